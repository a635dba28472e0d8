"""``alibi-sweep``: perplexity over a grid of evaluation lengths and context-extension methods.

The grid is checkpoints x methods x evaluation modes x lengths:

* **checkpoints**: ``NAME=PATH`` (or just ``PATH``; the name is then the file's
  directory).  Each model takes the methods that apply to its position method
  (``core/positions.py``; ``--help`` lists them: ALiBi's and RoPE's have
  several, the others ``none`` only); the stock sinusoidal ``transformer_lm``
  is evaluated with ``none``, with ``max_target_positions`` and
  ``tokens_per_sample`` overridden so that fairseq does not silently drop every
  window longer than the training length;
* **methods**: the ``--methods`` items of ``core/scaling.py`` (``METHOD_SYNTAX``):
  ``none``; ``linear:F`` / ``ntk:F`` (static factor F >= 1); ``linear`` /
  ``ntk`` (dynamic, ``max(1, length / train_length)``; also written
  ``linear:dynamic``); ``cap`` / ``cap:F`` (every distance above F training
  lengths counted as that distance) and the other distance methods;
* **modes**: ``nonoverlapping`` (windows of ``length`` tokens, each token
  scored once with the context available inside its window) and ``sliding``
  (windows of ``length`` tokens advanced by ``--stride``; the last ``stride``
  tokens of each window are scored, so each has at least ``length - stride``
  tokens of context, except in the first window, whose tokens are all scored
  with what precedes them in it).  Sliding with stride S at length L is exactly
  ``fairseq-eval-lm --tokens-per-sample L --context-window (L - S)``;
* **lengths**: absolute (``64,128``) or relative to each checkpoint's training
  length (``1x,2x,16x``), at most the evaluated text's token count (a longer
  window would be the whole text under a longer length's name: refused).

This module is the *measure* (what a cell is, how to run and report it); the
grid, resuming and loading are the runner's (``runner.py``), the models the
backend's (``backends.py``: fairseq's own pieces -- the eval-lm argument
parser, ``load_model_ensemble_and_task``, the task's ``eval_lm_dataloader`` and
``SequenceScorer``; ``hf_backend.py`` with ``--hf``; both in one grid and one
table with ``--checkpoint`` and ``--hf`` together).  Each model is loaded
once and put under each method in turn.  ``loss`` is fairseq-eval-lm's:
mean negative log-likelihood per token in base 2, and ``ppl = 2 ** loss``.

Outputs in ``--output-dir``: ``results.json`` (every cell; the resume state;
and ``paired``, the comparisons of cells that scored the same windows),
``results.csv``, ``results.md`` (a table per mode, perplexity by length with
its 95 % interval: a Student-t interval over the cell's windows,
``intervals.py``; then the paired changes against the baselines,
``paired.py``), ``perplexity.png`` (with the paired changes in a lower row of
panels), and with ``--per-position`` ``per_position.csv`` and
``per_position.png`` (mean loss by token position within the window).  Cells
already in ``results.json`` are skipped, so an interrupted sweep continues
where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..errors import EvaluationError, plural
from . import paired, report, runner
from .axes import check_max_tokens, method_rank, parse_lengths, resolve_lengths
from .backends import backend_for
from ..coverage import coverage_problem, longer_than_text
from .runner import tool_parser

logger = logging.getLogger("fairseq_alibi.sweep")

MODES = ("nonoverlapping", "sliding")  # the window modes
RESULT_FIELDS = (
    "checkpoint", "method", "factor", "alpha", "label", "mode", "length", "stride", "context_window",
    "length_ratio", "train_length", "subset", "loss", "ppl", "ppl_low", "ppl_high", "ppl_no_interval", "windows",
    "tokens", "seconds",
)
FLOAT_FIELDS = ("loss", "ppl", "ppl_low", "ppl_high", "seconds", "length_ratio")


@dataclass(frozen=True)
class WindowCell:
    """One cell of ``alibi-sweep``: the windows of one mode, length and stride."""

    mode: str
    length: int
    stride: int
    subset: str
    max_tokens: Optional[int]  # per batch (None: the backend's own batching)

    @property
    def key(self) -> tuple:
        return (self.mode, self.length, self.stride, self.subset)

    @property
    def label(self) -> str:
        return f"{self.mode} L={self.length}"


class Perplexity:
    """The measure of ``alibi-sweep``: one cell is (window mode, length, stride)
    of one model under one method; its numbers are fairseq-eval-lm's (mean
    negative log-likelihood per token in base 2, ``ppl = 2 ** loss``)."""

    tool = "alibi-sweep"

    @staticmethod
    def backend_for(args):
        return backend_for(args, subset=args.subset)

    def __init__(self, args, backend):
        self.backend = backend
        self.modes = parse_modes(args)
        self.lengths = parse_lengths(args.lengths)
        self.stride, self.per_position = args.stride, args.per_position
        self.hf = bool(args.hf)
        self.max_tokens, self.batch_size = check_batching(args)
        text_file = self.hf and not os.path.isdir(args.data or "")  # else a split of a data directory
        self.subset = os.path.basename(args.data) if text_file else args.subset
        self.data = os.path.abspath(args.data)

    def settings_identity(self) -> str:
        return f"{self.max_tokens}|{self.batch_size}"

    def meta(self) -> dict:
        meta = {"data": self.data, "subset": self.subset, "max_tokens": self.max_tokens,
                "batch_size": self.batch_size}
        return dict(meta, hf=True) if self.hf else meta

    def cells(self, described) -> List[WindowCell]:
        """Every (mode, length) of one model, validated before anything runs."""
        info = described.info
        lengths = resolve_lengths(self.lengths, info.train_length, info.name)
        check_lengths(info.name, lengths, self.stride if "sliding" in self.modes else None, self.max_tokens,
                      self.backend.text_tokens(described), self.subset)
        max_tokens = None if info.model.startswith("hf:") else self.max_tokens or 4 * max(lengths)
        return [WindowCell(mode, length, length if mode == "nonoverlapping" else self.stride, self.subset, max_tokens)
                for mode in self.modes for length in lengths]

    @staticmethod
    def max_length(cells: List[WindowCell]) -> int:
        return max(cell.length for cell in cells)

    def needs_run(self, stored: Optional[dict]) -> bool:
        return stored is None or (self.per_position and not stored.get("per_position"))

    @staticmethod
    def cell_key(record: dict) -> tuple:
        return (record["mode"], int(record["length"]), int(record["stride"]), record["subset"])

    @staticmethod
    def order(record: dict) -> tuple:
        return (record["checkpoint"], record["mode"], record["method"], record["factor"], record.get("alpha") or 0,
                record["length"], record["stride"])

    def run(self, model, method, cell: WindowCell) -> dict:
        mode, length, stride = cell.mode, cell.length, cell.stride
        start = time.perf_counter()
        settings = dict(max_tokens=cell.max_tokens, batch_size=self.batch_size)
        expected, scored = model.windows(length, stride, **settings)
        result = score_tokens(scored, length, self.per_position, f"{model.info.name} ({method.label}, L={length})")
        infinite = result.pop("infinite")  # scored, left out of the average (warned): not stored
        if expected is not None:
            problem = coverage_problem(result["tokens"] + infinite, expected, self.subset)
            if problem:
                raise EvaluationError(f"{model.info.name} ({method.label}, L={length}): {problem}")
        train_length = model.info.train_length
        return dict(mode=mode, length=length, stride=stride, context_window=length - stride,
                    length_ratio=length / train_length if train_length else None, subset=self.subset,
                    command=model.command(length, stride, **settings), **result,
                    seconds=time.perf_counter() - start)

    @staticmethod
    def log_line(cell: dict) -> str:
        estimate = report.ppl_estimate(cell)
        return (f"{cell['checkpoint']:>12} {cell['label']:>14} {cell['mode']:>14} L={cell['length']:<6} "
                f"stride={cell['stride']:<6} ppl={cell['ppl']:.2f}{report.estimate_bounds(estimate)} "
                f"({cell['tokens']} tokens, {cell['seconds']:.1f}s)")

    def table(self, cells: List[dict], rank) -> str:
        """The printed summary: the tables of the evaluated subset, paired comparisons included."""
        cells = report.with_ppl_intervals([c for c in cells if c["subset"] == self.subset])
        return report.perplexity_table(cells, rank, paired.comparisons(cells, rank))

    def report(self, outdir: str, cells: List[dict], methods) -> dict:
        """CSV, Markdown and plots of every cell (tables and legends in --methods order);
        returns what ``results.json`` adds to the cells: their intervals, and the
        paired comparisons of cells that scored the same windows (``paired``)."""
        rank = method_rank(methods)
        cells = report.with_ppl_intervals(cells)
        pairs = paired.comparisons(cells, rank)
        report.write_csv(os.path.join(outdir, "results.csv"), cells, RESULT_FIELDS, FLOAT_FIELDS)
        report.atomic_write(os.path.join(outdir, "results.md"), report.perplexity_table(cells, rank, pairs))
        if cells:
            report.plot_perplexity(os.path.join(outdir, "perplexity.png"), cells, rank, pairs)
        if any(c.get("per_position") for c in cells):
            report.write_per_position_csv(os.path.join(outdir, "per_position.csv"), cells)
            report.plot_per_position(os.path.join(outdir, "per_position.png"), cells, rank)
        return {"cells": cells, "paired": pairs}


def check_lengths(name: str, lengths: List[int], stride: Optional[int], max_tokens: Optional[int], available: int,
                  text: str) -> None:
    """A model's evaluation lengths (sorted), before anything runs: above the
    sliding stride, within one batch, within the evaluated text."""
    if stride is not None and stride >= min(lengths):
        raise EvaluationError(
            f"--stride {stride} is not below every evaluation length of {name} (shortest: {min(lengths)}); a "
            "sliding window scores its last STRIDE tokens, so choose a stride smaller than the shortest length"
        )
    check_max_tokens(max_tokens, max(lengths), f"the longest evaluation length of {name}", "one window")
    problem = longer_than_text(lengths, available, text)
    if problem:
        raise EvaluationError(f"{name}: {problem}")


def score_tokens(scored, length: int, per_position: bool, where: str) -> dict:
    """Loss (base 2), perplexity and token count of scored windows (:class:`ScoredWindow`);
    ``-inf``/``+inf`` scores skipped with a warning as ``fairseq-eval-lm`` skips them; a
    NaN score or nothing scored at all stops the run (a number that is not a result).
    Per window, for the intervals: its summed loss (bits), tokens and index in the text;
    and ``text_digest``, which tokens were scored (cells compared window by window must
    have scored the same text)."""
    import torch

    total, count, skipped = 0.0, 0, 0
    window_loss, window_tokens, window_index = [], [], []
    digests = {}
    pos_sum = torch.zeros(length, dtype=torch.float64)
    pos_count = torch.zeros(length, dtype=torch.float64)
    for window in scored:
        scores, positions = window.scores, window.positions
        digests[window.index] = hashlib.sha256(window.targets.to(torch.int64).numpy().tobytes()).digest()
        if bool(torch.isnan(scores).any()):
            raise EvaluationError(
                f"{where}: the model's log-probabilities are NaN; its weights are damaged or it overflowed "
                "(evaluate in float32); nothing is reported for this cell"
            )
        finite = torch.isfinite(scores)
        if not bool(finite.all()):
            skipped += int((~finite).sum())
            scores, positions = scores[finite], positions[finite]
        summed = float(scores.double().sum())
        total += summed
        count += scores.numel()
        if scores.numel():
            window_loss.append(round(-summed / math.log(2), 6))
            window_tokens.append(scores.numel())
            window_index.append(window.index)
        if per_position:
            pos_sum.index_add_(0, positions, -scores.double())
            pos_count.index_add_(0, positions, torch.ones_like(positions, dtype=torch.float64))
    if skipped:
        logger.warning("%s: %d tokens with infinite scores skipped (as fairseq-eval-lm does)", where, skipped)
    if count == 0:
        raise EvaluationError(f"{where}: no token was scored (every window was longer than the model accepts, "
                              "or the subset is empty)")
    loss = -total / count / math.log(2)
    text = hashlib.sha256(b"".join(digests[i] for i in sorted(digests))).hexdigest()[:16]
    result = {"loss": loss, "ppl": 2.0 ** loss, "tokens": count, "window_loss": window_loss,
              "window_tokens": window_tokens, "window_index": window_index, "text_digest": text, "infinite": skipped}
    if per_position:
        mean = (pos_sum / pos_count.clamp(min=1)) / math.log(2)
        result["per_position"] = [round(float(v), 6) if c > 0 else None for v, c in zip(mean, pos_count)]
        result["per_position_count"] = [int(c) for c in pos_count]
    return result


def check_batching(args):
    """(--max-tokens, --batch-size): positive, and for fairseq checkpoints only."""
    if args.hf and not args.checkpoint and (args.max_tokens is not None or args.batch_size is not None):
        raise EvaluationError("--max-tokens and --batch-size apply to fairseq checkpoints; --hf models "
                              "score one window at a time")
    for name in ("max_tokens", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise EvaluationError(f"--{name.replace('_', '-')} {value} is not valid: a positive number")
    return args.max_tokens, args.batch_size


def parse_modes(args) -> List[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise EvaluationError(f"unknown {plural(len(bad or modes), 'mode')} {', '.join(bad or modes)}: choose from "
                              f"{', '.join(MODES)}")
    if "sliding" in modes and args.stride is None:
        raise EvaluationError("--modes sliding needs --stride N (N >= 1 tokens scored per window)")
    if args.stride is not None and args.stride < 1:
        raise EvaluationError(f"--stride {args.stride} is not valid: a positive number of tokens scored per window")
    if "sliding" not in modes and args.stride is not None:
        raise EvaluationError(f"--stride {args.stride} applies to --modes sliding only; add sliding to --modes")
    return modes


def get_parser() -> argparse.ArgumentParser:
    from ..arguments import position_keys_help

    p = tool_parser(
        "alibi-sweep", "Perplexity of language models over evaluation lengths x context-extension methods x "
        "evaluation modes.\n\n" + report.methods_by_position(),
        "example:\n  alibi-sweep data-bin/embedded --checkpoint alibi=ck/alibi.pt --checkpoint sin=ck/sin.pt "
        "\\\n      --lengths 1x,2x,4x,8x,16x --methods none,linear:2,linear,ntk:2,ntk,cap "
        "--modes nonoverlapping,sliding --stride 32 --output-dir outputs/sweep --cpu\n\n"
        "Each model runs as trained but for the method of --methods (the key\nposition_scaling of "
        "alibi-eval-lm --model-overrides), which also sets each\nposition method's per-pass keys:\n"
        + position_keys_help(width=79),
        "fairseq-preprocess output directory (with --hf alone also a raw text file)", "outputs/sweep",
    )
    p.add_argument("--lengths", default="1x,2x,4x,8x,16x",
                   help="evaluation lengths: integers (2k = 2048), or Nx = N times the training length "
                   "(default: %(default)s)")
    p.add_argument("--modes", default="nonoverlapping", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (scored tokens per window)")
    p.add_argument("--subset", default="valid", help="split to evaluate (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per batch as fairseq-eval-lm counts them (default: 4 x the longest length)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch")
    p.add_argument("--per-position", action="store_true", help="also record mean loss by position in the window")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return runner.main(argv, get_parser(), Perplexity)


if __name__ == "__main__":
    sys.exit(main())
