"""Reports of the evaluation tools: CSV, Markdown tables and plots.

``results.json`` (the resume state) is written by ``store.ResultStore``; this
module writes everything derived from the cells: ``results.csv``,
``results.md`` and the figures.  Tables and legends list the methods in the
order of ``--methods`` (``rank``: a record -> its method's place).

Every number a reader compares carries its 95 % interval (``intervals.py``):
perplexity a Student-t interval over the cell's windows, accuracy Wilson's, a
mean log-probability a t-interval over prompts; in tables as ``PPL [LOW,
HIGH]``, in plots as bars.  A number that cannot have one says
why instead (``11.51 (1 window: no interval)``; in the CSV an empty interval
and the reason in ``ppl_no_interval``).  Cells that scored the same windows
are also compared pairwise (``paired.py``): each method against its
checkpoint's baseline, each checkpoint against the first on the same windows,
as a perplexity change with its paired interval, in tables and in the top
panels of ``perplexity.png``, which lead with them.  Each method has one colour and marker in every
plot (``styles.py``), each checkpoint a line style; panels compared side by
side share their axes; every line, band and mark is named in the figure.
"""

from __future__ import annotations

import csv
import io
import math
import os
import textwrap
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import intervals, paired, styles
from .store import atomic_write

Rank = Callable[[dict], int]
Interval = Optional[Tuple[float, float]]
PPL_INTERVAL = "95 % interval: Student t over windows"
ACCURACY_INTERVAL = "95 % Wilson interval"
LOGPROB_INTERVAL = "95 % interval: Student t over prompts"
PAIRED_INTERVAL = "95 % paired t-interval over the shared windows"
NO_WINDOWS = "no interval: no per-window losses recorded"



def methods_by_position(width: int = 79) -> str:
    """For ``--help``: the context-extension methods that apply to each position
    method, read from the registry (``core/positions.py``), so a method
    registered there is listed here without an edit; wrapped at ``width``."""
    from ..core.positions import POSITIONS

    groups: Dict[Tuple[str, ...], List[str]] = {}
    for name, extensions in [("sinusoidal", ("none",))] + [(n, p.extensions) for n, p in POSITIONS.items()]:
        groups.setdefault(tuple(extensions), []).append(name)
    text = "Each model is evaluated under the methods that apply to its position method: " + "; ".join(
        f"{', '.join(names)}: {', '.join(extensions)}" + (" (as trained)" if extensions == ("none",) else "")
        for extensions, names in groups.items()) + "."
    return textwrap.fill(text, width)

def ppl_estimate(cell: dict) -> intervals.Estimate:
    """A cell's perplexity with its interval over its windows, or with the reason
    it has none (one window; an older cell that kept no per-window losses)."""
    if not cell.get("window_loss") or not cell.get("window_tokens"):
        return intervals.Estimate(cell["ppl"], None, None, 0, NO_WINDOWS)
    return intervals.perplexity_interval(cell["window_loss"], cell["window_tokens"])


def ppl_interval(cell: dict) -> Interval:
    """The perplexity interval of a cell, or None (see :func:`ppl_estimate` for why)."""
    return ppl_estimate(cell).interval


def accuracy_interval(cell: dict) -> Interval:
    return intervals.wilson(cell["correct"], cell["n"])


def with_intervals(cells: Iterable[dict], name: str, interval_of: Callable[[dict], Interval]) -> List[dict]:
    """Copies of ``cells`` with ``NAME_low`` and ``NAME_high`` (None where there is no interval)."""
    out = []
    for cell in cells:
        interval = interval_of(cell)
        out.append(dict(cell, **{f"{name}_low": interval[0] if interval else None,
                                 f"{name}_high": interval[1] if interval else None}))
    return out


