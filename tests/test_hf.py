"""fairseq_alibi.hf on tiny random BLOOM, MPT and Falcon (alibi=True) models.

References are computed here independently of fairseq_alibi: the scaled slopes
by the formulas written out below (NTK-ALiBi's readme form for powers of two),
and the logits by the model's *own* transformers code with its slope (or bias)
function replaced, for the duration of one call, by one returning the expected
slopes.  Everything runs offline in float32 unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import json
import math
import random

import pytest
import torch

from transformers import (  # noqa: E402  (requirements.txt pins transformers: no silent skip)
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MptConfig,
    MptForCausalLM,
)
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.bloom import modeling_bloom  # noqa: E402
from transformers.models.falcon import modeling_falcon  # noqa: E402
from transformers.models.mpt import modeling_mpt  # noqa: E402

from fairseq_alibi import hf  # noqa: E402
from fairseq_alibi.errors import HFLoadError  # noqa: E402
from fairseq_alibi.evaluation import hf_backend  # noqa: E402
from fairseq_alibi.evaluation.hf_backend import token_log_probs  # noqa: E402

VOCAB = 60
TRAIN_LENGTH = 16  # training length assumed by the dynamic-scaling tests
LENGTH = 40  # > TRAIN_LENGTH: dynamic factor 2.5
HEADS = {"bloom": 4, "mpt": 6, "falcon": 5}  # 6 and 5: not powers of two

# The unscaled slopes, read from transformers' own functions (not from fairseq_alibi).
ORIGINAL_BLOOM_SLOPES = modeling_bloom._get_alibi_slopes
ORIGINAL_MPT_BIAS = modeling_mpt.build_mpt_alibi_tensor
ORIGINAL_FALCON_BIAS = modeling_falcon.build_alibi_tensor


def upstream_slopes(family: str, heads: int, alibi_bias_max: float = 8) -> torch.Tensor:
    if family == "bloom":
        return ORIGINAL_BLOOM_SLOPES(heads, torch.device("cpu")).float()
    if family == "mpt":  # bias at distance 1 from the last key is -slope
        return -ORIGINAL_MPT_BIAS(heads, 2, alibi_bias_max)[:, 0, 0].float()
    # Falcon: column 1 of its bias is slope * 1 (rounded to bfloat16 by Falcon)
    return ORIGINAL_FALCON_BIAS(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]


def expected_slopes(slopes: torch.Tensor, method: str, factor: float) -> torch.Tensor:
    """Scaled slopes written out independently of fairseq_alibi.core.alibi."""
    values = [float(m) for m in slopes]
    count = len(values)
    if method == "none" or factor == 1:
        return torch.tensor(values)
    if method == "linear":
        return torch.tensor([m / factor for m in values])
    assert method == "ntk"
    if count & (count - 1) == 0:
        # keezen/ntk_alibi: 1 / (2^(8h/H) * a^((h-1)/(H-1))), h = 1..H (paper-ordered heads)
        assert all(math.isclose(m, 2 ** (-8 * h / count)) for h, m in zip(range(1, count + 1), values))
        return torch.tensor(
            [1 / (2 ** (8 * h / count) * factor ** ((h - 1) / (count - 1))) for h in range(1, count + 1)]
        )
    # General form: steepest head kept, flattest divided by a, geometric in log-slope between.
    top, bottom = math.log(max(values)), math.log(min(values))
    return torch.tensor([m * factor ** (-(top - math.log(m)) / (top - bottom)) for m in values])


def randomize(model, seed: int, std: float = 0.6):
    """Weights large enough that attention (and so ALiBi) shapes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model.eval()


def make_model(family: str, heads: int = None, seed: int = 0, layers: int = 2, **overrides):
    heads = heads or HEADS[family]
    if family == "bloom":
        config = BloomConfig(vocab_size=VOCAB, hidden_size=8 * heads, n_layer=layers, n_head=heads, **overrides)
        model = BloomForCausalLM(config)
    elif family == "mpt":
        attn = {"alibi_bias_max": overrides.pop("alibi_bias_max", 8)}
        config = MptConfig(vocab_size=VOCAB, d_model=8 * heads, n_layers=layers, n_heads=heads, expansion_ratio=2,
                           max_seq_len=overrides.pop("max_seq_len", 64), attn_config=attn, **overrides)
        model = MptForCausalLM(config)
    else:
        config = FalconConfig(
            vocab_size=VOCAB, hidden_size=8 * heads, num_hidden_layers=layers, num_attention_heads=heads,
            alibi=overrides.pop("alibi", True), new_decoder_architecture=False, multi_query=False,
            parallel_attn=False, bias=True, attn_implementation=overrides.pop("attn", "sdpa"), **overrides,
        )
        model = FalconForCausalLM(config)
    return randomize(model, seed)


@contextlib.contextmanager
def reference_slopes(family: str, slopes: torch.Tensor, monkeypatch):
    """The model's own transformers code, with ``slopes`` in place of its built-in ones."""
    slopes = slopes.float()
    with monkeypatch.context() as patch:
        if family == "bloom":
            patch.setattr(modeling_bloom, "_get_alibi_slopes", lambda heads, device: slopes.to(device))
        elif family == "mpt":
            def mpt_bias(heads, length, alibi_bias_max=8, device=None):
                return slopes[:, None, None] * torch.arange(1 - length, 1, device=device).float()
            patch.setattr(modeling_mpt, "build_mpt_alibi_tensor", mpt_bias)
        else:
            def falcon_bias(mask, heads, dtype):
                positions = ((mask.cumsum(-1) - 1) * mask).float()
                bias = slopes[None, :, None] * positions[:, None, :]
                return bias.reshape(mask.shape[0] * heads, 1, mask.shape[1]).to(dtype)
            patch.setattr(modeling_falcon, "build_alibi_tensor", falcon_bias)
        yield


