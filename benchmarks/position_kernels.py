"""Every position method's attention call alone, in CPU training and in long
evaluation: the part of an update or a forward that the position method
changes, where ``positions_cost.py`` times whole models.

    python benchmarks/position_kernels.py                     # T = 1024, B = 4, 4 heads of 64
    python benchmarks/position_kernels.py --length 2048 --batch 2 --eval-length 16384 --repeats 7
    python benchmarks/position_kernels.py --methods alibi t5bias --dropout 0 --eval-length
    python benchmarks/position_kernels.py --methods fire --fire-threshold 1017 512 --dropout 0 --eval-length

One call is what a layer runs between its projections: the method's
rotation of queries and keys (rotary, rnope), its bias built for the pass
(T5, Kerple, FIRE; FoX's gates from a random input), ``layer.attention`` with
``alibi_attention=auto`` (the kernel a model runs: ``blocked`` in CPU training,
``chunked`` or SDPA in evaluation; an attention of its own, ``own_kernel``, its
``attend``: stick-breaking, PaTH) and, in training, the backward pass into
q, k, v and the method's parameters.  The hybrid (rnope) alternates its two
layer kinds call by call, as a stack of ``rnope_nope_every`` layers would run
them (one NoPE call per group).  Weights are each method's initial ones, q, k
and v random normal (ALiBi's key windows and FoX's depend on them: a trained
model skips a different share of the keys).

Time is CPU time of this process (``time.process_time``, one thread); the
cases of a repeat alternate (A B C, then C B A, ...).  The table gives each
method's median and its ratio to ALiBi's median; a method whose layers refuse a
column's attention dropout (an attention of its own has none) is not timed
there, its row says why.  Words per second of whole
models: ``positions_cost.py``.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import kernel_parser, machine_description, median, parse_kernel_args, refusal, write_rows  # noqa: E402

from fairseq_alibi.core import kernels  # noqa: E402
from fairseq_alibi.core.layer import attention as layer_attention  # noqa: E402
from fairseq_alibi.core import positions as P  # noqa: E402
from fairseq_alibi.core.scaling import Scaling  # noqa: E402


# --t5-paths: T5 also through the generic path of a learned Toeplitz bias
# (kernels.blocked_kernel without its far-and-band branch), timed beside it.
T5_GENERIC = "t5bias-generic"
# --fire-threshold T: FIRE also with its threshold at T tokens ("fire-threshold-T"), timed beside it.
FIRE_AT = "fire-threshold-"


class Case:
    """One method's position object(s), built as a layer stack of ``heads``
    heads of ``head_dim`` trained at ``length`` would build them."""

    def __init__(self, method: str, heads: int, head_dim: int, length: int):
        generic = method == T5_GENERIC
        threshold = float(method[len(FIRE_AT):]) if method.startswith(FIRE_AT) else None
        method = "t5bias" if generic else "fire" if threshold is not None else method
        entry = P.position(method)
        params = {p.name: p.default for p in entry.params}
        if threshold is not None:  # below length - 1, a training pass builds FIRE's bias block by block
            params["fire_threshold"] = threshold
        self.stack = P.build(method, heads, head_dim, params, Scaling("none", train_length=length))
        depth = getattr(self.stack, "nope_every", 1)  # one group of a hybrid's layers, else one layer
        self.stack.fit_depth(max(2, depth))
        self.layers = [self.stack.at_layer(i).for_layer() for i in range(depth)]
        if generic:  # no far bucket: the per-distance explicit path that Kerple takes, not the far-and-band one
            for layer in self.layers:
                layer.shared_from = lambda k_len: None
        self.calls = 0
        self.embed_dim = heads * head_dim
        self.shares = []  # per evaluation call: kernels.keys_read of the kernel it ran

    def seconds(self, q, k, v, weight, dropout: float, train: bool) -> float:
        """CPU seconds of one call (and its backward where ``train``)."""
        layer = self.layers[self.calls % len(self.layers)]
        self.calls += 1
        self.stack.start_pass()
        with torch.set_grad_enabled(train):
            leaves = [t.clone().requires_grad_(train) for t in (q, k, v)]
            x = torch.randn(q.size(2), q.size(0), self.embed_dim)  # the layer's input: FoX's gates read it
            start = time.process_time()
            bias, _ = layer.bind(x, None, None)
            rq, rk = bias.rotate(leaves[0], leaves[1], 0, k.size(2))
            out, _ = layer_attention(bias, "auto", rq, rk, leaves[2], x, 0, None, dropout, False, None)
            if train:
                (out * weight).sum().backward()
            seconds = time.process_time() - start
            if bias.own_kernel:  # its own attention, no shared kernel: what it reads is not counted here
                self.shares.append(None)
            elif not train:
                chunked = kernels.choose_kernel("auto", bias, False, q.size(2), k.size(2)) == "chunked"
                self.shares.append(kernels.keys_read(bias, rq, rk) if chunked else 1.0)
            return seconds


def measure(methods, shape, dropout: float, train: bool, repeats: int, length: int):
    """(CPU seconds per call, keys read per evaluation call, why a method was not
    run) per method: one whose layers refuse the attention dropout (``common.refusal``,
    as the model's layers check it when built: an attention of its own has none)
    is not timed, its row says why."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, weight = (torch.randn(shape, generator=gen) for _ in range(4))
    cases = {m: Case(m, shape[1], shape[3], length) for m in methods}
    refused = {m: why for m in methods if (why := refusal(cases[m].layers, "auto", dropout))}
    runnable = [m for m in methods if m not in refused]
    for m in runnable:  # warm-up
        cases[m].seconds(q, k, v, weight, dropout, train)
    times = {m: [] for m in methods}
    for r in range(repeats):
        for m in (runnable if r % 2 == 0 else runnable[::-1]):
            times[m].append(cases[m].seconds(q, k, v, weight, dropout, train))
    return times, {m: cases[m].shares for m in methods}, refused


def main(argv=None) -> int:
    p = kernel_parser(__doc__.split("\n\n")[0], dropout_nargs="*")
    p.add_argument("--methods", nargs="+", choices=tuple(P.POSITIONS), default=list(P.POSITIONS),
                   help="the methods (alibi, every ratio's reference, is always measured)")
    p.add_argument("--eval-length", type=int, nargs="*", default=[8192],
                   help="evaluation lengths (batch 1, no grad); none: training only")
    p.add_argument("--flush-denormal", action="store_true",
                   help="flush subnormal numbers to zero (torch.set_flush_denormal; this thread only): what the "
                        "explicit path's floor saves")
    p.add_argument("--t5-paths", action="store_true",
                   help=f"also time T5 through the generic per-distance path ({T5_GENERIC}), beside its far-and-band "
                        "path: which of the two is faster depends on the CPU")
    p.add_argument("--fire-threshold", type=float, nargs="*", default=[], metavar="TOKENS",
                   help="also time FIRE with its threshold at each of these (fire-threshold-T; by default it is the "
                        "length): below length - 1 a training pass builds FIRE's bias block by block instead of "
                        "from one value per distance, as training does once the learned threshold has moved below it")
    args = parse_kernel_args(p, argv)
    if any(not 0 < t < float("inf") for t in args.fire_threshold):
        p.error("--fire-threshold values must be positive numbers of tokens")
    if args.flush_denormal and not torch.set_flush_denormal(True):
        p.error("--flush-denormal: this CPU cannot flush subnormal numbers")
    if any(n < 1 for n in args.eval_length):
        p.error("--eval-length values must be at least 1")
    methods = ["alibi"] + [m for m in args.methods if m != "alibi"] + ([T5_GENERIC] if args.t5_paths else [])
    methods += [f"{FIRE_AT}{t:g}" for t in args.fire_threshold]
    print(f"position_kernels: L={args.length}, B={args.batch}, {args.heads} heads of {args.head_dim}, "
          f"{args.threads} thread(s); {machine_description()}", file=sys.stderr)
    columns, shares, refused, rows = [], {}, {}, []
    for dropout in args.dropout:
        name = f"train, dropout {dropout:g}"
        times, _, refused[name] = measure(methods, (args.batch, args.heads, args.length, args.head_dim), dropout,
                                          True, args.repeats, args.length)
        columns.append((name, times))
        print(f"[position_kernels] {name} done", file=sys.stderr)
    for n in args.eval_length:
        name = f"eval {n} tokens"
        times, shares[name], refused[name] = measure(methods, (1, args.heads, n, args.head_dim), 0.0, False,
                                                     args.repeats, args.length)
        columns.append((name, times))
        print(f"[position_kernels] {name} done", file=sys.stderr)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"Command: `python benchmarks/position_kernels.py {command}`\n")
    print("CPU seconds per call (median of " f"{args.repeats}), and / ALiBi; in evaluation also the share of the "
          "causal (query, key) pairs the call scores (kernels.keys_read: below 1 where key windows skip keys; "
          "a hybrid's mean over its layer kinds; - for an attention of its own, which no kernel here runs):\n")
    print("| method | " + " | ".join(f"{name}, s | / ALiBi" + (" | keys read" if name in shares else "")
                                     for name, _ in columns) + " |")
    print("|---|" + "".join("---|---|---|" if name in shares else "---|---|" for name, _ in columns))
    for m in methods:
        cells = []
        for name, times in columns:
            if m in refused[name]:  # not run: the row says why
                rows.append({"method": m, "column": name, "refused": refused[name][m]})
                cells.append(refused[name][m] + " | -" + (" | -" if name in shares else ""))
                continue
            med = median(times[m])
            ratio = med / median(times["alibi"])
            row = {"method": m, "column": name, "seconds": times[m], "median_s": med, "ratio": ratio}
            if name in shares:
                counted = [share for share in shares[name][m] if share is not None]
                row["keys_read"] = sum(counted) / len(counted) if counted else None
                cells.append(f"{med:.3f} | {ratio:.2f} | " + ("-" if row["keys_read"] is None else
                                                             f"{row['keys_read']:.2f}"))
            else:
                cells.append(f"{med:.3f} | {ratio:.2f}")
            rows.append(row)
        print(f"| {m} | " + " | ".join(cells) + " |")
    write_rows(args.json, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
