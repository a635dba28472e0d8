"""End to end: the real command-line tools, run as subprocesses, with the plugin.

Stock fairseq scripts with ``--user-dir "$(alibi-user-dir)"`` and the ``alibi-*``
console scripts: training (single process, hydra, torchrun data-parallel),
evaluation at 8x the training length (nonoverlapping, sliding window, every
interpolation override), generation, the hub interface, and build-time errors
for bad configuration values.  The model is the session fixture from
conftest.py: 6 heads, trained at 32 tokens.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from conftest import (
    BIN, HEADS, SPLIT_LINES, TRAIN_LENGTH, EvalResult, cli_env, error_lines, parse_eval, recipe_bin, run_cli, tool,
    train_args,
)
from fairseq_alibi.core.errors import ConfigError
from fairseq_alibi.core.scaling import METHODS
from fairseq_alibi.core.positions import POSITIONS

EVAL_LENGTH = 8 * TRAIN_LENGTH  # 256


def load_state(path) -> dict:
    return torch.load(str(path), map_location="cpu", weights_only=True)


def assert_alibi_checkpoint(path) -> dict:
    state = load_state(path)
    keys = list(state["model"])
    assert keys, "empty state dict"
    assert not [k for k in keys if "embed_positions" in k], keys
    assert any(k.endswith("self_attn.k_proj.weight") for k in keys)  # stock parameter names
    model_cfg = state["cfg"]["model"]
    assert model_cfg["_name"] == "transformer_lm_alibi"
    assert model_cfg["alibi_train_length"] == TRAIN_LENGTH
    assert model_cfg["decoder_attention_heads"] == HEADS
    assert model_cfg["decoder_input_dim"] == model_cfg["decoder_embed_dim"]
    return state


def num_updates(state) -> int:
    return state["optimizer_history"][-1]["num_updates"]


# --------------------------------------------------------------------------- training


def test_fairseq_train_with_user_dir(alibi_train_run, alibi_checkpoint):
    """The session fixture is itself stock fairseq-train --user-dir."""
    _, result = alibi_train_run
    assert "done training" in result.output
    state = assert_alibi_checkpoint(alibi_checkpoint)
    assert num_updates(state) > 0
    # The 6 heads are real: q_proj maps 48 -> 48 = 6 heads x 8.
    assert state["model"]["decoder.layers.0.self_attn.q_proj.weight"].shape == (48, 48)


@pytest.mark.slow
def test_alibi_train_console_script(lm_data_bin, alibi_checkpoint, tmp_path):
    result = run_cli([tool("alibi-train"), *train_args(lm_data_bin, tmp_path, max_update=4)])
    assert "done training" in result.output
    state = assert_alibi_checkpoint(tmp_path / "checkpoint_best.pt")
    assert num_updates(state) == 4
    reference = load_state(alibi_checkpoint)["model"]
    assert {k: v.shape for k, v in state["model"].items()} == {
        k: v.shape for k, v in reference.items()
    }


#: Methods whose layers compute their attention themselves, trained through each stock entry point.
OWN_ATTENTION = {"stickbreaking": ("alibi-train", ()),
                 "path": ("fairseq-train", ("--path-forget-gate", "1"))}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(OWN_ATTENTION))
def test_a_method_with_its_own_attention_trains_evaluates_and_refuses_dropout(method, lm_data_bin, alibi_user_dir,
                                                                               tmp_path):
    """Stick-breaking through alibi-train, PaTH-FoX through stock fairseq-train --user-dir:
    a few updates, a checkpoint holding the layers' own parameters, then alibi-eval-lm at
    8x L; attention dropout refused in one line where the model is built (by alibi-train;
    stock fairseq-train prints the same ConfigError in its traceback)."""
    script, flags = OWN_ATTENTION[method]
    args = train_args(lm_data_bin, tmp_path, max_update=6)
    args[args.index("--arch") + 1] = f"transformer_lm_{method}"
    extra = [*flags, "--user-dir", alibi_user_dir] if script == "fairseq-train" else list(flags)
    result = run_cli([tool(script), *args, *extra])
    assert "done training" in result.output
    state = load_state(tmp_path / "checkpoint_best.pt")
    assert num_updates(state) == 6 and state["cfg"]["model"]["_name"] == f"transformer_lm_{method}"
    own = [k for k in state["model"] if f".self_attn.{method}." in k]
    assert own and all(torch.isfinite(state["model"][k]).all() for k in own)
    scored = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", tmp_path / "checkpoint_best.pt", "--cpu",
                      "--gen-subset", "valid", "--tokens-per-sample", str(EVAL_LENGTH)])
    assert math.isfinite(parse_eval(scored.output).loss), scored.output[-2000:]
    fresh = train_args(lm_data_bin, tmp_path / "dropout", max_update=6)  # a save directory not yet trained
    fresh[fresh.index("--arch") + 1] = f"transformer_lm_{method}"
    refused = run_cli([tool("alibi-train"), *fresh, *flags, "--attention-dropout", "0.1"], expect_ok=False)
    assert refused.returncode == 1 and error_lines(refused) == [
        "error: attention_dropout=0.1 is not valid with this position method, whose attention runs its own kernel, "
        "which has no attention dropout: set --attention-dropout 0 (attention_dropout=0)"]


# --------------------------------------------------------------------------- eval-lm

def linear(factor):
    return {"alibi_interpolation": "linear", "alibi_scale_factor": factor}


def ntk(factor):
    return {"alibi_interpolation": "ntk", "alibi_scale_factor": factor}


def chunked_test_length() -> int:
    from fairseq_alibi.core import kernels

    return 2 * kernels.CHUNK_SIZE


@dataclass(frozen=True)
class Eval:
    """One eval-lm run on the valid split."""

    tokens_per_sample: int
    overrides: Optional[dict] = None
    context_window: int = 0
    script: str = "fairseq-eval-lm"
    batch: tuple = ("--max-tokens", "2048")  # several blocks per batch

    def __hash__(self):
        return hash(repr(self))


def eval_runs():
    """Every eval-lm run the tests below need; they start together (two at a
    time) the first time one is asked for, and each test waits for its own."""
    long, short = EVAL_LENGTH, TRAIN_LENGTH
    runs = [
        Eval(long),
        Eval(long, linear(1), script="alibi-eval-lm"),
        Eval(long, batch=("--batch-size", "1")),
        Eval(short),
        Eval(short, context_window=24),
        Eval(long, linear(2)),
        Eval(long, ntk(2)),
        Eval(short, linear(0)),
        Eval(long, linear(0)),
        Eval(long, linear(0), batch=("--batch-size", "1")),
        Eval(long, linear(8)),
        Eval(long, ntk(0)),
    ]
    runs += [
        Eval(chunked_test_length(), {**linear(0), "alibi_attention": path}, batch=("--batch-size", "1"))
        for path in ("reference", "chunked")
    ]
    return runs


@pytest.fixture(scope="session")
def eval_lm(lm_data_bin, alibi_checkpoint, alibi_user_dir):
    def run(spec: Eval) -> EvalResult:
        args = [
            tool(spec.script), lm_data_bin, "--path", alibi_checkpoint, "--cpu",
            "--gen-subset", "valid", "--tokens-per-sample", str(spec.tokens_per_sample),
            "--sample-break-mode", "none", "--num-workers", "0", *spec.batch,
        ]
        if spec.script.startswith("fairseq-"):
            args += ["--user-dir", alibi_user_dir]
        if spec.context_window:
            args += ["--context-window", str(spec.context_window)]
        if spec.overrides is not None:
            args += ["--model-overrides", repr(spec.overrides)]
        return parse_eval(run_cli(args).output)

    pool = ThreadPoolExecutor(max_workers=2)
    futures = {spec: pool.submit(run, spec) for spec in eval_runs()}

    def get(*args, **kwargs) -> EvalResult:
        spec = Eval(*args, **kwargs)
        result = (futures[spec] if spec in futures else pool.submit(run, spec)).result()
        assert math.isfinite(result.loss) and math.isfinite(result.ppl), result
        assert result.ppl == pytest.approx(2**result.loss, rel=5e-3)
        return result

    yield get
    pool.shutdown(cancel_futures=True)


def test_eval_8x_training_length_without_overrides(eval_lm):
    """Nonoverlapping at 8x the training length, several blocks per batch, no
    --model-overrides: finite, every valid token scored, and ALiBi
    extrapolates (no blow-up against evaluation at the training length)."""
    long = eval_lm(EVAL_LENGTH)
    short = eval_lm(TRAIN_LENGTH)
    assert long.tokens == short.tokens > 4 * EVAL_LENGTH  # >= 5 blocks in one 2048-token batch
    assert long.loss < short.loss + 0.05, (long, short)
    assert long.loss < 2.5  # far below uniform over the vocabulary (log2 ~ 5)


@pytest.mark.parametrize("times", [1, 16])
@pytest.mark.slow
def test_fast_kernels_print_the_reference_perplexity(eval_lm, times):
    """End to end at 1x and 16x L: the long-evaluation kernel (chunked, with its
    key windows: 512 tokens are two chunks) and the training kernel (blocked)
    print the reference kernel's perplexity to the printed digits (auto's
    choice between them is tested in test_attention)."""
    length = times * TRAIN_LENGTH
    reference = eval_lm(length, {"alibi_attention": "reference"})
    for kernel in ("chunked", "blocked"):
        result = eval_lm(length, {"alibi_attention": kernel})
        assert (result.ppl, result.tokens) == (reference.ppl, reference.tokens), kernel
        assert result.loss == pytest.approx(reference.loss, abs=1e-4), kernel


def test_none_equals_linear_factor_one_and_scripts_agree(eval_lm):
    """alibi-eval-lm with linear factor 1 reports exactly what stock
    fairseq-eval-lm --user-dir reports with no override."""
    assert eval_lm(EVAL_LENGTH, linear(1), script="alibi-eval-lm").text == eval_lm(EVAL_LENGTH).text


def test_padding_in_a_batch_changes_nothing(eval_lm):
    """The last, short block padded into a batch of several scores exactly as
    it does alone."""
    assert eval_lm(EVAL_LENGTH, batch=("--batch-size", "1")).text == eval_lm(EVAL_LENGTH).text


def test_sliding_window_scores_every_token_once_with_more_context(eval_lm):
    nonoverlapping = eval_lm(TRAIN_LENGTH)
    sliding = eval_lm(TRAIN_LENGTH, context_window=24)
    assert sliding.tokens == nonoverlapping.tokens
    # Clause subjects repeat within a line: context before each block helps.
    assert sliding.loss < nonoverlapping.loss, (sliding, nonoverlapping)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("method", [linear, ntk])
def test_static_factor_changes_the_loss(eval_lm, method):
    plain = eval_lm(EVAL_LENGTH)
    scaled = eval_lm(EVAL_LENGTH, method(2))
    assert scaled.loss != plain.loss, (scaled, plain)


def test_ntk_and_linear_differ(eval_lm):
    """NTK keeps the steepest head, linear does not: different slopes, different loss."""
    assert eval_lm(EVAL_LENGTH, ntk(2)).loss != eval_lm(EVAL_LENGTH, linear(2)).loss


def test_dynamic_scaling_is_a_no_op_at_training_length(eval_lm):
    assert eval_lm(TRAIN_LENGTH, linear(0)).text == eval_lm(TRAIN_LENGTH).text


@pytest.mark.slow
def test_dynamic_scaling_takes_each_rows_own_length(eval_lm):
    """Dynamic factor = a row's own keys / alibi_train_length, the train length
    read from the checkpoint (32), not from eval's --tokens-per-sample (256): a
    batch scores as its rows one at a time (the last, shorter block with a
    factor of its own, not the padded batch's 8)."""
    dynamic = eval_lm(EVAL_LENGTH, linear(0))
    assert dynamic.text == eval_lm(EVAL_LENGTH, linear(0), batch=("--batch-size", "1")).text
    assert dynamic.loss != eval_lm(EVAL_LENGTH).loss
    assert dynamic.loss != eval_lm(EVAL_LENGTH, linear(8)).loss


@pytest.mark.slow
def test_ntk_dynamic_at_8x_changes_the_loss(eval_lm):
    ntk_dynamic = eval_lm(EVAL_LENGTH, ntk(0))
    assert ntk_dynamic.loss not in (eval_lm(EVAL_LENGTH).loss, eval_lm(EVAL_LENGTH, linear(0)).loss)


@pytest.mark.slow
def test_dynamic_scaling_same_on_chunked_attention_path(eval_lm):
    """Past the chunked path's block size, dynamic slopes must still be those of
    the whole sequence (not of each query block's visible keys)."""
    results = {
        path: eval_lm(chunked_test_length(), {**linear(0), "alibi_attention": path},
                      batch=("--batch-size", "1"))
        for path in ("reference", "chunked")
    }
    assert results["chunked"].text == results["reference"].text, results


# --------------------------------------------------------------------------- generation


DYNAMIC_NTK = ["--model-overrides", "{'alibi_interpolation': 'ntk', 'alibi_scale_factor': 0}"]


@pytest.mark.parametrize("extra,warned", [
    ([], 0),
    (["--required-batch-size-multiple", "1", "--min-len", str(TRAIN_LENGTH + 8), *DYNAMIC_NTK], 1),
],
                         ids=["default-multiple", "multiple-1-dynamic"])
@pytest.mark.fast_cases(1)
def test_generate_with_prefix(extra, warned, lm_data_bin, alibi_checkpoint):
    # batches of 16 from 60 lines: fairseq 0.12 drops the last one (12, not a multiple
    # of fairseq's default 8); the plugin keeps it (patches/batching.py: remainder_batches_kept).
    # Generating past the training length (up to 2 L) under dynamic scaling is warned about once.
    result = run_cli([
        tool("alibi-generate"), lm_data_bin, "--path", alibi_checkpoint, "--task",
        "language_modeling", "--cpu", "--gen-subset", "valid", "--sample-break-mode", "eos",
        "--tokens-per-sample", "512", "--prefix-size", "2", "--beam", "2",
        "--max-len-b", str(2 * TRAIN_LENGTH), "--batch-size", "16", *extra,
    ])
    hypos = re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", result.stdout, re.M)
    sources = dict(re.findall(r"^S-(\d+)\t(.*)$", result.stdout, re.M))
    assert sorted(int(i) for i, _, _ in hypos) == list(range(SPLIT_LINES["valid"])) == sorted(map(int, sources))
    if warned:  # past L: the warning's case
        assert min(len(text.split()) for _, _, text in hypos) > TRAIN_LENGTH
    warnings = [line for line in result.output.splitlines() if "scaling past the training length" in line]
    assert len(warnings) == warned, result.output[-3000:]
    assert all(f"dynamic ntk scaling past the training length ({TRAIN_LENGTH} tokens)" in w for w in warnings)
    for index, score, text in hypos:
        assert math.isfinite(float(score))
        # The hypothesis continues the forced two-token prefix of its source.
        assert text.split()[:2] == sources[index].split()[:2]
        assert len(text.split()) > 2


def test_only_the_trainers_batches_drop_a_short_last_batch():
    """fairseq's batch_by_size drops a last batch that is no multiple of the
    required size; the plugin keeps it, except for the trainer's training
    batches (its validation: the test below)."""
    import fairseq_alibi.models  # noqa: F401  (applies patches.py)
    from fairseq.data import data_utils

    from fairseq_alibi.patches import batching

    indices = np.random.default_rng(0).permutation(13)

    def batches():
        return data_utils.batch_by_size(indices, lambda i: 4, max_sentences=4, required_batch_size_multiple=2)

    assert np.concatenate(batches()).tolist() == indices.tolist()  # every index once, in order
    inside = batching._in_trainer(batches)()
    assert [len(b) for b in inside] == [4, 4, 4] and np.concatenate(inside).tolist() == indices[:12].tolist()


def test_validation_during_training_reads_the_whole_split(lm_data_bin, tmp_path):
    """A batch size above the split's block count, which is no multiple of
    fairseq's required 8: the logged validation covers every block and token
    of the split (stock fairseq drops the blocks past the last multiple of 8)."""
    from fairseq.data import Dictionary, data_utils

    split = data_utils.load_indexed_dataset(str(lm_data_bin / "valid"), Dictionary.load(str(lm_data_bin / "dict.txt")))
    tokens = int(split.sizes.sum())  # (the sizes are a view of the split's mapped index: the split kept alive)
    blocks = math.ceil(tokens / TRAIN_LENGTH)  # --sample-break-mode none: blocks of TRAIN_LENGTH, the last shorter
    assert blocks % 8, "the fixture's validation split must not fill whole batches of 8"
    result = run_cli([tool("alibi-train"), *train_args(lm_data_bin, tmp_path, max_update=1, batch_size=10_000)])
    [valid] = [line for line in result.output.splitlines() if "valid on 'valid' subset" in line]
    stats = dict(re.findall(r"\| (\w+) ([\d.]+)", valid))
    # two batches: fairseq's one of the blocks up to the last multiple of 8, then the rest (the log's means)
    assert 2 * float(stats["bsz"]) == blocks and 2 * float(stats["wpb"]) == tokens, valid


@pytest.mark.slow
def test_interactive_stdin(lm_data_bin, alibi_checkpoint, alibi_user_dir):
    prompts = "one the cat\ntwo a dog sees\n"
    result = run_cli([
        tool("fairseq-interactive"), lm_data_bin, "--path", alibi_checkpoint,
        "--user-dir", alibi_user_dir, "--task", "language_modeling", "--cpu",
        "--beam", "1", "--max-len-b", "40",
    ], stdin=prompts)
    hypos = re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", result.stdout, re.M)
    assert [int(i) for i, _, _ in hypos] == [0, 1]
    for (_, score, text), prompt in zip(hypos, prompts.splitlines()):
        assert text.startswith(prompt + " ")
        assert math.isfinite(float(score))


@pytest.fixture(scope="module")
def hub_factory(alibi_checkpoint, lm_data_bin):
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    loaded = {}

    def load(**overrides):
        key = repr(sorted(overrides.items()))
        if key not in loaded:
            loaded[key] = AlibiTransformerLanguageModel.from_pretrained(
                str(alibi_checkpoint.parent), alibi_checkpoint.name,
                data_name_or_path=str(lm_data_bin), **overrides,
            ).eval()
        return loaded[key]

    return load


def valid_text(lm_corpus, words: int) -> str:
    return " ".join((lm_corpus / "valid.txt").read_text().split()[:words])


def test_hub_score_equals_full_forward(hub_factory, lm_corpus):
    lm = hub_factory()
    assert lm.cfg.model.alibi_train_length == TRAIN_LENGTH
    sentence = valid_text(lm_corpus, 3 * TRAIN_LENGTH)
    scored = lm.score(sentence)
    tokens = lm.encode(sentence)  # ends with eos
    model = lm.models[0]
    eos = lm.task.source_dictionary.eos()
    with torch.no_grad():
        inputs = torch.cat([tokens.new_tensor([eos]), tokens[:-1]])[None]
        lprobs = model.get_normalized_probs(model(inputs), log_probs=True)[0]
    direct = lprobs.gather(-1, tokens[:, None]).squeeze(-1)
    n = len(scored["positional_scores"])
    assert n == len(tokens) - 1 > 2 * TRAIN_LENGTH
    assert torch.equal(scored["positional_scores"], direct[:n])


def test_stock_hub_class_loads_the_checkpoint(hub_factory, alibi_checkpoint, lm_data_bin):
    from fairseq.models.transformer_lm import TransformerLanguageModel

    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    stock = TransformerLanguageModel.from_pretrained(
        str(alibi_checkpoint.parent), alibi_checkpoint.name, data_name_or_path=str(lm_data_bin)
    ).eval()
    assert isinstance(stock.models[0], AlibiTransformerLanguageModel)
    sentence = "one the cat sees a tree . two the cat likes the ball ."
    assert torch.equal(
        stock.score(sentence)["positional_scores"],
        hub_factory().score(sentence)["positional_scores"],
    )


def test_position_scaling_and_its_older_names_score_alike_on_every_checkpoint_format(
        hub_factory, alibi_checkpoint, lm_data_bin, tmp_path):
    """``{'position_scaling': 'ntk:2'}`` is ``{'alibi_interpolation': 'ntk', 'alibi_scale_factor': 2}``,
    on this checkpoint and on one written before ``position_scaling`` existed (its config
    lacks the key: fairseq would drop an override of it); the two names disagreeing is refused."""
    from fairseq_alibi.models.transformer_lm import AlibiTransformerLanguageModel

    sentence = "one the cat sees a tree . two the cat likes the ball . " * 6
    new, old = hub_factory(position_scaling="ntk:2"), hub_factory(alibi_interpolation="ntk", alibi_scale_factor=2.0)
    scores = new.score(sentence)["positional_scores"]
    assert torch.equal(scores, old.score(sentence)["positional_scores"])
    assert not torch.equal(scores, hub_factory().score(sentence)["positional_scores"])
    state = torch.load(alibi_checkpoint, weights_only=False)
    del state["cfg"]["model"]["position_scaling"]
    torch.save(state, tmp_path / "older.pt")
    older = AlibiTransformerLanguageModel.from_pretrained(str(tmp_path), "older.pt", data_name_or_path=str(lm_data_bin),
                                                         position_scaling="ntk:2").eval()
    assert torch.equal(older.score(sentence)["positional_scores"], scores)
    with pytest.raises(ValueError, match="the older names of the same setting say linear:2"):
        hub_factory(position_scaling="ntk:2", alibi_interpolation="linear", alibi_scale_factor=2.0)
    with pytest.raises(ValueError, match="model override 'position_scaling': 'ntk:half' is not valid; .*expected a "
                                         "number or 'dynamic'"):
        hub_factory(position_scaling="ntk:half")


@pytest.mark.slow
def test_hub_sample(hub_factory):
    lm = hub_factory()
    greedy = lm.sample("one the cat", beam=1, max_len_b=3 * TRAIN_LENGTH)
    assert greedy.startswith("one the cat ") and len(greedy.split()) > 4
    sampled = lm.sample("two a dog", beam=1, sampling=True, sampling_topk=4, seed=3)
    assert sampled.startswith("two a dog ")
    assert set(sampled.split()) <= set(lm.task.source_dictionary.symbols)


def incremental_vs_full(lm, text) -> float:
    """Max |difference| between the log-probs of ``text``'s tokens from the
    incremental decoder (the generator forced through ``text`` as its prefix)
    and from one full forward (``score``)."""
    full = lm.score(text)["positional_scores"]
    tokens = lm.encode(text)
    hypo = lm.generate([tokens], beam=1, max_len_a=0, max_len_b=len(tokens) + 1)[0][0]
    assert torch.equal(hypo["tokens"][: len(full)], tokens[: len(full)])
    return (hypo["positional_scores"][: len(full)] - full).abs().max().item()


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("overrides", [{}, linear(2), ntk(3)], ids=["none", "linear2", "ntk3"])
def test_kv_cache_exact_without_dynamic_scaling(hub_factory, lm_corpus, overrides):
    lm = hub_factory(**overrides)
    assert incremental_vs_full(lm, valid_text(lm_corpus, 2 * TRAIN_LENGTH)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("method", [linear, ntk])
def test_kv_cache_with_dynamic_scaling_differs_past_train_length(hub_factory, lm_corpus, method):
    """Documented behaviour (docs/evaluating.md): exact up to alibi_train_length; past
    it every step rescales the slopes but deeper layers' cached keys/values were
    computed under older slopes, so generation differs from a full forward."""
    lm = hub_factory(**method(0))
    assert incremental_vs_full(lm, valid_text(lm_corpus, TRAIN_LENGTH - 4)) < 1e-4
    assert incremental_vs_full(lm, valid_text(lm_corpus, 2 * TRAIN_LENGTH)) > 1e-3


# --------------------------------------------------------------------------- hydra

HYDRA_CONFIG = """\
common:
  cpu: true
  seed: 1
  log_format: simple
  log_interval: 5
  user_dir: {user_dir}
checkpoint:
  save_dir: {save_dir}
  no_epoch_checkpoints: true
task:
  _name: language_modeling
  data: {data}
  tokens_per_sample: {length}
  sample_break_mode: none
dataset:
  batch_size: 8
  num_workers: 0
optimization:
  max_update: 6
  lr: [0.01]
optimizer:
  _name: adam
lr_scheduler:
  _name: inverse_sqrt
  warmup_updates: 5
criterion: cross_entropy
model:
  _name: transformer_lm_alibi
  decoder_layers: 2
  decoder_embed_dim: 48
  decoder_input_dim: 48
  decoder_output_dim: 48
  decoder_ffn_embed_dim: 96
  decoder_attention_heads: {heads}
  dropout: 0.0
"""


def write_hydra_config(tmp_path, data, user_dir, extra_model="") -> Path:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    text = HYDRA_CONFIG.format(
        user_dir=user_dir, save_dir=tmp_path / "ckpt", data=data, length=TRAIN_LENGTH, heads=HEADS
    )
    (config_dir / "tiny_lm.yaml").write_text(text + extra_model)
    return config_dir


@pytest.mark.slow
def test_fairseq_hydra_train(lm_data_bin, alibi_user_dir, tmp_path):
    """Stock fairseq-hydra-train, the plugin named by common.user_dir in the yaml
    (alibi-hydra-train runs in test_bad_value_in_hydra_config)."""
    config_dir = write_hydra_config(tmp_path, lm_data_bin, alibi_user_dir)
    result = run_cli([
        tool("fairseq-hydra-train"), "--config-dir", config_dir, "--config-name", "tiny_lm",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ])
    assert "done training" in result.output
    state = assert_alibi_checkpoint(tmp_path / "ckpt" / "checkpoint_best.pt")
    assert num_updates(state) == 6


@pytest.mark.slow
def test_hydra_trains_another_position_method_and_stock_eval_lm_extends_it(lm_data_bin, alibi_user_dir, tmp_path):
    """A transformer_lm_<position> model through hydra with its own parameter
    (rotary_fraction), evaluated by stock fairseq-eval-lm at 8x L under a RoPE
    extension method; a method that does not apply is one error line."""
    config_dir = write_hydra_config(tmp_path, lm_data_bin, alibi_user_dir)
    text = (config_dir / "tiny_lm.yaml").read_text().replace("_name: transformer_lm_alibi",
                                                             "_name: transformer_lm_rotary\n  rotary_fraction: 0.5")
    (config_dir / "tiny_lm.yaml").write_text(text)
    run_cli([tool("fairseq-hydra-train"), "--config-dir", config_dir, "--config-name", "tiny_lm",
             f"hydra.run.dir={tmp_path / 'hydra'}"])
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    model_cfg = load_state(checkpoint)["cfg"]["model"]
    assert (model_cfg["_name"], model_cfg["rotary_fraction"], model_cfg["alibi_train_length"]) == (
        "transformer_lm_rotary", 0.5, TRAIN_LENGTH)
    args = [lm_data_bin, "--path", checkpoint, "--cpu", "--tokens-per-sample", str(EVAL_LENGTH),
            "--sample-break-mode", "none", "--num-workers", "0", "--max-tokens", "2048", "--gen-subset", "valid"]
    stock = [tool("fairseq-eval-lm"), *args, "--user-dir", alibi_user_dir]
    results = {spec: parse_eval(run_cli([*stock, "--model-overrides", spec]).output)
               for spec in ("{}", "{'alibi_interpolation': 'yarn', 'alibi_scale_factor': 8}")}
    assert len(set(results.values())) == 2  # YaRN changes the numbers past L
    refused = run_cli([tool("alibi-eval-lm"), *args, "--model-overrides", "{'alibi_interpolation': 'cap'}"],
                      expect_ok=False)
    assert refused.returncode == 1 and error_lines(refused) == [
        "error: method='cap' is not valid; cap does not apply to rotary models; the methods that do: "
        + ", ".join(POSITIONS["rotary"].extensions)]


# (torchrun, two CPU processes: tests/test_resume.py::test_torchrun_gloo_sigkill_then_resume)


# --------------------------------------------------------------------------- errors

BAD_TRAIN_FLAGS = [
    ("alibi-train", ["--alibi-interpolation", "cubic"],
     ["alibi_interpolation='cubic'", ", ".join(METHODS)]),
    ("fairseq-train", ["--alibi-interpolation", "linear", "--alibi-scale-factor", "0.5"],
     ["alibi_scale_factor=0.5", "static factor >= 1"]),
    ("alibi-train", ["--alibi-attention", "foo"], ["alibi_attention='foo'", "auto, reference"]),
]


def assert_reports(result, messages, script):
    """Non-zero exit, each message on stderr; the alibi-* scripts say it in one
    ``error:`` line (no traceback), stock scripts end their traceback with it."""
    assert result.returncode != 0
    for message in messages:
        assert message in result.stderr, result.stderr[-3000:]
    if script.startswith("alibi-"):
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and all(m in errors[0] for m in messages), errors


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("script,flags,messages", BAD_TRAIN_FLAGS, ids=lambda v: str(v)[:24])
def test_bad_value_fails_at_build_naming_the_field(
    lm_data_bin, alibi_user_dir, tmp_path, script, flags, messages
):
    args = [tool(script), *train_args(lm_data_bin, tmp_path / "ckpt", max_update=1), *flags]
    if script.startswith("fairseq-"):
        args += ["--user-dir", alibi_user_dir]
    result = run_cli(args, expect_ok=False)
    assert_reports(result, messages, script)
    assert "done training" not in result.output
    assert "| WARNING | fairseq_alibi |" not in result.output  # a bad method is an error, not also a warning
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


def test_dynamic_scaling_without_train_length_fails_eval(lm_data_bin, alibi_checkpoint):
    """An override that leaves dynamic scaling with no training length to divide by."""
    overrides = {**linear(0), "alibi_train_length": 0}  # (tokens_per_sample 0 is refused by its own key)
    result = run_cli([
        tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_checkpoint, "--cpu",
        "--gen-subset", "valid", "--tokens-per-sample", str(EVAL_LENGTH),
        "--model-overrides", repr(overrides),
    ], expect_ok=False)
    assert_reports(result, ["alibi_train_length=0", "an integer in [1, 2147483647]"], "alibi-eval-lm")
    assert "Loss (base 2)" not in result.output


@pytest.mark.slow
def test_bad_value_in_hydra_config(lm_data_bin, alibi_user_dir, tmp_path):
    config_dir = write_hydra_config(
        tmp_path, lm_data_bin, alibi_user_dir, extra_model="  alibi_interpolation: cubic\n"
    )
    result = run_cli([
        tool("alibi-hydra-train"), "--config-dir", config_dir, "--config-name", "tiny_lm",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ], expect_ok=False)
    assert result.returncode != 0
    assert "alibi_interpolation='cubic'" in result.output
    assert "none, linear, ntk" in result.output
    # it says where Hydra writes; Hydra's schema-matching deprecation is filtered
    assert f"hydra_train.log into {tmp_path / 'hydra'}" in result.stderr
    assert "validated against ConfigStore schema" not in result.output


def test_hydra_train_help_is_short_and_help_all_is_hydras():
    short = run_cli([tool("alibi-hydra-train"), "--help"])
    assert short.stdout.startswith("usage: alibi-hydra-train") and "--help-all" in short.stdout
    assert "== Config groups ==" not in short.stdout


# --------------------------------------------------------------------------- architectures


def parse_arch(arch, data_dir="unused-data-dir"):
    from fairseq import options

    import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)

    argv = [str(data_dir), "--task", "language_modeling", "--arch", arch,
            "--tokens-per-sample", "512"]
    return options.parse_args_and_arch(options.get_training_parser(), argv)


def twin_name(arch):
    return "transformer_lm_alibi" if arch == "transformer_lm" else f"{arch}_alibi"


def test_every_stock_lm_arch_has_an_alibi_twin():
    """Each twin parses to exactly the stock arch's settings, positions off."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)

    stock = sorted(a for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m == "transformer_lm")
    assert "transformer_lm_wiki103" in stock and len(stock) > 5
    for arch in stock:
        assert ARCH_MODEL_NAME_REGISTRY.get(twin_name(arch)) == "transformer_lm_alibi", arch
        stock_args, twin_args = vars(parse_arch(arch)), vars(parse_arch(twin_name(arch)))
        assert twin_args["no_token_positional_embeddings"] is True
        differing = {
            k for k in set(stock_args) | set(twin_args)
            if stock_args.get(k) != twin_args.get(k)
            and k not in ("arch", "no_token_positional_embeddings") and not k.startswith("alibi_")
        }
        assert not differing, (arch, {k: (stock_args.get(k), twin_args.get(k)) for k in differing})


@pytest.fixture(scope="module")
def wiki103_dict(tmp_path_factory):
    """A dictionary just past the adaptive cutoffs (20000, 60000) of wiki103."""
    path = tmp_path_factory.mktemp("wiki103_dict")
    (path / "dict.txt").write_text("".join(f"w{i} {70000 - i}\n" for i in range(60100)))
    return path


def build_on_meta(data_dir, arch):
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(parse_arch(arch, data_dir))
    task = tasks.setup_task(cfg.task)
    with torch.device("meta"):  # shapes only: no memory for the parameters
        return task.build_model(cfg.model), cfg


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_wiki103_twin_is_the_paper_model_with_stock_parameter_count(wiki103_dict):
    from fairseq_alibi.models.attention import PositionMultiheadAttention

    stock, _ = build_on_meta(wiki103_dict, "transformer_lm_wiki103")
    twin, cfg = build_on_meta(wiki103_dict, "transformer_lm_wiki103_alibi")
    # ALiBi adds no parameters; the stock sinusoidal positions have none.
    assert n_params(twin) == n_params(stock) > 200_000_000
    assert stock.decoder.embed_positions is not None and twin.decoder.embed_positions is None
    assert len(twin.decoder.layers) == 16
    assert cfg.model.decoder_embed_dim == 1024 == cfg.model.decoder_input_dim
    assert cfg.model.decoder_attention_heads == 8
    assert cfg.model.adaptive_input and cfg.model.alibi_train_length == 512
    attn = twin.decoder.layers[0].self_attn
    assert isinstance(attn, PositionMultiheadAttention) and attn.num_heads == 8


@pytest.mark.slow
def test_base_arch_builds_without_any_dimension_flags(wiki103_dict):
    """--arch transformer_lm_alibi with no --decoder-embed-dim: the arch function
    runs before the dataclass defaults exist, so the io dims are defaulted again
    at build time (this used to crash with AttributeError)."""
    stock, _ = build_on_meta(wiki103_dict, "transformer_lm")
    twin, _ = build_on_meta(wiki103_dict, "transformer_lm_alibi")
    assert twin.decoder.project_in_dim is None and twin.decoder.project_out_dim is None
    assert twin.decoder.embed_tokens.embedding_dim == 512
    assert n_params(twin) == n_params(stock)


HYDRA_OVERRIDE_CHECK = """
import sys
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
import dataclasses, glob, os
import fairseq_alibi.models  # noqa: F401
from fairseq.models import MODEL_DATACLASS_REGISTRY
fields = [f.name for f in dataclasses.fields(MODEL_DATACLASS_REGISTRY["transformer_lm_alibi"])
          if f.name.startswith(("alibi_", "position_"))]
names = sorted(os.path.basename(p)[:-5] for p in glob.glob(sys.argv[1] + "/wikitext103_alibi_L*.yaml"))
assert len(names) == 8, names
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.1"):  # as fairseq-hydra-train
    for name in names:  # every field of the plugin, so that each is overridden without +
        cfg = compose(name, overrides=["model.position_scaling=ntk:2", "model.alibi_tail_alpha=0.5"])
        missing = [f for f in fields if f not in cfg.model]
        assert not missing, (name, missing)
        assert cfg.model.position_scaling == "ntk:2" and cfg.model.alibi_train_length == cfg.task.tokens_per_sample
    cfg = compose("wikitext103_alibi_L512", overrides=["model.alibi_scale_factor=2"])
    assert cfg.model.alibi_scale_factor == 2
    try:
        compose("wikitext103_alibi_L512", overrides=["+model.alibi_scale_factor=2"])
    except ConfigCompositionException as exc:
        assert "already at" in str(exc), exc
    else:
        raise AssertionError("+model.alibi_scale_factor=2 was accepted")
print("ok")
"""


@pytest.mark.slow
def test_shipped_hydra_configs_take_overrides_without_plus():
    """docs/training.md: the shipped configs hold every ALiBi field of the model, so
    ``model.position_scaling=ntk:2`` and ``model.alibi_scale_factor=2`` work on each,
    ``+model.alibi_scale_factor=2`` is refused (the key is there).
    In a subprocess: Hydra's global version state would leak into fairseq's."""
    config_dir = Path(__file__).resolve().parents[1] / "examples" / "language_model" / "config"
    assert run_cli([sys.executable, "-c", HYDRA_OVERRIDE_CHECK, config_dir]).stdout.strip() == "ok"


# --------------------------------------------------------------------------- what users see

BAD_INPUTS = [
    # (what, script, arguments after the script, a phrase of the one error line)
    ("arch typo", "alibi-train", ["--arch", "transformer_lm_alibbi"], "did you mean transformer_lm_alibi"),
    ("context window", "alibi-eval-lm", ["--tokens-per-sample", "64", "--context-window", "64"],
     "--context-window 64 must be at least 0 and smaller than --tokens-per-sample 64"),
    ("missing split", "alibi-eval-lm", ["--gen-subset", "vaild"], "split 'vaild' not found"),
    ("checkpoint directory", "alibi-eval-lm", ["--path", "DIR"], "is a directory; give a checkpoint file in it"),
    ("unwritable save dir", "alibi-train", ["--save-dir", "/sys/alibi-readonly"], "cannot access /sys/alibi-readonly"),
    ("adaptive loss", "alibi-train", ["--criterion", "adaptive_loss", "--adaptive-softmax-cutoff", "10,20"],
     "--criterion adaptive_loss needs --ddp-backend legacy_ddp"),  # a traceback after the data was loaded
]


def test_training_without_a_batch_size_is_one_line(lm_data_bin, tmp_path):
    """Stock fairseq-train ends in an AssertionError traceback without --max-tokens or --batch-size."""
    result = run_cli([tool("alibi-train"), lm_data_bin, "--cpu", "--max-update", "1", "--save-dir", tmp_path / "ckpt"],
                     expect_ok=False)
    lines = error_lines(result)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-2000:]
    assert len(lines) == 1 and "no batch size: give --max-tokens N" in lines[0] and "--batch-size N" in lines[0]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("what,script,extra,phrase", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line(what, script, extra, phrase, lm_data_bin, alibi_checkpoint, tmp_path):
    extra = [str(alibi_checkpoint.parent) if a == "DIR" else a for a in extra]
    if script == "alibi-train":
        args = [*train_args(lm_data_bin, tmp_path / "ckpt", max_update=1), *extra]
    else:
        args = [lm_data_bin, "--path", alibi_checkpoint, "--cpu", *extra]
    result = run_cli([tool(script), *args], expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-2000:]
    lines = error_lines(result)
    assert len(lines) == 1 and phrase in lines[0], result.output[-2000:]


def test_dictionary_of_another_size_names_both_sizes(lm_corpus, alibi_checkpoint, tmp_path):
    small = tmp_path / "small"
    run_cli([tool("alibi-preprocess"), "--only-source", "--trainpref", lm_corpus / "train.txt",
             "--validpref", lm_corpus / "valid.txt", "--nwordssrc", "12", "--destdir", small, "--workers", "1"])
    result = run_cli([tool("alibi-eval-lm"), small, "--path", alibi_checkpoint, "--cpu", "--gen-subset", "valid"],
                     expect_ok=False)
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.output[-2000:]
    assert "dictionary of 32 symbols" in lines[0] and "gives 16" in lines[0], lines


@pytest.mark.parametrize("overrides,phrase", [
    ("{'alibi_interpolaton': 'linear'}", "error: model override 'alibi_interpolaton' would change nothing: no such "
                                         "field of this plugin; did you mean alibi_interpolation"),
    ("{'position_scalin': 'ntk:2'}", "error: model override 'position_scalin' would change nothing: no "
                                     "such field of this plugin; did you mean position_scaling"),
    # fairseq drops a key its config lacks, silently: a typo, or an encoder-only ALiBi field on a decoder
    ("{'dropuot': 0.5}", "error: model override 'dropuot' would change nothing: the checkpoint's config "
                         "(transformer_lm_alibi) has no such option; did you mean dropout"),
    ("{'alibi_bidirectional': 'split'}", "error: model override 'alibi_bidirectional' would change nothing: the checkpoint's "
                                         "config (transformer_lm_alibi) has no such option (an option of the ALiBi "
                                         "encoders"),
])
@pytest.mark.fast_cases(1)
def test_overrides_that_would_change_nothing_are_refused(overrides, phrase, lm_data_bin, alibi_checkpoint):
    """A misspelt or misplaced key would leave the model as trained and print its
    perplexity as if under the user's settings: one error line, no number."""
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--model-overrides", overrides], expect_ok=False)
    lines = error_lines(result)
    assert result.returncode == 1 and "Perplexity" not in result.output, result.output[-2000:]
    assert len(lines) == 1 and lines[0].startswith(phrase), lines


def test_a_factor_the_method_ignores_is_warned(lm_data_bin, alibi_checkpoint):
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", alibi_checkpoint, "--cpu",
                      "--gen-subset", "valid", "--model-overrides", "{'alibi_scale_factor': 8}"])
    warnings = [line for line in result.output.splitlines() if "| WARNING | fairseq_alibi |" in line]
    assert len(warnings) == 1 and "has no effect with alibi_interpolation='none'" in warnings[0], result.output[-2000:]


