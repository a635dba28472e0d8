"""Bidirectional ALiBi: bias maths, encoder attention modes, roberta_alibi and
transformer_alibi (training, beam search against a full forward)."""

import argparse
import contextlib
import importlib
import io
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils, tasks
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from conftest import causal_bias, error_lines, fairseq_config, run_cli, split_bias, symmetric_bias, tool

from fairseq_alibi.core import alibi
from fairseq_alibi.core.scaling import NO_SCALING, Scaling
from fairseq_alibi.models.attention import PositionMultiheadAttention
from fairseq_alibi.core.bias import AlibiBias, LearnedAlibiBias
from fairseq_alibi.core.kernels import flex_available
from fairseq_alibi.errors import ConfigError
from fairseq_alibi.models.config import build_bias
from fairseq_alibi.facts import UNBOUNDED_POSITIONS

BIN = os.path.dirname(sys.executable)
USER_DIR = os.path.dirname(os.path.abspath(fairseq_alibi.__file__))
MODES = alibi.BIDIRECTIONAL_MODES


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared machine: one intra-op thread is many times faster
    than two competing with other processes for the same cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# --------------------------------------------------------------------------
# The maths against naive loops
# --------------------------------------------------------------------------


def naive_split(slopes, q_len, k_len, q_start, masked):
    H = len(slopes)
    half = H // 2
    out = torch.empty(H, q_len, k_len)
    for h in range(H):
        side = "left" if h < half else ("right" if h < 2 * half else "both")
        for a in range(q_len):
            i = q_start + a
            for j in range(k_len):
                hidden = (side == "left" and j > i) or (side == "right" and j < i)
                out[h, a, j] = masked if hidden else -slopes[h] * abs(i - j)
    return out


def naive_asymmetric(left, right, q_len, k_len, q_start):
    out = torch.empty(len(left), q_len, k_len)
    for h in range(len(left)):
        for a in range(q_len):
            i = q_start + a
            for j in range(k_len):
                out[h, a, j] = -left[h] * (i - j) if j <= i else -right[h] * (j - i)
    return out


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 8, 12])
@pytest.mark.parametrize("q_start,q_len,k_len", [(0, 7, 7), (3, 2, 9), (0, 1, 5), (6, 3, 9)])
def test_split_bias_matches_loops(num_heads, q_start, q_len, k_len):
    slopes = alibi.split_slopes(num_heads)
    for masked in (float("-inf"), -1e4):
        got = split_bias(slopes, q_len, k_len, q_start=q_start, masked_value=masked)
        want = naive_split(slopes.tolist(), q_len, k_len, q_start, masked)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("num_heads", [1, 2, 5, 8])
@pytest.mark.parametrize("q_start,q_len,k_len", [(0, 6, 6), (2, 3, 8), (7, 1, 8)])
def test_asymmetric_bias_matches_loops(num_heads, q_start, q_len, k_len):
    left = torch.rand(num_heads) + 0.01
    right = torch.rand(num_heads) + 0.01
    both = alibi.head_directions("learned", num_heads)
    got = alibi.alibi_bias((left, right), q_len, k_len, both, q_start=q_start)
    want = naive_asymmetric(left.tolist(), right.tolist(), q_len, k_len, q_start)
    torch.testing.assert_close(got, want)
    # equal sides reduce to the symmetric bias
    torch.testing.assert_close(
        alibi.alibi_bias((left, left), q_len, k_len, both, q_start=q_start),
        symmetric_bias(left, q_len, k_len, q_start=q_start),
    )


def test_split_layout_and_odd_heads():
    assert alibi.split_directions(4) == (-1, -1, 1, 1)
    assert alibi.split_directions(5) == (-1, -1, 1, 1, 0)
    assert alibi.split_directions(1) == (0,)
    # even: both halves carry the paper's slopes for H/2 heads
    torch.testing.assert_close(alibi.split_slopes(8), alibi.get_slopes(4).repeat(2))
    # odd: ceil(H/2)-head slopes, the two-sided head takes the last one
    torch.testing.assert_close(
        alibi.split_slopes(5), torch.cat([alibi.get_slopes(3)[:2]] * 2 + [alibi.get_slopes(3)[2:]])
    )
    # left-looking heads are exactly the causal bias
    slopes = alibi.split_slopes(6)
    bias = split_bias(slopes, 5, 9, q_start=4)
    torch.testing.assert_close(bias[:3], causal_bias(slopes[:3], 5, 9, q_start=4))
    # right-looking heads are the mirror image of the left-looking ones
    square = split_bias(slopes, 7, 7)
    torch.testing.assert_close(square[3:], square[:3].transpose(1, 2))


