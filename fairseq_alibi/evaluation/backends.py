"""Backends of the evaluation runner: how to describe, load, encode and score a model.

A backend turns the tool's model arguments into models the measures can use:

* ``specs(args)``: the (name, source) pairs, checked;
* ``describe(name, source)``: a :class:`Described` -- the :class:`~.runner.ModelInfo`
  the grid is planned with and the model's text encoder -- reading each
  checkpoint once;
* ``load(described, max_length)``: an evaluation model, loaded once, that the
  runner puts under each method in turn (``use``) and the measures score with:
  ``answer_scores`` (retrieval: one teacher-forced forward per batch of
  equal-length sequences) and ``token_scores`` (perplexity: windows over the
  backend's evaluation text).

This module is the fairseq backend (checkpoints of ``transformer_lm_alibi``
and the stock ``transformer_lm``, data from a ``fairseq-preprocess``
directory); ``hf_backend.py`` is the Hugging Face one.  :func:`backend_for`
picks one from the arguments, or :class:`Both` for ``--checkpoint`` and
``--hf`` together: one grid, one table, the same text (a checkpoint beside its
export, ``docs/export.md``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, List, Optional, Sequence, Tuple

from ..core.scaling import Scaling
from ..errors import EvaluationError, plural
from .data_dir import check_data
from .prompts import Vocabulary
from .axes import check_checkpoint_paths, parse_named
from ..coverage import split_tokens
from .protocols import Described, ModelInfo, ScoredWindow, answer_result
from .store import file_identity


def backend_for(args, subset: Optional[str] = None):
    """The Hugging Face backend with ``--hf``, the fairseq one with ``--checkpoint``,
    :class:`Both` with both (``subset``: the split perplexity reads)."""
    if not args.hf:
        return FairseqBackend(args, subset)
    from .hf_backend import HFBackend

    if not args.checkpoint:
        return HFBackend(args, subset)
    if not args.data or not os.path.isdir(args.data):
        raise EvaluationError(f"--checkpoint with --hf: DATA must be the checkpoints' fairseq-preprocess directory "
                              f"(the --hf models read {'its split as text' if subset else 'their own tokenizer'}); "
                              f"{args.data} is not a directory")
    return Both(FairseqBackend(args, subset, beside_hf=True), HFBackend(args, subset, beside_checkpoints=True))


class Both:
    """Fairseq checkpoints and Hugging Face models in one grid: each model described,
    loaded and given its text by its own backend."""

    def __init__(self, *backends):
        self.backends = backends
        self.owner = {}
        self.data_identity = "|".join(b.data_identity for b in backends)

    def specs(self, args) -> List[Tuple[str, Tuple[Any, str]]]:
        pairs = [(name, (backend, source)) for backend in self.backends for name, source in backend.specs(args)]
        names = [name for name, _ in pairs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise EvaluationError(f"a checkpoint and a --hf model are both named {', '.join(twice)}: name them "
                                  "apart with NAME=...")
        return pairs

    def describe(self, name: str, spec) -> Described:
        backend, source = spec
        self.owner[name] = backend
        return backend.describe(name, source)

    def text_tokens(self, described: Described) -> int:
        return self.owner[described.info.name].text_tokens(described)

    def load(self, described: Described, max_length: int):
        return self.owner[described.info.name].load(described, max_length)


class Encoder:
    """Text -> dictionary ids, as the checkpoint reads text: word by word against the
    dictionary, or through its BPE / tokenizer (fairseq's ``encode_fn``) if it has one."""

    def __init__(self, dictionary, bpe=None, tokenizer=None):
        self.dictionary = dictionary
        self.bpe, self.tokenizer = bpe, tokenizer

    @property
    def subword(self) -> bool:
        return self.bpe is not None or self.tokenizer is not None

    def vocabulary(self) -> Vocabulary:
        if self.subword:
            return Vocabulary(None)
        d = self.dictionary
        return Vocabulary([d[i] for i in range(d.nspecial, len(d))])

    def words(self, words: Sequence[str]) -> List[int]:
        """Ids of words already spelled in the dictionary (a built-in task's),
        through the BPE / tokenizer where the checkpoint has one."""
        if self.subword:
            return self.encode(" ".join(words))
        return [self.dictionary.index(w) for w in words]

    def encode(self, text: str, where: str = "") -> List[int]:
        d = self.dictionary
        if self.subword:
            x = text
            if self.tokenizer is not None:
                x = self.tokenizer.encode(x)
            if self.bpe is not None:
                x = self.bpe.encode(x)
            ids = [d.index(t) for t in x.split()]
            if d.unk() in ids:
                raise EvaluationError(f"{where}the text {text[:60]!r} encodes to <unk> tokens with the checkpoint's BPE")
            return ids
        words = text.split()
        missing = sorted({w for w in words if d.index(w) == d.unk()})
        if missing:
            raise EvaluationError(
                f"{where}{len(missing)} {plural(len(missing), 'word')} not in the model's dictionary: "
                f"{', '.join(missing[:20])}; every "
                "word of a prompt and answer must be in the dictionary (none is replaced by <unk>): rewrite "
                "them with the model's own words"
            )
        return [d.index(w) for w in words]


class FairseqBackend:
    """Checkpoints of fairseq language models, evaluated on a ``fairseq-preprocess``
    directory (its dictionary; with ``subset``, that split's text for perplexity)."""

    def __init__(self, args, subset: Optional[str] = None, beside_hf: bool = False):
        given = getattr(args, "train_length", None) is not None or getattr(args, "dtype", None) is not None
        if given and not beside_hf:
            raise EvaluationError("--train-length and --dtype apply to --hf models only: a fairseq checkpoint "
                                  "records its training length and is evaluated in its own precision")
        if not args.data:
            raise EvaluationError("give the models' data directory (the fairseq-preprocess output with their "
                                  "dict.txt), or --hf MODEL")
        self.data, self.subset, self.cpu = args.data, subset, args.cpu
        self._text_tokens: Optional[int] = None
        from .. import models  # noqa: F401  (registered, and fairseq patched before its first import: 1-3 s a start)

        check_data(self.data, subset)
        names = ["dict.txt"] + ([f"{subset}.bin", f"{subset}.idx"] if subset else [])
        self.data_identity = ";".join([os.path.abspath(self.data)] + [
            f"{n}={file_identity(os.path.join(self.data, n))}" for n in names])

    def text_tokens(self, described: Described) -> int:
        """Tokens of the evaluated split: the longest window it can fill."""
        if self._text_tokens is None:
            from fairseq.data import data_utils

            dataset = data_utils.load_indexed_dataset(os.path.join(self.data, self.subset), None)
            self._text_tokens = int(dataset.sizes.sum())
        return self._text_tokens

    def specs(self, args) -> List[Tuple[str, str]]:
        """``[NAME=]PATH`` of existing files (a bare path is named after its directory)."""
        pairs = parse_named(
            args.checkpoint,
            lambda p: os.path.basename(os.path.dirname(os.path.abspath(p))) or os.path.basename(p),
            "checkpoints",
        )
        if not pairs:
            raise EvaluationError("no checkpoints given: add --checkpoint [NAME=]PATH")
        check_checkpoint_paths(pairs)
        return pairs

    def describe(self, name: str, path: str) -> Described:
        """Read the checkpoint (once: its state is kept for ``load``); refuse
        anything but a causal language model."""
        import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
        from fairseq import checkpoint_utils, tasks

        from .. import facts

        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        state.pop("last_optimizer_state", None)  # kept until load: Adam's moments would triple its memory
        model_cfg, task_cfg = facts.checkpoint_sections(state)
        if not model_cfg:
            raise EvaluationError(f"{path} has no model configuration: not a fairseq checkpoint")
        arch = facts.checkpoint_arch(model_cfg) or "?"
        family = facts.model_family(arch) or arch
        task = task_cfg.get("_name") or task_cfg.get("task")
        if family not in facts.language_models() or task not in (None, "language_modeling"):
            raise EvaluationError(
                f"{name}: {path} is a {family} checkpoint (arch {arch}, task {task or '?'}); this tool "
                f"evaluates causal language models ({', '.join(facts.language_models())}, task language_modeling)"
            )
        info = ModelInfo(name, path, family, arch, facts.position_of(family),
                         facts.checkpoint_train_length(model_cfg, task_cfg),
                         f"{os.path.abspath(path)}:{file_identity(path)}",
                         " (the checkpoint records no training length: no alibi_train_length or tokens_per_sample)")
        cfg = eval_lm_config(self.data, path, 64, {}, cpu=True)
        lm_task = tasks.setup_task(cfg.task)
        saved = state.get("cfg") or {}
        bpe_cfg, tok_cfg = (saved.get(k) if hasattr(saved, "get") else None for k in ("bpe", "tokenizer"))
        bpe = lm_task.build_bpe(bpe_cfg) if bpe_cfg is not None and bpe_cfg.get("_name") else None
        tokenizer = lm_task.build_tokenizer(tok_cfg) if tok_cfg is not None and tok_cfg.get("_name") else None
        return Described(info, Encoder(lm_task.source_dictionary, bpe, tokenizer), state)

    def load(self, described: Described, max_length: int) -> "FairseqModel":
        return FairseqModel(self, described, max_length)


class FairseqModel:
    """One checkpoint, loaded once with fairseq's own loader (as ``fairseq-eval-lm``
    with ``--tokens-per-sample max_length`` would), in eval mode."""

    def __init__(self, backend: FairseqBackend, described: Described, max_length: int):
        import torch
        from fairseq import checkpoint_utils, tasks

        self.backend, self.info = backend, described.info
        # A sinusoidal model would silently skip every window longer than it was trained on.
        self.overrides = {} if self.info.position else {"max_target_positions": max_length,
                                                     "tokens_per_sample": max_length}
        self.cfg = eval_lm_config(backend.data, self.info.path, max_length, self.overrides,
                                  subset=backend.subset or "valid", cpu=backend.cpu)
        state, described.source = described.source, None  # the model takes the weights; free the state after
        if self.overrides:
            checkpoint_utils.overwrite_args_by_name(state["cfg"], self.overrides)
        self.task = tasks.setup_task(self.cfg.task)
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task([self.info.path], task=self.task, state=state)
        self.model = models[0]
        self.use_cuda = torch.cuda.is_available() and not self.cfg.common.cpu
        if self.use_cuda:
            self.model.cuda()
        self.model.prepare_for_inference_(self.cfg)
        self.model.eval()
        self.method = Scaling()

    def use(self, method: Scaling) -> None:
        """Evaluate under ``method`` (complete: the runner's ``methods_for``) from
        now on: the ALiBi biases rescaled in place (the same numbers as loading
        with the method's ``--model-overrides``)."""
        from ..models.attention import rescale

        if self.info.position:
            rescale(self.model, method)
        elif method.method != "none":
            raise EvaluationError(f"{self.info.name}: context-extension methods do not apply to sinusoidal models")
        self.method = method

    def close(self) -> None:
        self.model = None

    def effective_factor(self, length: int) -> float:
        return self.method.factor_at(length)

    def answer_scores(self, batch: Sequence[Tuple[List[int], List[int]]]) -> List[Tuple[bool, float, List[int]]]:
        """(greedy exact match, mean answer log-prob, greedy ids) of equal-length
        (prompt, answer) pairs from one forward, fed as fairseq's LM inference feeds
        them (``task.build_dataset_for_inference``: eos prepended, nothing appended)."""
        import torch
        from fairseq import utils

        tokens = [torch.tensor(p + a[:-1], dtype=torch.long) for p, a in batch]
        dataset = self.task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
        src = dataset.collater([dataset[i] for i in range(len(tokens))])["net_input"]["src_tokens"]
        if self.use_cuda:
            src = utils.move_to_cuda(src)
        n_prompt, n_answer = len(batch[0][0]), len(batch[0][1])
        # The prepended token shifts the input by one: position len(prompt) + k predicts answer token k.
        positions = torch.arange(n_prompt, n_prompt + n_answer, device=src.device)
        with torch.no_grad():
            features, extra = self.model.decoder.extract_features(src, None)
            # the model's own normalization: an adaptive softmax's output layer hands the features
            # back, and its log-probs come from the adaptive softmax (a log_softmax of them was one
            # over the hidden dimensions)
            output = self.model.decoder.output_layer(features[:, positions, :])
            logprobs = self.model.get_normalized_probs((output, extra), log_probs=True).float()
        return [answer_result(logprobs[b], answer) for b, (_, answer) in enumerate(batch)]

    def windows(self, length: int, stride: int, max_tokens: Optional[int] = None, batch_size: Optional[int] = None):
        """(tokens to score, iterator of :class:`ScoredWindow`) over the subset, window
        by window in fairseq's batching order (a window's index: its dataset id),
        exactly as ``fairseq-eval-lm --tokens-per-sample length --context-window
        (length - stride)`` scores them (``+inf``/``-inf``/NaN scores included: the
        measure decides)."""
        from fairseq import tasks

        cfg = eval_lm_config(*self._eval_lm_args(length, stride, max_tokens, batch_size))
        task = tasks.setup_task(cfg.task)
        task.load_dataset(self.backend.subset)
        dataset = task.dataset(self.backend.subset)
        skip_bos = getattr(cfg.task, "add_bos_token", False)
        windows = scored_windows(self.model, self.use_cuda, cfg, task, dataset, length - stride, skip_bos)
        return split_tokens(dataset), windows

    def _eval_lm_args(self, length, stride, max_tokens, batch_size) -> tuple:
        overrides = self.method.config_values() if self.info.position else self.overrides
        b = self.backend
        return (b.data, self.info.path, length, overrides, length - stride, b.subset, max_tokens, batch_size, b.cpu)

    def command(self, length: int, stride: int, max_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> str:
        """The equivalent ``fairseq-eval-lm`` command line (for the record)."""
        argv = eval_lm_argv(*self._eval_lm_args(length, stride, max_tokens, batch_size))
        parts = ["fairseq-eval-lm", argv[0], '--user-dir "$(alibi-user-dir)"'] + argv[1:-2]
        return " ".join(parts + ["--model-overrides", f'"{argv[-1]}"'])


def scored_windows(model, use_cuda: bool, cfg, task, dataset, context: int, skip_bos: bool):
    """A :class:`ScoredWindow` of each window of fairseq's eval-lm dataloader,
    scored by its ``SequenceScorer`` (the window's index: its id in the dataset)."""
    import torch
    from fairseq import utils
    from fairseq.sequence_scorer import SequenceScorer

    itr = task.eval_lm_dataloader(
        dataset=dataset, max_tokens=cfg.dataset.max_tokens or 36000, batch_size=cfg.dataset.batch_size,
        max_positions=utils.resolve_max_positions(model.max_positions()), num_shards=1, shard_id=0,
        num_workers=0, data_buffer_size=cfg.dataset.data_buffer_size, context_window=context,
    )
    scorer = SequenceScorer(task.target_dictionary, cfg.eval_lm.softmax_batch)
    for sample in itr:
        if "net_input" not in sample:
            continue
        if use_cuda:
            sample = utils.move_to_cuda(sample)
        starts = sample.get("start_indices") or [0] * sample["target"].size(0)
        for i, hypos in enumerate(scorer.generate([model], sample)):
            scores, targets = hypos[0]["positional_scores"].float().cpu(), hypos[0]["tokens"].cpu()
            offset = int(starts[i])
            if skip_bos:
                scores, targets, offset = scores[1:], targets[1:], offset + 1
            yield ScoredWindow(int(sample["id"][i]), scores, torch.arange(offset, offset + scores.numel()), targets)


# ------------------------------------------------------------------ fairseq-eval-lm


def eval_lm_argv(data, path, length, overrides, context=0, subset="valid", max_tokens=None,
                 batch_size=None, cpu=False) -> List[str]:
    """The ``fairseq-eval-lm`` arguments of one evaluation (the one place they are spelled)."""
    argv = [data, "--path", path, "--gen-subset", subset or "valid", "--tokens-per-sample", str(length)]
    if context:
        argv += ["--context-window", str(context)]
    if max_tokens:
        argv += ["--max-tokens", str(max_tokens)]
    if batch_size:
        argv += ["--batch-size", str(batch_size)]
    if cpu:
        argv += ["--cpu"]
    return argv + ["--model-overrides", repr(overrides)]


def eval_lm_config(data, path, length, overrides, context=0, subset="valid", max_tokens=None,
                   batch_size=None, cpu=False):
    """The config ``fairseq-eval-lm`` builds from that command line (a fresh copy).

    Composing one runs fairseq's argparse and hydra (about 0.8 s), and a sweep
    needs one per cell; so the command line without its per-cell values (the
    checkpoint, the length, the overrides, the context) is composed once per
    process and those four fields are set on a copy: the values the command
    line would give them (tests/test_sweep.py compares the two whole)."""
    import copy

    template = _eval_lm_template(str(data), subset or "valid", max_tokens, batch_size, bool(cpu))
    cfg = copy.deepcopy(template)
    cfg.common_eval.path = str(path)
    cfg.common_eval.model_overrides = repr(overrides)
    cfg.eval_lm.context_window = int(context)
    # what fairseq_cli.eval_lm.main does before building the task
    cfg.task.tokens_per_sample = int(length) - int(context) if context > 0 else int(length)
    return cfg


def composed_eval_lm_config(argv: Sequence[str]):
    """The config of ``fairseq-eval-lm argv``, composed by fairseq's argparse and hydra."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_eval_lm_parser(), list(argv) + ["--num-workers", "0"])
    return convert_namespace_to_omegaconf(args)


@functools.lru_cache(maxsize=16)
def _eval_lm_template(data, subset, max_tokens, batch_size, cpu):
    return composed_eval_lm_config(eval_lm_argv(data, "checkpoint.pt", 64, {}, 0, subset, max_tokens, batch_size, cpu))
