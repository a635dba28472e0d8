"""Updates to retrieve: the retrieval recipe's staged trainings (``UNTIL=P``).

With ``UNTIL=P`` ``run.sh`` trains each model in stages of ``CHECK_EVERY``
updates up to its budget and, after each stage, evaluates it at 1x L
(`lines`, and the passkey with ``PASSKEY=1``); the model stops at the first
stage where every task reaches P%.  Which stage that is depends on the seed
more than on the family (docs/results/retrieval-every-family-recipe.md), so a fixed count per family is a
lottery and a budget with checks is not.  This script keeps the checks:

* ``record DIR STAGE LINES.json [PASSKEY.json]``: each task's accuracy at 1x
  without an extension method (every prompt of the run pooled), as the row
  ``STAGE<TAB>lines %<TAB>passkey %`` (``-`` without a passkey) of
  ``DIR/checks.tsv``, replacing a row of the same stage; prints the row;
* ``report OUT --until P``: for every ``OUT/seedS/MODEL/checks.tsv``, the
  updates the model took (the first stage where each task reached P%) or
  "not by N" (its last check), and each check's accuracies, as Markdown,
  and with ``--plot`` the learning curves (accuracy against updates, a panel
  per task, a colour per model, a marker per seed).  A model started again
  (``RESTART_AT``) shows its discarded attempts too
  (``OUT/seedS/restarts/MODEL.N/checks.tsv``: their last checks, dashed
  curves) and the updates of every attempt together.

    python examples/retrieval/stages.py report outputs/comb --until 90 --plot outputs/comb/stages.png
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from summary import read_results  # (this directory: the script's own)

from fairseq_alibi.evaluation.report import legend_outside, percent_text, save_figure

#: A check: (updates, lines %, passkey % or None).
Check = Tuple[int, float, Optional[float]]


@dataclass
class Run:
    """One model of one seed: the checks of the attempt that stands, and those of
    the attempts discarded before it (``RESTART_AT``), in the order they ran."""

    checks: List[Check] = field(default_factory=list)
    discarded: List[List[Check]] = field(default_factory=list)
    #: The training seeds (fairseq's ``--seed``, from each attempt's train.log; None where unknown) of
    #: the attempt that stands and of the discarded ones.
    seed: Optional[int] = None
    discarded_seeds: List[Optional[int]] = field(default_factory=list)

    def attempts(self) -> List[List[Check]]:
        return [*self.discarded, self.checks]

    def training_seeds(self) -> List[Optional[int]]:
        """The training seed of each of :meth:`attempts`."""
        return [*self.discarded_seeds, self.seed]


def accuracy_at_1x(path: str) -> float:
    """% of the prompts at 1x L without an extension method that ``path`` (an
    ``alibi-retrieval`` results.json of one checkpoint) answers, every depth pooled."""
    cells = [c for c in read_results(path)["cells"] if c.get("length_ratio") == 1.0 and c.get("method") == "none"]
    if not cells:
        raise SystemExit(f"error: {path} holds no cell at 1x without an extension method; evaluate with "
                         "--lengths 1x --methods none")
    if len({c.get("checkpoint") for c in cells}) > 1:
        raise SystemExit(f"error: {path} holds several checkpoints; a stage's check evaluates one model")
    return 100.0 * sum(c["correct"] for c in cells) / sum(c["n"] for c in cells)


def read_checks(path: str) -> List[Check]:
    """The rows of a ``checks.tsv``, by updates."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: cannot read the checks {path}: {getattr(e, 'strerror', None) or e}") from None
    for number, line in enumerate(lines, 1):
        fields = line.rstrip("\n").split("\t")
        try:
            updates, accuracy, passkey = int(fields[0]), float(fields[1]), fields[2]
            rows.append((updates, accuracy, None if passkey == "-" else float(passkey)))
        except (IndexError, ValueError):
            raise SystemExit(f"error: {path}, line {number}: {line.strip()!r} is not a check "
                             "(updates, lines %, passkey % or -, tab-separated)") from None
    return sorted(rows)


