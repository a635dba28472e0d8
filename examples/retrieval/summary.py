"""Retrieval results of several seeds, side by side: which method, where, on which model.

Reads the ``results.json`` of one ``alibi-retrieval`` run per seed (the same
task; each model under the same checkpoint name in every run, as ``run.sh``
names them: ``alibi``, ``rotary``, ``sinusoidal``, ...) and prints Markdown
tables for every checkpoint the runs hold (or those given with
``--checkpoint``; a model missing from some runs, such as the sinusoidal
baseline of the first seed only, is summarized over the runs that hold it):

* exact-match accuracy (%) by prompt length: a row per method, a column per
  model at each length; ``n/a`` where the method does not apply to the model's
  position method (``fairseq_alibi.core.positions``: ALiBi's methods under
  ``alibi``, RoPE's under ``rotary``), blank where it was not evaluated;
* per model: accuracy by needle distance (tokens from the queried record to
  the end of the prompt) in bins of the training length L, the mean answer
  log-probability by length, and each run's accuracy by length with its own
  95 % Wilson interval;

and, with ``--plot``, accuracy vs length and vs needle distance (mean line,
lowest-to-highest band), a colour and marker per method as in ``alibi-sweep``
and ``alibi-retrieval`` (``fairseq_alibi/evaluation/styles.py``), a line style
per model.

One convention for every accuracy across runs (:data:`CONVENTION`):
``mean [lowest, highest] (pooled low-high)``: each run's accuracy over all its
prompts of the cell (depths pooled), the mean of those per-run accuracies and
the lowest and highest of them, then the 95 % Wilson interval of all the runs'
prompts pooled (the binomial uncertainty of the prompts; the spread between
seeds is the brackets).  ``frontier.py`` and the tables of docs/results/retrieval-*.md use it too.

    python examples/retrieval/summary.py seed1=out/seed1/families/results.json \\
        seed2=out/seed2/families/results.json seed3=out/seed3/families/results.json \\
        --plot out/summary-families.png
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fairseq_alibi.evaluation.report import log_axis, save_figure
from fairseq_alibi.evaluation.report import percent_text as pc  # pc: whole percent, never 0 or 100

CONVENTION = ("mean over runs [lowest run, highest run] (pooled: the 95 % Wilson interval of all the runs' prompts "
              "together)")

Runs = Dict[str, List[dict]]  # run name -> one model's cells in that run
Match = Callable[[dict], bool]


@dataclass
class Retrieval:
    """One method's retrieval over runs: each run's (correct, n); :data:`CONVENTION` as text."""

    per_seed: List[Tuple[int, int]]

    @property
    def accuracies(self) -> List[float]:
        return [c / n for c, n in self.per_seed]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.accuracies)

    def pooled_wilson(self) -> Tuple[float, float]:
        from fairseq_alibi.evaluation.intervals import wilson

        return wilson(sum(c for c, _ in self.per_seed), sum(n for _, n in self.per_seed))

    def text(self) -> str:
        low, high = self.pooled_wilson()
        return (f"{pc(100 * self.mean)} [{pc(100 * min(self.accuracies))}, {pc(100 * max(self.accuracies))}] "
                f"(pooled {pc(100 * low)}-{pc(100 * high)})")


@dataclass
class Model:
    """One checkpoint name across runs: its registered model (``transformer_lm_alibi``, ...) and cells per run."""

    name: str
    model: str
    runs: Runs

    def applies(self, method: str) -> Optional[bool]:
        """Whether an extension method applies to this model's position method;
        None where the model is not a registered fairseq LM (a Hugging Face one)."""
        from types import SimpleNamespace

        from fairseq_alibi.evaluation.axes import applicable
        from fairseq_alibi.facts import language_models, position_of

        if self.model not in language_models():
            return None
        return method in applicable(SimpleNamespace(position=position_of(self.model)))


def read_results(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read retrieval results {path}: {exc}") from None
    if not isinstance(results, dict) or not isinstance(results.get("cells"), list):
        raise SystemExit(f"error: {path} is not an alibi-retrieval results.json (no list of cells)")
    return results


def load(specs: Sequence[str], checkpoints: Sequence[str] = ()) -> Tuple[List[Model], list]:
    """(the models, in the order the runs list them; the --methods spellings, parsed)."""
    from fairseq_alibi.core.scaling import Scaling

    models: Dict[str, Model] = {}
    order: List[str] = []
    for spec in specs:
        name, _, path = spec.rpartition("=")
        results = read_results(path)
        for cell in results["cells"]:
            if checkpoints and cell["checkpoint"] not in checkpoints:
                continue
            model = models.setdefault(cell["checkpoint"], Model(cell["checkpoint"], cell.get("model", "?"), {}))
            model.runs.setdefault(name or path, []).append(cell)
        order += [m for m in results.get("meta", {}).get("methods", []) if m not in order]
    missing = [c for c in checkpoints if c not in models]
    if missing:
        raise SystemExit(f"error: no run holds cells of checkpoint {', '.join(missing)}")
    if not models:
        raise SystemExit("error: the runs hold no cells")
    if checkpoints:
        models = {c: models[c] for c in checkpoints}
    lengths = {c["train_length"] for m in models.values() for cells in m.runs.values() for c in cells}
    if len(lengths) > 1:
        raise SystemExit(f"error: the runs hold models trained at different lengths ({', '.join(map(str, lengths))}): "
                         "summarize each training length on its own (--checkpoint)")
    return list(models.values()), [Scaling.parse(m) for m in order]


def method_key(cell: dict) -> tuple:
    """What identifies a cell's method: (method, factor, alpha), alpha included
    (``log:1:0.25`` and ``log:1:1`` share method and factor)."""
    if "_key" not in cell:
        from fairseq_alibi.core.scaling import Scaling

        cell["_key"] = Scaling.from_record(cell).key
    return cell["_key"]


def methods_in_order(models: Sequence[Model], given) -> List[Tuple[tuple, str]]:
    """(key, label) of every method any model holds, in the order the runs' --methods gave them (others after)."""
    rank = {m.key: i for i, m in enumerate(given)}
    seen = {method_key(c): c["label"] for m in models for cells in m.runs.values() for c in cells}
    return sorted(seen.items(), key=lambda item: (rank.get(item[0], len(rank)), repr(item[0])))


