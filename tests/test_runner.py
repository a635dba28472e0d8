"""The evaluation runner (``evaluation/runner.py``, ``axes.py``, ``store.py``), tested
once for every tool: the axes, resuming, cell identities, loading each model once, the order of
--methods in reports, and the output-directory lock (with two real processes).

A toy backend and a toy measure stand in for the real ones: the rules are the
runner's, whatever is measured.  The real tools run through the same code
(tests/test_sweep.py, test_retrieval.py, test_hf.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import json
import subprocess
import sys
import time

import pytest

from conftest import cli_env, run_cli, tool

from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.errors import EvaluationError, UserError
from fairseq_alibi.evaluation import axes, runner
from fairseq_alibi.evaluation.protocols import Described, ModelInfo


class ToyModel:
    def __init__(self, log, info):
        self.log, self.info, self.method = log, info, None

    def use(self, method):
        self.log.append(("use", self.info.name, method.spelling))
        self.method = method

    def close(self):
        self.log.append(("close", self.info.name))


class ToyBackend:
    """Models ``NAME=VALUE``: VALUE is the model's identity (changing it is a new file)."""

    data_identity = "toy-data"

    def __init__(self, log):
        self.log = log

    def specs(self, args):
        return axes.parse_named(args.checkpoint, lambda v: v, "checkpoints")

    def describe(self, name, value):
        self.log.append(("describe", name))
        position = None if name.startswith("sin") else "rotary" if name.startswith("rope") else "alibi"
        return Described(ModelInfo(name, value, "toy", "toy", position, 8, value), encoder=None)

    def load(self, described, max_length):
        self.log.append(("load", described.info.name, max_length))
        return ToyModel(self.log, described.info)


@dataclass(frozen=True)
class ToyCell:
    n: int

    @property
    def key(self):
        return (self.n,)

    @property
    def label(self):
        return f"n={self.n}"


class ToyMeasure:
    tool = "toy-tool"

    def __init__(self, log, cells=(1, 2, 3)):
        self.log, self.ns = log, cells

    def settings_identity(self):
        return "s"

    def meta(self):
        return {}

    def cells(self, described):
        return [ToyCell(n) for n in self.ns]

    @staticmethod
    def max_length(cells):
        return max(c.n for c in cells)

    @staticmethod
    def needs_run(stored):
        return stored is None

    @staticmethod
    def cell_key(record):
        return (record["n"],)

    @staticmethod
    def order(record):
        return (record["checkpoint"], record["method"], record["factor"], record["n"])

    def run(self, model, method, cell):
        self.log.append(("run", model.info.name, method.spelling, cell.n))
        return {"n": cell.n, "value": cell.n * 10 + len(method.spelling)}

    @staticmethod
    def log_line(record):
        return f"{record['checkpoint']} {record['label']} {record['n']}"

    def report(self, outdir, cells, methods):
        rank = axes.method_rank(methods)
        rows = sorted({(c["checkpoint"], c["label"], rank(c)) for c in cells}, key=lambda r: (r[0], r[2]))
        (outdir / "results.md").write_text("\n".join(f"{name} {label}" for name, label, _ in rows))
        # what results.json adds: a field derived per cell (as intervals are) and a section of its own
        return {"cells": [dict(c, double=2 * c["value"]) for c in cells], "total": sum(c["value"] for c in cells)}


def toy_run(tmp_path, checkpoints, methods="none,ntk:2,cap", cells=(1, 2, 3)):
    log = []
    args = argparse.Namespace(checkpoint=list(checkpoints), methods=methods, output_dir=tmp_path, no_progress=True)
    results = runner.run(args, axes.parse_methods(methods), ToyMeasure(log, cells), ToyBackend(log))
    return log, results


def runs(log):
    return [entry[1:] for entry in log if entry[0] == "run"]


def test_every_model_described_and_loaded_once_methods_in_turn(tmp_path):
    log, results = toy_run(tmp_path, ["a=1", "b=1"])
    assert [e for e in log if e[0] == "describe"] == [("describe", "a"), ("describe", "b")]
    assert [e for e in log if e[0] == "load"] == [("load", "a", 3), ("load", "b", 3)]
    assert [e for e in log if e[0] == "use" and e[1] == "a"] == [("use", "a", m) for m in ("none", "ntk:2", "cap")]
    assert len(runs(log)) == 2 * 3 * 3 and len(results) == 18
    # every model described (validated) before the first one is loaded
    assert log.index(("describe", "b")) < log.index(("load", "a", 3))
    record = next(r for r in results if r["checkpoint"] == "a" and r["method"] == "cap")
    assert (record["label"], record["factor"], record["train_length"], record["value"]) == ("cap x1", 1.0, 8, 13)


