"""Which heads find a record's own key, and which read the queried record:
the two steps a model needs for ``lines``, measured in any position family.

``lines`` asks for the number of the record ``line KEY : REGISTER_CONTENT is
N .`` (``line KEY N .`` with ``--layout adjacent``) whose KEY the question
repeats.  A two-layer model can answer by
(1) carrying each record's KEY to the record's later tokens (a head that
attends from ``:``, ``REGISTER_CONTENT``, ``is``, the digits and ``.`` to the
key of its own line, 1 to 8 tokens back, and not to the other lines' keys),
then (2) attending from the question's last token to the record whose carried
key matches.  Step (1) needs "the nearest key before me": content (a key
token) and recency together, which a bias that falls with distance gives
every head from the start.

For each model (any ``transformer_lm_<method>``: the weights come from the
model's own attention, its reference kernel), over ``lines`` prompts of
``--length`` tokens built as ``alibi-retrieval`` builds them, printed per
layer: the head with the most mass on the own key (step 1: mean over every
record token after the key, of the weight on that line's key), its mass on
the other lines' keys, the head with the most mass on the queried record
from the answer's position (step 2), the head with the most mass on the token
just before (a previous-token head: from every record token two or more after
its key, so that the token before is never the key; the step that copying a
number's later digits needs, and that a key right before the number would
make enough for step 1), and the share of prompts whose whole answer the
model predicts (teacher-forced greedy).

    python examples/retrieval/key_heads.py DATA -c alibi=CKPT -c rotary=CKPT --length 128
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from corpus import LAYOUTS, lines_task  # (this directory: the script's own)


def record_spans(meta: Dict, header: int, line_len: int) -> List[Tuple[int, int]]:
    """``(key position, end)`` of each record in the prompt (positions in the
    prompt's words; the key is a record's second word)."""
    return [(header + i * line_len + 1, header + (i + 1) * line_len) for i in range(meta["lines"])]


def own_key_mass(weights: torch.Tensor, spans: List[Tuple[int, int]], shift: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(own, other)`` float ``[H]``: from every record token after its key,
    the mean weight on its own line's key and the mean summed weight on the
    other lines' keys.  ``weights`` ``[H, T, S]`` of one prompt; ``shift``:
    input positions before the prompt's first word (the prepended eos)."""
    keys = torch.tensor([k + shift for k, _ in spans])
    own, other, count = 0.0, 0.0, 0
    for key, end in spans:
        rows = weights[:, key + shift + 1:end + shift]  # [H, r, S]
        at_keys = rows[..., keys].sum(-1)
        mine = rows[..., key + shift]
        own, other, count = own + mine.sum(-1), other + (at_keys - mine).sum(-1), count + rows.size(1)
    return own / count, other / count


def previous_token_mass(weights: torch.Tensor, spans: List[Tuple[int, int]], shift: int) -> torch.Tensor:
    """float ``[H]``: from every record token two or more after its key, the
    mean weight on the token just before it (never the key).  ``weights``
    ``[H, T, S]`` of one prompt; ``shift`` as in :func:`own_key_mass`."""
    rows = torch.cat([torch.arange(key + 2, end) for key, end in spans]) + shift
    return weights[:, rows, rows - 1].mean(-1)


def analyse(model, dictionary, task, length: int, samples: int, seed: int) -> Dict[str, torch.Tensor]:
    """The per-(layer, head) masses and the answer accuracy of one model."""
    layers = model.decoder.layers
    captured: Dict[int, torch.Tensor] = {}

    def ask(_module, args, kwargs):
        kwargs = dict(kwargs, need_weights=True, need_head_weights=True)
        return args, kwargs

    def keep(index):
        def fn(_module, _args, output):
            captured[index] = output[1][:, 0].float()  # [H, T, S]
        return fn

    handles = [h for i, layer in enumerate(layers) for h in (
        layer.self_attn.register_forward_pre_hook(ask, with_kwargs=True),
        layer.self_attn.register_forward_hook(keep(i)))]
    heads = layers[0].self_attn.num_heads
    own = torch.zeros(len(layers), heads)
    other, record, previous = torch.zeros_like(own), torch.zeros_like(own), torch.zeros_like(own)
    correct = 0
    header = len(task.words["header"])
    try:
        for s in range(samples):
            rng = random.Random(f"{seed}:heads:{length}:{s}")  # heads.py's prompts (its mass is step 2's)
            prompt = task.build(length, rng.randrange(5), 5, rng)
            words = prompt.prompt + prompt.answer[:-1]
            tokens = torch.tensor([[dictionary.eos()] + [dictionary.index(w) for w in words]])
            with torch.no_grad():
                logits, _ = model(tokens)
            answer = torch.tensor([dictionary.index(w) for w in prompt.answer])
            at = len(prompt.prompt)  # input position (after the eos) predicting the answer's first word
            correct += bool((logits[0, at:at + len(answer)].argmax(-1) == answer).all())
            line_len = len(task.record("k", prompt.answer))
            spans = record_spans(prompt.meta, header, line_len)
            needle = 1 + prompt.meta["needle_offset"]
            for li in range(len(layers)):
                mine, others = own_key_mass(captured[li], spans, shift=1)
                own[li] += mine / samples
                other[li] += others / samples
                record[li] += captured[li][:, at, needle:needle + line_len].sum(-1) / samples
                previous[li] += previous_token_mass(captured[li], spans, shift=1) / samples
    finally:
        for h in handles:
            h.remove()
    return {"own": own, "other": other, "record": record, "previous": previous,
            "accuracy": torch.tensor(correct / samples)}


