"""``make gpu-check`` (``scripts/gpu_check.py``) without a GPU: its arguments,
its refusal without CUDA, the commands of its steps, the results file it
writes from fake step outputs (every step's table, a step that ran out of its
time with the rows it finished, a failed step), a step killed at its time
limit with its subprocesses, and the results file rewritten after every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, cli_env

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

SCRIPT = str(REPO / "scripts" / "gpu_check.py")


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=cli_env(),
                          cwd=REPO, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_refuses_without_cuda_in_one_line():
    before = sorted((REPO / "docs" / "results").iterdir())
    result = run_script()
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: gpu-check needs a CUDA GPU, and torch {torch.__version__} sees none here "
        "(torch.cuda.is_available() is False); run it on a machine with one"]
    assert sorted((REPO / "docs" / "results").iterdir()) == before  # no results file


@pytest.mark.parametrize("args,message", [
    (["--steps", "tests", "bogus"], "unknown step bogus; allowed: tests, kernels, eval, compile, train"),
    (["--budget", "0"], "--budget must be a positive number of seconds, got 0"),
    (["--budget", "ten"], "argument --budget: invalid float value: 'ten'"),
])
def test_bad_arguments_are_one_error_line(args, message):
    result = run_script(*args)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].endswith(message), result.stderr


def test_step_commands(tmp_path):
    train = gpu_check.commands("train", str(tmp_path))
    assert [cmd[cmd.index("--length") + 1:] for cmd in train] == [["512", "--batch", "64"], ["2048", "--batch", "16"]]
    assert [cmd[cmd.index("--json") + 1] for cmd in train] == [str(tmp_path / "train_512.json"),
                                                                str(tmp_path / "train_2048.json")]
    for step in ("kernels", "compile", "eval"):
        (cmd,) = gpu_check.commands(step, str(tmp_path))
        assert cmd[0] == sys.executable and cmd[cmd.index("--json") + 1] == str(tmp_path / f"{step}.json")
        assert "cuda" in cmd
    (tests,) = gpu_check.commands("tests", str(tmp_path))
    assert tests[1:3] == ["-m", "pytest"] and tests[-2:] == ["-k", "cuda"]
    # a plain run: the CUDA tests, the kernels, the evaluation; the long steps only when named
    assert gpu_check.DEFAULT_STEPS == ("tests", "kernels", "eval")
    assert set(gpu_check.STEPS) == {"tests", "kernels", "eval", "compile", "train"}


def test_the_default_steps_fit_one_command_of_a_lent_machine():
    """The budget leaves a 600 s command room to install the package, and the default steps'
    weights (their expected seconds) fit in it, so no step is cut by the sharing alone."""
    assert gpu_check.BUDGET <= 600 - 100
    assert sum(gpu_check.STEPS[s][0] for s in gpu_check.DEFAULT_STEPS) <= gpu_check.BUDGET


def test_pytest_summary():
    assert gpu_check._pytest_summary("....\n9 passed, 200 deselected in 61.20s\n") == "9 passed, 200 deselected"
    assert gpu_check._pytest_summary("= 1 failed, 8 passed in 3.00s =") == "1 failed, 8 passed"
    assert gpu_check._pytest_summary("ImportError: no module") is None


#: What each step's command records of its settings (as the benchmarks write them), by default.
CONFIGS = {
    "kernels": {"dtype": "bfloat16", "heads": 16, "head_dim": 64, "tokens": 16384, "repeats": 5},
    "compile": {"dtype": "bfloat16", "warm_cache": False},
    "train": {"layers": 6, "embed_dim": 1024, "heads": 16, "skip": 10, "attention_dropout": [0.0]},
    "eval": {"dtype": "bfloat16", "layers": 4, "embed_dim": 256, "vocab": 32768, "timed": 3},
}


def kernel_row(length, batch, path, fwd, bwd, first, peak, shapes="static", **extra):
    return dict(path=path, length=length, batch=batch, shapes=shapes, fwd_ms=fwd, bwd_ms=bwd, ms=fwd + bwd,
                first_s=first, peak_mib=peak, **extra)


def fake_outputs(out, configs=CONFIGS, device="Fake GPU", torch_version="9.9", train_dtype="bfloat16",
                 complete=True):
    """What the steps' JSON files hold, with made-up numbers."""
    def write(name, data):
        (out / name).write_text(json.dumps(dict(data, device=device, torch=torch_version)))

    write("kernels.json", {"config": configs["kernels"], "complete": complete, "rows": [
        kernel_row(2048, 8, "flash-causal", 0.5, 1.0, 0.1, 100.0),
        kernel_row(2048, 8, "alibi", 1.0, 2.0, 12.0, 120.0, kernel="auto", chosen=["flex"], ratio=2.0),
        dict(path="t5bias", length=2048, batch=8, shapes="static", kernel="auto", failed="out of GPU memory"),
        kernel_row(16384, 1, "flash-causal", 2.0, 6.0, 0.2, 800.0),
        kernel_row(16384, 1, "alibi", 3.0, 7.0, 9.0, 810.0, kernel="auto", chosen=["flex"], ratio=1.25),
        kernel_row(16384, 1, "alibi, dynamic shapes", 4.0, 8.0, 20.0, 810.0, "dynamic", kernel="auto",
                   chosen=["flex"], ratio=1.5),
        kernel_row(16384, 1, "flex: slopes-only score_mod + block mask", 2.5, 6.5, 11.0, 805.0,
                   kernel="flex_attention", ratio=1.125, max_abs_diff=0.0078125)]})
    write("compile.json", {"config": configs["compile"], "rows": [
        dict(step="none", length=200, new_graphs=1, first_s=20.0, steady_s=0.001),
        dict(step="none", length=400, new_graphs=1, first_s=10.5, steady_s=0.002),
        dict(step="none", length=600, new_graphs=0, first_s=0.003, steady_s=0.003),
        dict(step="cap", length=600, new_graphs=1, first_s=9.0, steady_s=0.003)]})
    for (length, batch), (sinusoidal, alibi, ratio) in {(512, 64): ([90e3, 100e3, 130e3], [110e3], 1.1),
                                                        (2048, 16): ([80e3], [100e3], 1.25)}.items():
        write(f"train_{length}.json", {"dtype": train_dtype, "config": dict(configs["train"], length=length, batch=batch),
                                       "runs": {"0.0": {"median_wps": {"sinusoidal": sinusoidal, "alibi": alibi},
                                                        "median_ratio": ratio}}})
    write("eval.json", {"config": configs["eval"], "complete": complete, "cells": [
        dict(method="alibi", length=16384, seconds=0.5, first_s=12.25, warm_graphs=2, timed_graphs=0,
             peak_mib=2000.0),
        dict(method="sinusoidal", length=16384, seconds=0.7, first_s=0.9, warm_graphs=0, timed_graphs=0,
             peak_mib=9000.0),
        dict(method="alibi", length=65536, seconds=4.0, first_s=5.0, warm_graphs=1, timed_graphs=0, peak_mib=8000.0),
        dict(method="sinusoidal", length=65536, failed="out of GPU memory")]})


