"""The retrieval-perplexity frontier: what each context-extension method buys and costs.

For every method of a grid: retrieval accuracy at ``--at`` x L (``lines`` and
``passkey``, each seed's ``alibi-retrieval`` results) against the perplexity
cost at ``--ppl-at`` x L (``ppl(method) / ppl(none) - 1`` of the demo model on
real text, from ``alibi-sweep`` cells with per-window losses).  Parameters are
chosen on the TUNE seeds and models and reported on the REPORT ones:

* per family (``cap``, ``log``, ``capnorm``), the member with the best tune
  retrieval among those whose tune cost is at most ``--max-cost``;
* on the report seeds, every method with intervals: retrieval as the mean of
  the seeds' accuracies [lowest, highest seed] and the 95 % Wilson interval of
  all their prompts pooled; the cost with a 95 % paired t-interval over windows
  (per-window differences of the method and ``none``, windows matched by index);
* the goal: retrieval within ``--within`` points of ``cap`` at a cost of at
  most ``--max-cost`` (issue 29), checked per method on the report seeds.

    python examples/retrieval/frontier.py --methods none,ntk,cap,cap:2,log,capnorm \\
        --tune outputs/frontier/retrieval-c1 --tune-seeds "1 2" \\
        --report outputs/frontier/retrieval-c5 --report-seeds "31 32 33" \\
        --demo-sweep outputs/frontier/demo-sweep/results.json --output outputs/frontier/frontier

Prints Markdown; writes ``frontier.png`` (a point per method, retrieval
against cost, both intervals; the frontier dashed) into ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from summary import Retrieval  # the one convention for retrieval over seeds (this folder)
from fairseq_alibi.evaluation.report import save_figure  # writes no file through a link

TASKS = ("lines", "passkey")
FAMILIES = ("ntk", "cap", "log", "power", "capnorm")


def spelling(cell: dict) -> str:
    from fairseq_alibi.core.scaling import Scaling

    return Scaling.from_record(cell).spelling


def read_cells(path: str) -> List[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["cells"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"error: cannot read results {path}: {exc}") from None


def at_ratio(cells: List[dict], ratio: float) -> List[dict]:
    return [c for c in cells if c.get("length_ratio") is not None and abs(c["length_ratio"] - ratio) < 1e-9]


def retrieval(directory: str, seeds: Sequence[str], task: str, ratio: float) -> Dict[str, Retrieval]:
    """Method -> its retrieval at ``ratio`` x L over ``seeds`` (depths pooled per seed)."""
    per_method: Dict[str, Dict[str, Tuple[int, int]]] = {}
    for seed in seeds:
        cells = at_ratio(read_cells(os.path.join(directory, f"seed{seed}", task, "results.json")), ratio)
        for cell in cells:
            correct, n = per_method.setdefault(spelling(cell), {}).get(seed, (0, 0))
            per_method[spelling(cell)][seed] = (correct + cell["correct"], n + cell["n"])
    return {m: Retrieval([by_seed[s] for s in seeds]) for m, by_seed in per_method.items() if len(by_seed) == len(seeds)}


@dataclass
class Cost:
    """One method's perplexity cost against ``none`` on one model: the point and its paired interval."""

    value: float
    low: Optional[float]
    high: Optional[float]

    def text(self) -> str:
        if self.low is None:
            return f"{100 * self.value:+.2f}%"
        return f"{100 * self.value:+.2f}% [{100 * self.low:+.2f}, {100 * self.high:+.2f}]"


def costs(cells: List[dict], checkpoint: str, ratio: float) -> Dict[str, Cost]:
    """Method -> ``ppl / ppl(none) - 1`` of ``checkpoint``'s nonoverlapping cells at ``ratio`` x L."""
    from fairseq_alibi.evaluation.intervals import paired_interval
    from fairseq_alibi.evaluation.paired import comparable, paired_estimate

    mine = {spelling(c): c for c in at_ratio(cells, ratio)
            if c["checkpoint"] == checkpoint and c.get("mode", "nonoverlapping") == "nonoverlapping"}
    if "none" not in mine:
        raise SystemExit(f"error: no 'none' cell of {checkpoint} at {ratio:g}x L: the cost is relative to it")
    base = mine["none"]
    out = {}
    for method, cell in mine.items():
        estimate = None
        if comparable(cell, base):  # windows matched by their index in the text
            estimate = paired_estimate(cell, base)
        elif cell.get("window_loss") and base.get("window_loss") and cell["window_tokens"] == base["window_tokens"]:
            # cells of an earlier version: one checkpoint's windows, scored in the same order
            estimate = paired_interval(cell["window_loss"], base["window_loss"], cell["window_tokens"])
        interval = estimate.interval if estimate else None
        low, high = (interval[0] - 1, interval[1] - 1) if interval else (None, None)
        out[method] = Cost(cell["ppl"] / base["ppl"] - 1, low, high)
    return out


