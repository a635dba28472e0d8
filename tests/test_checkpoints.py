"""The ALiBi fork's checkpoint format: detection, conversion, refusal.

Fixtures are built offline: a tiny ALiBi model is trained with this plugin's
``transformer_lm_wiki103_alibi`` (adaptive input/softmax, like the paper's
model), then its file is rewritten the way the fork's own code saved its
models (REFERENCE.md, read from the fork's trainer and checkpoint_utils):
``args: None``; ``cfg`` a *plain dict of resolved values*
(``OmegaConf.to_container(cfg, resolve=True)``), without the sections and
fields fairseq 0.12 added later (``ema``, ``decoder_xformers_att_config``,
``scale_*``); model arch ``transformer_lm_wiki103`` with positions switched on
in the config, ``tokens_per_sample = max_target_positions = L`` and the
fork-only ``max_tokens``; a persistent ``decoder.embed_positions._float_tensor``.
The fork's decoder never added positions and its ``+m*j`` bias is
softmax-equivalent to ours, so the converted file must compute exactly what
the original ALiBi model computed.
"""

import copy
import os
import shutil
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from conftest import (
    FORK_MAX_TOKENS, TRAIN_LENGTH, cli_env, error_lines, fork_layout, parse_eval, recipe_bin, run_cli,
    same_bits, tool,
)
import fairseq_alibi.models  # noqa: F401  (registers the models with fairseq)
from fairseq_alibi import errors, fork, safe_load

MODEL_ARGS = [
    "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-input-dim", "32",
    "--decoder-output-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
]
COMMON_ARGS = [
    "--task", "language_modeling", "--tokens-per-sample", str(TRAIN_LENGTH), "--batch-size", "8",
    "--max-update", "12", "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0",
    "--no-progress-bar", "--seed", "1", "--disable-validation", "--no-epoch-checkpoints",
]
@pytest.fixture(scope="module")
def alibi_ckpt(lm_data_bin, tmp_path_factory):
    """A tiny ALiBi model of the paper's architecture family (adaptive input/softmax)."""
    save = tmp_path_factory.mktemp("alibi_ckpt")
    run_cli([tool("alibi-train"), lm_data_bin, "--arch", "transformer_lm_wiki103_alibi",
             "--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp",
             "--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff", "10,20",
             "--save-dir", save, *MODEL_ARGS, *COMMON_ARGS])
    return str(save / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def stock_ckpt(sinusoidal_checkpoint):
    """A genuine stock sinusoidal transformer_lm checkpoint (fairseq 0.12)."""
    return str(sinusoidal_checkpoint)


def fork_state(alibi_state):
    return fork_layout(alibi_state, TRAIN_LENGTH)


@pytest.fixture(scope="module")
def fork_ckpt(alibi_ckpt, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fork") / "alibi_wt103_L32.pt")
    torch.save(fork_state(safe_load.load(alibi_ckpt)), path)
    return path


@pytest.fixture(scope="module")
def converted_ckpt(fork_ckpt, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("converted") / "converted.pt")
    result = run_cli([tool("alibi-convert-checkpoint"), fork_ckpt, out])
    assert "transformer_lm_wiki103_alibi" in result.stdout
    return out


# ------------------------------------------------------------------ detection


@pytest.mark.slow
def test_fork_fixture_is_the_forks_layout(fork_ckpt):
    """Plain data only (torch's default allowlist reads it), resolved values."""
    assert torch.serialization.get_unsafe_globals_in_checkpoint(fork_ckpt) == []
    state = torch.load(fork_ckpt, weights_only=True)
    assert state["args"] is None and type(state["cfg"]) is dict and "ema" not in state["cfg"]
    model = state["cfg"]["model"]
    assert model["tokens_per_sample"] == model["max_target_positions"] == TRAIN_LENGTH
    assert model["max_tokens"] == FORK_MAX_TOKENS
    assert not [v for v in model.values() if isinstance(v, str) and v.startswith("${")]


@pytest.mark.slow
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
    assert [k for k in original if not same_bits(state["model"][k], original[k])] == []
    assert state["last_optimizer_state"] is not None  # training state kept


def test_missing_training_length_needs_flag(alibi_ckpt):
    state = fork_state(safe_load.load(alibi_ckpt))
    del state["cfg"]["task"]["tokens_per_sample"]
    del state["cfg"]["model"]["tokens_per_sample"]
    with pytest.raises(errors.CheckpointError, match="--train-length"):
        fork.convert_fork_state(state)
    assert fork.convert_fork_state(state, train_length=64)["cfg"]["model"]["alibi_train_length"] == 64


def test_converted_model_computes_what_the_alibi_model_did(converted_ckpt, alibi_ckpt, lm_data_bin):
    from fairseq import checkpoint_utils

    outputs = []
    for path in (alibi_ckpt, converted_ckpt):
        models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": str(lm_data_bin)})
        model = models[0].eval()
        tokens = torch.randint(4, 30, (2, 3 * TRAIN_LENGTH), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outputs.append(model(tokens)[0])
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow
def test_converted_evaluates_longer_than_training(converted_ckpt, alibi_ckpt, lm_data_bin):
    """Scores like the model it came from, at 4x its training length."""
    losses = [
        parse_eval(run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", path, "--cpu",
                            "--gen-subset", "valid", "--tokens-per-sample", 4 * TRAIN_LENGTH]).output).loss
        for path in (converted_ckpt, alibi_ckpt)
    ]
    assert 0 < losses[0] < 10 and losses[0] == losses[1]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("script", ["alibi-eval-lm", "fairseq-eval-lm"])
def test_forks_readme_eval_command_on_a_converted_checkpoint(converted_ckpt, alibi_ckpt, lm_data_bin,
                                                             alibi_user_dir, script):
    """The fork README's evaluation command, verbatim but for the paths and L."""
    length = 2 * TRAIN_LENGTH
    command = [
        tool(script), lm_data_bin, "--path", converted_ckpt, "--sample-break-mode", "none",
        "--gen-subset", "valid", "--max-sentences", "1", "--model-overrides",
        f"{{'max_tokens':{length}, 'tokens_per_sample':{length}, 'max_target_positions':{length}}}",
        "--tokens-per-sample", length, "--max-tokens", length, "--max-target-positions", length,
        "--context-window", "0", "--cpu",
    ]
    if script == "fairseq-eval-lm":
        command += ["--user-dir", alibi_user_dir]
    forked = parse_eval(run_cli(command).output)
    plain = parse_eval(run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_ckpt, "--cpu",
                                "--gen-subset", "valid", "--tokens-per-sample", length]).output)
    assert forked.loss == pytest.approx(plain.loss, abs=1e-4) and forked.tokens == plain.tokens