def test_learned_slope_parametrization():
    slopes = alibi.get_slopes(12)
    torch.testing.assert_close(alibi.learned_slopes(alibi.learned_slopes_inverse(slopes)), slopes)
    extreme = torch.tensor([-1e4, -100.0, 0.0, 50.0, 1e4])
    out = alibi.learned_slopes(extreme)
    assert bool((out > 0).all()) and bool(torch.isfinite(out).all())
    with pytest.raises(ValueError):
        alibi.learned_slopes_inverse(torch.tensor([0.5, 0.0]))


# --------------------------------------------------------------------------
# Attention modules
# --------------------------------------------------------------------------


def attention(mode, heads=4, dim=32, kernel="reference", scaling=NO_SCALING):
    torch.manual_seed(0)
    shared = AlibiBias(heads, mode, scaling)
    return PositionMultiheadAttention(dim, heads, shared, kernel=kernel).eval(), shared


@pytest.mark.parametrize("heads", [4, 5])
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "chunked"])
def test_split_left_heads_ignore_the_right(heads, kernel):
    """Per head: tokens right of i change nothing for left-looking heads at i,
    tokens left of i nothing for right-looking heads; two-sided heads see both."""
    dim = heads * 8
    module, _ = attention("split", heads, dim, kernel)
    with torch.no_grad():  # identity output projection: output = concatenated heads
        module.out_proj.weight.copy_(torch.eye(dim))
        module.out_proj.bias.zero_()
    torch.manual_seed(1)
    T, i = 12, 6
    x = torch.randn(T, 2, dim)
    y = x.clone()
    y[i + 1 :] = torch.randn(T - i - 1, 2, dim)  # change only positions right of i
    z = x.clone()
    z[:i] = torch.randn(i, 2, dim)  # change only positions left of i
    with torch.no_grad():
        ox, oy, oz = (module(t, t, t, need_weights=False)[0].view(T, 2, heads, 8) for t in (x, y, z))
    directions = alibi.split_directions(heads)
    for h in range(heads):
        same_right = torch.allclose(ox[i, :, h], oy[i, :, h], atol=1e-6)
        same_left = torch.allclose(ox[i, :, h], oz[i, :, h], atol=1e-6)
        assert same_right == (directions[h] == alibi.LOOK_LEFT), h
        assert same_left == (directions[h] == alibi.LOOK_RIGHT), h


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_kernel_paths_agree(mode):
    """Same weights, the bias dense (reference, sdpa), per block
    (chunked, two blocks at 300 queries) or as a FlexAttention score_mod (compiled
    on CPU), with left padding in one row."""
    x = torch.randn(300, 2, 32)
    pad = torch.zeros(2, 300, dtype=torch.bool)
    pad[1, :40] = True
    paths = ["reference", "sdpa", "chunked"]
    if mode != "learned" and flex_available():
        paths.append("flex")
    outs = {}
    for kernel in paths:
        module, _ = attention(mode, 4, 32, kernel)
        with torch.no_grad():
            outs[kernel] = module(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    assert bool(torch.isfinite(outs["reference"]).all())
    for kernel in paths[1:]:
        torch.testing.assert_close(outs[kernel], outs["reference"], atol=1e-5, rtol=1e-4, msg=kernel)
    if mode == "learned":  # no score_mod for trained slopes: refused when built, not ignored
        with pytest.raises(ConfigError, match="flex has a score_mod for ALiBi.s fixed slopes only"):
            attention(mode, 4, 32, "flex")


def test_shared_modes_share_one_cached_bias():
    _, shared = attention("split", 4, 32)
    a = shared.dense(9, 9, torch.float32, "cpu")
    assert shared.dense(9, 9, torch.float32, "cpu") is a
    module = PositionMultiheadAttention(32, 4, shared)
    assert module.positions is shared and not module.positions.causal
    assert all(k.split(".")[0] in ("q_proj", "k_proj", "v_proj", "out_proj") for k in module.state_dict())


def test_encoder_interpolation_dynamic_and_learned():
    shared = AlibiBias(8, "symmetric", Scaling("linear", 0, 64))
    torch.testing.assert_close(shared.slopes(64), alibi.get_slopes(8))
    torch.testing.assert_close(shared.slopes(256), alibi.get_slopes(8) / 4)
    torch.testing.assert_close(
        shared.dense(256, 256, torch.float32, "cpu"),
        symmetric_bias(alibi.get_slopes(8) / 4, 256, 256),
    )
    ntk = AlibiBias(8, "split", Scaling("ntk", 4.0))
    torch.testing.assert_close(ntk.slopes(10), alibi.scaled_slopes(Scaling("ntk", 4.0), alibi.split_slopes(8), 10))
    module, _ = attention("learned", 8, 32, scaling=Scaling("linear", 0, 16))
    left, right = module.positions.side_slopes(48)
    torch.testing.assert_close(left, alibi.get_slopes(8) / 3)
    torch.testing.assert_close(right, alibi.get_slopes(8) / 3)


def test_learned_slopes_train_and_stay_negative():
    module, _ = attention("learned", 4, 32, kernel="sdpa")
    module.train()
    learned = module.positions
    assert {"alibi.left", "alibi.right"} <= set(module.state_dict())
    x = torch.randn(10, 3, 32)
    module(x, x, x, need_weights=False)[0].pow(2).sum().backward()
    for p in (learned.left, learned.right):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and p.grad.abs().sum() > 0
    # A large learning rate pushing the bias up (towards positive) for many steps.
    optimizer = torch.optim.Adam([learned.left, learned.right], lr=50.0)
    for _ in range(20):
        optimizer.zero_grad()
        (-learned.dense(16, 16, torch.float32, "cpu")).sum().backward()
        optimizer.step()
    left, right = learned.side_slopes()
    assert float(learned.left.max()) < -100  # really pushed, far into softplus underflow
    assert bool((left > 0).all()) and bool((right > 0).all())
    bias = learned.dense(16, 16, torch.float32, "cpu")
    off_diagonal = ~torch.eye(16, dtype=torch.bool)
    assert bool((bias[:, off_diagonal] < 0).all())


# --------------------------------------------------------------------------
# Models built in-process
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dict_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dicts")
    entries = "".join(f"w{i} {100 - i}\n" for i in range(40))
    for name in ("dict.txt", "dict.src.txt", "dict.tgt.txt"):
        (path / name).write_text(entries)
    return path


def build(argv):
    cfg = fairseq_config(argv)
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model), cfg


