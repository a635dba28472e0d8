"""Logit scalings (``core/logit_scale.py``): the training-free ``logn`` method
and SSMax (``--ssmax``), each against logits scaled explicitly here, on every
kernel, with padding and with a KV cache."""

import math

import pytest
import torch
from omegaconf import open_dict

import fairseq_alibi.models  # noqa: F401  (registers the models)
from fairseq_alibi.core import flex, kernels
from fairseq_alibi.core.bias import AlibiBias, CausalMask, ModuleBias
from fairseq_alibi.core.errors import ScalingError
from fairseq_alibi.core.kerple import KerpleLog
from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.core.rotary import RotaryPositions
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.core.ssmax import ScalableSoftmax
from fairseq_alibi.models.attention import rescale

from test_position_models import TRAIN, build, data_dir, incremental, tokens  # noqa: F401 (data_dir: a fixture)

L = 8  # the training length of the kernel-level tests; 40 keys go 5x past it


def explicit_attention(q, k, v, bias_dense, factors):
    """softmax(factor_i * q_i . k_j / sqrt(d) + bias_ij) v, in float64, every query's factor given."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.size(-1))
    scores = scores * factors.double() + bias_dense.double()
    return torch.softmax(scores, -1) @ v.double()


def logn_by_hand(n: int, base: float) -> float:
    return max(1.0, math.log(n) / math.log(base))


def stack_biases(scaling):
    biases = {"alibi": AlibiBias(4, "causal"), "nope": CausalMask(4), "kerple": ModuleBias(KerpleLog(4), 4, True)}
    for bias in biases.values():
        bias.rescale(scaling)
    return biases


@pytest.mark.parametrize("spelling", ["logn", "logn:2"])
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "chunked", "blocked"])
@pytest.mark.parametrize("name", ["alibi", "nope", "kerple"])
def test_logn_is_the_explicit_logit_scaling_on_every_kernel(spelling, kernel, name):
    torch.manual_seed(0)
    scaling = Scaling.parse(spelling, L)
    bias = stack_biases(scaling)[name]
    T = 40
    q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
    base = scaling.factor * L
    factors = torch.tensor([logn_by_hand(i + 1, base) for i in range(T)])[None, None, :, None]
    assert factors.max() > 1.2 and factors[0, 0, : int(base)].eq(1).all()  # 1 within B keys, growing past it
    with torch.no_grad():
        expected = explicit_attention(q, k, v, bias.dense(T, T, torch.float32, "cpu"), factors)
        out, _ = kernels.attend(q, k, v, bias, kernel)
        bias.rescale(Scaling())
        plain, _ = kernels.attend(q, k, v, bias, kernel)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out, plain, atol=1e-3)  # the scaling changed the output


@pytest.mark.slow  # one inductor compile: minutes on 2 loaded cores
@pytest.mark.xfail(not flex.cpu_flex_verified(), strict=False,
                   reason="torch 2.13's compiled CPU FlexAttention is wrong at some lengths without AVX-512 "
                          "(refused to users there: flex._refuse_unverified_cpu)")
def test_logn_on_the_flex_kernel():
    torch.manual_seed(1)
    bias = AlibiBias(4, "causal", Scaling.parse("logn", L))
    q, k, v = (torch.randn(1, 4, 24, 8) for _ in range(3))
    factors = torch.tensor([logn_by_hand(i + 1, L) for i in range(24)])[None, None, :, None]
    with torch.no_grad():
        out, _ = kernels.attend(q, k, v, bias, "flex")
        expected = explicit_attention(q, k, v, bias.dense(24, 24, torch.float32, "cpu"), factors)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_logn_counts_a_rows_own_keys_under_padding_and_in_a_cache():
    """A left-padded row scores as alone; a KV-cache step's query sees its position + 1 keys."""
    torch.manual_seed(2)
    bias = AlibiBias(4, "causal", Scaling.parse("logn", L))
    q, k, v = (torch.randn(2, 4, 30, 8) for _ in range(3))
    pad = torch.zeros(2, 30, dtype=torch.bool)
    pad[1, :7] = True
    with torch.no_grad():
        batch, _ = kernels.attend(q, k, v, bias, "sdpa", pad)
        alone, _ = kernels.attend(q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], bias, "sdpa")
        torch.testing.assert_close(batch[1, :, 7:], alone[0], rtol=1e-5, atol=1e-5)
        step, _ = kernels.attend(q[:1, :, -1:], k[:1], v[:1], bias, "sdpa", incremental=True)
        torch.testing.assert_close(step[0, :, 0], batch[0, :, -1], rtol=1e-5, atol=1e-5)


