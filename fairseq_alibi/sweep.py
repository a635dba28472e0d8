"""``alibi-sweep``: perplexity over a grid of evaluation lengths and context-extension methods.

The grid is checkpoints x methods x evaluation modes x lengths:

* **checkpoints**: ``NAME=PATH`` (or just ``PATH``; the name is then the file's
  directory).  ALiBi checkpoints (``transformer_lm_alibi``) take every method;
  any other language model (e.g. the stock sinusoidal ``transformer_lm``) is
  evaluated with ``none`` only, with ``max_target_positions`` and
  ``tokens_per_sample`` overridden so that fairseq does not silently drop every
  window longer than the training length;
* **methods**: ``none``; ``linear:F`` / ``ntk:F`` (static factor F >= 1);
  ``linear`` / ``ntk`` (dynamic, ``max(1, length / train_length)``; also
  written ``linear:dynamic``);
* **modes**: ``nonoverlapping`` (windows of ``length`` tokens, each token
  scored once with the context available inside its window) and ``sliding``
  (windows of ``length`` tokens advanced by ``--stride``; the last ``stride``
  tokens of each window are scored, so each has at least ``length - stride``
  tokens of context).  Sliding with stride S at length L is exactly
  ``fairseq-eval-lm --tokens-per-sample L --context-window (L - S)``;
* **lengths**: absolute (``64,128``) or relative to each checkpoint's training
  length (``1x,2x,16x``).

Evaluation runs in-process with fairseq's own pieces (eval-lm argument parser,
``load_model_ensemble_and_task`` with the overrides ``--model-overrides``
would pass, the task's ``eval_lm_dataloader`` and ``SequenceScorer``), loading
each model once per checkpoint and method.  ``loss`` is fairseq-eval-lm's:
mean negative log-likelihood per token in base 2, and ``ppl = 2 ** loss``.

Outputs in ``--output-dir``: ``results.json`` (every cell; the resume state),
``results.csv``, ``results.md`` (a table per mode, perplexity by length),
``perplexity.png``, and with ``--per-position`` ``per_position.csv`` and
``per_position.png`` (mean loss by token position within the window).  Cells
already in ``results.json`` are skipped, so an interrupted sweep continues
where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger("fairseq_alibi.sweep")

MODES = ("nonoverlapping", "sliding")
ALIBI_MODEL = "transformer_lm_alibi"
DEFAULT_METHODS = "none,linear:2,linear,ntk:2,ntk"
RESULT_FIELDS = (
    "checkpoint", "method", "factor", "label", "mode", "length", "stride", "context_window",
    "length_ratio", "train_length", "subset", "loss", "ppl", "tokens", "seconds",
)


class SweepError(ValueError):
    """Bad input to the sweep (missing files, bad names), explained for the user."""


# --------------------------------------------------------------------------- grid


@dataclass(frozen=True)
class Method:
    name: str  # none | linear | ntk
    factor: float  # 1 for none, 0 for dynamic, else the static factor

    @property
    def label(self) -> str:
        if self.name == "none":
            return "none"
        if self.factor == 0:
            return f"{self.name} dynamic"
        return f"{self.name} x{self.factor:g}"

    def overrides(self) -> dict:
        return {"alibi_interpolation": self.name, "alibi_scale_factor": float(self.factor if self.name != "none" else 0.0)}


def parse_methods(spec: str) -> List[Method]:
    """``none,linear:2,linear,ntk:4,ntk:dynamic`` -> methods (order kept, duplicates dropped)."""
    from .alibi import INTERPOLATION_METHODS

    methods: List[Method] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, arg = item.partition(":")
        name = name.strip().lower()
        if name not in INTERPOLATION_METHODS:
            raise SweepError(
                f"unknown method {item!r}: use none, linear[:FACTOR|:dynamic] or ntk[:FACTOR|:dynamic]"
            )
        if name == "none":
            if arg:
                raise SweepError(f"method 'none' takes no factor (got {item!r})")
            method = Method("none", 1.0)
        elif arg in ("", "dynamic", "dyn", "0"):
            method = Method(name, 0.0)
        else:
            try:
                factor = float(arg)
            except ValueError:
                raise SweepError(f"bad factor in method {item!r}: expected a number >= 1 or 'dynamic'")
            if not (factor >= 1.0) or math.isinf(factor):
                raise SweepError(f"bad factor in method {item!r}: a static factor must be >= 1")
            method = Method(name, factor)
        if method not in methods:
            methods.append(method)
    if not methods:
        raise SweepError("no methods given")
    return methods


def parse_lengths(spec: str) -> List[Tuple[str, float]]:
    """``64,128`` -> absolute; ``1x,16x`` -> relative to the training length."""
    out = []
    for item in (s.strip().lower() for s in spec.split(",")):
        if not item:
            continue
        try:
            if item.endswith("x"):
                value = float(item[:-1])
                kind = "x"
            else:
                value = int(item)
                kind = "abs"
        except ValueError:
            raise SweepError(f"bad length {item!r}: use integers (64) or multiples of the training length (4x)")
        if value <= 0:
            raise SweepError(f"bad length {item!r}: must be positive")
        out.append((kind, value))
    if not out:
        raise SweepError("no lengths given")
    return out


def resolve_lengths(lengths: Sequence[Tuple[str, float]], train_length: Optional[int]) -> List[int]:
    out = []
    for kind, value in lengths:
        if kind == "x":
            if not train_length:
                raise SweepError("relative lengths (Nx) need the checkpoint's training length, which it does not record")
            length = int(round(value * train_length))
        else:
            length = int(value)
        if length not in out:
            out.append(length)
    return sorted(out)


def parse_checkpoints(specs: Sequence[str]) -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            path = spec
            name = os.path.basename(os.path.dirname(os.path.abspath(spec))) or os.path.basename(spec)
        if not os.path.isfile(path):
            raise SweepError(f"checkpoint not found: {path}")
        if any(n == name for n, _ in out):
            raise SweepError(f"two checkpoints named {name!r}: name them with NAME=PATH")
        out.append((name, path))
    if not out:
        raise SweepError("no checkpoints given")
    return out


def check_data(data: str, subset: str) -> None:
    if not os.path.isdir(data):
        raise SweepError(f"data directory not found: {data}")
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise SweepError(f"no dict.txt in {data}: not a fairseq-preprocess output directory")
    if not (os.path.isfile(os.path.join(data, f"{subset}.bin")) and os.path.isfile(os.path.join(data, f"{subset}.idx"))):
        raise SweepError(f"subset {subset!r} not found in {data} (expected {subset}.bin and {subset}.idx)")


def cell_key(cell: dict) -> tuple:
    return (
        cell["checkpoint"], cell["method"], float(cell["factor"]), cell["mode"],
        int(cell["length"]), int(cell["stride"]), cell["subset"],
    )


# --------------------------------------------------------------------------- checkpoint info


@dataclass
class CheckpointInfo:
    name: str
    path: str
    model: str  # registered model name
    alibi: bool
    train_length: Optional[int]


def inspect_checkpoint(name: str, path: str) -> CheckpointInfo:
    from fairseq import checkpoint_utils

    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
    except Exception as exc:
        raise SweepError(f"cannot load checkpoint {path}: {exc}") from exc
    cfg = state.get("cfg")
    if cfg is None or cfg.get("model") is None:
        raise SweepError(f"{path} has no model configuration: not a fairseq checkpoint?")
    model_cfg, task_cfg = cfg.model, cfg.get("task") or {}
    model_name = model_cfg.get("_name") or model_cfg.get("arch") or "?"
    alibi = model_name == ALIBI_MODEL or "alibi_interpolation" in model_cfg
    train_length = None
    for source, key in ((model_cfg, "alibi_train_length"), (task_cfg, "tokens_per_sample"), (model_cfg, "tokens_per_sample")):
        try:
            value = source.get(key)
        except Exception:  # unresolved interpolation
            value = None
        if isinstance(value, int) and value > 0:
            train_length = value
            break
    if not alibi and model_cfg.get("decoder_learned_pos"):
        logger.warning("%s uses learned positions: it cannot be evaluated past its table", path)
    return CheckpointInfo(name, path, model_name, alibi, train_length)


# --------------------------------------------------------------------------- evaluation


def _eval_cfg(data, path, length, context, subset, max_tokens, batch_size, cpu, overrides):
    """The config fairseq-eval-lm would build from the equivalent command line."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [
        data, "--path", path, "--gen-subset", subset,
        "--tokens-per-sample", str(length), "--context-window", str(context),
        "--model-overrides", repr(overrides), "--num-workers", "0",
    ]
    if max_tokens:
        argv += ["--max-tokens", str(max_tokens)]
    if batch_size:
        argv += ["--batch-size", str(batch_size)]
    if cpu:
        argv += ["--cpu"]
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    if context > 0:  # what fairseq_cli.eval_lm.main does before building the task
        cfg.task.tokens_per_sample -= context
    return cfg