def choose(grid: Sequence[str], tune_retrieval: Dict[str, Retrieval], tune_cost: Dict[str, Cost],
           max_cost: float) -> Dict[str, str]:
    """Per family, the member of ``grid`` with the best tune retrieval within ``max_cost`` (else the cheapest)."""
    chosen = {}
    for family in FAMILIES:
        members = [m for m in grid if m.split(":")[0] == family and m in tune_retrieval and m in tune_cost]
        if not members:
            continue
        affordable = [m for m in members if tune_cost[m].value <= max_cost]
        chosen[family] = (max(affordable, key=lambda m: tune_retrieval[m].mean) if affordable
                          else min(members, key=lambda m: tune_cost[m].value))
    return chosen


def meets_goal(method: str, lines: Dict[str, Retrieval], cost: Dict[str, Cost], within: float,
               max_cost: float) -> str:
    if method not in lines or method not in cost or "cap" not in lines:
        return ""
    close = lines[method].mean >= lines["cap"].mean - within
    cheap = cost[method].value <= max_cost
    return "yes" if close and cheap else ("retrieval" if cheap else "cost" if close else "neither")


def frontier(points: Dict[str, Tuple[float, float]]) -> List[str]:
    """Methods no other beats on both axes (lower cost, higher retrieval), by cost."""
    best = [m for m, (c, r) in points.items()
            if not any((c2 <= c and r2 >= r) and (c2, r2) != (c, r) for c2, r2 in points.values())]
    return sorted(best, key=lambda m: points[m][0])


