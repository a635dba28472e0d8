"""The comparison's figure and tables from alibi-sweep results (``compare.sh``).

Checkpoints are named ``METHOD_sSEED``; for every method and evaluation length
this prints the mean perplexity over seeds with the lowest and highest seed
``mean [min, max]`` (three seeds give no useful interval of their own: the
band is the seeds' range, and says so); each method against ALiBi of the same
seed (the same windows: the paired change in %, mean [min, max] over seeds,
which the seeds' own spread does not blur); and draws ``positions.png``:
perplexity against evaluation length, one line per method, the band the
seeds' range, under the change against ALiBi of the same seed, which leads
the figure; and ``positions.csv``, the numbers the figure draws, from which
``--table`` draws it again.  With ``--extensions`` it also tabulates and draws the
context-extension methods of every position method that has them
(``extensions.png``, a panel per method).  Methods are listed in the order of
the registry (``fairseq_alibi/core/positions.py``, sinusoidal first), each in
its colour (``fairseq_alibi/evaluation/styles.py``).  ``--positions``,
``--seeds``, ``--lengths`` and ``--extension-methods`` keep the cells of one
run of ``compare.sh`` (a results.json keeps the cells of earlier runs too).

    python examples/positions/report.py outputs/compare/sweep/results.json \\
        --extensions outputs/compare/extensions/results.json --output outputs/compare
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.evaluation.styles import cell_spelling, method_style, position_colour
from fairseq_alibi.evaluation.report import legend_outside, log_axis, save_figure  # writes no file through a link

NAME = re.compile(r"^(?P<method>.+)_s(?P<seed>\d+)$")


def registry_order() -> Tuple[str, ...]:
    """The order of the tables and legends: the stock model, then the registry's methods."""
    return ("sinusoidal", *POSITIONS)

Series = Dict[Tuple[str, str], Dict[int, Dict[int, float]]]  # (position, extension label) -> length -> seed -> ppl
#: (position, extension label) -> length -> (mean, lowest, highest seed, seeds): what the figures draw.
Summary = Dict[Tuple[str, str], Dict[int, Tuple[float, float, float, int]]]


@dataclass(frozen=True)
class Selection:
    """The cells of one run: its position methods, seeds, lengths (``Nx`` or tokens) and
    extension methods (``--methods`` spellings); an empty field keeps every cell."""

    positions: Tuple[str, ...] = ()
    seeds: Tuple[int, ...] = ()
    lengths: Tuple[str, ...] = ()
    methods: Tuple[str, ...] = ()

    def keeps(self, method: str, seed: int, cell: dict) -> bool:
        if self.positions and method not in self.positions or self.seeds and seed not in self.seeds:
            return False
        if self.methods and cell.get("label") not in self._labels():
            return False
        return not self.lengths or any(_is_length(item, cell) for item in self.lengths)

    def _labels(self) -> set:
        from fairseq_alibi.core.scaling import Scaling

        return {Scaling.parse(m).label for m in self.methods}


def _is_length(item: str, cell: dict) -> bool:
    """Whether a ``--lengths`` item (``4x``, ``256``) names the cell's length."""
    if item.endswith("x"):
        ratio = cell.get("length_ratio")
        return ratio is not None and math.isclose(float(item[:-1]), float(ratio))
    return int(item) == int(cell["length"])