class Evaluator:
    """One model (checkpoint + method) evaluated at several lengths and strides."""

    def __init__(self, info: CheckpointInfo, method: Method, data: str, subset: str,
                 max_length: int, max_tokens: Optional[int], batch_size: Optional[int], cpu: bool):
        import torch
        from fairseq import checkpoint_utils, tasks

        self.info, self.method, self.data, self.subset = info, method, data, subset
        self.max_tokens, self.batch_size, self.cpu = max_tokens, batch_size, cpu
        if info.alibi:
            self.overrides = method.overrides()
        else:
            if method.name != "none":
                raise SweepError(f"{info.name}: interpolation methods apply to ALiBi models only")
            # Without these fairseq would skip every window longer than training.
            self.overrides = {"max_target_positions": max_length, "tokens_per_sample": max_length}
        cfg = _eval_cfg(data, info.path, max_length, 0, subset, max_tokens, batch_size, cpu, self.overrides)
        task = tasks.setup_task(cfg.task)
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
            [info.path], arg_overrides=self.overrides, task=task
        )
        self.model = models[0]
        self.use_cuda = torch.cuda.is_available() and not cpu
        if self.use_cuda:
            self.model.cuda()
        self.model.prepare_for_inference_(cfg)
        self.model.eval()

    def command(self, length: int, stride: int) -> str:
        """The equivalent fairseq-eval-lm command line (for the record)."""
        context = length - stride
        parts = [
            "fairseq-eval-lm", self.data, '--user-dir "$(alibi-user-dir)"', "--path", self.info.path,
            "--gen-subset", self.subset, "--tokens-per-sample", str(length),
        ]
        if context:
            parts += ["--context-window", str(context)]
        if self.max_tokens:
            parts += ["--max-tokens", str(self.max_tokens)]
        if self.batch_size:
            parts += ["--batch-size", str(self.batch_size)]
        if self.cpu:
            parts += ["--cpu"]
        parts += ["--model-overrides", '"' + repr(self.overrides) + '"']
        return " ".join(parts)

    def evaluate(self, length: int, stride: int, per_position: bool = False) -> dict:
        import torch
        from fairseq import tasks, utils
        from fairseq.sequence_scorer import SequenceScorer

        context = length - stride
        cfg = _eval_cfg(self.data, self.info.path, length, context, self.subset,
                        self.max_tokens, self.batch_size, self.cpu, self.overrides)
        start = time.perf_counter()
        task = tasks.setup_task(cfg.task)
        task.load_dataset(self.subset)
        dataset = task.dataset(self.subset)
        expected = int(dataset.sizes.sum())
        itr = task.eval_lm_dataloader(
            dataset=dataset,
            max_tokens=cfg.dataset.max_tokens or 36000,
            batch_size=cfg.dataset.batch_size,
            max_positions=utils.resolve_max_positions(self.model.max_positions()),
            num_shards=1, shard_id=0, num_workers=0,
            data_buffer_size=cfg.dataset.data_buffer_size,
            context_window=context,
        )
        scorer = SequenceScorer(task.target_dictionary, cfg.eval_lm.softmax_batch)
        remove_bos = getattr(cfg.task, "add_bos_token", False)
        score_sum, count = 0.0, 0
        pos_sum = torch.zeros(length, dtype=torch.float64)
        pos_count = torch.zeros(length, dtype=torch.float64)
        for sample in itr:
            if "net_input" not in sample:
                continue
            if self.use_cuda:
                sample = utils.move_to_cuda(sample)
            starts = sample.get("start_indices") or [0] * sample["target"].size(0)
            hypos = scorer.generate([self.model], sample)
            for i, hypos_i in enumerate(hypos):
                scores = hypos_i[0]["positional_scores"].float().cpu()
                offset = int(starts[i])
                if remove_bos:
                    scores, offset = scores[1:], offset + 1
                positions = torch.arange(offset, offset + scores.numel())
                finite = torch.isfinite(scores)
                if not bool(finite.all()):
                    scores, positions = scores[finite], positions[finite]
                score_sum += float(scores.double().sum())
                count += scores.numel()
                if per_position:
                    pos_sum.index_add_(0, positions, -scores.double())
                    pos_count.index_add_(0, positions, torch.ones_like(positions, dtype=torch.float64))
        seconds = time.perf_counter() - start
        if count == 0:
            raise SweepError(
                f"{self.info.name}: no tokens were evaluated at length {length} "
                "(every window was longer than the model accepts?)"
            )
        if count != expected and not remove_bos:
            logger.warning("%s at length %d scored %d of %d tokens", self.info.name, length, count, expected)
        loss = -score_sum / count / math.log(2)
        result = {"loss": loss, "ppl": 2.0 ** loss, "tokens": count, "seconds": seconds}
        if per_position:
            mean = (pos_sum / pos_count.clamp(min=1)) / math.log(2)
            result["per_position"] = [round(float(v), 6) if c > 0 else None for v, c in zip(mean, pos_count)]
            result["per_position_count"] = [int(c) for c in pos_count]
        return result


