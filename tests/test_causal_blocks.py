"""The query-blocked causal path (``fairseq_alibi.core.causal_blocks``, ``alibi_attention
=blocked``, CPU training of causal stacks) against independent references:
forward and gradients, fp32, bf16 and fp16, right padding, lengths that are not a
multiple of the block, with and without attention dropout."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
import torch

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from conftest import causal_bias, fairseq_config
from fairseq_alibi.core import alibi
from fairseq_alibi.core.scaling import NO_SCALING, Scaling
from fairseq_alibi.core import kernels as K
from fairseq_alibi.core import causal_blocks as CB
from fairseq_alibi.models.attention import PositionMultiheadAttention
from fairseq_alibi.core import positions
from fairseq_alibi.core.bias import AlibiBias

BF16_REL, BF16_ABS = 5e-2, 5e-2


def assert_close(actual, expected, dtype):
    if dtype in (torch.bfloat16, torch.float16):
        err, size = (actual.float() - expected).norm(), expected.norm()
        assert err <= BF16_REL * size + BF16_ABS, f"|error| {err:.4f} for |expected| {size:.4f}"
    else:
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def explicit_attention(q, k, v, bias, pad=None, keep_mask=None, p=0.0):
    """softmax(q k^T / sqrt(d) + bias [+ padding]) [* mask / (1 - p)] @ v, in fp64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5 + bias.double()
    if pad is not None:
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if keep_mask is not None:
        probs = probs * keep_mask.double() / (1 - p)
    return probs @ v


def fixed_keep(full_mask, calls=None):
    """A stand-in for ``CB._keep_mask``: the slice of one fixed dropout mask
    for the block from ``start``, rows reversed where the path asks so (a
    Toeplitz bias's blocks); ``calls`` records (start, shape)."""
    def keep(shape, p, dtype, device, start, reverse=False):
        if calls is not None:
            calls.append((start, shape))
        block = full_mask[:, :, start: start + shape[2], : shape[3]].to(dtype)
        return block.flip(2) if reverse else block
    return keep


def merged(bias, pad=None):
    """The additive mask the module passes: [1, H, T, S] bias, plus -inf at padded keys."""
    mask = bias[None]
    if pad is not None:
        mask = mask.masked_fill(pad[:, None, None, :], float("-inf"))
    return mask


def right_padding(lengths, total):
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]


