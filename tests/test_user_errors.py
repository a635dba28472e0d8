"""User mistakes by class, across the console scripts and the Python API: one
``error:`` line, a non-zero exit, no traceback, the real cause named; never a
number printed from nothing (zero tokens, NaN), never an input overwritten.

Each test is driven by a table, so a new entry point or option gets the
class's checks by adding a row.
"""

from __future__ import annotations

import os
import shutil
import zipfile

import pytest
import torch

from conftest import error_lines, run_cli, tool

from fairseq_alibi import errors, safe_load


def assert_one_error(result, *expected: str, status: int = 1) -> str:
    """Exit ``status``, exactly one ``error:`` line containing every ``expected`` text, no traceback."""
    lines = error_lines(result)
    assert result.returncode == status, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert len(lines) == 1, result.output[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- numeric flags
NUMERIC_CASES = [
    ("alibi-eval-lm", "--tokens-per-sample", "0", "a positive integer"),
    ("alibi-eval-lm", "--context-window", "-1", "an integer >= 0"),
    ("alibi-train", "--max-tokens", "-5", "a positive integer"),
    ("alibi-train", "--decoder-attention-heads", "0", "a positive integer"),
    ("alibi-generate", "--beam", "0", "a positive integer"),
    ("alibi-preprocess", "--workers", "0", "a positive integer"),
]


@pytest.mark.parametrize("script,flag,value,allowed", NUMERIC_CASES)
def test_impossible_numbers_are_refused_before_fairseq_runs(script, flag, value, allowed, lm_data_bin, tmp_path):
    result = run_cli([tool(script), lm_data_bin, flag, value, "--cpu"], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, f"{flag} {value} is not valid", allowed)


# ------------------------------------------------------------ --model-overrides
OVERRIDE_CASES = [
    ("[1, 2]", "must be a dict"),
    ("{'alibi_interpolation': ntk}", "not a Python dict literal"),
    ("__import__('os').getcwd()", "not a Python dict literal"),
    ("{'alibi_scale_factor': 'x'}", "'alibi_scale_factor': 'x' is not valid; alibi_scale_factor takes a number"),
    ("{'alibi_interpolation': 'ntkk'}", "takes one of 'none', 'linear', 'ntk', 'cap'"),
    ("{'alibi_train_length': 1.5}", "alibi_train_length takes an integer"),
    ("{'alibi_interpolation': 'cap', 'alibi_scale_factor': -1}", "alibi_scale_factor"),
]


@pytest.mark.parametrize("text,expected", OVERRIDE_CASES)
def test_bad_model_overrides_name_the_key(text, expected, alibi_checkpoint, lm_data_bin):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--model-overrides", text], expect_ok=False)
    assert_one_error(result, expected)


@pytest.mark.parametrize("overrides,expected", [
    (dict(alibi_scale_factor="x"), "alibi_scale_factor takes a number"),
    (dict(alibi_attention="fast"), "alibi_attention takes one of"),
])
def test_python_api_checks_override_values_too(overrides, expected, alibi_checkpoint, lm_data_bin):
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    with pytest.raises(errors.ConfigError, match=expected):
        AlibiTransformerLanguageModel.from_pretrained(str(alibi_checkpoint.parent), alibi_checkpoint.name,
                                                      data_name_or_path=str(lm_data_bin), **overrides)


def test_alibi_overrides_on_a_model_without_alibi_warn(sinusoidal_checkpoint, lm_data_bin):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", sinusoidal_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", "32",
                      "--model-overrides", "{'alibi_interpolation': 'ntk'}"])
    assert "alibi_interpolation have no effect" in result.output and "has no ALiBi" in result.output


# ------------------------------------------------- no number from nothing
def damaged(source, directory) -> str:
    """A copy of ``source`` with 400 bytes overwritten inside its largest tensor record."""
    path = str(directory / "damaged.pt")
    shutil.copyfile(source, path)
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 30 + len(info.filename.encode()) + len(info.extra))
        f.seek(info.file_size // 2, os.SEEK_CUR)
        f.write(bytes(range(200)) * 2)
    return path


def with_nan_weight(source, directory) -> str:
    path = str(directory / "nan.pt")
    state = safe_load.load(source)
    name = next(k for k in state["model"] if k.endswith("embed_tokens.weight"))
    state["model"][name] = state["model"][name].clone()
    state["model"][name].view(-1)[0] = float("nan")
    torch.save(state, path)
    return path


@pytest.mark.parametrize("make,expected", [(damaged, "fails its checksum"), (with_nan_weight, "NaN/inf")])
@pytest.mark.parametrize("script", ["alibi-eval-lm", "alibi-sweep", "alibi-export-hf"])
def test_damaged_checkpoints_give_no_number(make, expected, script, alibi_checkpoint, lm_data_bin, tmp_path):
    path = make(alibi_checkpoint, tmp_path)
    args = {
        "alibi-eval-lm": [lm_data_bin, "--path", path, "--cpu", "--gen-subset", "valid"],
        "alibi-sweep": [lm_data_bin, "-c", f"m={path}", "--lengths", "1x", "--methods", "none", "--cpu",
                        "--no-progress", "-o", tmp_path / "sweep"],
        "alibi-export-hf": [path, tmp_path / "hf"],
    }[script]
    result = run_cli([tool(script), *args], expect_ok=False)
    assert_one_error(result, expected)
    assert "Perplexity" not in result.output and "ppl=" not in result.output


def test_the_python_api_refuses_damaged_checkpoints_alike(alibi_checkpoint, tmp_path):
    with pytest.raises(errors.CorruptCheckpointError, match="fails its checksum"):
        safe_load.load(damaged(alibi_checkpoint, tmp_path))
    with pytest.raises(errors.CorruptCheckpointError, match="NaN/inf"):
        safe_load.load(with_nan_weight(alibi_checkpoint, tmp_path))


def test_zero_evaluated_tokens_is_an_error(sinusoidal_checkpoint, lm_data_bin):
    """A sinusoidal model trained at 32 tokens cannot read blocks of 256: fairseq
    scores nothing and would print perplexity 1.00."""
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", sinusoidal_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", "256"], expect_ok=False)
    assert_one_error(result, "no token was evaluated", "32 positions")
    assert "Perplexity" not in result.output


# ------------------------------------------------------------ inputs kept
def test_converter_never_overwrites_its_input(alibi_checkpoint, tmp_path):
    original = tmp_path / "fork.pt"
    shutil.copyfile(alibi_checkpoint, original)
    before = original.read_bytes()
    link = tmp_path / "link.pt"
    link.symlink_to(original)
    for output, expected in [(original, "is the input file"), (link, "is the input file"),
                             (tmp_path, "is a directory")]:
        result = run_cli([tool("alibi-convert-checkpoint"), original, output], expect_ok=False)
        assert_one_error(result, expected)
    assert original.read_bytes() == before
