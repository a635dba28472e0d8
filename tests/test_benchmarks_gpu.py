"""The GPU benchmarks' code on the CPU, at tiny sizes: ``benchmarks/gpu_attention.py
--part kernels`` times every registered method's attention call (one registered
later too), writes its JSON after every row, keeps going past a path that fails,
and its rows render in ``make gpu-check``'s results file; its flex diagnostics
compute ALiBi (against a dense-bias reference); ``benchmarks/eval_memory.py``
warms each cell at its length and times the kernels alone, for every method."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, cli_env

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))
import gpu_attention  # noqa: E402
import gpu_check  # noqa: E402

from fairseq_alibi.core import positions as P  # noqa: E402

TINY = ["--part", "kernels", "--device", "cpu", "--tokens", "128", "--heads", "2", "--head-dim", "8",
        "--repeats", "1", "--shapes", "static", "--diagnose-lengths", "none"]
#: The fields every row names (what it measured, where).
NAMED = ("device", "torch", "dtype", "heads", "head_dim", "tokens", "length", "batch", "path", "shapes")


@pytest.fixture
def dynamo_config():
    """The benchmark sets dynamo's shape settings for its process: put them back for the other tests."""
    from torch._dynamo import config

    names = ("automatic_dynamic_shapes", "assume_static_by_default", "recompile_limit", "cache_size_limit",
             "accumulated_recompile_limit", "accumulated_cache_size_limit")
    saved = {name: getattr(config, name) for name in names if hasattr(config, name)}
    yield
    for name, value in saved.items():
        setattr(config, name, value)


@pytest.fixture
def later_method(monkeypatch):
    """A method registered after the benchmark was written (ALiBi's maths under another name)."""
    entry = dataclasses.replace(P.POSITIONS["alibi"], name="later")
    monkeypatch.setitem(P.POSITIONS, "later", entry)
    return "later"


def test_every_registered_method_is_timed(tmp_path, dynamo_config, later_method):
    out = tmp_path / "kernels.json"
    assert gpu_attention.main(TINY + ["--lengths", "64", "96", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["config"]["methods"] == list(P.POSITIONS)
    rows = result["rows"]
    assert [r for r in rows if "failed" in r] == []
    for row in rows:
        assert all(row[name] is not None for name in NAMED), row
        assert row["device"] == result["device"] and row["torch"] == torch.__version__
        assert (row["dtype"], row["heads"], row["head_dim"]) == ("float32", 2, 8)
        assert row["tokens"] == row["batch"] * row["length"] == 128 - 128 % row["length"]
        assert row["fwd_ms"] > 0 and row["ms"] > 0 and row["first_s"] > 0
    for length in (64, 96):
        at = [r for r in rows if r["length"] == length]
        assert [r["path"] for r in at][0] == "flash-causal" and at[-1]["path"] == "flash-causal (again)"
        timed = {r["method"] for r in at if "method" in r}
        assert timed == set(P.POSITIONS), f"not timed at {length}: {set(P.POSITIONS) - timed}"
        assert {r["kernel"] for r in at if r.get("method") == "alibi"} == {"auto", "sdpa"}
        assert all(r["chosen"] for r in at if "method" in r)  # the kernel auto (or the name) ran
        # a layer that computes its attention itself (own_kernel) ran its own attention, no kernel; the others a kernel
        own = {m for m in P.POSITIONS if any(gpu_attention.build_stack(m, length, 2, 8).at_layer(i).own_kernel
                                             for i in range(gpu_attention.LAYERS))}
        assert own and all((r["chosen"] == [gpu_attention.OWN_ATTENTION]) == (r["method"] in own)
                           for r in at if "method" in r), [(r["method"], r["chosen"]) for r in at if "method" in r]
        assert all(r["ratio"] > 0 for r in at if r["path"] != "flash-causal")
    hybrid = [r["path"] for r in rows if r.get("method") == "rnope" and r["length"] == 64]
    assert len(hybrid) == 2, hybrid  # a row per kind of layer: windowed RoPE, NoPE
    # the rows as make gpu-check's results file shows them: a table row per path, a line per reading
    section = "\n".join(gpu_check.kernels_section([result]))
    for row in rows:
        assert f"| {row['length']} | {row['batch']} | {row['path']} | static |" in section
    assert "| later | static |" in section


def test_a_path_that_fails_is_a_row_and_the_others_run(tmp_path, dynamo_config, monkeypatch):
    real = gpu_attention.layer_call

    def layer_call(method, *args):
        if method == "kerple":
            raise RuntimeError("no kernel for this\nsecond line")
        return real(method, *args)

    monkeypatch.setattr(gpu_attention, "layer_call", layer_call)
    out = tmp_path / "kernels.json"
    gpu_attention.main(TINY + ["--lengths", "64", "--methods", "alibi", "kerple", "nope", "--json", str(out)])
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kerple"]["failed"] == "RuntimeError: no kernel for this"
    assert "failed" not in rows["nope"] and "failed" not in rows["flash-causal (again)"]
    assert "| kerple | static | failed: RuntimeError: no kernel for this |" in "\n".join(
        gpu_check.kernels_section([json.loads(out.read_text())]))


def test_the_json_is_rewritten_after_every_row(tmp_path, dynamo_config, monkeypatch):
    """A run stopped part-way (make gpu-check's step out of its time) keeps the rows it finished."""
    out = tmp_path / "kernels.json"
    seen = []
    real = gpu_attention.measure

    def measure(*args):
        seen.append(json.loads(out.read_text()) if out.exists() else None)
        return real(*args)

    monkeypatch.setattr(gpu_attention, "measure", measure)
    gpu_attention.main(TINY + ["--lengths", "64", "--methods", "alibi", "nope", "--json", str(out)])
    assert seen[0] is None
    assert [len(s["rows"]) for s in seen[1:]] == list(range(1, len(seen)))
    assert all(s["complete"] is False for s in seen[1:])
    assert json.loads(out.read_text())["complete"] is True


def test_unregistered_methods_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="error: --methods bogus: not registered; allowed: alibi, "):
        gpu_attention.main(TINY + ["--lengths", "64", "--methods", "alibi", "bogus"])


def test_the_diagnostics_change_nothing_but_the_speed():
    """Each diagnostic's call is ALiBi (or, without a score_mod, causal attention): the dense
    reference the benchmark checks it against tells a wrong sign or a missing mask apart."""
    from fairseq_alibi.core.alibi import get_slopes

    q, k, v = gpu_attention.qkv(1, 2, 40, 8, "cpu", torch.float32, grad=False)
    slopes = get_slopes(2)
    alibi = gpu_attention.alibi_reference(q, k, v, slopes)
    assert (alibi - gpu_attention.alibi_reference(q, k, v, -slopes)).abs().max() > 0.1
    assert (alibi - gpu_attention.alibi_reference(q, k, v, slopes, causal_only=True)).abs().max() > 0.1
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    scores = (scores - slopes[:, None, None] * (i - j)).masked_fill(j > i, float("-inf"))
    assert torch.allclose(alibi, scores.softmax(-1) @ v, atol=1e-5)
    assert set(gpu_attention.DIAGNOSTICS) == {"mask-only", "slopes", "slopes-128x64", "slopes-rows-safe",
                                              "slopes-no-mask", "package", "package-score-mod",
                                              "package-block-mask"}


@pytest.mark.slow
def test_the_diagnostics_and_dynamic_shapes_run_compiled_on_the_cpu(tmp_path):
    """Every flex diagnostic compiled (forward only: torch has no CPU backward for it) and checked
    against the dense reference; ALiBi's layer after a reset, with dynamic shapes."""
    out = tmp_path / "kernels.json"
    args = [a for a in TINY if a not in ("--shapes", "static", "--diagnose-lengths", "none")]
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_attention.py"), *args, "--lengths", "64",
                             "--methods", "alibi", "--diagnose-lengths", "128", "--json", str(out)],
                            capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    diagnostics = [r for r in rows if r.get("diagnostic")]
    assert [r["diagnostic"] for r in diagnostics] == list(gpu_attention.DIAGNOSTICS)
    for row in diagnostics:
        assert "failed" not in row, row
        assert row["length"] == 128 and row["ms"] is None and row["fwd_ms"] > 0  # forward only here
        assert row["max_abs_diff"] < 1e-4, row
    assert [r["shapes"] for r in rows if r["path"] == "alibi, dynamic shapes"] == ["dynamic"]