HEADER = """\
# GPU: `make gpu-check` on Fake GPU, 2030-01-02

- **Date, machine, torch:** 2030-01-02; Fake GPU; torch 9.9; the code at commit abc1234
- **Corpus:** none: attention calls and models at their initial weights (timings)
- **Command:** `python scripts/gpu_check.py --budget 470`
- **Status:** complete: every step ran to its end; timings are one run's, each ratio from readings taken side by side

| step | result | seconds |
|---|---|---|
| tests | 9 passed, 200 deselected | 60 |
| kernels | ok | 50 |
| eval | ok | 100 |
| compile | ok | 40 |
| train | ok | 150 |
"""

KERNELS = """\
## kernels

One attention call, bfloat16, 16 heads of 64, 16,384 tokens per call (batch = tokens / T), on Fake GPU, torch 9.9 \
(`benchmarks/gpu_attention.py --part kernels`); median of 5 readings (CUDA events). Forward + backward, ms \
(x bias-free causal flash attention of the same length); a method's row is its attention layer with identity \
projections, its kernel `auto`'s choice unless named:

| path | shapes | T=2048 | T=16384 |
|---|---|---|---|
| flash-causal | static | 1.50 | 8.00 |
| alibi | static | 3.00 (2.00x) | 10.00 (1.25x) |
| t5bias | static | failed: out of GPU memory |  |
| alibi, dynamic shapes | dynamic |  | 12.00 (1.50x) |
| flex: slopes-only score_mod + block mask | static |  | 9.00 (1.12x) |

Every row: the forward alone and the backward (forward + backward less the forward), each x flash's; the first \
call (compilation included where the path compiles); the kernels `auto` chose; peak memory of one forward + \
backward above its inputs; a diagnostic's largest difference from a dense-bias SDPA of the same inputs:

| T | batch | path | shapes | kernel (chosen) | fwd ms (x) | bwd ms (x) | fwd+bwd ms (x) | first call s | peak MiB \
| max abs diff |
|---|---|---|---|---|---|---|---|---|---|---|
| 2048 | 8 | flash-causal | static |  | 0.50 (1.00) | 1.00 (1.00) | 1.50 (1.00) | 0.10 | 100 | - |
| 2048 | 8 | alibi | static | auto (flex) | 1.00 (2.00) | 2.00 (2.00) | 3.00 (2.00) | 12.00 | 120 | - |
| 2048 | 8 | t5bias | static | auto | failed: out of GPU memory | | | | | |
| 16384 | 1 | flash-causal | static |  | 2.00 (1.00) | 6.00 (1.00) | 8.00 (1.00) | 0.20 | 800 | - |
| 16384 | 1 | alibi | static | auto (flex) | 3.00 (1.50) | 7.00 (1.17) | 10.00 (1.25) | 9.00 | 810 | - |
| 16384 | 1 | alibi, dynamic shapes | dynamic | auto (flex) | 4.00 (2.00) | 8.00 (1.33) | 12.00 (1.50) | 20.00 | 810 \
| - |
| 16384 | 1 | flex: slopes-only score_mod + block mask | static | flex_attention | 2.50 (1.25) | 6.50 (1.08) \
| 9.00 (1.12) | 11.00 | 805 | 0.00781 |
"""