def with_ppl_intervals(cells: Iterable[dict]) -> List[dict]:
    """Copies of ``cells`` with ``ppl_low``/``ppl_high`` (None without an interval),
    ``ppl_no_interval`` (why not, else None) and ``windows`` (how many a cell scored)."""
    out = []
    for cell in cells:
        estimate = ppl_estimate(cell)
        out.append(dict(cell, ppl_low=estimate.low, ppl_high=estimate.high, ppl_no_interval=estimate.reason,
                        windows=len(cell.get("window_tokens") or []) or None))
    return out


def percent_text(value: float, threshold: Optional[float] = None) -> str:
    """A percentage in whole percent, with the decimals it needs where whole percent
    would show 0 or 100 for a value strictly between (199 of 200 is ``99.5``, not
    ``100``: a perfect score it is not), or, given a ``threshold``, a value on the
    other side of it (89.95 against 90 is ``89.95``, not ``90``)."""
    for digits in range(0, 7):
        text = f"{value:.{digits}f}"
        shown = float(text)
        if (0 < value < 100 and shown in (0.0, 100.0)) or (
                threshold is not None and (shown >= threshold) != (value >= threshold)):
            continue
        return text
    return text


def save_figure(fig, path: str, dpi: int = 110) -> None:
    """A figure written as the tools write every output file (``store.atomic_file``:
    a new file renamed over ``path``, no symbolic link there followed)."""
    from .store import atomic_file

    atomic_file(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=os.path.splitext(path)[1][1:] or "png"))


def bounds(interval: Interval, value: float, scale: float = 1.0) -> str:
    """`` [44.9, 45.6]`` (one decimal from 10 on, two below; percent, ``scale`` 100, in
    :func:`percent_text`; ``scale`` x the bounds), or ``""`` without an interval."""
    if interval is None:
        return ""
    if scale == 100:
        return f" [{percent_text(100 * interval[0])}, {percent_text(100 * interval[1])}]"
    digits = 1 if abs(value) >= 10 else 2
    return f" [{scale * interval[0]:.{digits}f}, {scale * interval[1]:.{digits}f}]"


def cell_bounds(cell: dict, name: str, scale: float = 1.0) -> str:
    """:func:`bounds` of a cell's ``NAME_low``/``NAME_high``, or `` (why there is none)``
    from its ``NAME_no_interval``."""
    low, high = cell.get(f"{name}_low"), cell.get(f"{name}_high")
    if low is None:
        reason = cell.get(f"{name}_no_interval")
        return f" ({reason})" if reason else ""
    return bounds((low, high), cell[name], scale)


def estimate_bounds(estimate: Optional[intervals.Estimate], scale: float = 1.0) -> str:
    """:func:`bounds` of an estimate, or `` (why there is none)``."""
    if estimate is None:
        return ""
    if estimate.low is None:
        return f" ({estimate.reason})"
    return bounds(estimate.interval, estimate.value, scale)


def percent_change(ratio: float, low: Optional[float], high: Optional[float], reason: Optional[str]) -> str:
    """``+2.81% [+2.10, +3.52]``: a ratio of perplexities as a change, with as many
    decimals as the interval's width needs (at most 6), in powers of ten where the
    change itself and the width are below 0.001 points (``-1.2e-07% [-3.4e-07,
    +1.0e-07]``); ``(why)`` without an interval."""
    change = _change(ratio)
    if low is None:
        return f"{change:+.2f}% ({reason})"
    width = _change(high) - _change(low)
    digits = max(2, 1 - math.floor(math.log10(width))) if width > 0 else 2
    if digits <= 4 or abs(change) >= 1e-3:  # a change of its own size keeps fixed decimals, at most 6
        spec = f"+.{min(digits, 6)}f"
    else:
        spec = "+.1e"
    return f"{change:{spec}}% [{_change(low):{spec}}, {_change(high):{spec}}]"


def _legend(ax, notes: Sequence[Tuple[object, str]] = (), **kwargs) -> None:
    """The axes' legend, with ``(handle, text)`` notes after its lines (bands, bars),
    outside the axes (:func:`legend_outside`)."""
    handles, labels = ax.get_legend_handles_labels()
    for handle, text in notes:
        handles.append(handle)
        labels.append(text)
    legend_outside(ax, handles, labels, **kwargs)