def test_hub_keyword_typo_is_refused(hub_factory):
    with pytest.raises(ConfigError, match=r"model override 'alibi_interpolaton' would change nothing: no such "
                                          r"field of this plugin; did you mean alibi_interpolation"):
        hub_factory(alibi_interpolaton="linear")


@pytest.mark.slow
def test_train_logs_like_stock_fairseq_train(lm_data_bin, alibi_user_dir, tmp_path):
    """Same format and streams as stock fairseq-train (timestamped INFO lines on
    stdout, nothing on stderr), and none of the known third-party noise."""
    outputs = {}
    for script in ("alibi-train", "fairseq-train"):
        args = [tool(script), *train_args(lm_data_bin, tmp_path / script, max_update=2)]
        args[args.index("--log-format") + 1] = "json"
        if script == "fairseq-train":
            args += ["--user-dir", alibi_user_dir]
        outputs[script] = run_cli(args)
    timestamped = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO \| fairseq")
    for script, result in outputs.items():
        lines = result.stdout.splitlines()
        assert sum(bool(timestamped.match(line)) for line in lines) > 10, (script, result.stdout[-1500:])
        assert not [line for line in lines if line.startswith(("DEBUG:", "INFO:"))], script
        assert result.stderr.strip() == "", (script, result.stderr[-1500:])
        for noise in ("ConfigStore schema", "Please install tensorboardX", "pin_memory", "torch.cuda.amp"):
            assert noise not in result.output, (script, noise)


