"""``make compare`` on a tiny run: every position method trained the same way
(the stock CLIs through ``alibi-train``), swept, and reported across seeds;
and the report's numbers against the results they come from."""

import json
import re
import subprocess

import pytest

from conftest import REPO, cli_env, recipe_bin

SEEDS = ("1", "2")
# the baseline and the two families with extension methods (every training is a process of its own;
# the learned biases train through alibi-train in test_benchmarks_positions and test_cli, and
# in-process in test_position_models)
POSITIONS = ("sinusoidal", "alibi", "rotary")


@pytest.fixture(scope="module")
def compare_run(lm_data_bin, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    env = cli_env(DATA=str(lm_data_bin), OUT=str(out), SEEDS=" ".join(SEEDS), POSITIONS=" ".join(POSITIONS),
                  L="16", LAYERS="1", DIM="16", FFN="32", HEADS="2", UPDATES="2", MAX_TOKENS="256", WARMUP="1",
                  LENGTHS="1x,2x", EXTENSIONS="none,cap,yarn:2", VENV_BIN=recipe_bin())
    result = subprocess.run(["bash", str(REPO / "examples/positions/compare.sh")], capture_output=True, text=True,
                            env=env, cwd=REPO, stdin=subprocess.DEVNULL, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def sweep_cells(path):
    with open(path) as f:
        return json.load(f)["cells"]


def test_every_method_is_trained_the_same_way(compare_run):
    out, _ = compare_run
    for seed in SEEDS:
        for name in POSITIONS:
            log = (out / f"seed{seed}" / name / "train.log").read_text()
            arch = "transformer_lm" if name == "sinusoidal" else f"transformer_lm_{name}"
            assert f"'arch': '{arch}'" in log or f"arch='{arch}'" in log or arch in log
            assert (out / f"seed{seed}" / name / "trained.ok").read_text().strip() == "2"


def test_the_table_is_the_mean_and_range_over_seeds(compare_run):
    out, stdout = compare_run
    cells = [c for c in sweep_cells(out / "sweep/results.json") if c["mode"] == "nonoverlapping"]
    table = (out / "positions.md").read_text()
    for name in POSITIONS:
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        for length in (16, 32):
            values = sorted(c["ppl"] for c in cells if c["checkpoint"].startswith(f"{name}_s") and c["length"] == length)
            assert len(values) == len(SEEDS)
            expected = f"{sum(values) / len(values):.2f} [{values[0]:.2f}, {values[-1]:.2f}]"
            assert expected in row, (row, expected)
        assert row.rstrip().endswith(f"| {len(SEEDS)} |")
    assert (out / "positions.png").stat().st_size > 10_000 and (out / "extensions.png").stat().st_size > 10_000


def test_extension_methods_only_where_they_apply(compare_run):
    out, stdout = compare_run
    cells = sweep_cells(out / "extensions/results.json")
    labels = {(re.sub(r"_s\d+$", "", c["checkpoint"]), c["label"]) for c in cells}
    assert labels == {("alibi", "none"), ("alibi", "cap x1"), ("rotary", "none"), ("rotary", "yarn x2")}
    table = (out / "positions.md").read_text()
    assert "| alibi cap x1 |" in table and "| rotary yarn x2 |" in table
    assert "rotary cap" not in table and "alibi yarn" not in table


def test_the_paired_table_is_each_seed_against_its_own_alibi(compare_run):
    out, _ = compare_run
    cells = [c for c in sweep_cells(out / "sweep/results.json") if c["mode"] == "nonoverlapping"]
    ppl = {(c["checkpoint"], c["length"]): c["ppl"] for c in cells}
    table = (out / "positions.md").read_text()
    paired = table[table.index("### Against ALiBi of the same seed"):]
    assert "| alibi |" not in paired.split("###")[1]
    for name in POSITIONS:
        if name == "alibi":
            continue
        row = next(line for line in paired.splitlines() if line.startswith(f"| {name} |"))
        for length in (16, 32):
            changes = sorted(100 * (ppl[(f"{name}_s{s}", length)] / ppl[(f"alibi_s{s}", length)] - 1) for s in SEEDS)
            expected = f"{sum(changes) / len(changes):+.1f}% [{changes[0]:+.1f}, {changes[-1]:+.1f}]"
            assert expected in row, (row, expected)
    assert "### rotary: each method against the plain model of the same seed" in table


def test_a_failed_training_stops_the_recipe_with_its_reason(lm_data_bin, tmp_path):
    """A training that fails (here an invalid T5 table) ends the recipe with exit
    status 1 and one error line naming the run, the trainer's reason and its log;
    nothing is swept."""
    env = cli_env(DATA=str(lm_data_bin), OUT=str(tmp_path), SEEDS="1", POSITIONS="t5bias", L="16", LAYERS="1",
                  DIM="16", FFN="32", HEADS="2", UPDATES="2", MAX_TOKENS="256", WARMUP="1",
                  EXTRA_TRAIN_ARGS="--t5-max-distance 16", VENV_BIN=recipe_bin())
    result = subprocess.run(["bash", str(REPO / "examples/positions/compare.sh")], capture_output=True, text=True,
                            env=env, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    log = tmp_path / "seed1" / "t5bias" / "train.log"
    assert result.stderr.splitlines() == [
        "error: training seed 1 t5bias failed (exit 1): t5_max_distance=16 is not valid with t5_buckets=32; "
        f"it must be > 16 (the exact buckets, half of t5_buckets) (log: {log})"]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "seed1" / "t5bias" / "trained.ok").exists()