def build_roberta(dict_dir, mode, *extra, heads=4):
    return build([
        str(dict_dir), "--task", "masked_lm", "--arch", "roberta_alibi",
        "--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48",
        "--encoder-attention-heads", str(heads), "--tokens-per-sample", "32",
        "--alibi-bidirectional", mode, *extra,
    ])


def build_transformer(dict_dir, mode, *extra):
    return build([
        str(dict_dir), "--task", "translation", "-s", "src", "-t", "tgt", "--arch", "transformer_alibi",
        "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
        "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48", "--decoder-ffn-embed-dim", "48",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--alibi-bidirectional", mode, *extra,
    ])


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("mode", MODES)
def test_roberta_structure(dict_dir, mode):
    model, cfg = build_roberta(dict_dir, mode)
    encoder = model.encoder.sentence_encoder
    assert encoder.embed_positions is None
    keys = list(model.state_dict())
    assert not [k for k in keys if "pos" in k]
    learned = [k for k in keys if "alibi" in k]
    if mode == "learned":
        assert len(learned) == 2 * 2  # left and right, per layer
    else:
        assert not learned
        assert {id(layer.self_attn.positions) for layer in encoder.layers} == {id(encoder.positions)}
    assert model.max_positions() == UNBOUNDED_POSITIONS
    assert cfg.model.alibi_train_length == 32
    # longer than tokens_per_sample: no position table caps it
    model.eval()
    with torch.no_grad():
        out = model(torch.randint(4, 40, (2, 100)))[0]
    assert out.shape == (2, 100, len(model.encoder.dictionary)) and bool(torch.isfinite(out).all())


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("heads", [4, 8])
def test_symmetric_encoder_is_reversal_equivariant(dict_dir, heads):
    model, _ = build_roberta(dict_dir, "symmetric", heads=heads)
    model.eval()
    tokens = torch.randint(4, 40, (3, 23))
    with torch.no_grad():
        features = model(tokens, features_only=True)[0]
        reversed_ = model(tokens.flip(1), features_only=True)[0]
    torch.testing.assert_close(reversed_.flip(1), features, atol=1e-4, rtol=0)
    # ... and the property is not vacuous: a causal-style split model breaks it
    split, _ = build_roberta(dict_dir, "split", heads=heads)
    split.eval()
    with torch.no_grad():
        a = split(tokens, features_only=True)[0]
        b = split(tokens.flip(1), features_only=True)[0].flip(1)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("mode", MODES)