# --------------------------------------------------------------------------- outputs


def load_results(path: str) -> List[dict]:
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise SweepError(f"cannot read previous results {path}: {exc} (delete it to start over)")
    return list(data.get("cells", []))


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, cells: List[dict], meta: dict) -> None:
    _atomic_write(path, json.dumps({"meta": meta, "cells": cells}, indent=1) + "\n")


def write_csv(path: str, cells: List[dict]) -> None:
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=RESULT_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for cell in cells:
        row = dict(cell)
        for key in ("loss", "ppl", "seconds", "length_ratio"):
            row[key] = f"{cell[key]:.6g}" if cell.get(key) is not None else ""
        writer.writerow(row)
    _atomic_write(path, buf.getvalue())


def write_per_position_csv(path: str, cells: List[dict]) -> None:
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["checkpoint", "label", "mode", "length", "stride", "position", "loss", "tokens"])
    for cell in cells:
        for pos, (loss, n) in enumerate(zip(cell.get("per_position") or [], cell.get("per_position_count") or [])):
            if n:
                w.writerow([cell["checkpoint"], cell["label"], cell["mode"], cell["length"], cell["stride"], pos, f"{loss:.6f}", n])
    _atomic_write(path, buf.getvalue())


def _sorted_cells(cells: Iterable[dict]) -> List[dict]:
    return sorted(cells, key=lambda c: (c["checkpoint"], c["mode"], c["method"], c["factor"], c["length"], c["stride"]))


