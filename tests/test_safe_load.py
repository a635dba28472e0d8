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
from conftest import Payload, error_lines, fairseq_config, preprocess, run_cli, tool
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


@pytest.mark.slow
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


# ------------------------------------------------------------- marker buffers
# fairseq's ``_float_tensor`` buffers (AdaptiveInput, AdaptiveSoftmax's tied head,
# the fork's sinusoidal positions) mark a device and dtype and hold whatever the
# memory held: a checkpoint must load whatever they hold, through every loader.
ADAPTIVE = ["--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff", "10,20", "--decoder-layers", "2",
            "--decoder-embed-dim", "24", "--decoder-input-dim", "24", "--decoder-output-dim", "24",
            "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "4", "--dropout", "0"]
MARKED_ARCHS = {  # every architecture whose state dict holds a marker buffer
    "wiki103_alibi": ["--arch", "transformer_lm_wiki103_alibi", *ADAPTIVE],
    "alibi_adaptive_input": ["--arch", "transformer_lm_alibi", "--adaptive-input", *ADAPTIVE],
    "stock_wiki103": ["--arch", "transformer_lm_wiki103", *ADAPTIVE],
}


def _built(data_bin, extra):
    """A fairseq LM built as fairseq-train builds it, with random weights, and its checkpoint dict."""
    from fairseq import tasks

    cfg = fairseq_config([str(data_bin), "--task", "language_modeling", "--tokens-per-sample", "16", "--cpu", *extra])
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    history = [{"criterion_name": "AdaptiveLoss", "optimizer_name": "Adam", "lr_scheduler_state": {},
                "num_updates": 0}]
    return {"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "model": model.state_dict(),
            "args": None, "optimizer_history": history, "extra_state": {}}


def _marked(state, dtype, value=float("nan")):
    """``state`` with its float weights in ``dtype`` and every marker buffer holding ``value``."""
    out = dict(state, model=collections.OrderedDict(state["model"]))
    markers = 0
    for name, tensor in out["model"].items():
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if safe_load.is_marker(name):
            tensor, markers = torch.full_like(tensor, value), markers + 1
        out["model"][name] = tensor
    assert markers, sorted(out["model"])  # not vacuous: the architecture has marker buffers
    return out


def _log_probs(path, data_bin):
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(data_bin)})
    ids = torch.tensor([[2, 5, 9, 4, 12, 7, 6, 8]])
    with torch.no_grad():
        return models[0].eval().get_normalized_probs(models[0](ids), log_probs=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("arch", sorted(MARKED_ARCHS))
def test_a_marker_buffer_holding_nan_or_inf_loads_everywhere(arch, dtype, lm_data_bin, tmp_path):
    """The NaN (fp32) or inf (fp16, as the fork saved) in every marker buffer changes
    nothing: every loader accepts the file and the model computes what the clean file's
    does; a NaN in a real weight is still refused (the check still checks)."""
    from fairseq_alibi.evaluation import perplexity
    from fairseq_alibi.export import main as export_main
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    state = _built(lm_data_bin, MARKED_ARCHS[arch])
    clean, marked = tmp_path / "clean.pt", tmp_path / "marked.pt"
    torch.save(_marked(state, dtype, 0.0), clean)
    torch.save(_marked(state, dtype, float("nan") if dtype == torch.float32 else float("inf")), marked)
    assert not bool(torch.isfinite(torch.load(marked, weights_only=True)["model"]["decoder.embed_tokens._float_tensor"]).all())
    safe_load.load(str(marked))
    assert torch.equal(_log_probs(marked, lm_data_bin), _log_probs(clean, lm_data_bin))
    sweep = [str(lm_data_bin), "-c", f"m={marked}", "--lengths", "16,32", "--methods", "none", "--cpu",
             "--no-progress", "-o"]
    assert perplexity.main(sweep + [str(tmp_path / "sweep")]) == 0
    if arch != "stock_wiki103":
        hub = AlibiTransformerLanguageModel.from_pretrained(str(tmp_path), "marked.pt", data_name_or_path=str(lm_data_bin))
        assert hub.score("the cat sees a tree .")["positional_scores"].isfinite().all()
        assert export_main([str(marked), str(tmp_path / "hf")]) == 0
    weight = dict(state, model=collections.OrderedDict(state["model"]))
    weight["model"]["decoder.layers.0.fc1.weight"] = weight["model"]["decoder.layers.0.fc1.weight"].clone()
    weight["model"]["decoder.layers.0.fc1.weight"].view(-1)[3] = float("nan")
    torch.save(weight, tmp_path / "nan_weight.pt")
    with pytest.raises(CorruptCheckpointError, match="weight decoder.layers.0.fc1.weight holds 1 NaN/inf"):
        safe_load.load(str(tmp_path / "nan_weight.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_fork_checkpoint_with_nan_markers_converts_and_evaluates(dtype, lm_data_bin, tmp_path):
    """The fork's layout (a sinusoidal-position marker besides the adaptive ones), through
    alibi-convert-checkpoint and alibi-eval-lm: the converted model computes what the
    fork file with clean markers converts to."""
    from conftest import fork_layout

    from fairseq_alibi import fork

    state = fork_layout(_built(lm_data_bin, MARKED_ARCHS["wiki103_alibi"]), 16)
    for name, value in (("clean", 0.0), ("marked", float("nan") if dtype == torch.float32 else float("inf"))):
        torch.save(_marked(state, dtype, value), tmp_path / f"fork_{name}.pt")
        assert fork.main([str(tmp_path / f"fork_{name}.pt"), str(tmp_path / f"{name}.pt")]) == 0
    assert torch.equal(_log_probs(tmp_path / "marked.pt", lm_data_bin), _log_probs(tmp_path / "clean.pt", lm_data_bin))
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", tmp_path / "marked.pt", "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", "16"])
    assert "Perplexity" in result.output
