"""The kernels (``kernels.py``) and the fairseq layer (``attention.py``) against
the reference, the shared-bias / linear-memory properties the model relies on,
and the distance cap on every path.

Fast (well under a minute on 2 CPU cores).  The CUDA-only paths (compiled
FlexAttention, memory-efficient SDPA) have their own tests that skip without a
GPU; FlexAttention compiled on the CPU is checked in ``test_flex.py``.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from conftest import causal_bias, count_sdpa_pairs, fairseq_config

from fairseq_alibi.core import alibi
from fairseq_alibi.core.scaling import NO_SCALING, Scaling
from fairseq_alibi.core import bias as B
from fairseq_alibi.core import kernels as K
from fairseq_alibi.models.attention import PositionMultiheadAttention
from fairseq_alibi.core.bias import AlibiBias, reversed_rows
from fairseq_alibi.core import positions
from fairseq_alibi.core.t5bias import relative_bucket
from fairseq_alibi.errors import ConfigError

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA path; no GPU available")

# fp32: elementwise (atol, rtol) against the fp32 reference.  bf16 (8-bit
# mantissa; parameter gradients are sums of many rounded terms): whole-tensor
# error ||actual - expected|| <= rel * ||expected|| + abs (the floor is for
# gradients that are zero in exact arithmetic, such as k_proj.bias).
TOL = {torch.float32: (2e-5, 1e-4)}
BF16_REL, BF16_ABS = 5e-2, 5e-2


# --------------------------------------------------------------------- helpers
def make_attention(kernel, heads=4, embed_dim=32, seed=0, mode="causal", scaling=NO_SCALING, **kwargs):
    torch.manual_seed(seed)
    return PositionMultiheadAttention(embed_dim, heads, AlibiBias(heads, mode, scaling), kernel=kernel, **kwargs)


def right_padding(lengths, total):
    """[B, T] key padding mask as fairseq's LM task makes it (--sample-break-mode eos)."""
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]


def run(module, x, pad=None, grad=False, dtype=torch.float32):
    """Output (and input/parameter gradients) of one attention forward.

    The gradients are those of a weighted sum over the real rows only: the
    output at a padded query is never read (fairseq's losses skip pad targets),
    and the kernels may leave different values there (a padded query of a
    ``split`` head that sees only padded keys: ``flex`` gives zeros, the
    reference a mean of padded values)."""
    module = module.to(dtype)
    x = x.detach().to(dtype).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, _ = module(x, x, x, key_padding_mask=pad, need_weights=False)
    if not grad:
        return out.float(), None
    # Random weights (the same for every kernel and dtype): a ramp from -1 to 1
    # sums to about zero over the rows, and made a bias gradient a cancelling sum.
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(out.device)
    if pad is not None:
        weight = weight * (~pad).t().unsqueeze(-1).to(weight)
    weight = weight.to(dtype)
    (out * weight).sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return out.float(), [g.float() for g in grads]


def assert_as_accurate_as_reference(kernel, dtype, x, pad, **attention):
    """``kernel`` against the float64 reference (the oracle) on ``x``'s device,
    output and gradients: no further from it than twice the distance of the
    reference kernel run in the same ``dtype``, plus 1e-5 of its norm (the
    check of FlashAttention's own tests).  A GPU reorders and fuses sums, so an
    elementwise tolerance fails on sums that cancel (a bias gradient, zero in
    exact arithmetic, comes out as bf16 noise); a bound relative to the
    reference's own rounding does not, and still fails a wrong bias or mask."""
    device = x.device
    oracle = run(make_attention("reference", **attention).to(device), x, pad, grad=True, dtype=torch.float64)
    same = run(make_attention("reference", **attention).to(device), x, pad, grad=True, dtype=dtype)
    got = run(make_attention(kernel, **attention).to(device), x, pad, grad=True, dtype=dtype)
    names = ["output", "input gradient"] + [n for n, _ in make_attention("reference", **attention).named_parameters()]
    rows = [[real_rows(t, pad) for t in outs] if name == "output" else outs
            for name, outs in zip(names, zip([oracle[0]] + oracle[1], [same[0]] + same[1], [got[0]] + got[1]))]
    ref_errors = [(ref.double() - want).norm().item() for want, ref, _ in rows]
    for name, (want, ref, actual), ref_error in zip(names, rows, ref_errors):
        err = (actual.double() - want).norm().item()
        bound = 2 * ref_error + 1e-5 * want.norm().item() + 1e-6
        if name == "k_proj.bias":
            # Zero in exact arithmetic (a key bias adds q.b to a whole row of
            # scores, which the softmax ignores): pure rounding noise, held to
            # the reference's largest rounding error elsewhere.
            bound = max(bound, max(ref_errors))
        assert err <= bound, f"{kernel} {dtype}, {name}: |error| {err:.3g} > {bound:.3g} (twice the reference's)"


def real_rows(out, pad):
    """Outputs at real (non-pad) positions only: [T, B, C] -> [N, C]."""
    if pad is None:
        return out
    return out.transpose(0, 1)[~pad]


