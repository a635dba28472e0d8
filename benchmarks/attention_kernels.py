"""Which attention kernel each model runs in CPU training, and what it costs.

    python benchmarks/attention_kernels.py                 # ~2 minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/attention_kernels.py

Part 1 (kernels): one forward + backward of a whole self-attention layer, fairseq's
stock ``MultiheadAttention`` with the decoder's ``[T, T]`` float future mask (what
``transformer_lm`` trains with: fairseq calls ``F.multi_head_attention_forward``
with ``need_weights=False``, which calls SDPA) and ``PositionMultiheadAttention``
(``auto``), with and without attention dropout, under the profiler: prints the
attention operators each runs.

Part 2 (costs): the attention call alone, forward + backward, B=8, H=8, T=512,
D=32, fp32, q/k/v laid out as both modules make them: SDPA with the stock
``[T, T]`` mask, SDPA with ALiBi's ``[1, H, T, T]`` bias, SDPA ``is_causal``
without a mask, the same three with attention dropout 0.1 (SDPA's math kernel),
and the ``blocked`` path with and without dropout.  Interleaved repeats; median
time and median ratio to the stock mask of the same dropout, wall and CPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, median  # noqa: E402

ATTENTION_OPS = ("scaled_dot_product", "bmm", "bernoulli", "_softmax", "BlockedCausal")


def kernels(embed_dim=256, heads=8, length=512, batch=8):
    from fairseq.modules import MultiheadAttention
    from fairseq import utils

    from fairseq_alibi.models.attention import PositionMultiheadAttention
    from fairseq_alibi.core.bias import AlibiBias

    x = torch.randn(length, batch, embed_dim)
    future = torch.triu(utils.fill_with_neg_inf(torch.zeros(length, length)), 1)  # the decoder's mask
    for drop in (0.0, 0.1):
        stock = MultiheadAttention(embed_dim, heads, dropout=drop, self_attention=True).train()
        alibi = PositionMultiheadAttention(embed_dim, heads, AlibiBias(heads), dropout=drop).train()
        for name, module, mask in (("stock transformer_lm", stock, future), ("ALiBi (auto)", alibi, None)):
            xi = x.clone().requires_grad_()
            with torch.profiler.profile() as prof:
                out, _ = module(xi, xi, xi, attn_mask=mask, need_weights=False)
                out.sum().backward()
            ops = sorted({e.key for e in prof.key_averages() if any(s in e.key for s in ATTENTION_OPS)})
            print(f"attention dropout {drop}: {name:22s} runs {', '.join(ops)}")


def costs(repeats: int):
    from fairseq_alibi.core import alibi
    from fairseq_alibi.core.causal_blocks import blocked_causal_attention

    torch.manual_seed(0)
    B, H, T, D = 8, 8, 512, 32
    # [T, B, H, D] storage seen as [B, H, T, D]: what both modules pass to SDPA
    q, k, v = [torch.randn(T, B, H, D).permute(1, 2, 0, 3).requires_grad_() for _ in range(3)]
    grad = torch.randn(T, B, H, D).permute(1, 2, 0, 3)
    bias = alibi.alibi_bias(alibi.get_slopes(H), T, T, [alibi.LOOK_LEFT] * H)
    future = torch.triu(torch.full((T, T), float("-inf")), 1)
    sdpa = F.scaled_dot_product_attention
    cases = {}
    for drop in (0.0, 0.1):
        cases[drop] = {
            "SDPA, stock [T, T] mask": lambda p=drop: sdpa(q, k, v, attn_mask=future, dropout_p=p),
            "SDPA, ALiBi [1, H, T, T] bias": lambda p=drop: sdpa(q, k, v, attn_mask=bias[None], dropout_p=p),
            "SDPA, is_causal, no mask": lambda p=drop: sdpa(q, k, v, is_causal=True, dropout_p=p),
            "blocked (ALiBi)": lambda p=drop: blocked_causal_attention(q, k, v, bias[None], p),
        }
    for drop, group in cases.items():
        wall = {n: [] for n in group}
        cpu = {n: [] for n in group}
        names = list(group)
        for r in range(repeats + 1):
            for name in names if r % 2 == 0 else names[::-1]:
                t0, c0 = time.perf_counter(), time.process_time()
                group[name]().backward(grad)
                t1, c1 = time.perf_counter(), time.process_time()
                q.grad = k.grad = v.grad = None
                if r:  # the first pass is warm-up
                    wall[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
        base = names[0]
        print(f"\nattention dropout {drop}: forward + backward, median of {repeats}")
        print("| call | wall ms | ratio to stock mask, wall | ratio, CPU time |")
        print("|---|---|---|---|")
        for name in names:
            r_wall = median([a / b for a, b in zip(wall[name], wall[base])])
            r_cpu = median([a / b for a, b in zip(cpu[name], cpu[base])])
            print(f"| {name} | {1000 * median(wall[name]):.0f} | {r_wall:.2f} | {r_cpu:.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--part", choices=("all", "kernels", "costs"), default="all")
    opts = p.parse_args()
    print(machine_description())
    if opts.part in ("all", "kernels"):
        kernels()
    if opts.part in ("all", "costs"):
        costs(opts.repeats)


if __name__ == "__main__":
    main()
