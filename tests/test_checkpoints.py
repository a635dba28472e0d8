"""The ALiBi fork's checkpoint format: detection, conversion, refusal.

Fixtures are built offline: a tiny ALiBi model is trained with this plugin's
``transformer_lm_wiki103_alibi`` (adaptive input/softmax, like the paper's
model), then its file is rewritten into the fork's layout with the fork's
quirks: ``args: None``; ``cfg`` a pickled OmegaConf DictConfig; model arch
``transformer_lm_wiki103`` with positions switched on in the config;
``tokens_per_sample`` etc. as unresolved ``${task.*}`` strings; the fork-only
``max_tokens`` field; a persistent ``decoder.embed_positions._float_tensor``.
The fork's decoder never added positions and its ``+m*j`` bias is
softmax-equivalent to ours, so the converted file must compute exactly what
the original ALiBi model computed.
"""

import collections
import copy
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from fairseq_alibi import errors, fork, safe_load

BIN = os.path.dirname(sys.executable)
TRAIN_LENGTH = 32
MODEL_ARGS = [
    "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-input-dim", "32",
    "--decoder-output-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
]
COMMON_ARGS = [
    "--task", "language_modeling", "--tokens-per-sample", str(TRAIN_LENGTH), "--batch-size", "8",
    "--max-update", "12", "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0",
    "--no-progress-bar", "--seed", "1", "--disable-validation", "--no-epoch-checkpoints",
]


def _tool(name):
    return os.path.join(BIN, name)


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("FAIRSEQ_ALIBI_TRACEBACK", None)
    return env


def _run(cmd, ok=True):
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_data")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    for split, lines in (("train", 200), ("valid", 40)):
        with open(root / f"{split}.txt", "w") as handle:
            for _ in range(lines):
                handle.write(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "\n")
    dest = root / "bin"
    _run([_tool("alibi-preprocess"), "--only-source", "--trainpref", str(root / "train.txt"),
          "--validpref", str(root / "valid.txt"), "--destdir", str(dest), "--workers", "1"])
    return str(dest)


