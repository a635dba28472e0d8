"""Training words/s of position methods' whole models, paired update by update in one process.

    python benchmarks/train_throughput.py                          # ALiBi against the stock model, attention-bound
    python benchmarks/train_throughput.py --attention-dropout 0 0.1
    python benchmarks/train_throughput.py --vocab 16384 --layers 4 --batch 4   # vocabulary-bound
    python benchmarks/train_throughput.py --methods all --pre-norm --length 1024 --layers 2 --heads 4 \\
        --ffn 512 --batch 4 --vocab 2004 --rounds 7 --threads 1 --attention-dropout 0 0.1

Defaults: ALiBi against the stock sinusoidal model in the attention-bound
configuration (6 layers, d=256, 8 heads, FFN 1024, 8 x 512 tokens per update,
a 504-symbol vocabulary, dropout 0.1, attention dropout 0, post-norm), where
the attention layers, not the vocabulary projection, take most of the time.

Every method's model is built in one process the way fairseq-train builds it
(the same parser and architecture function, the same size flags, input and
output dims pinned to the embedding dim) and trained with fairseq's own
``task.train_step`` (criterion forward, ``optimizer.backward``) followed by a
fairseq Adam step, on the same random batches.  Each round times ``--steps``
updates of every method in turn, the order rotated by one each round (for two
methods: A B, then B A), so that the updates compared are seconds apart;
``positions_cost.py`` times ``alibi-train`` runs instead, minutes apart, which
on a shared 2-core machine differ by 10-30%.

Reported per attention dropout: each method's median words/s over the rounds,
from wall-clock time and from this process's CPU time (``time.process_time``,
less disturbed by other jobs on a shared machine), and its speed relative to
ALiBi: the median over rounds of its words/s over ALiBi's of the same round
(above 1 is faster than ALiBi), with the range of those ratios; and the
share of the causal pairs that the blocked kernel's flash calls scored in a
training forward of the first batch (ALiBi's key windows, with the model's
own queries and keys).  A method whose model refuses an attention dropout
or the ``--alibi-attention`` given (an attention of its own, ``own_kernel``:
no attention dropout, ``auto`` only) is not run in that column: its row says
why in words.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import (build_lm, heads_problem, machine_description, make_dict_dir, median, model_args,  # noqa: E402
                    positive, replaced)
from positions_cost import (ALIBI, BASELINE, CHOICES, DEFAULT_METHODS, arch_of, fit_methods_to_depth,  # noqa: E402
                            left_out_lines, method_flags, option_refusal, rotated, significant)

from fairseq_alibi.core.kernels import KERNEL_NAMES  # noqa: E402

REFERENCE = ALIBI


def make_batches(n, batch, length, vocab, pad_idx, eos_idx, padded: bool, seed=0):
    """``n`` fairseq language-modelling samples of random words, ``batch`` rows of ``length``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(4, vocab, (batch, length + 1), generator=gen)
        lengths = torch.full((batch,), length, dtype=torch.long)
        if padded:  # --sample-break-mode eos: right padding to the longest row
            lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
            lengths[0] = length
            for row, n_tok in enumerate(lengths.tolist()):
                tokens[row, n_tok - 1] = eos_idx
                tokens[row, n_tok:] = pad_idx
        src, tgt = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if padded:
            tgt = tgt.masked_fill(src.eq(pad_idx), pad_idx)
        batches.append({
            "id": torch.arange(batch),
            "nsentences": batch,
            "ntokens": int(tgt.ne(pad_idx).sum()),
            "net_input": {"src_tokens": src, "src_lengths": lengths},
            "target": tgt,
        })
    return batches


def model_flags(opts, method: str, attention_dropout: float) -> List[str]:
    """The flags ``method``'s model is built with: the shared sizes, its own, the optimizer."""
    flags = model_args(opts.embed_dim, opts.layers, opts.heads, opts.ffn) + method_flags(method)
    flags += ["--optimizer", "adam", "--lr", "1e-4", "--attention-dropout", str(attention_dropout)]
    if opts.pre_norm:
        flags.append("--decoder-normalize-before")
    if method != BASELINE:  # the stock model has no kernel option
        flags += ["--alibi-attention", opts.alibi_attention]
    return flags


class Run:
    """One method's model, criterion and optimizer, and its updates."""

    def __init__(self, opts, method: str, data_dir: str, attention_dropout: float):
        import torch
        from fairseq import optim

        torch.manual_seed(0)
        self.task, self.model, self.criterion, cfg = build_lm(
            arch_of(method), data_dir, model_flags(opts, method, attention_dropout), opts.length)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optim.build_optimizer(cfg.optimizer, params)
        self.params = sum(p.numel() for p in params)

    def words_per_second(self, batches) -> tuple:
        """(wall, CPU-time) words/s of one update per batch."""
        words = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        for update, sample in enumerate(batches):
            _, sample_size, _ = self.task.train_step(sample, self.model, self.criterion, self.optimizer,
                                                     update_num=update)
            self.optimizer.multiply_grads(1.0 / max(sample_size, 1))
            self.optimizer.step()
            self.optimizer.zero_grad()
            words += sample["ntokens"]
        return words / (time.perf_counter() - start), words / (time.process_time() - cpu_start)


