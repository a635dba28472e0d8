"""One attention layer, forward + backward: ALiBi (auto path) against fairseq's
MultiheadAttention with its float future mask (what the sinusoidal model runs).

    python benchmarks/attention_layer.py          # ~1 minute on 2 cores

Same weights, same input, 4096 tokens per call (batch = 4096 / T), d=256, 8
heads; the two alternate call by call (A B, then B A); reports the median of the
per-pair time ratio ALiBi / fairseq, from wall-clock and from CPU time.  Smaller
and steadier than the whole-model benchmark (train_throughput.py), which it
explains: the attention layer is the only place the two models differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, median  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    opts = p.parse_args()

    from fairseq import utils
    from fairseq.modules import MultiheadAttention

    from fairseq_alibi.models.attention import PositionMultiheadAttention
    from fairseq_alibi.core.bias import AlibiBias

    torch.manual_seed(0)
    stock = MultiheadAttention(opts.embed_dim, opts.heads, self_attention=True)
    ours = PositionMultiheadAttention(opts.embed_dim, opts.heads, AlibiBias(opts.heads))
    ours.load_state_dict(stock.state_dict())
    print(machine_description())
    print("| T | batch | fairseq ms | alibi ms | time ratio wall | time ratio cpu |")
    print("|---|---|---|---|---|---|")
    for length in opts.lengths:
        batch = max(1, opts.tokens // length)
        x = torch.randn(length, batch, opts.embed_dim, requires_grad=True)
        future = torch.triu(utils.fill_with_neg_inf(torch.zeros([length, length])), 1)

        def run_stock():
            stock(x, x, x, need_weights=False, attn_mask=future)[0].sum().backward()

        def run_ours():
            ours(x, x, x, need_weights=False)[0].sum().backward()

        wall = {"stock": [], "ours": []}
        cpu = {"stock": [], "ours": []}
        fns = {"stock": run_stock, "ours": run_ours}
        for r in range(opts.repeats + 1):
            for name in (("stock", "ours") if r % 2 == 0 else ("ours", "stock")):
                t, c = time.perf_counter(), time.process_time()
                fns[name]()
                if r:
                    wall[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)
        ratio_wall = median([a / b for a, b in zip(wall["ours"], wall["stock"])])
        ratio_cpu = median([a / b for a, b in zip(cpu["ours"], cpu["stock"])])
        print(f"| {length} | {batch} | {1e3 * median(wall['stock']):.1f} | {1e3 * median(wall['ours']):.1f} "
              f"| {ratio_wall:.3f} | {ratio_cpu:.3f} |", flush=True)


if __name__ == "__main__":
    main()
