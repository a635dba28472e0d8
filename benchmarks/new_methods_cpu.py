"""Stick-breaking and PaTH on the CPU beside ALiBi and bias-free causal SDPA:
one attention call in training (forward + backward) and in long evaluation
(forward, batch 1, no grad), paired in one process (issue 81's CPU targets).

    python benchmarks/new_methods_cpu.py                           # L = 1024 and 2048, eval 8x and 32x of 256
    python benchmarks/new_methods_cpu.py --lengths 1024 --batch 4 --heads 8 --eval-lengths 2048 8192 --repeats 5

Each method is timed as ``position_kernels.py`` times it (its layer object's
``bind``, rotation and ``core.layer.attention`` with ``auto``, through the
layer's own kernel and its terms after it for stick-breaking and PaTH);
``sdpa`` is ``F.scaled_dot_product_attention(..., is_causal=True)`` alone,
the cost of bias-free causal attention.  Neither new method takes attention
dropout (their authors' kernels have none), so the training column has none:
a model's "dropout 0.1" only changes its other dropouts, outside the call.
Time is CPU time of this process (``time.process_time``, one thread by
default); a repeat runs every case, in an order rotated from repeat to repeat,
after one warm-up call each; medians.  In evaluation the table also gives the
time per causal (query, key) pair each call scores (ALiBi's key windows skip
pairs: ``kernels.keys_read``; every other method here scores them all) as a
ratio to ALiBi's, and the time over SDPA's.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fresh_buffers, fused_loops_off, machine_description, median, positive  # noqa: E402
from position_kernels import Case  # noqa: E402

from fairseq_alibi.core import native  # noqa: E402
from fairseq_alibi.core import positions as P  # noqa: E402
from fairseq_alibi.core import path, stickbreaking  # noqa: E402
from fairseq_alibi.core.scaling import Scaling  # noqa: E402

#: The cases: a method of core.positions and its parameters, or "sdpa".  "stickbreaking-far": its
#: queries and keys shifted so that z = q . k / sqrt(d) is about -8 + N(0, 1) (each key takes about
#: 0.05 % of the stick): no row spends its stick within 16,384 keys, so no key block is skipped; with
#: random q and k (z about N(0, 1)) a row's stick is spent within a few hundred keys.
#: A name ending in "-fresh": the same case with every buffer of the fused calls a fresh tensor
#: (``common.fresh_buffers``), as before they were kept (``native.Scratch``).
#: A name ending in "-eager": the same case with the fused CPU loops switched off (``core/native.py``),
#: its eager PyTorch passes instead (FIRE: the shared chunked kernel, its bias built over every key; PaTH: its
#: chunks, block terms and sweep as PyTorch operations, the cached keys by torch's fused attention).
CASES = {"alibi": ("alibi", {}), "sdpa": ("sdpa", {}), "stickbreaking": ("stickbreaking", {}),
         "stickbreaking-far": ("stickbreaking", {}), "stickbreaking-eager": ("stickbreaking", {}),
         "stickbreaking-far-eager": ("stickbreaking", {}), "path": ("path", {}),
         "path-fox": ("path", {"path_forget_gate": 1}), "path-eager": ("path", {}),
         "path-fox-eager": ("path", {"path_forget_gate": 1}), "fire": ("fire", {}), "fire-eager": ("fire", {}),
         "path-fresh": ("path", {}), "fire-fresh": ("fire", {})}


class Sdpa:
    """Bias-free causal attention, the reference of issue 81's 1.3x."""

    shares = None

    def seconds(self, q, k, v, weight, dropout: float, train: bool) -> float:
        with torch.set_grad_enabled(train):
            leaves = [t.clone().requires_grad_(train) for t in (q, k, v)]
            start = time.process_time()
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            if train:
                (out * weight).sum().backward()
            return time.process_time() - start


class Far(Case):
    """Stick-breaking with z about -8 + N(0, 1): every key block scored."""

    def seconds(self, q, k, v, weight, dropout: float, train: bool) -> float:
        q, k = q.clone(), k.clone()
        q[..., 0], k[..., 0] = 10.0, -6.4 * math.sqrt(q.size(-1)) / 8.0
        return super().seconds(q, k, v, weight, dropout, train)


class Within:
    """A case whose calls run inside ``context()``: the fused CPU loops switched off (``-eager``,
    ``common.fused_loops_off``) or their buffers fresh (``-fresh``, ``common.fresh_buffers``)."""

    def __init__(self, case, context):
        self.case, self.context = case, context

    def seconds(self, *args) -> float:
        with self.context():
            return self.case.seconds(*args)


