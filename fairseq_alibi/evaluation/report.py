"""Reports of the evaluation tools: CSV, Markdown tables and plots.

``results.json`` (the resume state) is written by ``runner.ResultStore``; this
module writes everything derived from the cells: ``results.csv``,
``results.md`` and the figures.  Tables and legends list the methods in the
order of ``--methods`` (``rank``: a record -> its method's place).
"""

from __future__ import annotations

import csv
import io
from typing import Callable, Dict, Iterable, List, Sequence

from .runner import atomic_write

Rank = Callable[[dict], int]

def write_csv(path: str, cells: List[dict], fields: Sequence[str], float_fields: Sequence[str] = ()) -> None:
    """One row per cell, the columns ``fields``; floats in ``float_fields`` to 6 digits."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for cell in cells:
        row = dict(cell)
        for key in float_fields:
            row[key] = f"{cell[key]:.6g}" if cell.get(key) is not None else ""
        writer.writerow(row)
    atomic_write(path, buf.getvalue())


def write_per_position_csv(path: str, cells: List[dict]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["checkpoint", "label", "mode", "length", "stride", "position", "loss", "tokens"])
    for cell in cells:
        for pos, (loss, n) in enumerate(zip(cell.get("per_position") or [], cell.get("per_position_count") or [])):
            if n:
                w.writerow([cell["checkpoint"], cell["label"], cell["mode"], cell["length"], cell["stride"], pos, f"{loss:.6f}", n])
    atomic_write(path, buf.getvalue())


def _row_order(rank: Rank):
    """Rows: by checkpoint, then the --methods order."""
    return lambda kv: (kv[0][0], rank({"method": kv[0][1], "factor": kv[0][2]}))


def _rows(cells: Iterable[dict]) -> Dict[tuple, List[dict]]:
    """Cells by table row: (checkpoint, method, factor, label, training length)."""
    rows: Dict[tuple, List[dict]] = {}
    for c in cells:
        rows.setdefault((c["checkpoint"], c["method"], c["factor"], c["label"], c.get("train_length")), []).append(c)
    return rows


def length_table(title: str, cells: List[dict], rank: Rank, value: Callable[[List[dict]], str]) -> List[str]:
    """A Markdown table: a row per checkpoint and method (--methods order), a
    column per length, ``value(cells of that length)`` in each."""
    lengths = sorted({c["length"] for c in cells})
    out = [f"### {title}\n", "| checkpoint | method | L train | " + " | ".join(str(n) for n in lengths) + " |",
           "|---|---|---|" + "---|" * len(lengths)]
    for (ckpt, _, _, label, train_length), row in sorted(_rows(cells).items(), key=_row_order(rank)):
        vals = [[c for c in row if c["length"] == n] for n in lengths]
        out.append(f"| {ckpt} | {label} | {train_length or ''} | " + " | ".join(value(v) if v else "" for v in vals)
                   + " |")
    return out + [""]


def perplexity_table(cells: List[dict], rank: Rank) -> str:
    """One table per (mode, subset): a row per checkpoint+method, a column per length."""
    out = []
    groups: Dict[tuple, List[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["mode"], cell["subset"], cell["stride"] if cell["mode"] == "sliding" else None), []).append(cell)
    for (mode, subset, stride), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        title = f"{mode}" + (f", stride {stride}" if stride else "") + f" ({subset} perplexity)"
        out += length_table(title, group, rank, lambda at: f"{at[0]['ppl']:.2f}")
    return "\n".join(out)


def _line_key(c: dict) -> tuple:
    return (c["checkpoint"], c["method"], c["factor"], c["label"])


def _lines_in_order(keys: Iterable[tuple], rank: Rank) -> List[tuple]:
    return sorted(keys, key=lambda k: (k[0], rank({"method": k[1], "factor": k[2]})))


def plot_perplexity(path: str, cells: List[dict], rank: Rank) -> None:
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
        for key in _lines_in_order(lines, rank):
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


#: Per-position points scored fewer times than this share of the most-scored
#: position are left out of the plot (a sliding window's first window scores its
#: early positions once: single tokens, mostly noise).
THIN_SHARE = 0.1


def position_bins(losses: Sequence, counts: Sequence[int]) -> List[tuple]:
    """(first, last, mean loss, tokens) of log2-spaced position bins [0], [1], [2, 3],
    [4, 7], ...: each bin's mean weighs every scored token once, so far positions,
    scored as often as near ones but individually noisy, pool into readable points.
    Positions scored fewer than ``THIN_SHARE`` x the most-scored one's count are left out."""
    floor = max(counts) * THIN_SHARE
    out, first = [], 0
    while first < len(losses):
        last = min(len(losses), max(1, 2 * first)) - 1
        kept = [(v, n) for v, n in zip(losses[first:last + 1], counts[first:last + 1]) if v is not None and n >= floor]
        tokens = sum(n for _, n in kept)
        if tokens:
            out.append((first, last, sum(v * n for v, n in kept) / tokens, tokens))
        first = last + 1
    return out