def qkv(batch, heads, length, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # [T, B, H, D] storage permuted to [B, H, T, D], as the module makes them
    return [
        torch.randn(length, batch, heads, dim, generator=gen).to(dtype).permute(1, 2, 0, 3).requires_grad_()
        for _ in range(3)
    ]


def outputs_and_grads(fn, q, k, v, weight):
    out = fn(q, k, v)
    (out.float() * weight).sum().backward()
    result = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return result


CASES = list(itertools.product((torch.float32, torch.bfloat16, torch.float16), (False, True), (0.0, 0.3)))


@pytest.mark.parametrize("dtype,padded,p", CASES)
def test_blocked_matches_explicit_attention(dtype, padded, p, monkeypatch):
    """37 queries in blocks of 16 (the last one partial), the same dropout mask
    for both sides (the path's draw is replaced by slices of one fixed mask)."""
    batch, heads, length, dim = 3, 4, 37, 8
    q, k, v = qkv(batch, heads, length, dim, dtype)
    bias = causal_bias(alibi.get_slopes(heads), length, length)
    pad = right_padding([37, 20, 9], length) if padded else None
    full_mask = None
    if p > 0:
        gen = torch.Generator().manual_seed(5)
        full_mask = (torch.rand(batch, heads, length, length, generator=gen) >= p).float()
        calls = []
        monkeypatch.setattr(CB, "_keep_mask", fixed_keep(full_mask, calls))
    weight = torch.linspace(-1, 1, batch * heads * length * dim).view(batch, heads, length, dim)
    got = outputs_and_grads(
        lambda q_, k_, v_: CB.blocked_causal_attention(q_, k_, v_, merged(bias, pad).to(dtype), p, block=16),
        q, k, v, weight,
    )
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = outputs_and_grads(
        lambda q_, k_, v_: explicit_attention(q_, k_, v_, bias, pad, full_mask, p), q64, k64, v64, weight
    )
    if p > 0:  # one draw per block, each only as wide as the keys the block sees
        assert calls == [(0, (3, 4, 16, 16)), (16, (3, 4, 16, 32)), (32, (3, 4, 5, 37))]
    real = ~pad[:, None, :, None] if padded else torch.ones(1, dtype=torch.bool)
    for g, w in zip(got, want):
        assert_close(torch.where(real, g, 0.0), torch.where(real, w.float(), 0.0), dtype)


@pytest.mark.slow
def test_blocked_dropout_is_unbiased_and_drops_p():
    """The real draw: about a fraction p of the probabilities is dropped, and the
    mean output over many draws is the output without dropout (the 1/(1-p)
    scale folded into v is right)."""
    torch.manual_seed(0)
    q, k, v = [t.detach() for t in qkv(2, 2, 20, 4, torch.float32)]
    bias = causal_bias(alibi.get_slopes(2), 20, 20)
    p = 0.4
    draws = [CB.blocked_causal_attention(q, k, v, merged(bias), p, block=8) for _ in range(2000)]
    kept = CB._keep_mask((200, 200), p, torch.float32, "cpu", 0)
    assert abs(float(kept.mean()) - (1 - p)) < 0.01
    mean = torch.stack(draws).mean(0)
    exact = CB.blocked_causal_attention(q, k, v, merged(bias), 0.0, block=8)
    assert not torch.allclose(draws[0], exact, atol=1e-3)  # dropout did something
    assert (mean - exact).abs().max() < 0.05 * exact.abs().max()


# --------------------------------------------------------------------- in the module
def make_attention(path, heads=4, embed_dim=32, seed=0, **kwargs):
    torch.manual_seed(seed)
    return PositionMultiheadAttention(embed_dim, heads, AlibiBias(heads), kernel=path, **kwargs)


@pytest.mark.parametrize("dtype,padded", list(itertools.product((torch.float32, torch.bfloat16), (False, True))))
def test_blocked_path_in_module_matches_reference(dtype, padded, monkeypatch):
    """Forward and all gradients (input and parameters) of the module on the
    ``blocked`` path against the ``reference`` path, no dropout."""
    monkeypatch.setattr(CB, "BLOCK", 16)
    length, batch = 37, 3
    x = torch.randn(length, batch, 32)
    pad = right_padding([37, 20, 9], length) if padded else None
    results = []
    for path, dt in (("reference", torch.float32), ("blocked", dtype)):
        module = make_attention(path).to(dt)
        xi = x.detach().to(dt).requires_grad_()
        out, _ = module(xi, xi, xi, key_padding_mask=pad, need_weights=False)
        weight = torch.linspace(-1, 1, out.numel()).view_as(out).to(dt)
        (out * weight).sum().backward()
        results.append([out.float()] + [g.float() for g in [xi.grad] + [p.grad for p in module.parameters()]])
    for got, want in zip(results[1], results[0]):
        if padded and got.dim() == 3:  # [T, B, C]: compare real positions only
            got, want = got.transpose(0, 1)[~pad], want.transpose(0, 1)[~pad]
        assert_close(got, want, dtype)


def test_blocked_path_with_dropout_in_module_matches_reference(monkeypatch):
    """Attention dropout in training: the module's blocked path against the
    reference path given the same dropout mask."""
    monkeypatch.setattr(CB, "BLOCK", 8)
    length, batch, heads, p = 21, 2, 4, 0.25
    gen = torch.Generator().manual_seed(3)
    full_mask = (torch.rand(batch, heads, length, length, generator=gen) >= p).float()
    monkeypatch.setattr(CB, "_keep_mask", fixed_keep(full_mask))

    def fixed_dropout(probs, p=0.0, training=True, inplace=False):
        return probs * full_mask / (1 - p)

    x = torch.randn(length, batch, 32)
    results = []
    for path in ("reference", "blocked"):
        module = make_attention(path, dropout=p).train()
        xi = x.detach().clone().requires_grad_()
        with mock.patch.object(K.F, "dropout", fixed_dropout):
            out, _ = module(xi, xi, xi, need_weights=False)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out] + [xi.grad] + [q.grad for q in module.parameters()])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def _choice(module, grad=True, dropout=0.0, device="cpu"):
    with torch.set_grad_enabled(grad), mock.patch.object(K, "flex_available", return_value=True):
        return K.choose_kernel(module.kernel, module.positions, False, 512, 512, dropout, False, torch.device(device))


def test_auto_picks_blocked_for_cpu_training():
    m = make_attention("auto")
    assert _choice(m, dropout=0.1) == "blocked"
    assert _choice(m, dropout=0.0) == "blocked"  # measured faster there too (docs/performance.md)
    assert _choice(m, grad=False, dropout=0.1) == "sdpa"
    assert _choice(m, grad=False) == "sdpa"
    assert _choice(m, dropout=0.1, device="cuda") == "sdpa"


