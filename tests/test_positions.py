"""The maths of the other position methods (core/rotary.py, t5bias.py,
kerple.py, fire.py) against references written here or taken from
transformers: RoPE as complex multiplication and transformers' Llama
rotation and frequency functions, T5's buckets as transformers' T5 computes
them, Kerple and FIRE as loops over (i, j)."""

import cmath
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

from fairseq_alibi.core import alibi, rotary
from fairseq_alibi.core.errors import ConfigError, ScalingError
from fairseq_alibi.core.fire import Fire
from fairseq_alibi.core.kerple import KerpleLog
from fairseq_alibi.core.t5bias import T5Bias, relative_bucket

LONG = 65535  # the last position of a 64K context


def grid(q_start, q_len, k_len):
    """Integer positions: queries ``q_start ..`` as ``[q, 1]``, keys ``0 ..`` as ``[1, k]``."""
    return torch.arange(q_start, q_start + q_len)[:, None], torch.arange(k_len)[None, :]


def assert_incremental(module, length=12, start=5):
    """``values`` row by row (a KV cache's queries) equals the full square, and
    so does a block of queries starting after 0."""
    full = module.values(*grid(0, length, length))
    for i in range(length):
        row = module.values(*grid(i, 1, i + 1))
        torch.testing.assert_close(row[:, 0], full[:, i, : i + 1], rtol=0, atol=0)
    block = module.values(*grid(start, length - start, length))
    torch.testing.assert_close(block, full[:, start:], rtol=0, atol=0)


def assert_gradients(parameters):
    for name, parameter in parameters:
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------- RoPE


def complex_rotation(x, positions, inv_freq, scale=1.0):
    """RoPE written as complex numbers, in float64: pair ``(x_k, x_{k+r/2})`` is
    ``x_k + i x_{k+r/2}``, multiplied by ``scale * exp(i p theta_k)``; the tail copied."""
    half = len(inv_freq)
    out = x.to(torch.float64).clone()
    for index in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:-1])).tolist():
        *_, t = index
        p = float(positions[t] if positions.dim() == 1 else positions[index[0], t])
        for k in range(half):
            z = complex(float(x[tuple(index)][k]), float(x[tuple(index)][k + half]))
            z *= scale * cmath.exp(1j * p * float(inv_freq[k]))
            out[tuple(index)][k], out[tuple(index)][k + half] = z.real, z.imag
    return out


@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (12, 8), (10, 4)])
def test_rotate_matches_complex_rotation(head_dim, rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, head_dim)
    positions = torch.tensor([[0, 1, 2, 7, 40], [3, 9, 100, 1000, 4096]])
    inv_freq = rotary.inv_frequencies(rotary_dim)
    for pos in (positions, positions[1]):
        got = rotary.rotate(x, pos, inv_freq, attention_scale=1.25)
        torch.testing.assert_close(got.double(), complex_rotation(x, pos, inv_freq, 1.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (12, 8)])
def test_rotate_rounds_as_the_halves_products_and_its_backward_is_autograds(dtype, head_dim, rotary_dim):
    """``rotate``'s four-pass turn (its own backward) against the plain eager
    formula on the two halves, through autograd: the same values and the
    same gradients bit for bit (the HF export checks compare against eager
    RoPE), for a projection's permuted layout and per-row positions."""
    torch.manual_seed(3)
    inv_freq = rotary.inv_frequencies(rotary_dim)
    half = rotary_dim // 2

    def halves(x, positions):
        angles = positions.to(torch.float32)[..., None] * inv_freq
        if angles.dim() == 3:
            angles = angles[:, None]
        cos, sin = angles.cos(), angles.sin()
        first, second = x[..., :half].float(), x[..., half:rotary_dim].float()
        turned = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1) * 1.25
        return torch.cat((turned.to(x.dtype), x[..., rotary_dim:]), dim=-1)

    base = torch.randn(7, 2, 3, head_dim).to(dtype)  # [T, B, H, D]
    grad = torch.randn(2, 3, 7, head_dim).to(dtype)
    for positions in (torch.arange(7) + 5, torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15]])):
        results = []
        for function in (halves, lambda x, p: rotary.rotate(x, p, inv_freq, attention_scale=1.25)):
            x = base.clone().requires_grad_()
            out = function(x.permute(1, 2, 0, 3), positions)
            out.backward(grad)
            results.append((out.detach(), x.grad))
        (want, want_grad), (got, got_grad) = results
        assert torch.equal(got, want)
        assert torch.equal(got_grad, want_grad)


