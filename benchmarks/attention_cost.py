"""What one ALiBi attention call costs against bias-free causal attention.

    python benchmarks/attention_cost.py                    # the table of docs/results/performance-alibi-cost.md
    python benchmarks/attention_cost.py --repeats 3 --lengths 2048
    python benchmarks/attention_cost.py --package /tmp/before     # the fairseq_alibi of another checkout

One call, B x H x T x D with H=8, D=32, fp32, q/k/v laid out as the layer makes
them: ``kernels.attend`` with ``alibi_attention=auto`` (what the model runs:
``blocked`` in CPU training, ``chunked`` for long inference, both with their
key windows) against ``F.scaled_dot_product_attention(q, k, v,
is_causal=True)``, bias-free and the fastest causal call there is, and against
the stock transformer_lm's ``[T, T]`` float future mask where a model trains:

* forward + backward (training), T = 512 (B = 8) and 2048 (B = 2);
* no-grad forward (evaluation), T = 2K, 8K, 16K (B = 1).

The calls of one configuration are interleaved, ``--repeats`` times after a
warm-up; each repeat gives a ratio of wall times from the same moment, and the
table reports the median ratio and its range, with the median milliseconds.
q and k are random normal: the key windows depend on ``|q| |k|``, which a
trained model sets (docs/results/performance-alibi-cost.md says what changes).
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

TRAINING = ((512, 8), (2048, 2))
EVALUATION = ((2048, 1), (8192, 1), (16384, 1))


def calls(T: int, B: int, grad: bool, heads: int = 8, dim: int = 32):
    """name -> a function running one call (and its backward when ``grad``)."""
    from fairseq_alibi.core import kernels
    from fairseq_alibi.core.bias import AlibiBias

    gen = torch.Generator().manual_seed(0)
    # [T, B, H, D] storage seen as [B, H, T, D], as the layer makes them
    q, k, v = (torch.randn(T, B, heads, dim, generator=gen).permute(1, 2, 0, 3) for _ in range(3))
    bias = AlibiBias(heads)
    future = torch.triu(torch.full((T, T), float("-inf")), 1)

    def run(fn):
        if not grad:
            with torch.no_grad():
                return lambda: fn(q, k, v)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        return lambda: fn(*leaves).sum().backward()

    out = {
        "bias-free SDPA is_causal": run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)),
        "ALiBi (auto)": run(lambda a, b, c: kernels.attend(a, b, c, bias, "auto")[0]),
    }
    if grad:
        out["stock [T, T] future mask"] = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=future))
    with torch.set_grad_enabled(grad):
        return out, kernels.choose_kernel("auto", bias, False, T, T)


def measure(T: int, B: int, grad: bool, repeats: int):
    group, kernel = calls(T, B, grad)
    names = list(group)
    times = {n: [] for n in names}
    for r in range(repeats + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            group[name]()
            if r:  # the first pass warms up
                times[name].append(time.perf_counter() - start)
    base = times[names[0]]
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(times[name], base)]
        rows.append((name, 1000 * median(times[name]), median(ratios), min(ratios), max(ratios)))
    return kernel, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--lengths", type=int, nargs="*", help="only these T")
    p.add_argument("--package", help="import fairseq_alibi from this checkout (e.g. a git worktree of an older commit)")
    args = p.parse_args(argv)
    if args.package:
        sys.path.insert(0, os.path.abspath(args.package))
    print(machine_description())
    print("| call | T | B | ALiBi kernel | bias-free ms | ALiBi / bias-free (median [min, max]) | stock mask / bias-free |")
    print("|---|---|---|---|---|---|---|")
    for grad, configs in ((True, TRAINING), (False, EVALUATION)):
        for T, B in configs:
            if args.lengths and T not in args.lengths:
                continue
            kernel, rows = measure(T, B, grad, args.repeats)
            by = {name: row for name, *row in rows}
            base_ms = by["bias-free SDPA is_causal"][0]
            _, ratio, low, high = by["ALiBi (auto)"]
            stock = f"{by['stock [T, T] future mask'][1]:.2f}" if grad else ""
            what = "forward + backward" if grad else "no-grad forward"
            print(f"| {what} | {T} | {B} | {kernel} | {base_ms:.0f} | {ratio:.2f} [{low:.2f}, {high:.2f}] | {stock} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
