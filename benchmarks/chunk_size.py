"""Chunk size of the linear-memory inference path: time per size, interleaved.

    python benchmarks/chunk_size.py            # ~2 minutes on 2 cores

One ALiBi attention layer (d=256, 8 heads), batch 1, no grad, the chunked path
at several chunk sizes, repeated in rotating order; reports median wall and CPU
time per size and the size of the shared bias ramp ([H, T + chunk] fp32, one
vector per head, built once per forward; every block's bias is a view of it:
``bias.reversed_rows``); the chunk size adds little else to the peak memory
(the SDPA scores of a block are tiled inside the kernel).  Before 2026-11-28
the ramp was [H, chunk, T + chunk], which the tables of
docs/results/performance-long-eval-cpu.md from before that date list.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, median  # noqa: E402

from fairseq_alibi.core import kernels as K  # noqa: E402
from fairseq_alibi.models.attention import PositionMultiheadAttention  # noqa: E402
from fairseq_alibi.core.bias import AlibiBias  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    opts = p.parse_args()

    torch.manual_seed(0)
    module = PositionMultiheadAttention(opts.embed_dim, opts.heads, AlibiBias(opts.heads), kernel="chunked").eval()
    print(machine_description())
    print("| tokens | chunk | wall s (median) | cpu s (median) | bias ramp MiB |")
    print("|---|---|---|---|---|")
    for length in opts.lengths:
        x = torch.randn(length, 1, opts.embed_dim)
        wall = {c: [] for c in opts.chunks}
        cpu = {c: [] for c in opts.chunks}
        for r in range(opts.repeats + 1):
            shift = r % len(opts.chunks)
            for chunk in opts.chunks[shift:] + opts.chunks[:shift]:
                K.CHUNK_SIZE = chunk
                t, c = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    module(x, x, x, need_weights=False)
                if r:  # the first pass is warm-up
                    wall[chunk].append(time.perf_counter() - t)
                    cpu[chunk].append(time.process_time() - c)
        for chunk in opts.chunks:
            mib = opts.heads * (length + chunk) * 4 / 2**20
            print(f"| {length} | {chunk} | {median(wall[chunk]):.3f} | {median(cpu[chunk]):.3f} | {mib:.0f} |")


if __name__ == "__main__":
    main()