def test_padding_leaves_real_positions_alone(dict_dir, mode):
    """Left and right padding: finite everywhere, real positions as unpadded."""
    model, _ = build_transformer(dict_dir, mode)
    model.eval()
    encoder, pad = model.encoder, model.encoder.padding_idx
    tokens = torch.randint(4, 40, (1, 9))
    left = torch.cat([torch.full((1, 4), pad), tokens], 1)
    right = torch.cat([tokens, torch.full((1, 4), pad)], 1)
    with torch.no_grad():
        plain = encoder(tokens)["encoder_out"][0]
        out_left = encoder(left)["encoder_out"][0]
        out_right = encoder(right)["encoder_out"][0]
    assert bool(torch.isfinite(out_left).all()) and bool(torch.isfinite(out_right).all())
    torch.testing.assert_close(out_left[4:], plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_right[:9], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_transformer_structure(dict_dir, mode):
    model, _ = build_transformer(dict_dir, mode)
    assert model.encoder.embed_positions is None and model.decoder.embed_positions is None
    assert not [k for k in model.state_dict() if "pos" in k]
    assert model.max_positions() == (UNBOUNDED_POSITIONS, UNBOUNDED_POSITIONS)
    encoder_attn = model.encoder.layers[0].self_attn
    assert isinstance(encoder_attn.positions, LearnedAlibiBias) == (mode == "learned")
    decoder_self = model.decoder.layers[0].self_attn
    assert isinstance(decoder_self, PositionMultiheadAttention) and decoder_self.positions.causal
    cross = model.decoder.layers[0].encoder_attn
    assert type(cross).__name__ == "MultiheadAttention"  # stock: no position information


def test_arch_twins():
    twins = {name: model for name, model in ARCH_MODEL_NAME_REGISTRY.items() if model == "transformer_alibi"}
    stock = [n for n, m in ARCH_MODEL_NAME_REGISTRY.items() if m == "transformer" and n.startswith("transformer")]
    assert {f"{n}_alibi" for n in stock} == set(twins)
    assert {"transformer_alibi", "transformer_iwslt_de_en_alibi", "transformer_wmt_en_de_alibi"} <= set(twins)
    for name in ("roberta_alibi", "roberta_alibi_base", "roberta_alibi_large"):
        assert ARCH_MODEL_NAME_REGISTRY[name] == "roberta_alibi"
    sizes = {}
    for name in ("roberta_alibi", "roberta_alibi_base", "roberta_alibi_large", "transformer_wmt_en_de_big_alibi"):
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[name](args)
        assert args.no_token_positional_embeddings and args.alibi_bidirectional == "symmetric"
        sizes[name] = (args.encoder_layers, args.encoder_embed_dim, args.encoder_attention_heads)
    assert sizes["roberta_alibi"] == sizes["roberta_alibi_base"] == (12, 768, 12)
    assert sizes["roberta_alibi_large"] == (24, 1024, 16)
    assert sizes["transformer_wmt_en_de_big_alibi"] == (6, 1024, 16)


def test_learned_positions_asked_of_an_alibi_twin_are_refused(dict_dir):
    """transformer_alibi forces its position embeddings off: a --*-learned-pos the
    user gave is refused, not dropped (a model without the positions asked for)."""
    for flag in ("--encoder-learned-pos", "--decoder-learned-pos"):
        with pytest.raises(ConfigError, match=f"^{flag}: an ALiBi model has no position embeddings"):
            build_transformer(dict_dir, "symmetric", flag)
    args = argparse.Namespace(encoder_learned_pos=True)
    with pytest.raises(ConfigError, match="--encoder-learned-pos"):
        ARCH_CONFIG_REGISTRY["transformer_wmt_en_de_alibi"](args)
    args = argparse.Namespace()  # the stock RoBERTa arch sets it on its own: forced off, no error
    ARCH_CONFIG_REGISTRY["roberta_alibi"](args)
    assert args.encoder_learned_pos is False


def test_bad_mode_names_the_field(dict_dir):
    with pytest.raises(ConfigError, match="alibi_bidirectional"):
        build_bias(argparse.Namespace(alibi_bidirectional="diagonal"), 4, encoder=True)
    with pytest.raises(ConfigError, match="alibi_train_length"):
        build_transformer(dict_dir, "symmetric", "--alibi-interpolation", "linear")


# --------------------------------------------------------------------------
# The stock CLIs: masked-LM training, translation training and beam search
# --------------------------------------------------------------------------


def cli(module, *argv):
    """A stock fairseq command in-process: its ``cli_main`` with ``sys.argv`` set
    (the console scripts are exactly ``sys.exit(cli_main())``), stdout returned.
    In-process saves an interpreter start and a torch import per command."""
    entry = importlib.import_module(f"fairseq_cli.{module}").cli_main
    saved, sys.argv = sys.argv, [f"fairseq-{module}", *map(str, argv)]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            entry()
    finally:
        sys.argv = saved
    return out.getvalue()


@pytest.fixture(scope="module")
def mlm_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    rng = random.Random(0)
    for split, n in (("train", 300), ("valid", 30)):
        lines = (" ".join(f"w{rng.randrange(30)}" for _ in range(rng.randint(5, 30))) for _ in range(n))
        (root / f"{split}.txt").write_text("\n".join(lines) + "\n")
    cli("preprocess", "--only-source", "--trainpref", root / "train.txt",
        "--validpref", root / "valid.txt", "--destdir", root / "bin", "--workers", "1")
    return root


def mlm_train_args(data, mode, save):
    return [
        data, "--task", "masked_lm", "--arch", "roberta_alibi", "--alibi-bidirectional", mode,
        "--cpu", "--encoder-layers", 2, "--encoder-embed-dim", 32, "--encoder-ffn-embed-dim", 48,
        "--encoder-attention-heads", 4, "--tokens-per-sample", 32, "--sample-break-mode", "complete",
        "--criterion", "masked_lm", "--optimizer", "adam", "--lr", 1e-3, "--batch-size", 8,
        "--max-update", 3, "--save-dir", save, "--no-epoch-checkpoints", "--disable-validation",
        "--num-workers", 0, "--log-format", "simple", "--log-interval", 1,
    ]


def check_mlm_checkpoint(path, mode):
    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert state["optimizer_history"][-1]["num_updates"] == 3
    keys = list(state["model"])
    assert not [k for k in keys if "pos" in k]
    assert bool([k for k in keys if "alibi" in k]) == (mode == "learned")
    model_cfg = state["cfg"]["model"]
    assert model_cfg.alibi_bidirectional == mode and model_cfg.alibi_train_length == 32
    init = alibi.learned_slopes_inverse(alibi.get_slopes(4))
    for key in keys:  # learned slopes moved away from their init in training
        if "alibi_" in key:
            assert float((state["model"][key] - init).abs().min()) > 1e-4, key


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("mode", MODES)
def test_fairseq_train_masked_lm(mlm_data, mode, tmp_path):
    """``fairseq-train --task masked_lm --arch roberta_alibi --user-dir ...``, 3 updates."""
    cli("train", "--user-dir", USER_DIR, *mlm_train_args(mlm_data / "bin", mode, tmp_path))
    check_mlm_checkpoint(tmp_path / "checkpoint_last.pt", mode)


@pytest.mark.slow
def test_fairseq_train_console_script(mlm_data, tmp_path):
    """The literal shell command: stock console script, ``$(alibi-user-dir)``."""
    argv = " ".join(f"'{a}'" for a in mlm_train_args(mlm_data / "bin", "split", tmp_path))
    command = f'"{BIN}/fairseq-train" --user-dir "$("{BIN}/alibi-user-dir")" {argv}'
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_mlm_checkpoint(tmp_path / "checkpoint_last.pt", "split")


@pytest.mark.slow
@pytest.mark.parametrize("flag,value,phrase", [
    ("--alibi-interpolation", "bogus", "alibi_interpolation='bogus' is not valid"),
    ("--alibi-bidirectional", "diagonal", "alibi_bidirectional='diagonal' is not valid"),
])
def test_encoder_bad_value_is_one_line(mlm_data, tmp_path, flag, value, phrase):
    """The encoders report bad ALiBi values as the LM does: one error line, exit 1."""
    args = [*mlm_train_args(mlm_data / "bin", "symmetric", tmp_path), flag, value]  # the last one wins
    result = run_cli([tool("alibi-train"), *args], expect_ok=False)
    lines = error_lines(result)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-2000:]
    assert len(lines) == 1 and phrase in lines[0], lines


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    """A tiny transformer_alibi (split encoder) trained for a few updates on copying."""
    root = tmp_path_factory.mktemp("copy")
    rng = random.Random(0)
    for split, n in (("train", 400), ("valid", 20), ("test", 24)):
        pairs = [[f"t{rng.randrange(12)}" for _ in range(rng.randint(3, 10))] for _ in range(n)]
        (root / f"{split}.src").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (root / f"{split}.tgt").write_text("".join(" ".join(p) + "\n" for p in pairs))
    cli("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
        "--trainpref", root / "train", "--validpref", root / "valid", "--testpref", root / "test",
        "--destdir", root / "bin", "--workers", "1")
    cli("train", root / "bin", "--user-dir", USER_DIR, "--task", "translation",
        "--arch", "transformer_alibi", "--alibi-bidirectional", "split", "--cpu",
        "--encoder-layers", 2, "--decoder-layers", 2, "--encoder-embed-dim", 32, "--decoder-embed-dim", 32,
        "--encoder-ffn-embed-dim", 64, "--decoder-ffn-embed-dim", 64,
        "--encoder-attention-heads", 4, "--decoder-attention-heads", 4, "--share-all-embeddings",
        "--optimizer", "adam", "--lr", 3e-3, "--max-tokens", 1000, "--max-update", 40,
        "--save-dir", root / "ckpt", "--no-epoch-checkpoints", "--save-interval", 1000,
        "--disable-validation", "--num-workers", 0, "--log-format", "simple", "--log-interval", 10)
    return root


