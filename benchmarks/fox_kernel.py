"""FoX's attention in CPU training against ALiBi's, kernel alone: one forward
and backward of the ``blocked`` kernel (``kernels.blocked_kernel``, what
``auto`` takes for CPU training) at ``--length`` tokens, for ALiBi and for FoX
under two kinds of gates, constant over the input (FoX's cost depends on them:
its key windows skip what its gates make negligible):

* ``fox-steep``: ``f = 0.5`` in every head, the authors' initialization (gate
  logits near 0), every head local: the cost of FoX early in training;
* ``fox-open``: ``f = 0.999``, every head sees every key: no key can be
  skipped, the cost of a head that learned to keep its context.

    python benchmarks/fox_kernel.py                        # T = 1024, B = 4, 4 heads of 64
    python benchmarks/fox_kernel.py --length 2048 --batch 2 --dropout 0 0.1 --repeats 7

The cases alternate in every repeat (A B C, then C B A, ...).  Time is CPU
time of this process (``time.process_time``, one thread): on a shared machine
the wall clock of one call varied by 2x between runs of one case; CPU time
leaves out the time other processes hold the core, not the slowdown they cause
through shared caches.  The table gives medians and each case's ratio to
ALiBi's median.  Words per second of whole models: ``positions_cost.py``.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import kernel_parser, machine_description, median, parse_kernel_args, write_rows  # noqa: E402

from fairseq_alibi.core import kernels  # noqa: E402
from fairseq_alibi.core.bias import AlibiBias  # noqa: E402
from fairseq_alibi.core.fox import GateBias  # noqa: E402
from fairseq_alibi.core.scaling import Scaling  # noqa: E402

GATES = {"fox-steep": 0.5, "fox-open": 0.999}
CASES = ("alibi",) + tuple(GATES)


def seconds(case: str, q, k, v, weight, dropout: float) -> float:
    """CPU seconds of one forward and backward of the blocked kernel."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    batch, heads, length, _ = q.shape
    if case == "alibi":
        bias = AlibiBias(heads, scaling=Scaling("none", train_length=length))
    else:
        log_gate = torch.full((batch, heads, length), math.log(GATES[case]))
        bias = GateBias(log_gate.cumsum(-1).requires_grad_())
    start = time.process_time()
    out, _ = kernels.blocked_kernel(*leaves, bias, None, dropout)
    (out * weight).sum().backward()
    return time.process_time() - start


def main(argv=None) -> int:
    args = parse_kernel_args(kernel_parser(__doc__.split("\n\n")[0]), argv)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.length, args.head_dim)
    q, k, v, weight = (torch.randn(shape, generator=gen) for _ in range(4))
    print(f"FoX and ALiBi in the blocked kernel: T={args.length}, B={args.batch}, {args.heads} heads of "
          f"{args.head_dim}, {args.threads} thread(s); {machine_description()}", file=sys.stderr)
    rows, lines = [], []
    for dropout in args.dropout:
        times = {case: [] for case in CASES}
        for case in CASES:  # warm-up
            seconds(case, q, k, v, weight, dropout)
        for r in range(args.repeats):
            for case in (CASES if r % 2 == 0 else CASES[::-1]):
                times[case].append(seconds(case, q, k, v, weight, dropout))
        medians = {case: median(t) for case, t in times.items()}
        for case in CASES:
            ratio = medians[case] / medians["alibi"]
            rows.append({"case": case, "dropout": dropout, "seconds": times[case], "median_s": medians[case],
                         "ratio": ratio})
            lines.append(f"| {case} | {dropout:g} | {medians[case]:.3f} | {ratio:.2f} |")
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"Command: `python benchmarks/fox_kernel.py {command}`\n")
    print("| case | attention dropout | CPU s, forward + backward | / ALiBi |\n|---|---|---|---|")
    print("\n".join(lines))
    write_rows(args.json, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