def pooled(cells: List[dict]) -> Tuple[int, int, float]:
    n = sum(c["n"] for c in cells)
    return sum(c["correct"] for c in cells), n, sum(c["answer_logprob"] * c["n"] for c in cells) / max(n, 1)


def across_runs(runs: Runs, match: Match) -> Optional[Retrieval]:
    """The runs' retrieval on the cells ``match`` keeps (runs without such cells left out)."""
    per_run = [pooled([c for c in cells if match(c)])[:2] for cells in runs.values()]
    per_run = [(k, n) for k, n in per_run if n]
    return Retrieval(per_run) if per_run else None


def distance_bins(train_length: int) -> List[Tuple[int, int]]:
    edges = [0, train_length // 2, train_length, 2 * train_length, 3 * train_length, 4 * train_length,
             6 * train_length, 8 * train_length, 16 * train_length]
    return list(zip(edges, edges[1:]))


def of_method(key: tuple) -> Match:
    return lambda c: method_key(c) == key


def of_length(length: int) -> Match:
    return lambda c: c["length"] == length


def of_distance(low: int, high: int) -> Match:
    return lambda c: c.get("needle_distance") is not None and low <= c["needle_distance"] < high


def both(a: Match, b: Match) -> Match:
    return lambda c: a(c) and b(c)


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def side_by_side(models: Sequence[Model], rows, lengths: Sequence[int], train_length: int) -> List[str]:
    """Accuracy by length, a column per model at each length; ``n/a`` where a method does not apply."""
    columns = [(model, length) for length in lengths for model in models]
    header = ["method"] + [f"{model.name} {length} ({length / train_length:g}x)" for model, length in columns]
    body = []
    for key, label in rows:
        line = []
        for model, length in columns:
            shown = across_runs(model.runs, both(of_method(key), of_length(length)))
            line.append("n/a" if model.applies(key[0]) is False else shown.text() if shown else "")
        body.append([label] + line)
    return markdown(header, body)


def by_distance(model: Model, rows, bins) -> List[str]:
    body = []
    for key, label in rows:
        shown = [across_runs(model.runs, both(of_method(key), of_distance(lo, hi))) for lo, hi in bins]
        body.append([label] + [r.text() if r else "" for r in shown])
    return markdown(["method"] + [f"{lo}-{hi - 1}" for lo, hi in bins], body)


def logprob_by_length(model: Model, rows, lengths) -> List[str]:
    """The mean answer log-probability x 100: mean [lowest, highest] of the runs'."""
    body = []
    for key, label in rows:
        line = []
        for length in lengths:
            match = both(of_method(key), of_length(length))
            kept = [[c for c in cells if match(c)] for cells in model.runs.values()]
            values = [100 * pooled(cs)[2] for cs in kept if cs]
            line.append(f"{pc(statistics.fmean(values))} [{pc(min(values))}, {pc(max(values))}]" if values else "")
        body.append([label] + line)
    return markdown(["method"] + [str(n) for n in lengths], body)