@pytest.mark.slow
def test_beam_search_matches_full_forward(copy_model):
    """fairseq-generate (beam 4, KV cache, left-padded batches) scores each best
    hypothesis exactly as a teacher-forced full forward of that hypothesis."""
    out = cli("generate", copy_model / "bin", "--user-dir", USER_DIR, "--path",
              copy_model / "ckpt" / "checkpoint_last.pt", "--beam", 4, "--batch-size", 8,
              "--gen-subset", "test", "--max-len-b", 30, "--cpu")
    sources, hypotheses = {}, {}
    for line in out.splitlines():
        tag, _, rest = line.partition("\t")
        if tag.startswith("S-"):
            sources[int(tag[2:])] = rest
        elif tag.startswith("H-"):
            score, _, text = rest.partition("\t")
            hypotheses[int(tag[2:])] = (float(score) * math.log(2), text)
    assert len(hypotheses) == 24

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(copy_model / "ckpt" / "checkpoint_last.pt")],
        arg_overrides={"data": str(copy_model / "bin")},
    )
    model = models[0].eval()
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    compared = 0
    for idx, (score, text) in hypotheses.items():
        src = src_dict.encode_line(sources[idx], add_if_not_exist=False).long()[None]
        hyp = tgt_dict.encode_line(text, add_if_not_exist=False).long()[None]  # ends with eos
        prev = torch.cat([hyp.new_tensor([[tgt_dict.eos()]]), hyp[:, :-1]], 1)
        with torch.no_grad():
            net_output = model(src, torch.tensor([src.size(1)]), prev)
            lprobs = model.get_normalized_probs(net_output, log_probs=True)
        full = lprobs.gather(-1, hyp[..., None]).mean().item()  # lenpen 1: mean over tokens
        assert abs(full - score) < 1e-4, (idx, full, score)
        compared += 1
    assert compared == 24