def markdown_table(cells: List[dict]) -> str:
    """One table per (mode, subset): a row per checkpoint+method, a column per length."""
    out = []
    groups: Dict[tuple, List[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["mode"], cell["subset"], cell["stride"] if cell["mode"] == "sliding" else None), []).append(cell)
    for (mode, subset, stride), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        lengths = sorted({c["length"] for c in group})
        rows: Dict[tuple, Dict[int, dict]] = {}
        for c in group:
            rows.setdefault((c["checkpoint"], c["method"], c["factor"], c["label"], c["train_length"]), {})[c["length"]] = c
        title = f"{mode}" + (f", stride {stride}" if stride else "") + f" ({subset} perplexity)"
        out.append(f"### {title}\n")
        out.append("| checkpoint | method | L train | " + " | ".join(str(n) for n in lengths) + " |")
        out.append("|---|---|---|" + "---|" * len(lengths))
        for (ckpt, _, _, label, train_length), by_len in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            vals = []
            for n in lengths:
                c = by_len.get(n)
                vals.append(f"{c['ppl']:.2f}" if c else "")
            out.append(f"| {ckpt} | {label} | {train_length or ''} | " + " | ".join(vals) + " |")
        out.append("")
    return "\n".join(out)


def _line_key(c: dict) -> tuple:
    return (c["checkpoint"], c["method"], c["factor"], c["label"])


