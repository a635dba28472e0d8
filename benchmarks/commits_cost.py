"""Training words/s of this tree against another commit's, paired:
``positions_cost.py`` run on each in turn, rounds alternating which goes
first, each tree with its own script and its own package.

    python benchmarks/commits_cost.py eed2720                        # the comparison's setting, 5 methods
    python benchmarks/commits_cost.py eed2720 --rounds 5 -- --methods alibi fox --length 1024 --heads 4 \\
        --embed-dim 256 --ffn 1024

A restructuring that should cost nothing is checked this way: the other
commit is checked out into a temporary worktree (``git worktree add``,
removed at the end) and run with ``PYTHONPATH`` set to it, so its trainer
runs import its package, not this one's (the editable install's finder comes
after ``PYTHONPATH``).  Each round runs ``positions_cost.py --repeats 1`` on
one tree then the other (the order alternating); the table gives each
method's words/s per round and the ratio this tree / the other per round,
and their median.  Arguments after ``--`` go to ``positions_cost.py``
(default: ``--methods alibi rotary t5bias fire fox --attention-dropout 0``,
training only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT = ["--methods", "alibi", "rotary", "t5bias", "fire", "fox", "--attention-dropout", "0"]


def run_cost(tree: str, extra: list, out: str) -> dict:
    """One ``positions_cost.py --repeats 1`` in ``tree``; its JSON."""
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "benchmarks/positions_cost.py", *extra, "--repeats", "1", "--eval-multiples",
           "--json", out]
    done = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: positions_cost.py failed in {tree}: {last}")
    with open(out) as f:
        return json.load(f)


def table(runs: dict, trees: tuple) -> str:
    """Markdown: per attention dropout and method, words/s per round of each tree and the ratio."""
    ours, theirs = trees
    lines = [f"| attention dropout | method | {theirs} words/s | this tree words/s | this / {theirs} per round | median |",
             "|---|---|---|---|---|---|"]
    rounds = len(runs[ours])
    for dropout, methods in runs[ours][0]["train"].items():
        for method in methods:
            a = [runs[theirs][r]["train"][dropout][method]["median"] for r in range(rounds)]
            b = [runs[ours][r]["train"][dropout][method]["median"] for r in range(rounds)]
            ratios = [y / x for x, y in zip(a, b)]
            lines.append(f"| {dropout} | {method} | {', '.join(f'{x:,.0f}' for x in a)} | "
                         f"{', '.join(f'{y:,.0f}' for y in b)} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                         f"{statistics.median(ratios):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commit", help="the other commit (anything git rev-parse takes)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both trees once")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: positions_cost.py's arguments
    args = parser.parse_args(argv[:cut])
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    extra = argv[cut + 1:] or DEFAULT
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode != 0:
        parser.error(f"no commit {args.commit!r} in this repository (git rev-parse: {commit.stderr.strip()})")
    name = commit.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="commits_cost_") as tmp:
        other = os.path.join(tmp, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", other, name], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs = {"this": [], name: []}
            for r in range(args.rounds):
                order = ("this", name) if r % 2 else (name, "this")
                for tree in order:
                    path = ROOT if tree == "this" else other
                    runs[tree].append(run_cost(path, extra, os.path.join(tmp, f"{tree}-{r}.json")))
                    print(f"round {r + 1}/{args.rounds}: {tree} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", other], cwd=ROOT, capture_output=True)
    print(f"positions_cost.py {' '.join(extra)}, {args.rounds} rounds; this tree against {name}\n")
    print(table(runs, ("this", name)))


if __name__ == "__main__":
    main()