def test_blocked_falls_back_to_sdpa_for_a_non_causal_bias():
    """Symmetric (bidirectional) bias: the blocked path would skip keys the
    queries must see; it is never used there."""
    torch.manual_seed(0)
    m = PositionMultiheadAttention(32, 4, AlibiBias(4, "symmetric"), kernel="auto", dropout=0.1)
    assert _choice(m, dropout=0.1) == "sdpa"
    assert K.check_kernel("blocked", AlibiBias(4, "symmetric")) == "sdpa"
    x = torch.randn(9, 2, 32)
    with mock.patch.object(K, "blocked_causal_attention", wraps=K.blocked_causal_attention) as spy:
        m.train()(x, x, x, need_weights=False)
        assert not spy.called
        causal = make_attention("auto", dropout=0.1).train()
        causal(x, x, x, need_weights=False)
        assert spy.call_count == 1  # the spy sees the path when it is taken


@pytest.mark.parametrize("method", ["t5bias", "kerple", "fire", "nope"])
def test_auto_trains_learned_biases_and_dropout_without_a_bias_on_blocked(method):
    """CPU training: a learned bias takes the blocked path with or without
    dropout (its gradient block by block); no bias at all takes it with
    dropout only (without, SDPA's causal flash kernel); never for inference."""
    bias = build_stack(method)

    def choice(grad=True, dropout=0.0):
        with torch.set_grad_enabled(grad):
            return K.choose_kernel("auto", bias, False, 512, 512, dropout, False, torch.device("cpu"))

    assert choice(dropout=0.1) == "blocked"
    assert choice() == ("sdpa" if method == "nope" else "blocked")
    assert choice(grad=False) != "blocked"
    assert K.check_kernel("blocked", bias) == "blocked"


def test_auto_trains_a_short_fixed_bias_without_dropout_on_sdpa():
    """Up to SHORT_TRAINING queries a fixed bias without attention dropout
    trains through SDPA with the dense bias (one call); longer, with dropout,
    or a learned bias: blocked."""
    alibi_bias, t5 = AlibiBias(4), build_stack("t5bias")

    def choice(bias, q_len, dropout=0.0):
        return K.choose_kernel("auto", bias, False, q_len, q_len, dropout, False, torch.device("cpu"))

    assert choice(alibi_bias, K.SHORT_TRAINING) == "sdpa"
    assert choice(alibi_bias, K.SHORT_TRAINING + 1) == "blocked"
    assert choice(alibi_bias, 64, dropout=0.1) == "blocked"
    assert choice(t5, 64) == "blocked"


def build_stack(method, heads=4, head_dim=16):
    """The position object of ``method`` with its default params, trained at L = 64."""
    params = {param.name: param.default for param in positions.POSITIONS[method].params}
    return positions.build(method, heads, head_dim, params, Scaling("none", train_length=64))


GRAD_CASES = list(itertools.product((torch.float32, torch.bfloat16), (False, True), (0.0, 0.3)))


def gradient_case(dtype, padded, p, monkeypatch, seed):
    """The inputs of a gradient test of the explicit path: (generator, q, k, v,
    ``hidden`` (right of each query), right padding or None, the dropout mask
    (patched in as ``_keep_mask``) or None, the loss's weight); 3 rows, 4 heads,
    30 queries, the last of 41 keys, head size 8."""
    batch, heads, q_len, k_len, dim = 3, 4, 30, 41, 8
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, heads, k_len, dim, generator=gen).to(dtype) for _ in range(2))
    hidden = torch.arange(k_len)[None, :] > torch.arange(q_len)[:, None] + (k_len - q_len)
    pad = right_padding([41, 30, 35], k_len) if padded else None
    full_mask = None
    if p > 0:
        full_mask = (torch.rand(batch, heads, q_len, k_len, generator=gen) >= p).float()
        monkeypatch.setattr(CB, "_keep_mask", fixed_keep(full_mask))
    real = torch.ones(batch, 1, q_len, 1, dtype=torch.bool)
    if padded:  # a padded query row is read by no loss (its keys are all it sees)
        real = ~pad[:, None, k_len - q_len:, None]
    weight = torch.randn(batch, heads, q_len, dim, generator=gen) * real
    return gen, q, k, v, hidden, pad, full_mask, weight


