"""Training and evaluation cost of every position method, side by side (issue 35).

    python benchmarks/positions_cost.py                   # the comparison's setting (examples/positions/compare.sh)
    python benchmarks/positions_cost.py --methods alibi t5bias --repeats 5    # sinusoidal is always measured
    python benchmarks/positions_cost.py --length 512 --layers 6 --embed-dim 256 --ffn 1024 \\
        --max-tokens 4096 --eval-multiples 8 16 --updates 20             # a larger setting
    python benchmarks/positions_cost.py --json cost.json --markdown cost.md   # keep the results

The ALiBi paper's table of training speed, inference speed and memory, for
the stock model and every position method of the registry (sinusoidal: the
stock ``transformer_lm``; the others ``transformer_lm_<method>``), every model with
the same flags as ``compare.sh`` trains it (2 layers, d=128, 8 heads, FFN 512,
pre-norm, L=64, 2048 tokens per update, dropout 0.1), only the arch differing.

* **Training words/s**: ``alibi-train`` runs of ``--updates`` updates each on a
  throw-away corpus of random words (``--words``, the embedded corpus's
  vocabulary size by default; ``--data`` trains on a binarized directory
  instead), ``--log-interval 1``, one run at a time with ``--threads`` threads,
  for each ``--attention-dropout``.  A run's words/s is the median ``wps`` of
  its updates after ``--skip`` warm-up updates.  Each repeat visits every
  (attention dropout, method) once, the methods in an order rotated by one
  each repeat, so that a slow phase of the machine does not fall on one
  method only.  A method whose attention has no dropout (an attention of its
  own: ``own_kernel``, which refuses any) trains at attention dropout 0 in
  every column, its other dropouts 0.1 as every model's, paired with the
  column's other runs as usual; its row says so (:func:`trained_dropout`).
* **Evaluation**: one no-grad forward of the decoder stack
  (``extract_features``: embeddings, layers, final norm; no vocabulary
  projection, which costs every method the same) over one sequence of each
  ``--eval-multiples`` x L tokens, batch 1, freshly initialized weights (seed
  0).  Every cell (method x length x repeat) is a fresh subprocess, as in
  ``eval_memory.py``: it builds the model as fairseq-train would (every model
  with ``--max-target-positions`` raised to the longest length, which the
  sinusoidal model needs to read past L, as the sweep's backend overrides it),
  runs one forward of L tokens, one forward at the length (caches built, as
  when a corpus is evaluated in windows of one length), then times
  ``--eval-calls`` more: time is the median of those calls.  One more
  (untimed) forward counts the (query, key) pairs its attention scores, as a
  share of the causal pairs ("keys read", :func:`keys_read`): below 1 where
  key windows skip keys (ALiBi's in long evaluation), which no method that
  weighs every key can match per pair.  Memory is a
  second subprocess of the same cell, run with a fixed glibc mmap threshold
  (``eval_memory.MEASURED_ALLOCATOR``: freed blocks leave the process, so
  resident memory follows the tensors held): after the forward of L tokens it
  notes its resident memory (``ready``), resets the kernel's high-water mark
  (``eval_memory.reset_peak``) and runs two forwards at the length; peak: the
  high-water mark since the reset, own: peak minus ready, what the long
  forwards added (``--memory-only``: no timing process).  Cells alternate like
  the training runs.

Reported per method: the median over repeats and its ratio to the sinusoidal
median (the ratio of the two printed medians), with the range of the ratios of
the pairs taken in the same repeat, ``[min, max]``; where ALiBi was measured,
the same against ALiBi's median (``/ ALiBi``: issue 43's targets).  A wall clock on a shared
machine is noisy: run it on a quiet one and quote the table with its header
(command line, host, torch, threads, load average).  Progress goes to stderr,
the Markdown report to stdout (and ``--markdown``), everything to ``--json``.
Exit status 1 if a cell failed (its row says so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Set

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This checkout's package first, in this process and in every cell (the same file):
# an installed copy elsewhere would be measured instead (the training runs get it
# through PYTHONPATH, fairseq_train_wps.run_all).
sys.path[:0] = [HERE, ROOT]
from common import (heads_problem, machine_description, median, model_args, positive, refusal,  # noqa: E402
                    replaced, rotated)
from eval_memory import MEASURED_ALLOCATOR, mem_available_gib, reset_peak, rss_mib, status_mib  # noqa: E402
from fairseq_train_wps import (BIN, RunFailed, make_corpus, read_log, run_all, summarize,  # noqa: E402
                              train_inner_stats)

from fairseq_alibi.core.positions import POSITIONS  # noqa: E402

BASELINE = "sinusoidal"
#: The second reference of every table: issue 43's targets are ratios to ALiBi's cost.
ALIBI = "alibi"
#: A method trained with scalable softmax (``--ssmax``): ``<method>+ssmax``, any method of the registry.
SSMAX = "+ssmax"
#: Every method, in the order the tables list them: the baseline, then the registry's; ALiBi with SSMax by default.
METHODS = (BASELINE,) + tuple(POSITIONS)
CHOICES = METHODS + tuple(name + SSMAX for name in POSITIONS)
DEFAULT_METHODS = METHODS + ("alibi" + SSMAX,)
#: Every model's dropout (compare.sh's): a method that has no attention dropout keeps it (:func:`trained_dropout`).
DROPOUT = 0.1
#: A sinusoidal cell is skipped when its ``T x T`` float future mask, twice, would take more
#: than this share of the memory available (the machine may be shared).
MEMORY_SHARE = 0.6


def arch_of(method: str) -> str:
    return "transformer_lm" if method == BASELINE else f"transformer_lm_{position_of(method)}"


def position_of(method: str) -> str:
    """The registry's position method of a table's method (``alibi+ssmax``: ``alibi``)."""
    return method[:-len(SSMAX)] if method.endswith(SSMAX) else method


def method_flags(method: str) -> List[str]:
    """The training flags a table's method adds to its arch (``--ssmax``)."""
    return ["--ssmax"] if method.endswith(SSMAX) else []