EVAL = """\
## eval

One sequence scored in one forward (`SequenceScorer`), bfloat16, 4 layers, d=256, vocabulary 32,768, on Fake GPU, \
torch 9.9 (`benchmarks/eval_memory.py --device cuda`); each cell a process of its own, warmed by a first forward at \
its length (compilation included), then timed: the median of 3 forwards:

| tokens | method | s | first call s | graphs compiled: warming / timed | peak MiB |
|---|---|---|---|---|---|
| 16384 | alibi | 0.500 | 12.25 | 2 / 0 | 2000 |
| 16384 | sinusoidal | 0.700 | 0.90 | 0 / 0 | 9000 |
| 65536 | alibi | 4.000 | 5.00 | 1 / 0 | 8000 |
| 65536 | sinusoidal | - | - | - | out of GPU memory |
"""

COMPILE = """\
## compile

Compilation of the `flex` kernel, bfloat16, from an empty inductor cache (`benchmarks/flex_compile.py --device cuda`):

| calls | length | new graphs | first call s | steady call ms |
|---|---|---|---|---|
| none | 200 | 1 | 20.00 | 1.00 |
| none | 400 | 1 | 10.50 | 2.00 |
| none | 600 | 0 | 0.00 | 3.00 |
| cap | 600 | 1 | 9.00 | 3.00 |

Fake GPU, torch 9.9: 2 graphs for 3 lengths, 30.5 s of compilation in all.
"""

TRAIN = """\
## train

Stock `fairseq-train`, bfloat16, 6 layers, d=1024, 16 heads, ALiBi (`auto`: compiled \
FlexAttention) against sinusoidal, median words/s after 10 warm-up updates \
(`benchmarks/fairseq_train_wps.py --device cuda`):

| tokens per sample | sequences per update | sinusoidal wps | ALiBi wps | ALiBi / sinusoidal |
|---|---|---|---|---|
| 512 | 64 | 100000 | 110000 | 1.100 |
| 2048 | 16 | 80000 | 100000 | 1.250 |
"""