def test_rotate_far_position_is_finite_and_close():
    """At position 65535 float32 angles are off by at most ~|p theta| 2^-24 (~0.004 rad)."""
    torch.manual_seed(1)
    x = torch.randn(1, 2, 1, 16)
    pos = torch.tensor([LONG])
    inv_freq = rotary.inv_frequencies(16)
    got = rotary.rotate(x, pos, inv_freq)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), complex_rotation(x, pos, inv_freq), rtol=0, atol=2e-2)


def test_partial_rotary_leaves_the_tail_untouched_and_keeps_dtype():
    x = torch.randn(2, 2, 6, 16, dtype=torch.bfloat16)
    got = rotary.rotate(x, torch.arange(6) + 30, rotary.inv_frequencies(4), attention_scale=1.3)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[..., 4:], x[..., 4:])
    assert not torch.equal(got[..., :4], x[..., :4])


def test_scores_depend_on_the_offset_only():
    torch.manual_seed(2)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)
    inv_freq = rotary.inv_frequencies(32)

    def score(m, n):
        qm = rotary.rotate(q, torch.tensor([m]), inv_freq)
        kn = rotary.rotate(k, torch.tensor([n]), inv_freq)
        return float((qm * kn).sum())

    for m, n in [(5, 2), (40, 40), (17, 30), (300, 1)]:
        for shift in (1, 13, 1000):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-3)
    assert abs(score(5, 2) - score(5, 3)) > 1e-2  # the offset itself does matter


def llama_config(head_dim, rope, train_length=64, partial=None):
    """A small Llama config with ``rope_parameters`` (transformers 5 fills in
    ``original_max_position_embeddings`` for yarn from ``max_position_embeddings``)."""
    parameters = {"rope_theta": rope.pop("rope_theta", 10000.0), **rope}
    if partial is not None:
        parameters["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                       max_position_embeddings=train_length, rope_parameters=parameters)


@pytest.mark.parametrize("head_dim, base", [(8, 10000.0), (64, 10000.0), (128, 500000.0)])
def test_frequencies_match_transformers_default(head_dim, base):
    config = llama_config(head_dim, {"rope_type": "default", "rope_theta": base})
    expected, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    torch.testing.assert_close(rotary.inv_frequencies(head_dim, base), expected, rtol=2e-6, atol=0)
    got, got_scale = rotary.extended_frequencies("none", 1.0, head_dim, base)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert got_scale == scale == 1.0


@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0, 8.5])
@pytest.mark.parametrize("partial", [None, 0.5])
def test_linear_matches_transformers(factor, partial):
    config = llama_config(32, {"rope_type": "linear", "factor": factor}, partial=partial)
    expected, scale = ROPE_INIT_FUNCTIONS["linear"](config)
    got, got_scale = rotary.extended_frequencies("linear", factor, int(32 * (partial or 1)))
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert got_scale == scale == 1.0


@pytest.mark.parametrize("length", [64, 100, 256, 1024])
@pytest.mark.parametrize("head_dim, base", [(16, 10000.0), (64, 10000.0), (64, 500000.0)])
def test_ntk_is_transformers_dynamic_at_the_length(length, head_dim, base):
    """transformers' dynamic NTK at ``seq_len = n`` with its ``factor`` 1 raises the
    base by ``(n / L)^(d / (d - 2))``: our ``ntk`` at the resolved factor ``n / L``."""
    config = llama_config(head_dim, {"rope_type": "dynamic", "factor": 1.0, "rope_theta": base})
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=length)
    got, scale = rotary.extended_frequencies("ntk", length / 64, head_dim, base)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert scale == 1.0
    plain = rotary.inv_frequencies(head_dim, base)  # fastest pair kept, slowest divided by s
    assert got[0] == 1.0 and float(got[-1]) == pytest.approx(float(plain[-1]) * 64 / length, rel=1e-5)


@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0, 16.0])
@pytest.mark.parametrize("head_dim, train_length, base, partial", [
    (16, 64, 10000.0, None), (64, 64, 10000.0, None), (64, 512, 10000.0, 0.5),
    (128, 2048, 10000.0, None), (128, 4096, 500000.0, None), (32, 7, 10000.0, None)])