@pytest.fixture(scope="module")
def alibi_ckpt(data_bin, tmp_path_factory):
    """A tiny ALiBi model of the paper's architecture family (adaptive input/softmax)."""
    save = tmp_path_factory.mktemp("alibi_ckpt")
    _run([_tool("alibi-train"), data_bin, "--arch", "transformer_lm_wiki103_alibi",
          "--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp",
          "--adaptive-input-cutoff", "20,40", "--adaptive-softmax-cutoff", "20,40",
          "--save-dir", str(save)] + MODEL_ARGS + COMMON_ARGS)
    return str(save / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def stock_ckpt(data_bin, tmp_path_factory):
    """A genuine stock sinusoidal transformer_lm checkpoint (fairseq 0.12)."""
    save = tmp_path_factory.mktemp("stock_ckpt")
    _run([_tool("alibi-train"), data_bin, "--arch", "transformer_lm", "--save-dir", str(save)]
         + MODEL_ARGS + COMMON_ARGS)
    return str(save / "checkpoint_last.pt")


def fork_state(alibi_state, dictconfig=True):
    """``alibi_state`` rewritten the way the fork saved its models."""
    state = copy.deepcopy(alibi_state)
    cfg = state["cfg"]
    model = cfg["model"]
    assert model["_name"] == "transformer_lm_wiki103_alibi"
    for name in [k for k in model if k.startswith("alibi_")]:
        del model[name]
    model["_name"] = "transformer_lm_wiki103"
    model["no_token_positional_embeddings"] = False
    model["tokens_per_sample"] = "${task.tokens_per_sample}"
    model["max_target_positions"] = "${task.max_target_positions}"
    model["add_bos_token"] = "${task.add_bos_token}"
    model["tpu"] = "${common.tpu}"
    model["max_tokens"] = "${task.max_tokens}"  # as in the fork (dangles: no task.max_tokens)
    weights = collections.OrderedDict(state["model"])
    weights["decoder.embed_positions._float_tensor"] = torch.FloatTensor(1).zero_()
    state["model"] = weights
    state["args"] = None
    state["cfg"] = OmegaConf.create(cfg) if dictconfig else cfg
    return state


@pytest.fixture(scope="module")
def fork_ckpt(alibi_ckpt, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fork") / "alibi_wt103_L32.pt")
    torch.save(fork_state(safe_load.load(alibi_ckpt)), path)
    return path


@pytest.fixture(scope="module")
def converted_ckpt(fork_ckpt, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("converted") / "converted.pt")
    result = _run([_tool("alibi-convert-checkpoint"), fork_ckpt, out])
    assert "transformer_lm_wiki103_alibi" in result.stdout
    return out


def _loss(result):
    match = re.search(r"Loss \(base 2\): ([0-9.]+)", result.stdout + result.stderr)
    assert match, result.stderr[-2000:]
    return float(match.group(1))


# ------------------------------------------------------------------ detection


def test_fork_fixture_needs_the_omegaconf_allowlist(fork_ckpt):
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(fork_ckpt)
    assert "omegaconf.dictconfig.DictConfig" in unsafe
    assert isinstance(safe_load.load(fork_ckpt)["cfg"], type(OmegaConf.create({})))


def test_signature_fork_vs_genuine_checkpoints(fork_ckpt, alibi_ckpt, stock_ckpt):
    assert "max_tokens" in fork.fork_signature(safe_load.load(fork_ckpt))
    assert fork.fork_signature(safe_load.load(alibi_ckpt)) is None
    stock = safe_load.load(stock_ckpt)
    assert fork.fork_signature(stock) is None
    # what upstream fairseq <= 0.12.2 writes for the same stock model: the same
    # position buffer as the fork, and a DictConfig cfg; still not the fork
    upstream = copy.deepcopy(stock)
    upstream["model"]["decoder.embed_positions._float_tensor"] = torch.FloatTensor(1)
    upstream["cfg"] = OmegaConf.create(upstream["cfg"])
    assert fork.fork_signature(upstream) is None
    # a pre-hydra checkpoint whose args carry max_tokens (all options were saved)
    legacy = {"args": __import__("argparse").Namespace(arch="transformer_lm", max_tokens=1024),
              "model": {}}
    assert fork.fork_signature(legacy) is None


# ----------------------------------------------------------------- conversion


def test_converted_format(converted_ckpt, alibi_ckpt):
    # a converted file needs nothing beyond torch's own safe types
    assert torch.serialization.get_unsafe_globals_in_checkpoint(converted_ckpt) == []
    state = torch.load(converted_ckpt, weights_only=True)
    model = state["cfg"]["model"]
    assert state["args"] is None
    assert model["_name"] == "transformer_lm_wiki103_alibi"
    assert model["alibi_train_length"] == TRAIN_LENGTH
    assert model["tokens_per_sample"] == TRAIN_LENGTH  # ${task.tokens_per_sample} resolved
    assert model["no_token_positional_embeddings"] is True
    assert "max_tokens" not in model
    assert not [k for k in state["model"] if "embed_positions" in k]
    original = safe_load.load(alibi_ckpt)["model"]
    assert state["model"].keys() == original.keys()
    assert all(torch.equal(state["model"][k], original[k]) for k in original)
    assert state["last_optimizer_state"] is not None  # training state kept


def test_plain_dict_cfg_variant_converts(alibi_ckpt):
    """The fork's cfg as a plain dict with ``${...}`` strings converts the same way."""
    state = fork_state(safe_load.load(alibi_ckpt), dictconfig=False)
    out = fork.convert_fork_state(state)
    assert out["cfg"]["model"]["alibi_train_length"] == TRAIN_LENGTH
    assert out["cfg"]["model"]["_name"] == "transformer_lm_wiki103_alibi"


def test_missing_training_length_needs_flag(alibi_ckpt):
    state = fork_state(safe_load.load(alibi_ckpt), dictconfig=False)
    del state["cfg"]["task"]["tokens_per_sample"]
    with pytest.raises(errors.CheckpointError, match="--train-length"):
        fork.convert_fork_state(state)
    assert fork.convert_fork_state(state, train_length=64)["cfg"]["model"]["alibi_train_length"] == 64


def test_converted_model_computes_what_the_alibi_model_did(converted_ckpt, alibi_ckpt, data_bin):
    from fairseq import checkpoint_utils

    outputs = []
    for path in (alibi_ckpt, converted_ckpt):
        models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data_bin})
        model = models[0].eval()
        tokens = torch.randint(4, 60, (2, 3 * TRAIN_LENGTH), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outputs.append(model(tokens)[0])
    assert torch.equal(outputs[0], outputs[1])


def test_converted_evaluates_longer_than_training(converted_ckpt, data_bin):
    result = _run([_tool("alibi-eval-lm"), data_bin, "--path", converted_ckpt, "--cpu",
                   "--gen-subset", "valid", "--tokens-per-sample", str(4 * TRAIN_LENGTH)])
    assert 0 < _loss(result) < 10


def test_converter_refusals(stock_ckpt, alibi_ckpt, converted_ckpt, tmp_path, capsys):
    out = str(tmp_path / "out.pt")
    for path, expected in [
        (stock_ckpt, "stock fairseq transformer_lm checkpoint"),
        (alibi_ckpt, "already a transformer_lm_alibi checkpoint"),
        (converted_ckpt, "already a transformer_lm_alibi checkpoint"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            fork.main([path, out])
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1
    assert not os.path.exists(out)


def test_other_model_family_is_refused(stock_ckpt):
    state = copy.deepcopy(safe_load.load(stock_ckpt))
    state["cfg"]["model"]["_name"] = "transformer_iwslt_de_en"
    state["cfg"]["model"]["max_tokens"] = 4096  # even with the fork-only field name
    assert fork.fork_signature(state) is None
    with pytest.raises(errors.CheckpointError, match="model family 'transformer'"):
        fork.convert_fork_state(state)


# ------------------------------------------------------ refusal at load time


def test_eval_of_unconverted_fork_checkpoint_is_refused(fork_ckpt, data_bin):
    result = _run([_tool("alibi-eval-lm"), data_bin, "--path", fork_ckpt, "--cpu",
                   "--gen-subset", "valid"], ok=False)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "alibi-convert-checkpoint" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_stock_cli_with_user_dir_refuses_fork_checkpoint(fork_ckpt, data_bin):
    user_dir = _run([_tool("alibi-user-dir")]).stdout.strip()
    result = _run([_tool("fairseq-eval-lm"), data_bin, "--path", fork_ckpt, "--cpu",
                   "--gen-subset", "valid", "--user-dir", user_dir], ok=False)
    assert result.returncode != 0
    assert "ForkCheckpointError" in result.stderr and "alibi-convert-checkpoint" in result.stderr


def test_stock_sinusoidal_checkpoint_still_evaluates(stock_ckpt, data_bin):
    result = _run([_tool("alibi-eval-lm"), data_bin, "--path", stock_ckpt, "--cpu",
                   "--gen-subset", "valid", "--tokens-per-sample", str(TRAIN_LENGTH)])
    assert 0 < _loss(result) < 10


def test_eval_of_another_model_family_is_one_line(stock_ckpt, data_bin, tmp_path):
    state = copy.deepcopy(safe_load.load(stock_ckpt))
    state["cfg"]["model"]["_name"] = "roberta_base"
    path = str(tmp_path / "roberta.pt")
    torch.save(state, path)
    result = _run([_tool("alibi-eval-lm"), data_bin, "--path", path, "--cpu", "--gen-subset", "valid"], ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model family 'roberta'" in errors[0], result.stderr[-2000:]


@pytest.mark.skipif(not (shutil.which("curl") or shutil.which("wget")), reason="needs curl or wget")
def test_download_script(fork_ckpt, tmp_path):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "download.sh")
    env = _env()
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    bad = subprocess.run([script, "100"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "no published model for training length '100'" in bad.stderr
    env["ALIBI_CHECKPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens there: as if offline
    offline = subprocess.run([script, "64", str(tmp_path / "offline")], capture_output=True, text=True, env=env)
    assert offline.returncode == 1 and "download.sh: error: could not download" in offline.stderr
    assert not list((tmp_path / "offline").iterdir())
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shutil.copy(fork_ckpt, mirror / "alibi_wt103_L64.pt")
    env["ALIBI_CHECKPOINT_URL"] = f"file://{mirror}"
    ok = subprocess.run([script, "64", str(tmp_path / "dest")], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    converted = torch.load(tmp_path / "dest" / "alibi_wt103_L64.pt", weights_only=True)
    assert converted["cfg"]["model"]["_name"] == "transformer_lm_wiki103_alibi"
    assert (tmp_path / "dest" / "alibi_wt103_L64.fork.pt").exists()
