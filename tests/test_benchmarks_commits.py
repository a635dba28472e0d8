"""``benchmarks/commits_cost.py`` (this tree's words/s against another
commit's, paired): its table from made-up rounds against a recomputation
here, and its refusals (an unknown commit, no rounds) before anything runs."""

from __future__ import annotations

import statistics
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import commits_cost  # noqa: E402


def run(words: dict) -> dict:
    """A made-up ``positions_cost.py --json`` of one repeat: ``{dropout: {method: words/s}}``."""
    return {"train": {d: {m: {"median": w} for m, w in methods.items()} for d, methods in words.items()}}


def test_the_table_pairs_each_round_and_takes_the_median_ratio():
    theirs = [run({"0.0": {"alibi": 100.0, "fox": 90.0}}), run({"0.0": {"alibi": 200.0, "fox": 80.0}}),
              run({"0.0": {"alibi": 150.0, "fox": 100.0}})]
    ours = [run({"0.0": {"alibi": 110.0, "fox": 90.0}}), run({"0.0": {"alibi": 190.0, "fox": 88.0}}),
            run({"0.0": {"alibi": 150.0, "fox": 95.0}})]
    text = commits_cost.table({"this": ours, "abc1234": theirs}, ("this", "abc1234"))
    rows = {line.split(" | ")[1]: line for line in text.splitlines()[2:]}
    for method, a, b in (("alibi", [100, 200, 150], [110, 190, 150]), ("fox", [90, 80, 100], [90, 88, 95])):
        ratios = [y / x for x, y in zip(a, b)]
        assert rows[method].endswith(f"| {statistics.median(ratios):.3f} |")
        assert ", ".join(f"{r:.3f}" for r in ratios) in rows[method]
    assert "abc1234 words/s" in text.splitlines()[0]


def test_an_unknown_commit_and_no_rounds_are_refused_before_anything_runs():
    for args, says in ((["no-such-commit-xyz"], "no commit 'no-such-commit-xyz'"),
                       (["HEAD", "--rounds", "0"], "--rounds must be at least 1")):
        done = subprocess.run([sys.executable, "benchmarks/commits_cost.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr, done.stderr