def keys_read(run: Run, sample) -> Optional[float]:
    """The share of the causal (query, key) pairs that the blocked kernel's
    flash calls score in one training forward of ``run``'s model on
    ``sample``, every layer together: below 1 where key windows skip keys
    (ALiBi's, with the model's own queries and keys, not random ones), above
    1 where the blocks' diagonal squares are scored whole; None where no call
    took that path (SDPA's causal kernel, the explicit path of a learned bias
    or of attention dropout)."""
    from fairseq_alibi.core import causal_blocks

    real, read, causal = causal_blocks._block_calls, [0], [0]

    def counting(q_len, k_len, block, heads, windows=None, per_head=False):
        calls = real(q_len, k_len, block, heads, windows, per_head)
        read[0] += sum((stop - start) * (end - first) * (group.stop - group.start)
                       for start, stop, group, first, end in calls)
        causal[0] += heads * (q_len * (k_len - q_len) + q_len * (q_len + 1) // 2)
        return calls

    with replaced(real, counting):  # wherever it is held: FoX's own blocked kernel imports it by name
        run.model(**sample["net_input"])
    return read[0] / causal[0] if causal[0] else None


def fire_threshold(run: Run) -> Optional[float]:
    """FIRE's learned threshold in ``run``'s model (tokens), or None for
    other methods: while it is at least ``L - 1`` FIRE trains from one value
    per distance, below it from its bias built block by block (``fire.py``),
    which costs more; it moves with every update."""
    from fairseq_alibi.core.fire import Fire

    found = [float(m.threshold.detach()) for m in run.model.modules() if isinstance(m, Fire)]
    return found[0] if found else None


def paired(values: List[float], reference: List[float]) -> dict:
    """The median and range of round-by-round ratios ``values / reference``."""
    ratios = [a / b for a, b in zip(values, reference)]
    return {"ratios": ratios, "median": median(ratios), "range": [min(ratios), max(ratios)]}


def measure(opts, attention_dropout: float) -> Dict[str, dict]:
    """Per method: its words/s per round (wall and CPU time), medians, and speed relative to ALiBi;
    ``{"refused": why}`` for a method whose model refuses ``attention_dropout`` or ``--alibi-attention``
    (an attention of its own: ``positions_cost.option_refusal``), not run."""
    data_dir = make_dict_dir(opts.vocab)
    refused = {method: option_refusal(opts, method, attention_dropout, opts.alibi_attention)
               for method in opts.methods if method != BASELINE}  # the stock model has no kernel option
    refused = {method: why for method, why in refused.items() if why}
    methods = [method for method in opts.methods if method not in refused]
    runs = {method: Run(opts, method, data_dir, attention_dropout) for method in methods}
    dictionary = runs[REFERENCE].task.source_dictionary
    batches = make_batches(opts.steps, opts.batch, opts.length, len(dictionary), dictionary.pad(),
                           dictionary.eos(), opts.padded)
    read = {method: keys_read(run, batches[0]) for method, run in runs.items()}
    thresholds = {method: [fire_threshold(run)] for method, run in runs.items()}
    warmup = [batches[i % len(batches)] for i in range(opts.warmup)]
    for run in runs.values():  # caches, allocator, lazy initialisation
        run.words_per_second(warmup)
    wall: Dict[str, List[float]] = {method: [] for method in methods}
    cpu: Dict[str, List[float]] = {method: [] for method in methods}
    for r in range(opts.rounds):
        for method in rotated(methods, r):
            w, c = runs[method].words_per_second(batches)
            wall[method].append(w)
            cpu[method].append(c)
        print(f"[train_throughput] attention dropout {attention_dropout}, round {r + 1}/{opts.rounds}: "
              + ", ".join(f"{m} {wall[m][-1]:.0f}" for m in methods) + " words/s", file=sys.stderr, flush=True)
    for method, run in runs.items():
        thresholds[method].append(fire_threshold(run))
    measured = {method: {"params": runs[method].params, "keys_read": read[method], "wps": wall[method],
                         "fire_threshold": None if thresholds[method][0] is None else thresholds[method],
                         "cpu_wps": cpu[method],
                         "median_wps": median(wall[method]), "median_cpu_wps": median(cpu[method]),
                         "speed": paired(wall[method], wall[REFERENCE]),
                         "cpu_speed": paired(cpu[method], cpu[REFERENCE])}
                for method in methods}
    return {method: measured.get(method) or {"refused": refused[method]} for method in opts.methods}


def render(opts, command: str, results: Dict[str, Dict[str, dict]]) -> str:
    def speed(entry):
        low, high = entry["range"]
        return f"{significant(entry['median'])} [{significant(low)}, {significant(high)}]"

    drops = list(results)
    norm = "pre-norm" if opts.pre_norm else "post-norm"
    lines = [f"Command: `{command}`", "",
             f"Host: {machine_description()}. Model: "
             f"{opts.layers} layers, d={opts.embed_dim}, {opts.heads} heads, FFN {opts.ffn}, {norm}, "
             f"vocabulary {opts.vocab}; {opts.batch} x {opts.length} tokens per update"
             f"{' (right-padded rows)' if opts.padded else ''}, {opts.steps} update(s) per method per round, "
             f"medians of {opts.rounds} rounds. Speed / ALiBi: the median of the rounds' ratios of words/s, "
             "[their range]; above 1 is faster than ALiBi."] + left_out_lines(opts) + ["",
             "Keys read: the share of the causal (query, key) pairs that the blocked kernel's flash calls "
             "scored in a training forward of the first batch (below 1 where key windows skip keys; - where "
             "no call took that path).", "",
             "| method | " + " | ".join(f"words/s, attention dropout {d} | speed / ALiBi | CPU-time speed / ALiBi "
                                      "| keys read" for d in drops) + " |",
             "|---|" + "---|---|---|---|" * len(drops)]
    for method in opts.methods:
        cells = [f"{results[d][method]['refused']} | - | - | -" if "refused" in results[d][method] else
                 f"{results[d][method]['median_wps']:.0f} | {speed(results[d][method]['speed'])} | "
                 f"{speed(results[d][method]['cpu_speed'])} | "
                 + ("-" if results[d][method]["keys_read"] is None else f"{results[d][method]['keys_read']:.3f}")
                 for d in drops]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    crossing = [(d, method, results[d][method]["fire_threshold"]) for d in drops for method in opts.methods
                if results[d][method].get("fire_threshold")]
    if crossing:
        lines += ["", f"FIRE's learned threshold (from one value per distance while it is at least L - 1 = "
                      f"{opts.length - 1}, its bias built block by block below it), before the warm-up and after "
                      "the last round: " + "; ".join(f"{method}, attention dropout {d}: {start:.2f} -> {end:.2f}"
                                                     for d, method, (start, end) in crossing) + "."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=CHOICES + ("all",), default=[BASELINE, REFERENCE],
                   help="the methods to time; all: every method of positions_cost.py's table "
                        "(alibi, every ratio's reference, is always timed)")
    p.add_argument("--attention-dropout", type=float, nargs="+", default=[0.0], help="one table column each")
    p.add_argument("--vocab", type=positive, default=504, help="dictionary size, fairseq's 4 specials included")
    p.add_argument("--embed-dim", type=positive, default=256)
    p.add_argument("--layers", type=positive, default=6)
    p.add_argument("--heads", type=positive, default=8)
    p.add_argument("--ffn", type=positive, default=1024)
    p.add_argument("--length", type=positive, default=512, help="tokens per sample, L")
    p.add_argument("--batch", type=positive, default=8, help="sequences per update")
    p.add_argument("--steps", type=positive, default=1, help="timed updates per method per round")
    p.add_argument("--rounds", type=positive, default=24)
    p.add_argument("--warmup", type=int, default=2, help="untimed updates per method before the rounds")
    p.add_argument("--padded", action="store_true", help="right-padded batches (sample-break-mode eos)")
    p.add_argument("--pre-norm", action="store_true", help="--decoder-normalize-before for every model")
    p.add_argument("--alibi-attention", default="auto", choices=KERNEL_NAMES,
                   help="the kernel option of every method but the stock model")
    p.add_argument("--threads", type=positive, help="torch threads (default: torch's own choice)")
    p.add_argument("--json", help="also write every measurement here")
    opts = p.parse_args(argv)
    if not all(0 <= d < 1 for d in opts.attention_dropout):
        p.error(f"--attention-dropout takes probabilities in [0, 1), got {' '.join(map(str, opts.attention_dropout))}")
    if opts.vocab < 5:
        p.error(f"--vocab must be at least 5 (fairseq's 4 specials and one word), got {opts.vocab}")
    if opts.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {opts.warmup}")
    if problem := heads_problem(opts.embed_dim, opts.heads):
        p.error(problem)
    methods = [m for name in opts.methods for m in (DEFAULT_METHODS if name == "all" else [name])]
    fit_methods_to_depth(p, opts, [REFERENCE] + [m for m in dict.fromkeys(methods) if m != REFERENCE],
                         optional=set(DEFAULT_METHODS) - set(opts.methods) if "all" in opts.methods else set())
    for drop in opts.attention_dropout:  # every speed is a ratio to ALiBi's: a column without it is no table
        if why := option_refusal(opts, REFERENCE, drop, opts.alibi_attention):
            p.error(f"--alibi-attention {opts.alibi_attention} with --attention-dropout {drop:g}: {REFERENCE}, every "
                    f"speed's reference, refuses it: {why}; give another kernel or attention dropout")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    command = "python benchmarks/train_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
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
