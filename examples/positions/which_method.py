"""The "which method" figure: a point per position method (and per variant that
changes what it can do), perplexity at 16x L against retrieval accuracy at 4x L,
the marker's area its training time against ALiBi's.

It reads a CSV with a row per point (``docs/results/which-method.csv``, whose
notes say where each number was measured): ``method`` (a registry name, or
``sinusoidal``), ``variant`` (empty for the method as its defaults train it),
``ppl_16x`` with ``ppl_16x_low``/``ppl_16x_high`` (the seeds' range),
``lines_4x`` with its range (empty where not measured past L: the model did
not learn the task at 1x, whose accuracy ``lines_1x`` gives) and
``train_speed`` (words/s against ALiBi's).  A method with none of the numbers
is one not yet measured: it has a row, no point, and the figure names it.  Points are drawn in the registry's
order and colours (``fairseq_alibi/evaluation/styles.py``); a model without a
measurement past L sits in a strip below 0, its 1x accuracy beside it, and an
arrow leads from a method to its variants.

    python examples/positions/which_method.py docs/results/which-method.csv --output docs/which-method.png
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Dict, List, Optional

from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.evaluation.report import legend_outside, log_axis, save_figure
from fairseq_alibi.evaluation.styles import position_colour

FIELDS = ("method", "variant", "ppl_16x", "ppl_16x_low", "ppl_16x_high", "lines_4x", "lines_4x_low",
          "lines_4x_high", "lines_1x", "train_speed")
#: Where a model without a retrieval measurement past L is drawn (accuracy %, below the axis's 0).
STRIP = -14.0
#: Marker area (points^2) of ALiBi's training time; a method's area scales with its time.
AREA = 90.0


def number(text: str) -> Optional[float]:
    return float(text) if text.strip() else None


def read(path: str) -> List[dict]:
    """The rows of the CSV (lines starting with ``#`` are notes), numbers as floats (None where empty)."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        missing = [name for name in FIELDS if rows and name not in rows[0]]
        if not rows or missing:
            raise ValueError(f"no rows, or no column {', '.join(missing)}" if missing else "no rows")
        out = []
        for row in rows:
            point = {name: number(row[name]) for name in FIELDS if name not in ("method", "variant")}
            point.update(method=row["method"].strip(), variant=row["variant"].strip())
            if all(point[name] is None for name in FIELDS if name not in ("method", "variant")):
                out.append(point)  # a method not yet measured: named, not drawn
                continue
            if point["ppl_16x"] is None or point["train_speed"] is None or point["train_speed"] <= 0:
                raise ValueError(f"{point['method']} {point['variant']}: ppl_16x and a positive train_speed are needed")
            if point["lines_4x"] is None and point["lines_1x"] is None:
                raise ValueError(f"{point['method']} {point['variant']}: give lines_4x, or lines_1x where 4x was "
                                 "not measured")
            out.append(point)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"error: cannot read {path}: {exc}; give a CSV with the columns {', '.join(FIELDS)} "
                         "(docs/results/which-method.csv is one)") from None
    return out


def order(points: List[dict]) -> List[dict]:
    """The stock model, then the registry's order; a method's variants after it."""
    names = ("sinusoidal", *POSITIONS)
    rank = {name: i for i, name in enumerate(names)}
    return sorted(points, key=lambda p: (rank.get(p["method"], len(names)), p["method"], bool(p["variant"])))


def has_numbers(point: dict) -> bool:
    """Whether the point has numbers (a row without any is a method not yet measured)."""
    return point["ppl_16x"] is not None


def label(point: dict) -> str:
    return point["method"] + (f", {point['variant']}" if point["variant"] else "")


def crowded(point: dict, points: List[dict]) -> bool:
    """Whether another point lies just right of ``point`` (within 12 % in perplexity, 6 points in accuracy)."""
    def y(p):
        return p["lines_4x"] if p["lines_4x"] is not None else STRIP

    return any(other is not point and point["ppl_16x"] <= other["ppl_16x"] < 1.12 * point["ppl_16x"]
               and abs(y(other) - y(point)) < 6 for other in points)