def tokens(length: int = LENGTH, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


FAMILIES = ["bloom", "mpt", "falcon"]


# ---------------------------------------------------------------------------
# Slopes and scaling against the independent references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("family,heads", [("bloom", 4), ("bloom", 12), ("mpt", 6), ("mpt", 8), ("falcon", 5)])
def test_base_slopes_equal_the_models_own(family, heads):
    model = make_model(family, heads)
    assert torch.allclose(hf.base_slopes(model), upstream_slopes(family, heads), rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["linear", "ntk"])
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_scaled_logits_equal_reference(family, method, mode, monkeypatch):
    model = make_model(family)
    ids = tokens()
    plain = logits(model, ids)
    factor = 2.5 if mode == "static" else LENGTH / TRAIN_LENGTH
    with reference_slopes(family, expected_slopes(upstream_slopes(family, HEADS[family]), method, factor), monkeypatch):
        reference = logits(model, ids)
    if mode == "static":
        hf.apply_alibi_scaling(model, method, factor)
    else:  # factor 0: dynamic, as in the fairseq config
        hf.apply_alibi_scaling(model, method, 0, train_length=TRAIN_LENGTH)
    scaled = logits(model, ids)
    assert max_diff(scaled, reference) < 1e-4
    assert max_diff(scaled, plain) > 1e-3  # 10x the tolerance: the scaling is visible
    assert hf.alibi_scaling_settings(model)["last_factor"] == pytest.approx(factor)


@pytest.mark.parametrize("family", FAMILIES)
def test_dynamic_scaling_changes_nothing_up_to_the_training_length(family):
    model = make_model(family)
    ids = tokens(TRAIN_LENGTH)
    plain = logits(model, ids)
    with hf.alibi_scaling(model, "ntk", 0, train_length=TRAIN_LENGTH):
        assert max_diff(logits(model, ids), plain) < 1e-4
        assert hf.alibi_scaling_settings(model)["last_factor"] == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_none_equals_the_unscaled_model(family):
    model = make_model(family)
    ids = tokens()
    plain = logits(model, ids)
    hf.apply_alibi_scaling(model, "none")
    assert max_diff(logits(model, ids), plain) < 1e-4
    hf.apply_alibi_scaling(model, "none", bias_form="upstream")
    assert max_diff(logits(model, ids), plain) < 1e-5


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_left_padded_batch_equals_reference(family, monkeypatch):
    """With a 2-D mask, positions count attended tokens only (as the models do)."""
    model = make_model(family)
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # row 0 left-padded
    slopes = expected_slopes(upstream_slopes(family, HEADS[family]), "ntk", 3.0)
    with reference_slopes(family, slopes, monkeypatch):
        reference = logits(model, ids, attention_mask=mask)
    with hf.alibi_scaling(model, "ntk", 3.0):
        scaled = logits(model, ids, attention_mask=mask)
    assert max_diff(scaled[0, 7:], reference[0, 7:]) < 1e-4
    assert max_diff(scaled[1], reference[1]) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_bare_model_is_scaled_too(family, monkeypatch):
    base = make_model(family).base_model
    ids = tokens()
    slopes = expected_slopes(upstream_slopes(family, HEADS[family]), "linear", 2.0)
    with torch.no_grad(), reference_slopes(family, slopes, monkeypatch):
        reference = base(input_ids=ids).last_hidden_state
    with torch.no_grad(), hf.alibi_scaling(base, "linear", 2.0):
        scaled = base(input_ids=ids).last_hidden_state
    assert max_diff(scaled, reference) < 1e-4


# ---------------------------------------------------------------------------
# The distance cap
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def reference_capped_bias(family: str, slopes: torch.Tensor, cap: int, monkeypatch):
    """The model's own code with a full ``[q, kv]`` bias ``-m * min(i - j, cap)``
    (positions counted over attended tokens) in place of its key-only one: the
    models slice (MPT) or broadcast (BLOOM's baddbmm, Falcon's mask) a full bias."""
    slopes = slopes.float()

    def relative(mask, heads, dtype):
        positions = (mask.cumsum(-1) - 1) * mask
        distance = (positions[:, :, None] - positions[:, None, :]).clamp(max=cap).float()
        bias = -slopes[None, :, None, None] * distance[:, None]
        return bias.reshape(mask.shape[0] * heads, mask.shape[1], mask.shape[1]).to(dtype)

    def mpt_bias(heads, length, alibi_bias_max=8, device=None):
        return relative(torch.ones(1, length, dtype=torch.long, device=device), heads, torch.float32)

    with monkeypatch.context() as patch:
        if family == "mpt":
            patch.setattr(modeling_mpt, "build_mpt_alibi_tensor", mpt_bias)
        else:
            patch.setattr(modeling_bloom if family == "bloom" else modeling_falcon, "build_alibi_tensor", relative)
        yield


@pytest.mark.parametrize("family", FAMILIES)
def test_capped_logits_equal_reference(family, monkeypatch):
    """``cap``: every distance above C = factor x L counted as C, against the
    model's own code with a full capped bias; left padding in one row."""
    model = make_model(family)
    ids = tokens()
    mask = torch.ones_like(ids)
    if family != "mpt":  # MPT's bias ignores padding (its own convention)
        mask[0, :5] = 0
    cap = 8
    with reference_capped_bias(family, upstream_slopes(family, HEADS[family]), cap, monkeypatch):
        reference = logits(model, ids, attention_mask=mask)
    plain = logits(model, ids, attention_mask=mask)
    hf.apply_alibi_scaling(model, "cap", 0.5, train_length=TRAIN_LENGTH)
    scaled = logits(model, ids, attention_mask=mask)
    rows = slice(5, None) if family != "mpt" else slice(None)
    assert max_diff(scaled[0, rows], reference[0, rows]) < 1e-4 and max_diff(scaled[1], reference[1]) < 1e-4
    assert max_diff(scaled, plain) > 1e-3  # past C the cap is visible
    short = tokens(cap + 1)  # within C: plain ALiBi, exactly the unscaled model
    hf.remove_alibi_scaling(model)
    unscaled = logits(model, short)
    with hf.alibi_scaling(model, "cap", 0.5, TRAIN_LENGTH):
        assert max_diff(logits(model, short), unscaled) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_cap_makes_far_tokens_interchangeable(family):
    """The property only the cap has, on a one-layer model: tokens farther than
    C from the last position all get the same bias, so shuffling them leaves
    its logits unchanged; without the cap the shuffle changes them."""
    model = make_model(family, layers=1)
    ids = tokens(LENGTH, batch=1)
    cap = 8
    shuffled = ids.clone()
    far = LENGTH - 1 - cap  # keys 0 .. far are at distance >= cap from the last position
    shuffled[0, : far + 1] = ids[0, torch.randperm(far + 1, generator=torch.Generator().manual_seed(0))]
    assert not torch.equal(shuffled, ids)
    with hf.alibi_scaling(model, "cap", 0.5, TRAIN_LENGTH):
        assert max_diff(logits(model, ids)[:, -1], logits(model, shuffled)[:, -1]) < 1e-5
    assert max_diff(logits(model, ids)[:, -1], logits(model, shuffled)[:, -1]) > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_equals_full_forward_with_a_cap(family):
    model = make_model(family)
    ids = tokens(28)
    hf.apply_alibi_scaling(model, "cap", 0.5, train_length=TRAIN_LENGTH)
    assert max_diff(incremental_logits(model, ids, prefix=5), logits(model, ids)) < 1e-4


def test_mpt_static_cache_with_a_cap():
    """A StaticCache's keys include its empty slots (MPT masks them): the capped
    bias covers them too (it had only the filled keys' columns: a shape error)."""
    from transformers.cache_utils import StaticCache

    model = make_model("mpt")
    ids = tokens(28)
    hf.apply_alibi_scaling(model, "cap", 0.5, train_length=TRAIN_LENGTH)
    cache = StaticCache(config=model.config, max_cache_len=40)
    with torch.no_grad():
        pieces = [model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits]
        for step in range(5, ids.shape[1]):
            pieces.append(model(input_ids=ids[:, step : step + 1], past_key_values=cache, use_cache=True).logits)
    assert max_diff(torch.cat(pieces, dim=1), logits(model, ids)) < 1e-4


# ---------------------------------------------------------------------------
# Undo
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_remove_and_context_manager_restore_exactly(family):
    model = make_model(family)
    base = model.base_model
    ids = tokens()
    plain = logits(model, ids)
    modules_with_hooks = lambda: [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]  # noqa: E731

    hf.apply_alibi_scaling(model, "ntk", 2.0)
    ntk = logits(model, ids)
    assert max_diff(ntk, plain) > 1e-2
    hf.remove_alibi_scaling(model)
    assert torch.equal(logits(model, ids), plain)
    assert modules_with_hooks() == []
    assert "build_mpt_alibi_tensor" not in vars(base)
    assert hf.alibi_scaling_settings(model) is None

    with hf.alibi_scaling(model, "linear", 2.0):
        linear = logits(model, ids)
        with hf.alibi_scaling(model, "ntk", 2.0):
            assert torch.equal(logits(model, ids), ntk)
        assert torch.equal(logits(model, ids), linear)  # the outer scaling is back
    assert torch.equal(logits(model, ids), plain)
    assert modules_with_hooks() == []

    with pytest.raises(RuntimeError), hf.alibi_scaling(model, "ntk", 2.0):
        raise RuntimeError("inside")
    assert torch.equal(logits(model, ids), plain)


def test_unsupported_models_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(ValueError, match="supported: BLOOM .*MPT .*Falcon with config.alibi=True"):
        hf.apply_alibi_scaling(gpt2, "ntk", 2.0)
    rotary_falcon = make_model("falcon", alibi=False)
    with pytest.raises(ValueError, match="config.alibi=False.*rotary"):
        hf.apply_alibi_scaling(rotary_falcon, "linear", 2.0)
    assert not any(m._forward_pre_hooks for m in rotary_falcon.modules())
    # transformers' MPT adds ALiBi whatever attn_config.alibi says: scaled, it was a model never trained so
    mpt_without = make_model("mpt")
    mpt_without.config.attn_config.alibi = False
    with pytest.raises(ValueError, match="attn_config.alibi=False: this MPT was trained without ALiBi"):
        hf.apply_alibi_scaling(mpt_without, "ntk", 2.0)
    with pytest.raises(ValueError, match="attn_config.alibi=False: this MPT was trained without ALiBi"):
        hf.config_family(mpt_without.config)
    assert hf.config_family(make_model("mpt").config) == "mpt"


def test_a_sweep_refuses_logn_for_bloom_mpt_falcon_before_any_cell(saved_mpt, monkeypatch, capsys):
    """logn scales logits these models compute themselves, so their hooks do not
    take it: the plan says so up front (it ran the none cells, then stopped)."""
    from fairseq_alibi.evaluation import perplexity

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = [str(saved_mpt / "text.txt"), "--hf", f"mpt={saved_mpt / 'mpt'}", "--lengths", "1x", "--methods",
            "none,logn", "--output-dir", str(saved_mpt / "logn"), "--cpu", "--no-progress"]
    with pytest.raises(SystemExit) as exit_info:
        perplexity.main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 1 and errors == [
        "error: logn does not apply to any model of this run; the methods that do: mpt (alibi): none, linear, ntk, "
        "cap, log, power, capnorm"]
    assert not (saved_mpt / "logn" / "results.json").exists()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(method="yarn", factor=2.0), "method='yarn' is not valid; yarn does not apply to alibi models; the "
                                          "methods that do: none, linear, ntk, cap"),
        (dict(method="rope", factor=2.0), "method='rope' is not valid; allowed values: none, linear, ntk, yarn"),
        (dict(method="ntk", factor=0.5), "factor=0.5 is not valid; ntk takes a static factor >= 1, or dynamic"),
        (dict(method="ntk", factor=None), "factor=None is not valid"),
        (dict(method="ntk"), "train_length=None is not valid; dynamic scaling .* pass it \\(train_length=L"),
        (dict(method="cap", factor=2.0), "train_length=None is not valid; cap \\(which starts at F x L\\) needs"),
        (dict(method="ntk", factor=2.0, train_length=0), "train_length=0 is not valid"),
        (dict(method="ntk", factor=2.0, bias_form="absolute"), "bias_form='absolute' is not valid"),
        (dict(method="cap", factor=2.0, train_length=8, bias_form="upstream"), "cannot transform distances"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    model = make_model("bloom")
    with pytest.raises(ValueError, match=message):
        hf.apply_alibi_scaling(model, **kwargs)
    assert hf.alibi_scaling_settings(model) is None


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------


def incremental_logits(model, ids, prefix: int, cache=None) -> torch.Tensor:
    """Logits of ``ids`` from a prefix forward, then one token at a time through the cache."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        pieces = [model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True).logits]
        for step in range(prefix, ids.shape[1]):
            pieces.append(model(input_ids=ids[:, step : step + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_equals_full_forward_with_a_static_factor(family):
    model = make_model(family)
    ids = tokens(28)
    hf.apply_alibi_scaling(model, "ntk", 2.0)
    full = logits(model, ids)
    assert max_diff(incremental_logits(model, ids, prefix=20), full) < 1e-4
    # a cache made without a config holds no layers until the first forward fills it
    assert max_diff(incremental_logits(model, ids, prefix=20, cache=DynamicCache()), full) < 1e-4


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_under_a_static_factor_equals_greedy_full_forwards(family):
    """generate() (2-D mask, growing cache) picks the argmax of full recomputations."""
    model = make_model(family)
    model.generation_config.pad_token_id = 0
    prompt = tokens(20, batch=1)
    hf.apply_alibi_scaling(model, "ntk", 2.0)
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    expected = prompt
    for _ in range(6):
        expected = torch.cat([expected, logits(model, expected)[:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == expected.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_left_padded_row_equals_the_unpadded_prompt(family):
    model = make_model(family)
    model.generation_config.pad_token_id = 0
    prompts = tokens(20, batch=2)
    mask = torch.ones_like(prompts)
    mask[0, :5] = 0
    hf.apply_alibi_scaling(model, "linear", 2.0)
    with torch.no_grad():
        batch = model.generate(prompts, attention_mask=mask, max_new_tokens=4, do_sample=False)
        alone = model.generate(prompts[:1, 5:], attention_mask=mask[:1, 5:], max_new_tokens=4, do_sample=False)
    assert batch[0, 20:].tolist() == alone[0, 15:].tolist()


def test_bloom_generate_with_a_static_cache_equals_the_dynamic_cache():
    """A static cache pads BLOOM's 2-D mask to the cache length: positions still line up."""
    model = make_model("bloom")
    model.generation_config.pad_token_id = 0
    prompt = tokens(20, batch=1)
    hf.apply_alibi_scaling(model, "ntk", 2.0)
    runs = []
    for implementation in ("dynamic", "static"):
        with torch.no_grad():
            runs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                       do_sample=False, cache_implementation=implementation))
    assert runs[0].tolist() == runs[1].tolist()