def assert_close(actual, expected, dtype):
    if dtype == torch.bfloat16:
        err, size = (actual.float() - expected).norm(), expected.norm()
        assert err <= BF16_REL * size + BF16_ABS, f"|error| {err:.4f} for |expected| {size:.4f}"
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------- the bias
@pytest.mark.parametrize("q_start,q_len,k_len", [(0, 7, 7), (5, 3, 9), (10, 1, 11), (256, 256, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_block_equals_causal_bias(q_start, q_len, k_len, dtype):
    shared = AlibiBias(6, scaling=Scaling("ntk", 2.0))
    slopes = shared.slopes(k_len)
    block = shared.block(q_start, q_len, k_len, dtype, "cpu")
    assert block.dtype == dtype
    assert torch.equal(block, causal_bias(slopes, q_len, k_len, dtype, "cpu", q_start))


@pytest.mark.parametrize("chunk", [4, 16])
@pytest.mark.parametrize("scaling", [Scaling("linear", 0, 8), Scaling("cap", 0.5, 8),
                                     Scaling("log", 1, 8, 1.0), Scaling("power", 1, 8, 1.5)],
                         ids=["linear", "cap", "log", "power"])
def test_toeplitz_ramp_views_equal_causal_bias(chunk, scaling):
    """The chunked kernel's blocks (reversed-row views of one vector per head)
    against the whole bias, with the slopes of the whole length (dynamic
    scaling) and the cap of the whole model, with and without a KV offset."""
    shared = AlibiBias(3, scaling=scaling)
    k_len = 37
    full = shared.block(0, k_len, k_len, torch.float32, "cpu")
    ramp = K.toeplitz_ramp(shared, k_len, chunk, torch.float32, "cpu")
    assert ramp.shape == (3, k_len + chunk)
    for offset in (0, 5):
        for start in range(0, k_len - offset, chunk):
            rows = min(chunk, k_len - offset - start)
            visible = offset + start + rows
            window = reversed_rows(ramp, offset + start, rows, visible, k_len)
            assert torch.equal(window.flip(1), full[:, offset + start: visible, :visible])


@pytest.mark.parametrize("cap", [None, 0.5])
def test_constant_tail_finds_where_the_bias_stops_changing(cap):
    """T5's buckets are one value from max_distance on; a capped ALiBi from its
    cap; plain ALiBi changes at every distance."""
    table = positions.build("t5bias", 2, 8, {"t5_buckets": 8, "t5_max_distance": 20, "t5_init_slopes": 0.0}, NO_SCALING)
    with torch.no_grad():
        table.method.table.weight.copy_(torch.arange(16.0).view(8, 2))
    found = K.constant_tail(K.toeplitz_ramp(table, 50, 4, torch.float32, "cpu"), 50)
    buckets = [int(b) for b in relative_bucket(-torch.arange(50), False, 8, 20)]
    assert found[0] == buckets.index(7) and torch.equal(found[1], table.method.table.weight[7])
    alibi_bias = AlibiBias(2, scaling=Scaling("cap", cap, 8) if cap else NO_SCALING)
    found = K.constant_tail(K.toeplitz_ramp(alibi_bias, 50, 4, torch.float32, "cpu"), 50)
    assert found is None if cap is None else found[0] == 4


def test_chunked_dynamic_scaling_matches_reference(monkeypatch):
    monkeypatch.setattr(K, "CHUNK_SIZE", 8)
    x = torch.randn(40, 1, 32)
    scaling = Scaling("ntk", 0.0, 10)
    ref, _ = run(make_attention("reference", scaling=scaling), x)
    out, _ = run(make_attention("chunked", scaling=scaling), x)
    assert_close(out, ref, torch.float32)


# --------------------------------------------------------------------- kernels vs reference
CPU_KERNELS = ("sdpa", "chunked")


@pytest.mark.parametrize(
    "kernel,dtype,padded",
    list(itertools.product(CPU_KERNELS, (torch.float32, torch.bfloat16), (False, True))),
)
def test_kernel_matches_reference_forward_and_grad(kernel, dtype, padded, monkeypatch):
    # 37 keys: not a multiple of the chunk (16) nor of any kernel block size.
    monkeypatch.setattr(K, "CHUNK_SIZE", 16)
    length, batch = 37, 3
    x = torch.randn(length, batch, 32)
    pad = right_padding([37, 20, 9], length) if padded else None
    ref_out, ref_grads = run(make_attention("reference"), x, pad, grad=True)
    out, grads = run(make_attention(kernel), x, pad, grad=True, dtype=dtype)
    assert_close(real_rows(out, pad), real_rows(ref_out, pad), dtype)
    for g, ref in zip(grads, ref_grads):
        assert_close(g, ref, dtype)


@pytest.mark.parametrize("mode", ["causal", "symmetric", "split"])
@pytest.mark.parametrize("padded", [False, True])
def test_chunked_without_grad_matches_reference(mode, padded, monkeypatch):
    monkeypatch.setattr(K, "CHUNK_SIZE", 8)
    x = torch.randn(29, 2, 32)
    pad = right_padding([29, 13], 29) if padded else None
    ref, _ = run(make_attention("reference", mode=mode), x, pad)
    out, _ = run(make_attention("chunked", mode=mode), x, pad)
    assert_close(real_rows(out, pad), real_rows(ref, pad), torch.float32)


@pytest.mark.parametrize("scaling", [NO_SCALING, Scaling("ntk", 0, 64), Scaling("log", 1, 256, 1.0),
                                     Scaling("cap", 1, 16)], ids=["none", "ntk", "log", "cap"])
@pytest.mark.fast_cases(1)
def test_chunked_key_windows_skip_far_keys_and_change_nothing(scaling, monkeypatch):
    """ALiBi's own sparsity: steep heads read only the keys whose weight is not
    negligible (kernels.negligible_gap), and the output is the reference's; a cap (bounded
    bias) skips nothing; the flattest head reads everything."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 64)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (3 * torch.randn(2, 8, 1000, 16, generator=gen) for _ in range(3))  # |q||k|/sqrt(D) up to ~100
    bias = AlibiBias(8, scaling=scaling)
    firsts = K.key_windows(bias, q, k)(936, 1000)
    if scaling.method == "cap":
        assert firsts == [0] * 8
    else:
        assert firsts[0] > 0 and firsts[-1] == 0 and firsts == sorted(firsts, reverse=True), firsts
    with torch.no_grad():
        out, _ = K.chunked_kernel(q, k, v, bias, None, 0.0)
        ref, _ = K.reference_kernel(q, k, v, bias, None, 0.0)
        monkeypatch.setattr(K, "key_windows", lambda *a: None)
        whole, _ = K.chunked_kernel(q, k, v, bias, None, 0.0)
    if scaling.method == "cap":  # one value past the cap: far_and_near's merge of two log-sum-exps near 100,
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # each rounded to 2^-17 (float32 at 100)
    else:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["symmetric", "split", "learned"])
@pytest.mark.parametrize("scaling", [NO_SCALING, Scaling("ntk", 0, 8), Scaling("log", 1, 8, 1.0)],
                         ids=["none", "ntk", "log"])
def test_two_sided_ramp_views_equal_the_bidirectional_bias(mode, scaling):
    """An encoder's chunked blocks (reversed-row views of one vector per head
    over every key) against the whole bias, bit for bit: both sides, one-way
    heads' hidden side, the slopes of the whole length."""
    bias = (B.LearnedAlibiBias(3, scaling=scaling) if mode == "learned" else AlibiBias(3, mode=mode, scaling=scaling))
    if mode == "learned":
        with torch.no_grad():
            bias.right.add_(torch.tensor([0.5, -1.0, 2.0]))  # the two sides differ
    k_len = 37
    full = bias.block(0, k_len, k_len, torch.float32, "cpu")
    ramp = B.two_sided_ramp(bias, k_len, torch.float32, "cpu")
    assert ramp.shape == (3, 2 * k_len - 1)
    for start in range(0, k_len, 8):
        rows = min(8, k_len - start)
        assert torch.equal(reversed_rows(ramp, start, rows, k_len, k_len).flip(1), full[:, start:start + rows])


@pytest.mark.parametrize("scaling", [NO_SCALING, Scaling("ntk", 0, 8)], ids=["none", "ntk"])
def test_learned_slopes_dense_bias_is_the_block_with_its_gradients(scaling):
    """Learned slopes' dense bias (copied out of the two-sided ramp) has the
    values of ``block()`` bit for bit, and the same gradients to both sides'
    slopes (summed in another order: close, not equal)."""
    bias = B.LearnedAlibiBias(3, scaling=scaling)
    with torch.no_grad():
        bias.right.add_(torch.tensor([0.5, -1.0, 2.0]))
    weight = torch.randn(3, 37, 37, generator=torch.Generator().manual_seed(7))
    results = []
    for build in (lambda: bias.dense(37, 37, torch.float32, "cpu"),
                  lambda: bias.block(0, 37, 37, torch.float32, "cpu")):
        bias.zero_grad()
        dense = build()
        (dense * weight).sum().backward()
        results.append((dense.detach(), bias.left.grad.clone(), bias.right.grad.clone()))
    (dense, left, right), (block, left_ref, right_ref) = results
    assert torch.equal(dense, block) and dense.is_contiguous()
    torch.testing.assert_close(left, left_ref)
    torch.testing.assert_close(right, right_ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("mode", ["symmetric", "split", "learned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_sided_windows_skip_far_keys_on_both_sides_and_change_nothing(mode, dtype, device, monkeypatch):
    """An encoder's ALiBi in the chunked kernel: steep heads read a window
    around each block (one side only for a split head; learned slopes each
    side by its own slope, in inference only), the flattest head every key
    it sees, and the output is the reference's, and that of the same kernel
    without windows."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 64)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (3 * torch.randn(2, 8, 1000, 16, generator=gen) for _ in range(3))  # |q||k|/sqrt(D) up to ~100
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    bias = B.LearnedAlibiBias(8) if mode == "learned" else AlibiBias(8, mode=mode)
    if mode == "learned":
        bias.to(device)  # its slopes are parameters (fixed ones are built on the device the call runs on)
        with torch.no_grad():
            bias.right.sub_(1.0)  # flatter on the right: narrower windows on the left
        assert K.two_sided_windows(bias, q, k) is None  # training: the slopes' gradient needs every key
        with torch.no_grad():
            spans = K.two_sided_windows(bias, q, k)(448, 512)
        assert all(448 - first < end - 512 for first, end in spans[:4]), spans
    with torch.no_grad():
        span = K.two_sided_windows(bias, q, k)
    blocks = [span(start, min(start + 64, 1000)) for start in range(0, 1000, 64)]
    for start, spans in zip(range(0, 1000, 64), blocks):
        stop = min(start + 64, 1000)
        for (first, end), direction in zip(spans, bias.directions):
            assert first % K.WINDOW_ALIGN == 0 and (end % K.WINDOW_ALIGN == 0 or end == 1000)
            assert first == start if direction == alibi.LOOK_RIGHT else first <= start
            assert end == stop if direction == alibi.LOOK_LEFT else end >= stop
    looks = [h for h, d in enumerate(bias.directions) if d != alibi.LOOK_RIGHT]  # left or both ways
    steep, flattest = looks[0], looks[-1]
    assert any(spans[steep][0] > 0 for spans in blocks) and all(spans[flattest][0] == 0 for spans in blocks)
    steep_right = 4 if mode == "split" else 0  # right or both ways
    assert any(spans[steep_right][1] < 1000 for spans in blocks)
    with torch.no_grad():
        out, _ = K.chunked_kernel(q, k, v, bias, None, 0.0)
        ref, _ = K.reference_kernel(q, k, v, bias, None, 0.0)
        monkeypatch.setattr(K, "two_sided_windows", lambda *a: None)
        whole, _ = K.chunked_kernel(q, k, v, bias, None, 0.0)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        # The keys left out weigh less than a rounding unit together; what remains is the order
        # of the sums (fewer keys, other blocks), a few units of the values' own size (|v| ~ 10:
        # an Intel Xeon differed by 1.19e-6, 1.25 units, where an AMD EPYC stayed under 1e-6).
        torch.testing.assert_close(out, whole, atol=4 * torch.finfo(dtype).eps * float(v.abs().max()), rtol=0)
    else:  # bfloat16 rounds each output (and SDPA's sums differ with the keys it reads): one rounding apart
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), whole.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("slopes", ["alibi", "flat"])
def test_keys_read_counts_the_pairs_the_chunked_kernel_scores(slopes, monkeypatch):
    """``kernels.keys_read`` (the benchmarks' "keys read") against a count of
    every (query, key) pair the chunked kernel hands SDPA: below 1 with ALiBi's
    key windows, just above 1 (each diagonal block's masked half) without."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 64)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, 700, 16, generator=gen) for _ in range(3))
    bias = AlibiBias(8)
    if slopes == "flat":
        bias.base_slopes.mul_(1e-3)  # no key weighs little enough to skip
    scored = count_sdpa_pairs(monkeypatch)
    with torch.no_grad():
        K.chunked_kernel(q, k, v, bias, None, 0.0)
    causal = 8 * 700 * 701 // 2
    assert K.keys_read(bias, q, k) == pytest.approx(sum(scored) / causal)
    if slopes == "alibi":
        assert K.keys_read(bias, q, k) < 0.97  # at 700 tokens only the steepest heads skip keys
    else:
        assert 1 < K.keys_read(bias, q, k) < 1 + 64 / 700


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_windows_bound_holds_for_adversarial_scores(dtype):
    """Keys aligned with the query at the window's edge, the query's own key
    scoring the lowest possible: the keys left out still weigh together less
    than SKIPPED_SHARE of a rounding unit of the softmax sum (weights in fp64),
    and not much less (the window is not needlessly wide)."""
    heads, dim, length = 8, 16, 1200
    q = torch.zeros(1, heads, length, dim)
    k = torch.zeros(1, heads, length, dim)
    q[..., 0], k[..., 0] = 4.0, 4.0  # every score is the largest |q||k|/sqrt(D) = 4
    k[:, :, -1, 0] = -4.0  # the last query's own key scores the lowest possible
    bias = AlibiBias(heads)
    firsts = K.key_windows(bias, q.to(dtype), k.to(dtype))(length - 1, length)
    assert firsts[0] > 0, firsts
    scores = (q[:, :, -1:] @ k.transpose(-1, -2)).double() / dim ** 0.5
    scores = scores + bias.block(length - 1, 1, length, torch.float64, "cpu")
    weights = torch.softmax(scores, dim=-1)[0, :, 0]
    allowed = K.SKIPPED_SHARE * torch.finfo(dtype).eps
    for h, first in enumerate(firsts):
        assert float(weights[h, :first].sum()) <= allowed, (h, first)
    # the steepest head's window ends within WINDOW_ALIGN + a few keys of the bound
    assert float(weights[0, : firsts[0] + K.WINDOW_ALIGN + 8].sum()) > allowed * 1e-6


@pytest.mark.parametrize("own", ["aligned", "random"])
def test_key_windows_leave_out_negligible_mass_for_every_query(own):
    """Every query of a block and every head: the keys before the head's first
    key weigh together at most SKIPPED_SHARE * eps of the row (fp64 softmax),
    also where the window is narrowed by queries scoring high on their own key
    (the row maximum's floor)."""
    heads, dim, length, start = 8, 16, 1500, 1372
    gen = torch.Generator().manual_seed(11)
    k = 3 * torch.randn(1, heads, length, dim, generator=gen)
    q = k.clone() if own == "aligned" else 3 * torch.randn(1, heads, length, dim, generator=gen)
    bias = AlibiBias(heads)
    firsts = K.key_windows(bias, q, k)(start, length)
    assert firsts[0] > 0, firsts
    scores = (q[:, :, start:] @ k.transpose(-1, -2)).double() / dim ** 0.5
    weights = torch.softmax(scores + bias.block(start, length - start, length, torch.float64, "cpu"), dim=-1)[0]
    allowed = K.SKIPPED_SHARE * torch.finfo(torch.float32).eps
    for h, first in enumerate(firsts):
        assert float(weights[h, :, :first].sum(-1).max()) <= allowed, (h, first)


def test_reference_returns_weights_for_need_weights():
    module = make_attention("sdpa")
    x = torch.randn(6, 2, 32)
    with torch.no_grad():
        _, weights = module(x, x, x, need_weights=True)
    assert weights.shape == (2, 6, 6)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 6))
    assert torch.all(weights.triu(1) == 0)


# --------------------------------------------------------------------- the distance cap
CAP = Scaling("cap", 0.25, 20)  # C = 5 tokens


def naive_attention(q, k, v, slopes, cap, pad=None):
    """softmax(q k^T / sqrt(d) - m * min(i - j, cap)) v with a causal mask, by explicit loops over heads."""
    bsz, heads, length, dim = q.shape
    out = torch.empty_like(q, dtype=torch.float64)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    for h in range(heads):
        scores = q[:, h].double() @ k[:, h].double().transpose(-1, -2) / dim**0.5
        scores = scores - float(slopes[h]) * torch.minimum(i - j, torch.tensor(cap)).double()
        scores = scores.masked_fill(j > i, float("-inf"))
        if pad is not None:
            scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[:, h].double()
    return out


def test_capped_reference_kernel_against_naive_attention():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 23, 8, generator=gen) for _ in range(3))
    pad = right_padding([23, 11], 23)
    bias = AlibiBias(4, scaling=CAP)
    out, _ = K.reference_kernel(q, k, v, bias, pad, 0.0)
    expected = naive_attention(q, k, v, bias.base_slopes, CAP.distance_limit, pad)
    torch.testing.assert_close(out[0], expected[0].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :, :11], expected[1, :, :11].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kernel,dtype,padded",
    list(itertools.product(("sdpa", "blocked"), (torch.float32, torch.bfloat16), (False, True))),
)
def test_capped_kernel_matches_reference_forward_and_grad(kernel, dtype, padded):
    length = 37
    x = torch.randn(length, 3, 32)
    pad = right_padding([37, 20, 9], length) if padded else None
    ref_out, ref_grads = run(make_attention("reference", scaling=CAP), x, pad, grad=True)
    out, grads = run(make_attention(kernel, scaling=CAP), x, pad, grad=True, dtype=dtype)
    assert_close(real_rows(out, pad), real_rows(ref_out, pad), dtype)
    for g, ref in zip(grads, ref_grads):
        assert_close(g, ref, dtype)
    plain, _ = run(make_attention("reference"), x, pad)
    assert (plain - ref_out).abs().max() > 1e-3  # the cap is active at this length


@pytest.mark.parametrize("mode", ["causal", "symmetric", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_capped_chunked_matches_reference(mode, dtype, padded, monkeypatch):
    monkeypatch.setattr(K, "CHUNK_SIZE", 8)
    x = torch.randn(29, 2, 32)
    pad = right_padding([29, 13], 29) if padded else None
    ref, _ = run(make_attention("reference", mode=mode, scaling=CAP), x, pad)
    out, _ = run(make_attention("chunked", mode=mode, scaling=CAP), x, pad, dtype=dtype)
    assert_close(real_rows(out, pad), real_rows(ref, pad), dtype)


def test_cap_changes_nothing_within_the_cap():
    """Up to C tokens every distance is below the cap: the output is plain ALiBi's, exactly."""
    x = torch.randn(20, 2, 32)
    for kernel in ("reference", "sdpa", "chunked"):
        plain, _ = run(make_attention(kernel), x)
        capped, _ = run(make_attention(kernel, scaling=Scaling("cap", 1, 19)), x)
        assert torch.equal(plain, capped), kernel


@pytest.mark.slow
def test_cap_property_far_keys_are_interchangeable_at_16k():
    """What only ``cap`` guarantees, on the long-inference (chunked) path: keys
    farther than C from a query all get the bias -m * C, so shuffling them
    (keys and values together) leaves that query's output unchanged, up to the
    order of summation.  Without the cap the same shuffle changes it."""
    length, heads, dim, cap = 16384, 2, 16, 256
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, dim, generator=gen) for _ in range(3))
    first = length - K.CHUNK_SIZE  # the last chunk's queries see keys 0 .. first - cap at distance >= cap
    far = torch.randperm(first - cap + 1, generator=gen)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, : first - cap + 1] = k[:, :, far]
    v2[:, :, : first - cap + 1] = v[:, :, far]
    scaling = Scaling("cap", 1, cap)
    with torch.no_grad():
        for spec, same in ((scaling, True), (NO_SCALING, False)):
            bias = AlibiBias(heads, scaling=spec)
            assert K.choose_kernel("auto", bias, False, length, length) == "chunked"
            a, _ = K.attend(q, k, v, bias, "auto")
            b, _ = K.attend(q, k2, v2, bias, "auto")
            diff = (a[:, :, first:] - b[:, :, first:]).abs().max().item()
            assert (diff < 1e-5) if same else (diff > 1e-3), (spec, diff)


# --------------------------------------------------------------------- auto choice
def _choice(bias, q_len, k_len, grad=True, need_weights=False, incremental=False,
            dropout=0.0, device="cpu", flex=True, kernel="auto"):
    with torch.set_grad_enabled(grad), mock.patch.object(K, "flex_available", return_value=flex):
        return K.choose_kernel(kernel, bias, need_weights, q_len, k_len, dropout, incremental, torch.device(device))


def test_auto_choice():
    b = AlibiBias(4)
    big = 4096
    assert _choice(b, 512, 512) == "blocked"  # CPU training: query blocks skip the keys right of them
    assert _choice(b, big, big) == "blocked"
    assert _choice(b, 512, 512, dropout=0.1) == "blocked"  # SDPA would use its math kernel
    assert _choice(AlibiBias(4, "symmetric"), 512, 512) == "sdpa"
    for encoder in (AlibiBias(4, "symmetric"), AlibiBias(4, "split"), B.LearnedAlibiBias(4)):
        assert _choice(encoder, 512, 512, grad=False) == "sdpa"  # the dense bias is as fast up to 512 queries
        assert _choice(encoder, 513, 513, grad=False) == "chunked"  # its views and two-sided windows from there
        assert _choice(encoder, 768, 768) == "sdpa"  # training: the dense bias (learned slopes' gradient)
        assert _choice(encoder, 1, 768, grad=False, incremental=True) == "sdpa"
        assert _choice(encoder, 768, 768, grad=False, device="cuda", flex=False) == "sdpa"  # measured on CPUs only
    assert _choice(AlibiBias(4, "symmetric"), 512, 512, dropout=0.1) == "sdpa"  # blocked: causal only
    assert _choice(b, 512, 512, grad=False) == "sdpa"
    assert _choice(b, big, big, grad=False) == "chunked"  # long evaluation
    assert _choice(b, 1, 700, grad=False, incremental=True) == "sdpa"
    assert _choice(b, 512, 512, need_weights=True) == "reference"
    assert _choice(b, 512, 512, device="cuda") == "flex"
    assert _choice(b, big, big, grad=False, device="cuda") == "flex"
    assert _choice(b, 512, 512, dropout=0.1, device="cuda") == "sdpa"  # flex has no dropout
    assert _choice(b, 1, 700, grad=False, incremental=True, device="cuda") == "sdpa"
    assert _choice(b, 512, 512, device="cuda", flex=False) == "sdpa"
    assert _choice(b, big, big, grad=False, device="cuda", flex=False) == "chunked"
    for kernel in ("reference", "sdpa", "chunked", "flex", "blocked"):
        assert _choice(b, big, big, grad=False, kernel=kernel) == kernel


def test_kernel_checked_once_at_build():
    """Impossible combinations are refused when the layer is built, naming the
    option; blocked (causal only) becomes sdpa for a bidirectional stack."""
    assert make_attention("blocked", mode="symmetric").kernel == "sdpa"
    assert make_attention("blocked").kernel == "blocked"
    assert make_attention("auto", dropout=0.1).kernel == "auto"
    for kernel, kwargs, message in (
        ("cubic", {}, "alibi_attention='cubic' is not valid; allowed values: auto, reference"),
        ("flex", dict(dropout=0.1), "flex has no attention dropout"),
        ("chunked", dict(dropout=0.1), "chunked has no attention dropout"),
        ("flex", dict(mode="learned"), "flex has a score_mod for ALiBi.s fixed slopes only"),
    ):
        with pytest.raises(ConfigError, match=message):
            make_attention(kernel, **kwargs)


def test_auto_never_picks_flex_for_learned_slopes():
    learned = AlibiBias(4, "learned").for_layer()
    assert isinstance(learned, B.LearnedAlibiBias) and not learned.supports_flex
    assert _choice(learned, 512, 512, device="cuda") == "sdpa"
    assert _choice(learned, 4096, 4096, grad=False, device="cuda") == "chunked"


# --------------------------------------------------------------------- tiny real models
VOCAB = 60


@pytest.fixture(scope="module")
def dict_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dict")
    (path / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(VOCAB - 4)))
    return str(path)


