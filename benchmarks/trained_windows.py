"""Key windows on trained models: what a learned bias of the distance alone (T5's
buckets, Kerple, FIRE within its threshold) skips in long evaluation once it
has learned to look near (``kernels.distance_windows``), and what that saves.

    python benchmarks/trained_windows.py data-bin/retrieval-L128-c29-f0.25-adjacent \
        -c t5bias=outputs/fresh/s74/seed74/t5bias/checkpoint_last.pt \
        -c kerple=outputs/fresh/s74/seed74/kerple/checkpoint_last.pt --tokens 1024 8192 --repeats 3

Each checkpoint scores one sequence of ``--tokens`` tokens of the data's valid
split (its documents end to end, repeated where the split is shorter), batch 1,
no grad, one thread, the kernel the model picks (``auto``: the chunked kernel
past its threshold), twice per repeat: with the distance windows and without
(``distance_windows`` off), alternating which goes first, so that whatever
else runs on the machine slows both alike.  The table gives the share of
causal (query, key) pairs the chunked calls score (``kernels.keys_read``,
over every layer), the median seconds of each form and their ratio, and the
largest difference of the two forms' log-probabilities (the windows leave out
only keys that weigh less than a rounding unit, so it is at rounding level).
The initial weights of ``positions_cost.py`` skip nothing (T5's table starts
at zero, Kerple's decay is logarithmic); this is the trained model's cost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from argparse import Namespace
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, median  # noqa: E402

from fairseq_alibi.core import kernels as K  # noqa: E402
from fairseq_alibi.evaluation.backends import FairseqBackend  # noqa: E402
from fairseq_alibi.errors import EvaluationError  # noqa: E402


@contextmanager
def counted_pairs(shares: list):
    """Every chunked call records the share of causal pairs it scores."""
    chunked = K.KERNELS["chunked"]

    def counting(q, k, v, bias, key_padding_mask, dropout_p, *args, **kwargs):
        shares.append(K.keys_read(bias, q, k) if key_padding_mask is None and bias.causal else 1.0)
        return chunked(q, k, v, bias, key_padding_mask, dropout_p, *args, **kwargs)

    K.KERNELS["chunked"] = counting
    try:
        yield
    finally:
        K.KERNELS["chunked"] = chunked


@contextmanager
def without_windows():
    windows = K.distance_windows
    K.distance_windows = lambda *a, **kw: None
    try:
        yield
    finally:
        K.distance_windows = windows


def sequence(data: str, tokens: int) -> torch.Tensor:
    """``[1, tokens]``: the valid split's documents end to end (repeated as needed)."""
    from fairseq.data import data_utils

    split = data_utils.load_indexed_dataset(os.path.join(data, "valid"), None)
    pieces, total = [], 0
    while total < tokens:
        for i in range(len(split)):
            pieces.append(split[i].long())
            total += len(pieces[-1])
    return torch.cat(pieces)[:tokens][None]


def log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.get_normalized_probs(model(tokens), log_probs=True)


def measure(model, tokens: torch.Tensor, repeats: int) -> dict:
    log_probs(model, tokens[:, :64])  # warm-up
    shares, times = [], {"windows": [], "all keys": []}
    with counted_pairs(shares):
        with_windows = log_probs(model, tokens)
    every = []
    with without_windows(), counted_pairs(every):
        every_key = log_probs(model, tokens)
    for r in range(repeats):
        for form in (("windows", "all keys") if r % 2 == 0 else ("all keys", "windows")):
            start = time.perf_counter()
            if form == "windows":
                log_probs(model, tokens)
            else:
                with without_windows():
                    log_probs(model, tokens)
            times[form].append(time.perf_counter() - start)
    share = lambda s: sum(s) / len(s) if s else None  # None: no chunked call (a short input)
    return {"keys_read": share(shares), "keys_read_all": share(every),
            "seconds": {f: median(t) for f, t in times.items()},
            "max_diff": float((with_windows - every_key).abs().max())}


def arguments(doc: str, argv, checkpoint_help: str, tokens, repeats_help: str, extra=None) -> argparse.Namespace:
    """The command line these trained-model benchmarks share (``doc``: the script's docstring; ``extra``: a
    function that adds a script's own options to the parser)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(p)
    p.add_argument("data", help="the models' fairseq-preprocess directory (dict.txt, valid split)")
    p.add_argument("-c", "--checkpoint", action="append", required=True, metavar="NAME=PATH", help=checkpoint_help)
    p.add_argument("--tokens", type=int, nargs="+", default=tokens, help="sequence lengths to score")
    p.add_argument("--repeats", type=int, default=3, help=repeats_help)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.repeats < 1 or any(t < 2 for t in args.tokens) or args.threads < 1:
        p.error("--repeats and --threads must be at least 1 and every --tokens at least 2")
    torch.set_num_threads(args.threads)
    return args


def load_models(args) -> dict:
    """Each ``-c NAME=PATH`` checkpoint loaded for ``max(args.tokens)`` tokens, by name: the backend's loaded
    model (``.model``; a loaded model is freed with its holder, so the holders are what is kept).  Raises
    ``EvaluationError``."""
    backend = FairseqBackend(Namespace(data=args.data, cpu=True, checkpoint=args.checkpoint), subset="valid")
    return {name: backend.load(backend.describe(name, path), max(args.tokens)) for name, path in backend.specs(args)}


def main(argv=None) -> int:
    args = arguments(__doc__, argv, "a causal language model's checkpoint (repeatable)", [1024, 8192],
                     "timed forwards of each form per length")
    try:
        held = load_models(args)
    except EvaluationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    models = [(name, h.model) for name, h in held.items()]
    print(f"host: {machine_description()}\n")
    print("| model | tokens | keys read, windows | keys read, all | s, windows | s, all keys | windows / all "
          "| max diff of log-probs |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        text = sequence(args.data, tokens)
        for name, model in models:
            row = measure(model, text, args.repeats)
            share = lambda x: "- (not chunked)" if x is None else f"{x:.3f}"
            s = row["seconds"]
            print(f"| {name} | {tokens} | {share(row['keys_read'])} | {share(row['keys_read_all'])} "
                  f"| {s['windows']:.3f} | {s['all keys']:.3f} | {s['windows'] / s['all keys']:.2f} "
                  f"| {row['max_diff']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