@pytest.mark.parametrize("dtype,padded,p", GRAD_CASES)
def test_blocked_gives_a_learned_bias_its_gradient(dtype, padded, p, monkeypatch):
    """A bias that requires a gradient (``[1, H, T, S]``, broadcast over the
    batch; ``[B, H, T, S]`` once padding is merged in): the blocked path's
    gradient of the bias, and of q, k, v, against autograd through the fp64
    explicit attention with the same dropout mask; 30 queries, the last of 41
    keys (a KV cache's offset), in blocks of 16 (the last one partial)."""
    gen, q, k, v, hidden, pad, full_mask, weight = gradient_case(dtype, padded, p, monkeypatch, seed=7)
    learned = torch.randn(4, 30, 41, generator=gen)  # any bias: not Toeplitz, not ALiBi

    def run(attention, leaf_dtype):
        leaves = [t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v, learned)]
        bias = leaves[3].masked_fill(hidden, float("-inf"))
        (attention(*leaves[:3], bias).double() * weight.double()).sum().backward()
        return [leaf.grad.double() for leaf in leaves]

    got = run(lambda q_, k_, v_, b: CB.blocked_causal_attention(q_, k_, v_, merged(b, pad).to(dtype), p, block=16),
              dtype)
    want = run(lambda q_, k_, v_, b: explicit_attention(q_, k_, v_, b, pad, full_mask, p), torch.float64)
    for name, g, w in zip(("q", "k", "v", "bias"), got, want):
        if name == "bias":
            assert (g[hidden.expand_as(g)] == 0).all()  # nothing right of the diagonal
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=name)
        else:
            assert (g - w).norm() <= BF16_REL * w.norm() + BF16_ABS, name


@pytest.mark.parametrize("dtype,padded,p", GRAD_CASES)
def test_blocked_gives_a_toeplitz_bias_its_gradient_per_distance(dtype, padded, p, monkeypatch):
    """A learned Toeplitz bias given as its values per distance
    (``per_distance`` ``[H, S]``, built into reversed-row block views, its
    gradient summed along anti-diagonals): the output and the gradients of q,
    k, v and the per-distance values against autograd through the fp64
    explicit attention over the dense bias ``w[i - j]`` gathered pair by pair,
    with the same dropout mask; 30 queries, the last of 41 keys, blocks of 16."""
    gen, q, k, v, hidden, pad, full_mask, weight = gradient_case(dtype, padded, p, monkeypatch, seed=11)
    values = torch.randn(4, 41, generator=gen)
    distance = (torch.arange(30)[:, None] + 11 - torch.arange(41)[None, :]).clamp(min=0)

    def run(attention, leaf_dtype):
        leaves = [t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v, values)]
        out = attention(*leaves)
        (out.double() * weight.double()).sum().backward()
        return [out.detach().double()] + [leaf.grad.double() for leaf in leaves]

    padding = None if pad is None else torch.zeros(pad.shape).masked_fill(pad, float("-inf"))[:, None, None, :]
    got = run(lambda q_, k_, v_, w: CB.blocked_causal_attention(
        q_, k_, v_, None if padding is None else padding.to(dtype), p, block=16, per_distance=w), dtype)
    want = run(lambda q_, k_, v_, w: explicit_attention(
        q_, k_, v_, w[:, distance].masked_fill(hidden, float("-inf")), pad, full_mask, p), torch.float64)
    real = torch.ones(1, dtype=torch.bool) if pad is None else ~pad[:, None, 11:, None]
    for name, g, w in zip(("out", "q", "k", "v", "per_distance"), got, want):
        if name in ("out", "q"):
            g, w = torch.where(real, g, 0.0), torch.where(real, w, 0.0)
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=name)
        else:
            assert (g - w).norm() <= BF16_REL * w.norm() + BF16_ABS, name