def build_lm(dict_dir, *extra, heads=4, layers=3, arch="transformer_lm_alibi"):
    from fairseq import tasks

    cfg = fairseq_config([
        dict_dir, "--task", "language_modeling", "--arch", arch, "--cpu",
        "--tokens-per-sample", "16", "--decoder-layers", str(layers),
        "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", str(heads), "--dropout", "0.0", *extra,
    ])  # as fairseq-train does
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    return task, task.build_model(cfg.model).eval()


def log_probs(model, tokens):
    with torch.no_grad():
        net_output = model(tokens)
        return model.get_normalized_probs(net_output, log_probs=True)


@pytest.mark.parametrize("method,factor", [("none", "1"), ("linear", "2"), ("ntk", "2"), ("cap", "0.5"),
                                           ("log", "0.5"), ("power", "0.5"), ("capnorm", "0.5")])
@pytest.mark.fast_cases(1)
def test_incremental_decoding_equals_full_forward(dict_dir, method, factor):
    """Static factors and the distance methods (C = 8 tokens here): every step
    of a KV-cache decode equals the full forward, past C too (40 tokens)."""
    _, model = build_lm(dict_dir, "--alibi-interpolation", method, "--alibi-scale-factor", factor)
    tokens = torch.randint(4, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    full = log_probs(model, tokens)
    state = {}
    steps = []
    with torch.no_grad():
        for t in range(tokens.size(1)):
            out = model.decoder(tokens[:, : t + 1], incremental_state=state)
            steps.append(model.get_normalized_probs(out, log_probs=True)[:, -1])
    step = torch.stack(steps, dim=1)
    assert (step - full).abs().max() < 1e-4


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("kernel", ["auto", "reference", "sdpa", "chunked"])
def test_right_padded_batch_equals_rows_alone(dict_dir, kernel, monkeypatch):
    """Right padding (LM task, --sample-break-mode eos): every real token's
    log-probs equal those of its sequence run alone."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 8)
    task, model = build_lm(dict_dir, "--alibi-attention", kernel)
    d = task.source_dictionary
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (23, 11, 17)]
    batch = torch.full((3, 23), d.pad())
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    padded = log_probs(model, batch)
    for i, row in enumerate(rows):
        alone = log_probs(model, row[None])
        assert (padded[i, : len(row)] - alone[0]).abs().max() < 1e-4


class CountingBias:
    def __init__(self):
        self.calls = []
        self.original = alibi.alibi_bias

    def __call__(self, slopes, q_len, k_len, *args, **kwargs):
        out = self.original(slopes, q_len, k_len, *args, **kwargs)
        self.calls.append(tuple(out.shape))
        return out


@pytest.mark.slow
def test_shared_bias_built_once_per_forward_without_batch_dim(dict_dir):
    _, model = build_lm(dict_dir, "--alibi-attention", "auto", heads=4, layers=3)
    model.train()
    tokens = torch.randint(4, VOCAB, (5, 24))
    counter = CountingBias()
    with mock.patch.object(B, "alibi_bias", counter):
        model(tokens)[0].sum().backward()
        assert counter.calls == [(4, 24, 24)]  # one [H, T, T] bias for 3 layers, 5 rows
        model(tokens.flip(0))[0].sum().backward()
        assert len(counter.calls) == 1  # next batch of the same length reuses it
        model(tokens[:, :20])[0].sum().backward()
        assert counter.calls[1:] == [(4, 20, 20)]
    layers = model.decoder.layers
    assert all(layer.self_attn.positions is layers[0].self_attn.positions for layer in layers)


@pytest.mark.slow
def test_padding_mask_merged_once_per_forward(dict_dir):
    task, model = build_lm(dict_dir, layers=3)
    model.train()
    tokens = torch.randint(4, VOCAB, (2, 12))
    tokens[1, 7:] = task.source_dictionary.pad()
    with mock.patch.object(B, "padding_mask", wraps=B.padding_mask) as spy:
        model(tokens)[0].sum().backward()
    assert spy.call_count == 1


class LargestTensors(TorchDispatchMode):
    """Records the shape of every tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.slow
def test_long_inference_builds_nothing_quadratic(dict_dir):
    """A whole-model no-grad forward past the chunking threshold: no tensor with
    two dimensions >= T anywhere (decoder mask included), and the result equals
    the reference path."""
    length = 1100  # 1100^2 > CHUNK_THRESHOLD; not a multiple of CHUNK_SIZE
    _, model = build_lm(dict_dir, heads=2, layers=2)
    tokens = torch.randint(4, VOCAB, (1, length))
    with LargestTensors() as spy:
        fast = log_probs(model, tokens)
    quadratic = [s for s in spy.shapes if sum(d >= length for d in s) >= 2]
    assert not quadratic, quadratic[:5]
    for layer in model.decoder.layers:
        layer.self_attn.kernel = "reference"
    slow = log_probs(model, tokens)
    assert (fast - slow).abs().max() < 1e-4


@pytest.mark.slow
def test_sinusoidal_twin_has_same_parameter_count(dict_dir):
    _, alibi_model = build_lm(dict_dir, "--decoder-input-dim", "32", "--decoder-output-dim", "32")
    _, stock = build_lm(dict_dir, "--decoder-input-dim", "32", "--decoder-output-dim", "32",
                        arch="transformer_lm")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(alibi_model) == count(stock)


# --------------------------------------------------------------------- CUDA only
@needs_cuda
@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_cuda_kernel_matches_reference(kernel, dtype, padded):
    length, batch = 300, 2  # not a multiple of 128 (flex blocks) nor of 8 (mask alignment)
    x = torch.randn(length, batch, 64).cuda()
    pad = right_padding([300, 170], length).cuda() if padded else None
    assert_as_accurate_as_reference(kernel, dtype, x, pad, embed_dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_oracle_check_passes_sdpa_and_fails_a_wrong_bias(dtype, monkeypatch):
    """The CUDA tests' check, here on the CPU: sdpa passes it, and sdpa with
    slopes 10% too flat fails it."""
    x = torch.randn(37, 2, 32)
    pad = right_padding([37, 20], 37)
    assert_as_accurate_as_reference("sdpa", dtype, x, pad)

    def flat_slopes(q, k, v, bias, key_padding_mask, dropout_p):
        mask = bias.merged_mask(0.9 * K._dense(q, k, bias), key_padding_mask)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), None

    monkeypatch.setitem(K.KERNELS, "sdpa", flat_slopes)
    with pytest.raises(AssertionError, match="twice the reference"):
        assert_as_accurate_as_reference("sdpa", dtype, x, pad)


@needs_cuda
def test_cuda_dense_bias_rows_are_aligned():
    bias = AlibiBias(4).dense(301, 301, torch.bfloat16, torch.device("cuda"))
    assert bias.shape == (4, 301, 301) and bias.stride(1) % 8 == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [300, 170])
