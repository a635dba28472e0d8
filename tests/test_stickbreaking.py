"""Stick-breaking attention (``core/stickbreaking.py``): the blockwise kernel
and its backward against the naive float64 product, the stick's weights and
remainder, the KV cache, padding, the skip of spent sticks, low precision,
and the layer's terms after the attention."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_alibi.core import native, stickbreaking
from fairseq_alibi.core.errors import ConfigError, ScalingError
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.core.stickbreaking import (StickBreakingOutput, StickBreakingPositions, stickbreaking_attention,
                                              stickbreaking_reference)

HEADS, DIM = 3, 8


def inputs(T: int, S: int = None, batch: int = 2, dtype=torch.float64, seed: int = 0, spread: float = 1.0):
    torch.manual_seed(seed)
    S = S or T
    q = (spread * torch.randn(batch, HEADS, T, DIM, dtype=torch.float64)).to(dtype).requires_grad_()
    k = torch.randn(batch, HEADS, S, DIM, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(batch, HEADS, S, DIM, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def grads(out, rem, tensors, seed: int = 1):
    torch.manual_seed(seed)
    d_out, d_rem = torch.randn(out.shape, dtype=torch.float64), torch.randn(rem.shape, dtype=torch.float64)
    loss = (out.double() * d_out).sum() + (rem.double() * d_rem).sum()
    return torch.autograd.grad(loss, tensors)


# lengths that straddle the blocks: one key block short of, at and past a multiple, cached queries
@pytest.mark.parametrize("T,S,block", [(37, 37, 5), (37, 37, 16), (32, 32, 16), (33, 33, 16), (9, 41, 4),
                                       (1, 20, 7), (20, 20, 128)])
def test_the_kernel_and_its_gradients_are_the_naive_product(T, S, block):
    q, k, v = inputs(T, S)
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, :3] = True
    expected, rem, _ = stickbreaking_reference(q, k, v, pad)
    out, remainder = stickbreaking_attention(q, k, v, pad, block=block)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(remainder, rem, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads(out, remainder, (q, k, v)), grads(expected, rem, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # evaluation: the forward that gathers the heads still reading
        out, remainder = stickbreaking_attention(q, k, v, pad, block=block)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(remainder, rem.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_without_a_gradient_each_head_stops_where_its_own_stick_is_spent(dtype, monkeypatch):
    """Heads 0 and 2 score every key at 8.5 (their sticks spent within a few
    keys), head 1 at -5 (0.7 % of the stick each, never spent in 120 keys):
    without a gradient, heads 0 and 2 stop reading after their first key
    blocks while head 1 reads on alone, in both rows of a batch with one
    left-padded; values and remainders stay the float64 product's (the keys
    left out weigh under 2^-16 of a rounding unit)."""
    q, k, v = inputs(120)
    with torch.no_grad():
        for head in (0, 2):
            q[:, head], k[:, head] = 3.0, 1.0  # z = 3 * 8 / sqrt(8) = 8.5
        q[:, 1], k[:, 1] = 0.0, 0.0
        q[:, 1, :, 0], k[:, 1, :, 0] = 5.0, -(8 ** 0.5)  # z = -5
    pad = torch.zeros(2, 120, dtype=torch.bool)
    pad[1, :7] = True
    expected, rem, _ = stickbreaking_reference(q, k, v, pad)
    assert float(rem[:, 1, -1].min()) > 1e-3 and float(rem[:, 0, 20:].max()) < 1e-30
    heads_read, scored = [], []
    original = stickbreaking._read_block
    monkeypatch.setattr(stickbreaking, "_read_block", lambda qs, *a: heads_read.append(qs.size(0)) or original(qs, *a))
    monkeypatch.setattr(stickbreaking, "_count_scored", scored.append)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    # float32: the whole fused forward first (which stops each head in C++), then block by block in Python
    for fused in ((True, False) if dtype == torch.float32 else (False,)):
        monkeypatch.setenv(native.SWITCH, "1" if fused else "0")
        with torch.no_grad():
            out, remainder = stickbreaking_attention(*(t.to(dtype) for t in (q, k, v)), pad, block=16, key_block=16)
        torch.testing.assert_close(out.double(), expected.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(remainder.double(), rem.detach(), rtol=tol, atol=tol)
    # the first key blocks of a query block read every head of both rows, the later ones head 1 of each alone
    assert max(heads_read) == 2 * HEADS and heads_read.count(2) >= 15 and set(heads_read) <= {2, 2 * HEADS}
    if dtype == torch.float32:  # the fused forward's one count, then the blocks': the same pairs
        assert len(scored) == 1 + len(heads_read) and scored[0] == sum(scored[1:])


# evaluation in float32 and bfloat16 takes the fused CPU loop (core/native.py): against the float64 product and
# the eager passes, at lengths that straddle the blocks and the loop's vectors, with padding, cached queries
@pytest.mark.parametrize("T,S,block,key_block,side", [(37, 37, 16, 16, "left"), (70, 70, 32, 64, "right"),
                                                      (9, 41, 4, 8, "left"), (1, 30, 8, 8, None),
                                                      (130, 130, 128, 256, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_evaluation_through_the_fused_loop_is_the_naive_product(T, S, block, key_block, side, dtype, monkeypatch):
    """The whole C++ forward against the float64 product and the eager passes; the same (query, key) pairs
    scored as the eager path."""
    scored = []
    monkeypatch.setattr(stickbreaking, "_count_scored", scored.append)
    q, k, v = (t.detach() for t in inputs(T, S, spread=2.0))
    pad = None if side is None else torch.zeros(2, S, dtype=torch.bool)
    if side is not None:
        pad[1, slice(0, 3) if side == "left" else slice(S - 2, S)] = True
    expected, rem, _ = stickbreaking_reference(q, k, v, pad)
    low = [t.to(dtype) for t in (q, k, v)]
    with torch.no_grad():
        out, remainder = stickbreaking_attention(*low, pad, block=block, key_block=key_block)
        fused_scored, scored[:] = sum(scored), []
        monkeypatch.setenv(native.SWITCH, "0")
        eager, eager_rem = stickbreaking_attention(*low, pad, block=block, key_block=key_block)
    assert fused_scored == sum(scored) > 0
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bfloat16: its output rounding, the inputs exact in float32
    expected_low, rem_low, _ = stickbreaking_reference(*low, pad)
    torch.testing.assert_close(out.double(), expected_low, rtol=tol, atol=tol)
    torch.testing.assert_close(remainder.double(), rem_low, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out, eager, rtol=tol, atol=tol)
    torch.testing.assert_close(remainder, eager_rem, rtol=2e-5, atol=2e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("T,S,block,key_block,side", [(37, 37, 16, 16, "left"), (70, 70, 32, 64, "right"),
                                                      (9, 41, 4, 8, None), (130, 130, 128, 256, None)])
def test_training_through_the_fused_forward_is_the_naive_product(T, S, block, key_block, side, monkeypatch):
    """Where a gradient is taken in float32, the forward is the fused C++ call and the backward this
    module's own: values and gradients against the float64 product and against the eager forward."""
    calls = []
    real_forward = stickbreaking.native_forward
    monkeypatch.setattr(stickbreaking, "native_forward", lambda *a: calls.append(1) or real_forward(*a))
    q64, k64, v64 = inputs(T, S, spread=2.0)
    pad = None if side is None else torch.zeros(2, S, dtype=torch.bool)
    if side is not None:
        pad[1, slice(0, 3) if side == "left" else slice(S - 2, S)] = True
    expected, rem, _ = stickbreaking_reference(q64, k64, v64, pad)
    want = grads(expected, rem, (q64, k64, v64))
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(native.SWITCH, switch)
        q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
        out, remainder = stickbreaking_attention(q, k, v, pad, block=block, key_block=key_block)
        results[switch] = (out, remainder, grads(out, remainder, (q, k, v)))
    assert len(calls) == 1  # the fused forward ran once, with the loops on
    for out, remainder, got in results.values():
        torch.testing.assert_close(out.double(), expected.detach(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(remainder.double(), rem.detach(), rtol=2e-5, atol=2e-5)
        for g, w in zip(got, want):
            assert float((g.double() - w).abs().max()) < 1e-4 * max(1.0, float(w.abs().max()))
    for a, b in zip(results["1"][2], results["0"][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["BTHD", "TBHD", "BHTD"])
def test_inputs_of_any_memory_layout_give_the_naive_products_gradients(layout):
    """q, k, v as permuted views of [B, T, H, D] (heads split from one projection) or [T, B, H, D]
    (fairseq's): the backward sums each block's gradient into views of contiguous tensors (a strided q once
    had its dq summed into a copy and dropped)."""
    shape = {"B": 2, "H": HEADS, "T": 37, "D": DIM}
    torch.manual_seed(0)
    base = [torch.randn([shape[c] for c in layout], dtype=torch.float64, requires_grad=True) for _ in range(3)]
    q, k, v = (t.permute([layout.index(c) for c in "BHTD"]) for t in base)
    out, remainder = stickbreaking_attention(q, k, v, block=8, key_block=16)
    expected, rem, _ = stickbreaking_reference(q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads(out, remainder, base), grads(expected, rem, base)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_weights_of_a_query_sum_to_at_most_one_and_the_rest_is_the_remainder():
    q, k, v = inputs(30, spread=3.0)
    _, rem, weights = stickbreaking_reference(q, k, v)
    weights = weights.detach()
    sums = weights.sum(-1)
    assert bool((sums <= 1 + 1e-12).all()) and bool((weights >= 0).all())
    assert float(sums[..., 1:].min()) < 0.5 < float(sums.max())  # spent sticks and nearly whole ones both occur
    _, remainder = stickbreaking_attention(q, k, v, block=8)
    torch.testing.assert_close(remainder, 1 - sums, rtol=1e-10, atol=1e-12)
    # the query's own key is not among its keys: the first query has none, its remainder is 1
    assert bool((weights.detach().diagonal(dim1=-2, dim2=-1) == 0).all())
    assert bool((remainder[..., 0] == 1).all())


def test_the_nearest_key_takes_its_share_first():
    """Equal scores everywhere: the key at distance d gets beta (1 - beta)^(d - 1)."""
    q = torch.zeros(1, 1, 6, 4, dtype=torch.float64)
    k, v = torch.zeros(1, 1, 6, 4, dtype=torch.float64), torch.randn(1, 1, 6, 4, dtype=torch.float64)
    _, _, weights = stickbreaking_reference(q, k, v)
    assert weights[0, 0, 5].tolist() == [0.5 ** 5, 0.5 ** 4, 0.5 ** 3, 0.5 ** 2, 0.5, 0.0]


def test_incremental_queries_equal_the_full_forward():
    q, k, v = inputs(29)
    full, rem = stickbreaking_attention(q, k, v, block=8)
    for t in range(29):  # one token at a time, the cache holding every earlier key and value
        out, r = stickbreaking_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], block=8)
        torch.testing.assert_close(out, full[:, :, t:t + 1], rtol=0, atol=1e-13)
        torch.testing.assert_close(r, rem[:, :, t:t + 1], rtol=0, atol=1e-13)
    out, r = stickbreaking_attention(q[:, :, 20:], k, v, block=8)  # a chunk after a cached prefix
    torch.testing.assert_close(out, full[:, :, 20:], rtol=0, atol=1e-13)
    with torch.no_grad():  # decoding: each head of a single query stops at its own spent stick
        for t in (0, 1, 9, 28):
            out, r = stickbreaking_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], block=8)
            torch.testing.assert_close(out, full[:, :, t:t + 1].detach(), rtol=0, atol=1e-13)
            torch.testing.assert_close(r, rem[:, :, t:t + 1].detach(), rtol=0, atol=1e-13)