def record(directory: str, stage: int, lines_results: str, passkey_results: Optional[str]) -> str:
    lines = accuracy_at_1x(lines_results)
    passkey = accuracy_at_1x(passkey_results) if passkey_results else None
    path = os.path.join(directory, "checks.tsv")
    rows = [r for r in (read_checks(path) if os.path.exists(path) else []) if r[0] != stage]
    rows = sorted(rows + [(stage, lines, passkey)])
    partial = f"{path}.partial.{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as f:
        f.writelines(format_row(r) + "\n" for r in rows)
    os.replace(partial, path)  # whole or not at all: a stopped run leaves the last complete table
    return format_row((stage, lines, passkey))


def format_row(check: Check) -> str:
    """A row of checks.tsv: the accuracies as computed (the stopping rule compares them
    with UNTIL; rounded, 89.95% would pass a rule of 90%)."""
    updates, lines, passkey = check
    return f"{updates}\t{lines!r}\t{'-' if passkey is None else repr(passkey)}"


def training_seed(run_dir: str) -> Optional[int]:
    """The ``--seed`` an attempt trained under, as its ``train.log`` records it
    (fairseq logs its config, ``'seed': N``, at every start of a stage); None
    without a log or where the log gives more than one."""
    try:
        with open(os.path.join(run_dir, "train.log"), encoding="utf-8", errors="replace") as log:
            found = set(re.findall(r"'seed': (\d+)", log.read()))
    except FileNotFoundError:
        return None
    return int(found.pop()) if len(found) == 1 else None


def passes(check: Check, until: float) -> bool:
    return check[1] >= until and (check[2] is None or check[2] >= until)


def shown(check: Check, until: Optional[float] = None) -> str:
    """A check's accuracies as the docs give them: ``lines / passkey`` (or ``lines``), whole percent
    (more decimals where whole percent would reach 0, 100 or ``until`` and the value does not)."""
    return percent_text(check[1], until) + ("" if check[2] is None else f" / {percent_text(check[2], until)}")


def took(run: Run, until: float) -> str:
    """The first check where every task reached ``until`` %, or "not by" the last one; after
    restarts, each discarded attempt's last check and the updates of every attempt together."""
    first = next((c for c in run.checks if passes(c, until)), None)
    if first:
        text, updates = f"**{first[0]:,}** ({shown(first, until)})", first[0]
    elif run.checks:
        text, updates = f"not by {run.checks[-1][0]:,} ({shown(run.checks[-1], until)})", run.checks[-1][0]
    else:
        text, updates = "training (no check yet)", 0
    if not run.discarded:
        return text
    restarts = len(run.discarded)
    given_up = "; ".join(f"{shown(a[-1], until)} at {a[-1][0]:,}" for a in run.discarded)
    in_all = updates + sum(a[-1][0] for a in run.discarded)
    return f"{text} after {restarts} restart{'s' * (restarts > 1)} ({given_up}); {in_all:,} updates in all"


def collect(out: str) -> Dict[str, Dict[str, Run]]:
    """``{model: {seed: Run}}`` of every ``OUT/seedS/MODEL/checks.tsv``, with the
    discarded attempts of ``OUT/seedS/restarts/MODEL.N/checks.tsv``."""
    found: Dict[str, Dict[str, Run]] = {}
    for seed_dir in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if not re.fullmatch(r"seed\d+", seed_dir):
            continue
        for model in sorted(os.listdir(os.path.join(out, seed_dir))):
            path = os.path.join(out, seed_dir, model, "checks.tsv")
            checks = read_checks(path) if os.path.isfile(path) else []
            if checks:
                found.setdefault(model, {})[seed_dir] = Run(checks, seed=training_seed(os.path.dirname(path)))
        restarts = os.path.join(out, seed_dir, "restarts")
        attempts = [m.groups() for m in (re.fullmatch(r"(.+)\.(\d+)", name) for name in
                                         (sorted(os.listdir(restarts)) if os.path.isdir(restarts) else [])) if m]
        for model, number in sorted(attempts, key=lambda a: (a[0], int(a[1]))):
            path = os.path.join(restarts, f"{model}.{number}", "checks.tsv")
            checks = read_checks(path) if os.path.isfile(path) else []
            if checks:
                run = found.setdefault(model, {}).setdefault(seed_dir, Run())
                run.discarded.append(checks)
                run.discarded_seeds.append(training_seed(os.path.dirname(path)))
    return found