def named_checkpoints(parser: argparse.ArgumentParser, items: List[str], flag: str = "--checkpoint"
                      ) -> List[Tuple[str, str]]:
    """The ``-c NAME=PATH`` items (of option ``flag``) as ``(name, path)``; a
    malformed one or a name given twice is a usage error."""
    pairs: List[Tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"{flag} {item!r} is not NAME=PATH")
        if name in dict(pairs):
            parser.error(f"{flag}: the name {name!r} is given twice; give each its own name")
        pairs.append((name, path))
    return pairs


def inputs_ok(data: str, paths: Sequence[str]) -> bool:
    """Whether the DATA directory (``evaluation.data_dir.check_data``) and
    every checkpoint path are there, checked before anything is printed;
    False after one ``error:`` line naming the first that is not.  The
    analysis scripts' one check of their inputs (heads.py, token_losses.py
    and this one)."""
    from fairseq_alibi.errors import EvaluationError
    from fairseq_alibi.evaluation.data_dir import check_data

    try:
        check_data(data)
    except EvaluationError as e:
        print(f"error: {e}", file=sys.stderr)
        return False
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
        print(f"error: checkpoint not found: {missing[0]}", file=sys.stderr)
    return not missing


def load_model(name: str, path: str, data: str, overrides: Optional[dict] = None):
    """The model of checkpoint ``path`` in eval mode, with ``data``'s
    dictionary (and the config ``overrides``); None after one ``error:`` line
    when it cannot be loaded."""
    import fairseq_alibi.models  # noqa: F401  (registers the models)
    from fairseq import checkpoint_utils

    try:
        models, _ = checkpoint_utils.load_model_ensemble([path], arg_overrides={**(overrides or {}), "data": data})
    except (OSError, KeyError, RuntimeError) as e:
        print(f"error: cannot load {name}={path}: {e}", file=sys.stderr)
        return None
    return models[0].eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="the binarized retrieval corpus (its dict.txt)")
    p.add_argument("-c", "--checkpoint", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--length", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--samples", type=int, default=20, help="prompts (default 20)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--layout", choices=tuple(LAYOUTS), default="record",
                   help="the corpus's record layout (corpus.py --layout; default record)")
    args = p.parse_args(argv)
    for name in ("digits", "length", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    pairs = named_checkpoints(p, args.checkpoint)
    if not inputs_ok(args.data, [path for _, path in pairs]):
        return 1

    from fairseq_alibi.errors import PromptError
    from fairseq_alibi.evaluation import prompts as P

    print(f"`lines` at {args.length} tokens, {args.samples} prompts: per layer, the head with the most mass "
          "on its record's own key (step 1) and the head with the most mass on the queried record from "
          "the answer's position (step 2), and the head with the most mass on the token before "
          "(a previous-token head)\n")
    print("| model | layer | own key: head, mass | that head on the other keys | queried record: head, mass "
          "| previous token: head, mass | answers right |")
    print("|---|---|---|---|---|---|---|")
    for name, path in pairs:
        model = load_model(name, path, args.data)
        if model is None:
            return 1
        d = model.decoder.dictionary
        try:
            task = lines_task(P.Vocabulary([d[i] for i in range(d.nspecial, len(d))]), args.digits, args.layout)
        except PromptError as e:  # most often a corpus of the other layout: its template's words are not in DATA
            other = next(layout for layout in LAYOUTS if layout != args.layout)
            print(f"error: {name}: {e}; give the --layout of the corpus the model was trained on "
                  f"(now {args.layout}; e.g. --layout {other})", file=sys.stderr)
            return 1
        r = analyse(model, d, task, args.length, args.samples, args.seed)
        for li in range(r["own"].size(0)):
            h = int(r["own"][li].argmax())
            g = int(r["record"][li].argmax())
            b = int(r["previous"][li].argmax())
            accuracy = f"{100 * float(r['accuracy']):.0f}%" if li == 0 else ""
            print(f"| {name if li == 0 else ''} | {li + 1} | {h + 1}: {r['own'][li, h]:.2f} | "
                  f"{r['other'][li, h]:.2f} | {g + 1}: {r['record'][li, g]:.2f} | "
                  f"{b + 1}: {r['previous'][li, b]:.2f} | {accuracy} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