def legend_outside(ax, handles=None, labels=None, **kwargs):
    """A legend to the right of the axes, outside them, so that it covers no data
    point of any panel (a legend inside, at matplotlib's ``best``, covered points of
    the lower panels); the figure's layout (``constrained``, ``tight_layout``) makes
    room for it.  ``handles``/``labels`` default to the axes' own."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    options = dict(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    options.update(kwargs)
    return ax.legend(handles, labels, **options)


def plain_number(value: float) -> str:
    """A tick label as a plain number: ``64``, ``1024``, ``0.5``, ``30`` (never
    ``2^6`` or ``3 x 10^1``)."""
    if value >= 1 and abs(value - round(value)) < 1e-9 * value:
        return str(int(round(value)))
    return f"{value:g}"


def log_axis(ax, which: str = "x", base: float = 10) -> None:
    """A logarithmic axis (``which``: ``x`` or ``y``) whose tick labels are plain
    numbers (:func:`plain_number`: 64, 128, 1024; 30, 40, 60), major and minor ticks
    alike, where matplotlib writes powers (``2^6``, ``6 x 10^1``): every figure's log
    axis is set here."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return plain_number(x)

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=base)
    axis.set_major_formatter(Plain(base=base))
    # the minor ticks labelled, every one where the axis spans a decade or less
    axis.set_minor_formatter(Plain(base=base, labelOnlyBase=False, minor_thresholds=(2, 1)))


def _bar_note(drawn: bool, paired_above: bool = False, missing: bool = False):
    from matplotlib.lines import Line2D

    notes = []
    if drawn:
        each = " (each cell on its own; paired changes above)" if paired_above else ""
        notes.append((Line2D([], [], color="grey", marker="|", ms=10, lw=0), f"bars: {PPL_INTERVAL}{each}"))
    return notes + _missing_note(missing, "bar")


def _missing_note(missing: bool, what: str):
    """The legend's word on points drawn without an interval (results.md says why)."""
    from matplotlib.patches import Patch

    return [(Patch(fill=False, lw=0), f"a point without a {what}: no interval (results.md says why)")] if missing \
        else []


def _train_lengths(ax, cells: Iterable[dict]) -> None:
    """The training length(s) as dotted vertical lines, named in the legend."""
    lengths: Dict[int, List[str]] = {}
    for c in cells:
        if c.get("train_length"):
            lengths.setdefault(c["train_length"], [])
            if c["checkpoint"] not in lengths[c["train_length"]]:
                lengths[c["train_length"]].append(c["checkpoint"])
    for length, names in sorted(lengths.items()):
        which = f" of {', '.join(sorted(names))}" if len(lengths) > 1 else ""
        ax.axvline(length, color="grey", lw=0.8, ls=":", label=f"training length{which}: {length} tokens")

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


def _by_panel(cells: Iterable[dict]) -> List[Tuple[tuple, List[dict]]]:
    """Cells by (mode, subset, stride of a sliding mode), in that order."""
    groups: Dict[tuple, List[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["mode"], cell["subset"], cell["stride"] if cell["mode"] == "sliding" else None),
                          []).append(cell)
    return sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0))


def perplexity_table(cells: List[dict], rank: Rank, pairs: Sequence[dict] = ()) -> str:
    """One table per (mode, subset): a row per checkpoint+method, a column per length;
    ``ppl [low, high]`` where the cells carry intervals (:func:`with_ppl_intervals`),
    ``ppl (why not)`` where they cannot; then the paired comparisons ``pairs``
    (:func:`paired.comparisons`), one table per mode and kind."""
    out = []
    for (mode, subset, stride), group in _by_panel(cells):
        note = f" [{PPL_INTERVAL}]" if any(c.get("ppl_low") is not None for c in group) else ""
        title = f"{mode}" + (f", stride {stride}" if stride else "") + f" ({subset} perplexity{note})"
        out += length_table(title, group, rank, lambda at: f"{at[0]['ppl']:.2f}{cell_bounds(at[0], 'ppl')}")
    return "\n".join(out + paired_tables(pairs, rank))