def test_yarn_matches_transformers(factor, head_dim, train_length, base, partial):
    config = llama_config(head_dim, {"rope_type": "yarn", "factor": factor, "rope_theta": base},
                          train_length=train_length, partial=partial)
    expected, scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    got, got_scale = rotary.extended_frequencies("yarn", factor, int(head_dim * (partial or 1)), base,
                                                 train_length)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert got_scale == pytest.approx(scale, rel=1e-12)
    assert got_scale == pytest.approx(0.1 * math.log(factor) + 1.0)


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    """Against the ramp's definition: pairs turning >= 32 times within L kept,
    <= once divided by s."""
    train_length, d, factor = 4096, 128, 8.0
    plain = rotary.inv_frequencies(d)
    got, _ = rotary.extended_frequencies("yarn", factor, d, 10000.0, train_length)
    turns = train_length * plain.double() / (2 * math.pi)
    kept, interpolated = turns >= 33, turns <= 0.9
    assert kept.any() and interpolated.any()
    torch.testing.assert_close(got[kept], plain[kept], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[interpolated], plain[interpolated] / factor, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "yarn", "factor": 4.0}])
def test_rotate_matches_transformers_llama(rope):
    torch.manual_seed(3)
    config = llama_config(16, dict(rope))
    embedding = LlamaRotaryEmbedding(config)
    q, k = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    positions = torch.tensor([[0, 1, 2, 3, 50, 63, 200], [10, 11, 12, 13, 14, 15, 16]])
    cos, sin = embedding(q, positions)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    method = rope["rope_type"] if rope["rope_type"] != "default" else "none"
    inv_freq, scale = rotary.extended_frequencies(method, rope.get("factor", 1.0), 16, 10000.0, 64)
    torch.testing.assert_close(rotary.rotate(q, positions, inv_freq, scale), expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary.rotate(k, positions, inv_freq, scale), expected_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, error", [
    (lambda: rotary.inv_frequencies(7), ConfigError),
    (lambda: rotary.inv_frequencies(8, base=1.0), ConfigError),
    (lambda: rotary.extended_frequencies("cap", 2.0, 8), ScalingError),
    (lambda: rotary.extended_frequencies("linear", 0.5, 8), ScalingError),
    (lambda: rotary.extended_frequencies("ntk", 2.0, 2), ConfigError),
    (lambda: rotary.extended_frequencies("yarn", 2.0, 8), ConfigError),
    (lambda: rotary.rotate(torch.zeros(1, 1, 2, 4), torch.arange(2), rotary.inv_frequencies(8)), ConfigError),
])
def test_rotary_refuses_what_it_cannot_compute(call, error):
    with pytest.raises(error) as caught:
        call()
    assert "\n" not in str(caught.value) and "not valid" in str(caught.value)


# ---------------------------------------------------------------------------- T5 bias


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (16, 64), (64, 128), (32, 256)])
def test_buckets_match_transformers_t5(bidirectional, num_buckets, max_distance):
    relative = torch.cat([torch.arange(-600, 601), torch.tensor([-LONG, -4097, 4097, LONG])])
    expected = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(relative_bucket(relative, bidirectional, num_buckets, max_distance), expected)


def naive_causal_bucket(n, num_buckets=32, max_distance=128):
    """T5's unidirectional bucket of distance ``n = max(i - j, 0)``, in plain floats."""
    exact = num_buckets // 2
    if n < exact:
        return n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(far, num_buckets - 1)


def test_causal_buckets_match_the_definition_and_saturate():
    distances = torch.arange(0, 2000)
    buckets = relative_bucket(-distances, bidirectional=False)
    assert buckets.tolist() == [naive_causal_bucket(n) for n in range(2000)]
    assert torch.equal(buckets[:16], torch.arange(16)) and (buckets[128:] == 31).all()
    assert (buckets[1:] >= buckets[:-1]).all()
    assert (relative_bucket(torch.arange(1, 50), bidirectional=False) == 0).all()  # keys after the query


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (32, 64), (8, 20), (4, 3)])
def test_t5_shared_from_is_the_first_distance_of_the_last_bucket(num_buckets, max_distance):
    """``T5Bias.shared_from(k_len)``: the least distance whose bucket (by the
    naive definition) is the last, every farther one in it too, where a pass
    of ``k_len`` keys reaches it; None where it does not."""
    module = T5Bias(2, num_buckets, max_distance)
    buckets = [naive_causal_bucket(n, num_buckets, max_distance) for n in range(3 * max_distance)]
    first = buckets.index(num_buckets - 1)
    assert all(b == num_buckets - 1 for b in buckets[first:])
    assert module.shared_from(3 * max_distance) == first == module.shared_from(first + 1)
    assert module.shared_from(first) is None


