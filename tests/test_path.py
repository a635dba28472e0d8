"""PaTH attention (``core/path.py``): the blockwise kernel against the naive
float64 product of Householder-like matrices (values and gradients), the KV
cache's transformed keys, padding, every ``beta = 0`` as NoPE, PaTH-FoX with
the PaTH part off as FoX, low precision, and the layer's projections."""

import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_alibi.core.fox import ForgetGates, cumulative_gates, gate_bias
from fairseq_alibi.core.kernels import reference_attention
from fairseq_alibi.core.errors import ConfigError, ScalingError
from fairseq_alibi.core.path import PathPositions, PathProjections, path_attention, path_reference
from fairseq_alibi.core.scaling import Scaling

HEADS, DIM = 2, 6


def inputs(S: int, batch: int = 2, dtype=torch.float64, seed: int = 0):
    """``q, k, v, w, beta, c`` of ``S`` tokens (``c``: FoX's cumulative log gates)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(batch, HEADS, S, DIM, dtype=torch.float64) for _ in range(3))
    w = F.normalize(torch.randn(batch, HEADS, S, DIM, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(batch, HEADS, S, dtype=torch.float64)
    c = F.logsigmoid(torch.randn(batch, HEADS, S, dtype=torch.float64) + 2).cumsum(-1)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, w, beta, c)]


def cached_call(q, k, v, w, beta, gate, pad, T: int, block: int):
    """The kernel for the last ``T`` tokens after a cache of the others, built by the kernel itself."""
    S0 = k.size(2) - T
    past = None
    if S0:
        _, past = path_attention(q[:, :, :S0], k[:, :, :S0], v[:, :, :S0], w[:, :, :S0], beta[:, :, :S0],
                                 None if gate is None else gate[..., :S0], None if pad is None else pad[:, :S0],
                                 block=block, return_keys=True)
    out, _ = path_attention(q[:, :, S0:], k[:, :, S0:], v[:, :, S0:], w[:, :, S0:], beta[:, :, S0:], gate, pad,
                            past, v[:, :, :S0] if S0 else None, block=block)
    return out


@pytest.mark.parametrize("S,T,block", [(11, 11, 3), (12, 12, 4), (13, 13, 4), (11, 11, 64), (14, 5, 4),
                                       (9, 1, 2)])
@pytest.mark.parametrize("gated", [False, True])
def test_the_kernel_and_its_gradients_are_the_naive_product(S, T, block, gated):
    q, k, v, w, beta, c = inputs(S)
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, :3] = True
    gate = c if gated else None
    expected, _ = path_reference(q[:, :, S - T:], k, v, w, beta, gate, pad)
    out = cached_call(q, k, v, w, beta, gate, pad, T, block)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.manual_seed(3)
    d_out = torch.randn_like(expected)
    tensors = (q, k, v, w, beta) + ((c,) if gated else ())
    want = torch.autograd.grad((expected * d_out).sum(), tensors, allow_unused=True)
    got = torch.autograd.grad((out * d_out).sum(), tensors, allow_unused=True)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block,dense", [(2, False), (3, True), (8, True)])
def test_both_forms_of_a_blocks_product_give_the_naive_product(block, dense):
    """A query is carried through a block as the d x d matrix where d <= 2c, else as two thin products: both
    give the reference's values and gradients (DIM = 6: blocks of 2 take the thin form)."""
    from fairseq_alibi.core import path
    q, k, v, w, beta, c = inputs(13)
    blocked = [path._blocked(t, -(-13 // block), block) for t in (q, k, w, beta)]
    assert (len(path._block_terms(*blocked)[3]) == 1) == dense
    expected, _ = path_reference(q, k, v, w, beta, c)
    out, _ = path_attention(q, k, v, w, beta, c, block=block)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    d_out = torch.randn_like(expected)
    tensors = (q, k, v, w, beta, c)
    for g, e in zip(torch.autograd.grad((out * d_out).sum(), tensors), torch.autograd.grad((expected * d_out).sum(),
                                                                                         tensors)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)



@pytest.mark.parametrize("block,S,sweep_block,merges", [(2, 37, 128, 0), (4, 37, 128, 1), (4, 70, 16, 2),
                                                        (4, 45, 64, 1), (4, 30, 64, 0)])
def test_the_training_sweep_and_its_own_backward_are_the_naive_product(block, S, sweep_block, merges, monkeypatch):
    """Where a gradient is taken the sweep is ``_TrainingSweep`` (its backward written out, not autograd's) on the
    block terms merged in pairs (up to SWEEP_BLOCK tokens, at least SWEEP_STEPS merged blocks; none where a
    block's product takes the thin form, blocks of 2 here): many blocks, lengths that are no multiple of a
    merged block, the gate and padding on both sides of a row, in float64."""
    from fairseq_alibi.core import path
    monkeypatch.setattr(path, "SWEEP_BLOCK", sweep_block)
    assert path._merges(S, block, DIM) == merges
    calls = []
    original = path._TrainingSweep.forward
    monkeypatch.setattr(path._TrainingSweep, "forward", staticmethod(lambda *a: calls.append(1) or original(*a)))
    q, k, v, w, beta, c = inputs(S)
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[0, :5], pad[1, S - 7:] = True, True
    expected, _ = path_reference(q, k, v, w, beta, c, pad)
    out, _ = path_attention(q, k, v, w, beta, c, pad, block=block)
    assert calls == [1]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    d_out = torch.randn_like(expected)
    tensors = (q, k, v, w, beta, c)
    got = torch.autograd.grad((out * d_out).sum(), tensors)
    for g, e in zip(got, torch.autograd.grad((expected * d_out).sum(), tensors)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # evaluation: the online sweep alone, in place
        again, _ = path_attention(q, k, v, w, beta, c, pad, block=block)
    assert calls == [1]
    torch.testing.assert_close(again, expected, rtol=1e-12, atol=1e-12)


def test_the_cached_keys_are_the_rank_one_updates():
    """Each new token t carries every cached key through H_t: k <- k - beta_t (k . w_t) w_t."""
    q, k, v, w, beta, _ = inputs(10)
    with torch.no_grad():
        _, keys = path_attention(q, k, v, w, beta, block=4, return_keys=True)
        cache = k[:, :, :1]
        for t in range(1, 10):
            cache = cache - beta[:, :, t, None, None] * (cache @ w[:, :, t, :, None]) * w[:, :, t, None, :]
            cache = torch.cat([cache, k[:, :, t:t + 1]], dim=2)
    torch.testing.assert_close(keys, cache, rtol=1e-12, atol=1e-12)


def test_token_by_token_decoding_equals_the_full_forward():
    q, k, v, w, beta, c = inputs(15)
    with torch.no_grad():
        full, _ = path_attention(q, k, v, w, beta, c, block=4)
        past = None
        for t in range(15):
            out, past = path_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], w[:, :, t:t + 1],
                                       beta[:, :, t:t + 1], c[..., :t + 1], None, past,
                                       v[:, :, :t] if t else None, return_keys=True)
            torch.testing.assert_close(out, full[:, :, t:t + 1], rtol=1e-12, atol=1e-12)


def test_every_beta_zero_is_nope():
    q, k, v, w, beta, _ = inputs(21)
    with torch.no_grad():
        out, _ = path_attention(q, k, v, w, torch.zeros_like(beta), block=8)
    causal = torch.full((21, 21), float("-inf"), dtype=torch.float64).triu(1)
    expected, _ = reference_attention(q.detach(), k.detach(), v.detach(), causal[None])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_path_fox_with_the_path_part_off_is_fox():
    """The gates of fox.py's own layer, with every beta = 0: FoX's softmax exactly."""
    torch.manual_seed(0)
    layer = ForgetGates(HEADS, 16, Scaling()).for_layer().double()
    with torch.no_grad():
        layer.proj.weight.normal_(std=0.4)
        layer.proj.bias.normal_()
    x = torch.randn(21, 2, 16, dtype=torch.float64)
    fox_bias, c = layer.bind(x, None, None)
    q, k, v, w, beta, _ = inputs(21)
    with torch.no_grad():
        out, _ = path_attention(q, k, v, w, torch.zeros_like(beta), c, block=8)
        expected, _ = reference_attention(q, k, v, gate_bias(c.double(), 0, 21, 21))  # FoX float32 gates
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def projections() -> PathProjections:
    """float64 projections with weights large enough that w and beta vary from token to token."""
    torch.manual_seed(0)
    terms = PathProjections(16, HEADS, DIM).double()
    with torch.no_grad():
        for p in terms.parameters():
            p.normal_(std=0.5)
    return terms


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_row_equals_its_unpadded_self(side):
    """Through the layer's projections (the convolution too): padding changes no real token's output."""
    terms = projections()
    x = torch.randn(13, 1, 16, dtype=torch.float64)
    q, k, v = (torch.randn(1, HEADS, 13, DIM, dtype=torch.float64) for _ in range(3))
    extra = 5
    w, beta, _ = terms(x)
    with torch.no_grad():
        alone, _ = path_attention(q, k, v, w, beta, block=4)

    def grow(t: torch.Tensor, dim: int) -> torch.Tensor:  # extra tokens of large garbage on the padded side
        garbage = 5 + torch.randn(t.shape[:dim] + (extra,) + t.shape[dim + 1:], dtype=t.dtype)
        return torch.cat([garbage, t] if side == "left" else [t, garbage], dim)

    pad = torch.zeros(1, 13 + extra, dtype=torch.bool)
    pad[0, (slice(0, extra) if side == "left" else slice(13, None))] = True
    real = slice(extra, None) if side == "left" else slice(0, 13)
    xp = grow(x, 0)
    wp, bp, _ = terms(xp, pad)
    with torch.no_grad():
        out, _ = path_attention(grow(q, 2), grow(k, 2), grow(v, 2), wp, bp, key_padding_mask=pad, block=4)
    torch.testing.assert_close(out[:, :, real], alone, rtol=0, atol=1e-12)


def test_the_projections_carry_the_convolution_across_calls():
    terms = projections()
    x = torch.randn(9, 2, 16, dtype=torch.float64)
    w, beta, _ = terms(x)
    assert w.shape == (2, HEADS, 9, DIM) and beta.shape == (2, HEADS, 9)
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(2, HEADS, 9, dtype=torch.float64), rtol=0, atol=1e-3)
    assert bool(((beta > 0) & (beta < 2)).all())
    state, parts = None, []
    for t in range(9):
        wt, bt, state = terms(x[t:t + 1], None, state)
        parts.append(wt)
        torch.testing.assert_close(bt, beta[:, :, t:t + 1])
    torch.testing.assert_close(torch.cat(parts, 2), w, rtol=1e-12, atol=1e-12)
    plain = PathProjections(16, HEADS, DIM, short_conv=False)
    assert plain.w_conv is None and plain(x.float())[2] is None


@pytest.mark.parametrize("T", [1, 2, 7])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_the_projections_equal_torchs_depthwise_convolution(T, with_prefix):
    """``w`` (values and gradients) against the same projections written with ``F.conv1d`` over ``[B, C, T]``,
    the earlier inputs joined in front (zeros without a state), and the returned state against the last two of
    those inputs; fewer tokens than the convolution's width included."""
    from fairseq_alibi.core.path import CONV_WIDTH, NORM_EPS
    terms = projections()
    x = torch.randn(T, 2, 16, dtype=torch.float64, requires_grad=True)
    prefix = torch.randn(2, HEADS * DIM, CONV_WIDTH - 1, dtype=torch.float64) if with_prefix else None
    w, _, state = terms(x, None, prefix)
    u = terms.w_proj(x).permute(1, 2, 0)  # [B, C, T]
    joined = torch.cat([prefix if with_prefix else u.new_zeros(2, u.size(1), CONV_WIDTH - 1), u], dim=-1)
    conv = F.silu(F.conv1d(joined, terms.w_conv.weight, groups=u.size(1)))  # [B, C, T]
    expected = conv.view(2, HEADS, DIM, T).transpose(2, 3)
    expected = expected * torch.rsqrt((expected * expected).sum(-1, keepdim=True) + NORM_EPS)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, joined[..., -(CONV_WIDTH - 1):], rtol=1e-12, atol=1e-12)
    d_w = torch.randn_like(w)
    parameters = [x, terms.w_conv.weight, terms.w_proj[1].weight]
    got = torch.autograd.grad((w * d_w).sum(), parameters)
    want = torch.autograd.grad((expected * d_w).sum(), parameters)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # without a gradient, the same values (the convolution's output scaled in place)
        torch.testing.assert_close(terms(x, None, prefix)[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 2, 7, 40])
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("dim", [DIM, 40])  # 40: whole vectors of 8 and 16 floats and a remainder
def test_the_fused_projections_are_the_float64_formula(T, with_prefix, dim, monkeypatch):
    """Without a gradient in float32, ``w`` is one C++ pass (``native.path_w``): against the eager projections
    in float64 (the test above ties those to ``F.conv1d``), with and without the convolution's earlier inputs,
    and with the fused calls switched off (the eager path, the same numbers to float32's rounding)."""
    from fairseq_alibi.core import native, path
    from fairseq_alibi.core.path import CONV_WIDTH
    torch.manual_seed(0)
    terms = PathProjections(16, HEADS, dim).double()
    with torch.no_grad():
        for p in terms.parameters():
            p.normal_(std=0.5)
    x = torch.randn(T, 2, 16, dtype=torch.float64)
    prefix = torch.randn(2, HEADS * dim, CONV_WIDTH - 1, dtype=torch.float64) if with_prefix else None
    expected, beta64, state64 = terms(x, None, prefix)
    calls, real = [], path.native_w
    monkeypatch.setattr(path, "native_w", lambda *a: calls.append(1) or real(*a))
    single = terms.float()
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(native.SWITCH, switch)
        with torch.no_grad():
            results[switch] = single(x.float(), None, None if prefix is None else prefix.float())
        assert len(calls) == 1
    (w, beta, state), (eager, _, _) = results["1"], results["0"]
    assert w.dtype == torch.float32 and w.shape == (2, HEADS, T, dim)
    torch.testing.assert_close(w.double(), expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(w, eager, rtol=0, atol=2e-6)
    torch.testing.assert_close(beta.double(), beta64, rtol=0, atol=1e-6)
    torch.testing.assert_close(state.double(), state64, rtol=0, atol=1e-5)
    with torch.enable_grad():  # a gradient: the eager path
        single(x.float(), None, None if prefix is None else prefix.float())[0].sum().backward()
    assert len(calls) == 1


@pytest.mark.parametrize("block,merges", [(16, 0), (4, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_low_precision_stays_near_the_float64_product(dtype, tol, block, merges):
    """Values and gradients, the training sweep on blocks of 16 as they are and on blocks of 4 merged twice."""
    from fairseq_alibi.core import path
    assert path._merges(70, block, DIM) == merges
    q, k, v, w, beta, c = inputs(70, dtype=dtype)
    expected, _ = path_reference(q, k, v, w, beta, c)
    out, _ = path_attention(q, k, v, w, beta, c, block=block)
    assert out.dtype == dtype
    assert float((out.double() - expected).abs().max()) < tol * float(expected.abs().max())
    d_out = torch.randn(expected.shape, dtype=torch.float64)
    want = torch.autograd.grad((expected * d_out).sum(), (q, k, w, beta))
    got = torch.autograd.grad((out.double() * d_out).sum(), (q, k, w, beta))
    for g, e in zip(got, want):
        assert float((g.double() - e).abs().max()) < 4 * tol * float(e.abs().max())


def test_far_keys_below_float32s_normal_range_weigh_nothing():
    """A steep forget gate (-3 per token) puts every row's far keys below exp(-87): the float32 kernel takes
    them as weighing nothing (an exponential landing among subnormals is slow) and stays the float64
    product's, values and gradients; a row whose keys are all padding still gives 0."""
    q, k, v, w, beta, _ = inputs(70, dtype=torch.float32)
    c = torch.full((2, HEADS, 70), -3.0).cumsum(-1).requires_grad_()
    pad = torch.zeros(2, 70, dtype=torch.bool)
    pad[1, :40] = True  # row 1's first 40 queries see padding only
    expected, _ = path_reference(q, k, v, w, beta, c, pad)
    out, _ = path_attention(q, k, v, w, beta, c, pad, block=16)
    assert float((out.double() - expected).abs().max()) < 2e-5 * float(expected.abs().max())
    assert bool((out[1, :, :40] == 0).all())
    d_out = torch.randn(expected.shape, dtype=torch.float64)
    want = torch.autograd.grad((expected * d_out).sum(), (q, k, w, beta, c))
    got = torch.autograd.grad((out.double() * d_out).sum(), (q, k, w, beta, c))
    for g, e in zip(got, want):
        assert float((g.double() - e).abs().max()) < 1e-4 * float(e.abs().max())


def test_long_inputs_run_chunk_by_chunk_as_one_sweep():
    """4,096 tokens without gradients go chunk by chunk (each step of a chunk's sweep holds [B, H, chunk,
    block] scores, the fused call over the keys before the chunk none, never [B, H, T, T]), and give what
    one sweep over the whole row gives."""
    torch.manual_seed(0)
    T = 4096
    q, k, v = (torch.randn(1, 1, T, 16) for _ in range(3))
    w, beta = F.normalize(torch.randn(1, 1, T, 16), dim=-1), 2 * torch.rand(1, 1, T)
    with torch.no_grad():
        out, _ = path_attention(q, k, v, w, beta)
        whole, _ = path_attention(q, k, v, w, beta, chunk=T)
    assert out.shape == (1, 1, T, 16) and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("block,chunk", [(2, 4), (3, 7)])
def test_long_evaluation_chunk_by_chunk_is_the_naive_product(block, chunk, gated, fused, monkeypatch):
    """Without a gradient a row longer than a chunk is read chunk by chunk, each chunk's queries scoring the
    keys before it in one call of torch's fused kernel (or, where it is missing, with the scores written
    out): the float64 product's values, with padding on both sides of a row and a row whose first chunks
    are all padding (outputs 0 there), and the cache's keys at the end as one sweep's."""
    from fairseq_alibi.core import path
    calls = []
    if fused:
        original = path._FUSED_WITH_LSE
        assert original is not None  # torch 2.x's CPU kernel
        monkeypatch.setattr(path, "_FUSED_WITH_LSE", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    else:
        monkeypatch.setattr(path, "_FUSED_WITH_LSE", None)
    q, k, v, w, beta, c = inputs(29)
    gate = c if gated else None
    pad = torch.zeros(2, 29, dtype=torch.bool)
    pad[0, :11], pad[1, 25:] = True, True  # row 0: its first 11 queries see padding only
    expected, _ = path_reference(q, k, v, w, beta, gate, pad)
    with torch.no_grad():
        out, keys = path_attention(q, k, v, w, beta, gate, pad, block=block, chunk=chunk, return_keys=True)
        _, whole = path_attention(q, k, v, w, beta, gate, pad, block=block, chunk=29, return_keys=True)
    assert len(calls) == (-(-29 // chunk) - 1 if fused else 0)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    assert bool((out[0, :, :11] == 0).all())
    torch.testing.assert_close(keys, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_keys_the_gate_has_forgotten_are_left_out_of_the_fused_call(dtype, monkeypatch):
    """PaTH-FoX with a steep gate (-2 per token) in chunks of 8: the fused
    call of each chunk reads only the last cached keys (the earlier ones
    weigh under 2^-16 of a rounding unit for every query), the values stay the
    float64 product's; a gentle gate (-0.01 per token) leaves every key in."""
    from fairseq_alibi.core import path
    read = []
    original = path._FUSED_WITH_LSE
    monkeypatch.setattr(path, "_FUSED_WITH_LSE", lambda q, k, *a, **kw: read.append(k.size(2)) or original(q, k, *a, **kw))
    q, k, v, w, beta, _ = inputs(64, dtype=dtype)
    pad = torch.zeros(2, 64, dtype=torch.bool)
    pad[1, :5] = True
    for step, forgets in ((-2.0, True), (-0.01, False)):
        c = torch.full((2, HEADS, 64), step, dtype=dtype).cumsum(-1)
        expected, _ = path_reference(q, k, v, w, beta, c, pad)
        read.clear()
        with torch.no_grad():
            out, _ = path_attention(q, k, v, w, beta, c, pad, block=4, chunk=8)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out.double(), expected.detach(), rtol=tol, atol=tol)
        cached = list(range(8, 64, 8))  # the keys before chunks 2 .. 8
        if forgets:  # a window of about gap / 2 keys (gap: 36-51 here) and the chunk's reach, however long the row
            assert read[:2] == cached[:2] and max(read) <= 32 < cached[-1], read
        else:
            assert read == cached


def fused_calls(monkeypatch) -> list:
    """Counts the calls of the fused C++ forward (``native.path_forward``) from ``path.py``."""
    from fairseq_alibi.core import path
    calls, real = [], path.native_forward
    monkeypatch.setattr(path, "native_forward", lambda *a: calls.append(1) or real(*a))
    return calls


# evaluation in float32 and bfloat16 without padding takes the fused C++ call (core/native.py): its values and
# the cache's keys against the float64 product and the eager path, at lengths that straddle its blocks and
# chunks (the last of each short), with and without a cache before the new tokens, with and without the gate
@pytest.mark.parametrize("S,T,block,chunk", [(29, 29, 3, 7), (32, 32, 4, 8), (40, 40, 8, 40), (70, 70, 8, 24),
                                             (37, 13, 4, 8), (30, 3, 4, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("gated", [False, True])
def test_evaluation_through_the_fused_call_is_the_naive_product(S, T, block, chunk, dtype, tol, gated, monkeypatch):
    from fairseq_alibi.core import native
    q, k, v, w, beta, c = inputs(S, dtype=dtype)
    gate = c if gated else None
    expected, _ = path_reference(q[:, :, S - T:], k, v, w, beta, gate)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(native.SWITCH, switch)
        calls = fused_calls(monkeypatch)
        with torch.no_grad():
            past = past_values = None
            if S > T:  # the cache, built by the eager path
                monkeypatch.setenv(native.SWITCH, "0")
                _, past = path_attention(q[:, :, :S - T], k[:, :, :S - T], v[:, :, :S - T], w[:, :, :S - T],
                                         beta[:, :, :S - T], None if gate is None else gate[..., :S - T],
                                         block=block, return_keys=True)
                past_values = v[:, :, :S - T]
                monkeypatch.setenv(native.SWITCH, switch)
            new = slice(S - T, S)
            results[switch] = path_attention(q[:, :, new], k[:, :, new], v[:, :, new], w[:, :, new],
                                             beta[:, :, new], gate, past_keys=past, past_values=past_values,
                                             block=block, chunk=chunk, return_keys=True)
        assert len(calls) == (switch == "1")
    (fused, keys), (eager, eager_keys) = results["1"], results["0"]
    assert fused.dtype == dtype and keys.shape == (2, HEADS, S, DIM)
    scale = float(expected.abs().max())
    assert float((fused.double() - expected).abs().max()) < tol * scale
    assert float((fused.double() - eager.double()).abs().max()) < tol * scale
    with torch.no_grad():  # every key carried through every token, as the eager path carries them
        _, whole = path_attention(q.double(), k.double(), v.double(), w.double(), beta.double(), return_keys=True)
    assert float((keys.double() - whole).abs().max()) < tol * float(whole.abs().max())


def test_the_fused_call_serves_what_it_can_compute_exactly(monkeypatch):
    """The fused call runs without a gradient or padding (a mask of no padding counts as none), with or without
    the gate, in float32 and bfloat16, and after a cache where at least D / 2 tokens are new; a gradient,
    padding, float64 and a decoding step keep the eager path."""
    calls = fused_calls(monkeypatch)
    q, k, v, w, beta, c = inputs(12, dtype=torch.float32)
    no_pad, pad = torch.zeros(2, 12, dtype=torch.bool), torch.zeros(2, 12, dtype=torch.bool)
    pad[0, :2] = True
    expect = [({}, True), ({"key_padding_mask": no_pad}, True), ({"gate": c}, True),
              ({"key_padding_mask": pad}, False), ({"gate": c, "key_padding_mask": pad}, False)]
    with torch.no_grad():
        for kwargs, fused in expect:
            calls.clear()
            path_attention(q, k, v, w, beta, block=4, **kwargs)
            assert len(calls) == fused, kwargs
        calls.clear()
        path_attention(*(t.double() for t in (q, k, v, w, beta)), block=4)
        path_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], w[:, :, 10:], beta[:, :, 10:],
                       past_keys=k[:, :, :10].detach(), past_values=v[:, :, :10].detach(), block=4)  # 2 < 6 / 2 new
        assert not calls
        path_attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], w[:, :, 8:], beta[:, :, 8:],
                       past_keys=k[:, :, :8].detach(), past_values=v[:, :, :8].detach(), block=4)
        assert len(calls) == 1
    calls.clear()
    path_attention(q, k, v, w, beta, block=4)[0].sum().backward()
    assert not calls


@pytest.mark.parametrize("S,block,gated,padded", [(29, 4, False, False), (40, 8, True, True), (70, 16, True, False)])
def test_training_through_the_fused_block_terms_is_the_naive_product(S, block, gated, padded, monkeypatch):
    """Where a gradient is taken in float32, the block terms are the C++ forward and its written-out backward
    (``_BlockTerms``): values and gradients of every input against the float64 product, and the eager path's
    (autograd through ``_block_terms``) within float32 rounding; with the gate, padding, and lengths that
    straddle the blocks and their merges."""
    from fairseq_alibi.core import native, path
    calls = []
    real = path.native_block_terms_backward
    monkeypatch.setattr(path, "native_block_terms_backward", lambda *a: calls.append(1) or real(*a))
    q, k, v, w, beta, c = inputs(S, dtype=torch.float32)
    gate = c if gated else None
    pad = None
    if padded:
        pad = torch.zeros(2, S, dtype=torch.bool)
        pad[1, :5] = True
    expected, _ = path_reference(q, k, v, w, beta, gate, pad)
    d_out = torch.randn(expected.shape, dtype=torch.float64)
    tensors = (q, k, v, w, beta) + ((c,) if gated else ())
    want = torch.autograd.grad((expected * d_out).sum(), tensors)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(native.SWITCH, switch)
        out, _ = path_attention(q, k, v, w, beta, gate, pad, block=block)
        results[switch] = (out, torch.autograd.grad((out.double() * d_out).sum(), tensors))
        assert len(calls) == 1  # the fused backward ran once, with the loops on
    (out, got), (eager_out, eager) = results["1"], results["0"]
    assert float((out.double() - expected).abs().max()) < 2e-5 * float(expected.abs().max())
    for g, e, ge in zip(got, want, eager):
        scale = float(e.abs().max())
        assert float((g.double() - e).abs().max()) < 1e-4 * scale
        assert float((g.double() - ge.double()).abs().max()) < 1e-4 * scale


def test_the_fused_call_leaves_out_the_keys_the_gate_has_forgotten(monkeypatch):
    """PaTH-FoX without padding in the fused call: with a steep gate (-2 per token) each chunk of 8 leaves out
    the cached keys the eager path's rule (``_forgotten``) leaves out, decided per head rather than for the
    whole batch (so at least the eager path's pairs), most of them; with a gentle one (-0.01) none; the
    values stay the float64 product's in both."""
    from fairseq_alibi.core import native, path
    skipped, eager_skipped = [], []
    real_forgotten = path._forgotten

    def forgotten(state, flat, *rest):  # the eager rule's first key kept, times the chunk's queries
        first = real_forgotten(state, flat, *rest)
        eager_skipped.append(first * flat.size(0) * flat.size(1) * 8)
        return first

    monkeypatch.setattr(path, "_count_skipped", skipped.append)
    monkeypatch.setattr(path, "_forgotten", forgotten)
    q, k, v, w, beta, _ = inputs(64, dtype=torch.float32)
    cached = 2 * HEADS * 8 * sum(range(8, 64, 8))  # the (query, cached key) pairs of chunks 2 .. 8
    for step, forgets in ((-2.0, True), (-0.01, False)):
        c = torch.full((2, HEADS, 64), step).cumsum(-1)
        expected, _ = path_reference(q, k, v, w, beta, c)
        skipped.clear(), eager_skipped.clear()
        with torch.no_grad():
            out, _ = path_attention(q, k, v, w, beta, c, block=4, chunk=8)
            monkeypatch.setenv(native.SWITCH, "0")
            path_attention(q, k, v, w, beta, c, block=4, chunk=8)
            monkeypatch.delenv(native.SWITCH)
        torch.testing.assert_close(out.double(), expected.detach(), rtol=2e-5, atol=2e-5)
        # per head, at least what the eager rule leaves out for all heads of the batch at once
        assert len(skipped) == 1 and sum(eager_skipped) <= skipped[0]
        assert (cached // 2 < skipped[0] < cached) if forgets else skipped[0] == 0, (skipped, cached)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_chunks_in_low_precision_stay_near_the_float64_product(dtype, tol):
    """70 tokens in chunks of 24 (the last one short) and blocks of 8, the gate on and a left-padded row."""
    q, k, v, w, beta, c = inputs(70, dtype=dtype)
    pad = torch.zeros(2, 70, dtype=torch.bool)
    pad[1, :30] = True
    expected, _ = path_reference(q, k, v, w, beta, c, pad)
    with torch.no_grad():
        out, _ = path_attention(q, k, v, w, beta, c, pad, block=8, chunk=24)
    assert out.dtype == dtype
    assert float((out.double() - expected).abs().max()) < tol * float(expected.abs().max())


@pytest.mark.parametrize("forget_gate", [0, 1, 2])
def test_the_layer_attends_with_its_own_kernel_and_cache(forget_gate):
    """A layer's object (projections, FoX's gate for PaTH-FoX, its bias unscaled (1) or divided by sqrt(d)
    (2): the kernel given the gate's running sums so): its cache, extended call by call, gives the full
    forward; attention dropout and the extension methods without a logit scaling are refused."""
    torch.manual_seed(0)
    layer = PathPositions(HEADS, DIM, 16, forget_gate=forget_gate).for_layer().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.5)
    assert layer.own_kernel and (layer.gate is not None) == bool(forget_gate)
    q, k, v = (torch.randn(2, HEADS, 11, DIM, dtype=torch.float64) for _ in range(3))
    x = torch.randn(11, 2, 16, dtype=torch.float64)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, :2] = True
    with torch.no_grad():
        full = layer.attend(q, k, v, x, pad)
        w, beta, _ = layer.proj(x, pad)
        gate = None if layer.gate is None else layer.gate.bind(x, pad, None)[1] * (DIM ** -0.5 if forget_gate == 2
                                                                                  else 1.0)
        expected, _ = path_attention(q, k, v, w, beta, gate, pad)
    torch.testing.assert_close(full, expected, rtol=0, atol=1e-12)
    with torch.no_grad():
        state = {}
        for start, stop in [(0, 4), (4, 5), (5, 6), (6, 11)]:
            part = layer.attend(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], x[start:stop],
                                pad[:, :stop], state)
            # FoX's gates are float32 by design (fox.log_gates): a running sum continued across calls rounds
            # as float32 does, the rest is float64 here
            torch.testing.assert_close(part, full[:, :, start:stop], rtol=0, atol=1e-5 if forget_gate else 1e-12)
    assert set(state) == {"prev_key", "prev_value", "prev_path_conv"} | ({"prev_positions"} if forget_gate else set())
    with pytest.raises(ConfigError, match="attention_dropout=0.1 is not valid with PaTH"):
        layer.attend(q, k, v, x, None, dropout_p=0.1)
    with pytest.raises(ScalingError, match="linear does not apply to path"):
        PathPositions(HEADS, DIM, 16, scaling=Scaling("linear", 2.0))
    assert PathPositions(HEADS, DIM, 16, scaling=Scaling("logn", train_length=64)).scaling.method == "logn"


@pytest.mark.parametrize("S,D,sizes", [(100, 8, (32, 256)), (100, 64, (32, 256)), (100, 128, (64, 512)),
                                       (4097, 8, (32, 512))])
def test_the_fused_call_takes_short_sizes_where_they_are_faster(S, D, sizes, monkeypatch):
    """Without named sizes, the fused evaluation runs blocks of 32 in chunks of 256 where it sees at most
    ``SHORT_FUSED`` keys and heads of at most 64, else ``inference_block`` and ``CHUNK``; named sizes win."""
    from fairseq_alibi.core import path
    seen = []
    monkeypatch.setattr(path, "native_forward", lambda *a: seen.append(a[8:10]) or (torch.zeros(a[0].shape[:2] + (
        a[4].size(-1),)), 0))
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(1, 1, S, D, generator=gen) for _ in range(4))
    with torch.no_grad():
        path.path_attention(q, k, v, w, torch.rand(1, 1, S, generator=gen))
        path.path_attention(q, k, v, w, torch.rand(1, 1, S, generator=gen), block=16, chunk=64)
    assert seen == [sizes, (16, 64)]
