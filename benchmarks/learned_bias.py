"""The learned Toeplitz biases' own cost: building the causal ``[H, T, T]`` bias
and its backward pass, one value per distance (``bias.toeplitz_block``, what
the models run) against one per (query, key) pair (the form before it).

    python benchmarks/learned_bias.py                        # T = 512 .. 4096, T5 and Kerple
    python benchmarks/learned_bias.py --lengths 1024 --repeats 9 --json out.json

The two forms alternate in every repeat (A B, then B A, ...), so that whatever
else runs on the machine slows both alike; the table gives median seconds and
the ratio of medians.  One thread (``--threads``).  This is the bias alone,
computed once per forward pass and shared by the stack's layers: the attention
kernel's own cost is ``positions_cost.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, median  # noqa: E402

from fairseq_alibi.core import positions as P  # noqa: E402
from fairseq_alibi.core.alibi import positions as grid  # noqa: E402
from fairseq_alibi.core.scaling import Scaling  # noqa: E402

METHODS = ("t5bias", "kerple")


def pairwise(stack, length: int) -> torch.Tensor:
    """The bias of every (query, key) pair, as ``ModuleBias.block`` computed it before."""
    query, key = (p.long() for p in grid(length, length, 0, "cpu"))
    return stack.method.values(query, key).float().masked_fill(key > query, float("-inf"))


def toeplitz(stack, length: int) -> torch.Tensor:
    return stack.block(0, length, length, torch.float32, "cpu")


def seconds(build, stack, length: int, weight: torch.Tensor) -> float:
    """Forward and backward of one bias (the weight: a stand-in score gradient)."""
    start = time.perf_counter()
    bias = build(stack, length)
    bias.backward(weight)
    return time.perf_counter() - start


def measure(method: str, length: int, heads: int, repeats: int) -> dict:
    entry = P.position(method)
    stack = P.build(method, heads, 64, {p.name: p.default for p in entry.params}, Scaling("none", train_length=length))
    weight = torch.randn(heads, length, length).tril()
    times = {"pairwise": [], "toeplitz": []}
    order = list(times)
    seconds(toeplitz, stack, length, weight)  # warm-up of both
    seconds(pairwise, stack, length, weight)
    for r in range(repeats):
        for form in order if r % 2 == 0 else order[::-1]:
            times[form].append(seconds(toeplitz if form == "toeplitz" else pairwise, stack, length, weight))
    row = {"method": method, "length": length, "heads": heads, "repeats": repeats}
    row.update({f"{form}_s": median(values) for form, values in times.items()})
    row["ratio"] = row["toeplitz_s"] / row["pairwise_s"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the rows here too")
    opts = p.parse_args(argv)
    if any(n < 1 for n in opts.lengths) or opts.heads < 1 or opts.repeats < 1 or opts.threads < 1:
        p.error("--lengths, --heads, --repeats and --threads must be positive integers")
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    rows = [measure(m, n, opts.heads, opts.repeats) for m in opts.methods for n in opts.lengths]
    print(f"{machine_description()}; {opts.threads} thread(s), {opts.heads} heads, median of {opts.repeats}")
    print("| method | T | pairwise s | per distance s | per distance / pairwise |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['method']} | {row['length']} | {row['pairwise_s']:.4f} | {row['toeplitz_s']:.4f} | "
              f"{row['ratio']:.2f} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"machine": machine_description(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