def test_an_encoder_s_queries_count_every_key_they_see_both_ways():
    """A head that looks both ways sees its row's every real key, one that looks
    left the keys up to it, right from it (a causal count gave an encoder's first
    query 1 and its last T); and a symmetric encoder scores a mirrored input as
    the mirror of its output, with logn as without."""
    from fairseq_alibi.core.logit_scale import keys_seen

    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 7:] = True  # row 1: 7 real keys
    n = keys_seen(10, 10, pad, directions=(-1, 0, 1))[..., 0]  # [B, H, T]
    assert n[0].tolist() == [list(range(1, 11)), [10] * 10, list(range(10, 0, -1))]
    assert n[1, 1, :7].tolist() == [7] * 7 and n[1, 2, :7].tolist() == list(range(7, 0, -1))
    torch.manual_seed(3)
    bias = AlibiBias(4, "symmetric", Scaling.parse("logn", L))
    q, k, v = (torch.randn(1, 4, 5 * L, 8) * 2 for _ in range(3))
    with torch.no_grad():
        out, _ = kernels.attend(q, k, v, bias, "sdpa")
        mirrored, _ = kernels.attend(q.flip(2), k.flip(2), v.flip(2), bias, "sdpa")
        torch.testing.assert_close(mirrored.flip(2), out, rtol=1e-5, atol=1e-5)
        factor = math.log(5 * L) / math.log(L)  # every query sees all 5 L keys
        dense = torch.softmax((q * factor) @ k.transpose(-1, -2) / math.sqrt(8) + bias.dense(5 * L, 5 * L, q.dtype,
                                                                                             q.device), -1) @ v
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("name", list(POSITIONS))
def test_logn_applies_to_every_position_method_and_its_cache_equals_the_full_forward(data_dir, name):
    if "logn" not in POSITIONS[name].extensions:  # no softmax to sharpen (stick-breaking): refused in one line
        assert POSITIONS[name].extensions == ("none",)
        with pytest.raises(ScalingError, match="does not apply to") as caught:
            build(data_dir, name, "--alibi-interpolation", "logn")
        assert "\n" not in str(caught.value)
        return
    # rnope: a NoPE layer (full attention) in the 2-layer model; its windowed layers see 8 keys, fewer than L
    extra = ["--rnope-nope-every", "2"] if name == "rnope" else []
    model = build(data_dir, name, "--alibi-interpolation", "logn", *extra)
    ids = tokens(3 * TRAIN)
    with torch.no_grad():
        full, _ = model.decoder(ids)
        torch.testing.assert_close(incremental(model, ids), full, rtol=1e-4, atol=1e-4)
        rescale(model, Scaling())
        plain, _ = model.decoder(ids)
    torch.testing.assert_close(plain[:, :TRAIN], full[:, :TRAIN], rtol=1e-5, atol=1e-5)  # within L: unchanged
    assert not torch.allclose(plain[:, TRAIN + 4:], full[:, TRAIN + 4:], atol=1e-4)  # past L: scaled