def t5_module(heads=3):
    torch.manual_seed(4)
    module = T5Bias(heads)
    torch.nn.init.normal_(module.table.weight)
    return module


def test_t5_values_match_a_loop():
    module = t5_module()
    q_start, q_len, k_len = 150, 40, 190
    got = module.values(*grid(q_start, q_len, k_len))
    table = module.table.weight.detach()
    for a, i in enumerate(range(q_start, q_start + q_len)):
        for j in range(k_len):
            torch.testing.assert_close(got[:, a, j], table[naive_causal_bucket(max(i - j, 0))], rtol=0, atol=0)


def test_t5_starts_as_no_position_and_learns():
    module = T5Bias(4)
    values = module.values(*grid(0, 8, 8))
    assert values.shape == (4, 8, 8) and values.dtype == torch.float32 and (values == 0).all()
    (module.values(*grid(0, 8, 8)) * torch.randn(4, 8, 8)).sum().backward()
    assert module.table.weight.grad[:8].abs().sum() > 0


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (16, 1000)])
def test_t5_init_slopes_starts_at_alibis_bias(num_buckets, max_distance):
    """``t5_init_slopes`` k: every pair's initial value is ALiBi's bias times
    k at the nearest distance of its bucket (a loop over distances, each
    bucket's first one found by hand); on the exact buckets that is ALiBi's
    own bias, and every head's values never rise with distance."""
    heads, k = 4, 1.5
    module = T5Bias(heads, num_buckets, max_distance, init_slopes=k)
    slopes = alibi.get_slopes(heads)
    values = module.values(*grid(max_distance + 40, 1, max_distance + 41))[:, 0].flip(-1)  # [H, distance]
    nearest = {}
    for d in range(max_distance + 41):
        nearest.setdefault(naive_causal_bucket(d, num_buckets, max_distance), d)
    for d in range(max_distance + 41):
        expected = -k * slopes * nearest[naive_causal_bucket(d, num_buckets, max_distance)]
        torch.testing.assert_close(values[:, d], expected, rtol=1e-6, atol=0)
    exact = num_buckets // 2
    torch.testing.assert_close(values[:, :exact], -k * slopes[:, None] * torch.arange(exact), rtol=1e-6, atol=0)
    assert (values[:, 1:] <= values[:, :-1]).all()
    assert (T5Bias(heads, num_buckets, max_distance).table.weight == 0).all()  # the default: zeros


def test_t5_incremental_and_long():
    module = t5_module()
    assert_incremental(module)
    far = module.values(*grid(LONG, 1, LONG + 1))
    assert torch.isfinite(far).all()
    torch.testing.assert_close(far[:, 0, : LONG - 127], module.table.weight[31, :, None].expand(3, LONG - 127))


# ---------------------------------------------------------------------------- Kerple


def kerple_module(heads=4):
    module = KerpleLog(heads)
    with torch.no_grad():
        module.raw_r1.copy_(torch.linspace(-2, 2, heads))
        module.raw_r2.copy_(torch.linspace(-4, 1, heads))
    return module


def test_kerple_values_match_a_loop():
    module = kerple_module()
    r1, r2 = module.r1.tolist(), module.r2.tolist()
    q_start, q_len, k_len = 20, 10, 30
    got = module.values(*grid(q_start, q_len, k_len)).detach()
    assert got.shape == (4, q_len, k_len) and got.dtype == torch.float32
    for h in range(4):
        for a, i in enumerate(range(q_start, q_start + q_len)):
            for j in range(i + 1):
                assert float(got[h, a, j]) == pytest.approx(-r1[h] * math.log(1 + r2[h] * (i - j)), rel=1e-5)


def test_kerple_init_is_alibi_near_and_heads_differ():
    module = KerpleLog(6)
    torch.testing.assert_close(module.r1, torch.ones(6))
    torch.testing.assert_close(module.r2, alibi.get_slopes(6))
    near = module.values(torch.tensor([[1]]), torch.tensor([[0]]))[:, 0, 0]
    torch.testing.assert_close(near, -torch.log1p(alibi.get_slopes(6)))
    assert len(set(near.tolist())) == 6


def test_kerple_parameters_stay_positive_and_get_gradients():
    module = KerpleLog(5)
    with torch.no_grad():
        module.raw_r1.copy_(torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4]))
        module.raw_r2.copy_(torch.tensor([1e4, -1e4, -90.0, 3.0, 0.0]))
    assert (module.r1 > 0).all() and (module.r2 > 0).all()
    assert torch.isfinite(module.values(*grid(LONG, 1, LONG + 1))).all()
    trainable = kerple_module()
    trainable.values(*grid(0, 16, 16)).sum().backward()
    assert_gradients(trainable.named_parameters())


