"""Reports of the evaluation tools: CSV, Markdown tables and plots.

``results.json`` (the resume state) is written by ``grid.ResultStore``; this
module writes everything derived from the cells: ``results.csv``,
``results.md`` and the figures.
"""

from __future__ import annotations

import csv
import io
from typing import Dict, Iterable, List, Sequence

from .grid import atomic_write

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


def sorted_cells(cells: Iterable[dict]) -> List[dict]:
    return sorted(cells, key=lambda c: (c["checkpoint"], c["mode"], c["method"], c["factor"], c["length"], c["stride"]))


def perplexity_table(cells: List[dict]) -> str:
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