@pytest.mark.slow
def test_fork_training_command_warns(lm_data_bin, tmp_path):
    """The fork's ``--arch transformer_lm_wiki103`` is the stock sinusoidal model here."""
    args = train_args(lm_data_bin, tmp_path / "ckpt", max_update=1)
    args[args.index("transformer_lm_alibi")] = "transformer_lm_wiki103"
    args += ["--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff", "10,20",
             "--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp"]
    result = run_cli([tool("alibi-train"), *args])
    warnings = [line for line in result.output.splitlines() if "| WARNING | fairseq_alibi |" in line]
    assert len(warnings) == 1 and "--arch transformer_lm_wiki103_alibi" in warnings[0], result.output[-2000:]
    assert "not ALiBi" in warnings[0]


@pytest.mark.slow
def test_training_with_an_evaluation_method_warns_once(lm_data_bin, tmp_path):
    """A method given to alibi-train is trained with and stored: said; without one, nothing."""
    args = train_args(lm_data_bin, tmp_path / "ckpt", max_update=1)
    result = run_cli([tool("alibi-train"), *args, "--alibi-interpolation", "cap"])
    warnings = [line for line in result.output.splitlines() if "| WARNING | fairseq_alibi |" in line]
    assert len(warnings) == 1 and "--alibi-interpolation cap" in warnings[0] and "stores it" in warnings[0]
    plain = run_cli([tool("alibi-train"), *train_args(lm_data_bin, tmp_path / "plain", max_update=1)])
    assert "--alibi-interpolation" not in plain.output