@pytest.mark.slow
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


def test_converter_replaces_an_existing_output_only_with_force(fork_ckpt, tmp_path, capsys):
    out = tmp_path / "checkpoint_best.pt"
    out.write_bytes(b"someone's model")
    with pytest.raises(SystemExit) as exit_info:
        fork.main([fork_ckpt, str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert f"error: {out} already exists" in err and "--force" in err
    assert out.read_bytes() == b"someone's model"
    assert fork.main([fork_ckpt, str(out), "--force"]) == 0
    assert safe_load.load(str(out))["cfg"]["model"]["_name"] == "transformer_lm_wiki103_alibi"


@pytest.mark.slow
def test_other_model_family_is_refused(stock_ckpt):
    state = copy.deepcopy(safe_load.load(stock_ckpt))
    state["cfg"]["model"]["_name"] = "transformer_iwslt_de_en"
    state["cfg"]["model"]["max_tokens"] = 4096  # even with the fork-only field name
    assert fork.fork_signature(state) is None
    with pytest.raises(errors.CheckpointError, match="model family 'transformer'"):
        fork.convert_fork_state(state)


# ------------------------------------------------------ refusal at load time


@pytest.mark.slow
def test_eval_of_unconverted_fork_checkpoint_is_refused(fork_ckpt, lm_data_bin):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", fork_ckpt, "--cpu",
                      "--gen-subset", "valid"], expect_ok=False)
    assert result.returncode == 1
    lines = error_lines(result)
    assert len(lines) == 1 and "alibi-convert-checkpoint" in lines[0], result.output[-2000:]
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_stock_cli_with_user_dir_refuses_fork_checkpoint(fork_ckpt, lm_data_bin, alibi_user_dir):
    result = run_cli([tool("fairseq-eval-lm"), lm_data_bin, "--path", fork_ckpt, "--cpu",
                      "--gen-subset", "valid", "--user-dir", alibi_user_dir], expect_ok=False)
    assert result.returncode != 0
    assert "ForkCheckpointError" in result.output and "alibi-convert-checkpoint" in result.output


@pytest.mark.slow
def test_stock_sinusoidal_checkpoint_still_evaluates(stock_ckpt, lm_data_bin):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", stock_ckpt, "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", TRAIN_LENGTH])
    assert 0 < parse_eval(result.output).loss < 10


@pytest.mark.slow
def test_eval_of_another_model_family_is_one_line(stock_ckpt, lm_data_bin, tmp_path):
    state = copy.deepcopy(safe_load.load(stock_ckpt))
    state["cfg"]["model"]["_name"] = "roberta_base"
    path = str(tmp_path / "roberta.pt")
    torch.save(state, path)
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", path, "--cpu", "--gen-subset", "valid"],
                     expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.output
    lines = error_lines(result)
    assert len(lines) == 1 and "model family 'roberta'" in lines[0], result.output[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("curl") or shutil.which("wget")), reason="needs curl or wget")
def test_download_script(fork_ckpt, tmp_path):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "download.sh")
    env = cli_env()
    env["PATH"] = recipe_bin() + os.pathsep + env.get("PATH", "")  # its alibi-convert-checkpoint: a fork
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
    again = subprocess.run([script, "64", str(tmp_path / "dest")], capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "already downloaded" in again.stdout, again.stderr[-2000:]