def test_kv_cache_under_dynamic_scaling_differs_from_recomputation():
    """The documented caveat: cached keys keep the slopes they were computed under."""
    model = make_model("bloom")
    ids = tokens(28)
    plain_start = logits(model, ids[:, :TRAIN_LENGTH])
    hf.apply_alibi_scaling(model, "ntk", 0, train_length=TRAIN_LENGTH)
    full = logits(model, ids)  # every position under the factor 28 / 16
    incremental = incremental_logits(model, ids, prefix=12)
    # up to the training length each incremental step ran with factor 1 ...
    assert max_diff(incremental[:, :TRAIN_LENGTH], plain_start) < 1e-4
    # ... and beyond it the cached keys of layer 2 still carry those earlier slopes
    assert max_diff(incremental[:, TRAIN_LENGTH:], full[:, TRAIN_LENGTH:]) > 1e-2


# ---------------------------------------------------------------------------
# Upstream defects
# ---------------------------------------------------------------------------


def capture_block_inputs(block, into: dict):
    """Record the keyword arguments a block receives (after earlier pre-hooks)."""
    def hook(module, args, kwargs):
        into.update(kwargs)
    return block.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.slow
def test_bloom_bfloat16_absolute_bias_collapses_and_relative_form_does_not():
    import copy

    length = 2048
    model = make_model("bloom", seed=3)  # 4 heads: steepest slope 1/4
    ids = tokens(length, batch=1, seed=3)
    exact = logits(model, ids)[:, -64:]  # float32 reference
    half = copy.deepcopy(model).to(torch.bfloat16)

    seen = {}
    handle = capture_block_inputs(half.transformer.h[0], seen)
    upstream = logits(half, ids)[:, -64:]
    bias = seen["alibi"].float()  # [H, 1, kv]: slope * j in bfloat16
    # 0.25 * 2046 and 0.25 * 2047 round to the same bfloat16 value (spacing 2 there)
    assert bias[0, 0, -1] == bias[0, 0, -2]
    handle.remove()

    hf.apply_alibi_scaling(half, "none")
    seen.clear()
    handle = capture_block_inputs(half.transformer.h[0], seen)
    ours = logits(half, ids)[:, -64:]
    handle.remove()
    bias = seen["alibi"].float()  # [H, q, kv]: -slope * (i - j)
    assert bias[0, -1, -1] == 0 and bias[0, -1, -2] == -0.25 and bias[0, -1, -3] == -0.5
    upstream_error, our_error = max_diff(upstream, exact), max_diff(ours, exact)
    print(f"BLOOM bf16 max |logit error|: upstream {upstream_error:.2f}, relative {our_error:.2f}")  # docs/hf.md
    assert our_error < upstream_error / 4, (our_error, upstream_error)  # measured 0.07 vs 0.67
    hf.apply_alibi_scaling(half, "none", bias_form="upstream")
    assert torch.equal(logits(half, ids)[:, -64:], upstream)  # the option keeps BLOOM's own form