@pytest.mark.parametrize("dtype,padded,p", GRAD_CASES)
def test_blocked_gives_a_bias_given_block_by_block_its_gradient(dtype, padded, p, monkeypatch):
    """A learned bias given as the bias of each query block (``blocks``: FIRE
    past its threshold), here ``scale_h * table[h, i, j]`` with a table over
    every (query position, key) and a scale per head, each block's rows last
    first, built once and read by two calls (two layers): the outputs and the
    gradients of q, k, v, the table and the scales (autograd summing both
    calls' per-block dS) against autograd through the fp64 explicit attention
    over the dense bias, with the same dropout mask; 30 queries, the last of
    41 keys, blocks of 16."""
    gen, q, k, v, hidden, pad, full_mask, weight = gradient_case(dtype, padded, p, monkeypatch, seed=13)
    table, scale = torch.randn(4, 41, 41, generator=gen), torch.rand(4, generator=gen) + 0.5

    def blocks_of(tab, sc):
        out = []
        for start in range(0, 30, 16):
            rows = torch.arange(11 + min(start + 16, 30) - 1, 11 + start - 1, -1)  # last query first
            keys = 11 + min(start + 16, 30)
            block = sc[:, None, None] * tab[:, rows, :keys]
            out.append(block.masked_fill(torch.arange(keys)[None, :] > rows[:, None], float("-inf")))
        return out

    def run(attention, leaf_dtype):
        leaves = [t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v)]
        params = [t.detach().to(torch.float64 if leaf_dtype == torch.float64 else torch.float32).requires_grad_()
                  for t in (table, scale)]
        shared = attention.prepare(*params)
        outs = [attention(*leaves, shared, twice) for twice in (False, True)]  # two layers, the second reads q twice
        sum((out.double() * weight.double()).sum() for out in outs).backward()
        return [outs[0].detach().double()] + [t.grad.double() for t in leaves + params]

    padding = None if pad is None else torch.zeros(pad.shape).masked_fill(pad, float("-inf"))[:, None, None, :]

    def blocked(q_, k_, v_, blocks, twice):
        q_ = q_ * 2 if twice else q_
        return CB.blocked_causal_attention(q_, k_, v_, None if padding is None else padding.to(dtype), p, block=16,
                                           blocks=blocks)

    def explicit(q_, k_, v_, dense, twice):
        q_ = q_ * 2 if twice else q_
        return explicit_attention(q_, k_, v_, dense, pad, full_mask, p)

    blocked.prepare = blocks_of
    explicit.prepare = lambda tab, sc: (sc[:, None, None] * tab[:, 11:]).masked_fill(hidden, float("-inf"))
    got, want = run(blocked, dtype), run(explicit, torch.float64)
    real = torch.ones(1, dtype=torch.bool) if pad is None else ~pad[:, None, 11:, None]
    for name, g, w in zip(("out", "q", "k", "v", "table", "scale"), got, want):
        if name in ("out", "q"):
            g, w = torch.where(real, g, 0.0), torch.where(real, w, 0.0)
        if name == "table":
            assert (g[:, :11] == 0).all() and (g[:, 11:][hidden.expand_as(g[:, 11:])] == 0).all()  # unread
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=name)
        else:
            assert (g - w).norm() <= BF16_REL * w.norm() + BF16_ABS, name


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("length,near,block", [(300, 37, 128), (300, 1, 64), (129, 128, 128), (200, 113, 16)])
def test_far_and_band_matches_the_dense_bias_and_gives_each_value_its_gradient(dtype, length, near, block):
    """``far_and_band_attention`` (T5's last bucket: one value per head from
    distance D on, a bias-free causal flash call for those keys, a band for
    the nearer ones): the output and the gradients of q, k, v, the values at
    distances below D and the shared far value against autograd through the
    fp64 explicit attention over the dense bias ``w[min(i - j, D)]``; lengths
    that straddle the blocks, D from 1 to T - 1."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = qkv(2, 3, length, 16, dtype, seed=7)
    values = torch.randn(3, near + 1, generator=gen)
    weight = torch.randn(2, 3, length, 16, generator=gen)
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    hidden = distance < 0

    def run(attention, leaf_dtype):
        leaves = [t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v)]
        leaves.append(values.detach().to(torch.float64 if leaf_dtype == torch.float64 else torch.float32).requires_grad_())
        out = attention(*leaves)
        (out.double() * weight.double()).sum().backward()
        return [out.detach().double()] + [leaf.grad.double() for leaf in leaves]

    got = run(lambda q_, k_, v_, w: CB.far_and_band_attention(q_, k_, v_, w, block), dtype)
    want = run(lambda q_, k_, v_, w: explicit_attention(
        q_, k_, v_, w[:, distance.clamp(0, near)].masked_fill(hidden, float("-inf"))), torch.float64)
    for name, g, w in zip(("out", "q", "k", "v", "values"), got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=name)
        else:
            assert (g - w).norm() <= BF16_REL * w.norm() + BF16_ABS, name
    with pytest.raises(ValueError, match="0 < D < T"):
        CB.far_and_band_attention(q, k, v, torch.zeros(3, length + 1))


def test_t5_trains_through_far_and_band_as_through_the_reference(monkeypatch):
    """T5's table through the blocked kernel without padding or dropout, past
    its last bucket's first distance: the flash path runs (each layer one
    call, values up to that distance) and every bucket gets the reference's
    gradient, from the zero init (where every value is equal: the shared
    tail is the buckets', not the values') and away from it; heads of
    ``BAND_HEAD_DIM`` take the per-distance explicit path, with the same
    gradients."""
    bias = build_stack("t5bias")
    shared = bias.shared_from(300)
    assert shared == bias.method.shared_from(300) and 0 < shared < 300
    calls = []
    real = K.far_and_band_attention
    monkeypatch.setattr(K, "far_and_band_attention", lambda q, k, v, w: calls.append(w.shape) or real(q, k, v, w))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 16, generator=gen) for _ in range(3))
    weight = torch.randn(q.shape, generator=gen)
    for moved in (False, True):
        if moved:
            for param in bias.parameters():
                param.data.add_(0.3 * torch.randn_like(param))
        assert_blocked_trains_as_the_reference(bias, q, k, v, weight)
    assert calls == [(4, shared + 1)] * 2
    wide = [t.repeat(1, 1, 1, K.BAND_HEAD_DIM // 16) for t in (q, k, v, weight)]  # heads of 64: the explicit path
    assert_blocked_trains_as_the_reference(bias, *wide)
    assert len(calls) == 2


def test_antidiagonal_sums_against_a_loop():
    m = torch.randn(3, 5, 9, dtype=torch.float64)
    want = torch.zeros(3, 13, dtype=torch.float64)
    for i in range(5):
        for j in range(9):
            want[:, i + j] += m[:, i, j]
    torch.testing.assert_close(CB._antidiagonal_sums(m), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,padded,p", GRAD_CASES)
def test_blocked_builds_fox_bias_per_block_and_gives_c_its_gradient(dtype, padded, p, monkeypatch):
    """FoX's bias ``c_i - c_j`` given as ``c`` (``cumulative``), built block by
    block: the output and the gradients of q, k, v and ``c`` against autograd
    through the fp64 explicit attention over the whole ``c_i - c_j`` square,
    with the same dropout mask; 30 queries, the last of 41 keys (a KV cache's
    offset: cached keys' ``c`` get the column sums only), in blocks of 16."""
    gen, q, k, v, hidden, pad, full_mask, weight = gradient_case(dtype, padded, p, monkeypatch, seed=11)
    batch, heads, k_len = k.shape[:3]
    offset = k_len - q.size(2)
    # a running sum of log gates in (-3, 0): decreasing, per row and head
    c = torch.log(torch.rand(batch, heads, k_len, generator=gen) * 0.95 + 0.05).cumsum(-1)

    def run(attention, leaf_dtype):
        leaves = [t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v)]
        leaves.append(c.detach().to(torch.float64 if leaf_dtype == torch.float64 else torch.float32)
                      .requires_grad_())
        out = attention(*leaves)
        (out.double() * weight.double()).sum().backward()
        return [out.detach().double()] + [leaf.grad.double() for leaf in leaves]

    pad_mask = None if pad is None else torch.zeros(batch, 1, 1, k_len).masked_fill(pad[:, None, None, :],
                                                                                      float("-inf"))
    got = run(lambda q_, k_, v_, c_: CB.blocked_causal_attention(q_, k_, v_, pad_mask, p, block=16, cumulative=c_),
              dtype)
    square = lambda c_: (c_[:, :, offset:, None] - c_[:, :, None, :]).masked_fill(hidden, float("-inf"))
    want = run(lambda q_, k_, v_, c_: explicit_attention(q_, k_, v_, square(c_), pad, full_mask, p), torch.float64)
    for name, g, w in zip(("output", "q", "k", "v", "c"), got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=name)
        else:
            assert (g - w).norm() <= BF16_REL * w.norm() + BF16_ABS, name