def test_resume_reuses_cells_of_unchanged_models_only(tmp_path):
    toy_run(tmp_path, ["a=1", "b=1"])
    log, _ = toy_run(tmp_path, ["a=1", "b=1"])
    assert runs(log) == [] and not [e for e in log if e[0] == "load"]  # nothing left: nothing loaded
    log, results = toy_run(tmp_path, ["a=2"], cells=(1, 2, 3, 4))  # a's file changed, one more cell
    assert sorted(runs(log)) == sorted(("a", m, n) for m in ("none", "ntk:2", "cap") for n in (1, 2, 3, 4))
    assert {r["checkpoint"] for r in results} == {"a"}  # the cells of this run's grid (runner.run)
    stored = json.loads((tmp_path / "results.json").read_text())
    assert len(stored["cells"]) == 3 * 4 + 3 * 3 and stored["meta"]["methods"] == ["none", "ntk:2", "cap"]
    assert {c["checkpoint"] for c in stored["cells"]} == {"a", "b"}  # b's cells are kept for a later run


def test_stale_cells_outside_the_grid_are_kept_for_the_run_they_belong_to(tmp_path):
    """A run under another identity (here a's value; in alibi-sweep, another --subset,
    whose files are part of it) recomputes the cells of its grid and keeps the others
    as they were: a later run under the first identity reuses them (they were dropped
    from results.json, never recomputed)."""
    toy_run(tmp_path, ["a=1"], cells=(1, 2, 3))
    log, _ = toy_run(tmp_path, ["a=2"], cells=(1,))
    assert sorted(runs(log)) == sorted(("a", m, 1) for m in ("none", "ntk:2", "cap"))
    stored = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert sorted((c["n"], c["identity"].split("|")[0]) for c in stored if c["method"] == "none") == [
        (1, "2"), (2, "1"), (3, "1")]
    log, _ = toy_run(tmp_path, ["a=1"], cells=(2, 3))
    assert runs(log) == []


def test_what_a_report_derives_is_written_to_results_json_and_resumes(tmp_path):
    _, results = toy_run(tmp_path, ["a=1"])
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["total"] == sum(r["value"] for r in results) and len(stored["cells"]) == len(results)
    assert all(c["double"] == 2 * c["value"] for c in stored["cells"])
    log, again = toy_run(tmp_path, ["a=1"])
    assert runs(log) == [] and len(again) == len(results)  # the derived fields do not make a cell stale


def test_reports_list_methods_in_the_order_given(tmp_path):
    toy_run(tmp_path, ["a=1"], methods="cap,none,ntk:2")
    assert (tmp_path / "results.md").read_text().splitlines() == ["a cap x1", "a none", "a ntk x2"]


def test_a_damaged_or_foreign_results_file_is_named(tmp_path):
    (tmp_path / "results.json").write_text('{"cells": [{"checkpoint": "a"}]}')
    with pytest.raises(EvaluationError, match="cannot read previous results .*another tool's results, or damaged"):
        toy_run(tmp_path, ["a=1"])
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(EvaluationError, match="delete it to start over"):
        toy_run(tmp_path, ["a=1"])
    for foreign in ('{"x": 1}', "[1, 2]", '{"cells": 3}'):  # valid JSON of someone else's: kept, never overwritten
        (tmp_path / "results.json").write_text(foreign)
        with pytest.raises(EvaluationError, match="cannot read previous results"):
            toy_run(tmp_path, ["a=1"])
        assert (tmp_path / "results.json").read_text() == foreign


@pytest.mark.parametrize("spec,message", [
    ("cubic", "method='cubic' is not valid; allowed values"), ("ntk:0.5", "factor=0.5 is not valid; ntk takes"),
    ("cap:0", "factor='0' is not valid; the cap must be a positive"), ("none:2", "method='none:2' is not valid; 'none' takes no"),
    ("", "no methods given"),
])
def test_bad_methods(spec, message):
    with pytest.raises(UserError, match=message):
        axes.parse_methods(spec)


