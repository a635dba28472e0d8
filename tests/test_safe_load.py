"""Allowlisted unpickling on every load path, and clear errors for bad files.

The hostile file is a checkpoint-shaped dict one of whose values unpickles by
calling ``open(MARKER, "w")``: if any load path ran it, the marker would exist.
Resuming from a real ``checkpoint_last.pt`` (Adam state, meters, iterator
position) through the patched loader is exercised in tests/test_resume.py.
"""

import argparse
import collections
import io
import os
import zipfile

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from conftest import Payload, error_lines, preprocess, run_cli, tool
from fairseq_alibi import errors, safe_load
from fairseq_alibi.safe_load import CorruptCheckpointError, UnsafeCheckpointError

MODEL_ARGS = [
    "--arch", "transformer_lm_alibi", "--decoder-layers", "2", "--decoder-embed-dim", "32",
    "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
]


def _hostile_checkpoint(path, marker):
    state = {
        "args": None,
        "cfg": {"model": {"_name": "transformer_lm_alibi"}},
        "model": collections.OrderedDict(w=torch.zeros(2)),
        "extra_state": Payload(marker),
    }
    torch.save(state, path)
    return path


@pytest.fixture()
def hostile(tmp_path):
    marker = str(tmp_path / "MARKER")
    path = _hostile_checkpoint(str(tmp_path / "hostile.pt"), marker)
    return path, marker


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run: Adam, an LR schedule, validation, mid-epoch checkpoints."""
    root = tmp_path_factory.mktemp("safe_load_run")
    with open(root / "train.txt", "w") as handle:
        for i in range(120):
            handle.write(" ".join(f"w{(i * 7 + j) % 50}" for j in range(12)) + "\n")
    (root / "valid.txt").write_text((root / "train.txt").read_text())
    preprocess(root, root / "bin", splits=("train", "valid"))
    run_cli([
        tool("alibi-train"), root / "bin", "--task", "language_modeling",
        "--tokens-per-sample", "32", "--batch-size", "8", "--optimizer", "adam", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "2", "--max-update", "6",
        "--save-interval-updates", "3", "--cpu", "--num-workers", "0", "--no-progress-bar",
        "--save-dir", root / "ckpt", *MODEL_ARGS,
    ])
    return str(root / "bin"), str(root / "ckpt" / "checkpoint_last.pt")


# ------------------------------------------------------------- the allowlist


def test_allowlist_is_exactly_the_documented_types():
    assert sorted(safe_load.allowed_global_names()) == sorted([
        "omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
        "omegaconf.base.ContainerMetadata", "omegaconf.base.Metadata", "omegaconf.nodes.AnyNode",
        "typing.Any", "builtins.dict", "builtins.list", "builtins.int",
        "collections.defaultdict", "argparse.Namespace",
    ])


def test_real_checkpoint_last_needs_nothing_extra(trained):
    _, last = trained
    assert torch.serialization.get_unsafe_globals_in_checkpoint(last) == []
    state = safe_load.load(last)
    assert state["last_optimizer_state"]["state"]  # Adam moments
    assert "iterations_in_epoch" in state["extra_state"]["train_iterator"]
    assert "metrics" in state["extra_state"]
    from fairseq import checkpoint_utils

    assert checkpoint_utils.load_checkpoint_to_cpu(last)["optimizer_history"][-1]["num_updates"] == 6


def test_fork_era_and_pre_hydra_configs_load(tmp_path):
    cfg = OmegaConf.create({"task": {"tokens_per_sample": 512}, "model": {
        "_name": "transformer_lm_wiki103", "tokens_per_sample": "${task.tokens_per_sample}",
        "cutoffs": [20000, 60000]}})
    OmegaConf.set_struct(cfg, True)
    path = str(tmp_path / "cfg.pt")
    torch.save({"args": argparse.Namespace(arch="transformer_lm", lr=[0.1]), "cfg": cfg, "model": {}}, path)
    state = safe_load.load(path)
    assert state["cfg"].model.tokens_per_sample == 512
    assert state["args"].arch == "transformer_lm"


def test_numpy_scalars_are_not_allowed(tmp_path):
    path = str(tmp_path / "np.pt")
    torch.save({"model": {}, "val_loss": np.float64(1.5)}, path)
    with pytest.raises(UnsafeCheckpointError, match="numpy"):
        safe_load.load(path)


# --------------------------------------------------------- hostile payloads


def test_payload_is_live_when_unrestricted(tmp_path):
    """Sanity: the payload does create the marker under plain unpickling."""
    marker = str(tmp_path / "LIVE")
    path = _hostile_checkpoint(str(tmp_path / "live.pt"), marker)
    torch.load(path, weights_only=False)
    assert os.path.exists(marker)


def test_safe_load_refuses_payload(hostile, monkeypatch):
    path, marker = hostile
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # cannot weaken it
    with pytest.raises(UnsafeCheckpointError, match="io.open|builtins.open"):
        safe_load.load(path)
    with pytest.raises(UnsafeCheckpointError):
        safe_load.load(open(path, "rb"))
    assert not os.path.exists(marker)


def test_fairseq_loader_and_hub_refuse_payload(hostile):
    from fairseq import checkpoint_utils
    from fairseq.models.transformer_lm import TransformerLanguageModel

    path, marker = hostile
    with pytest.raises(UnsafeCheckpointError):
        checkpoint_utils.load_checkpoint_to_cpu(path)
    with pytest.raises(UnsafeCheckpointError):
        checkpoint_utils.load_model_ensemble_and_task([path])
    with pytest.raises(UnsafeCheckpointError):
        # even if the caller asks for an unrestricted load
        checkpoint_utils.torch.load(path, weights_only=False)
    with pytest.raises(UnsafeCheckpointError):
        TransformerLanguageModel.from_pretrained(os.path.dirname(path), os.path.basename(path))
    assert not os.path.exists(marker)


def _one_error_line(result):
    assert result.returncode == 1, result.output[-2000:]
    assert "Traceback" not in result.output
    lines = error_lines(result)
    assert len(lines) == 1, result.output[-2000:]
    return lines[0]


def test_console_scripts_refuse_payload(hostile, trained, tmp_path):
    path, marker = hostile
    data_bin, _ = trained
    line = _one_error_line(run_cli(
        [tool("alibi-convert-checkpoint"), path, tmp_path / "out.pt"], expect_ok=False))
    assert "refusing to load" in line and "open" in line
    line = _one_error_line(run_cli([tool("alibi-eval-lm"), data_bin, "--path", path, "--cpu"], expect_ok=False))
    assert "refusing to load" in line
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "out.pt")


# ------------------------------------------------------------- broken files


def _broken_files(tmp_path, real):
    data = open(real, "rb").read()
    files = {}
    for name, content in [
        ("truncated.pt", data[: len(data) // 2]),
        ("empty.pt", b""),
        ("text.pt", b"this is not a checkpoint\n"),
        ("legacy-truncated.pt", data[:0] + b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"),
    ]:
        files[name] = tmp_path / name
        files[name].write_bytes(content)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("readme.txt", "a zip, but not a torch checkpoint")
    files["other.zip"] = tmp_path / "other.zip"
    files["other.zip"].write_bytes(buf.getvalue())
    files["missing.pt"] = tmp_path / "missing.pt"
    files["directory"] = tmp_path
    return files


def test_broken_files_are_reported_not_crashed(trained, tmp_path):
    _, last = trained
    for name, path in _broken_files(tmp_path, last).items():
        with pytest.raises(CorruptCheckpointError) as info:
            safe_load.load(str(path))
        message = str(info.value)
        assert str(path) in message and "\n" not in message, (name, message)


def test_eval_of_truncated_checkpoint_is_one_line(trained, tmp_path):
    data_bin, last = trained
    truncated = tmp_path / "checkpoint_last.pt"
    truncated.write_bytes(open(last, "rb").read()[:20000])
    line = _one_error_line(run_cli([tool("alibi-eval-lm"), data_bin, "--path", truncated, "--cpu"],
                                   expect_ok=False))
    assert "not a readable PyTorch checkpoint" in line


def test_describe_error_leaves_bugs_alone():
    assert errors.describe(ZeroDivisionError("x")) is None
    assert errors.describe(FileNotFoundError(2, "No such file", "data/dict.txt")).startswith(
        "dictionary not found: data/dict.txt")