def padded(t: torch.Tensor, extra: int, side: str) -> torch.Tensor:
    """``t`` ``[B, H, T, D]`` with ``extra`` tokens of large garbage on ``side``."""
    garbage = 5.0 + torch.randn(t.shape[:2] + (extra,) + t.shape[3:], dtype=t.dtype)
    return torch.cat([garbage, t] if side == "left" else [t, garbage], dim=2)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_row_equals_its_unpadded_self(side):
    q, k, v = inputs(19, batch=1)
    alone, rem = stickbreaking_attention(q, k, v, block=8)
    extra = 6
    pad = torch.zeros(1, 19 + extra, dtype=torch.bool)
    real = slice(extra, None) if side == "left" else slice(0, 19)
    pad[0, (slice(0, extra) if side == "left" else slice(19, None))] = True
    out, prem = stickbreaking_attention(*(padded(t, extra, side) for t in (q, k, v)), pad, block=8)
    torch.testing.assert_close(out[:, :, real], alone, rtol=0, atol=1e-13)
    torch.testing.assert_close(prem[:, :, real], rem, rtol=0, atol=1e-13)


def test_spent_sticks_skip_the_farther_keys_without_changing_a_number(monkeypatch):
    """Queries aligned with every key spend the stick within a few keys: the
    kernel stops there, and values and gradients stay the reference's."""
    q, k, v = inputs(200, batch=1)
    with torch.no_grad():
        k.fill_(1.0)
        q.fill_(40.0)  # z = 113: log(1 - beta) = -113 per key
    expected, rem, _ = stickbreaking_reference(q, k, v)
    calls = []
    original = stickbreaking._block_terms
    monkeypatch.setattr(stickbreaking, "_block_terms", lambda *a: calls.append(1) or original(*a))
    out, remainder = stickbreaking_attention(q, k, v, block=16)
    forward_calls = len(calls)
    assert forward_calls <= 2 * 13  # the diagonal block and one more per query block, not 13 * 14 / 2
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads(out, remainder, (q, k, v)), grads(expected, rem, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert len(calls) == 2 * forward_calls  # the backward skips the same keys


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_stays_near_the_float64_product(dtype, tol):
    q, k, v = inputs(70, dtype=dtype)
    expected, rem, _ = stickbreaking_reference(q, k, v)
    out, remainder = stickbreaking_attention(q, k, v, block=32)
    assert out.dtype == dtype and remainder.dtype == torch.float32
    scale = float(expected.abs().max())
    assert float((out.double() - expected).abs().max()) < tol * scale
    assert float((remainder.double() - rem).abs().max()) < tol
    for got, want in zip(grads(out, remainder, (q, k, v)), grads(expected, rem, (q, k, v))):
        assert float((got.double() - want).abs().max()) < 4 * tol * float(want.abs().max())


def test_the_remainder_vector_and_the_group_norm():
    """The layer's output: GroupNorm(sum A v + remainder * b_h), one group per head."""
    q, k, v = inputs(12)
    terms = StickBreakingOutput(HEADS, DIM).double()
    with torch.no_grad():
        terms.head_bias.normal_()
        terms.norm.weight.normal_()
        terms.norm.bias.normal_()
    out, rem = stickbreaking_attention(q, k, v)
    got = terms(out, rem)
    x = out + rem[..., None] * terms.head_bias[:, None]  # [B, H, T, D]
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    want = (x - mean) / torch.sqrt(var + terms.norm.eps) * terms.norm.weight.view(HEADS, 1, DIM) \
        + terms.norm.bias.view(HEADS, 1, DIM)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)
    # the remainder reaches the output: the first token (no key, remainder 1) is the norm of b_h alone
    first = (terms.head_bias - terms.head_bias.mean(-1, keepdim=True))
    assert float(first.abs().max()) > 0
    (head_bias_grad,) = torch.autograd.grad(got.sum() + (got ** 2).sum(), terms.head_bias)
    assert float(head_bias_grad.abs().max()) > 0