def size_args(opts) -> List[str]:
    """The model flags every method shares (compare.sh's)."""
    return model_args(opts.embed_dim, opts.layers, opts.heads, opts.ffn, dropout=DROPOUT) + \
        ["--decoder-normalize-before"]


def train_command(data: str, method: str, opts, attention_dropout: float) -> List[str]:
    """``alibi-train`` with compare.sh's training flags, logging every update's words/s."""
    return [
        os.path.join(BIN, "alibi-train"), data, "--task", "language_modeling", "--arch", arch_of(method),
        *size_args(opts), *method_flags(method), "--attention-dropout", str(attention_dropout),
        "--tokens-per-sample", str(opts.length), "--sample-break-mode", "none", "--max-tokens", str(opts.max_tokens),
        "--required-batch-size-multiple", "1",  # fairseq's 8 cut 20 samples to 16: an update of max_tokens // L
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--weight-decay", "0.01",
        "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100", "--warmup-init-lr", "1e-7",
        "--max-update", str(opts.updates), "--seed", "1", "--log-format", "json", "--log-interval", "1",
        "--no-save", "--disable-validation", "--num-workers", "0", "--cpu",
    ]


# ----------------------------------------------------------------- one evaluation cell (a subprocess)
def sinusoidal_mask_gib(length: int) -> float:
    """The stock decoder's float32 ``T x T`` future mask."""
    return 4 * length * length / 2**30


def cell_extra_args(opts, method: str) -> List[str]:
    """The model flags of an evaluation cell of ``method``."""
    return size_args(opts) + method_flags(method) + [
        "--max-target-positions", str(opts.length * max(opts.eval_multiples))]


def run_cell(opts) -> dict:
    """Time of the no-grad decoder stack of ``opts.cell_method`` over
    ``opts.cell_length`` tokens, or its memory (``opts.cell_memory``, :func:`memory_of`)."""
    import torch
    from common import build_lm

    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    _, model, _, _ = build_lm(arch_of(opts.cell_method), opts.dict_dir, cell_extra_args(opts, opts.cell_method),
                              tokens_per_sample=opts.length)
    model.eval()

    def tokens(n: int):
        return torch.randint(4, opts.vocab, (1, n), generator=torch.Generator().manual_seed(n))

    def forward(x) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            features = model.decoder.extract_features(x, None)[0]
            elapsed = time.perf_counter() - start
        if not bool(torch.isfinite(features).all()):
            raise RuntimeError(f"{opts.cell_method}: non-finite features at {x.size(1)} tokens")
        return elapsed

    forward(tokens(opts.length))
    x = tokens(opts.cell_length)
    if opts.cell_memory:
        return memory_of(lambda: forward(x))
    first = forward(x)
    calls = [forward(x) for _ in range(opts.eval_calls)]
    return {"seconds": median(calls), "calls": calls, "first_call": first, "keys_read": keys_read(forward, x)}


