"""The own kernels' attention call at several block sizes, beside causal SDPA:
PaTH's (``--method path``, the default) and stick-breaking's.

    python benchmarks/kernel_blocks.py                     # PaTH, training: 4 heads of 64, 1,024 and 2,048 tokens
    python benchmarks/kernel_blocks.py --lengths 2048 --sweep-blocks 64 128 256 --blocks 32 64
    python benchmarks/kernel_blocks.py --eval --lengths 2048 8192 --blocks 32 64 --chunks 256 512 1024
    python benchmarks/kernel_blocks.py --method stickbreaking --blocks 64 128 --key-blocks 128 256 512

One call with gradients (forward + backward, batch ``--batch``, random
normal ``q``, ``k``, ``v``; for PaTH random unit ``w`` and ``beta`` in (0,
2)) per case, and torch's causal ``scaled_dot_product_attention`` of the
same tensors.  PaTH's cases: a block size of the block terms
(``--blocks``, :data:`path.BLOCK` by default) and a size of the blocks the
training sweep runs on (``--sweep-blocks``, :data:`path.SWEEP_BLOCK` by
default: the block terms merged in pairs up to it).  Stick-breaking's:
queries per block (``--blocks``, :data:`stickbreaking.BLOCK`) and keys per
block (``--key-blocks``, :data:`stickbreaking.KEY_BLOCK`; with ``--eval``
where the fused C++ forward runs, its :data:`stickbreaking.FUSED_BLOCK` and
:data:`stickbreaking.FUSED_KEY_BLOCK`).  The cases run in
turn, the order rotated each repeat; reported per length: each case's
median CPU time (``time.process_time``) and its median ratio to SDPA's
time of the same repeat, with the range of those ratios.  This is the
command behind the two kernels' block constants.

With ``--eval``: the call without a gradient (forward only, every case's
inputs alike); PaTH's cases a block size (``--blocks``, default
:func:`path.inference_block`) and a chunk size (``--chunks``, default
:data:`path.CHUNK`); stick-breaking's as in training (with random
normal inputs each query spends its stick within a few hundred keys, and
its heads stop reading there; ``--far`` shifts ``q . k / sqrt(d)`` to about
-8, so that every key block is scored).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import machine_description, median, positive, rotated  # noqa: E402

from fairseq_alibi.core import native, path, stickbreaking  # noqa: E402


def inputs(batch: int, heads: int, length: int, head_dim: int, seed: int = 0, far: bool = False):
    """``q, k, v, w, beta`` taking gradients, and the output's gradient; ``far``: ``q . k / sqrt(d)`` about
    -8 + N(0, 1) (``new_methods_cpu.py``'s stickbreaking-far: no stick is spent, every key block scored)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g)

    shape = (batch, heads, length, head_dim)
    q, k, v = (normal(*shape) for _ in range(3))
    if far:
        q[..., 0], k[..., 0] = 10.0, -6.4 * head_dim ** 0.5 / 8.0
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w = F.normalize(normal(*shape), dim=-1).requires_grad_()
    beta = (2 * torch.sigmoid(normal(batch, heads, length))).requires_grad_()
    return (q, k, v, w, beta), normal(*shape)


def path_case(tensors, grad_out, block: int, sweep_block: int):
    def run():
        saved = path.SWEEP_BLOCK
        path.SWEEP_BLOCK = sweep_block
        try:
            out, _ = path.path_attention(*tensors, block=block)
        finally:
            path.SWEEP_BLOCK = saved
        out.backward(grad_out)
    return run


def eval_case(tensors, block: int, chunk: int):
    def run():
        with torch.no_grad():
            path.path_attention(*tensors, block=block, chunk=chunk)
    return run


def stickbreaking_case(tensors, grad_out, block: int, key_block: int):
    def run():
        q, k, v = tensors[:3]
        if grad_out is None:
            with torch.no_grad():
                stickbreaking.stickbreaking_attention(q, k, v, block=block, key_block=key_block)
        else:
            out, _ = stickbreaking.stickbreaking_attention(q, k, v, block=block, key_block=key_block)
            out.backward(grad_out)
    return run


def sdpa_case(tensors, grad_out):
    def run():
        q, k, v = tensors[:3]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if grad_out is not None:
            out.backward(grad_out)
    return run


def time_cases(cases, repeats: int):
    """``{name: [seconds per repeat]}``, every case once untimed first, then in rotated order."""
    for run in cases.values():
        run()
    names, times = list(cases), {name: [] for name in cases}
    for r in range(repeats):
        for name in rotated(names, r):
            start = time.process_time()
            cases[name]()
            times[name].append(time.process_time() - start)
    return times


def table(length: int, times) -> str:
    rows = [f"| case | {length} tokens, CPU ms | / SDPA, median [range] |", "|---|---|---|"]
    for name, values in times.items():
        ratios = sorted(v / s for v, s in zip(values, times["sdpa"]))
        rows.append(f"| {name} | {median(values) * 1e3:.3f} | {median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}] |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=positive, nargs="+", default=[1024, 2048])
    p.add_argument("--method", choices=("path", "stickbreaking"), default="path")
    p.add_argument("--eval", action="store_true", help="the call without a gradient (evaluation)")
    p.add_argument("--blocks", type=positive, nargs="+",
                   help="PaTH: the block terms' sizes; stick-breaking: queries per block (default: the kernel's own)")
    p.add_argument("--chunks", type=positive, nargs="+", default=[path.CHUNK], help="PaTH with --eval: chunk sizes")
    p.add_argument("--sweep-blocks", type=positive, nargs="+", default=[path.BLOCK, path.SWEEP_BLOCK],
                   help="PaTH's training sweep's block sizes (a block size: no merging)")
    p.add_argument("--key-blocks", type=positive, nargs="+",
                   help="stick-breaking: keys per block (default: the kernel's own, the fused forward's with --eval "
                        "where it runs)")
    p.add_argument("--far", action="store_true",
                   help="q . k / sqrt(d) about -8: no stick-breaking row spends its stick (every key block scored)")
    p.add_argument("--batch", type=positive, default=2)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--repeats", type=positive, default=5)
    p.add_argument("--threads", type=positive, default=1)
    opts = p.parse_args(argv)
    torch.set_num_threads(opts.threads)
    print(f"# {machine_description()}; {opts.method}{' (far: z about -8)' if opts.far else ''}, "
          f"{'evaluation (no gradient)' if opts.eval else 'training'}; "
          f"batch {opts.batch}, "
          f"{opts.heads} heads of {opts.head_dim}; {opts.repeats} repeats, rotated")
    if opts.method == "stickbreaking":
        fused = opts.eval and native.forward_available()  # the fused forward's own sizes, where it runs
        blocks = opts.blocks or [stickbreaking.FUSED_BLOCK if fused else stickbreaking.BLOCK]
        opts.key_blocks = opts.key_blocks or [stickbreaking.FUSED_KEY_BLOCK if fused else stickbreaking.KEY_BLOCK]
    else:
        blocks = opts.blocks or [path.inference_block(opts.head_dim) if opts.eval else path.BLOCK]
    for length in opts.lengths:
        tensors, grad_out = inputs(opts.batch, opts.heads, length, opts.head_dim, far=opts.far)
        if opts.eval:
            tensors, grad_out = [t.detach() for t in tensors], None
        cases = {"sdpa": sdpa_case(tensors, grad_out)}
        for block in blocks:
            if opts.method == "stickbreaking":
                for key_block in opts.key_blocks:
                    cases[f"stickbreaking, blocks {block}, key blocks {key_block}"] = stickbreaking_case(
                        tensors, grad_out, block, key_block)
                continue
            if opts.eval:
                for chunk in opts.chunks:
                    cases[f"path, blocks {block}, chunks {chunk}"] = eval_case(tensors, block, chunk)
                continue
            for sweep in sorted(set(opts.sweep_blocks)):
                if sweep >= block:
                    cases[f"path, blocks {block}, sweep {sweep}"] = path_case(tensors, grad_out, block, sweep)
        print()
        print(table(length, time_cases(cases, opts.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
