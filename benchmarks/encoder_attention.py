"""An encoder's ALiBi in long evaluation: the attention call alone, against
bias-free attention over the same queries, keys and values.

    python benchmarks/encoder_attention.py                          # 4K and 16K tokens, 8 heads of 64
    python benchmarks/encoder_attention.py --lengths 8192 --heads 12 --head-dim 64 --modes symmetric

One call is what a bidirectional layer runs between its projections in a
no-grad forward: ``kernels.attend`` with ``alibi_attention=auto`` (the
``chunked`` kernel past a million pairs) for each bias mode, and SDPA
without a mask (what a bias-free encoder runs: every query over every key).
q, k and v are random normal (the key windows depend on them: a trained
model's own queries and keys skip a different share).  "Keys read" is the
share of the ``T x T`` pairs the chunked kernel hands SDPA (below 1 where
ALiBi's two-sided key windows skip keys, or a one-way head its hidden side).

Time is CPU time of this process (``time.process_time``, ``--threads``
threads); the cases of a repeat alternate (A B C, then C B A, ...); the
table gives each case's median and its ratio to bias-free attention's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, median, positive  # noqa: E402

from fairseq_alibi.core import kernels  # noqa: E402
from fairseq_alibi.core.alibi import BIDIRECTIONAL_MODES  # noqa: E402
from fairseq_alibi.core.bias import AlibiBias, LearnedAlibiBias  # noqa: E402

BIAS_FREE = "no bias"


def keys_read(bias, q: torch.Tensor, k: torch.Tensor) -> float:
    """The share of the ``T x T`` pairs the chunked kernel scores (a no-grad
    call): its two-sided windows per block of queries (every key without them)."""
    length, heads = q.size(2), q.size(1)
    windows = getattr(kernels, "two_sided_windows", None)  # absent before the windows (a before/after run)
    span = windows(bias, q, k) if windows and length > kernels.CHUNK_SIZE else None
    read = 0
    for start in range(0, length, kernels.CHUNK_SIZE):
        stop = min(start + kernels.CHUNK_SIZE, length)
        spans = span(start, stop) if span else [(0, length)] * heads
        read += sum((stop - start) * (end - first) for first, end in spans)
    return read / (heads * length * length)


def run(length: int, heads: int, head_dim: int, modes: List[str], repeats: int, seed: int = 0) -> List[dict]:
    """One row per case: median CPU seconds over ``repeats`` alternating calls."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen) for _ in range(3))
    biases = {mode: LearnedAlibiBias(heads) if mode == "learned" else AlibiBias(heads, mode=mode) for mode in modes}
    cases = [BIAS_FREE] + modes
    times: Dict[str, List[float]] = {case: [] for case in cases}
    with torch.no_grad():
        for repeat in range(repeats):
            for case in cases if repeat % 2 == 0 else cases[::-1]:
                start = time.process_time()
                if case == BIAS_FREE:
                    F.scaled_dot_product_attention(q, k, v)
                else:
                    kernels.attend(q, k, v, biases[case], "auto")
                times[case].append(time.process_time() - start)
        chosen = {mode: kernels.choose_kernel("auto", biases[mode], False, length, length) for mode in modes}
        # SDPA with the dense bias scores the whole square
        reads = {mode: keys_read(biases[mode], q, k) if chosen[mode] == "chunked" else 1.0 for mode in modes}
    free = median(times[BIAS_FREE])
    return [dict(length=length, case=case, kernel="sdpa" if case == BIAS_FREE else chosen[case],
                 seconds=median(times[case]), ratio=median(times[case]) / free,
                 keys_read=1.0 if case == BIAS_FREE else reads[case]) for case in cases]


def table(rows: List[dict]) -> str:
    lines = ["| tokens | case | kernel | CPU s (median) | / no bias | keys read |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['length']} | {r['case']} | {r['kernel']} | {r['seconds']:.3f} | {r['ratio']:.2f} "
              f"| {r['keys_read']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=positive, nargs="+", default=[4096, 16384], help="tokens per call")
    p.add_argument("--heads", type=positive, default=8)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--modes", nargs="+", default=list(BIDIRECTIONAL_MODES), choices=BIDIRECTIONAL_MODES,
                   help="encoder bias modes (learned: trained slopes as initialized, each side its own)")
    p.add_argument("--repeats", type=positive, default=3, help="calls per case (odd: a median of real calls)")
    p.add_argument("--threads", type=positive, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_description())
    rows = []
    for length in args.lengths:
        rows += run(length, args.heads, args.head_dim, args.modes, args.repeats)
    print(table(rows))


if __name__ == "__main__":
    main()
