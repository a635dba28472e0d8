"""``make compare`` on a tiny run: every position method trained the same way
(the stock CLIs through ``alibi-train``), swept, and reported across seeds;
the report's numbers against the results they come from; any subset of
methods runs to a report, never an earlier run's; and every list of methods
the recipes and the report show comes from the registry: a position method
registered by a test appears in the recipe's defaults, the report and the help."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import BIN, REPO, cli_env, recipe_bin
from fairseq_alibi.core.positions import POSITIONS as REGISTRY

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


@pytest.mark.slow
def test_every_method_is_trained_the_same_way(compare_run):
    out, _ = compare_run
    for seed in SEEDS:
        for name in POSITIONS:
            log = (out / f"seed{seed}" / name / "train.log").read_text()
            arch = "transformer_lm" if name == "sinusoidal" else f"transformer_lm_{name}"
            assert f"'arch': '{arch}'" in log or f"arch='{arch}'" in log or arch in log
            assert (out / f"seed{seed}" / name / "trained.ok").read_text().strip() == "2"


@pytest.mark.slow
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


@pytest.mark.slow
def test_extension_methods_only_where_they_apply(compare_run):
    out, stdout = compare_run
    cells = sweep_cells(out / "extensions/results.json")
    labels = {(re.sub(r"_s\d+$", "", c["checkpoint"]), c["label"]) for c in cells}
    assert labels == {("alibi", "none"), ("alibi", "cap x1"), ("rotary", "none"), ("rotary", "yarn x2")}
    table = (out / "positions.md").read_text()
    assert "| alibi cap x1 |" in table and "| rotary yarn x2 |" in table
    assert "rotary cap" not in table and "alibi yarn" not in table


@pytest.mark.slow
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


# ------------------------------------------------------------------ subsets, stale reports
TINY = dict(L="16", LAYERS="1", DIM="16", FFN="32", HEADS="2", UPDATES="2", MAX_TOKENS="256", WARMUP="1",
            LENGTHS="1x,2x")


def run_compare(**settings):
    return subprocess.run(["bash", str(REPO / "examples/positions/compare.sh")], capture_output=True, text=True,
                          env=cli_env(**settings), cwd=REPO, stdin=subprocess.DEVNULL, timeout=900)


@pytest.mark.slow
def test_a_subset_of_methods_runs_to_a_fresh_report(lm_data_bin, tmp_path):
    """``POSITIONS="alibi kerple"`` (no RoPE model): the default extension list keeps the
    methods that apply to ALiBi (no yarn), the run ends with its own report, and the
    report an earlier run left is not shown."""
    (tmp_path / "positions.md").write_text("| rotary | an earlier run's table |\n")
    (tmp_path / "extensions.png").write_bytes(b"an earlier run's figure")
    result = run_compare(DATA=str(lm_data_bin), OUT=str(tmp_path), SEEDS="1", POSITIONS="alibi kerple",
                         VENV_BIN=recipe_bin(), **TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    alibi = REGISTRY["alibi"].extensions
    methods = {c["method"] for c in sweep_cells(tmp_path / "extensions/results.json")}
    assert methods == {"none", "cap", "log", "power", "capnorm", "ntk", "linear", "logn"} and methods <= set(alibi)
    table = (tmp_path / "positions.md").read_text()
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")]
    assert "| alibi" in rows and "| kerple" in rows and "| rotary" not in rows and "earlier" not in table
    assert "### alibi: context-extension methods" in table and "yarn" not in table
    assert (tmp_path / "extensions.png").read_bytes() != b"an earlier run's figure"
    assert "extension methods {none,cap,log,power,capnorm,ntk:2,ntk,linear:2,linear,logn} on {alibi kerple}" \
        in result.stdout  # logn applies to Kerple too


def test_the_default_extension_list_is_every_method_of_the_registry():
    """examples/lib.sh's DEFAULT_EXTENSIONS, the default of `make compare` and of the
    retrieval families recipe: each spelling parses, and the methods it names are those
    of fairseq_alibi/core/scaling.py, none left out (a method registered later is
    evaluated by default only once it is added here, and this test says so)."""
    from fairseq_alibi.core.scaling import METHODS, Scaling

    line = next(text for text in (REPO / "examples/lib.sh").read_text().splitlines()
                if text.startswith("DEFAULT_EXTENSIONS="))
    spellings = line.split("=", 1)[1].split(",")
    assert {Scaling.parse(spelling, train_length=64).method for spelling in spellings} == set(METHODS)
    assert len(spellings) == len(set(spellings))


def test_a_refused_setting_stops_before_anything_runs(lm_data_bin, tmp_path):
    """A method that applies to no model of the run, a method that does not exist, no seed:
    one error line naming what is allowed, exit 1, nothing trained."""
    cases = {
        ("alibi kerple", "none,yarn:2", "1"): "error: EXTENSIONS holds yarn:2, which applies to none of the models of "
                                            "this run; the methods that do: alibi: "
                                            + ", ".join(REGISTRY["alibi"].extensions) + "; kerple: "
                                            + ", ".join(REGISTRY["kerple"].extensions),
        ("alibi rope", "", "1"): "error: POSITIONS names 'rope', which is not a position method; allowed values: "
                               + " ".join(["sinusoidal", *REGISTRY]),
        ("alibi", "", " "): "error: SEEDS must name at least one seed",
    }
    for (positions, extensions, seeds), expected in cases.items():
        out = tmp_path / str(len(positions + extensions + seeds))
        result = run_compare(DATA=str(lm_data_bin), OUT=str(out), SEEDS=seeds, POSITIONS=positions,
                             EXTENSIONS=extensions, VENV_BIN=recipe_bin(), **TINY)
        assert result.returncode == 1 and result.stderr.splitlines() == [expected], result.stderr
        assert not (out / "seed1").exists()


@pytest.mark.slow
def test_the_report_shows_the_cells_of_its_run_only(tmp_path, capsys):
    """results.json keeps the cells of earlier runs in the same folder (other methods,
    seeds, lengths, extension methods): --positions, --seeds, --lengths and
    --extension-methods leave them out of the tables."""
    report = example("examples/positions/report.py")
    cells = [dict(checkpoint=f"{name}_s{seed}", label="none", mode="nonoverlapping", length=length,
                  length_ratio=length / 16, train_length=16, ppl=10.0 + seed + length / 16)
             for name in ("alibi", "rotary", "kerple") for seed in (1, 2, 3) for length in (16, 32, 64)]
    extended = [dict(cell, label=label, ppl=cell["ppl"] + k) for cell in cells if cell["checkpoint"].startswith("alibi")
                for k, label in enumerate(("none", "cap x1", "ntk x2"))]
    (tmp_path / "sweep.json").write_text(json.dumps({"cells": cells}))
    (tmp_path / "extensions.json").write_text(json.dumps({"cells": extended}))
    assert report.main([str(tmp_path / "sweep.json"), "--extensions", str(tmp_path / "extensions.json"),
                        "--output", str(tmp_path), "--positions", "alibi kerple", "--seeds", "1 2",
                        "--lengths", "1x,2x", "--extension-methods", "none,cap"]) == 0
    table = capsys.readouterr().out
    first = table.split("###")[1]
    assert "| method | 16 (1x) | 32 (2x) | seeds |" in first and "rotary" not in table and "ntk" not in table
    assert "| alibi | 12.50 [12.00, 13.00] | 13.50 [13.00, 14.00] | 2 |" in first
    assert "| alibi cap x1 | 13.50 [13.00, 14.00] | 14.50 [14.00, 15.00] | 2 |" in table


def test_the_report_reads_one_split_and_marks_cells_with_fewer_seeds(tmp_path, capsys):
    """A results.json keeps other splits' cells (alibi-sweep --subset test): the report
    reads --subset's alone (a test cell replaced a valid one); a mean over fewer seeds
    than the run has says so (it read as a better method); two cells for one seed
    are refused."""
    report = example("examples/positions/report.py")
    cells = [dict(checkpoint=f"{name}_s{seed}", label="none", mode="nonoverlapping", length=length, subset="valid",
                  length_ratio=length / 16, train_length=16, ppl=(20.0 if name == "alibi" else 19.0) + seed)
             for name in ("alibi", "rotary") for seed in (1, 2, 3) for length in (16, 32)
             if not (name == "rotary" and seed == 3 and length == 32)]
    cells.append(dict(cells[0], subset="test", ppl=99.0))
    (tmp_path / "sweep.json").write_text(json.dumps({"cells": cells}))
    assert report.main([str(tmp_path / "sweep.json"), "--output", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| alibi | 22.00 [21.00, 23.00] | 22.00 [21.00, 23.00] | 3 |" in table
    assert "| rotary | 21.00 [20.00, 22.00] | 20.50 [20.00, 21.00] (2 of 3 seeds) | 3 |" in table
    assert "| rotary | -4.6% [-4.8, -4.3] | -4.7% [-4.8, -4.5] (2 of 3 seeds) | 3 |" in table
    assert report.main([str(tmp_path / "sweep.json"), "--output", str(tmp_path), "--subset", "test"]) == 0
    assert "| alibi | 99.00 |" in capsys.readouterr().out
    (tmp_path / "twice.json").write_text(json.dumps({"cells": cells + [dict(cells[1], ppl=50.0)]}))
    with pytest.raises(SystemExit, match="holds two valid cells of alibi_s1 under none at 32 tokens"):
        report.main([str(tmp_path / "twice.json"), "--output", str(tmp_path)])


# ------------------------------------------------------------------ every list from the registry
def example(path: str):
    """An example script, imported as a module (its functions, without running it)."""
    name = path.replace("/", "_")[:-3]
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where its dataclasses look their annotations up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def dummy_position(monkeypatch):
    """A position method registered for one test: a copy of NoPE's entry named ``dummy``."""
    entry = dataclasses.replace(REGISTRY["nope"], name="dummy", summary="a test's copy of NoPE", colour=None)
    monkeypatch.setitem(REGISTRY, "dummy", entry)
    return entry