def plot(path: str, order: List[str], tasks: Dict[str, Dict[str, Retrieval]], cost: Dict[str, Cost],
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_alibi.evaluation.styles import method_style

    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 6.2), sharex=True, sharey=True, squeeze=False)
    for ax, (task, results) in zip(axes[0], tasks.items()):
        shown = [m for m in order if m in results and m in cost]
        for m in shown:
            style, r, c = method_style(m), results[m], cost[m]
            low, high = r.pooled_wilson()
            xerr = ([[100 * max(0.0, c.value - c.low)], [100 * max(0.0, c.high - c.value)]]
                    if c.low is not None else None)  # a percentile interval may miss its point by a rounding
            ax.errorbar(100 * c.value, 100 * r.mean, xerr=xerr,
                        yerr=[[100 * (r.mean - min(r.accuracies))], [100 * (max(r.accuracies) - r.mean)]],
                        color=style.color, marker=style.marker, mfc="none", ms=8, capsize=3, lw=1, ls="none",
                        label=m)
            ax.errorbar(100 * c.value, 100 * r.mean, yerr=[[100 * max(0.0, r.mean - low)], [100 * max(0.0, high - r.mean)]],
                        color=style.color, lw=3, alpha=0.3, ls="none")
            ax.annotate(m, (100 * c.value, 100 * r.mean), textcoords="offset points", xytext=(5, 4), fontsize=7)
        edge = frontier({m: (cost[m].value, results[m].mean) for m in shown})
        ax.plot([100 * cost[m].value for m in edge], [100 * results[m].mean for m in edge], "k--", lw=0.8,
                label="frontier (no method better on both)")
        ax.set_title(task)
        ax.set_xlabel("perplexity cost at 16x L vs none (%), demo model")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("retrieval at 8x L (%), mean over seeds")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=min(9, len(labels)), frameon=False)
    fig.suptitle(f"{title}\nhorizontal bar: 95% paired t-interval over windows; vertical: thin = seed min-max, "
                 "thick = pooled 95% Wilson", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def table(order: List[str], tasks: Dict[str, Dict[str, Retrieval]], cost: Dict[str, Cost],
          model_costs: Dict[str, List[float]], chosen: Dict[str, str], within: float, max_cost: float) -> List[str]:
    head = ["method", *[f"{t} at 8x, % mean [min, max] (pooled 95%)" for t in tasks], "ppl cost at 16x, demo (95%)",
            "ppl cost at 16x, retrieval models mean [min, max]", "goal"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in order:
        if m not in cost or not any(m in results for results in tasks.values()):
            continue  # not evaluated on this side
        mark = " (chosen)" if m in chosen.values() else ""
        retrieval_cells = [tasks[t][m].text() if m in tasks[t] else "" for t in tasks]
        spread = model_costs.get(m, [])
        spread_text = (f"{100 * statistics.fmean(spread):+.1f}% [{100 * min(spread):+.1f}, {100 * max(spread):+.1f}]"
                       if spread else "")
        goal = meets_goal(m, tasks["lines"], cost, within, max_cost) if "lines" in tasks else ""
        out.append(f"| `{m}`{mark} | " + " | ".join(retrieval_cells + [cost[m].text(), spread_text, goal]) + " |")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", required=True, help="the grid, in the order to show it")
    p.add_argument("--tune", required=True, help="directory of the tune seeds (seedS/{lines,passkey}, sweep/)")
    p.add_argument("--tune-seeds", required=True)
    p.add_argument("--report", required=True, help="directory of the report seeds")
    p.add_argument("--report-seeds", required=True)
    p.add_argument("--demo-sweep", required=True, help="alibi-sweep results.json of the demo models")
    p.add_argument("--demo-tune", default="demo-s1", help="the demo model parameters are chosen on")
    p.add_argument("--demo-report", default="demo-s2", help="the demo model the costs are reported on")
    p.add_argument("--at", type=float, default=8.0, help="retrieval at this many training lengths")
    p.add_argument("--ppl-at", type=float, default=16.0, help="perplexity at this many training lengths")
    p.add_argument("--within", type=float, default=0.05, help="goal: retrieval at most this far below cap")
    p.add_argument("--max-cost", type=float, default=0.005, help="goal: perplexity cost at most this")
    p.add_argument("--output", required=True, help="directory for frontier.png")
    args = p.parse_args(argv)
    from fairseq_alibi.core.scaling import Scaling

    order = [Scaling.parse(m).spelling for m in args.methods.split(",") if m.strip()]
    demo_cells = read_cells(args.demo_sweep)

    def side(directory: str, seeds: List[str], demo: str):
        tasks = {t: retrieval(directory, seeds, t, args.at) for t in TASKS
                 if os.path.exists(os.path.join(directory, f"seed{seeds[0]}", t, "results.json"))}
        sweep = read_cells(os.path.join(directory, "sweep", "results.json"))
        per_model = [costs(sweep, f"seed{s}", args.ppl_at) for s in seeds]
        model_costs = {m: [c[m].value for c in per_model] for m in per_model[0] if all(m in c for c in per_model)}
        return tasks, costs(demo_cells, demo, args.ppl_at), model_costs

    tune_seeds, report_seeds = args.tune_seeds.split(), args.report_seeds.split()
    tune_tasks, tune_cost, tune_models = side(args.tune, tune_seeds, args.demo_tune)
    chosen = choose(order, tune_tasks["lines"], tune_cost, args.max_cost)
    report_tasks, report_cost, report_models = side(args.report, report_seeds, args.demo_report)
    os.makedirs(args.output, exist_ok=True)
    plot(os.path.join(args.output, "frontier.png"), order, report_tasks, report_cost,
         f"report seeds {', '.join(report_seeds)} ({args.report}); demo model {args.demo_report}")
    lines = [f"## Tune: seeds {', '.join(tune_seeds)}, demo model {args.demo_tune}", "",
             *table(order, tune_tasks, tune_cost, tune_models, chosen, args.within, args.max_cost), "",
             "Chosen per family (best tune retrieval at a cost <= "
             f"{100 * args.max_cost:g}%): " + ", ".join(f"{f}: `{m}`" for f, m in chosen.items()), "",
             f"## Report: seeds {', '.join(report_seeds)}, demo model {args.demo_report}", "",
             *table(order, report_tasks, report_cost, report_models, chosen, args.within, args.max_cost), "",
             f"goal: lines retrieval at {args.at:g}x within {100 * args.within:g} points of `cap` at a demo "
             f"perplexity cost at {args.ppl_at:g}x of at most {100 * args.max_cost:g}% (yes / which part fails)"]
    unreported = [m for m in chosen.values() if m not in report_tasks.get("lines", {})]
    if unreported:
        lines += ["", "warning: chosen on the tune side but not evaluated on the report side: "
                  + ", ".join(f"`{m}`" for m in unreported) + " (add them to REPORT_METHODS)"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