@pytest.mark.parametrize("method,threshold", [("t5bias", None), ("kerple", None), ("fire", None), ("fire", 400.0)])
def test_learned_position_biases_train_through_blocked_as_through_the_reference(method, threshold):
    """The position modules' parameters (T5's table, Kerple's r1 r2, FIRE's
    MLP) get the reference kernel's gradient through the blocked path: a
    padded batch of 2 rows, 300 queries (blocks of 128 and a partial one).
    T5, Kerple and FIRE with every query below its threshold run from one
    value per distance (``per_distance``); FIRE past it (threshold 64) from
    the dense bias of every pair."""
    torch.manual_seed(0)
    bias = build_stack(method)
    if threshold is not None:
        bias = positions.build("fire", 4, 16, {"fire_hidden": 32, "fire_threshold": threshold},
                               Scaling("none", train_length=64))
    assert (bias.per_distance(300, "cpu") is None) == (method == "fire" and threshold is None)
    for param in bias.parameters():  # away from the init (T5's zeros)
        param.data.add_(0.3 * torch.randn_like(param))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 16, generator=gen) for _ in range(3))
    pad = right_padding([300, 211], 300)
    weight = torch.randn(q.shape, generator=gen) * ~pad[:, None, :, None]
    assert_blocked_trains_as_the_reference(bias, q, k, v, weight, pad)


