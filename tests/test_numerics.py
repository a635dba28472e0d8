"""fp16/bf16 ALiBi at 16K tokens against an exact reference.

What is compared: the last queries of a 16,384-token causal sequence (the
largest distances), 8 heads (slopes 1/2 .. 1/256), head dim 16.  The bias is
built in the low-precision dtype; everything else is computed in fp32 (or
fp64 for the reference) so that the only difference is the bias precision.

Tolerances, with ``u`` the unit roundoff of the dtype (fp16 ``2**-11``, bf16
``2**-8``):

* bias: softmax ignores a per-row constant, so what matters is the bias
  relative to its row's diagonal.  A correctly rounded ``-m*(i-j)`` is within
  ``u * m * (i-j)`` of exact: errors shrink towards the diagonal, where the
  attention weight is.  That is the check, ``|err| <= u * |exact|``.
* attention output: a score perturbation ``delta_j`` changes the softmax by
  ``dp_j ~ p_j (delta_j - sum_k p_k delta_k)``, so
  ``|do| <= max|v| * sum_j |dp_j| <= 2 * max|v| * sum_j p_j |delta_j|
  <= 2u * max|v| * E_p|b|``, with ``E_p|b|`` the attention-weighted bias
  magnitude of the row (computed from the reference).  The check allows
  twice that first-order bound.

The fork's ``+m*j`` bias rounds values as large as ``m * 16383`` (fp16 steps
of 4-8 at slope 1/2), so its errors near the diagonal are of order one and both
checks fail by orders of magnitude.
"""

import pytest
import torch

from conftest import causal_bias, fork_causal_bias

from fairseq_alibi.core import alibi

LENGTH = 16384
QUERIES = 128  # the last QUERIES positions of the sequence
HEADS = 8
HEAD_DIM = 16
BLOCK = 32  # queries per block of the attention computation
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float16, torch.bfloat16]
Q_START = LENGTH - QUERIES


def _fork_rows(slopes, q_start, q_len, length, dtype):
    """Rows ``q_start ..`` of ``fork_causal_bias`` without its ``[H, N, N]``
    allocation (same formula; pinned to it at a small length below)."""
    key_pos = torch.arange(length, dtype=torch.float32)
    rows = (slopes.float()[:, None] * key_pos).to(dtype)[:, None, :].expand(-1, q_len, -1).clone()
    query_pos = torch.arange(q_start, q_start + q_len)
    above = key_pos[None, :] > query_pos[:, None]
    return rows.masked_fill(above, float("-inf"))


def _bias(form, dtype):
    slopes = alibi.get_slopes(HEADS)
    if form == "ours":
        return causal_bias(slopes, QUERIES, LENGTH, dtype, q_start=Q_START)
    return _fork_rows(slopes, Q_START, QUERIES, LENGTH, dtype)


@pytest.fixture(scope="module")
def exact():
    """fp64 ``-m (i - j)`` for the compared rows, ``-inf`` above the diagonal."""
    slopes = alibi.get_slopes(HEADS).double()
    distance = (torch.arange(Q_START, LENGTH)[:, None] - torch.arange(LENGTH)[None, :]).double()
    bias = -slopes[:, None, None] * distance
    return bias.masked_fill(distance < 0, float("-inf"))


@pytest.fixture(scope="module")
def qkv():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(HEADS, QUERIES, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(HEADS, LENGTH, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(HEADS, LENGTH, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v


def _attention(q, k, v, bias, dtype=torch.float64):
    """softmax(q k^T / sqrt(d) + bias) v in ``dtype``, in query blocks; also
    returns the attention-weighted |bias| per query (for the bound)."""
    outs, weighted = [], []
    q, k, v, bias = (t.to(dtype) for t in (q, k, v, bias))
    for start in range(0, q.size(1), BLOCK):
        stop = start + BLOCK
        scores = q[:, start:stop] @ k.transpose(-1, -2) * HEAD_DIM**-0.5 + bias[:, start:stop]
        probs = torch.softmax(scores, dim=-1)
        outs.append(probs @ v)
        finite = torch.isfinite(bias[:, start:stop])
        magnitude = torch.where(finite, bias[:, start:stop].abs(), torch.zeros_like(probs))
        weighted.append((probs * magnitude).sum(-1))
    return torch.cat(outs, 1), torch.cat(weighted, 1)


@pytest.fixture(scope="module")
def reference(qkv, exact):
    return _attention(*qkv, exact)


def _shifted_error(bias, exact):
    """Error of the bias relative to each row's diagonal (what softmax sees)."""
    bias = bias.double()
    diagonal = torch.arange(QUERIES) + Q_START
    diag_values = bias[:, torch.arange(QUERIES), diagonal][:, :, None]
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(bias)), "mask differs from the exact one"
    return ((bias - diag_values) - exact).abs()[finite], exact.abs()[finite]


def test_fork_rows_helper_matches_fork_causal_bias():
    slopes = alibi.get_slopes(HEADS)
    full = fork_causal_bias(slopes, 512, torch.float16)
    assert torch.equal(_fork_rows(slopes, 448, 64, 512, torch.float16), full[:, 448:])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_within_one_rounding_of_exact(dtype, exact):
    err, magnitude = _shifted_error(_bias("ours", dtype), exact)
    assert bool((err <= UNIT_ROUNDOFF[dtype] * magnitude).all()), float((err / magnitude.clamp_min(1e-30)).max())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fork_bias_fails_the_same_check(dtype, exact):
    err, magnitude = _shifted_error(_bias("fork", dtype), exact)
    bad = err > UNIT_ROUNDOFF[dtype] * magnitude
    assert bool(bad.any())
    # not a marginal miss: near the diagonal (|exact| <= 4) errors reach >= 1
    near = magnitude <= 4
    assert float(err[near].max()) >= 1.0


def _output_check(dtype, form, qkv, reference):
    q, k, v = qkv
    ref_out, weighted_bias = reference
    out, _ = _attention(q, k, v, _bias(form, dtype), dtype=torch.float32)
    err = (out.double() - ref_out).abs().amax(-1)  # per head and query
    bound = 2 * (2 * UNIT_ROUNDOFF[dtype] * v.abs().max() * weighted_bias) + 1e-5
    return err, bound


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_output_with_low_precision_bias(dtype, qkv, reference):
    err, bound = _output_check(dtype, "ours", qkv, reference)
    assert bool((err <= bound).all()), (float(err.max()), float(bound.min()))
    # in absolute terms (measured: fp16 5e-7, bf16 8e-4; the fork: 2.0 and 2.8)
    assert float(err.max()) < {torch.float16: 1e-4, torch.bfloat16: 5e-3}[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fork_attention_output_fails(dtype, qkv, reference):
    err, bound = _output_check(dtype, "fork", qkv, reference)
    assert bool((err > bound).any())
    # the steepest head (slope 1/2) attends mostly to a few nearest keys, whose
    # fork biases are off by whole units: its outputs are visibly wrong
    assert float(err[0].max()) > 0.1