@pytest.mark.slow
def test_eval_cells_are_warmed_at_their_length_for_every_method(tmp_path):
    out = tmp_path / "eval.json"
    methods = ["sinusoidal", *P.POSITIONS]
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "eval_memory.py"), "--lengths", "48",
                             "--methods", *methods, "--repeats", "1", "--timed", "2", "--vocab", "64",
                             "--embed-dim", "16", "--layers", "2", "--heads", "2", "--ffn", "32",
                             "--train-length", "32", "--json", str(out)],
                            capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["config"]["timed"] == 2
    assert [c["method"] for c in sorted(data["cells"], key=lambda c: methods.index(c["method"]))] == methods
    for cell in data["cells"]:
        assert "failed" not in cell, cell
        assert len(cell["times"]) == 2 and cell["seconds"] == pytest.approx(sum(cell["times"]) / 2)
        assert cell["first_s"] > 0 and cell["timed_graphs"] == 0 and cell["finite"]
    section = "\n".join(gpu_check.eval_section([data]))
    assert "the median of 2 forwards" in section
    assert all(f"| 48 | {m} | " in section for m in methods)


@pytest.mark.slow
def test_flex_compile_reaches_flex_through_the_layer(tmp_path):
    """``benchmarks/flex_compile.py`` (make gpu-check's ``compile`` step) on the CPU: ALiBi's layer
    with the flex kernel compiles once per shape class and once per distance method."""
    out = tmp_path / "compile.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "flex_compile.py"), "--lengths", "64", "160",
                             "--methods", "cap", "--heads", "2", "--head-dim", "8", "--batch", "1", "--json", str(out)],
                            capture_output=True, text=True, env=cli_env(FAIRSEQ_ALIBI_CPU_FLEX="1"), cwd=REPO,
                            timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["step"], r["length"]) for r in data["rows"]] == [("none", 64), ("none", 160), ("cap", 160), ("cap", 160)]
    assert [r["new_graphs"] for r in data["rows"]][:3] == [1, 1, 1]
    assert "| none | 64 | 1 |" in "\n".join(gpu_check.compile_section([data]))