def keys_read(forward, x) -> Optional[float]:
    """The (query, key) pairs the attention of one more (untimed) ``forward``
    of ``x`` scores, every layer together, as a share of the pairs causal
    attention scores (each query with the keys up to its own): below 1 where
    key windows skip keys (``kernels.keys_read`` of each ``chunked`` call, a
    method's own ``chunked`` kernel's too, FoX's, with the layer's own queries
    and keys), 1 for a kernel that scores every causal pair (SDPA, the
    explicit paths), a little above 1 for blocks that score their diagonal
    squares whole.  The stock sinusoidal model calls none of this project's
    kernels: its attention scores the full ``T x T`` square, ``2T / (T + 1)``
    of the causal pairs.  None where a layer computes its attention itself
    (``own_kernel``: no kernel here runs it, and what it reads is its own)."""
    from fairseq_alibi.core import kernels, layer

    real_for, real_attention, read, causal, own = kernels.kernel_for, layer.attention, [0.0], [0], [0]

    def counting_for(name: str, bias):
        chosen = real_for(name, bias)

        def kernel(q, k, v, bias, key_padding_mask, dropout_p, *args, **kwargs):
            q_len, k_len = q.size(2), k.size(2)
            pairs = q.size(0) * q.size(1) * (q_len * (k_len - q_len) + q_len * (q_len + 1) // 2)
            share = kernels.keys_read(bias, q, k) if name == "chunked" and key_padding_mask is None else 1.0
            read[0] += share * pairs
            causal[0] += pairs
            return chosen(q, k, v, bias, key_padding_mask, dropout_p, *args, **kwargs)
        return kernel

    def attention(positions, *args, **kwargs):
        own[0] += bool(positions.own_kernel)
        return real_attention(positions, *args, **kwargs)

    with replaced(real_for, counting_for), replaced(real_attention, attention):
        forward(x)
    if own[0]:
        return None
    length = x.size(1)
    return read[0] / causal[0] if causal[0] else 2 * length / (length + 1)


def memory_of(long_forward) -> dict:
    """What two calls of ``long_forward`` add to the resident memory they start
    from: ``own_mib`` = ``peak_mib`` (the high-water mark from their start,
    ``VmHWM`` after :func:`eval_memory.reset_peak`) - ``ready_mib`` (resident
    then).  Where the mark cannot be reset (no ``/proc``) the process's
    ``ru_maxrss`` serves, earlier peaks included (``memory_basis`` says which)."""
    try:
        status_mib("VmHWM")  # where the peak is read from: a /proc without it takes the fallback
        reset = reset_peak()
    except OSError:
        reset = False
    basis, ready = ("VmHWM", status_mib("VmRSS")) if reset else ("ru_maxrss", rss_mib())
    for _ in range(2):
        long_forward()
    peak = status_mib("VmHWM") if basis == "VmHWM" else rss_mib()
    return {"peak_mib": peak, "ready_mib": ready, "own_mib": peak - ready, "memory_basis": basis}


def cell_command(opts, method: str, length: int, dict_dir: str) -> List[str]:
    # --methods: the cell's own (a cell checks only the method it runs; the default, every method,
    # would refuse a depth that another method needs more layers for)
    cmd = [sys.executable, os.path.abspath(__file__), "--methods", method, "--cell-method", method,
           "--cell-length", str(length),
           "--dict-dir", dict_dir, "--vocab", str(opts.vocab), "--threads", str(opts.threads),
           "--eval-calls", str(opts.eval_calls), "--eval-multiples", *map(str, opts.eval_multiples)]
    for flag in ("length", "max_tokens", "layers", "embed_dim", "heads", "ffn"):  # what parse_args checks them by
        cmd += ["--" + flag.replace("_", "-"), str(getattr(opts, flag))]
    return cmd


def measure_cell(opts, method: str, length: int, dict_dir: str) -> dict:
    """One cell, its time and its memory each in a fresh subprocess: the two
    results in one dict, or ``{"skipped"|"failed": why}``."""
    if method == BASELINE and 2 * sinusoidal_mask_gib(length) > MEMORY_SHARE * mem_available_gib():
        return {"skipped": f"needs ~{2 * sinusoidal_mask_gib(length):.0f} GiB for the T x T mask"}
    cell = {}
    runs = (([], None), (["--cell-memory"], {**os.environ, **MEASURED_ALLOCATOR}))
    for extra, env in runs[1:] if opts.memory_only else runs:
        proc = subprocess.run(cell_command(opts, method, length, dict_dir) + extra, capture_output=True, text=True,
                              env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("CELL ")]
        if proc.returncode != 0 or not lines:
            return {"failed": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}",
                    "stderr": proc.stderr[-4000:]}
        cell.update(json.loads(lines[-1][len("CELL "):]))
    return cell