def test_axes():
    assert axes.parse_methods("none,ntk,ntk:dynamic,cap:1,cap") == [Scaling(), Scaling("ntk"), Scaling("cap", 1)]
    assert axes.resolve_lengths(axes.parse_lengths("2k,1x,0.5x,64"), 64) == [32, 64, 2048]
    for bad in ("abc", "-1", "0x", "nanx", "infx", "100000000000"):
        with pytest.raises(EvaluationError, match="bad length"):
            axes.parse_lengths(bad)
    with pytest.raises(EvaluationError, match="relative lengths .* need the model's training length"):
        axes.resolve_lengths(axes.parse_lengths("2x"), None)
    with pytest.raises(EvaluationError, match="two checkpoints named 'a'"):
        axes.parse_named(["a=x", "a=y"], str, "checkpoints")


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(EvaluationError, match="is a file, not a directory"):
        toy_run(target, ["a=1"])


@pytest.mark.slow
def test_a_second_writer_of_the_same_output_dir_is_refused(lm_data_bin, alibi_checkpoint, tmp_path):
    """Two real alibi-sweep processes on one --output-dir: the second stops at once
    with one line naming the first; the first finishes every cell.  The first is
    held after its first cell until the second has been refused (a file releases
    it), so the order does not depend on the machine's speed."""
    out, release = tmp_path / "o", tmp_path / "release"
    args = [str(lm_data_bin), "-c", f"alibi={alibi_checkpoint}", "--lengths", "1x,2x",
            "--methods", "none,cap", "--output-dir", str(out), "--cpu", "--no-progress"]
    held = (
        "import os, sys, time\n"
        "from fairseq_alibi.evaluation import store\n"
        "put = store.ResultStore.put\n"
        "def held_put(self, cell, meta):\n"
        "    put(self, cell, meta)\n"
        "    deadline = time.time() + 240\n"
        f"    while not os.path.exists({str(release)!r}) and time.time() < deadline:\n"
        "        time.sleep(0.05)\n"
        "store.ResultStore.put = held_put\n"
        "from fairseq_alibi.evaluation.perplexity import main\n"
        "sys.argv = ['alibi-sweep'] + sys.argv[1:]\n"
        "main()\n"
    )
    first = subprocess.Popen([sys.executable, "-c", held, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=cli_env())
    try:
        deadline = time.time() + 240
        while not (out / "results.json").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second could start"
        second = run_cli([tool("alibi-sweep"), *args], expect_ok=False, timeout=240)
    finally:
        release.touch()
    assert second.returncode == 1, second.stderr[-2000:]
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "is being written by alibi-sweep (pid" in last and str(first.pid) in last
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-2000:]
    assert len(json.loads((out / "results.json").read_text())["cells"]) == 2 * 2
    run_cli([tool("alibi-sweep"), *args], timeout=240)  # the lock went with the first process


def test_lock_is_released_when_the_holder_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from fairseq_alibi.evaluation.store import OutputLock;"
         f"lock = OutputLock({str(tmp_path)!r}, 'holder').__enter__(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=cli_env(),
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(EvaluationError, match="is being written by holder"):
        toy_run(tmp_path, ["a=1"])
    holder.kill()
    holder.wait()
    log, _ = toy_run(tmp_path, ["a=1"])
    assert len(runs(log)) == 9


def test_a_model_without_alibi_gets_none_only_and_the_skipped_methods_are_named(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        log, results = toy_run(tmp_path, ["a=1", "sin=1"])
    assert {(r["checkpoint"], r["method"]) for r in results if r["checkpoint"] == "sin"} == {("sin", "none")}
    assert any("sin (toy): ntk:2, cap do not apply to it (the methods that do: none); evaluated with none"
               in r.message for r in caplog.records)


def test_each_model_gets_the_methods_of_its_position_method(tmp_path, caplog):
    """RoPE takes ntk but not cap; a method no model of the run takes is refused in one line."""
    with caplog.at_level("WARNING"):
        log, results = toy_run(tmp_path, ["a=1", "rope=1"])
    assert {r["method"] for r in results if r["checkpoint"] == "rope"} == {"none", "ntk"}
    assert {r["method"] for r in results if r["checkpoint"] == "a"} == {"none", "ntk", "cap"}
    rotary = ", ".join(POSITIONS["rotary"].extensions)
    assert any(f"rope (rotary): cap does not apply to it (the methods that do: {rotary})"
               in r.message for r in caplog.records)
    with pytest.raises(EvaluationError, match="yarn:2 does not apply to any model of this run; the methods that "
                                              "do: a \\(alibi\\): none, linear, ntk, cap"):
        toy_run(tmp_path / "other", ["a=1"], methods="none,yarn:2")