def plot_per_position(path: str, cells: List[dict], rank: Rank) -> None:
    """Mean loss by token position (log2 bins of positions) at each line's longest
    evaluated length, the training length marked."""
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
        for key in _lines_in_order(longest, rank):
            c = longest[key]
            bins = position_bins(c["per_position"], c.get("per_position_count") or [1] * len(c["per_position"]))
            ax.plot([(lo + hi) / 2 + 1 for lo, hi, _, _ in bins], [v for _, _, v, _ in bins], marker="o", ms=3,
                    lw=1, ls="-" if key[1] == "none" else "--", label=f"{key[0]}: {key[3]} (L={c['length']})")
        for train_length in sorted({c["train_length"] for c in longest.values() if c["train_length"]}):
            ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token position within the window (log2 bins; dotted: training length)")
        ax.set_ylabel("mean loss (bits)")
        ax.set_title(mode + (f", stride {stride}" if mode == "sliding" else "")
                     + f" (positions scored < {THIN_SHARE:.0%} as often as the most left out)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ retrieval


def _pool(cells: Iterable[dict]) -> tuple:
    """(correct, n, n-weighted mean log-prob) of cells pooled together."""
    cells = list(cells)
    n = sum(c["n"] for c in cells)
    correct = sum(c["correct"] for c in cells)
    logprob = sum(c["answer_logprob"] * c["n"] for c in cells) / n if n else float("nan")
    return correct, n, logprob


def retrieval_tables(cells: List[dict], rank: Rank) -> str:
    """Per task: accuracy (%) by length, all depths pooled; the answer's mean log-prob
    by length; and, for JSONL tasks with groups, accuracy by group."""
    out = []
    for task in sorted({c["task"] for c in cells}):
        group = [c for c in cells if c["task"] == task]
        lengths = sorted({c["length"] for c in group})
        rows = _rows(group)
        depths = sorted({c["depth"] for c in group if c.get("depth") is not None})
        pooled = f", {len(depths)} depths pooled" if depths else ""
        for title, fmt in (("accuracy %", lambda k, n, lp: f"{100.0 * k / n:.0f}"),
                           ("mean answer log-prob", lambda k, n, lp: f"{lp:.2f}")):
            if len(lengths) <= 24:  # prompt files of many lengths: no length columns
                out += length_table(f"{task}: {title} by prompt length (tokens{pooled})", group, rank,
                                    lambda at, fmt=fmt: fmt(*_pool(at)))
        groups = sorted({c.get("group", "") for c in group})
        if groups != [""] or len(lengths) > 24:
            out.append(f"### {task}: accuracy % by group (n prompts)\n")
            out.append("| checkpoint | method | " + " | ".join(g or "(none)" for g in groups) + " | all |")
            out.append("|---|---|" + "---|" * (len(groups) + 1))
            for (ckpt, _, _, label, _), row in sorted(rows.items(), key=_row_order(rank)):
                vals = []
                for g in groups + [None]:
                    k, n, _ = _pool(c for c in row if g is None or c.get("group", "") == g)
                    vals.append(f"{100.0 * k / n:.0f} ({n})" if n else "")
                out.append(f"| {ckpt} | {label} | " + " | ".join(vals) + " |")
            out.append("")
    return "\n".join(out)


def plot_retrieval_accuracy(path: str, cells: List[dict], rank: Rank) -> None:
    """Accuracy vs prompt length (log x), one line per checkpoint and method, a panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({c["task"] for c in cells})
    fig, axes = plt.subplots(1, len(tasks), figsize=(8.0 * len(tasks), 4.6), squeeze=False, layout="constrained")
    for ax, task in zip(axes[0], tasks):
        group = [c for c in cells if c["task"] == task]
        for key, row in sorted(_rows(group).items(), key=_row_order(rank)):
            lengths = sorted({c["length"] for c in row})
            acc = []
            for n in lengths:
                k, total, _ = _pool(c for c in row if c["length"] == n)
                acc.append(100.0 * k / total)
            style = "-" if key[1] == "none" else "--"
            ax.plot(lengths, acc, style, marker="o", ms=3, label=f"{key[0]}: {key[3]}")
        for train_length in sorted({c["train_length"] for c in group if c.get("train_length")}):
            ax.axvline(train_length, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("exact-match accuracy (%)")
        ax.set_title(task)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_retrieval_depth(path: str, cells: List[dict], rank: Rank) -> None:
    """Depth x length accuracy heatmaps: a row per checkpoint (and task), a column per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({(c["checkpoint"], c["task"]) for c in cells})
    methods = sorted({(c["method"], c["factor"], c["label"]) for c in cells},
                     key=lambda m: rank({"method": m[0], "factor": m[1]}))
    fig, axes = plt.subplots(len(rows), len(methods), figsize=(2.6 * len(methods) + 1.2, 2.5 * len(rows) + 0.4),
                             squeeze=False, layout="constrained")
    image = None
    for r, (ckpt, task) in enumerate(rows):
        for m, (name, factor, label) in enumerate(methods):
            ax = axes[r][m]
            these = [c for c in cells if c["checkpoint"] == ckpt and c["task"] == task
                     and (c["method"], c["factor"]) == (name, factor)]
            if not these:
                ax.axis("off")
                continue
            lengths = sorted({c["length"] for c in these})
            depths = sorted({c["depth"] for c in these})
            grid = [[float("nan")] * len(lengths) for _ in depths]
            for c in these:
                grid[depths.index(c["depth"])][lengths.index(c["length"])] = 100.0 * c["accuracy"]
            image = ax.imshow(grid, origin="upper", aspect="auto", vmin=0, vmax=100, cmap="viridis")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    v = grid[i][j]
                    if v == v:
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6,
                                color="white" if v < 50 else "black")
            ax.set_xticks(range(len(lengths)))
            ax.set_xticklabels([str(n) for n in lengths], fontsize=6, rotation=45)
            ax.set_yticks(range(len(depths)))
            ax.set_yticklabels([f"{d:.2f}" for d in depths], fontsize=6)
            ax.set_title(f"{ckpt}: {label}" + (f" ({task})" if len({t for _, t in rows}) > 1 else ""), fontsize=8)
            if m == 0:
                ax.set_ylabel("needle depth", fontsize=7)
            if r == len(rows) - 1:
                ax.set_xlabel("prompt length", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy (%)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