@pytest.mark.slow
def test_model_overrides_reach_an_encoder_decoder_checkpoint(copy_model):
    """transformer_alibi is an argparse model: its checkpoint holds the model
    config as a Namespace, which a loaded config wraps in an object node; an
    override of its ALiBi settings is applied (it was refused as "no such
    option": every key was, 'dropout' included), and the generation runs."""
    checkpoint = str(copy_model / "ckpt" / "checkpoint_last.pt")
    source = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 2]])
    outputs = {}
    for overrides in ({}, {"position_scaling": "ntk:2"}):
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
            [checkpoint], arg_overrides={"data": str(copy_model / "bin"), **overrides})
        with torch.no_grad():
            outputs[str(overrides)] = models[0].eval().encoder(source, torch.tensor([9]))["encoder_out"][0]
    assert (outputs["{}"] - outputs[str({"position_scaling": "ntk:2"})]).abs().max() > 1e-3
    result = run_cli([tool("alibi-generate"), copy_model / "bin", "--path", checkpoint, "--beam", "2",
                      "--gen-subset", "test", "--max-len-b", "30", "--cpu",
                      "--model-overrides", "{'position_scaling': 'ntk:2', 'dropout': 0.0}"])
    assert sum(line.startswith("H-") for line in result.stdout.splitlines()) == 24