# ----------------------------------------------------------------- summaries
def compared(per_repeat: Dict[str, List[Optional[float]]], base: str = BASELINE) -> Dict[str, dict]:
    """Each method's median over its repeats, its ratio to the ``base`` method's
    median, and the ratios of the pairs of one repeat (both measured), with
    their range. ``None`` marks a repeat that gave no value. Against the
    sinusoidal baseline (the paper's), each entry also holds ``per_alibi``, the
    same against ALiBi where it was measured (issue 43's targets)."""
    base_values = [v for v in per_repeat[base] if v is not None]
    base_median = median(base_values) if base_values else None
    out = {}
    for method, values in per_repeat.items():
        done = [v for v in values if v is not None]
        pairs = [v / b for v, b in zip(values, per_repeat[base]) if v is not None and b]
        entry = {"values": values, "median": median(done) if done else None, "paired_ratios": pairs}
        entry["ratio"] = entry["median"] / base_median if done and base_median else None
        entry["range"] = [min(pairs), max(pairs)] if pairs else None
        out[method] = entry
    if base == BASELINE and ALIBI in per_repeat:
        for method, entry in compared(per_repeat, ALIBI).items():
            out[method]["per_alibi"] = {key: entry[key] for key in ("ratio", "range", "paired_ratios")}
    return out


def significant(value: float) -> str:
    """At least 4 significant digits, never an exponent (the table's medians and ratios)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.{max(0, 3 - math.floor(math.log10(abs(value))))}f}"


def ratio_text(entry: dict) -> str:
    if entry["ratio"] is None:
        return "-"
    low, high = entry["range"]
    return f"{significant(entry['ratio'])} [{significant(low)}, {significant(high)}]"


def value_text(entry: dict) -> str:
    return significant(entry["median"]) if entry["median"] is not None else "-"


# ----------------------------------------------------------------- the report
def code_version() -> str:
    """This checkout's commit, and whether its files differ from it."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True).stdout.strip()

    try:
        commit, changed = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return "unknown (no git)"
    return f"commit {commit or 'unknown'}" + (" with uncommitted changes" if changed else "")


def header(opts, command: str, loads: Sequence[float]) -> List[str]:
    return [
        "## Position methods: training and evaluation cost",
        "",
        f"Command: `{command}` (code: {code_version()})",
        "",
        f"Host: {machine_description()}; {opts.threads} thread(s) per run; load average (1 min) "
        f"{loads[0]:.2f} at the start, {loads[1]:.2f} at the end.",
        "",
        f"Model (every method): {opts.layers} layers, d={opts.embed_dim}, {opts.heads} heads, FFN {opts.ffn}, "
        f"pre-norm, vocabulary {opts.vocab}, L={opts.length}; "
        + (f"training {tokens_per_update(opts)} tokens per update ({opts.max_tokens // opts.length} samples), "
           if opts.attention_dropout else "")
        + f"dropout {DROPOUT}. Each value: the median over {opts.repeats} repeat(s) (fewer where a row says so); "
        "/ sinusoidal"
        + (" and / ALiBi: the ratio of the medians to that method's" if ALIBI in opts.methods else
           ": the ratio of the medians") + ", [the range of the ratios of the pairs of one repeat].",
    ] + left_out_lines(opts)


def tokens_per_update(opts) -> int:
    """An update's tokens: the whole samples of L that ``--max-tokens`` holds (``train_command``'s batches)."""
    return opts.max_tokens // opts.length * opts.length


def left_out_lines(opts) -> List[str]:
    """A report's paragraph naming the default methods this depth could not build, if any."""
    if not opts.left_out:
        return []
    return ["", "Left out of the default methods: " + "; ".join(
        f"{method} ({why})" for method, why in opts.left_out.items()) + "."]