def unwrap(text: str) -> str:
    """The expected text with its long lines joined (written across lines above, one line in the file)."""
    return text.replace(" \\\n", " ").replace("\\\n", "")


STEPS_DONE = {"tests": dict(status="9 passed, 200 deselected", seconds=60.2),
              "kernels": dict(status="ok", seconds=50), "eval": dict(status="ok", seconds=100),
              "compile": dict(status="ok", seconds=40), "train": dict(status="ok", seconds=150)}


def render(out, statuses=None, steps=None):
    statuses = dict(STEPS_DONE) if statuses is None else statuses
    return gpu_check.render("Fake GPU", "9.9", statuses, str(out), "2030-01-02", steps or list(STEPS_DONE),
                            "python scripts/gpu_check.py --budget 470", "abc1234")


def test_results_file_from_fake_numbers(tmp_path):
    fake_outputs(tmp_path)
    expected = "\n".join(unwrap(part) for part in (HEADER, KERNELS, EVAL, COMPILE, TRAIN))
    assert render(tmp_path) == expected


def test_the_results_file_has_the_header_the_docs_test_reads(tmp_path):
    """docs/results/ files open with a title, then the date, machine, corpus, command and status
    (tests/test_docs.py reads the second paragraph)."""
    import re

    fake_outputs(tmp_path)
    head = render(tmp_path).split("\n\n", 2)[1]
    for field in ("Date", "[Mm]achine", "Corpus", "Command", "Status"):
        assert re.search(rf"\*\*(Date, )?{field}\b", head), field


def test_a_step_out_of_time_shows_the_rows_it_finished_and_a_failed_one_none(tmp_path):
    fake_outputs(tmp_path, complete=False)
    statuses = dict(STEPS_DONE, kernels=dict(status="timed out after 230 s", seconds=230),
                    eval=dict(status="failed (exit 1)", seconds=3))
    section = render(tmp_path, statuses)
    assert "| kernels | timed out after 230 s | 230 |" in section
    assert "| eval | failed (exit 1) | 3 |" in section
    assert "Partial: the kernels step stopped before its end; the rows it finished:" in section
    assert "| alibi | static | 3.00 (2.00x) | 10.00 (1.25x) |" in section  # its rows, as finished
    assert "## eval" not in section and "SequenceScorer" not in section
    assert "- **Status:** every step ran; kernels, eval did not finish or failed (below)" in section


def test_a_run_stopped_after_some_steps_says_which_did_not_run(tmp_path):
    fake_outputs(tmp_path)
    section = render(tmp_path, {"tests": STEPS_DONE["tests"]}, ["tests", "kernels", "eval"])
    assert "- **Status:** partial: written after the tests step; not run (yet): kernels, eval;" in section
    assert "| kernels | not run | - |" in section and "## kernels" not in section


def test_run_step_reports_a_failure_and_kills_an_overrun_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.STEPS, "kernels", (10, ["-c", "import sys; print('boom'); sys.exit(3)"]))
    failed = gpu_check.run_step("kernels", str(tmp_path), 30)
    assert failed["status"] == "failed (exit 3)" and "boom" in failed["tail"]
    assert "boom" in (tmp_path / "kernels.log").read_text()
    # A step that prints, starts a child of its own and sleeps: stopped at its time, its output kept,
    # the child killed with it (a benchmark's cell process must not run on into the next step).
    marker = tmp_path / "child-still-ran"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w').write('x')"
    script = ("import subprocess, sys, time; print('started', flush=True); "
              f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)")
    monkeypatch.setitem(gpu_check.STEPS, "kernels", (10, ["-c", script]))
    start = time.monotonic()
    overrun = gpu_check.run_step("kernels", str(tmp_path), 1.5)
    assert time.monotonic() - start < 10
    assert overrun["status"] == "timed out after 2 s" and "started" in overrun["tail"]
    assert "started" in (tmp_path / "kernels.log").read_text()
    time.sleep(4)
    assert not marker.exists()