def test_falcon_eager_path_adds_alibi_twice_upstream_and_once_when_scaled(monkeypatch):
    model = make_model("falcon")
    ids = tokens()
    slopes = upstream_slopes("falcon", HEADS["falcon"])
    sdpa = logits(model, ids)
    with reference_slopes("falcon", 2 * slopes, monkeypatch):
        doubled = logits(model, ids)
    model.config._attn_implementation = "eager"
    eager = logits(model, ids)
    assert max_diff(eager, sdpa) > 1e-2
    assert max_diff(eager, doubled) < 1e-4  # upstream eager == the bias added twice

    hf.apply_alibi_scaling(model, "none")
    assert max_diff(logits(model, ids), sdpa) < 1e-4  # eager, scaled: once
    model.config._attn_implementation = "sdpa"
    assert max_diff(logits(model, ids), sdpa) < 1e-4
    with torch.no_grad():
        output = model(input_ids=ids, use_cache=False, output_attentions=True)
    assert max_diff(output.logits, sdpa) < 1e-4  # output_attentions takes the eager branch
    assert output.attentions[0].shape == (2, HEADS["falcon"], LENGTH, LENGTH)


def test_falcon_bias_is_rounded_to_bfloat16_even_in_float32(monkeypatch):
    length = 1100
    upstream = ORIGINAL_FALCON_BIAS(torch.ones(1, length, dtype=torch.long), 5, torch.float32)
    # head 0, slope 1/4: 0.25 * 1001 = 250.25 rounds to 250 = 0.25 * 1000 in bfloat16
    assert upstream[0, 0, 1000] == upstream[0, 0, 1001] == 250.0

    model = make_model("falcon", seed=4)
    ids = tokens(length, batch=1, seed=4)
    plain = logits(model, ids)[:, -64:]
    with reference_slopes("falcon", upstream_slopes("falcon", 5), monkeypatch):
        exact = logits(model, ids)[:, -64:]  # same slopes, float32 positions
    hf.apply_alibi_scaling(model, "none")
    seen = {}
    capture_block_inputs(model.transformer.h[0], seen)
    ours = logits(model, ids)[:, -64:]
    head_dim = model.config.hidden_size // 5
    mask = seen["attention_mask"]
    assert mask[0, 0, -1, -1] - mask[0, 0, -1, -2] == pytest.approx(0.25 / math.sqrt(head_dim), rel=1e-6)
    print(f"Falcon fp32 max |logit error|: upstream {max_diff(plain, exact):.2f}, "
          f"relative {max_diff(ours, exact):.0e}")  # docs/hf.md
    assert max_diff(ours, exact) < 1e-4
    assert max_diff(plain, exact) > 10 * max_diff(ours, exact)