def test_chunked_runs_a_constant_far_bias_without_a_mask_as_the_reference(dtype, q_len, monkeypatch):
    """T5's bias past its max distance (20 here) is one value per head: the
    chunked kernel runs those keys without a mask and merges them with the
    near keys by log-sum-exp: a full forward in one causal call plus a band
    per block (``far_causal_and_band``), with a KV offset (170 queries) per
    block (``far_and_near``); the output against the reference kernel's over
    the whole dense bias, 300 keys in blocks of 32."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 32)
    table = positions.build("t5bias", 4, 8, {"t5_buckets": 8, "t5_max_distance": 20, "t5_init_slopes": 0.0}, NO_SCALING)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        table.method.table.weight.copy_(torch.randn(8, 4, generator=gen) * 3)
    q = torch.randn(2, 4, q_len, 8, generator=gen).to(dtype)
    k, v = (torch.randn(2, 4, 300, 8, generator=gen).to(dtype) for _ in range(2))
    path = "far_causal_and_band" if q_len == 300 else "far_and_near"
    with torch.no_grad(), mock.patch.object(K, path, wraps=getattr(K, path)) as spy:
        got, _ = K.chunked_kernel(q, k, v, table, None, 0.0)
        want, _ = K.reference_kernel(q.double(), k.double(), v.double(), table, None, 0.0)
    assert spy.call_count == 1 if q_len == 300 else spy.call_count >= q_len // 32 - 1
    assert_close(got.float(), want.float(), dtype)


def test_a_bias_constant_from_distance_1_keeps_each_query_s_own_key_in_the_band(monkeypatch):
    """T5's zero-initialized table is one value at every distance: the band
    of near keys is each query's own key alone (the far call has every other
    key), still the reference's output."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 32)
    table = positions.build("t5bias", 4, 8, {"t5_buckets": 8, "t5_max_distance": 20, "t5_init_slopes": 0.0}, NO_SCALING)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 100, 8, generator=gen) for _ in range(3))
    with torch.no_grad():
        assert K.constant_tail(K.toeplitz_ramp(table, 100, 32, torch.float32, "cpu"), 100)[0] == 1
        got, _ = K.chunked_kernel(q, k, v, table, None, 0.0)
        want, _ = K.reference_kernel(q.double(), k.double(), v.double(), table, None, 0.0)
    assert_close(got.float(), want.float(), torch.float32)