def per_run(model: Model, rows, lengths) -> List[str]:
    """Accuracy % per method and run, with the Wilson interval of that run's prompts."""
    from fairseq_alibi.evaluation.intervals import wilson

    body = []
    for key, label in rows:
        for name, cells in model.runs.items():
            line = []
            for length in lengths:
                match = both(of_method(key), of_length(length))
                k, n, _ = pooled([c for c in cells if match(c)])
                low, high = wilson(k, n) if n else (None, None)
                line.append(f"{pc(100.0 * k / n)} [{pc(100 * low)}, {pc(100 * high)}] ({n})" if n else "")
            body.append([label, name] + line)
    return markdown(["method", "run"] + [str(n) for n in lengths], body)


def runs_text(model: Model) -> str:
    return f"{len(model.runs)} run{'' if len(model.runs) == 1 else 's'}"


def model_part(model: Model, rows, train_length: int) -> List[str]:
    """One model's own tables: by needle distance, log-probability, each run with its interval."""
    cells = [c for cs in model.runs.values() for c in cs]
    rows = [(key, label) for key, label in rows if any(method_key(c) == key for c in cells)]
    lengths = sorted({c["length"] for c in cells})
    bins = [b for b in distance_bins(train_length) if any(of_distance(*b)(c) for c in cells)]
    return (["", f"## {model.name} ({model.model}): {runs_text(model)} ({', '.join(model.runs)})", "",
             "Accuracy % by needle distance (tokens from the queried record to the prompt's end), "
             "all lengths pooled\n"] + by_distance(model, rows, bins)
            + ["", "Mean answer log-probability (nats per answer token) x 100 by prompt length, mean [lowest, "
               "highest] over runs\n"] + logprob_by_length(model, rows, lengths)
            + ["", "Accuracy % by prompt length in each run, [95 % Wilson interval] (prompts)\n"]
            + per_run(model, rows, lengths))


def summary(models: Sequence[Model], given=()) -> Tuple[str, dict]:
    cells = [c for m in models for cs in m.runs.values() for c in cs]
    train_length = cells[0]["train_length"]
    lengths = sorted({c["length"] for c in cells})
    rows = methods_in_order(models, given)
    names = ", ".join(f"{m.name}: {runs_text(m)}" for m in models)
    text = [f"Every accuracy across runs is {CONVENTION}; L = {train_length}.", "",
            f"Accuracy % by prompt length, a column per model at each length ({names}); n/a: the method does not "
            "apply to that model's position method\n"]
    text += side_by_side(models, rows, lengths, train_length)
    for model in models:
        text += model_part(model, rows, train_length)
    return "\n".join(text) + "\n", dict(train_length=train_length, rows=rows, lengths=lengths)


def plot(path: str, models: Sequence[Model], layout) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_alibi.evaluation import styles

    train_length = layout["train_length"]
    bins = distance_bins(train_length)
    line_style = styles.line_styles(m.name for m in models)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained", sharey=True)
    for ax, columns, xlabel in (
        (axes[0], [(n, of_length(n)) for n in layout["lengths"]], "prompt length (tokens)"),
        (axes[1], [((lo + hi) / 2, of_distance(lo, hi)) for lo, hi in bins], "needle distance (tokens, bin centre)"),
    ):
        for model in models:
            for key, label in layout["rows"]:
                points = [(x, across_runs(model.runs, both(of_method(key), match))) for x, match in columns]
                points = [(x, r) for x, r in points if r]
                if not points:
                    continue
                method = next(c for cells in model.runs.values() for c in cells if method_key(c) == key)
                xs = [x for x, _ in points]
                line, = ax.plot(xs, [100 * r.mean for _, r in points], label=f"{model.name}: {label}",
                                **styles.plot_kwargs(method, line_style[model.name]))
                ax.fill_between(xs, [100 * min(r.accuracies) for _, r in points],
                                [100 * max(r.accuracies) for _, r in points], color=line.get_color(), alpha=0.12, lw=0)
        ax.axvline(train_length, color="grey", lw=0.8, ls=":", label=f"training length: {train_length} tokens")
        log_axis(ax, "x", 2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("exact-match accuracy (%)")
        ax.grid(True, which="both", alpha=0.3)
    runs = max(len(m.runs) for m in models)
    axes[0].set_title(f"line: mean over up to {runs} runs; shaded: lowest to highest run")
    axes[1].set_title("the same by needle distance")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", metavar="NAME=RESULTS.JSON")
    p.add_argument("--checkpoint", action="append", default=[],
                   help="summarize this checkpoint name of the results (repeatable; default: every one)")
    p.add_argument("--plot", default=None, help="write accuracy vs length and vs distance here (PNG)")
    args = p.parse_args(argv)
    models, given = load(args.results, args.checkpoint)
    logging.basicConfig(level=logging.WARNING, force=True)  # importing fairseq set the root logger to DEBUG
    text, layout = summary(models, given)
    sys.stdout.write(text)
    if args.plot:
        plot(args.plot, models, layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