def load(path: str, selection: Selection = Selection(), subset: str = "valid",
         spellings: Optional[Dict[str, str]] = None) -> Tuple[Series, int]:
    """Perplexities by (position method, extension label) and length, one per seed; and L.
    Only ``subset``'s cells (a results.json keeps other splits' too); two cells for one
    (method, label, length, seed) are refused (neither may stand for the other).
    ``spellings``, if given, gets each extension label's ``--methods`` spelling (its style)."""
    try:
        with open(path, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: cannot read sweep results {path}: {exc}") from None
    series: Series = defaultdict(lambda: defaultdict(dict))
    train_lengths = set()
    for cell in cells:
        match = NAME.match(str(cell.get("checkpoint", "")))
        if not match or cell.get("mode") != "nonoverlapping" or cell.get("ppl") is None:
            continue
        if cell.get("subset", "valid") != subset or not selection.keeps(match["method"], int(match["seed"]), cell):
            continue
        by_seed = series[(match["method"], cell["label"])][int(cell["length"])]
        if int(match["seed"]) in by_seed:
            raise SystemExit(f"error: {path} holds two {subset} cells of {cell['checkpoint']} under {cell['label']} at "
                             f"{cell['length']} tokens; keep one (alibi-sweep writes one per cell)")
        by_seed[int(match["seed"])] = float(cell["ppl"])
        if spellings is not None:
            spellings.setdefault(cell["label"], cell_spelling(cell))
        train_lengths.add(cell.get("train_length"))
    if not series:
        raise SystemExit(f"error: {path} holds no nonoverlapping {subset} cells of checkpoints named METHOD_sSEED"
                         + (" of this run's methods, seeds and lengths" if selection != Selection() else ""))
    lengths = {length for length in train_lengths if length}
    return series, (min(lengths) if lengths else 0)


def ordered(methods) -> List[str]:
    """Position methods in the registry's order (sinusoidal first), any others after, sorted."""
    methods, order = set(methods), registry_order()
    return [m for m in order if m in methods] + sorted(methods - set(order))


def summary(values: List[float]) -> Tuple[float, float, float]:
    """(mean, min, max); a diverged seed (inf) makes the mean inf."""
    return sum(values) / len(values), min(values), max(values)


def seeds_of(series: Series) -> int:
    """How many seeds the run has: every seed any cell of ``series`` holds."""
    return len({seed for by_length in series.values() for by_seed in by_length.values() for seed in by_seed})


def fewer(count: int, expected: int) -> str:
    """`` (2 of 3 seeds)`` where a cell pools fewer seeds than the run has, else ``""``."""
    return f" ({count} of {expected} seeds)" if count < expected else ""


def cell_text(values: List[float], expected: int = 0) -> str:
    if not values:
        return "-"
    mean, low, high = summary(values)
    if len(values) == 1:
        return f"{mean:.2f}" + fewer(1, expected)
    return f"{mean:.2f} [{low:.2f}, {high:.2f}]" + fewer(len(values), expected)


def heading(series: Series, keys: List[Tuple[str, str]], train_length: int, title: str):
    """The lengths of ``keys`` and a table's first rows: its title, header and rule."""
    lengths = sorted({n for key in keys for n in series[key]})
    head = "| method | " + " | ".join(f"{n} ({n / train_length:g}x)" if train_length else str(n)
                                      for n in lengths) + " | seeds |"
    return lengths, [f"### {title}", "", head, "|" + "---|" * (len(lengths) + 2)]


def table(series: Series, keys: List[Tuple[str, str]], train_length: int, title: str) -> str:
    """Mean [min, max] over seeds; a cell with fewer seeds than the run has says so."""
    lengths, rows = heading(series, keys, train_length, title)
    expected = seeds_of(series)
    for key in keys:
        label = key[0] if key[1] == "none" else f"{key[0]} {key[1]}"
        seeds = max(len(v) for v in series[key].values())
        rows.append(f"| {label} | " + " | ".join(cell_text(list(series[key].get(n, {}).values()), expected)
                                                  for n in lengths) + f" | {seeds} |")
    return "\n".join(rows)


def paired_table(series: Series, keys: List[Tuple[str, str]], baseline: Tuple[str, str], train_length: int,
                 title: str) -> str:
    """Each key against ``baseline`` seed by seed (the same windows, the same seed's training data order):
    ``100 * (ppl / baseline ppl - 1)``, mean over seeds [min, max]; seeds that only one side has are left out."""
    lengths, rows = heading(series, keys, train_length, title)
    expected = seeds_of(series)
    for key in keys:
        if key == baseline:
            continue
        cells, paired_seeds = [], set()
        for n in lengths:
            mine, theirs = series[key].get(n, {}), series[baseline].get(n, {})
            shared = sorted(set(mine) & set(theirs))
            paired_seeds |= set(shared)
            changes = [100 * (mine[s] / theirs[s] - 1) for s in shared]
            if not changes:
                cells.append("-")
                continue
            mean, low, high = summary(changes)
            cells.append((f"{mean:+.1f}%" if len(changes) == 1 else f"{mean:+.1f}% [{low:+.1f}, {high:+.1f}]")
                         + fewer(len(changes), expected))
        label = key[0] if key[1] == "none" else f"{key[0]} {key[1]}"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {len(paired_seeds)} |")
    return "\n".join(rows)


def summarize(series: Series, keys: List[Tuple[str, str]]) -> Summary:
    """Each key's perplexity at each length: (mean, lowest, highest, seeds)."""
    return {key: {n: (*summary(list(by_seed.values())), len(by_seed)) for n, by_seed in sorted(series[key].items())}
            for key in keys}


def paired_summary(series: Series, keys: List[Tuple[str, str]], baseline: Tuple[str, str]) -> Summary:
    """Each key's change against ``baseline`` of the same seed, in %: (mean, lowest, highest, seeds)."""
    out: Summary = {}
    for key in keys:
        if key == baseline:
            continue
        for n, mine in sorted(series[key].items()):
            theirs = series[baseline].get(n, {})
            changes = [100 * (mine[s] / theirs[s] - 1) for s in sorted(set(mine) & set(theirs))]
            if changes:
                out.setdefault(key, {})[n] = (*summary(changes), len(changes))
    return out


def colours(keys: List[Tuple[str, str]], spellings: Optional[Dict[str, str]] = None) -> Dict[Tuple[str, str], str]:
    """A line colour per key: a position method's own (the registry's, ``styles.position_colour``) where
    the keys are methods as trained; an extension method's (``styles.method_style``) in a family's panel."""
    family = any(k[1] != "none" for k in keys)
    return {key: method_style((spellings or {}).get(key[1], key[1])).color if family else position_colour(key[0])
            for key in keys}


def plot(path: str, panels: List[Tuple[str, List[Tuple[str, str]]]], values: Summary, train_length: int,
         subset: str = "valid", changes: Optional[Summary] = None, baseline: str = "alibi", expected: int = 0,
         spellings: Optional[Dict[str, str]] = None) -> None:
    """A column per (title, keys): perplexity against length, a line per key, the seeds' range as a
    band; with ``changes`` (one panel), above it the change against ``baseline`` of the same seed,
    the seeds' range as bars, which leads the figure.  Legends sit outside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if changes else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(6.4 * len(panels) + 2.4, 4.6 + 3.8 * (rows - 1)),
                             squeeze=False, sharex="col", layout="constrained")
    for column, (title, keys) in enumerate(panels):
        ax, colour = axes[-1][column], colours(keys, spellings)
        short = False
        for key in keys:
            lengths = sorted(values[key])
            means, lows, highs, counts = zip(*(values[key][n] for n in lengths))
            label = key[0] if key[1] == "none" else f"{key[0]} {key[1]}"
            ax.plot(lengths, means, marker="o", ms=3, color=colour[key], label=label)
            ax.fill_between(lengths, lows, highs, color=colour[key], alpha=0.18, linewidth=0)
            thin = [(n, m) for n, m, c in zip(lengths, means, counts) if c < expected]
            if thin:  # a mean over fewer seeds than the others: not comparable as it stands
                short = True
                ax.plot(*zip(*thin), ls="none", marker="x", ms=8, color=colour[key])
        if short:
            ax.plot([], [], ls="none", marker="x", color="grey", label=f"fewer than the run's {expected} seeds")
        if train_length:
            ax.axvline(train_length, color="black", lw=0.8, ls=":")
        log_axis(ax, "x", 2)
        log_axis(ax, "y", 10)
        finite = [v for key in keys for row in values[key].values() for v in row[:3] if math.isfinite(v)]
        if finite:
            ax.set_ylim(min(finite) * 0.95, min(max(finite), 8 * min(finite)) * 1.05)
        ax.set_xlabel("evaluation length (tokens; dotted: training length L)")
        ax.set_ylabel(f"{subset} perplexity (mean over seeds; band: their range)")
        ax.set_title(title if rows == 1 else "perplexity", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        legend_outside(ax, fontsize=8)
        if rows == 2:
            top = axes[0][column]
            top.axhline(0.0, color="grey", lw=0.9, label=f"{baseline} (no difference)")
            for key in keys:
                if key not in changes:
                    continue
                lengths = sorted(changes[key])
                means, lows, highs, _ = zip(*(changes[key][n] for n in lengths))
                top.errorbar(lengths, means, yerr=[[m - lo for m, lo in zip(means, lows)],
                                                   [hi - m for m, hi in zip(means, highs)]],
                             marker="o", ms=3, capsize=3, elinewidth=0.9, color=colour[key], label=key[0])
            log_axis(top, "x", 2)
            if train_length:
                top.axvline(train_length, color="black", lw=0.8, ls=":")
            top.set_ylabel(f"{subset} perplexity change against\n{baseline} of the same seed (%)")
            top.set_title(f"{title}: change against {baseline} of the same seed (bars: the seeds' range)",
                          fontsize=10)
            top.grid(True, which="both", alpha=0.3)
            legend_outside(top, fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


CSV_FIELDS = ("quantity", "method", "extension", "length", "train_length", "mean", "low", "high", "seeds",
              "run_seeds", "source")


def summary_rows(quantity: str, values: Summary, train_length: int, expected: int, source: str) -> List[dict]:
    """The rows of ``positions.csv`` for ``values`` (``quantity``: ``perplexity`` or ``change_vs_alibi``, %)."""
    return [dict(quantity=quantity, method=key[0], extension=key[1], length=n, train_length=train_length,
                 mean=f"{v[0]:.6g}", low=f"{v[1]:.6g}", high=f"{v[2]:.6g}", seeds=v[3], run_seeds=expected,
                 source=source) for key, by_length in values.items() for n, v in by_length.items()]


def write_summary(path: str, rows: List[dict]) -> None:
    """``positions.csv``: what ``positions.png`` draws, number by number, so that the figure can be
    drawn again from it (``--table``) without the results.json."""
    import csv
    import io

    from fairseq_alibi.evaluation.store import atomic_write

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, buf.getvalue())


def read_summary(path: str) -> Tuple[Summary, Summary, int, int]:
    """(perplexities, changes against ALiBi, L, the run's seeds) of a ``positions.csv`` (lines starting
    with ``#`` are notes); only the methods as trained (extension ``none``)."""
    import csv

    try:
        with open(path, encoding="utf-8") as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        values: Summary = defaultdict(dict)
        changes: Summary = defaultdict(dict)
        lengths, seeds = set(), set()
        for row in rows:
            if row["extension"] != "none":
                continue
            target = {"perplexity": values, "change_vs_alibi": changes}[row["quantity"]]
            target[(row["method"], "none")][int(row["length"])] = (
                float(row["mean"]), float(row["low"]), float(row["high"]), int(row["seeds"]))
            lengths.add(int(row["train_length"]))
            seeds.add(int(row["run_seeds"]))
    except (OSError, KeyError, ValueError) as exc:
        raise SystemExit(f"error: cannot read the summary table {path}: {exc}; give a positions.csv that "
                         f"report.py wrote (columns: {', '.join(CSV_FIELDS)})") from None
    if not values or len(lengths) != 1:
        raise SystemExit(f"error: {path} holds no perplexity rows of one training length; give a positions.csv "
                         "that report.py wrote")
    return dict(values), dict(changes), lengths.pop(), max(seeds)


def words(text: Optional[str], separator: Optional[str] = None) -> Tuple[str, ...]:
    return tuple(w.strip() for w in (text or "").split(separator) if w.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", help="results.json of the sweep over every model (methods: none)")
    parser.add_argument("--table", help="draw positions.png again from a positions.csv that this script wrote "
                        "(what the figure draws, number by number) instead of a results.json")
    parser.add_argument("--extensions", help="results.json of the extension-method sweep (the models of the "
                        "position methods that have extension methods: " + ", ".join(
                            name for name, p in POSITIONS.items() if set(p.extensions) - {"none"}) + ")")
    parser.add_argument("--output", default=".", help="where positions.png and extensions.png go")
    parser.add_argument("--positions", help="only these position methods (space-separated; default: every one "
                        "the results hold, of: " + " ".join(registry_order()) + ")")
    parser.add_argument("--seeds", help="only these seeds (space-separated; default: every one)")
    parser.add_argument("--lengths", help="only these lengths (comma-separated, 4x or tokens; default: every one)")
    parser.add_argument("--subset", default="valid", help="the split whose cells to report (default: %(default)s)")
    parser.add_argument("--extension-methods", help="only these extension methods in the --extensions results "
                        "(a --methods list; default: every one)")
    args = parser.parse_args(argv)
    if bool(args.table) == bool(args.results):
        raise SystemExit("error: give either a results.json or --table positions.csv (one of the two); "
                         "see --help")
    if args.table:
        values, changes, train_length, expected = read_summary(args.table)
        keys = [(m, "none") for m in ordered(m for m, _ in values)]
        os.makedirs(args.output, exist_ok=True)
        plot(os.path.join(args.output, "positions.png"), [(f"trained at L = {train_length}, evaluated longer", keys)],
             values, train_length, args.subset, changes or None, expected=expected)
        return 0
    try:
        selection = Selection(words(args.positions), tuple(int(s) for s in words(args.seeds)),
                              words(args.lengths, ","), words(args.extension_methods, ","))
    except ValueError as exc:
        raise SystemExit(f"error: --seeds {args.seeds!r}: {exc}; give seeds as whole numbers") from None
    series, train_length = load(args.results, replace(selection, methods=()), args.subset)  # every model as trained
    keys = [(m, "none") for m in ordered(m for m, label in series if label == "none")]
    os.makedirs(args.output, exist_ok=True)
    print(table(series, keys, train_length, "Perplexity against evaluation length (mean over seeds [min, max])"))
    if ("alibi", "none") in series and len(keys) > 1:
        print("\n" + paired_table(series, keys, ("alibi", "none"), train_length,
                                  "Against ALiBi of the same seed (perplexity change, mean over seeds [min, max])"))
    values, expected = summarize(series, keys), seeds_of(series)
    changes = paired_summary(series, keys, ("alibi", "none")) if ("alibi", "none") in series else {}
    plot(os.path.join(args.output, "positions.png"), [(f"trained at L = {train_length}, evaluated longer", keys)],
         values, train_length, args.subset, changes or None, expected=expected)
    write_summary(os.path.join(args.output, "positions.csv"),
                  summary_rows("perplexity", values, train_length, expected, args.results)
                  + summary_rows("change_vs_alibi", changes, train_length, expected, args.results))
    if args.extensions and os.path.exists(args.extensions):
        spellings: Dict[str, str] = {}
        extended, _ = load(args.extensions, selection, args.subset, spellings)
        panels = []
        for family in ordered(m for m, _ in extended):
            family_keys = sorted((k for k in extended if k[0] == family), key=lambda k: (k[1] != "none", k[1]))
            if family_keys:
                print("\n" + table(extended, family_keys, train_length, f"{family}: context-extension methods"))
                if (family, "none") in extended and len(family_keys) > 1:
                    print("\n" + paired_table(extended, family_keys, (family, "none"), train_length,
                                              f"{family}: each method against the plain model of the same seed"))
                panels.append((f"{family}: extension methods at evaluation", family_keys))
        if panels:
            plot(os.path.join(args.output, "extensions.png"), panels,
                 summarize(extended, [k for _, keys in panels for k in keys]), train_length, args.subset,
                 expected=seeds_of(extended), spellings=spellings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