def learned_near_biases(heads: int = 4):
    """A T5 table whose heads 0 and 3 learned to look near (far buckets 45-60
    below the own key's, head 0's rising again at the last bucket: the suffix
    maximum, not the bucket next door, bounds its far keys), head 1 flat and
    head 2 mild; and a Kerple whose first head is steep (r1 = 20)."""
    table = positions.build("t5bias", heads, 8, {"t5_buckets": 8, "t5_max_distance": 20, "t5_init_slopes": 0.0},
                            NO_SCALING)
    rows = torch.tensor([[0.0, -10, -20, -30, -40, -50, -60, -45], [0.0] * 8, [0.0, -1, -2, -3, -4, -5, -6, -7],
                         [0.0, -5, -50, -55, -60, -60, -60, -60]])
    kerple = positions.build("kerple", heads, 8, {}, NO_SCALING)
    with torch.no_grad():
        table.method.table.weight.copy_(rows.T)
        kerple.method.raw_r1[0] = 20.0  # softplus(20) ~ 20
    return {"t5bias": table, "kerple": kerple}


@pytest.mark.parametrize("name", ["t5bias", "kerple"])
@pytest.mark.parametrize("q_len", [700, 300])
def test_distance_windows_skip_the_far_keys_of_a_learned_bias_that_looks_near(name, q_len, monkeypatch):
    """``kernels.distance_windows``: a learned bias of the distance alone leaves
    out, per head, the keys its values make negligible (ALiBi's bound with the
    bias read from its values), in inference only: the steep heads skip keys,
    the flat ones read all; the chunked kernel's output is the reference's, and
    the same as without the windows (T5's heads that read every key keep the
    far call without a mask); under autograd nothing is skipped."""
    monkeypatch.setattr(K, "CHUNK_SIZE", 64)
    bias = learned_near_biases()[name]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, q_len, 8, generator=gen)
    k, v = (torch.randn(1, 4, 700, 8, generator=gen) for _ in range(2))
    with torch.no_grad():
        firsts = K.distance_windows(bias, q, k)(q_len - 64, q_len)
        assert firsts[0] > 0 and firsts[1] == firsts[2] == 0 and (firsts[3] > 0) == (name == "t5bias"), firsts
        assert K.keys_read(bias, q, k) < 0.95  # of 4 heads, 2 (T5) or 1 (Kerple) skip
        got, _ = K.chunked_kernel(q, k, v, bias, None, 0.0)
        want, _ = K.reference_kernel(q.double(), k.double(), v.double(), bias, None, 0.0)
        monkeypatch.setattr(K, "distance_windows", lambda *a: None)
        whole, _ = K.chunked_kernel(q, k, v, bias, None, 0.0)
    assert_close(got, want.float(), torch.float32)
    torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-6)
    monkeypatch.undo()
    assert K.distance_windows(bias, q, k) is None  # grad enabled: the blocked kernel's, over every key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distance_windows_leave_out_negligible_mass_for_every_query(dtype):
    """Every query of a block and every head, the T5 table above, keys aligned
    with their queries (the own key scoring high narrows the floor): the keys
    before a head's first key weigh together at most SKIPPED_SHARE * eps of
    the row (fp64 softmax over the dense bias)."""
    heads, length, start, stop = 4, 900, 800, 864
    bias = learned_near_biases(heads)["t5bias"]
    gen = torch.Generator().manual_seed(12)
    k = 2 * torch.randn(1, heads, length, 8, generator=gen)
    q = k.clone()
    with torch.no_grad():
        firsts = K.distance_windows(bias, q.to(dtype), k.to(dtype))(start, stop)
        scores = (q[:, :, start:stop] @ k.transpose(-1, -2)).double() / 8 ** 0.5
        scores = scores + bias.block(start, stop - start, length, torch.float64, "cpu")
    weights = torch.softmax(scores, dim=-1)[0]
    assert firsts[0] > 0 and firsts[3] > 0, firsts
    allowed = K.SKIPPED_SHARE * torch.finfo(dtype).eps
    for h, first in enumerate(firsts):
        assert float(weights[h, :, :first].sum(-1).max()) <= allowed, (h, first)