def test_kerple_incremental_and_long():
    module = kerple_module()
    assert_incremental(module)
    far = module.values(*grid(LONG, 1, LONG + 1))[:, 0]
    r1, r2 = module.r1.double(), module.r2.double()
    for j in (0, 1, 30000, LONG):
        torch.testing.assert_close(far[:, j].double(), -r1 * torch.log1p(r2 * (LONG - j)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- FIRE


def fire_module(heads=3, threshold=8.0):
    torch.manual_seed(5)
    return Fire(heads, hidden=6, init_threshold=threshold)


def plain_mlp(module, x):
    """FIRE's MLP applied the plain way (two layers, ReLU), ``[q, k] -> [H, q, k]``."""
    return module.outer(torch.relu(module.inner(x[..., None]))).permute(2, 0, 1)


def knotted_fire():
    """8 hidden units: knots spread over [0, 1] on both slopes with a tie, and
    two units with w = 0 (one always on, one always off)."""
    module = Fire(3, hidden=8, init_threshold=8.0)
    knots = torch.tensor([0.1, 0.3, 0.3, 0.55, 0.8, 0.95])
    w = torch.tensor([2.0, -1.5, 1.0, -3.0, 0.5, 4.0])
    with torch.no_grad():
        module.inner.weight.copy_(torch.cat([w, torch.zeros(2)])[:, None])
        module.inner.bias.copy_(torch.cat([-w * knots, torch.tensor([0.7, -0.2])]))
    return module


def naive_fire(module, i, j):
    """FIRE's bias of query ``i`` over key ``j <= i``, per head, in float64 from the definition."""
    c, threshold = float(module.c.detach()), float(module.threshold.detach())
    x = math.log(c * (i - j) + 1) / math.log(c * max(threshold, i) + 1)
    w1, b1 = module.inner.weight.detach().double()[:, 0], module.inner.bias.detach().double()
    hidden = (w1 * x + b1).clamp(min=0)
    return module.outer.weight.detach().double() @ hidden + module.outer.bias.detach().double()


@pytest.mark.parametrize("make", [fire_module, knotted_fire])
def test_fire_values_match_a_loop(make):
    module = make()
    q_start, q_len, k_len = 4, 12, 16  # queries on both sides of the threshold (8)
    got = module.values(*grid(q_start, q_len, k_len))
    assert got.shape == (3, q_len, k_len) and got.dtype == torch.float32
    for a, i in enumerate(range(q_start, q_start + q_len)):
        for j in range(i + 1):
            torch.testing.assert_close(got[:, a, j].double(), naive_fire(module, i, j), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [fire_module, knotted_fire])
def test_fire_pieces_are_the_mlp_with_its_gradients(make):
    torch.manual_seed(6)
    module = make()
    query, key = grid(0, 40, 40)
    weights = torch.randn(3, 40, 40)
    got = module.values(query, key)
    expected = plain_mlp(module, module.mlp_input(query, key))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = [torch.autograd.grad((out * weights).sum(), list(module.parameters())) for out in (got, expected)]
    for name, a, b in zip(dict(module.named_parameters()), *grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("make", [fire_module, knotted_fire])
def test_fire_values_are_its_pieces_exactly_and_contiguous(make):
    """The per-head gather gives, bit for bit, each (i, j)'s piece looked up
    the plain way (``[q, k, H]`` indexing, then heads first), and the
    gradients of that lookup; and a contiguous ``[H, q, k]`` bias."""
    torch.manual_seed(7)
    module = make()
    query, key = grid(30, 20, 50)  # queries on both sides of the threshold, keys past them (masked later)
    got = module.values(query, key)
    x = module.mlp_input(query, key)
    knots, slopes, intercepts = module.pieces()
    piece = torch.bucketize(x.detach(), knots)
    expected = (slopes[piece] * x[..., None] + intercepts[piece]).permute(2, 0, 1)
    assert torch.equal(got, expected) and got.is_contiguous()
    weights = torch.randn(got.shape)
    grads = [torch.autograd.grad((out * weights).sum(), list(module.parameters())) for out in (got, expected)]
    for name, a, b in zip(dict(module.named_parameters()), *grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def assert_same_gradients_where_seen(module, got, expected, seed):
    """``got`` and ``expected`` (a masked bias, ``-inf`` where unseen) give
    ``module``'s parameters the same gradients under random weights of the
    finite entries, to rounding (the same sums in another order)."""
    seen = torch.isfinite(expected)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed))
    grads = [torch.autograd.grad((out[seen] * weights[seen]).sum(), list(module.parameters()))
             for out in (got, expected)]
    for name, a, b in zip(dict(module.named_parameters()), *grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("make", [fire_module, knotted_fire])
@pytest.mark.parametrize("q_start, q_len, keys", [
    (0, 16, 16),  # below the threshold (8) and across it
    (30, 20, 50),  # past it, keys to the right of every query (masked)
    (3000, 64, 3064),  # far past it: rows straddle knots
    (900, 1, 901),  # one query (a KV cache step)
    (2000, 150, 2150),  # several row groups (fire.ROW_GROUP), the last a partial one
])
def test_fire_reversed_block_is_values_bit_for_bit(make, q_start, q_len, keys):
    """The chunked kernel's block (one value per distance and piece, pairs
    only where the rows straddle a knot) is :meth:`values` of every pair,
    masked, rows last first: the same floats, and the same gradients."""
    module = make()
    query, key = grid(q_start, q_len, keys)
    expected = module.values(query, key).masked_fill(key > query, float("-inf")).flip(-2)
    got = module.reversed_block(q_start, q_len, keys, "cpu")
    assert torch.equal(got, expected) and got.is_contiguous()
    for group in (1, 2, 3):  # a few heads at a time, in one storage (filled with NaN: every entry written)
        storage = torch.full(((1 + group) * q_len * keys,), float("nan"))
        with torch.no_grad():
            heads = [(h, block.clone()) for h, block in module.reversed_head_blocks(q_start, q_len, keys, "cpu",
                                                                                   storage, group)]
        assert [h.start for h, _ in heads] == list(range(0, 3, group))
        assert torch.equal(torch.cat([block for _, block in heads]), expected)
    assert_same_gradients_where_seen(module, got, expected, seed=1)


@pytest.mark.parametrize("threshold", [8.0, 20.5, 40.0, 1.0])
@pytest.mark.parametrize("q_start, q_len", [(0, 30), (12, 18), (25, 5)])
def test_fire_dense_bias_is_values_bit_for_bit_on_both_sides_of_the_threshold(threshold, q_start, q_len):
    """The dense bias a pass past the threshold trains with
    (``ModuleBias.block``, built by ``reversed_block``) is :meth:`values` of
    every pair, masked: the same floats and the same gradients, whether the
    block's rows lie below the threshold, past it, or on both sides."""
    from fairseq_alibi.core.bias import ModuleBias

    module = knotted_fire()
    with torch.no_grad():
        module.raw_threshold.fill_(math.log(math.expm1(threshold / 8.0)))  # threshold_unit 8
    assert (q_start + q_len - 1 > float(module.threshold.detach())) == (threshold < 40)  # rows past it or not
    keys = q_start + q_len
    query, key = grid(q_start, q_len, keys)
    expected = module.values(query, key).masked_fill(key > query, float("-inf"))
    got = ModuleBias(module, 3, toeplitz=False).block(q_start, q_len, keys, torch.float32, "cpu")
    assert torch.equal(got, expected)
    assert_same_gradients_where_seen(module, got, expected, seed=2)


@pytest.mark.parametrize("make", [fire_module, knotted_fire])
def test_fire_value_span_is_the_range_of_its_mlp_on_the_unit_interval(make):
    """``value_span`` (which lets the explicit path skip its floor against
    subnormal weights) bounds every value of the bias, at any query, and is
    the MLP's own range over ``[0, 1]``, not a looser bound."""
    from fairseq_alibi.core.bias import CausalMask, ModuleBias

    module = make()
    span = float(module.value_span())
    for query, key in (grid(0, 64, 64), grid(3000, 8, 3008)):
        values = module.values(query, key).detach().masked_fill(key > query, float("nan"))
        assert float((values.nan_to_num(-math.inf).amax((1, 2)) - values.nan_to_num(math.inf).amin((1, 2))).max()) \
            <= span * (1 + 1e-6)
    x = torch.cat([torch.linspace(0, 1, 20001), module.pieces()[0].clamp(0, 1)]).detach()
    with torch.no_grad():
        f = plain_mlp(module, x[None])[:, 0]  # [H, points]
    torch.testing.assert_close(span, float((f.amax(1) - f.amin(1)).max()), rtol=1e-5, atol=1e-6)
    assert ModuleBias(module, 3, toeplitz=False).value_span() == span
    assert CausalMask(3).value_span() == 0.0 and math.isinf(ModuleBias(KerpleLog(3), 3, toeplitz=True).value_span())


@pytest.mark.parametrize("group_dims", [8, 16, 64])  # a head per call, two (and one), all three
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fire_chunked_evaluation_equals_the_reference_kernel(dtype, tol, group_dims, monkeypatch):
    """Long inference past the threshold (the chunked kernel reading
    ``reversed_head_blocks``' blocks a few heads at a time, queries flipped)
    against the reference kernel's dense bias, in float32 and bfloat16, with
    and without key padding (the queries that see a key compared)."""
    from fairseq_alibi.core import kernels
    from fairseq_alibi.core.bias import ModuleBias

    monkeypatch.setattr(kernels, "HEAD_GROUP_DIMS", group_dims)
    bias = ModuleBias(knotted_fire(), 3, toeplitz=False)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 300, 8, generator=gen).to(dtype) for _ in range(3))
    padded = torch.zeros(2, 300, dtype=torch.bool)
    padded[1, :7] = True  # left padding of the second row
    for pad, seen in ((None, slice(None)), (padded, slice(7, None))):
        with torch.no_grad():
            expected, _ = kernels.reference_kernel(q.float(), k.float(), v.float(), bias, pad, 0.0)
            got, _ = kernels.chunked_kernel(q, k, v, bias, pad, 0.0, chunk_size=128)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float()[..., seen, :], expected[..., seen, :], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T, S", [(300, 300), (40, 3040), (1, 3100)])  # whole rows; cached keys far past L
def test_fire_fused_evaluation_equals_the_reference_kernel(dtype, tol, T, S, monkeypatch):
    """FIRE's own ``chunked`` kernel (``fire.fused_chunked_kernel``: one C++ call, the bias from one value per
    distance, the pairs that straddle a knot their own) against the reference kernel's dense bias and the
    shared chunked kernel, with and without right padding, queries far past the threshold (a block's rows
    then straddle knots); with a gradient it is the shared kernel."""
    from fairseq_alibi.core import fire, kernels, native
    from fairseq_alibi.core.bias import ModuleBias

    bias = ModuleBias(knotted_fire(), 3, toeplitz=False)
    assert kernels.kernel_for("chunked", bias) is fire.fused_chunked_kernel
    calls = []
    real = fire.fire_forward
    monkeypatch.setattr(fire, "fire_forward", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, T, 8, generator=gen).to(dtype)
    k, v = (torch.randn(2, 3, S, 8, generator=gen).to(dtype) for _ in range(2))
    padded = torch.zeros(2, S, dtype=torch.bool)
    padded[1, -3:] = True  # right padding of the second row: its last queries are padding too
    results = {}
    for pad in (None, padded) if T == S else (None,):
        with torch.no_grad():
            expected, _ = kernels.reference_kernel(q.float(), k.float(), v.float(), bias, pad, 0.0)
            shared, _ = kernels.chunked_kernel(q, k, v, bias, pad, 0.0, chunk_size=128)
            got, _ = fire.fused_chunked_kernel(q, k, v, bias, pad, 0.0)
        assert got.dtype == dtype and calls
        seen = slice(None) if pad is None else slice(0, S - 3)
        torch.testing.assert_close(got.float()[..., seen, :], expected[..., seen, :], rtol=tol, atol=tol)
        torch.testing.assert_close(got.float()[..., seen, :], shared.float()[..., seen, :], rtol=tol, atol=tol)
        results[pad is None] = expected
    calls.clear()
    monkeypatch.setenv(native.SWITCH, "0")  # switched off: the shared kernel, the same numbers
    with torch.no_grad():
        off, _ = fire.fused_chunked_kernel(q, k, v, bias, None, 0.0)
    assert not calls
    torch.testing.assert_close(off.float(), results[True], rtol=tol, atol=tol)


def test_fire_fused_evaluation_weighs_a_far_key_far_above_the_near_ones():
    """The fused call weighs its key blocks from the nearest back, each later one against the rows' maxima so
    far in the same pass as its bias; two far keys scoring about 100 above every near one (beyond that pass's
    headroom, and beyond the exponential's range) have their block weighed again in two passes: the same
    output as the reference kernel's, the two keys' values in their ratio of weights, about 6 to 1."""
    from fairseq_alibi.core import fire, kernels
    from fairseq_alibi.core.bias import ModuleBias

    bias = ModuleBias(knotted_fire(), 3, toeplitz=False)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 3, 300, 8, generator=gen) for _ in range(3))
    q[..., 0] = 10.0  # keys 0 and 1: q . k / sqrt(8) about 106 and 104, the others about 3.5 N(0, 1)
    k[..., 1, :] = k[..., 0, :]
    k[..., 0, 0], k[..., 1, 0] = 30.0, 29.5
    with torch.no_grad():
        expected, _ = kernels.reference_kernel(q, k, v, bias, None, 0.0)
        got, _ = fire.fused_chunked_kernel(q, k, v, bias, None, 0.0)
    mix = (expected[..., 256:, :] - v[..., 1:2, :]) / (v[..., 0:1, :] - v[..., 1:2, :])  # key 0's share: e / (e + 1)
    torch.testing.assert_close(mix, torch.full_like(mix, 0.855), rtol=0, atol=0.02)  # capped at e^87: 0.5
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fire_reversed_block_writes_the_rows_that_straddle_a_knot():
    """Far past the threshold a block's rows see one distance on both sides of
    a knot: the case the pairwise correction exists for (without it, the
    values of the test above differ there)."""
    module = knotted_fire()
    q_start, q_len = 3000, 64
    psi = torch.log1p(module.c * torch.arange(q_start + q_len, dtype=torch.float32))
    normalizer = torch.log1p(module.c * torch.tensor([q_start, q_start + q_len - 1], dtype=torch.float32))
    knots = module.pieces()[0]
    straddling = torch.bucketize(psi / normalizer[1], knots) != torch.bucketize(psi / normalizer[0], knots)
    assert straddling.sum() > 0