def test_a_registered_method_is_in_the_recipe_defaults_report_and_help(dummy_position, tmp_path, monkeypatch,
                                                                       capsys):
    """In-process: the recipes' lists (examples/registry.py), the report's rows, lines and
    colours, and the help of alibi-sweep, alibi-retrieval and report.py all name the method."""
    import matplotlib.axes

    from fairseq_alibi.evaluation import perplexity, retrieval
    from fairseq_alibi.evaluation.styles import position_colour

    registry = example("examples/registry.py")
    assert registry.models() == ["sinusoidal", *REGISTRY] and registry.models()[-1] == "dummy"
    extended = registry.extended(registry.models(), ["none", "cap", "yarn:2"])
    assert "alibi" in extended and "rotary" in extended and "dummy" not in extended
    assert "dummy" in registry.extended(registry.models(), ["none", "logn"])  # logn applies to every family
    assert registry.applicable("none,cap,yarn:2", ["dummy"], "EXTENSIONS", strict=False) == ["none"]
    registry.check(["dummy", "sinusoidal"], "POSITIONS")

    report = example("examples/positions/report.py")
    cells = [dict(checkpoint=f"{name}_s{seed}", label="none", mode="nonoverlapping", length=length,
                  length_ratio=length / 16, train_length=16, ppl=ppl)
             for name, base in (("dummy", 30.0), ("alibi", 20.0), ("sinusoidal", 25.0)) for seed in (1, 2)
             for length, ppl in ((16, base + seed), (32, base + 2 * seed))]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"cells": cells}))
    lines = []
    original = matplotlib.axes.Axes.plot

    def recorded(self, *args, **kwargs):
        lines.append((kwargs.get("label"), kwargs.get("color")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    assert report.main([str(results), "--output", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.split("###")[1].splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| sinusoidal", "| alibi", "| dummy"]
    assert rows[3] == "| dummy | 31.50 [31.00, 32.00] | 33.00 [32.00, 34.00] | 2 |"
    colours = {name: position_colour(name) for name in ("sinusoidal", *REGISTRY)}
    assert lines == [("sinusoidal", colours["sinusoidal"]), ("alibi", colours["alibi"]), ("dummy", colours["dummy"])]
    assert len(set(colours.values())) == len(colours) and REGISTRY["dummy"].colour is None
    assert position_colour("dummy") == colours["dummy"]  # the same in every run

    for parser in (perplexity.get_parser(), retrieval.get_parser()):
        assert help_groups(parser.format_help())["dummy"] == list(REGISTRY["nope"].extensions), parser.prog
    with pytest.raises(SystemExit):
        report.main(["--help"])
    assert " dummy)" in " ".join(capsys.readouterr().out.split())


def help_groups(text: str) -> dict:
    """The sentence of a tool's --help that lists, per position method, the extension methods that apply."""
    flat = " ".join(text.split())
    sentence = flat.split("the methods that apply to its position method: ", 1)[1].split(".", 1)[0]
    groups = {}
    for group in sentence.split("; "):
        names, methods = group.replace(" (as trained)", "").split(": ")
        groups.update({name: methods.split(", ") for name in names.split(", ")})
    return groups


def test_help_lists_the_extension_methods_of_every_position_method():
    """alibi-sweep's and alibi-retrieval's help: each position method of the registry with
    the methods that apply to it, the sinusoidal model with none."""
    from fairseq_alibi.evaluation import perplexity, retrieval

    expected = {"sinusoidal": ["none"], **{name: list(p.extensions) for name, p in REGISTRY.items()}}
    for parser in (perplexity.get_parser(), retrieval.get_parser()):
        assert help_groups(parser.format_help()) == expected, parser.prog


HOOK = """# Registers a position method for tests/test_compare.py in every Python the recipe starts:
# the registry holds alibi and a copy of NoPE named dummy (nothing else, to keep the run short).
import dataclasses
import fairseq_alibi.core.positions as positions
kept = {"alibi": positions.POSITIONS["alibi"],
        "dummy": dataclasses.replace(positions.POSITIONS["nope"], name="dummy", summary="a test's copy of NoPE")}
positions.POSITIONS.clear()
positions.POSITIONS.update(kept)
"""


@pytest.mark.slow
def test_a_method_registered_in_every_process_is_trained_swept_and_reported(lm_data_bin, tmp_path):
    """compare.sh with a registry of alibi and ``dummy`` (a sitecustomize module on the
    PYTHONPATH of every process the recipe starts; real processes, not the fork server):
    POSITIONS left to its default trains sinusoidal, alibi and dummy; the extension sweep
    runs the default list's methods where they apply (ALiBi's on alibi, logn on both; no RoPE
    model: no yarn); the report has a
    row for dummy; alibi-sweep's help names it.  Every tool here imports torch and fairseq
    anew: about 2 minutes on a quiet 2-core machine, over 15 on a loaded one."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    pythonpath = os.pathsep.join(filter(None, [str(hook), str(REPO), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "out"
    env = cli_env(DATA=str(lm_data_bin), OUT=str(out), SEEDS="1", VENV_BIN=str(BIN), PYTHONPATH=pythonpath, **TINY)
    result = subprocess.run(["bash", str(REPO / "examples/positions/compare.sh")], capture_output=True, text=True,
                            env=env, cwd=REPO, stdin=subprocess.DEVNULL, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (out / "seed1").iterdir()) == ["alibi", "dummy", "sinusoidal"]
    assert "'arch': 'transformer_lm_dummy'" in (out / "seed1/dummy/train.log").read_text() or \
        "transformer_lm_dummy" in (out / "seed1/dummy/train.log").read_text()
    table = (out / "positions.md").read_text()
    assert re.search(r"^\| dummy \| \d+\.\d\d \| \d+\.\d\d \| 1 \|$", table, re.M), table
    labels = {(c["checkpoint"], c["method"]) for c in sweep_cells(out / "extensions/results.json")}
    # every extension method of the default list (no RoPE model: no yarn) on the models it applies to:
    # ALiBi's own and logn on alibi, logn (the one every method takes) on dummy
    assert {method for checkpoint, method in labels if checkpoint == "alibi_s1"} == set(REGISTRY["alibi"].extensions)
    assert {method for checkpoint, method in labels if checkpoint == "dummy_s1"} == {"none", "logn"}
    assert {checkpoint for checkpoint, _ in labels} == {"alibi_s1", "dummy_s1"}
    sweep_help = subprocess.run([str(BIN / "alibi-sweep"), "--help"], capture_output=True, text=True, env=env,
                                timeout=300).stdout
    groups = help_groups(sweep_help)
    assert groups["sinusoidal"] == ["none"] and groups["dummy"] == list(REGISTRY["nope"].extensions), sweep_help