def plot_perplexity(path: str, cells: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["mode"], c["stride"] if c["mode"] == "sliding" else 0, c["subset"]) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, (mode, stride, subset) in zip(axes[0], panels):
        group = [c for c in cells if c["mode"] == mode and c["subset"] == subset and (mode != "sliding" or c["stride"] == stride)]
        lines: Dict[tuple, List[dict]] = {}
        for c in group:
            lines.setdefault(_line_key(c), []).append(c)
        ppls = [c["ppl"] for c in group]
        for key in sorted(lines):
            pts = sorted(lines[key], key=lambda c: c["length"])
            style = "-" if key[1] == "none" else "--"
            ax.plot([c["length"] for c in pts], [c["ppl"] for c in pts], style, marker="o", ms=3,
                    label=f"{key[0]}: {key[3]}")
        for train_length in sorted({c["train_length"] for c in group if c["train_length"]}):
            ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        if ppls and max(ppls) / max(min(ppls), 1e-9) > 4:
            ax.set_yscale("log")
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel(f"{subset} perplexity")
        ax.set_title(mode + (f", stride {stride}" if mode == "sliding" else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_position(path: str, cells: List[dict]) -> None:
    """Mean loss by position at each line's longest evaluated length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in cells if c.get("per_position")]
    if not cells:
        return
    panels = sorted({(c["mode"], c["stride"] if c["mode"] == "sliding" else 0) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, (mode, stride) in zip(axes[0], panels):
        longest: Dict[tuple, dict] = {}
        for c in cells:
            if c["mode"] != mode or (mode == "sliding" and c["stride"] != stride):
                continue
            key = _line_key(c)
            if key not in longest or c["length"] > longest[key]["length"]:
                longest[key] = c
        for key in sorted(longest):
            c = longest[key]
            pts = [(i, v) for i, v in enumerate(c["per_position"]) if v is not None]
            # Average into at most 128 bins so that long windows stay readable.
            width = max(1, len(c["per_position"]) // 128)
            xs, ys = [], []
            for b in range(0, len(pts), width):
                chunk = pts[b:b + width]
                xs.append(sum(p for p, _ in chunk) / len(chunk))
                ys.append(sum(v for _, v in chunk) / len(chunk))
            ax.plot(xs, ys, lw=1, label=f"{key[0]}: {key[3]} (L={c['length']})")
        for train_length in sorted({c["train_length"] for c in longest.values() if c["train_length"]}):
            ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("token position within the window")
        ax.set_ylabel("mean loss (bits)")
        ax.set_title(mode + (f", stride {stride}" if mode == "sliding" else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(outdir: str, cells: List[dict], meta: dict) -> None:
    cells = _sorted_cells(cells)
    write_json(os.path.join(outdir, "results.json"), cells, meta)
    write_csv(os.path.join(outdir, "results.csv"), cells)
    _atomic_write(os.path.join(outdir, "results.md"), markdown_table(cells))
    if cells:
        plot_perplexity(os.path.join(outdir, "perplexity.png"), cells)
    if any(c.get("per_position") for c in cells):
        write_per_position_csv(os.path.join(outdir, "per_position.csv"), cells)
        plot_per_position(os.path.join(outdir, "per_position.png"), cells)


# --------------------------------------------------------------------------- driver


@dataclass
class Plan:
    info: CheckpointInfo
    method: Method
    mode: str
    length: int
    stride: int


def build_plan(infos: List[CheckpointInfo], methods: List[Method], modes: List[str],
               lengths: List[Tuple[str, float]], stride: Optional[int]) -> Tuple[List[Plan], List[str]]:
    plans, notes = [], []
    for info in infos:
        these = resolve_lengths(lengths, info.train_length)
        usable = methods if info.alibi else [m for m in methods if m.name == "none"]
        if not info.alibi and len(usable) < len(methods):
            notes.append(f"{info.name} ({info.model}) is not an ALiBi model: evaluated with 'none' only")
        if not usable:
            usable = [Method("none", 1.0)]
        for method in usable:
            for mode in modes:
                for length in these:
                    if mode == "nonoverlapping":
                        plans.append(Plan(info, method, mode, length, length))
                    elif stride >= length:
                        notes.append(f"sliding stride {stride} >= length {length}: same as nonoverlapping, skipped")
                    else:
                        plans.append(Plan(info, method, mode, length, stride))
    return plans, sorted(set(notes), key=notes.index)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alibi-sweep",
        description="Perplexity of fairseq language models over evaluation lengths x ALiBi "
        "context-extension methods x evaluation modes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  alibi-sweep data-bin/embedded --checkpoint alibi=ck/alibi.pt "
        "--checkpoint sin=ck/sin.pt \\\n      --lengths 1x,2x,4x,8x,16x --methods none,linear:2,linear,ntk:2,ntk "
        "--modes nonoverlapping,sliding --stride 32 --output-dir outputs/sweep --cpu",
    )
    p.add_argument("data", help="fairseq-preprocess output directory")
    p.add_argument("--checkpoint", "-c", action="append", default=[], metavar="[NAME=]PATH",
                   help="a checkpoint to evaluate (repeatable)")
    p.add_argument("--lengths", default="1x,2x,4x,8x,16x",
                   help="evaluation lengths: integers, or Nx = N times the training length (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="none | linear[:F|:dynamic] | ntk[:F|:dynamic], comma-separated (default: %(default)s)")
    p.add_argument("--modes", default="nonoverlapping", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (scored tokens per window)")
    p.add_argument("--subset", default="valid", help="split to evaluate (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per batch as fairseq-eval-lm counts them (default: 4 x the longest length)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch")
    p.add_argument("--per-position", action="store_true", help="also record mean loss by position in the window")
    p.add_argument("--output-dir", "-o", default="outputs/sweep", help="(default: %(default)s)")
    p.add_argument("--cpu", action="store_true", help="evaluate on CPU even if CUDA is available")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep fairseq's INFO logging")
    return p


def run(args: argparse.Namespace) -> List[dict]:
    methods = parse_methods(args.methods)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SweepError(f"unknown mode(s) {bad or modes}: choose from {', '.join(MODES)}")
    if "sliding" in modes and (args.stride is None or args.stride < 1):
        raise SweepError("--modes sliding needs --stride N (N >= 1 tokens scored per window)")
    lengths = parse_lengths(args.lengths)
    checkpoints = parse_checkpoints(args.checkpoint)
    check_data(args.data, args.subset)

    import fairseq_alibi  # noqa: F401  (registers the ALiBi models)

    infos = [inspect_checkpoint(name, path) for name, path in checkpoints]
    plans, notes = build_plan(infos, methods, modes, lengths, args.stride)
    for note in notes:
        logger.info(note)
    os.makedirs(args.output_dir, exist_ok=True)
    results_path = os.path.join(args.output_dir, "results.json")
    cells = load_results(results_path)
    done = {cell_key(c): c for c in cells}

    def key_of(plan: Plan) -> tuple:
        return (plan.info.name, plan.method.name, float(plan.method.factor), plan.mode, plan.length, plan.stride, args.subset)

    todo = [p for p in plans if key_of(p) not in done or (args.per_position and not done[key_of(p)].get("per_position"))]
    logger.info("%d cells in the grid, %d already done, %d to run", len(plans), len(plans) - len(todo), len(todo))
    meta = {"data": os.path.abspath(args.data), "subset": args.subset, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size}

    from tqdm import tqdm

    bar = tqdm(total=len(plans), initial=len(plans) - len(todo), disable=args.no_progress,
               desc="sweep", unit="cell", dynamic_ncols=True, file=sys.stderr)
    evaluator: Optional[Evaluator] = None
    for plan in todo:
        bar.set_postfix_str(f"{plan.info.name} {plan.method.label} {plan.mode} L={plan.length}")
        if evaluator is None or evaluator.info is not plan.info or evaluator.method != plan.method:
            evaluator = None  # free the previous model first
            max_len = max(p.length for p in plans if p.info is plan.info)
            max_tokens = args.max_tokens or 4 * max_len
            evaluator = Evaluator(plan.info, plan.method, args.data, args.subset, max_len,
                                  max_tokens, args.batch_size, args.cpu)
        result = evaluator.evaluate(plan.length, plan.stride, per_position=args.per_position)
        cell = {
            "checkpoint": plan.info.name, "path": plan.info.path, "model": plan.info.model,
            "method": plan.method.name, "factor": float(plan.method.factor), "label": plan.method.label,
            "mode": plan.mode, "length": plan.length, "stride": plan.stride,
            "context_window": plan.length - plan.stride,
            "length_ratio": plan.length / plan.info.train_length if plan.info.train_length else None,
            "train_length": plan.info.train_length, "subset": args.subset,
            "command": evaluator.command(plan.length, plan.stride),
            **result,
        }
        done[key_of(plan)] = cell
        write_json(results_path, _sorted_cells(done.values()), meta)  # resume point after every cell
        bar.update(1)
        bar.write(f"{cell['checkpoint']:>12} {cell['label']:>14} {cell['mode']:>14} L={cell['length']:<6} "
                  f"stride={cell['stride']:<6} ppl={cell['ppl']:.2f} ({cell['tokens']} tokens, {cell['seconds']:.1f}s)")
    bar.close()
    cells = list(done.values())
    write_outputs(args.output_dir, cells, meta)
    return _sorted_cells(cells)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stderr, force=True)
    for name in ("matplotlib", "PIL", "hydra"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not args.verbose:
        for name in ("fairseq", "fairseq_cli"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        cells = run(args)
    except SweepError as exc:
        sys.stderr.write(f"alibi-sweep: error: {exc}\n")
        return 2
    print(markdown_table([c for c in cells if c["subset"] == args.subset]))
    print(f"results in {args.output_dir}/ (results.csv, results.json, results.md, perplexity.png"
          + (", per_position.csv, per_position.png" if args.per_position else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
