"""PaTH's attention call at several block sizes, beside causal SDPA.

    python benchmarks/path_blocks.py                       # training: 4 heads of 64, 1,024 and 2,048 tokens
    python benchmarks/path_blocks.py --lengths 2048 --sweep-blocks 64 128 256 --blocks 32 64
    python benchmarks/path_blocks.py --eval --lengths 2048 8192 --blocks 32 64 --chunks 256 512 1024

One call of ``path.path_attention`` with gradients (forward + backward, batch
``--batch``, random unit ``w`` and ``beta`` in (0, 2)) per case: each case a
block size of the block terms (``--blocks``, :data:`path.BLOCK` by default)
and a size of the blocks the training sweep runs on (``--sweep-blocks``,
:data:`path.SWEEP_BLOCK` by default: the block terms merged in pairs up to
it), and torch's causal ``scaled_dot_product_attention`` of the same tensors.
The cases run in turn, the order rotated each repeat; reported per length:
each case's median CPU time (``time.process_time``) and its median ratio to
SDPA's time of the same repeat, with the range of those ratios.  This is
the command that chose :data:`path.BLOCK` and :data:`path.SWEEP_BLOCK`.

With ``--eval``: the call without a gradient (forward only, every case's
inputs alike), each case a block size (``--blocks``, default
:func:`path.inference_block`) and a chunk size (``--chunks``, default
:data:`path.CHUNK`): the command behind :data:`path.INFERENCE_BLOCKS` and
:data:`path.CHUNK`.
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
from common import machine_description, median, positive  # noqa: E402

from fairseq_alibi.core import path  # noqa: E402


def inputs(batch: int, heads: int, length: int, head_dim: int, seed: int = 0):
    """``q, k, v, w, beta`` taking gradients, and the output's gradient."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g)

    shape = (batch, heads, length, head_dim)
    q, k, v = (normal(*shape).requires_grad_() for _ in range(3))
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
        for name in names[r % len(names):] + names[:r % len(names)]:
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
    p.add_argument("--eval", action="store_true", help="the call without a gradient (evaluation)")
    p.add_argument("--blocks", type=positive, nargs="+", help="block terms' sizes (default: the kernel's own)")
    p.add_argument("--chunks", type=positive, nargs="+", default=[path.CHUNK], help="with --eval: chunk sizes")
    p.add_argument("--sweep-blocks", type=positive, nargs="+", default=[path.BLOCK, path.SWEEP_BLOCK],
                   help="the training sweep's block sizes (a block size: no merging)")
    p.add_argument("--batch", type=positive, default=2)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--repeats", type=positive, default=5)
    p.add_argument("--threads", type=positive, default=1)
    opts = p.parse_args(argv)
    torch.set_num_threads(opts.threads)
    print(f"# {machine_description()}; {'evaluation (no gradient)' if opts.eval else 'training'}; batch {opts.batch}, "
          f"{opts.heads} heads of {opts.head_dim}; {opts.repeats} repeats, rotated")
    blocks = opts.blocks or [path.inference_block(opts.head_dim) if opts.eval else path.BLOCK]
    for length in opts.lengths:
        tensors, grad_out = inputs(opts.batch, opts.heads, length, opts.head_dim)
        if opts.eval:
            tensors, grad_out = [t.detach() for t in tensors], None
        cases = {"sdpa": sdpa_case(tensors, grad_out)}
        for block in blocks:
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
