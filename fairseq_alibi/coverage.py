"""Whether an evaluation scored the whole split: the one check every
perplexity this package prints or stores passes first.

fairseq's ``eval_lm`` scores what its data loader yields, and the loader
drops, without a word, every block longer than the model's positions (a
sinusoidal model trained at 32 tokens evaluated at 128 keeps only a short last
block).  A perplexity over such a part of the split is not the split's
perplexity: it is refused in one line that says how much was scored, why the
rest was not, and what to give instead (:func:`coverage_problem`).  Refusing
rather than labelling a partial result: a number over another set of tokens
is not comparable with any other cell or paper, and each cause has a remedy
that scores everything.  Tokens scored +-inf are the one exception, kept as
fairseq keeps them: they are scored (a probability of 0 or an overflow),
left out of the average as ``fairseq-eval-lm`` and ``alibi-sweep`` leave them
out, and counted in a warning.

The split's tokens are counted as fairseq's dataset holds them
(:func:`split_tokens`: every block's targets, less the one ``bos`` per block
that ``--add-bos-token`` prepends and nobody scores); the scored ones by a
:class:`Tally` of what the scorer returned.  ``alibi-eval-lm`` and
``fairseq-eval-lm --user-dir`` check through ``patches.guarded_eval_lm``;
``alibi-sweep`` through ``evaluation/perplexity.py``, which scores windows
itself (it raises a sinusoidal model's position table to the evaluated
length first, ``backends.FairseqModel``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, List, Optional

#: The datasets (with the model's position limit) fairseq's eval-lm loader was
#: built over in this thread, newest last (:func:`recorded_loaders`).
_LOADERS = threading.local()


def split_tokens(dataset) -> int:
    """The tokens of an eval-lm split as fairseq's dataset holds them: the sum
    of its blocks' sizes, each token one target.  ``--add-bos-token`` adds a
    ``bos`` to each block outside its size, and fairseq's ``eval_lm`` leaves
    that one unscored, so the count is the same with it."""
    sizes = getattr(dataset, "sizes", None)
    return int(sizes.sum()) if sizes is not None else sum(int(dataset.size(i)) for i in range(len(dataset)))


def blocks_over(dataset, limit: Optional[int]) -> int:
    """How many blocks of ``dataset`` are longer than ``limit`` positions (the
    ones fairseq's loader drops)."""
    if limit is None:
        return 0
    sizes = getattr(dataset, "sizes", None)
    if sizes is None:
        sizes = [dataset.size(i) for i in range(len(dataset))]
    return sum(1 for size in sizes if int(size) > limit)


class Tally:
    """Counts what a scorer returned: ``scored``, every target score (the
    coverage), and ``infinite``, the +-inf ones fairseq's ``eval_lm`` leaves
    out of its average."""

    def __init__(self, skip_bos: bool = False):
        self.skip_bos, self.scored, self.infinite = skip_bos, 0, 0

    def add(self, positional_scores) -> None:
        scores = positional_scores[1:] if self.skip_bos else positional_scores
        self.infinite += int(scores.isinf().sum())
        self.scored += int(scores.numel())


def coverage_problem(scored: int, expected: int, subset: str, blocks: int = 0, skipped_blocks: int = 0,
                     limit: Optional[int] = None, remedy: str = "") -> Optional[str]:
    """None if ``scored`` is every one of the ``expected`` tokens of ``subset``;
    else the one line that refuses the result: how much was scored, why not the
    rest (``skipped_blocks`` of ``blocks`` longer than ``limit`` positions),
    and ``remedy``."""
    if scored == expected:
        return None
    why = (f"{skipped_blocks:,} of {blocks:,} blocks are longer than the model's {limit:,} positions and were skipped"
           if skipped_blocks else "fairseq's loader or scorer left the rest out")
    return (f"only {scored:,} of the {expected:,} tokens of {subset} were scored ({why}); a perplexity over part of "
            f"a split is not printed" + (f": {remedy}" if remedy else ""))


def longer_than_text(lengths: List[int], available: int, text: str, what: str = "evaluation length",
                     flag: str = "--lengths") -> Optional[str]:
    """None if no length of ``lengths`` (``what``, given with ``flag``) exceeds
    the ``available`` tokens of the evaluated ``text``; else the one line that
    refuses them: a window longer than the text would be the whole text, a
    shorter window scored under that length's name.  ``alibi-sweep`` checks its
    lengths with it, ``alibi-eval-lm`` its ``--tokens-per-sample``
    (:func:`check_block_length`)."""
    over = [int(n) for n in lengths if n > available]
    if not over:
        return None
    several = len(over) > 1
    return (f"{what}{'s' if several and not what.startswith('-') else ''} {', '.join(map(str, over))} "
            f"{'exceed' if several else 'exceeds'} the {available:,} tokens of the evaluated text ({text}): a window "
            f"cannot be longer than the text, so the result would be a shorter window's under "
            f"{'those lengths' if several else 'that length'}; give {flag} up to {available}, or evaluate a "
            "longer split")


def check_block_length(dataset, task_cfg, subset: str) -> None:
    """``fairseq-eval-lm``'s blocks of ``--tokens-per-sample`` tokens
    (``--sample-break-mode none``) fit in split ``subset``: a ``UserError``
    (:func:`longer_than_text`) where one block would be the whole split, shorter,
    as ``alibi-sweep`` refuses such a length.  Other break modes make a block of
    each line or sentence, ``--tokens-per-sample`` only their limit."""
    from .errors import UserError

    length = getattr(task_cfg, "tokens_per_sample", None)
    if getattr(task_cfg, "sample_break_mode", "none") not in ("none", None) or not isinstance(length, int):
        return
    problem = longer_than_text([length], split_tokens(dataset), subset, "--tokens-per-sample", "--tokens-per-sample")
    if problem:
        raise UserError(problem)


def position_limit_remedy(model, length: int) -> str:
    """What to give so that a model with a position table scores blocks of
    ``length`` tokens: a sinusoidal table is computed, so raising
    ``max_target_positions`` works (``alibi-sweep`` does that itself); a learned
    table has as many rows as it was trained with."""
    limit = _max_positions(model)
    shorter = f"give --tokens-per-sample {limit} or less" if limit else "give a shorter --tokens-per-sample"
    embed = getattr(getattr(model, "decoder", None), "embed_positions", None)
    if embed is not None and type(embed).__name__ == "SinusoidalPositionalEmbedding":
        return (f"{shorter}, or raise the sinusoidal table with --model-overrides "
                f"\"{{'max_target_positions': {length}}}\" (alibi-sweep raises it itself)")
    if embed is not None:
        return f"{shorter} (the model's learned position table has {limit} rows)"
    return shorter


def _max_positions(model) -> Optional[int]:
    try:
        limit = model.max_positions()
    except (AttributeError, NotImplementedError):
        return None
    if isinstance(limit, tuple):
        limit = min((x for x in limit if x is not None), default=None)
    return int(limit) if isinstance(limit, (int, float)) else None


@contextlib.contextmanager
def recorded_loaders(subset: str, check: Optional[Callable[[Any], None]] = None):
    """While the block runs (fairseq-eval-lm's ``main`` over split ``subset``),
    every eval-lm loader fairseq builds (each task's ``eval_lm_dataloader``)
    records ``(dataset, max_positions, context_window)`` in :func:`loaders`, so
    the split can be counted after scoring; ``check(dataset)`` runs first
    (before anything is scored: :func:`check_block_length`)."""
    from fairseq.tasks import TASK_REGISTRY

    _LOADERS.found, _LOADERS.subset = [], str(subset)
    owners = {cls for cls in TASK_REGISTRY.values() if "eval_lm_dataloader" in vars(cls)}  # each task its own
    stock = {cls: vars(cls)["eval_lm_dataloader"] for cls in owners}

    def recording(method):
        def eval_lm_dataloader(self, dataset, *args, **kwargs):
            limit = kwargs.get("max_positions", args[2] if len(args) > 2 else None)
            if check is not None:
                check(dataset)
            _LOADERS.found.append((dataset, limit, int(kwargs.get("context_window") or 0)))
            return method(self, dataset, *args, **kwargs)

        return eval_lm_dataloader

    for cls in owners:
        cls.eval_lm_dataloader = recording(stock[cls])
    try:
        yield
    finally:
        for cls in owners:
            cls.eval_lm_dataloader = stock[cls]


def loaders() -> List[Any]:
    """``(dataset, max_positions, context_window)`` of the loaders recorded in this thread (:func:`recorded_loaders`)."""
    return list(getattr(_LOADERS, "found", []))


@contextlib.contextmanager
def tallied_scorer(module, tally: Tally):
    """While the block runs, the ``SequenceScorer`` that ``module`` (fairseq's
    ``fairseq_cli.eval_lm``) builds adds every hypothesis it returns to ``tally``."""
    stock = module.SequenceScorer

    class SequenceScorer(stock):
        def generate(self, models, sample, **kwargs):
            hypos = super().generate(models, sample, **kwargs)
            for hypo in hypos:
                tally.add(hypo[0]["positional_scores"])
            return hypos

    module.SequenceScorer = SequenceScorer
    try:
        yield
    finally:
        module.SequenceScorer = stock


def check_eval_lm(models, tally: Tally) -> None:
    """After fairseq's ``eval_lm``: a ``UserError`` (one line) unless the scorer
    returned a score for every token of the split the loader was built over
    (the newest recorded loader); +-inf scores counted in a warning."""
    from .errors import UserError, warn_once

    found = loaders()
    if not found:
        return  # eval_lm called without fairseq's loader: nothing to count against
    dataset, limit, context = found[-1]
    expected = split_tokens(dataset)
    limit = _max_positions(models[0]) if limit is None and models else limit
    limit = min(x for x in limit if x is not None) if isinstance(limit, tuple) else limit
    sizes = getattr(dataset, "sizes", None)
    longest = max((int(size) for size in sizes), default=0) if sizes is not None else 0
    skipped = blocks_over(dataset, limit)
    # a window holds its block and up to context_window tokens before it: the length a table must reach
    remedy = position_limit_remedy(models[0], longest + context) if skipped and models else ""
    subset = getattr(_LOADERS, "subset", "the split")
    problem = coverage_problem(tally.scored, expected, subset, len(dataset), skipped, limit, remedy)
    if problem:
        raise UserError(problem)
    if tally.infinite:
        warn_once(f"{tally.infinite:,} of the {expected:,} tokens of {subset} scored +-inf (probability 0, or an "
                  "overflow) and are left out of the perplexity, as fairseq-eval-lm leaves them out")