def test_fire_is_not_toeplitz_past_the_threshold():
    module = fire_module()
    values = module.values(*grid(0, 40, 40))
    assert not torch.allclose(values[:, 20, 15], values[:, 30, 25])  # same i - j = 5, other i
    torch.testing.assert_close(values[:, 7, 2], values[:, 6, 1])  # below the threshold: i - j alone


@pytest.mark.parametrize("raw_c, raw_threshold", [(0.0, 0.0), (-30.0, 5.0), (5.0, -30.0), (1e4, 1e4)])
def test_fire_mlp_input_stays_in_the_unit_interval(raw_c, raw_threshold):
    """Progressive interpolation: ``psi(i - j) / psi(max(L, i))`` in [0, 1] for
    every visible key, whatever ``c`` and ``L`` are and however long the input."""
    module = fire_module()
    with torch.no_grad():
        module.raw_c.fill_(raw_c)
        module.raw_threshold.fill_(raw_threshold)
    for query, key in (grid(0, 64, 64), grid(1000, 24, 1024), grid(LONG, 1, LONG + 1)):
        x = module.mlp_input(query, key)
        visible = key <= query
        assert torch.isfinite(x).all()
        assert (x[visible] >= 0).all() and (x[visible] <= 1).all()
    if module.threshold.item() <= LONG:  # the farthest key of a query past the threshold: exactly 1
        assert module.mlp_input(torch.tensor([[LONG]]), torch.tensor([[0]])).item() == 1.0