def test_mpt_ignores_alibi_bias_max_and_the_scaled_model_honours_it(monkeypatch):
    model = make_model("mpt", alibi_bias_max=16)
    ids = tokens()
    plain = logits(model, ids)
    with reference_slopes("mpt", upstream_slopes("mpt", 6, alibi_bias_max=8), monkeypatch):
        eight = logits(model, ids)
    sixteen_slopes = upstream_slopes("mpt", 6, alibi_bias_max=16)
    with reference_slopes("mpt", sixteen_slopes, monkeypatch):
        sixteen = logits(model, ids)
    assert max_diff(plain, eight) < 1e-5  # upstream: always 8
    assert max_diff(plain, sixteen) > 1e-2
    assert torch.allclose(hf.mpt_slopes(6, 16), sixteen_slopes, rtol=1e-6, atol=0)
    hf.apply_alibi_scaling(model, "none")
    assert max_diff(logits(model, ids), sixteen) < 1e-4
    hf.remove_alibi_scaling(model)
    with reference_slopes("mpt", expected_slopes(sixteen_slopes, "ntk", 2.0), monkeypatch):
        reference = logits(model, ids)
    hf.apply_alibi_scaling(model, "ntk", 2.0)  # NTK scales the b=16 slopes
    assert max_diff(logits(model, ids), reference) < 1e-4


def test_mpt_refuses_inputs_longer_than_max_seq_len_and_the_scaled_model_takes_them(monkeypatch):
    model = make_model("mpt", max_seq_len=32)
    ids = tokens(48)
    with pytest.raises(RuntimeError, match="size of tensor"):
        logits(model, ids)
    slopes = expected_slopes(upstream_slopes("mpt", 6), "linear", 1.5)
    with reference_slopes("mpt", slopes, monkeypatch):
        monkeypatch.setattr(model.config, "max_seq_len", 48)
        reference = logits(model, ids)
        monkeypatch.setattr(model.config, "max_seq_len", 32)
    hf.apply_alibi_scaling(model, "linear", 1.5)
    assert max_diff(logits(model, ids), reference) < 1e-4
    assert max_diff(incremental_logits(model, ids, prefix=30), reference) < 1e-4
    assert token_log_probs(model, ids[0]).shape == (47,)


# ---------------------------------------------------------------------------
# Adapter for the evaluation tools
# ---------------------------------------------------------------------------