def plot(path: str, points: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    unmeasured = [label(p) for p in order(points) if not has_numbers(p)]
    points = [p for p in order(points) if has_numbers(p)]
    fig, ax = plt.subplots(figsize=(10.5, 6.2), layout="constrained")
    where: Dict[str, tuple] = {}
    for point in points:
        colour = position_colour(point["method"])
        measured = point["lines_4x"] is not None
        x, y = point["ppl_16x"], point["lines_4x"] if measured else STRIP
        area = AREA / point["train_speed"]
        ax.errorbar(x, y, xerr=[[x - point["ppl_16x_low"]], [point["ppl_16x_high"] - x]]
                    if point["ppl_16x_low"] is not None else None,
                    yerr=[[y - point["lines_4x_low"]], [point["lines_4x_high"] - y]]
                    if measured and point["lines_4x_low"] is not None else None,
                    ls="none", color=colour, elinewidth=0.9, capsize=2, zorder=2)
        ax.scatter([x], [y], s=area, marker="*" if point["variant"] else "o", color=colour,
                   facecolors=colour if measured else "none", linewidths=1.4, zorder=3, label=label(point))
        note = "" if measured else f" (1x: {point['lines_1x']:g}%)"
        left = crowded(point, points)  # another point just right of this one: its name goes to the left
        ax.annotate(label(point) + note, (x, y), textcoords="offset points", ha="right" if left else "left",
                    xytext=(-7 if left else 7, 5 if measured else -11), fontsize=7, color=colour)
        if not point["variant"]:
            where[point["method"]] = (x, y)
        elif point["method"] in where:
            ax.annotate("", (x, y), where[point["method"]], zorder=1,
                        arrowprops=dict(arrowstyle="->", color=colour, lw=0.9, ls="--", shrinkA=6, shrinkB=6))
    ax.axhspan(STRIP - 6, STRIP + 6, color="grey", alpha=0.08, lw=0)
    ax.axhline(-4, color="grey", lw=0.6)
    log_axis(ax, "x", 10)
    xs = [p["ppl_16x_low"] or p["ppl_16x"] for p in points] + [p["ppl_16x_high"] or p["ppl_16x"] for p in points]
    ax.set_xlim(min(xs) * 0.85, max(xs) * 1.12)  # room for the names set left of their points
    ax.set_ylim(STRIP - 6, 100)
    ax.set_yticks([STRIP, 0, 20, 40, 60, 80, 100], ["not measured\npast L", "0", "20", "40", "60", "80", "100"])
    ax.set_xlabel("valid perplexity at 16x L (1,024 tokens; lower is better; bars: the seeds' range)")
    ax.set_ylabel("retrieval (lines task) accuracy at 4x L, % (bars: the seeds' range)")
    ax.set_title("Which method: perplexity far past L against retrieval past L (top left is best)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if unmeasured:
        ax.text(0.99, 0.01, "not yet measured: " + ", ".join(unmeasured), transform=ax.transAxes, ha="right",
                va="bottom", fontsize=8, color="grey")
    notes = [(Line2D([], [], ls="none", marker="o", color="grey", mfc="grey", ms=math.sqrt(AREA)),
              "the method with its defaults"),
             (Line2D([], [], ls="none", marker="*", color="grey", mfc="grey", ms=math.sqrt(AREA)),
              "a variant (arrow: from its method)"),
             (Line2D([], [], ls="none", marker="o", color="grey", mfc="none", ms=math.sqrt(AREA)),
              "hollow: did not learn retrieval at 1x"),
             (Line2D([], [], ls="none", marker="o", color="grey", mfc="grey", ms=math.sqrt(AREA / 0.5)),
              "marker area: training time against ALiBi's\n(this size: ALiBi's; 2x the area: twice the time)")]
    handles, labels = ax.get_legend_handles_labels()
    legend_outside(ax, handles + [h for h, _ in notes], labels + [t for _, t in notes], labelspacing=1.1)
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", help="the CSV of the points (docs/results/which-method.csv)")
    parser.add_argument("--output", default="which-method.png", help="the figure (default: %(default)s)")
    args = parser.parse_args(argv)
    points = read(args.table)
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise SystemExit(f"error: --output {args.output}: no directory {directory}; create it or give another")
    plot(args.output, points)
    print(f"{len(points)} points -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