PAIRED_TITLES = {
    "method": "each method against its checkpoint's baseline (`none`, else the first method)",
    "checkpoint": "each checkpoint against the first (by name) that scored the same windows, same method",
}


def paired_tables(pairs: Sequence[dict], rank: Rank) -> List[str]:
    """Markdown tables of paired comparisons: the perplexity change of each row
    against its baseline on the same windows, ``+2.81% [+2.10, +3.52]``."""
    out = []
    for (mode, subset, stride), group in _by_panel(pairs):
        for kind, what in PAIRED_TITLES.items():
            rows = [dict(p, checkpoint=_versus(p["checkpoint"], p["baseline_checkpoint"]),
                         label=_versus(p["label"], p["baseline_label"])) for p in group if p["kind"] == kind]
            if rows:
                title = (f"{mode}" + (f", stride {stride}" if stride else "") + f": {what} ({subset} perplexity "
                         f"change on the same windows, % [{PAIRED_INTERVAL}]; an interval that excludes 0 is a "
                         "difference the windows show)")
                out += length_table(title, rows, rank, lambda at: percent_change(
                    at[0]["ppl_ratio"], at[0]["ppl_ratio_low"], at[0]["ppl_ratio_high"], at[0]["no_interval"]))
    return out


def _versus(name: str, baseline: str) -> str:
    return name if name == baseline else f"{name} vs {baseline}"


def _line_key(c: dict) -> tuple:
    return (c["checkpoint"], c["method"], c["factor"], c["label"])


def _lines_in_order(keys: Iterable[tuple], rank: Rank) -> List[tuple]:
    return sorted(keys, key=lambda k: (k[0], rank({"method": k[1], "factor": k[2]})))