#: The case name's ending and the context its calls run in (:class:`Within`).
VARIANTS = {"-eager": fused_loops_off, "-fresh": fresh_buffers}


def scored(case, q, k, v) -> float:
    """The share of the causal pairs one stick-breaking forward scores
    (the blocks it does not skip, their masked part included, for each head
    still reading)."""
    count = []
    original = stickbreaking._count_scored

    def counting(pairs: int):  # every head's pairs computed, block by block or once for the fused forward
        count.append(pairs / (q.size(0) * q.size(1)))

    stickbreaking._count_scored = counting
    try:
        case.seconds(q, k, v, None, 0.0, False)
    finally:
        stickbreaking._count_scored = original
    T = q.size(2)
    return sum(count) / (T * (T + 1) // 2)


def path_scored(case, q, k, v) -> float:
    """The share of the causal pairs one PaTH forward scores: all of them less the (query, cached key) pairs
    PaTH-FoX's gate leaves out of its chunks (counted by the fused C++ call, or from the eager path's rule)."""
    from common import replaced
    skipped = [0]

    def forgotten(state, flat, *rest):  # the eager path: the first cached keys left out, for every head
        first = real_forgotten(state, flat, *rest)
        rows = int((flat[0, 0].abs().sum(-1) > 0).sum())  # the block padding past the input: zero queries
        skipped[0] += first * flat.size(0) * flat.size(1) * rows
        return first

    real_forgotten = path._forgotten
    with replaced(real_forgotten, forgotten), replaced(path._count_skipped, lambda pairs: skipped.__setitem__(
            0, skipped[0] + pairs)):
        case.seconds(q, k, v, None, 0.0, False)
    T = q.size(2)
    return 1.0 - skipped[0] / (q.size(0) * q.size(1) * T * (T + 1) // 2)


def build(name: str, heads: int, head_dim: int, length: int):
    method, params = CASES[name]
    if method == "sdpa":
        return Sdpa()
    case = (Far if "-far" in name else Case)(method, heads, head_dim, length)
    if params:  # rebuilt with the variant's parameters
        entry = P.position(method)
        full = {p.name: p.default for p in entry.params}
        full.update(params)
        case.stack = P.build(method, heads, head_dim, full, Scaling("none", train_length=length))
        case.stack.fit_depth(2)
        case.layers = [case.stack.at_layer(0).for_layer()]
    ending = name[name.rfind("-"):]
    return Within(case, VARIANTS[ending]) if ending in VARIANTS else case


def measure(names, shape, train: bool, repeats: int, length: int):
    """CPU seconds per call per case, and ALiBi's share of the causal pairs read (evaluation)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, weight = (torch.randn(shape, generator=gen) for _ in range(4))
    cases = {n: build(n, shape[1], shape[3], length) for n in names}
    for n in names:  # warm-up
        cases[n].seconds(q, k, v, weight, 0.0, train)
    times = {n: [] for n in names}
    for r in range(repeats):
        turn = r % len(names)
        for n in names[turn:] + names[:turn]:
            times[n].append(cases[n].seconds(q, k, v, weight, 0.0, train))
    shares = {}
    if not train:  # the share of the causal pairs each scores: ALiBi's windows and spent sticks skip some
        shares = {n: 1.0 for n in names}
        shares["alibi"] = sum(cases["alibi"].shares) / len(cases["alibi"].shares)
        for n in names:
            if n.startswith("stickbreaking"):
                shares[n] = scored(cases[n], q, k, v)
            elif n.startswith("path"):
                shares[n] = path_scored(cases[n], q, k, v)
    return times, shares


def table(title: str, names, times, shares) -> None:
    alibi, sdpa = median(times["alibi"]), median(times["sdpa"])
    print(f"\n{title}\n")
    head = "| case | s | / ALiBi | / SDPA |" + (" pairs scored | per pair / ALiBi's | per pair / SDPA's |"
                                                 if shares else "")
    print(head)
    print("|---|---|---|---|" + ("---|---|---|" if shares else ""))
    for n in names:
        med = median(times[n])
        cells = f"| {n} | {med:.4f} | {med / alibi:.2f} | {med / sdpa:.2f} |"
        if shares:  # time per pair scored, over ALiBi's and SDPA's (which scores every causal pair)
            per_pair = med / shares[n]
            cells += f" {shares[n]:.2f} | {per_pair / (alibi / shares['alibi']):.2f} | {per_pair / sdpa:.2f} |"
        print(cells)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=positive, nargs="*", default=[1024, 2048], help="training lengths")
    p.add_argument("--batch", type=positive, default=2)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--trained-length", type=positive, default=256, help="ALiBi's training length in evaluation")
    p.add_argument("--eval-lengths", type=positive, nargs="*", default=[2048, 8192])
    p.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--threads", type=positive, default=1)
    p.add_argument("--memory", action="store_true",
                   help="also the memory one evaluation forward adds, per case and length (positions_cost.memory_of)")
    p.add_argument("--memory-cell", nargs=2, metavar=("CASE", "LENGTH"), help=argparse.SUPPRESS)
    p.add_argument("--profile", metavar="CASE", choices=tuple(CASES),
                   help="also where one evaluation call of CASE spends its time at each --eval-lengths "
                        "(torch.profiler: the operators' shares of the call's CPU time)")
    args = p.parse_args(argv)
    if args.memory_cell:
        torch.set_num_threads(args.threads)
        memory_cell(args.memory_cell[0], int(args.memory_cell[1]), args)
        return 0
    torch.set_num_threads(args.threads)
    names = ["alibi", "sdpa"] + [n for n in args.cases if n not in ("alibi", "sdpa")]
    print(f"new_methods_cpu: B={args.batch}, {args.heads} heads of {args.head_dim}, {args.threads} thread(s), "
          f"{args.repeats} repeats; {machine_description()}; fused CPU loops: {native.status()}")
    for n in args.lengths:
        times, _ = measure(names, (args.batch, args.heads, n, args.head_dim), True, args.repeats, n)
        table(f"Training, L = {n}: forward + backward, CPU s per call (median)", names, times, {})
    for n in args.eval_lengths:
        times, shares = measure(names, (1, args.heads, n, args.head_dim), False, args.repeats, args.trained_length)
        table(f"Evaluation, {n} tokens ({n / args.trained_length:g}x L = {args.trained_length}), forward; ALiBi "
              f"reads {shares['alibi']:.2f} of the causal pairs", names, times, shares)
    if args.memory and args.eval_lengths:
        memory_table(names, args)
    if args.profile:
        profile_table(args.profile, args)
    return 0


def profile_table(name: str, args, rows: int = 6) -> None:
    """The operators taking the largest shares of one evaluation call's CPU time (after a warm-up call)."""
    from torch.profiler import profile

    print(f"\nWhere one evaluation call of {name} spends its time (torch.profiler, self CPU time)\n")
    print("| tokens | " + " | ".join(f"operator {i + 1}" for i in range(rows)) + " |")
    print("|---|" + "---|" * rows)
    for n in args.eval_lengths:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn((1, args.heads, n, args.head_dim), generator=gen) for _ in range(3))
        case = build(name, args.heads, args.head_dim, args.trained_length)
        case.seconds(q, k, v, None, 0.0, False)
        with profile() as prof:
            case.seconds(q, k, v, None, 0.0, False)
        spent = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        total = sum(spent.values())
        top = sorted(spent.items(), key=lambda item: -item[1])[:rows]
        print(f"| {n} | " + " | ".join(f"{key} {t / total:.0%}" for key, t in top) + " |")


def memory_table(names, args) -> None:
    """MiB that one evaluation forward adds to resident memory (the peak of two calls over what was resident
    before them, ``positions_cost.memory_of``), per case and evaluation length, each cell in a fresh process
    (in one process the allocator keeps what an earlier case freed): linear in the length for a linear-memory
    kernel."""
    import json
    import subprocess

    lengths = args.eval_lengths
    print("\nEvaluation memory, MiB one forward adds (batch 1, each cell its own process)\n")
    print("| case | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name in names:
        cells = []
        for n in lengths:
            cmd = [sys.executable, os.path.abspath(__file__), "--memory-cell", name, str(n), "--heads", str(args.heads),
                   "--head-dim", str(args.head_dim), "--trained-length", str(args.trained_length),
                   "--threads", str(args.threads)]
            cells.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["own_mib"])
        print(f"| {name} | " + " | ".join(f"{mib:.0f}" for mib in cells) + " |", flush=True)


def memory_cell(name: str, length: int, args) -> None:
    """One cell of :func:`memory_table`, printed as JSON."""
    import json

    from positions_cost import memory_of

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, args.heads, length, args.head_dim), generator=gen) for _ in range(3))
    case = build(name, args.heads, args.head_dim, args.trained_length)
    print(json.dumps(memory_of(lambda: case.seconds(q, k, v, None, 0.0, False))))

if __name__ == "__main__":
    sys.exit(main())