def ratio_columns(opts) -> List[str]:
    """The ratio columns after each value: to the sinusoidal baseline, and to ALiBi where it was measured."""
    return ["/ sinusoidal"] + ["/ ALiBi"] * (ALIBI in opts.methods)


def value_cells(opts, entry: dict) -> List[str]:
    """A value and its ratios, in ``ratio_columns``' order."""
    return [value_text(entry), ratio_text(entry)] + ([ratio_text(entry["per_alibi"])] if ALIBI in opts.methods else [])


def table_lines(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def train_table(opts, train: Dict[str, Dict[str, dict]]) -> List[str]:
    drops = list(train)
    header = ["method"] + [c for d in drops for c in [f"wps, attention dropout {d}"] + ratio_columns(opts)]
    rows = [[method + "".join(f" ({train[d][method]['note']})" for d in drops if train[d][method].get("note"))]
            + [c for d in drops for c in value_cells(opts, train[d][method])] for method in opts.methods]
    return [f"### Training: words/s of `alibi-train` (median update after {opts.skip} warm-up, "
            f"{opts.updates} updates per run)", ""] + table_lines(header, rows)


def eval_table(opts, length: int, by_key: Dict[str, Dict[str, dict]], why: Dict[str, str],
               partial: Optional[Dict[str, str]] = None) -> List[str]:
    """``partial``: a method measured in some repeats only, and why not the others (its
    median is over the repeats it has; said in its row)."""
    partial = partial or {}
    header = ["method", "keys read"] + [c for name in ("seconds", "peak MiB", "own MiB")
                                        for c in [name] + ratio_columns(opts)]
    rows = [[method, f"not run: {why[method]}"] + ["-"] * (len(header) - 2) if method in why else
            [method + (f" ({partial[method]})" if method in partial else ""), value_text(by_key["keys_read"][method])]
            + [c for key in ("seconds", "peak_mib", "own_mib") for c in value_cells(opts, by_key[key][method])]
            for method in opts.methods]
    return [f"### Evaluation: no-grad forward of the decoder stack, {length} tokens "
            f"({length // opts.length}x L), batch 1, initial weights (seed 0)", ""] + table_lines(header, rows) + (
        [] if opts.memory_only else ["", KEYS_READ_NOTE])


#: Under every timed evaluation table: what its "keys read" column counts (a memory-only run has none).
KEYS_READ_NOTE = ("Keys read: the (query, key) pairs the attention scores, every layer together, as a share of the "
                  "causal pairs (each query with the keys up to its own), from one more forward of the timed cell. "
                  "Below 1 where key windows skip the keys a head cannot weigh (ALiBi's steep heads, FoX's closed "
                  "gates, a sliding window): a method that reads every key cannot be that much faster per pair. "
                  "The stock sinusoidal model scores the full T x T square (2T / (T + 1)). - for a method that "
                  "computes its attention itself (no kernel here counts what it reads).")


#: What a report says under a table whose memory could not be read from a reset high-water mark.
NO_RESET_NOTE = ("Memory from `ru_maxrss` (this system cannot reset the high-water mark through "
                 "/proc/self/clear_refs): peak is the process's whole peak, and own less the peak before the long "
                 "forwards, which may hide what they reused.")


def render(opts, command: str, loads: Sequence[float], train: Dict[str, Dict[str, dict]], evaluation) -> str:
    """The Markdown report: the header, the training table, one evaluation table per length."""
    lines = header(opts, command, loads) + ([""] + train_table(opts, train) + threshold_lines(opts, train)
                                            if train else [])
    for length, result in evaluation.items():
        lines += [""] + eval_table(opts, int(length), result["compared"], result["not_run"], result.get("partial"))
        if "ru_maxrss" in result.get("memory_basis", ()):
            lines += ["", NO_RESET_NOTE]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- the runs
def progress(start: float, message: str) -> None:
    print(f"[positions_cost {time.time() - start:.0f}s] {message}", file=sys.stderr, flush=True)


def measure_training(opts, data: str, workdir: str, start: float) -> Dict[str, Dict[str, dict]]:
    """Per attention dropout, ``compared`` words/s of every method; a method
    that refuses the column's attention dropout trains without
    (:func:`trained_dropout`: its entry's ``attention_dropout`` and ``note``)."""
    wps = {str(d): {m: [] for m in opts.methods} for d in opts.attention_dropout}
    thresholds = {str(d): {m: [] for m in opts.methods} for d in opts.attention_dropout}
    used = {(str(d), m): trained_dropout(opts, m, d) for d in opts.attention_dropout for m in opts.methods}
    for r in range(opts.repeats):
        for drop in opts.attention_dropout:
            for method in rotated(opts.methods, r):
                trained, note = used[str(drop), method]
                if trained is None:  # refused even without attention dropout: its row says why
                    wps[str(drop)][method].append(None)
                    thresholds[str(drop)][method].append(None)
                    continue
                log = os.path.join(workdir, f"{method}_ad{drop}_{r}.log")
                run_all([(train_command(data, method, opts, trained), log)], parallel=False)
                value = summarize(read_log(log), opts.skip)[0]
                wps[str(drop)][method].append(value)
                thresholds[str(drop)][method].append(logged_scalar(log, "fire_threshold")[opts.skip:] or None)
                progress(start, f"train repeat {r + 1}/{opts.repeats}, attention dropout {drop}, "
                                f"{method}: median wps {value:.0f}" + (f" ({note})" if note else ""))
    train = {drop: compared(values) for drop, values in wps.items()}
    for (drop, method), (trained, note) in used.items():
        train[drop][method]["attention_dropout"] = trained
        if note:
            train[drop][method]["note"] = note
    for drop, methods in thresholds.items():
        for method, runs in methods.items():
            if any(runs):  # FIRE: the threshold at each counted update of each repeat
                train[drop][method]["fire_threshold"] = runs
    return train


def logged_scalar(log: str, key: str) -> List[float]:
    """``key``'s value in each ``train_inner`` line of a fairseq JSON log that has it."""
    return [float(stats[key]) for stats in train_inner_stats(log) if key in stats]


def threshold_lines(opts, train: Dict[str, Dict[str, dict]]) -> List[str]:
    """What the training table's FIRE rows measured: its learned threshold
    over the counted updates (fairseq-train's log; the value each update
    started from), and how many were below ``L - 1``, where a training pass
    builds its bias block by block instead of from one value per distance."""
    lines = []
    for drop, methods in train.items():
        for method, entry in methods.items():
            runs = entry.get("fire_threshold")
            if not runs:
                continue
            done = [run for run in runs if run]
            past = sum(value < opts.length - 1 for run in done for value in run)
            spans = ", ".join(f"{run[0]:.2f} -> {run[-1]:.2f}" for run in done)
            lines.append(f"- {method}, attention dropout {drop}: {spans}; {past} of "
                         f"{sum(len(run) for run in done)} counted updates below L - 1.")
    if not lines:
        return []
    return ["", f"FIRE's learned threshold over the counted updates of each repeat (tokens, from the training log): "
                f"its training builds the bias from one value per distance while the threshold is at least L - 1 = "
                f"{opts.length - 1}, block by block (slower) past it."] + ["", *lines]


def measure_evaluation(opts, dict_dir: str, start: float):
    """Per length: the cells, ``compared`` seconds / peak / own memory, and why a method has none."""
    results = {}
    for m, multiple in enumerate(opts.eval_multiples):
        length = multiple * opts.length
        cells = {method: [] for method in opts.methods}
        for r in range(opts.repeats):
            for method in rotated(opts.methods, r + m):
                cell = measure_cell(opts, method, length, dict_dir)
                cells[method].append(cell)
                read = "-" if cell.get("keys_read") is None else f"{cell['keys_read']:.3f}"  # -: its own attention
                state = cell.get("skipped") or cell.get("failed") or \
                    (f"{cell['seconds']:.3f} s (keys read {read}), " if "seconds" in cell else "") + \
                    f"peak {cell['peak_mib']:.0f} MiB (own {cell['own_mib']:.0f})"
                progress(start, f"eval repeat {r + 1}/{opts.repeats}, {length} tokens, {method}: {state}")
        by_key = {key: compared({method: [c.get(key) for c in runs] for method, runs in cells.items()})
                  for key in ("seconds", "keys_read", "peak_mib", "own_mib")}
        why = {method: next(c.get("skipped") or c.get("failed") for c in runs)
               for method, runs in cells.items() if not any("own_mib" in c for c in runs)}
        partial = {method: f"{sum('own_mib' in c for c in runs)} of {len(runs)} repeats; "
                           + next(c.get("skipped") or c.get("failed") for c in runs if "own_mib" not in c)
                   for method, runs in cells.items() if method not in why and not all("own_mib" in c for c in runs)}
        bases = sorted({c["memory_basis"] for runs in cells.values() for c in runs if "memory_basis" in c})
        results[str(length)] = {"cells": cells, "compared": by_key, "not_run": why, "partial": partial,
                                "memory_basis": bases}
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=CHOICES,
                   help="the methods to compare (sinusoidal, every ratio's baseline, is always measured; default: "
                   "every method of the registry and alibi+ssmax, less those that cannot be built at --layers)")
    p.add_argument("--attention-dropout", type=float, nargs="*", default=[0.0, 0.1],
                   help="the training runs' attention dropouts (none: no training)")
    p.add_argument("--repeats", type=positive, default=3, help="runs per (method, attention dropout) and cells per "
                   "(method, length)")
    p.add_argument("--updates", type=positive, default=30, help="updates per training run")
    p.add_argument("--skip", type=int, default=5, help="warm-up updates not counted")
    p.add_argument("--length", type=positive, default=64, help="L, --tokens-per-sample")
    p.add_argument("--max-tokens", type=positive, default=2048, help="tokens per update")
    p.add_argument("--layers", type=positive, default=2)
    p.add_argument("--embed-dim", type=positive, default=128)
    p.add_argument("--heads", type=positive, default=8)
    p.add_argument("--ffn", type=positive, default=512)
    p.add_argument("--words", type=positive, default=10420,
                   help="corpus words (+4 fairseq specials: by default the embedded corpus's 10424 symbols)")
    p.add_argument("--data", help="train on this binarized directory instead of a corpus of random words")
    p.add_argument("--eval-multiples", type=positive, nargs="*", default=[8, 64],
                   help="evaluation lengths, x L (none: training only)")
    p.add_argument("--eval-calls", type=positive, default=2, help="timed forwards per evaluation cell")
    p.add_argument("--memory-only", action="store_true", help="evaluation cells measure memory, not time")
    p.add_argument("--threads", type=positive, default=1, help="threads of every run and cell")
    p.add_argument("--keep", help="keep the corpus and training logs in this directory")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--markdown", help="write the report here too")
    for hidden in ("--cell-method", "--dict-dir"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--cell-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cell-memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if not all(0 <= d < 1 for d in opts.attention_dropout):
        p.error(f"--attention-dropout takes probabilities in [0, 1), got {' '.join(map(str, opts.attention_dropout))}")
    if not opts.attention_dropout and not opts.eval_multiples:
        p.error("nothing to measure: give --attention-dropout (training) or --eval-multiples (evaluation) a value")
    if opts.memory_only and not opts.eval_multiples:
        p.error("--memory-only measures evaluation cells: give --eval-multiples a value")
    if opts.skip < 1 or opts.skip >= opts.updates:
        p.error(f"--skip must be in 1 .. {opts.updates - 1} (fewer than --updates {opts.updates}; fairseq logs the "
                f"first update's words/s as 0), got {opts.skip}")
    if problem := heads_problem(opts.embed_dim, opts.heads):
        p.error(problem)
    if opts.max_tokens < opts.length:
        p.error(f"--max-tokens {opts.max_tokens} must be at least --length {opts.length}: an update holds whole "
                "samples of L tokens")
    methods = [BASELINE] + [m for m in dict.fromkeys(opts.methods or DEFAULT_METHODS) if m != BASELINE]
    fit_methods_to_depth(p, opts, methods, optional=set() if opts.methods else set(DEFAULT_METHODS))
    return opts


def layer_objects(method: str, layers: int, heads: int, embed_dim: int, length: int) -> list:
    """The position object of each of ``method``'s ``layers`` layers, its params
    at their defaults, as its model builds them (``ConfigError`` where it cannot
    be built); none for the stock sinusoidal model."""
    from fairseq_alibi.core import positions
    from fairseq_alibi.core.scaling import Scaling

    position = position_of(method)
    if position not in positions.POSITIONS:
        return []  # the stock sinusoidal model
    params = {param.name: param.default for param in positions.POSITIONS[position].params}
    stack = positions.build(position, heads, embed_dim // heads, params, Scaling("none", train_length=length), layers)
    return [stack.at_layer(index).for_layer() for index in range(layers)]


def depth_problem(method: str, layers: int, heads: int, embed_dim: int, length: int) -> Optional[str]:
    """Why ``method`` cannot be built ``layers`` deep (a hybrid needs both
    kinds of layer), or with ``--ssmax`` (``<method>+ssmax`` of a method
    without a softmax: ``positions.ssmax_problem``), as a one-line error, or None."""
    from fairseq_alibi.core import positions
    from fairseq_alibi.core.errors import ConfigError

    problem = positions.ssmax_problem(position_of(method), True) if method_flags(method) else None
    if problem:
        return f"--methods {method}: {problem}"
    try:
        layer_objects(method, layers, heads, embed_dim, length)
    except ConfigError as err:
        return f"--methods {position_of(method)} with --layers {layers}: {err}"
    return None


def option_refusal(opts, method: str, attention_dropout: float, kernel: str = "auto") -> Optional[str]:
    """Why ``method``'s model, at ``opts``' sizes, refuses ``attention_dropout``
    or the kernel option ``kernel`` (``common.refusal``: an attention of its own
    takes neither), in words for its row; None where it takes both (the stock
    model, which has no kernel option, always)."""
    return refusal(layer_objects(method, opts.layers, opts.heads, opts.embed_dim, opts.length), kernel,
                   attention_dropout)


def trained_dropout(opts, method: str, attention_dropout: float):
    """``(the attention dropout method trains with, what its row says)`` in the
    column of ``attention_dropout``: that dropout and nothing; for a method
    that refuses it but takes none (an attention of its own), 0 and why, its
    other dropouts unchanged (``DROPOUT``), paired with the others' runs of the
    column as usual; ``(None, why)`` where it refuses even 0 (not run)."""
    refused = option_refusal(opts, method, attention_dropout)
    if refused is None:
        return attention_dropout, None
    if option_refusal(opts, method, 0.0) is None:
        return 0.0, f"{refused}; trained at attention dropout 0, its other dropouts {DROPOUT}"
    return None, refused


def fit_methods_to_depth(p: argparse.ArgumentParser, opts, methods: Sequence[str], optional: Set[str]) -> None:
    """Set ``opts.methods`` to ``methods`` less those that cannot be built
    ``opts.layers`` deep, before any run starts: a method the user named is a
    usage error; one that came from a default (``optional``) is left out, its
    reason in ``opts.left_out`` for the report (the issue's own command has one
    layer, which RNoPE cannot have)."""
    opts.methods, opts.left_out = [], {}
    for method in methods:
        problem = depth_problem(method, opts.layers, opts.heads, opts.embed_dim, opts.length)
        if problem and method not in optional:
            p.error(problem)
        if problem:
            opts.left_out[method] = problem
            print(f"note: {method} left out: {problem}", file=sys.stderr)
        else:
            opts.methods.append(method)


def dictionary_size(data: str) -> int:
    """Symbols of a binarized directory's dictionary, fairseq's 4 specials included."""
    with open(os.path.join(data, "dict.txt"), encoding="utf-8") as f:
        return 4 + sum(1 for line in f if line.strip())


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.cell_method:
        print("CELL " + json.dumps(run_cell(opts)), flush=True)
        return 0
    os.environ.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads))
    import torch

    torch.set_num_threads(opts.threads)
    start, loads = time.time(), [os.getloadavg()[0]]
    command = "python benchmarks/positions_cost.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    workdir = opts.keep or tempfile.mkdtemp(prefix="positions_cost_")
    os.makedirs(workdir, exist_ok=True)
    data = opts.data or make_corpus(workdir, opts.words, tokens=2 * (opts.updates + 2) * opts.max_tokens)
    opts.vocab = dictionary_size(data)
    progress(start, f"{len(opts.methods)} methods, {opts.repeats} repeat(s); corpus {data}")
    try:
        train = measure_training(opts, data, workdir, start)
    except RunFailed as err:  # the run's own error line; the directory stays for its log
        print(f"error: {err}", file=sys.stderr)
        return 1
    evaluation = measure_evaluation(opts, data, start)
    loads.append(os.getloadavg()[0])
    report = render(opts, command, loads, train, evaluation)
    print(report, flush=True)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write(report)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"command": command, "code": code_version(), "machine": machine_description(),
                       "torch": torch.__version__,
                       "threads": opts.threads, "load_average": loads, "config": vars(opts), "train": train,
                       "eval": evaluation, "markdown": report}, f, indent=1)
    if not opts.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    failed = any("failed" in c for result in evaluation.values() for runs in result["cells"].values() for c in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
