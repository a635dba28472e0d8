"""``make gpu-check`` (``scripts/gpu_check.py``) without a GPU: its arguments,
its refusal without CUDA, the commands of its steps, and the Markdown it
writes into docs/results/gpu-check.md, from fake numbers."""

from __future__ import annotations

import json
import subprocess
import sys

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
    before = (REPO / "docs" / "results" / "gpu-check.md").read_text()
    result = run_script()
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: gpu-check needs a CUDA GPU, and torch {torch.__version__} sees none here "
        "(torch.cuda.is_available() is False); run it on a machine with one"]
    assert (REPO / "docs" / "results" / "gpu-check.md").read_text() == before


@pytest.mark.parametrize("args,message", [
    (["--steps", "tests", "bogus"], "unknown step(s) bogus; allowed: tests, kernels, compile, train, eval"),
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


def test_pytest_summary():
    assert gpu_check._pytest_summary("....\n9 passed, 200 deselected in 61.20s\n") == "9 passed, 200 deselected"
    assert gpu_check._pytest_summary("= 1 failed, 8 passed in 3.00s =") == "1 failed, 8 passed"
    assert gpu_check._pytest_summary("ImportError: no module") is None


#: What each step's command records of its settings (as the benchmarks write them), by default.
CONFIGS = {
    "kernels": {"dtype": "bfloat16", "heads": 16, "head_dim": 64, "tokens": 16384, "repeats": 3},
    "compile": {"dtype": "bfloat16", "warm_cache": False},
    "train": {"layers": 6, "embed_dim": 1024, "heads": 16, "skip": 10, "attention_dropout": [0.0]},
    "eval": {"dtype": "bfloat16", "layers": 4, "embed_dim": 256, "vocab": 32768},
}


def fake_outputs(out, configs=CONFIGS, device="Fake GPU", torch_version="9.9", train_dtype="bfloat16"):
    """What the steps' JSON files hold, with made-up numbers."""
    def write(name, data):
        (out / name).write_text(json.dumps(dict(data, device=device, torch=torch_version)))

    write("kernels.json", {"config": configs["kernels"], "rows": [
        dict(length=2048, batch=8, path="flash-causal", ms=1.0, peak_mib=100.0, ratio=1.0),
        dict(length=2048, batch=8, path="alibi-flex", ms=1.5, peak_mib=120.0, ratio=1.5),
        dict(length=2048, batch=8, path="alibi-sdpa", ms=3.0, peak_mib=900.0, ratio=3.0),
        dict(length=16384, batch=1, path="flash-causal", ms=8.0, peak_mib=800.0, ratio=1.0),
        dict(length=16384, batch=1, path="alibi-flex", ms=10.0, peak_mib=810.0, ratio=1.25)]})
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
    write("eval.json", {"config": configs["eval"], "cells": [
        dict(method="alibi", length=16384, seconds=0.5, peak_mib=2000.0),
        dict(method="sinusoidal", length=16384, seconds=0.7, peak_mib=9000.0),
        dict(method="alibi", length=65536, seconds=4.0, peak_mib=8000.0),
        dict(method="sinusoidal", length=65536, failed="out of GPU memory")]})


EXPECTED = """\
<!-- gpu-check: begin -->
### Measured by `make gpu-check` on Fake GPU (2030-01-02, torch 9.9)

| step | result | seconds |
|---|---|---|
| tests | 9 passed, 200 deselected | 60 |
| kernels | ok | 50 |
| compile | ok | 40 |
| train | ok | 150 |
| eval | ok | 100 |

One attention call, forward + backward, bfloat16, 16 heads of 64, 16,384 tokens per call \
(`benchmarks/gpu_attention.py --part kernels`); median of 3:

| T | batch | flash causal, no bias: ms | ALiBi flex: ms (x flash) | ALiBi sdpa: ms (x flash) | \
peak MiB: flash / flex / sdpa |
|---|---|---|---|---|---|
| 2048 | 8 | 1.00 | 1.50 (1.50) | 3.00 (3.00) | 100 / 120 / 900 |
| 16384 | 1 | 8.00 | 10.00 (1.25) | not run | 800 / 810 / - |

Compilation of the `flex` kernel, bfloat16, from an empty inductor cache (`benchmarks/flex_compile.py --device cuda`):

| calls | length | new graphs | first call s | steady call ms |
|---|---|---|---|---|
| none | 200 | 1 | 20.00 | 1.00 |
| none | 400 | 1 | 10.50 | 2.00 |
| none | 600 | 0 | 0.00 | 3.00 |
| cap | 600 | 1 | 9.00 | 3.00 |

Fake GPU, torch 9.9: 2 graphs for 3 lengths, 30.5 s of compilation in all.

Stock `fairseq-train`, bfloat16, 6 layers, d=1024, 16 heads, ALiBi (`auto`: compiled \
FlexAttention) against sinusoidal, median words/s after 10 warm-up updates \
(`benchmarks/fairseq_train_wps.py --device cuda`):

| tokens per sample | sequences per update | sinusoidal wps | ALiBi wps | ALiBi / sinusoidal |
|---|---|---|---|---|
| 512 | 64 | 100000 | 110000 | 1.100 |
| 2048 | 16 | 80000 | 100000 | 1.250 |

One sequence scored in one forward (`SequenceScorer`), bfloat16, 4 layers, d=256, vocabulary 32,768 \
(`benchmarks/eval_memory.py --device cuda`):

| tokens | ALiBi s | ALiBi peak MiB | sinusoidal s | sinusoidal peak MiB |
|---|---|---|---|---|
| 16384 | 0.50 | 2000 | 0.70 | 9000 |
| 65536 | 4.00 | 8000 | - | out of GPU memory |
<!-- gpu-check: end -->"""


def test_markdown_from_fake_numbers(tmp_path):
    fake_outputs(tmp_path)
    statuses = {"tests": dict(status="9 passed, 200 deselected", seconds=60.2),
                "kernels": dict(status="ok", seconds=50), "compile": dict(status="ok", seconds=40),
                "train": dict(status="ok", seconds=150), "eval": dict(status="ok", seconds=100)}
    assert gpu_check.render("Fake GPU", "9.9", statuses, str(tmp_path), "2030-01-02") == EXPECTED
    # a step that did not finish has its line in the first table and no table of its own
    statuses["eval"] = dict(status="timed out after 120 s", seconds=120)
    section = gpu_check.render("Fake GPU", "9.9", statuses, str(tmp_path), "2030-01-02")
    assert "| eval | timed out after 120 s | 120 |" in section and "SequenceScorer" not in section


def test_section_replaced_between_the_markers_of_the_docs():
    docs = (REPO / "docs" / "results" / "gpu-check.md").read_text()
    assert docs.count(gpu_check.BEGIN) == 1 and docs.count(gpu_check.END) == 1
    assert "Measured" in docs.split(gpu_check.BEGIN)[1].split(gpu_check.END)[0]
    replaced = gpu_check.replace_section(docs, EXPECTED)
    assert replaced.split(gpu_check.BEGIN)[0] == docs.split(gpu_check.BEGIN)[0]
    assert replaced.split(gpu_check.END)[1] == docs.split(gpu_check.END)[1]
    assert gpu_check.BEGIN + replaced.split(gpu_check.BEGIN)[1].split(gpu_check.END)[0] + gpu_check.END == EXPECTED
    with pytest.raises(ValueError, match="has no '<!-- gpu-check: begin -->'"):
        gpu_check.replace_section("no markers here", EXPECTED)


def test_a_step_that_fails_or_overruns_is_reported_as_such(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.STEPS, "kernels", (10, ["-c", "import sys; print('boom'); sys.exit(3)"]))
    failed = gpu_check.run_step("kernels", str(tmp_path), 30)
    assert failed["status"] == "failed (exit 3)" and "boom" in failed["tail"]
    assert "boom" in (tmp_path / "kernels.log").read_text()
    monkeypatch.setitem(gpu_check.STEPS, "kernels", (10, ["-c", "import time; time.sleep(30)"]))
    assert gpu_check.run_step("kernels", str(tmp_path), 1)["status"] == "timed out after 1 s"


#: name -> (each step's recorded settings changed, the words its caption must then hold)
RECORDED = {
    "float16 kernels, 8 heads of 128, 5 repeats": (
        {"kernels": {"dtype": "float16", "heads": 8, "head_dim": 128, "tokens": 8192, "repeats": 5}},
        "float16, 8 heads of 128, 8,192 tokens per call (`benchmarks/gpu_attention.py --part kernels`); median of 5:"),
    "compile from a warm cache": ({"compile": {"dtype": "float32", "warm_cache": True}},
                                  "Compilation of the `flex` kernel, float32, from the usual inductor cache"),
    "train: 4 layers, d=512, 3 warm-up updates": (
        {"train": {"layers": 4, "embed_dim": 512, "heads": 8, "skip": 3, "attention_dropout": [0.1]}},
        "4 layers, d=512, 8 heads, ALiBi (`auto`: compiled FlexAttention) against sinusoidal, median words/s after "
        "3 warm-up updates"),
    "eval: float32, vocabulary 1000": ({"eval": {"dtype": "float32", "layers": 2, "embed_dim": 64, "vocab": 1000}},
                                       "`SequenceScorer`), float32, 2 layers, d=64, vocabulary 1,000 "),
}


@pytest.mark.parametrize("name", list(RECORDED))
def test_captions_say_what_each_step_recorded_not_what_was_asked(name, tmp_path):
    """A caption's dtype, sizes and repeats come from the step's own JSON: a step
    that ran with other settings (another STEPS entry, a benchmark's fallback) is
    described as it ran; an output that records another device or torch says so."""
    changed, words = RECORDED[name]
    configs = dict(CONFIGS, **changed)
    if "train" in changed:  # the runs are stored under their attention dropout
        configs["train"] = changed["train"]
    fake_outputs(tmp_path, configs, device="Other GPU", torch_version="8.8", train_dtype="float16")
    if "train" in changed:
        for path in tmp_path.glob("train_*.json"):
            data = json.loads(path.read_text())
            data["runs"] = {"0.1": data["runs"]["0.0"]}
            path.write_text(json.dumps(data))
    statuses = {step: dict(status="ok", seconds=1) for step in gpu_check.SECTIONS}
    section = gpu_check.render("Fake GPU", "9.9", statuses, str(tmp_path), "2030-01-02")
    assert words in section.replace("\n", " "), section
    assert "could not be read" not in section
    assert section.count("(its output records Other GPU, torch 8.8, not the header's)") == len(gpu_check.SECTIONS)
    assert "Stock `fairseq-train`, float16," in section  # what the train runs record, not bfloat16


def test_outputs_that_cannot_be_read_are_said_so(tmp_path):
    fake_outputs(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"device": "Fake GPU", "cells": []}))  # no config
    (tmp_path / "kernels.json").unlink()
    statuses = {step: dict(status="ok", seconds=1) for step in gpu_check.SECTIONS}
    section = gpu_check.render("Fake GPU", "9.9", statuses, str(tmp_path), "2030-01-02")
    assert "(kernels wrote no output to read)" in section
    assert "(eval: its output could not be read: KeyError: 'config')" in section


def test_a_step_that_ends_early_hands_its_time_to_the_later_steps():
    steps = list(gpu_check.STEPS)
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