def plot_perplexity(path: str, cells: List[dict], rank: Rank, pairs: Sequence[dict] = ()) -> None:
    """Perplexity vs window length, a column per mode (and subset).  Where cells scored
    the same windows, the figure leads with the paired changes against the baseline
    (each method against its checkpoint's baseline method; each checkpoint against the
    first at that baseline method), with their paired intervals: a difference the cells'
    own intervals hide shows there.  Below them (or alone) the perplexities, a line per
    checkpoint and method on one shared y axis, each cell's own interval a bar, the
    lines' bars set a little apart so that none hides another.  Legends sit outside
    the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["mode"], c["stride"] if c["mode"] == "sliding" else 0, c["subset"]) for c in cells})
    baseline = paired.baseline_methods(cells, rank)
    shown = [p for p in pairs if p["kind"] == "method" or p["spelling"] == baseline.get(p["baseline_checkpoint"])]
    rows = 2 if shown else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(6.4 * len(panels) + 3.6, 4.6 + 4.0 * (rows - 1)),
                             squeeze=False, sharey="row", sharex="col", layout="constrained")
    line_style = styles.line_styles(c["checkpoint"] for c in cells)
    values = [v for c in cells for v in (c["ppl"], c.get("ppl_low"), c.get("ppl_high")) if v is not None]
    log_y = bool(values) and max(values) / max(min(values), 1e-9) > 4
    for col, (mode, stride, subset) in enumerate(panels):
        def here(c, mode=mode, stride=stride, subset=subset):
            return c["mode"] == mode and c["subset"] == subset and (mode != "sliding" or c["stride"] == stride)

        title = mode + (f", stride {stride}" if mode == "sliding" else "")
        if rows == 2:
            _paired_panel(axes[0][col], [p for p in shown if here(p)], rank, line_style, subset)
            axes[0][col].set_title(f"{title}: paired changes")
            axes[1][col].set_title(f"{title}: perplexity of each cell")
        else:
            axes[0][col].set_title(title)
        _perplexity_panel(axes[-1][col], [c for c in cells if here(c)], rank, line_style, log_y, subset, rows == 2)
        axes[-1][col].set_xlabel("evaluation window length (tokens)")
    save_figure(fig, path)
    plt.close(fig)


def _dodge(index: int, count: int, step: float = 0.035) -> float:
    """The factor that moves line ``index`` of ``count`` sideways on a log2 axis
    (``step`` octaves apart, centred on the true length), so that lines of equal
    values keep their interval bars apart."""
    return 2.0 ** (step * (index - (count - 1) / 2))


def _perplexity_panel(ax, group: List[dict], rank: Rank, line_style: Dict[str, str], log_y: bool, subset: str,
                      paired_above: bool) -> None:
    """One mode's perplexity lines, each cell's own interval a bar (the lines set a little apart)."""
    lines: Dict[tuple, List[dict]] = {}
    for c in group:
        lines.setdefault(_line_key(c), []).append(c)
    barred = False
    order = _lines_in_order(lines, rank)
    for index, key in enumerate(order):
        pts = sorted(lines[key], key=lambda c: c["length"])
        shift = _dodge(index, len(order))
        style = styles.plot_kwargs(pts[0], line_style[key[0]])
        ax.plot([c["length"] * shift for c in pts], [c["ppl"] for c in pts], label=f"{key[0]}: {key[3]}", **style)
        known = [c for c in pts if c.get("ppl_low") is not None]
        if known:
            ax.errorbar([c["length"] * shift for c in known], [c["ppl"] for c in known], capsize=2, elinewidth=0.8,
                        ls="none", color=style["color"], alpha=0.7,
                        yerr=[[c["ppl"] - c["ppl_low"] for c in known], [c["ppl_high"] - c["ppl"] for c in known]])
            barred = True
    _train_lengths(ax, group)
    log_axis(ax, "x", 2)
    if log_y:
        log_axis(ax, "y", 10)
    ax.set_ylabel(f"{subset} perplexity")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, _bar_note(barred, paired_above, any(c.get("ppl_low") is None for c in group)))


def _paired_line_key(p: dict) -> tuple:
    return (p["kind"] != "method", p["checkpoint"], p["method"], p["factor"], p["label"], p["baseline_checkpoint"],
            p["baseline_label"])


def _change(ratio: float) -> float:
    """A ratio of perplexities as a change in percent."""
    return 100.0 * (ratio - 1.0)


def _paired_panel(ax, group: List[dict], rank: Rank, line_style: Dict[str, str], subset: str) -> None:
    """One mode's paired changes against the baselines: a line per comparison, its
    paired intervals as error bars, a filled marker where the interval excludes 0."""
    from matplotlib.lines import Line2D

    ax.axhline(0.0, color="grey", lw=0.9, label="no difference")
    lines: Dict[tuple, List[dict]] = {}
    for p in group:
        lines.setdefault(_paired_line_key(p), []).append(p)
    order = sorted(lines, key=lambda k: (k[0], k[1], rank({"method": k[2], "factor": k[3]})))
    for index, key in enumerate(order):
        pts = sorted(lines[key], key=lambda p: p["length"])
        shift = _dodge(index, len(order))
        style = styles.plot_kwargs(pts[0], line_style[key[1]])
        name = (f"{key[1]}: {key[4]} vs {key[6]}" if key[1] == key[5] else f"{key[1]} vs {key[5]}: {key[4]}")
        ax.plot([p["length"] * shift for p in pts], [_change(p["ppl_ratio"]) for p in pts], label=name, **style)
        known = [p for p in pts if p["ppl_ratio_low"] is not None]
        if known:
            ax.errorbar([p["length"] * shift for p in known], [_change(p["ppl_ratio"]) for p in known], capsize=3,
                        elinewidth=0.9, ls="none", color=style["color"],
                        yerr=[[_change(p["ppl_ratio"]) - _change(p["ppl_ratio_low"]) for p in known],
                              [_change(p["ppl_ratio_high"]) - _change(p["ppl_ratio"]) for p in known]])
        real = [p for p in known if p["ppl_ratio_low"] > 1.0 or p["ppl_ratio_high"] < 1.0]
        ax.plot([p["length"] * shift for p in real], [_change(p["ppl_ratio"]) for p in real], ls="none",
                marker=style["marker"], ms=style["ms"], color=style["color"], mfc=style["color"], label="_real")
    log_axis(ax, "x", 2)
    ax.set_ylabel(f"{subset} perplexity change against\nthe baseline, same windows (%)")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, [(Line2D([], [], color="grey", marker="|", ms=10, lw=0), f"bars: {PAIRED_INTERVAL}"),
                 (Line2D([], [], color="grey", marker="o", ls="none", mfc="grey"),
                  "filled: the interval excludes 0 (a difference the windows show)")]
                + _missing_note(any(p["ppl_ratio_low"] is None for p in group), "bar"))


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
    evaluated window, a panel per mode on one shared y axis, the training length marked;
    the legend says how many windows each line's points pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in cells if c.get("per_position")]
    if not cells:
        return
    panels = sorted({(c["mode"], c["stride"] if c["mode"] == "sliding" else 0) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels) + 3.6, 5.0), squeeze=False, sharey=True,
                             layout="constrained")
    line_style = styles.line_styles(c["checkpoint"] for c in cells)
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
            counts = c.get("per_position_count") or [1] * len(c["per_position"])
            bins = position_bins(c["per_position"], counts)
            ax.plot([(lo + hi) / 2 + 1 for lo, hi, _, _ in bins], [v for _, _, v, _ in bins],
                    label=f"{key[0]}: {key[3]} (window {c['length']}, {max(counts)} windows)",
                    **styles.plot_kwargs(c, line_style[key[0]]))
        _train_lengths(ax, longest.values())
        log_axis(ax, "x", 2)
        ax.set_xlabel("token position within the window (log2 bins of positions)")
        ax.set_ylabel("mean loss (bits per token)")
        ax.set_title(mode + (f", stride {stride}" if mode == "sliding" else ""))
        ax.grid(True, which="both", alpha=0.3)
        _legend(ax)
    note = ("Each point: the mean loss of the positions in its bin over every window that scored them (the legend "
            f"gives the windows); positions that fewer than {THIN_SHARE:.0%} of those windows scored (a sliding "
            "window's first) are left out")
    lines = textwrap.wrap(note, width=int(fig.get_figwidth() * 14))  # about 14 characters an inch at 8 points
    fig.suptitle("\n".join(lines), fontsize=8)  # the constrained layout makes room for it: it is never cut
    save_figure(fig, path)
    plt.close(fig)


# ------------------------------------------------------------------ retrieval


def _pool(cells: Iterable[dict]) -> tuple:
    """(correct, n, n-weighted mean log-prob, every prompt's log-prob or None) of cells pooled together."""
    cells = list(cells)
    n = sum(c["n"] for c in cells)
    correct = sum(c["correct"] for c in cells)
    logprob = sum(c["answer_logprob"] * c["n"] for c in cells) / n if n else float("nan")
    samples = None if any(c.get("sample_logprob") is None for c in cells) else [
        v for c in cells for v in c["sample_logprob"]]
    return correct, n, logprob, samples


def _accuracy(k: int, n: int, *_) -> str:
    """``80 [49, 94]`` (8 of 10): accuracy % and its Wilson interval."""
    return f"{percent_text(100.0 * k / n)}{bounds(intervals.wilson(k, n), 100.0 * k / n, scale=100)}"


def _logprob(k: int, n: int, logprob: float, samples) -> str:
    if not samples:
        return f"{logprob:.2f} (no interval: no per-prompt log-probs recorded)"
    return f"{logprob:.2f}{estimate_bounds(intervals.mean_interval(samples))}"


def retrieval_tables(cells: List[dict], rank: Rank) -> str:
    """Per task: accuracy (%) by length, all depths pooled; the answer's mean log-prob
    by length; and, for JSONL tasks with groups, accuracy by group; each with its interval."""
    out = []
    for task in sorted({c["task"] for c in cells}):
        group = [c for c in cells if c["task"] == task]
        lengths = sorted({c["length"] for c in group})
        rows = _rows(group)
        depths = sorted({c["depth"] for c in group if c.get("depth") is not None})
        pooled = f", {len(depths)} depths pooled" if depths else ""
        for title, fmt, note in (("accuracy %", _accuracy, ACCURACY_INTERVAL),
                                 ("mean answer log-prob", _logprob, LOGPROB_INTERVAL)):
            if len(lengths) <= 24:  # prompt files of many lengths: no length columns
                out += length_table(f"{task}: {title} by prompt length (tokens{pooled}) [{note}]", group, rank,
                                    lambda at, fmt=fmt: fmt(*_pool(at)))
        groups = sorted({c.get("group", "") for c in group})
        if groups != [""] or len(lengths) > 24:
            out.append(f"### {task}: accuracy % by group (n prompts) [{ACCURACY_INTERVAL}]\n")
            out.append("| checkpoint | method | " + " | ".join(g or "(none)" for g in groups) + " | all |")
            out.append("|---|---|" + "---|" * (len(groups) + 1))
            for (ckpt, _, _, label, _), row in sorted(rows.items(), key=_row_order(rank)):
                vals = []
                for g in groups + [None]:
                    k, n, _, _ = _pool(c for c in row if g is None or c.get("group", "") == g)
                    vals.append(f"{_accuracy(k, n)} ({n})" if n else "")
                out.append(f"| {ckpt} | {label} | " + " | ".join(vals) + " |")
            out.append("")
    return "\n".join(out)


def plot_retrieval_accuracy(path: str, cells: List[dict], rank: Rank) -> None:
    """Accuracy vs prompt length (log x) with Wilson error bars, one line per checkpoint
    and method, a panel per task (one shared y axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    tasks = sorted({c["task"] for c in cells})
    fig, axes = plt.subplots(1, len(tasks), figsize=(8.0 * len(tasks), 4.6), squeeze=False, layout="constrained",
                             sharey=True)
    line_style = styles.line_styles(c["checkpoint"] for c in cells)
    for ax, task in zip(axes[0], tasks):
        group = [c for c in cells if c["task"] == task]
        for key, row in sorted(_rows(group).items(), key=_row_order(rank)):
            lengths = sorted({c["length"] for c in row})
            acc, low, high = [], [], []
            for n in lengths:
                k, total, _, _ = _pool(c for c in row if c["length"] == n)
                lo, hi = intervals.wilson(k, total)
                acc.append(100.0 * k / total)
                low.append(acc[-1] - 100.0 * lo)
                high.append(100.0 * hi - acc[-1])
            ax.errorbar(lengths, acc, yerr=[low, high], capsize=2, elinewidth=0.7, label=f"{key[0]}: {key[3]}",
                        **styles.plot_kwargs(row[0], line_style[key[0]]))
        _train_lengths(ax, group)
        log_axis(ax, "x", 2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("exact-match accuracy (%)")
        ax.set_title(task)
        ax.grid(True, which="both", alpha=0.3)
        bar = Line2D([], [], color="grey", marker="|", ms=10, lw=0)
        _legend(ax, [(bar, f"bars: {ACCURACY_INTERVAL}")])
    save_figure(fig, path)
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
            these = [c for c in cells if c["checkpoint"] == ckpt and c["task"] == task  # label: alpha too
                     and (c["method"], c["factor"], c["label"]) == (name, factor, label)]
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
        widest = max(hi - lo for lo, hi in (intervals.wilson(c["correct"], c["n"]) for c in cells))
        sizes = sorted({c["n"] for c in cells})
        fig.suptitle(f"each square: accuracy of {'/'.join(map(str, sizes))} prompts; {ACCURACY_INTERVAL}s up to "
                     f"{100 * widest:.0f} points wide", fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