SENTENCES = [
    "the cat sees a tree",
    "the dog likes the ball",
    "a bird sees the dog",
    "the tree is green and the sky is blue",
]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    assert tokenizer.get_vocab_size() <= VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_load_hf_model_reads_a_saved_directory_offline(family, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = make_model(family), build_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = hf.load_hf_model(str(tmp_path))
    assert type(loaded) is type(model) and not loaded.training
    text = "the dog sees a green tree"
    ids = loaded_tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == tokenizer(text, return_tensors="pt").input_ids.tolist()
    assert tokenizer.unk_token_id not in ids[0].tolist()
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    half, _ = hf.load_hf_model(str(tmp_path), dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_load_hf_model_errors_are_one_clear_line(tmp_path):
    with pytest.raises(HFLoadError, match="missing not found") as missing:
        hf.load_hf_model(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HFLoadError, match="cannot load Hugging Face model .*config.json") as unreadable:
        hf.load_hf_model(str(empty))
    with pytest.raises(HFLoadError, match="unknown dtype 'half8'"):
        hf.load_hf_model(str(empty), dtype="half8")
    # a fairseq checkpoint (a .pt file, or a directory of them) is named as one, with both ways to load it
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    torch.save({"model": {}}, checkpoints / "checkpoint_best.pt")
    for path in (checkpoints, checkpoints / "checkpoint_best.pt"):
        with pytest.raises(HFLoadError, match="fairseq checkpoint.*alibi-export-hf .*checkpoint_best.pt OUTPUT_DIR"
                                               ".*import fairseq_alibi.models") as fairseq_checkpoint:
            hf.load_hf_model(str(path))
        assert "\n" not in str(fairseq_checkpoint.value)
    for error in (missing, unreadable):
        assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)


def test_load_hf_model_of_a_hub_name_offline_says_what_to_do(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never touch the network
    message = "'fairseq-alibi-tests/no-such-model'.*network.*pass its directory"
    with pytest.raises(HFLoadError, match=message) as error:
        hf.load_hf_model("fairseq-alibi-tests/no-such-model")
    assert "\n" not in str(error.value)


def test_hf_train_length():
    assert hf.hf_train_length(MptConfig(max_seq_len=2048)) == 2048
    assert hf.hf_train_length(BloomConfig(seq_length=2048)) == 2048
    assert hf.hf_train_length(BloomConfig()) is None
    assert hf.hf_train_length(FalconConfig(alibi=True)) is None
    assert hf.hf_train_length(GPT2Config()) is None


def test_token_log_probs_equal_the_full_logits():
    model = make_model("bloom")
    ids = tokens(30, batch=1)
    expected = torch.log_softmax(logits(model, ids)[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    chunked = token_log_probs(model, ids, chunk=7)  # [1, T] input, several chunks
    assert chunked.shape == (29,) and chunked.dtype == torch.float32
    assert max_diff(chunked, expected) < 1e-5
    assert max_diff(token_log_probs(model, ids[0]), expected) < 1e-5
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32)).eval()
    expected = torch.log_softmax(logits(gpt2, ids)[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert max_diff(token_log_probs(gpt2, ids), expected) < 1e-5  # any causal LM
    with pytest.raises(ValueError, match="no language-model head"):
        token_log_probs(model.base_model, ids)
    with pytest.raises(ValueError, match="one sequence"):
        token_log_probs(model, tokens(30, batch=2))


# ---------------------------------------------------------------------------
# alibi-sweep --hf: perplexity of a saved model on a raw text file
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_mpt(tmp_path_factory):
    """A tiny MPT (6 heads, max_seq_len 16 = its recorded training length) and
    its tokenizer, saved as a user would have them; plus a text file."""
    root = tmp_path_factory.mktemp("hf_sweep")
    model, tokenizer = make_model("mpt", max_seq_len=TRAIN_LENGTH), build_tokenizer()
    model.save_pretrained(root / "mpt")
    tokenizer.save_pretrained(root / "mpt")
    rng = random.Random(0)
    words = " ".join(rng.choice(" ".join(SENTENCES).split()) for _ in range(150))
    (root / "text.txt").write_text(words + "\n")
    return root


def reference_nonoverlapping_loss(model, ids, length) -> float:
    """Base-2 loss: chunks of ``length`` inputs, each predicting the next token."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, length):
            inputs = ids[start : start + length]
            targets = ids[start + 1 : start + length + 1]
            logprobs = model(inputs[None]).logits[0, : targets.numel()].double().log_softmax(-1)
            total += float(logprobs.gather(-1, targets[:, None]).sum())
            count += targets.numel()
    return -total / count / math.log(2)


@pytest.mark.slow
def test_sweep_hf_model_on_a_text_file(saved_mpt, monkeypatch):
    from fairseq_alibi.evaluation import perplexity

    from fairseq_alibi.evaluation import hf_backend

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = saved_mpt / "out"
    argv = [str(saved_mpt / "text.txt"), "--hf", f"mpt={saved_mpt / 'mpt'}", "--lengths", "1x,2x",
            "--methods", "none,linear:2,ntk", "--modes", "nonoverlapping,sliding", "--stride", "4",
            "--output-dir", str(out), "--cpu", "--no-progress"]
    encoded, encode = [], hf_backend.HFEncoder._ids
    monkeypatch.setattr(hf_backend.HFEncoder, "_ids",
                        lambda self, text: encoded.append(len(text)) or encode(self, text))
    assert perplexity.main(argv) == 0
    text_length = len((saved_mpt / "text.txt").read_text())
    assert encoded.count(text_length) == 1  # the plan (lengths against the text) and the cells share one encoding
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert len(cells) == 3 * 2 * 2 and (out / "perplexity.png").exists()
    model, tokenizer = hf.load_hf_model(str(saved_mpt / "mpt"))
    ids = torch.tensor(tokenizer((saved_mpt / "text.txt").read_text(), add_special_tokens=False)["input_ids"])
    by = {(c["label"], c["mode"], c["length"]): c for c in cells}
    for label, method, factor in (("none", "none", 0), ("linear x2", "linear", 2.0)):
        for length in (TRAIN_LENGTH, 2 * TRAIN_LENGTH):
            with hf.alibi_scaling(model, method, factor):
                expected = reference_nonoverlapping_loss(model, ids, length)
            cell = by[(label, "nonoverlapping", length)]
            assert cell["tokens"] == ids.numel() - 1
            assert cell["loss"] == pytest.approx(expected, abs=1e-5), (label, length)
    # dynamic NTK at the recorded training length is the unscaled model
    assert by[("ntk dynamic", "nonoverlapping", TRAIN_LENGTH)]["loss"] == pytest.approx(
        by[("none", "nonoverlapping", TRAIN_LENGTH)]["loss"], abs=1e-9)
    # sliding windows score every token once, with more context than nonoverlapping ones
    assert by[("none", "sliding", 2 * TRAIN_LENGTH)]["tokens"] == ids.numel() - 1
    # re-run: every cell reused
    calls = []
    monkeypatch.setattr(hf_backend, "token_log_probs", lambda *a, **k: calls.append(a))
    assert perplexity.main(argv) == 0 and calls == []


@pytest.mark.slow
def test_sweep_hf_models_are_loaded_one_at_a_time(saved_mpt, tmp_path, monkeypatch):
    """Planning reads configs and tokenizers only; each model's weights are
    loaded when its cells run and are gone before the next model loads."""
    import gc
    import shutil
    import weakref

    from fairseq_alibi.evaluation import perplexity

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shutil.copytree(saved_mpt / "mpt", tmp_path / "second")
    alive, load = [], hf.load_hf_model

    def tracked(*args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in alive), "a model was loaded while another one is still held"
        model, tokenizer = load(*args, **kwargs)
        alive.append(weakref.ref(model))
        return model, tokenizer

    monkeypatch.setattr(hf, "load_hf_model", tracked)
    argv = [str(saved_mpt / "text.txt"), "--hf", f"a={saved_mpt / 'mpt'}", "--hf", f"b={tmp_path / 'second'}",
            "--lengths", "1x", "--methods", "none,ntk:2", "--output-dir", str(tmp_path / "out"), "--cpu",
            "--no-progress"]
    assert perplexity.main(argv) == 0
    assert len(alive) == 2
    cells = json.loads((tmp_path / "out" / "results.json").read_text())["cells"]
    by = {(c["checkpoint"], c["label"]): c["loss"] for c in cells}
    assert len(by) == 4 and by[("a", "none")] == pytest.approx(by[("b", "none")], abs=1e-9)


@pytest.mark.parametrize("family, settings, expected", [
    ("bloom", {}, "bloom"), ("mpt", {}, "mpt"), ("falcon", {"alibi": True}, "falcon"),
    ("falcon", {"alibi": False}, "config.alibi=False"), ("gpt2", {}, "model_type 'gpt2' is not a model whose positions this package scales"),
    ("gpt_neox", {}, "gpt_neox"),
])
def test_config_family_refuses_what_resolve_refuses(family, settings, expected):
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **settings)
    if expected in ("bloom", "mpt", "falcon", "gpt_neox"):
        assert hf.config_family(config) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            hf.config_family(config)


@pytest.mark.slow
def test_retrieval_hf_model_on_jsonl_prompts(saved_mpt, tmp_path, monkeypatch, capsys):
    """alibi-retrieval --hf DIR: accuracies and answer log-probs equal a direct
    computation (bos + prompt + answer, argmax at the answer positions)."""
    from fairseq_alibi.evaluation import retrieval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rng = random.Random(3)
    words = sorted(set(" ".join(SENTENCES).split()))
    model, tokenizer = hf.load_hf_model(str(saved_mpt / "mpt"))
    word_ids = {i: w for w, i in tokenizer.get_vocab().items() if w in words}
    rows = []
    for i in range(8):
        prompt = " ".join(rng.choice(words) for _ in range(rng.choice((10, 30))))
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # half the answers: the model's own greedy next word (so some are right); scaled
        # with 'none' so that MPT takes prompts longer than its max_seq_len
        with torch.no_grad(), hf.alibi_scaling(model, "none"):
            logits = model(torch.tensor(ids)[None]).logits[0, -1]
        best = max(word_ids, key=lambda j: float(logits[j]))
        answer = word_ids[best] if i % 2 == 0 else rng.choice(words)
        rows.append({"prompt": prompt, "answer": answer, "group": str(i % 2)})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["--hf", f"mpt={saved_mpt / 'mpt'}", "--task", str(prompts), "--methods", "none,linear:2,ntk",
            "--output-dir", str(out), "--cpu", "--no-progress"]
    assert retrieval.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert sum(c["correct"] for c in cells if c["label"] == "none") >= 1  # not a vacuous 0 == 0
    for label, method, factor in (("none", "none", 0), ("linear x2", "linear", 2.0), ("ntk dynamic", "ntk", 0)):
        expected = {}
        with hf.alibi_scaling(model, method, factor, TRAIN_LENGTH):
            for r in rows:
                prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
                answer = tokenizer(r["answer"], add_special_tokens=False)["input_ids"]
                bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
                ids = torch.tensor(bos + prompt + answer[:-1])
                with torch.no_grad():
                    logprobs = model(ids[None]).logits[0, -len(answer):].double().log_softmax(-1)
                ok = bool((logprobs.argmax(-1) == torch.tensor(answer)).all())
                lp = float(logprobs.gather(-1, torch.tensor(answer)[:, None]).mean())
                expected.setdefault((r["group"], len(prompt + answer)), []).append((ok, lp))
        got = {(c["group"], c["length"]): c for c in cells if c["label"] == label}
        assert set(got) == set(expected), label
        for key, values in expected.items():
            assert got[key]["correct"] == sum(ok for ok, _ in values), (label, key)
            assert got[key]["answer_logprob"] == pytest.approx(sum(lp for _, lp in values) / len(values), abs=1e-5)
    # a word the tokenizer does not know: one clear error
    prompts.write_text(json.dumps({"prompt": "the zebra sees", "answer": "a tree"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        retrieval.main([*argv[:4], "--output-dir", str(tmp_path / "o2"), "--cpu"])
    assert exit_info.value.code == 1 and "zebra" in capsys.readouterr().err


@pytest.mark.slow
def test_importing_the_hf_side_leaves_fairseq_alone():
    """An HF user pays no fairseq import and gets no patch applied to it."""
    import subprocess
    import sys

    code = ("import sys, fairseq_alibi.hf; from fairseq_alibi.hf import apply_alibi_scaling; "
            "print(sorted(m for m in sys.modules if m == 'fairseq' or m.startswith(('fairseq.', 'fairseq_cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------
# Exported models: static caches, last_factor; the dynamic-cache warning
# ---------------------------------------------------------------------------


def exported_model(spelling: str = "none", heads: int = 4, seed: int = 0):
    """A tiny random model of ``alibi-export-hf``'s class, scaled as ``spelling``."""
    from fairseq_alibi.core.configuration_alibi import AlibiLMConfig
    from fairseq_alibi.core.modeling_alibi import AlibiForCausalLM
    from fairseq_alibi.core.scaling import Scaling

    config = AlibiLMConfig(vocab_size=VOCAB, hidden_size=8 * heads, layers=2, attention_heads=heads,
                           ffn_dim=16 * heads, alibi_train_length=TRAIN_LENGTH, pad_token_id=0,
                           alibi_scaling=Scaling.parse(spelling, TRAIN_LENGTH).to_hf())
    return randomize(AlibiForCausalLM(config), seed)


def greedy_by_recomputation(model, prompt: torch.Tensor, steps: int) -> list:
    """Greedy continuation of one unpadded prompt, each step a full forward (no cache)."""
    for _ in range(steps):
        prompt = torch.cat([prompt, logits(model, prompt)[:, -1:].argmax(-1)], dim=1)
    return prompt[0].tolist()


@pytest.mark.parametrize("spelling", ["none", "linear:2", "cap:0.5", "ntk"])
def test_exported_model_generates_a_padded_batch_with_a_static_cache(spelling):
    """generate() keeps the 2-D mask for a static cache; its empty slots are cut
    off: each row generates what the growing cache gives and, under a static
    method, what greedy recomputation of its unpadded prompt gives."""
    model = exported_model(spelling)
    prompts = tokens(10, batch=2)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    settings = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    with torch.no_grad():
        static = model.generate(prompts, cache_implementation="static", **settings)
        growing = model.generate(prompts, **settings)
    assert static.tolist() == growing.tolist()
    if spelling != "ntk":  # dynamic scaling with a cache only approximates recomputation past L
        for row, start in ((0, 0), (1, 4)):
            assert static[row, start:].tolist() == greedy_by_recomputation(model, prompts[row:row + 1, start:], 8)


def test_exported_model_reports_each_passes_dynamic_factor():
    """``last_factor``: the latest pass's factor, ``max(1, n / L)`` with ``n`` the
    row's own tokens; one number per row where the rows of a padded batch differ."""
    model = exported_model()
    hf.apply_alibi_scaling(model, "linear", 0)
    assert hf.alibi_scaling_settings(model)["last_factor"] is None  # no pass yet
    logits(model, tokens(150, batch=1))
    assert hf.alibi_scaling_settings(model)["last_factor"] == pytest.approx(150 / TRAIN_LENGTH)
    ids = tokens(40, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :8], mask[2, :30] = 0, 0
    logits(model, ids, attention_mask=mask)
    assert hf.alibi_scaling_settings(model)["last_factor"] == pytest.approx([40 / 16, 32 / 16, 1.0])
    logits(model, ids)  # rows of one length: one number
    assert hf.alibi_scaling_settings(model)["last_factor"] == pytest.approx(40 / 16)


@pytest.mark.parametrize("family", ["exported", "bloom"])
def test_generating_past_the_training_length_under_dynamic_scaling_warns_once(family, caplog):
    from fairseq_alibi.core import errors

    errors.warned.difference_update({m for m in errors.warned if "scaling past the training length" in m})
    model = exported_model() if family == "exported" else make_model("bloom")

    def warnings_of(run) -> list:
        caplog.clear()
        with caplog.at_level("WARNING", logger="fairseq_alibi"), torch.no_grad():
            run()
        return [r.getMessage() for r in caplog.records if r.name == "fairseq_alibi"]

    def generate(prompt_length: int, new: int):
        prompt = tokens(prompt_length, batch=1)
        return lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)

    hf.apply_alibi_scaling(model, "ntk", 2.0, train_length=TRAIN_LENGTH)
    assert warnings_of(generate(12, 10)) == []  # a static factor: exact
    hf.apply_alibi_scaling(model, "ntk", 0, train_length=TRAIN_LENGTH)
    assert warnings_of(generate(8, 6)) == []  # 14 keys <= L: factor 1 throughout
    assert warnings_of(lambda: model(input_ids=tokens(40))) == []  # no cache: a full forward
    said = warnings_of(generate(12, 10))
    assert len(said) == 1 and f"dynamic ntk scaling past the training length ({TRAIN_LENGTH} tokens)" in said[0]
    assert "\n" not in said[0]
    assert warnings_of(generate(12, 10)) == []  # once per process