def test_fire_gradients_reach_c_threshold_and_mlp():
    module = fire_module(threshold=32.0)
    module.values(*grid(0, 16, 16)).pow(2).sum().backward()  # queries below the threshold: L counts
    assert_gradients(module.named_parameters())
    assert {name for name, _ in module.named_parameters()} == {
        "inner.weight", "inner.bias", "outer.weight", "outer.bias", "raw_c", "raw_threshold"}


def test_fire_init_and_half_parameters():
    module = Fire(4)
    assert module.c.item() == pytest.approx(0.1, rel=1e-5)
    assert module.threshold.item() == pytest.approx(512.0, rel=1e-5)
    full = module.values(*grid(0, 6, 6))
    assert len({tuple(full[h, 5].tolist()) for h in range(4)}) == 4  # the heads differ at step 0
    module.half()
    half = module.values(*grid(0, 6, 6))
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=1e-2, atol=1e-2)


def test_fire_incremental_and_long():
    module = fire_module()
    assert_incremental(module)
    far = module.values(*grid(LONG, 1, LONG + 1))[:, 0]
    assert torch.isfinite(far).all()
    for j in (0, 1, 30000, LONG):
        torch.testing.assert_close(far[:, j].double(), naive_fire(module, LONG, j), rtol=1e-4, atol=1e-5)
