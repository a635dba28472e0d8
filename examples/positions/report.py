"""The comparison's figure and tables from alibi-sweep results (``compare.sh``).

Checkpoints are named ``METHOD_sSEED``; for every method and evaluation length
this prints the mean perplexity over seeds with the lowest and highest seed
``mean [min, max]`` (three seeds give no useful interval of their own: the
band is the seeds' range, and says so); each method against ALiBi of the same
seed (the same windows: the paired change in %, mean [min, max] over seeds,
which the seeds' own spread does not blur); and draws ``positions.png``:
perplexity against evaluation length, one line per method, the band the
seeds' range.  With ``--extensions`` it also tabulates and draws the
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
from fairseq_alibi.evaluation.styles import position_colour
from fairseq_alibi.evaluation.report import save_figure  # writes no file through a link

NAME = re.compile(r"^(?P<method>.+)_s(?P<seed>\d+)$")


def registry_order() -> Tuple[str, ...]:
    """The order of the tables and legends: the stock model, then the registry's methods."""
    return ("sinusoidal", *POSITIONS)

Series = Dict[Tuple[str, str], Dict[int, Dict[int, float]]]  # (position, extension label) -> length -> seed -> ppl


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


def load(path: str, selection: Selection = Selection(), subset: str = "valid") -> Tuple[Series, int]:
    """Perplexities by (position method, extension label) and length, one per seed; and L.
    Only ``subset``'s cells (a results.json keeps other splits' too); two cells for one
    (method, label, length, seed) are refused (neither may stand for the other)."""
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


def plot(path: str, panels: List[Tuple[str, List[Tuple[str, str]]]], series: Series, train_length: int,
         subset: str = "valid") -> None:
    """One panel per (title, keys): perplexity against length, a line per key, the seeds' range as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    expected = seeds_of(series)
    for ax, (title, keys) in zip(axes[0], panels):
        short = False
        for index, key in enumerate(keys):
            lengths = sorted(series[key])
            means, lows, highs = zip(*(summary(list(series[key][n].values())) for n in lengths))
            plain = "black" if any(k[1] != "none" for k in keys) else position_colour(key[0])  # a family's panel
            colour = plain if key[1] == "none" else plt.cm.tab10(index % 10)
            label = key[0] if key[1] == "none" else f"{key[0]} {key[1]}"
            ax.plot(lengths, means, marker="o", ms=3, color=colour, label=label)
            ax.fill_between(lengths, lows, highs, color=colour, alpha=0.18, linewidth=0)
            thin = [(n, m) for n, m in zip(lengths, means) if len(series[key][n]) < expected]
            if thin:  # a mean over fewer seeds than the others: not comparable as it stands
                short = True
                ax.plot(*zip(*thin), ls="none", marker="x", ms=8, color=colour)
        if short:
            ax.plot([], [], ls="none", marker="x", color="grey", label=f"fewer than the run's {expected} seeds")
        if train_length:
            ax.axvline(train_length, color="black", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        finite = [v for key in keys for by_seed in series[key].values() for v in by_seed.values() if math.isfinite(v)]
        if finite:
            ax.set_ylim(min(finite) * 0.95, min(max(finite), 8 * min(finite)) * 1.05)
        ax.set_xlabel("evaluation length (tokens; dotted: training length L)")
        ax.set_ylabel(f"{subset} perplexity (mean over seeds; band: their range)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def words(text: Optional[str], separator: Optional[str] = None) -> Tuple[str, ...]:
    return tuple(w.strip() for w in (text or "").split(separator) if w.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.json of the sweep over every model (methods: none)")
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
    plot(os.path.join(args.output, "positions.png"),
         [(f"trained at L = {train_length}, evaluated longer", keys)], series, train_length, args.subset)
    if args.extensions and os.path.exists(args.extensions):
        extended, _ = load(args.extensions, selection, args.subset)
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
            plot(os.path.join(args.output, "extensions.png"), panels, extended, train_length, args.subset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