def test_help_lists_the_alibi_options():
    train_help = run_cli([tool("alibi-train"), "--help"]).stdout
    for flag in ("--alibi-interpolation", "--alibi-scale-factor", "--alibi-tail-alpha", "--alibi-attention"):
        assert flag in train_help
    assert "'alibi_interpolation'" in run_cli([tool("alibi-eval-lm"), "--help"]).stdout


def test_user_dir_imports_neither_fairseq_nor_torch():
    code = ("import sys, alibi_user_dir; alibi_user_dir.main(); "
            "assert not {'fairseq', 'torch'} & set(sys.modules), sorted(sys.modules)")
    result = run_cli([sys.executable, "-c", code], fresh=True)
    assert result.stdout.strip().endswith("fairseq_alibi")


@pytest.mark.parametrize("argv", [
    ["alibi-eval-lm", "DATA", "--path", "CKPT", "--cpu", "--model-overrides", "{'alibi_interpolation': 'ntkk'}"],
    ["fairseq-eval-lm", "DATA", "--path", "CKPT", "--cpu", "--user-dir", "USER_DIR", "--max-sentences", "4",
     "--tokens-per-sample", "32"],  # (the default 1,024 is longer than the test split: refused, a traceback there)
    ["fairseq-train", "TRAIN", "--user-dir", "USER_DIR"],
])
@pytest.mark.slow
def test_a_forked_run_prints_what_a_fresh_process_prints(argv, lm_data_bin, alibi_checkpoint, alibi_user_dir,
                                                          tmp_path):
    """tests/forkserver.py (how run_cli runs console scripts) changes nothing a run
    prints or returns: an error, stock CLIs' logging (fairseq-eval-lm's goes to
    stderr, fairseq-train's to stdout), against a fresh process."""
    names = {"DATA": lm_data_bin, "CKPT": alibi_checkpoint, "USER_DIR": alibi_user_dir}
    args = [tool(argv[0])]
    for arg in argv[1:]:
        args += train_args(lm_data_bin, tmp_path / "ckpt", max_update=1) if arg == "TRAIN" else [names.get(arg, arg)]
    forked = run_cli(args, expect_ok=False)
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
    fresh = run_cli(args, expect_ok=False, fresh=True)
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
    # and through a recipe's shim (forkserver.write_shims: the streams handed over, the status handed back)
    shimmed = subprocess.run([os.path.join(recipe_bin(), argv[0]), *map(str, args[1:])], capture_output=True,
                             text=True, env=cli_env(), stdin=subprocess.DEVNULL, timeout=300)
    # fairseq's clock readings: timestamps, rates, durations, and the stats wps, ups, wall, train_wall
    timings = (r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|[\d.]+ (tokens/s|seconds)|in [\d.]+s"
               r"|\b(wps|ups|wall|train_wall) [\d.e+]+")
    strip_times = functools.partial(re.sub, timings, "T")
    assert forked.returncode == fresh.returncode == shimmed.returncode
    for run, name in ((forked, "forked"), (shimmed, "shimmed")):
        for stream in ("stdout", "stderr"):
            got, want = (strip_times(getattr(r, stream)).splitlines() for r in (run, fresh))
            diff = difflib.unified_diff(want, got, "fresh " + stream, f"{name} {stream}", lineterm="")
            assert got == want, "\n".join(diff)