def assert_blocked_trains_as_the_reference(bias, q, k, v, weight, pad=None):
    """The blocked kernel's output (its real rows: ``weight`` is 0 at padded
    queries) and the gradients of q, k, v equal the reference kernel's
    element by element; the bias's parameters' gradients to 1e-5 of their
    joint norm.  Those are sums over every (query, key) pair, accumulated in
    another order, and some are 0 in exact arithmetic (a constant added to
    all of a head's scores, FIRE's output bias, changes no softmax), so
    what is left of them is rounding, which an element-wise relative
    tolerance cannot bound (it failed on an AMD EPYC with 1.04e-5 on an
    element of FIRE's inner bias, a gradient of norm 7.3)."""
    results = []
    for kernel in (K.blocked_kernel, K.reference_kernel):
        bias.start_pass()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = kernel(*leaves, bias, pad, 0.0)
        (out * weight).sum().backward()
        results.append(([out.detach() * (weight != 0)] + [t.grad for t in leaves],
                        [p.grad.clone() for p in bias.parameters()]))
        bias.zero_grad()
    (values, param_grads), (want_values, want_param_grads) = results
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    scale = torch.cat([w.flatten() for w in want_param_grads]).norm()
    assert scale > 0
    for got, want in zip(param_grads, want_param_grads):
        assert float((got - want).norm()) <= 1e-5 * float(scale), (float((got - want).norm()), float(scale))


def test_lm_training_with_attention_dropout_takes_blocked_path(tmp_path):
    """A real transformer_lm_alibi training step with --attention-dropout: every
    layer runs the blocked path, and every parameter gets a finite gradient."""
    from fairseq import tasks

    (tmp_path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    cfg = fairseq_config([
        str(tmp_path), "--task", "language_modeling", "--arch", "transformer_lm_alibi", "--cpu",
        "--tokens-per-sample", "16", "--decoder-layers", "2", "--decoder-embed-dim", "32",
        "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4", "--dropout", "0.1",
        "--attention-dropout", "0.1",
    ])
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model).train()
    tokens = torch.randint(4, 44, (3, 16))
    with mock.patch.object(K, "blocked_causal_attention", wraps=K.blocked_causal_attention) as spy:
        model(tokens)[0].float().logsumexp(-1).sum().backward()
    assert spy.call_count == 2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("scaling", [NO_SCALING, Scaling("ntk", 2.0)], ids=["none", "ntk2"])
