"""One training step of every position method's whole model, paired in one process.

    python benchmarks/train_step.py --length 1024 --embed-dim 384 --heads 3 --ffn 768
    python benchmarks/train_step.py --methods alibi t5bias nope --attention-dropout 0 --repeats 11

``positions_cost.py`` times ``alibi-train`` runs, one process per run and a
few updates each: the real trainer, but on a shared 2-core machine the runs of
one repeat, minutes apart, differ by 10-30%.  This script builds every
method's model (``positions_cost``'s flags: the same sizes, dropout 0.1,
pre-norm) in one process and times one step of each in turn (forward, the
cross-entropy over the vocabulary, backward; no optimizer step, which costs
every method the same), the order rotated by one each round, so that the
steps compared are seconds apart.  Reported per attention dropout: each
method's median step time, and its speed relative to ALiBi (ALiBi's median
time over its own; above 1 is faster) with the range of the ratios of the
steps of one round.

``train_throughput.py`` does the same for ALiBi against the stock model only,
with fairseq's own ``task.train_step`` and an Adam step; the two should become
one benchmark with ``--methods`` (not yet done).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import build_lm, machine_description, make_dict_dir, median  # noqa: E402
from positions_cost import (CHOICES, DEFAULT_METHODS, arch_of, method_flags, positive, rotated,  # noqa: E402
                            significant, size_args)

REFERENCE = "alibi"


def build_models(opts, attention_dropout: float) -> Dict[str, object]:
    """Every method's model in training mode, each from the same seed."""
    import torch

    dict_dir = make_dict_dir(opts.vocab)
    models = {}
    for method in opts.methods:
        torch.manual_seed(0)
        flags = size_args(opts) + method_flags(method) + ["--attention-dropout", str(attention_dropout)]
        models[method] = build_lm(arch_of(method), dict_dir, flags, tokens_per_sample=opts.length)[1].train()
    return models


def step_seconds(model, tokens, targets) -> float:
    """Wall seconds of one forward, cross-entropy and backward."""
    import torch.nn.functional as F

    start = time.perf_counter()
    logits = model(tokens)[0]
    F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def measure(opts, attention_dropout: float) -> Dict[str, dict]:
    """Per method: its step times, their median, and its speed relative to ALiBi's."""
    import torch

    models = build_models(opts, attention_dropout)
    generator = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(4, opts.vocab, (opts.batch, opts.length), generator=generator) for _ in range(2))
    for model in models.values():  # warm-up: caches, allocator, lazy initialisation
        step_seconds(model, tokens, targets)
    times: Dict[str, List[float]] = {method: [] for method in opts.methods}
    for r in range(opts.repeats):
        for method in rotated(opts.methods, r):
            times[method].append(step_seconds(models[method], tokens, targets))
        print(f"[train_step] attention dropout {attention_dropout}, round {r + 1}/{opts.repeats}", file=sys.stderr,
              flush=True)
    reference = times[REFERENCE]
    return {method: {"seconds": values, "median": median(values),
                     "speed": median(reference) / median(values),
                     "range": [min(a / b for a, b in zip(reference, values)),
                               max(a / b for a, b in zip(reference, values))]}
            for method, values in times.items()}


def render(opts, command: str, results: Dict[str, Dict[str, dict]]) -> str:
    drops = list(results)
    lines = [f"Command: `{command}`", "",
             f"Host: {machine_description()}; {opts.threads} thread(s). Model: "
             f"{opts.layers} layers, d={opts.embed_dim}, {opts.heads} heads, FFN {opts.ffn}, vocabulary {opts.vocab}; "
             f"{opts.batch} x {opts.length} tokens per step; medians of {opts.repeats} rounds.", "",
             "| method | " + " | ".join(f"step s, attention dropout {d} | speed / ALiBi" for d in drops) + " |",
             "|---|" + "---|---|" * len(drops)]
    for method in opts.methods:
        cells = [f"{significant(results[d][method]['median'])} | {significant(results[d][method]['speed'])} "
                 f"[{significant(results[d][method]['range'][0])}, {significant(results[d][method]['range'][1])}]"
                 for d in drops]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=CHOICES, default=list(DEFAULT_METHODS),
                   help="the methods to time (alibi, every ratio's reference, is always timed)")
    p.add_argument("--attention-dropout", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--length", type=positive, default=1024, help="tokens per row, L")
    p.add_argument("--batch", type=positive, default=4, help="rows per step")
    p.add_argument("--layers", type=positive, default=2)
    p.add_argument("--embed-dim", type=positive, default=256)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--ffn", type=positive, default=512)
    p.add_argument("--vocab", type=positive, default=2004, help="dictionary size, fairseq's 4 specials included")
    p.add_argument("--repeats", type=positive, default=7, help="rounds of one step per method")
    p.add_argument("--threads", type=positive, default=1)
    p.add_argument("--json", help="write every measurement here too")
    opts = p.parse_args(argv)
    if not all(0 <= d < 1 for d in opts.attention_dropout):
        p.error(f"--attention-dropout takes probabilities in [0, 1), got {' '.join(map(str, opts.attention_dropout))}")
    if opts.vocab < 5:
        p.error(f"--vocab must be at least 5 (fairseq's 4 specials and one word), got {opts.vocab}")
    opts.methods = [REFERENCE] + [m for m in dict.fromkeys(opts.methods) if m != REFERENCE]
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    os.environ.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads))
    import torch

    torch.set_num_threads(opts.threads)
    command = "python benchmarks/train_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {str(d): measure(opts, d) for d in opts.attention_dropout}
    report = render(opts, command, results)
    print(report, flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"command": command, "machine": machine_description(), "config": vars(opts),
                       "results": results, "markdown": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