@pytest.mark.parametrize("ignored", [[], [signal.SIGINT], [signal.SIGINT, signal.SIGTERM]],
                         ids=["neither", "SIGINT", "both"])
def test_a_shimmed_run_starts_with_the_signals_a_fresh_interpreter_would(ignored):
    """A recipe's tool (a fork of the worker's server) handles SIGINT and
    SIGTERM as the real interpreter started in its place does: ignored where
    its parent left them ignored (a recipe started with &), else Ctrl-C raises
    KeyboardInterrupt, whatever the test worker itself inherited."""
    show = "import signal; print(signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))"

    def start(python):
        def dispositions():
            for number in (signal.SIGINT, signal.SIGTERM):
                signal.signal(number, signal.SIG_IGN if number in ignored else signal.SIG_DFL)

        return subprocess.run([python, "-c", show], capture_output=True, text=True, env=cli_env(),
                              preexec_fn=dispositions, timeout=120)

    shimmed, real = start(os.path.join(recipe_bin(), "python")), start(sys.executable)
    assert shimmed.returncode == real.returncode == 0, shimmed.stderr + real.stderr
    assert shimmed.stdout == real.stdout


def test_a_shim_passes_signals_on_and_returns_the_status():
    """forkserver.write_shims: SIGTERM to a recipe's tool reaches the forked run
    (128 + 15, as a shell reports a process killed by it); an exit status comes back."""
    python = os.path.join(recipe_bin(), "python")
    assert subprocess.run([python, "-c", "import sys; sys.exit(7)"], env=cli_env()).returncode == 7
    sleeper = subprocess.Popen([python, "-c", "import time; print('up', flush=True); time.sleep(120)"],
                               stdout=subprocess.PIPE, text=True, env=cli_env())
    assert sleeper.stdout.readline() == "up\n"
    sleeper.send_signal(signal.SIGTERM)
    shimmed = recipe_bin() != str(BIN)  # FAIRSEQ_ALIBI_TEST_FORKS=0: the real interpreter, killed by the signal
    assert sleeper.wait(timeout=30) == (128 + signal.SIGTERM if shimmed else -signal.SIGTERM)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("override,expected", [
    ("model.alibi_scale_fator=2", "Could not override 'model.alibi_scale_fator'"),
    ("+model.alibi_scale_fator=2", "Key 'alibi_scale_fator' not in"),
    ("model.decoder_layers=x", "could not be converted to Integer (key decoder_layers)"),
])
def test_a_hydra_override_the_config_does_not_take_is_one_line(override, expected, lm_data_bin, alibi_user_dir,
                                                               tmp_path):
    """Hydra's and omegaconf's errors were a traceback of 70 lines and more."""
    config_dir = write_hydra_config(tmp_path, lm_data_bin, alibi_user_dir)
    result = run_cli([tool("alibi-hydra-train"), "--config-dir", config_dir, "--config-name", "tiny_lm",
                      f"hydra.run.dir={tmp_path / 'hydra'}", override], expect_ok=False)
    lines = error_lines(result)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: Hydra config: ") and expected in lines[0], lines
    if override.startswith("+"):  # checked against the model's dataclass: its keys are the choices
        assert lines[0].endswith("did you mean alibi_scale_factor?"), lines