def test_blocked_key_windows_give_the_reference_forward_and_gradients(scaling, monkeypatch):
    """Without dropout each head's query block reads only the keys within its
    key window (kernels.key_windows): steep heads skip keys whose weights
    together are below float32's rounding; the forward and every gradient are those of the blocked path
    without windows, and the fp64 reference's (to fp32 rounding of scores up to ~80)."""
    heads, length = 8, 1200
    bias = AlibiBias(heads, scaling=scaling)
    q, k, v = (3 * x.detach() for x in qkv(2, heads, length, 16, torch.float32))
    firsts = K.key_windows(bias, q, k)(length - 128, length)
    assert firsts[0] > 0 and firsts[-1] == 0, firsts  # the steepest head skips, the flattest does not
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    def forward_backward(dtype=torch.float32):
        leaves = [x.clone().to(dtype).requires_grad_() for x in (q, k, v)]
        if dtype == torch.float64:
            out = explicit_attention(*leaves, bias.dense(length, length, torch.float32, "cpu"))
        else:
            out, _ = K.blocked_kernel(*leaves, bias, None, 0.0)
        (out * weight.to(dtype)).sum().backward()
        return [out.float()] + [x.grad.float() for x in leaves]

    windowed = forward_backward()
    expected = forward_backward(torch.float64)
    monkeypatch.setattr(K, "key_windows", lambda *a: None)
    whole = forward_backward()
    for got, plain, want in zip(windowed, whole, expected):
        # the calls differ (head groups), and so does rounding: a few float32
        # ulps of values up to ~40, well below either side's error against fp64
        torch.testing.assert_close(got, plain, atol=4e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("item", ["none", "linear", "ntk:2", "ntk", "cap:0.5", "log:1:0.25", "power:1:2"])
def test_blocked_without_dropout_matches_reference_for_every_method(item, monkeypatch):
    """The path without dropout (the flash kernel and its backward per block
    and head, key windows) against the reference kernel for every scaling
    method, static and dynamic: queries the last 200 of 300 keys (a KV cache's
    offset), blocks of 32 (boundaries inside), 2 rows; outputs and gradients."""
    heads, q_len, k_len, train_length = 8, 200, 300, 64
    bias = AlibiBias(heads, scaling=Scaling.parse(item, train_length))
    monkeypatch.setattr(CB, "block_size", lambda n: 32)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, heads, q_len, 16, generator=gen)
    k, v = (torch.randn(2, heads, k_len, 16, generator=gen) for _ in range(2))
    firsts = K.key_windows(bias, q, k)(q_len - 32, q_len)
    # the steepest head skips keys where the bias grows fast enough over 300 keys
    # (not under a cap, nor with slopes divided by 300 / 64 or distances bent past 64)
    assert (firsts[0] > 0) == (item in ("none", "ntk:2", "ntk")), firsts
    weight = torch.randn(2, heads, q_len, 16, generator=gen)
    results = []
    for kernel in (K.blocked_kernel, K.reference_kernel):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, _ = kernel(*leaves, bias, None, 0.0)
        (out * weight).sum().backward()
        results.append([out] + [x.grad for x in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_softmax_above_floor_drops_only_what_weighs_nothing(dtype):
    """The explicit path's floor (``_softmax_above_floor``): rows whose scores
    span hundreds (a steep bias) come out as the softmax in float64 within
    SKIPPED_SHARE of a rounding unit (plus the dtype's own rounding), masked
    keys keep weight exactly 0, and no weight is subnormal (the reason for the
    floor: the CPU computes subnormal numbers many times slower)."""
    keys = 300
    gen = torch.Generator().manual_seed(3)
    ramp = -torch.arange(keys, dtype=torch.float64) * torch.tensor([0.0, 0.25, 1.0, 3.0])[:, None, None]
    scores = (ramp + torch.randn(4, 5, keys, generator=gen, dtype=torch.float64))
    scores[..., -7:] = float("-inf")  # keys right of the query
    expected = torch.softmax(scores, dim=-1)
    got = CB._softmax_above_floor(scores.to(dtype), CB.negligible_gap(keys, dtype)).double()
    eps = torch.finfo(dtype).eps
    assert (got - expected).abs().max() <= 2 * eps + keys * CB.SKIPPED_SHARE * eps
    assert torch.equal(got[..., -7:], torch.zeros_like(got[..., -7:]))
    assert bool((got[got > 0] >= torch.finfo(dtype).tiny).all())
    # the steep rows really had subnormal weights to drop: the floor is not vacuous
    plain = torch.softmax(scores.to(dtype), dim=-1)
    if dtype != torch.float64:
        assert bool(((plain > 0) & (plain < torch.finfo(dtype).tiny)).any())
    assert int((got == 0).sum()) > int((expected == 0).sum())


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0, 3.0])
def test_may_underflow_is_a_sound_bound(scale):
    """``kernels.may_underflow``: where it says no row can reach a subnormal
    weight, no row's scores (content plus a bias of the given span) spread
    past -ln(tiny); an unknown span (inf) always may; the bound is not vacuous
    (small inputs pass, large ones do not)."""
    gen = torch.Generator().manual_seed(4)
    q, k = (scale * torch.randn(2, 3, 50, 16, generator=gen) for _ in range(2))
    span = 10.0
    scores = q @ k.transpose(-1, -2) / 4
    spread = float((scores.amax(-1) - scores.amin(-1)).max()) + span
    verdict = K.may_underflow(q, k, span)
    if not verdict:
        assert spread < -math.log(torch.finfo(torch.float32).tiny)
    assert K.may_underflow(q, k, float("inf"))
    assert verdict == (scale >= 3.0), (scale, spread)