def seeds_of(found: Dict[str, Dict[str, Run]]) -> List[str]:
    return sorted({s for runs in found.values() for s in runs}, key=lambda s: int(s[4:]))


def with_passkey(found: Dict[str, Dict[str, Run]]) -> bool:
    return any(c[2] is not None for runs in found.values() for run in runs.values()
               for checks in run.attempts() for c in checks)


def report(found: Dict[str, Dict[str, Run]], until: float) -> str:
    seeds = seeds_of(found)
    tasks = "`lines` / passkey" if with_passkey(found) else "`lines`"
    out = [f"Updates to retrieve: the first check at which each task reached {until:g}% at 1x L "
           f"(its {tasks} %), or the last check", "",
           "| model | " + " | ".join(seeds) + " |", "|---|" + "---|" * len(seeds)]
    for model, runs in sorted(found.items()):
        out.append(f"| {model} | " + " | ".join(took(runs[s], until) if s in runs else "" for s in seeds) + " |")
    out += ["", f"Every check ({tasks} % at 1x L):", "", "| model | seed | " + "updates: accuracy, ... |", "|---|---|---|"]
    for model, runs in sorted(found.items()):
        for seed in seeds:
            if seed not in runs:
                continue
            attempts = runs[seed].attempts()
            for number, (checks, trained) in enumerate(zip(attempts, runs[seed].training_seeds()), 1):
                if not checks:  # an attempt that has not reached its first check
                    continue
                notes = ([f"training seed {trained:,}"] if trained is not None else []) + \
                    (["discarded"] if number < len(attempts) else [])
                label = seed if len(attempts) == 1 else \
                    f"{seed}, attempt {number}" + (f" ({', '.join(notes)})" if notes else "")
                out.append(f"| {model} | {label} | " + ", ".join(f"{c[0]:,}: {shown(c, until)}" for c in checks) + " |")
    return "\n".join(out) + "\n"


def plot(found: Dict[str, Dict[str, Run]], until: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["lines", "passkey"] if with_passkey(found) else ["lines"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    markers = "osD^v<>px*"
    seeds = seeds_of(found)
    for column, (ax, task) in enumerate(zip(axes[0], panels)):
        for colour, (model, runs) in enumerate(sorted(found.items())):
            for seed, run in runs.items():
                for checks in run.attempts():  # the discarded attempts dashed, unlabelled
                    points = [(c[0], c[1 + column]) for c in checks if c[1 + column] is not None]
                    if not points:
                        continue
                    standing = checks is run.checks
                    ax.plot(*zip(*points), color=f"C{colour % 10}", marker=markers[seeds.index(seed) % len(markers)],
                            label=f"{model} {seed}" if standing else None, alpha=0.8 if standing else 0.4,
                            linestyle="-" if standing else "--")
        if any(run.discarded for runs in found.values() for run in runs.values()):
            ax.plot([], [], color="grey", linestyle="--", alpha=0.6, label="discarded attempts (restarts)")
        ax.axhline(until, color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"{task} at 1x L", xlabel="updates", ylabel="accuracy %", ylim=(-3, 103))
    legend_outside(axes[0][-1], ncol=2)  # outside the data (lower right covered the points of late checks)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="add a stage's check to DIR/checks.tsv")
    r.add_argument("directory")
    r.add_argument("stage", type=int)
    r.add_argument("lines_results")
    r.add_argument("passkey_results", nargs="?")
    s = sub.add_parser("report", help="the updates each model of OUT took, and its checks")
    s.add_argument("out")
    s.add_argument("--until", type=float, required=True, help="the accuracy %% a check must reach on every task")
    s.add_argument("--plot", help="the learning curves, as this PNG")
    args = p.parse_args(argv)
    if args.command == "record":
        print(record(args.directory, args.stage, args.lines_results, args.passkey_results))
        return 0
    if not 0 < args.until <= 100:
        p.error(f"--until must be a percentage above 0 and at most 100, got {args.until:g}")
    found = collect(args.out)
    if not found:
        print(f"error: {args.out} holds no staged training (no seedS/MODEL/checks.tsv); train with UNTIL=P",
              file=sys.stderr)
        return 1
    print(report(found, args.until), end="")
    if args.plot:
        try:
            plot(found, args.until, args.plot)
        except OSError as e:
            print(f"error: cannot write {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