def test_the_layer_attends_with_its_own_kernel_and_cache():
    """A layer's object: the cache (fairseq's prev_key / prev_value) extended call by call gives the full
    forward; attention dropout and every extension method but none are refused in one line."""
    torch.manual_seed(0)
    layer = StickBreakingPositions(HEADS, DIM).for_layer().double()
    assert layer.own_kernel and layer.for_layer() is layer
    with torch.no_grad():
        layer.terms.head_bias.normal_()
    q, k, v = inputs(11, batch=2)
    x = torch.randn(11, 2, 16, dtype=torch.float64)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, :2] = True
    with torch.no_grad():
        full = layer.attend(q, k, v, x, pad)
        state = {}
        for start, stop in [(0, 4), (4, 5), (5, 11)]:
            part = layer.attend(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], x[start:stop],
                                pad[:, :stop], state)
            torch.testing.assert_close(part, full[:, :, start:stop], rtol=0, atol=1e-12)
    assert state["prev_key"].shape == (2, HEADS, 11, DIM)
    with pytest.raises(ConfigError, match="attention_dropout=0.1 is not valid with stick-breaking"):
        layer.attend(q, k, v, x, None, dropout_p=0.1)
    with pytest.raises(ScalingError, match="logn does not apply to stickbreaking"):
        StickBreakingPositions(HEADS, DIM, Scaling("logn", train_length=64))
