"""Retrieval results of several seeds, side by side: which method, where.

Reads the ``results.json`` of one ``alibi-retrieval`` run per seed (the same
task, lengths and methods; each seed's model under the name given) and prints
Markdown tables of the spread across seeds, ``mean [min, max]``: each seed's
value is computed from all its prompts in the table cell (depths pooled), then
the mean of those per-seed values and the lowest and highest of them:

* exact-match accuracy (%) by prompt length, a row per method;
* accuracy by needle distance (tokens from the queried record to the end of
  the prompt), in bins of the training length L, a row per method;
* the mean answer log-probability by length;

then the uncertainty within each seed: accuracy by length per seed with its
95 % Wilson interval (the binomial interval of that seed's prompts);
and, with ``--plot``, accuracy vs length and vs needle distance (mean line,
min-max band) per method, in the colours and markers of ``alibi-sweep`` and
``alibi-retrieval`` (``fairseq_alibi/evaluation/styles.py``).

    python examples/retrieval/summary.py seed1=out/seed1/lines/results.json \\
        seed2=out/seed2/lines/results.json seed3=out/seed3/lines/results.json \\
        --checkpoint alibi --plot docs/retrieval-methods.png
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Dict, List, Sequence, Tuple


def load(specs: Sequence[str], checkpoint: str) -> Tuple[Dict[str, List[dict]], List[str]]:
    """(seed name -> the cells of ``checkpoint`` in that seed's results, the --methods spellings)."""
    from fairseq_alibi.core.scaling import Scaling

    out, order = {}, []
    for spec in specs:
        name, _, path = spec.rpartition("=")
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        cells = [c for c in results["cells"] if c["checkpoint"] == checkpoint]
        if not cells:
            raise SystemExit(f"error: {path} has no cells of checkpoint {checkpoint!r}")
        out[name or path] = cells
        order += [m for m in results.get("meta", {}).get("methods", []) if m not in order]
    return out, [Scaling.parse(m) for m in order]


def method_key(cell: dict) -> tuple:
    """What identifies a cell's method: (method, factor, alpha), alpha included
    (``log:1:0.25`` and ``log:1:1`` share method and factor)."""
    if "_key" not in cell:
        from fairseq_alibi.core.scaling import Scaling

        cell["_key"] = Scaling.from_record(cell).key
    return cell["_key"]


def methods_in_order(runs: Dict[str, List[dict]], given) -> List[Tuple[tuple, str]]:
    """(key, label) in the order the runs' --methods gave them (others after)."""
    rank = {m.key: i for i, m in enumerate(given)}
    seen = {method_key(c): c["label"] for cells in runs.values() for c in cells}
    return sorted(seen.items(), key=lambda item: (rank.get(item[0], len(rank)), repr(item[0])))


def pooled(cells: List[dict]) -> Tuple[int, int, float]:
    n = sum(c["n"] for c in cells)
    return sum(c["correct"] for c in cells), n, sum(c["answer_logprob"] * c["n"] for c in cells) / max(n, 1)


def distance_bins(train_length: int) -> List[Tuple[int, int]]:
    edges = [0, train_length // 2, train_length, 2 * train_length, 3 * train_length, 4 * train_length,
             6 * train_length, 8 * train_length, 16 * train_length]
    return list(zip(edges, edges[1:]))


def table(runs, rows, columns, value, header: str, column_name) -> List[str]:
    """A Markdown table, ``value(cells) -> float or None`` per seed, mean [min-max] per cell."""
    out = [f"| {header} | " + " | ".join(column_name(c) for c in columns) + " |",
           "|---|" + "---|" * len(columns)]
    for label, match in rows:
        line = []
        for column in columns:
            values = [value([c for c in cells if match(c) and column[1](c)]) for cells in runs.values()]
            values = [v for v in values if v is not None]
            if not values:
                line.append("")
            elif len(values) == 1:
                line.append(f"{values[0]:.0f}")
            else:
                line.append(f"{sum(values) / len(values):.0f} [{min(values):.0f}, {max(values):.0f}]")
        out.append(f"| {label} | " + " | ".join(line) + " |")
    return out


def accuracy(cells):
    k, n, _ = pooled(cells)
    return 100.0 * k / n if n else None


def per_seed_table(runs, rows, columns, column_name) -> List[str]:
    """Accuracy % per method and seed, with the Wilson interval of that seed's prompts."""
    from fairseq_alibi.evaluation.intervals import wilson

    out = ["| method | run | " + " | ".join(column_name(c) for c in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
    for label, match in rows:
        for name, cells in runs.items():
            line = []
            for column in columns:
                k, n, _ = pooled([c for c in cells if match(c) and column[1](c)])
                low, high = wilson(k, n) if n else (None, None)
                line.append(f"{100.0 * k / n:.0f} [{100 * low:.0f}, {100 * high:.0f}] ({n})" if n else "")
            out.append(f"| {label} | {name} | " + " | ".join(line) + " |")
    return out


def summary(runs: Dict[str, List[dict]], given=()) -> Tuple[str, dict]:
    train_length = next(iter(runs.values()))[0]["train_length"]
    lengths = sorted({c["length"] for cells in runs.values() for c in cells})
    rows = [(label, lambda c, k=k: method_key(c) == k) for k, label in methods_in_order(runs, given)]
    by_length = [(n, lambda c, n=n: c["length"] == n) for n in lengths]
    bins = [((lo, hi), lambda c, lo=lo, hi=hi: c.get("needle_distance") is not None and lo <= c["needle_distance"] < hi)
            for lo, hi in distance_bins(train_length)]
    bins = [b for b in bins if any(b[1](c) for cells in runs.values() for c in cells)]
    name = ", ".join(runs)
    text = [f"Accuracy % by prompt length, mean [min, max] over {len(runs)} runs ({name}): each run's accuracy over "
            f"its prompts, then their mean, lowest and highest; L = {train_length}\n"]
    text += table(runs, rows, by_length, accuracy, "method",
                  lambda col: f"{col[0]} ({col[0] / train_length:g}x)")
    text += ["", "Accuracy % by needle distance (tokens from the queried record to the prompt's end)\n"]
    text += table(runs, rows, bins, accuracy, "method", lambda col: f"{col[0][0]}-{col[0][1] - 1}")
    text += ["", "Mean answer log-probability (nats per answer token) x 100, by prompt length\n"]
    text += table(runs, rows, by_length, lambda cells: 100 * pooled(cells)[2] if cells else None, "method",
                  lambda col: str(col[0]))
    text += ["", "Accuracy % by prompt length in each run, [95 % Wilson interval] (prompts)\n"]
    text += per_seed_table(runs, rows, by_length, lambda col: str(col[0]))
    return "\n".join(text) + "\n", dict(train_length=train_length, rows=rows, by_length=by_length, bins=bins)


def plot(path: str, runs, layout) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_alibi.evaluation import styles

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained", sharey=True)
    for ax, columns, xs_of, xlabel in (
        (axes[0], layout["by_length"], lambda col: col[0], "prompt length (tokens)"),
        (axes[1], layout["bins"], lambda col: (col[0][0] + col[0][1]) / 2, "needle distance (tokens, bin centre)"),
    ):
        for label, match in layout["rows"]:
            xs, mean, lo, hi = [], [], [], []
            for column in columns:
                values = [accuracy([c for c in cells if match(c) and column[1](c)]) for cells in runs.values()]
                values = [v for v in values if v is not None]
                if values:
                    xs.append(xs_of(column))
                    mean.append(sum(values) / len(values))
                    lo.append(min(values))
                    hi.append(max(values))
            method = next(c for cells in runs.values() for c in cells if match(c))
            line, = ax.plot(xs, mean, label=label, **styles.plot_kwargs(method))
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12, lw=0)
        ax.axvline(layout["train_length"], color="grey", lw=0.8, ls=":",
                   label=f"training length: {layout['train_length']} tokens")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("exact-match accuracy (%)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title(f"line: mean over {len(runs)} runs; shaded: lowest to highest run")
    axes[1].set_title("the same by needle distance")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", metavar="NAME=RESULTS.JSON")
    p.add_argument("--checkpoint", default="alibi", help="the checkpoint name in the results (default: %(default)s)")
    p.add_argument("--plot", default=None, help="write accuracy vs length and vs distance here (PNG)")
    args = p.parse_args(argv)
    runs, given = load(args.results, args.checkpoint)
    logging.basicConfig(level=logging.WARNING, force=True)  # importing fairseq set the root logger to DEBUG
    text, layout = summary(runs, given)
    sys.stdout.write(text)
    if args.plot:
        plot(args.plot, runs, layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