def test_main_writes_the_results_file_after_every_step(tmp_path, monkeypatch):
    """Each step starts with the results file already holding the steps before it (a run stopped
    from outside keeps them); the copy in --out is the same file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    results = tmp_path / "gpu-check-test.md"
    out = tmp_path / "out"
    seen = {}

    def fake_step(step, out_dir, seconds):
        seen[step] = results.read_text()
        if step == "kernels":
            fake_outputs(out)
        return dict(status="timed out after 5 s" if step == "eval" else "ok", seconds=1.0, tail="")

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    assert gpu_check.main(["--steps", "kernels", "eval", "--budget", "60", "--out", str(out),
                           "--results", str(results), "--commit", "0123abc"]) == 0
    assert "| kernels | not run | - |" in seen["kernels"] and "not run (yet): kernels, eval" in seen["kernels"]
    assert "| kernels | ok | 1 |" in seen["eval"] and "## kernels" in seen["eval"]
    final = results.read_text()
    assert (out / "gpu-check-test.md").read_text() == final
    assert "| eval | timed out after 5 s | 1 |" in final and "## eval" in final  # its rows, marked partial or not
    assert "**Command:** `python scripts/gpu_check.py --steps kernels eval --budget 60" in final
    assert "; the code at commit 0123abc" in final


def test_results_path_is_new_for_each_run_of_a_day(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "RESULTS_DIR", str(tmp_path))
    assert gpu_check.results_path("2030-01-02") == str(tmp_path / "gpu-check-2030-01-02.md")
    (tmp_path / "gpu-check-2030-01-02.md").write_text("x")
    (tmp_path / "gpu-check-2030-01-02-2.md").write_text("x")
    assert gpu_check.results_path("2030-01-02") == str(tmp_path / "gpu-check-2030-01-02-3.md")


#: name -> (each step's recorded settings changed, the words its caption must then hold)
RECORDED = {
    "float16 kernels, 8 heads of 128, 3 repeats": (
        {"kernels": {"dtype": "float16", "heads": 8, "head_dim": 128, "tokens": 8192, "repeats": 3}},
        "One attention call, float16, 8 heads of 128, 8,192 tokens per call (batch = tokens / T), on Other GPU, "
        "torch 8.8 (`benchmarks/gpu_attention.py --part kernels`); median of 3 readings"),
    "compile from a warm cache": ({"compile": {"dtype": "float32", "warm_cache": True}},
                                  "Compilation of the `flex` kernel, float32, from the usual inductor cache"),
    "train: 4 layers, d=512, 3 warm-up updates": (
        {"train": {"layers": 4, "embed_dim": 512, "heads": 8, "skip": 3, "attention_dropout": [0.1]}},
        "4 layers, d=512, 8 heads, ALiBi (`auto`: compiled FlexAttention) against sinusoidal, median words/s after "
        "3 warm-up updates"),
    "eval: float32, vocabulary 1000, 5 timed": (
        {"eval": {"dtype": "float32", "layers": 2, "embed_dim": 64, "vocab": 1000, "timed": 5}},
        "`SequenceScorer`), float32, 2 layers, d=64, vocabulary 1,000, on Other GPU"),
}


@pytest.mark.parametrize("name", list(RECORDED))
def test_captions_say_what_each_step_recorded_not_what_was_asked(name, tmp_path):
    """A caption's dtype, sizes and repeats come from the step's own JSON: a step
    that ran with other settings (another STEPS entry, a benchmark's fallback) is
    described as it ran; an output that records another device or torch says so."""
    changed, words = RECORDED[name]
    configs = dict(CONFIGS, **changed)
    fake_outputs(tmp_path, configs, device="Other GPU", torch_version="8.8", train_dtype="float16")
    if "train" in changed:  # the runs are stored under their attention dropout
        for path in tmp_path.glob("train_*.json"):
            data = json.loads(path.read_text())
            data["runs"] = {"0.1": data["runs"]["0.0"]}
            path.write_text(json.dumps(data))
    section = render(tmp_path)
    assert words in section.replace("\n", " "), section
    assert "could not be read" not in section
    assert section.count("(its output records Other GPU, torch 8.8, not the header's)") == len(gpu_check.SECTIONS)
    assert "Stock `fairseq-train`, float16," in section  # what the train runs record, not bfloat16


def test_outputs_that_cannot_be_read_are_said_so(tmp_path):
    fake_outputs(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"device": "Fake GPU", "cells": []}))  # no config
    (tmp_path / "kernels.json").unlink()
    section = render(tmp_path)
    assert "(kernels wrote no output to read)" in section
    assert "(eval: its output could not be read: KeyError: 'config')" in section


def test_a_step_that_ends_early_hands_its_time_to_the_later_steps():
    steps = list(gpu_check.DEFAULT_STEPS)
    weights = [gpu_check.STEPS[s][0] for s in steps]
    first = gpu_check.step_share(steps, 630.0)
    assert first == pytest.approx(630.0 * weights[0] / sum(weights))
    # The first step used a third of its share: the rest share what is left, in proportion.
    left = 630.0 - first / 3
    second = gpu_check.step_share(steps[1:], left)
    assert second == pytest.approx(left * weights[1] / sum(weights[1:]))
    assert second > 630.0 * weights[1] / sum(weights)
    assert gpu_check.step_share(steps[-1:], 42.0) == pytest.approx(42.0)
    assert gpu_check.step_share(steps[-1:], -3.0) == 0.0


def test_no_step_leaves_files_the_device_would_not_send_back(tmp_path):
    """A lent machine sends back at most 8 files from its output folder: the default steps'
    outputs, logs and the results copy stay within that."""
    files = {"gpu-check-2030-01-02.md"}
    for step in gpu_check.DEFAULT_STEPS:
        files |= set(gpu_check.outputs(step)) | {f"{step}.log"}
    assert len(files) <= 8, sorted(files)
    assert all(os.path.basename(name) == name for name in files)


@pytest.mark.slow
def test_the_real_benchmarks_through_the_check_one_step_out_of_time(tmp_path, monkeypatch):
    """The check's whole path on the CPU, the benchmarks' own outputs read back: the kernel
    benchmark given more lengths than its share of the time allows is stopped, its finished rows
    in the results file as partial; the evaluation after it gets the time left and its table."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    lengths = [str(n) for n in range(64, 64 + 8 * 320, 8)]  # far more than 40 s of rows on any CPU (80 took 28 s)
    monkeypatch.setitem(gpu_check.STEPS, "kernels", (1, [
        "benchmarks/gpu_attention.py", "--part", "kernels", "--device", "cpu", "--tokens", "128", "--heads", "2",
        "--head-dim", "8", "--repeats", "1", "--shapes", "static", "--diagnose-lengths", "none", "--lengths",
        *lengths, "--json", "{json}"]))
    monkeypatch.setitem(gpu_check.STEPS, "eval", (1, [
        "benchmarks/eval_memory.py", "--lengths", "32", "--methods", "alibi", "--repeats", "1", "--timed", "2",
        "--vocab", "64", "--embed-dim", "16", "--layers", "1", "--heads", "2", "--ffn", "32", "--json", "{json}"]))
    results, out = tmp_path / "gpu-check-test.md", tmp_path / "out"
    assert gpu_check.main(["--steps", "kernels", "eval", "--budget", "80", "--out", str(out),
                           "--results", str(results)]) == 0
    text = results.read_text()
    assert "| kernels | timed out after 40 s | 40 |" in text, text
    assert "Partial: the kernels step stopped before its end; the rows it finished:" in text
    assert "| 64 | 2 | flash-causal | static |" in text  # the first row, from the benchmark's own JSON
    assert "| eval | ok |" in text and "| 32 | alibi | " in text and "the median of 2 forwards" in text
    assert (out / "kernels.log").read_text().startswith("$ ")