def test_logn_grammar():
    assert Scaling.parse("logn", 64).spelling == "logn" and Scaling.parse("logn", 64).logit_base == 64
    spec = Scaling.parse("logn:0.5", 64)
    assert spec.spelling == "logn:0.5" and spec.logit_base == 32 and spec.label == "logn x0.5"
    for bad, reason in (("logn:dynamic", "no dynamic form"), ("logn:0.01", "at least 2"),
                        ("logn:-1", "base length must be a positive")):
        with pytest.raises(ScalingError, match=reason) as caught:
            Scaling.parse(bad, 64)
        assert "\n" not in str(caught.value)
    with pytest.raises(ScalingError, match="needs the length L"):
        Scaling.parse("logn").complete()
    assert Scaling.from_hf({"type": "logn"}, 64) == Scaling.parse("logn", 64)
    assert Scaling.from_hf(Scaling.parse("logn:2", 64).to_hf(), 64).logit_base == 128
    with pytest.raises(ScalingError, match="no train_seq_len"):
        Scaling.from_hf({"type": "logn", "train_seq_len": 64}, 64)


def test_the_hooks_refuse_logn_in_one_line():
    """The hooks patch ALiBi's bias of stock models (BLOOM, ...): logn is not theirs."""
    from transformers import BloomConfig, BloomForCausalLM
    from fairseq_alibi import hf

    model = BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ScalingError, match="logn does not apply") as caught:
        hf.apply_alibi_scaling(model, "logn", 1, train_length=8)
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ SSMax
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "chunked", "blocked"])
@pytest.mark.parametrize("name", ["alibi", "nope"])
def test_ssmax_is_the_explicit_logit_scaling_on_every_kernel(kernel, name):
    torch.manual_seed(3)
    bias = stack_biases(Scaling())[name]
    s = torch.tensor([0.3, 0.5, 0.9, 1.4])
    T = 40
    q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
    factors = s[None, :, None, None] * torch.log(torch.arange(1, T + 1, dtype=torch.float64))[None, None, :, None]
    with torch.no_grad():
        out, _ = kernels.attend(q, k, v, bias, kernel, ssmax=s)
        expected = explicit_attention(q, k, v, bias.dense(T, T, torch.float32, "cpu"), factors)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_ssmax_initial_scale_is_softmax_at_the_training_length():
    module = ScalableSoftmax(4, 1024)
    assert torch.allclose(module.scale * math.log(1024), torch.ones(4))


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", ["alibi", "rotary", "fire"])
def test_ssmax_model_cache_equals_the_full_forward_and_s_learns(data_dir, name):
    model = build(data_dir, name, "--ssmax")
    layer = model.decoder.layers[0].self_attn
    assert layer.ssmax.scale.shape == (4,)
    with torch.no_grad():
        for attention in (m.self_attn for m in model.decoder.layers):
            attention.ssmax.scale.copy_(torch.tensor([0.2, 0.4, 0.7, 1.1]))
    ids = tokens(3 * TRAIN)
    with torch.no_grad():
        full, _ = model.decoder(ids)
        torch.testing.assert_close(incremental(model, ids), full, rtol=1e-4, atol=1e-4)
    model.train()
    out, _ = model.decoder(ids)
    out.sum().backward()
    assert layer.ssmax.scale.grad is not None and layer.ssmax.scale.grad.abs().sum() > 0


@pytest.mark.slow
def test_a_model_without_ssmax_keeps_its_state_dict(data_dir):
    """--ssmax adds exactly one ``ssmax.scale`` per layer; without it nothing
    changes, and a config that predates the flag builds the same model."""
    plain = build(data_dir, "alibi")
    with_ssmax = build(data_dir, "alibi", "--ssmax")
    extra = set(with_ssmax.state_dict()) - set(plain.state_dict())
    assert extra == {f"decoder.layers.{i}.self_attn.ssmax.scale" for i in range(2)}
    assert set(plain.state_dict()) <= set(with_ssmax.state_dict())
    from fairseq import tasks
    from fairseq_alibi import facts
    from conftest import fairseq_config
    cfg = fairseq_config([str(data_dir), "--task", "language_modeling", "--arch", facts.position_model("alibi"),
                          "--tokens-per-sample", str(TRAIN), "--decoder-layers", "2", "--decoder-embed-dim", "32",
                          "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4"])
    with open_dict(cfg.model):
        del cfg.model["ssmax"]  # a checkpoint's config from before the flag
    assert "ssmax" not in cfg.model
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    model.load_state_dict(plain.state_dict(), strict=True)
    assert not any("ssmax" in key for key in model.state_dict())
