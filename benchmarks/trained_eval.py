"""Long evaluation of trained models, side by side: what each method's
attention costs on the activations a trained model makes, against ALiBi's.

    python benchmarks/trained_eval.py data-bin/embedded \
        -c alibi=outputs/compare-new-methods/seed1/alibi/checkpoint_last.pt \
        -c stickbreaking=outputs/compare-new-methods/seed1/stickbreaking/checkpoint_last.pt \
        -c path=outputs/compare-new-methods/seed1/path/checkpoint_last.pt --tokens 512 2048 8192 --repeats 3

Random inputs (``new_methods_cpu.py``) say what a kernel costs per pair; a
trained model decides how many pairs it scores: ALiBi's key windows skip the
keys its slopes cannot reach, and stick-breaking stops reading keys once every
query of a block has spent its stick.  Each checkpoint scores one sequence of
``--tokens`` tokens of the data's valid split (its documents end to end,
repeated where the split is shorter), batch 1, no grad, one thread, the
kernels the model picks, timed in CPU time of this process
(``time.process_time``: what else runs on the machine slows it less).  A
repeat runs every model once, in an order rotated from repeat to repeat,
after one warm-up forward each.  The table gives, per model, the median
seconds of the whole forward and of its attention calls alone
(``core.layer.attention``: the kernel and, for stick-breaking and PaTH,
their own terms and projections; not the q, k, v and output projections),
each over the first model's (name it ``alibi``), and the share of the
causal (query, key) pairs the attention scores over every layer (the
chunked kernel's key windows, ALiBi's and FoX's: ``kernels.keys_read``;
stick-breaking: the key blocks it computes; PaTH-FoX: all but the cached
keys its gate leaves out of a chunk's fused call; every other kernel: 1),
with the attention's time per pair scored over the first model's.  The models
should share their shape (layers, heads, widths) for the ratios to be the
methods' costs.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fused_loops_off, machine_description, median, replaced  # noqa: E402
from trained_windows import arguments, load_models, sequence  # noqa: E402

from fairseq_alibi.core import kernels as K  # noqa: E402
from fairseq_alibi.core import layer as core_layer  # noqa: E402
from fairseq_alibi.core import native  # noqa: E402
from fairseq_alibi.core import path  # noqa: E402
from fairseq_alibi.core import stickbreaking  # noqa: E402
from fairseq_alibi.errors import EvaluationError  # noqa: E402


@contextmanager
def recorded(record: dict):
    """Every attention call's seconds (``record["attention"]``), the causal
    pairs it could score (``record["pairs"]``, each query with the keys up to
    its own) and those it scores (``record["scored"]``): a ``chunked`` call's
    ``kernels.keys_read`` (ALiBi's windows, FoX's), stick-breaking's key
    blocks computed, every other call all of them less the cached keys
    PaTH-FoX's gate leaves out of a chunk's fused call (the eager path's, or the fused C++ call's count)."""
    real_attention, real_for, real_count = core_layer.attention, K.kernel_for, stickbreaking._count_scored
    real_forgotten, real_skipped = path._forgotten, path._count_skipped
    scored, skipped = [None], [0]  # this call's pairs scored, where a kernel counted them; pairs left out

    def attention(positions, kernel, q, k, *args, **kwargs):
        T, S = q.size(2), k.size(2)
        scored[0], skipped[0] = None, 0
        start = time.process_time()
        result = real_attention(positions, kernel, q, k, *args, **kwargs)
        record["attention"] += time.process_time() - start
        causal = q.size(0) * q.size(1) * (T * (S - T) + T * (T + 1) // 2)
        record["pairs"] += causal
        record["scored"] += (causal if scored[0] is None else min(scored[0], causal)) - skipped[0]
        return result

    def forgotten(state, flat, *rest):  # PaTH-FoX: the first cached keys left out of a chunk's fused call
        first = real_forgotten(state, flat, *rest)
        rows = int((flat[0, 0].abs().sum(-1) > 0).sum())  # the block padding past the input: zero queries
        skipped[0] += first * flat.size(0) * flat.size(1) * rows
        return first

    def count_skipped(pairs: int):  # PaTH-FoX: the same, counted by its fused C++ call
        skipped[0] += pairs

    def counting_for(name: str, bias):
        chosen = real_for(name, bias)

        def kernel(q, k, v, bias, key_padding_mask, *args, **kwargs):
            if name == "chunked" and key_padding_mask is None:
                T, S = q.size(2), k.size(2)
                share = K.keys_read(bias, q, k)
                scored[0] = (scored[0] or 0) + share * q.size(0) * q.size(1) * (T * (S - T) + T * (T + 1) // 2)
            return chosen(q, k, v, bias, key_padding_mask, *args, **kwargs)
        return kernel

    def count_scored(pairs: int):  # stick-breaking's pairs computed (its key blocks' whole)
        scored[0] = (scored[0] or 0) + pairs

    with replaced(real_attention, attention), replaced(real_for, counting_for), replaced(real_count, count_scored), \
            replaced(real_forgotten, forgotten), replaced(real_skipped, count_skipped):
        yield


def forward(model, tokens: torch.Tensor) -> dict:
    """One timed forward: ``{"whole", "attention", "scored", "pairs"}``."""
    record = {"attention": 0.0, "scored": 0, "pairs": 0}
    with torch.no_grad(), recorded(record):
        start = time.process_time()
        model(tokens)
        record["whole"] = time.process_time() - start
    return record


def measure(models, tokens: torch.Tensor, repeats: int, eager=()) -> dict:
    """Per model name: medians of the whole forward and the attention, and the share of pairs scored; the
    models named in ``eager`` run with the fused CPU loops switched off."""
    names = list(models)
    for name in names:
        with fused_loops_off(name in eager):
            forward(models[name], tokens[:, :64])  # warm-up
    runs = {name: [] for name in names}
    for r in range(repeats):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            with fused_loops_off(name in eager):
                runs[name].append(forward(models[name], tokens))
    return {name: {"whole": median([x["whole"] for x in rs]), "attention": median([x["attention"] for x in rs]),
                   "share": rs[0]["scored"] / rs[0]["pairs"] if rs[0]["pairs"] else 1.0}
            for name, rs in runs.items()}


def main(argv=None) -> int:
    def eager_option(p):
        p.add_argument("--eager", nargs="+", default=[], metavar="NAME",
                       help="models (by their -c NAME) run with the fused CPU loops switched off, the eager "
                            "PyTorch passes instead: name one checkpoint twice to time both paths side by side")

    args = arguments(__doc__, argv, "a causal language model's checkpoint (repeatable; the first is the reference: "
                     "ALiBi's)", [2048, 8192], "timed forwards of each model per length", eager_option)
    names = [spec.split("=", 1)[0] for spec in args.checkpoint]
    unknown = [name for name in args.eager if name not in names]
    if unknown:
        print(f"error: --eager names {', '.join(unknown)}, which no -c NAME=PATH gives; the models: "
              f"{', '.join(names)}", file=sys.stderr)
        return 1
    try:
        held = load_models(args)
    except EvaluationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    models = {name: h.model for name, h in held.items()}
    first = next(iter(models))
    print(f"host: {machine_description()}; fused CPU loops: {native.status()}"
          + (f" (switched off for {', '.join(args.eager)})" if args.eager else "") + "\n")
    print(f"| model | tokens | pairs scored | s, forward | / {first} | s, attention | / {first} "
          f"| attention per pair / {first}'s |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        rows = measure(models, sequence(args.data, tokens), args.repeats, args.eager)
        ref = rows[first]
        for name, row in rows.items():
            per_pair = (row["attention"] / row["share"]) / (ref["attention"] / ref["share"])
            print(f"| {name} | {tokens} | {row['share']:.3f} | {row['whole']:.3g} | {row['whole'] / ref['whole']:.2f} "
                  f"| {row['attention']:.3g} | {row['attention'] / ref['attention']:.2f} | {per_pair:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
