"""ALiBi attention kernels: free functions with one signature, in one registry.

Pure torch (no fairseq), like ``bias.py``: the fairseq layer
(``attention.PositionMultiheadAttention``) and an exported Hugging Face model run
the same kernels.  Every kernel is

    kernel(q, k, v, bias, key_padding_mask, dropout_p) -> (output, weights or None)

with q ``[B, H, T, D]``, k/v ``[B, H, S, D]`` (queries the last ``T`` of the
``S`` keys, as with a KV cache), ``bias`` the stack's :class:`StackBias` and
``key_padding_mask`` ``[B, S]`` (True at padding).  Each kernel owns its helper
and keeps it in the bias object's cache:

* ``reference``: explicit scores + bias + softmax in fp32; the ground truth,
  and the only kernel that returns attention weights;
* ``sdpa``: ``F.scaled_dot_product_attention`` with one ``[1, H, T, S]`` bias
  broadcast over the batch (``StackBias.dense``, cached across layers);
* ``flex``: FlexAttention (``flex.py``; compiled, on CUDA forward and backward,
  on the CPU forward only), ALiBi as a ``score_mod`` with a cached causal block
  mask: nothing ``T x T`` is materialized; no attention dropout, no learned slopes;
* ``chunked``: queries in blocks, each block's bias a view of one cached
  vector per head, so memory grows linearly with the length (long
  evaluation); no dropout;
* ``blocked``: causal attention in query blocks that only compute the keys they
  can see (``causal_blocks.py``), for CPU training (a learned bias's gradient
  block by block, never ``[B, H, T, T]``; a per-row cumulative term ``c_i -
  c_j`` built per block from ``c``).

A position object may bring a kernel of its own for a name
(``StackBias.own_kernels``: FoX's blocked and chunked paths, ``fox.py``):
:func:`kernel_for` runs it in place of the shared one.

:func:`check_kernel` resolves a configured name once, when a layer is built,
and refuses what can never run; :func:`choose_kernel` picks per call only what
depends on the call (``auto``, attention weights wanted).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .alibi import LOOK_LEFT, LOOK_RIGHT, reach, scaled_slopes
from .bias import StackBias, distance_ramp, padding_mask, reversed_rows, two_sided_ramp
from .errors import ConfigError
from .causal_blocks import (BLOCK, SKIPPED_SHARE, blocked_causal_attention, far_and_band_attention,  # noqa: F401
                            far_and_band_forward, head_groups, merged_parts, negligible_gap)
from .flex import flex_available, flex_kernel
from .logit_scale import scaled_queries
from .scaling import warn_if_cache_drifts

Kernel = Callable[[Tensor, Tensor, Tensor, StackBias, Optional[Tensor], float], Tuple[Tensor, Optional[Tensor]]]

# Inference with more query x key pairs than this is "long" (auto: chunked).
CHUNK_THRESHOLD = 1024 * 1024
# CPU training of a fixed bias without attention dropout up to this many
# queries runs SDPA with the dense bias, one call per layer: the blocked
# kernel's calls per block and head cost more than they skip there, and it
# wins from 512 on (the comparison's L = 64 trained 10% slower than the stock
# model through it; docs/positions.md, "Speed and memory").
SHORT_TRAINING = 256
# Queries per block of the chunked kernel (its ramp: H x (T + CHUNK_SIZE)
# values; docs/performance.md has the measurement behind the size).
CHUNK_SIZE = 256
# An encoder's self-attention in CPU inference past this many queries is "long":
# its chunked views and two-sided windows took at most the time of SDPA with
# the dense bias from 768 tokens on (split and learned slopes less), tied at
# 512 (docs/performance.md, "Encoders (bidirectional ALiBi) in long evaluation").
ENCODER_CHUNKED_FROM = 2 * CHUNK_SIZE


# ----------------------------------------------------------------- dense kernels
def reference_attention(q, k, v, mask, key_padding_mask=None, dropout_p=0.0):
    """Explicit softmax(q k^T / sqrt(d) + mask) v, with ``mask`` the additive
    ``[H, T, S]`` bias tensor.  Shapes: q ``[B,H,T,D]``, k/v ``[B,H,S,D]``.
    Returns (output, probabilities).  Computed in float32, or in float64 for
    float64 inputs (the tests' exact oracle)."""
    exact = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(exact) * q.size(-1) ** -0.5, k.to(exact).transpose(-1, -2))
    scores = scores + mask.to(exact)
    pad = padding_mask(key_padding_mask, exact)
    if pad is not None:
        scores = scores + pad
    probs = masked_softmax(scores)
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(dropped, v.to(exact)).to(q.dtype), probs.to(q.dtype)


def masked_softmax(scores: Tensor) -> Tensor:
    """``softmax`` over the last dimension, a row whose every score is
    ``-inf`` given weights 0 (and gradients 0) instead of NaN, as SDPA and the
    CPU flash kernel give it: a padded query whose keys are all padding (the
    hybrid's sliding window past the end of a short row).  Its output is
    ignored, but a NaN there reached every gradient (0 * NaN)."""
    empty = scores.amax(-1, keepdim=True) == float("-inf")
    return torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def reference_kernel(q, k, v, bias: StackBias, key_padding_mask, dropout_p):
    return reference_attention(q, k, v, _dense(q, k, bias), key_padding_mask, dropout_p)


def sdpa_kernel(q, k, v, bias: StackBias, key_padding_mask, dropout_p):
    if bias.zero and key_padding_mask is None and q.size(2) in (k.size(2), 1):  # no bias: causal alone
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=q.size(2) > 1), None
    mask = bias.merged_mask(_dense(q, k, bias), key_padding_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None


# T5's far-and-band path pays off for narrow heads only: at 8 heads of 32 it took
# T5's training call from 1.76x ALiBi's time to 1.00x on an Intel Xeon and is
# 11% faster than the per-distance explicit path on an AMD EPYC; from 64
# dimensions on, the explicit path's matrix products are as fast on the Xeon
# and 7-40% faster on the EPYC (docs/positions.md, "T5's two training paths").
BAND_HEAD_DIM = 64


def blocked_kernel(q, k, v, bias: StackBias, key_padding_mask, dropout_p):
    k, v = _contiguous(k, v)
    grad = torch.is_grad_enabled()
    per_distance = bias.per_distance(k.size(2), q.device) if bias.learned and grad else None
    if per_distance is not None:  # a learned Toeplitz bias: its values and gradient per distance, never [H, T, S]
        if (dropout_p == 0 and key_padding_mask is None and q.size(2) == k.size(2) and q.device.type == "cpu"
                and q.size(-1) < BAND_HEAD_DIM):
            shared = bias.shared_from(k.size(2))
            if shared is not None:  # T5's far bucket: flash calls, dS only in the band before it
                return far_and_band_attention(q, k, v, per_distance[:, : shared + 1]), None
        values = per_distance.detach()
        return blocked_causal_attention(q, k, v, padding_mask(key_padding_mask, q.dtype), dropout_p,
                                        per_distance=per_distance,
                                        steep=may_underflow(q, k, float(values.max() - values.min()))), None
    blocks = bias.training_blocks(q.size(2), k.size(2), BLOCK, q.device) if bias.learned and grad else None
    if blocks is not None:  # FIRE past its threshold: each block's bias built once per pass, its dS returned per block
        return blocked_causal_attention(q, k, v, padding_mask(key_padding_mask, q.dtype), dropout_p, block=BLOCK,
                                        blocks=blocks, steep=may_underflow(q, k, bias.value_span())), None
    mask = bias.merged_mask(_dense(q, k, bias), key_padding_mask)
    windows = key_windows(bias, q, k) if key_padding_mask is None and dropout_p == 0 else None
    windows = windows or sliding_windows(bias, q.size(1), k.size(2) - q.size(2))
    return blocked_causal_attention(q, k, v, mask, dropout_p, windows=windows,
                                    steep=may_underflow(q, k, bias.value_span())), None


def may_underflow(q: Tensor, k: Tensor, bias_span: float) -> bool:
    """Whether some row's scores may spread so far that ``exp`` of the lowest
    less the largest is a subnormal number (below ``-ln(tiny)``: 87.3 in
    float32 and bfloat16): a content score lies within ``|q_i| K / sqrt(D)``
    of 0 (``K`` the largest key norm), so a row spans at most twice the
    largest of those plus ``bias_span``, the bias's own range (``inf`` where
    not known).  Where it cannot, the explicit path's floor would only spend
    its passes and is skipped (``steep=False``); where
    it may, the floor keeps the subnormal numbers out."""
    if math.isinf(bias_span):
        return True
    content = 2 * q.detach().norm(dim=-1).amax() * k.detach().norm(dim=-1).amax() * q.size(-1) ** -0.5
    return float(content) + bias_span >= -math.log(torch.finfo(q.dtype).tiny)


def _contiguous(*tensors: Tensor) -> List[Tensor]:
    """``[B, H, T, D]``-contiguous copies of keys and values: the CPU flash
    kernel reads them ~15% faster than the projections' ``[T, B, H, D]``
    layout, and every query block reads them again (the queries, read once,
    gain nothing from a copy)."""
    return [t.contiguous() for t in tensors]


def _dense(q, k, bias: StackBias) -> Tensor:
    return bias.dense(q.size(2), k.size(2), q.dtype, q.device)


# ----------------------------------------------------------------- chunked
def toeplitz_ramp(bias: StackBias, k_len: int, extra: int, dtype, device) -> Tensor:
    """The :func:`bias.distance_ramp` of a causal stack whose bias depends on
    ``query - key`` only (``Scaling.relative``: the slopes of a ``k_len``-key
    forward), cached: one vector per head, its values from the last query's
    row, of which every block of queries is a view (:func:`bias.reversed_rows`),
    shared by every layer and block, linear in the length."""
    key = (k_len, extra, dtype, str(device), bias.scaling.factor_at(k_len))
    return bias.cached("ramp", key, lambda: distance_ramp(bias.block(k_len - 1, 1, k_len, dtype, device)[:, 0], extra))


#: Key windows start at multiples of this (fewer distinct head groups per block).
WINDOW_ALIGN = 64


def key_windows(bias: StackBias, q: Tensor, k: Tensor) -> Optional[Callable[[int, int], List[int]]]:
    """ALiBi's own sparsity: ``first(start, stop)`` -> the first key each head
    needs for the queries ``start .. stop - 1`` of a causal call, or None where
    no key can be skipped.

    A key at distance ``d`` scores at most ``|q_i| K / sqrt(D) - m d'(d)``
    (``K`` the head's largest key norm), and its row's maximum is at least the
    query's score of its own key ``s_ii`` (distance 0, no bias); past the
    distance where ``m d'(d)`` exceeds :func:`negligible_gap` plus the block's
    largest ``|q_i| K / sqrt(D) - s_ii``, all such keys together change the
    softmax by less than ``SKIPPED_SHARE`` of a rounding unit, so leaving them
    out is exact to the dtype's precision (the bound is in
    :func:`negligible_gap`).  Steep heads need a few hundred keys, however long
    the input; a cap (bounded bias) or padding (a query's own key may be
    hidden) skips nothing.
    """
    if not (bias.causal and bias.has_slopes):
        return None
    scaling, k_len = bias.scaling, k.size(2)
    slopes = scaled_slopes(scaling, bias.base_slopes, k_len, bias.exponents).tolist()
    offset = k_len - q.size(2)
    floor = negligible_floor(q, k)

    def first(start: int, stop: int) -> List[int]:
        bound = (-floor(start, stop)).tolist()
        firsts = []
        for m, b in zip(slopes, bound):
            window = reach(scaling, b, m)
            nearest = offset + start - math.ceil(window) if math.isfinite(window) else 0
            firsts.append(max(0, nearest // WINDOW_ALIGN * WINDOW_ALIGN))
        return firsts

    return first


def two_sided_windows(bias: StackBias, q: Tensor, k: Tensor) -> Optional[Callable[[int, int], List[Tuple[int, int]]]]:
    """:func:`key_windows` for a bidirectional ALiBi (an encoder's, queries =
    keys, no padding): ``span(start, stop)`` -> the keys ``(first, end)``
    each head needs for the queries ``start .. stop - 1``, or None where no
    head can skip a key.  The bound is the causal one on each side the head
    looks, with that side's slope (a key at distance ``d`` on either side
    scores at most ``|q_i| K / sqrt(D) - m d'(d)``, the query's own key, bias
    0, is in every row); at most ``k_len`` keys are left out in all, as
    there.  A head that looks one way (``split``) reads no key on its hidden
    side of the block.  Learned slopes (``learned``, one per side) are fixed
    numbers in inference and get windows then; in training their gradient
    needs every key."""
    fixed = bias.has_slopes or (bias.learned and not torch.is_grad_enabled())
    if bias.causal or not fixed or q.size(2) != k.size(2):
        return None
    scaling, k_len = bias.scaling, k.size(2)
    slopes = bias.slopes(k_len).detach().float()  # [H], or [2, H]: left, right
    left, right = (slopes[0].tolist(), slopes[1].tolist()) if slopes.dim() == 2 else (slopes.tolist(),) * 2
    floor = negligible_floor(q, k)

    def span(start: int, stop: int) -> List[Tuple[int, int]]:
        bound = (-floor(start, stop)).tolist()
        spans = []
        for m_left, m_right, b, direction in zip(left, right, bound, bias.directions):
            near = [math.ceil(w) if math.isfinite(w) else k_len  # keys this far away weigh nothing
                    for w in (reach(scaling, b, m_left), reach(scaling, b, m_right))]
            first = start if direction == LOOK_RIGHT else max(0, start - near[0])
            end = stop if direction == LOOK_LEFT else stop - 1 + near[1]
            spans.append((first // WINDOW_ALIGN * WINDOW_ALIGN, min(k_len, -(-end // WINDOW_ALIGN) * WINDOW_ALIGN)))
        return spans

    return span


def distance_windows(bias: StackBias, q: Tensor, k: Tensor) -> Optional[Callable[[int, int], List[int]]]:
    """:func:`key_windows` for every other causal bias of the distance alone
    (a learned one's :meth:`StackBias.per_distance`: T5's buckets, Kerple,
    FIRE within its threshold), in inference: ``first(start, stop)`` -> the
    first key each head needs for queries ``start .. stop - 1``, or None where
    no head can skip a key.

    The bound is ALiBi's with the bias read from its values: a key at distance
    ``d`` scores at most ``|q_i| K / sqrt(D) + b(d)`` and its row's maximum is
    at least ``s_ii + b(0)``, so every key at distance ``D`` or more can be
    left out once the largest ``b(d) - b(0)`` over ``d >= D`` (a suffix
    maximum: the bias need not fall monotonically, T5's table may rise again)
    is below ``-(gap + margin)`` (:func:`negligible_gap`,
    :func:`score_margins`).  A head whose far bias stays near its near one (T5
    and Kerple as initialized, most heads of a trained model) keeps every key;
    one that learned to look near skips its far keys, as ALiBi's steep heads
    do.  Inference only: in training a learned bias runs through the blocked
    kernel, whose gradient reaches every distance."""
    if not bias.causal or bias.has_slopes or torch.is_grad_enabled():
        return None
    k_len = k.size(2)
    values = bias.per_distance(k_len, q.device)
    if values is None:
        return None

    def suffix() -> Tensor:
        """How far every key at distance d or more stays below the query's own key
        (the least of ``b(0) - b(d')``, d' >= d): non-decreasing in d, once per pass."""
        table = values.detach().float()
        return (table[:, :1] - table).flip(-1).cummin(-1).values.flip(-1).contiguous()

    below_own = bias.cached("distance_windows", (k_len, str(q.device)), suffix)
    gap = negligible_gap(k_len, q.dtype)
    if not bool((below_own[:, -1] > gap).any()):  # not even the farthest key of any head, with no margin
        return None
    offset = k_len - q.size(2)
    floor = negligible_floor(q, k)

    def first(start: int, stop: int) -> List[int]:
        bound = (-floor(start, stop))[:, None].contiguous()  # [H, 1]
        reach = torch.searchsorted(below_own, bound, right=True)[:, 0].tolist()  # least d below the bound
        # keys at distance >= reach from the block's first query (so from every query) are left out
        return [max(0, offset + start - r + 1) // WINDOW_ALIGN * WINDOW_ALIGN if r < k_len else 0 for r in reach]

    return first


def score_margins(q: Tensor, k: Tensor) -> Tensor:
    """float32 ``[H, T]``: how far any key's content score (``q_i . k_j /
    sqrt(D)``, at most ``|q_i| K_h / sqrt(D)`` with ``K_h`` the head's largest
    key norm) can exceed the query's score of its own key (a floor of its row's
    maximum, where the bias is 0), the largest over the batch: what a key
    window adds to :func:`negligible_gap`."""
    offset = k.size(2) - q.size(2)
    queries, keys = q.detach().float(), k.detach().float()
    key_norm = keys.norm(dim=-1).amax(dim=(0, 2))  # [H]
    own = (queries * keys[:, :, offset:]).sum(-1)  # [B, H, T]
    return ((queries.norm(dim=-1) * key_norm[:, None] - own) * q.size(-1) ** -0.5).amax(dim=0)


def negligible_floor(q: Tensor, k: Tensor) -> Callable[[int, int], Tensor]:
    """``floor(start, stop)`` -> float32 ``[H]``: a bias below which a key
    weighs nothing for the queries ``start .. stop - 1`` of a causal call
    without padding: ``-(gap + margin)`` (:func:`negligible_gap`,
    :func:`score_margins`), the bound of the key windows.  Keys below it
    together weigh less than ``SKIPPED_SHARE`` of a rounding unit of any of
    those rows."""
    margins = score_margins(q, k)
    gap = negligible_gap(k.size(2), q.dtype)
    return lambda start, stop: -(margins[:, start:stop].amax(-1) + gap)


def sliding_windows(bias: StackBias, heads: int, offset: int) -> Optional[Callable[[int, int], List[int]]]:
    """A sliding window's key windows (``bias.window`` keys per query, the
    hybrid's RoPE layers): ``first(start, stop)`` -> the first key every head
    needs for queries ``start .. stop - 1`` (``offset`` keys before the first
    query), or None without a window.  Exact: the keys left out are masked."""
    if bias.window is None or not bias.causal:
        return None

    def first(start: int, stop: int) -> List[int]:
        nearest = max(0, offset + start - bias.window + 1)
        return [nearest // WINDOW_ALIGN * WINDOW_ALIGN] * heads

    return first


def constant_tail(ramp: Tensor, k_len: int) -> Optional[Tuple[int, Tensor]]:
    """``(D, far)`` where every head's bias is one value ``far[h]`` (float32
    ``[H]``) at every distance from ``D`` to ``k_len - 1`` (T5's last bucket
    from its max distance, a capped ALiBi from its cap), read from the
    :func:`toeplitz_ramp` (distances ``k_len - 1`` down to 0); None where only
    the farthest distance has its value (ALiBi, Kerple)."""
    far_to_near = ramp[:, :k_len]
    shared = int((far_to_near == far_to_near[:, :1]).all(0).int().cumprod(0).sum())
    # from distance 1 at least: a block's near part keeps each query's own key (no row without a key)
    return (max(k_len - shared, 1), far_to_near[:, 0].float()) if shared > 1 else None


_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def far_and_near(q: Tensor, k: Tensor, v: Tensor, near: int, far: Tensor, mask: Tensor) -> Tensor:
    """Attention of the queries ``q`` (one block) over keys ``0 .. near - 1``,
    which all share the bias ``far`` (``[H, 1]``, one per head), and keys
    ``near ..`` with their bias ``mask``: two flash calls, the first without
    a mask (bias-free attention's speed over most keys of a long input), merged
    by their log-sum-exps.  Exact: ``softmax`` over the union is the two parts'
    softmaxes weighted by ``exp(lse_part - lse)``, ``far`` added to the first
    part's log-sum-exp; the merge weighs each part by its log-sum-exp, which
    the kernel returns rounded to float32 (its largest score included), so a
    row whose scores reach 100 gets weights within ~1e-5 (relative), where one
    call rounds each weight alone.  Inference only (the log-sum-exps carry no
    gradient)."""
    visible = near + mask.size(-1)
    o_far, lse_far = _flash_forward(q, k[:, :, :near], v[:, :, :near])
    o_near, lse_near = _flash_forward(q, k[:, :, near:visible], v[:, :, near:visible], attn_mask=mask)
    return merged_parts(o_far, lse_far + far, o_near, lse_near)[0].to(q.dtype)


def far_causal_and_band(q: Tensor, k: Tensor, v: Tensor, ramp: Tensor, far_from: int, far: Tensor,
                        chunk_size: int, out: Tensor) -> None:
    """A full forward (queries = keys, no cache) of a causal Toeplitz bias
    that is one value per head, ``far`` ``[H]``, from distance ``far_from``
    on (:func:`constant_tail`): ``causal_blocks.far_and_band_forward`` over
    the :func:`toeplitz_ramp` with ``-inf`` from ``far_from`` on, queries in
    blocks of ``chunk_size``.  Writes ``out`` (``[T, B, H, D]`` storage).  The
    work of bias-free causal attention plus a band of ``far_from +
    chunk_size`` keys per query; no grad."""
    band = ramp.clone()
    band[:, : q.size(2) - far_from] = float("-inf")  # entries of distances >= far_from (length - 1 - x >= far_from)
    far_and_band_forward(q, k, v, band, far_from, far, chunk_size, out.permute(1, 2, 0, 3))


def block_windows(bias: StackBias, q: Tensor, k: Tensor, padded: bool, chunk_size: int) -> List[List[int]]:
    """Per block of ``chunk_size`` queries, the first key each head of the
    ``chunked`` kernel reads: ALiBi's :func:`key_windows`, a bias's own
    (``StackBias.windows``: FoX's), a learned distance bias's :func:`distance_windows`
    (none of them with padding, nor for a single block), or a sliding window
    (:func:`sliding_windows`); 0 for every head otherwise."""
    q_len, k_len = q.size(2), k.size(2)
    windows = (key_windows(bias, q, k) or bias.windows(q, k) or distance_windows(bias, q, k)) \
        if not padded and q_len > chunk_size else None
    windows = windows or sliding_windows(bias, q.size(1), k_len - q_len if bias.causal else 0)
    return [windows(s, min(s + chunk_size, q_len)) if windows else [0] * q.size(1)
            for s in range(0, q_len, chunk_size)]


def keys_read(bias: StackBias, q: Tensor, k: Tensor, chunk_size: Optional[int] = None) -> float:
    """The (query, key) pairs a causal call of the ``chunked`` kernel scores
    without padding, as a share of the pairs causal attention scores (every
    query with the keys up to its own): below 1 where key windows skip keys
    (what makes ALiBi's and FoX's long evaluation cheaper than bias-free
    attention's, which scores every causal pair), slightly above 1 with none
    (a block scores its diagonal square whole, its upper half masked).  For
    the benchmarks (``benchmarks/position_kernels.py``)."""
    chunk_size = chunk_size or CHUNK_SIZE
    q_len, k_len = q.size(2), k.size(2)
    offset = k_len - q_len
    read = 0
    for start, firsts in zip(range(0, q_len, chunk_size), block_windows(bias, q, k, False, chunk_size)):
        rows = min(chunk_size, q_len - start)
        read += sum(rows * (offset + start + rows - first) for first in firsts)
    causal = q.size(1) * (q_len * offset + q_len * (q_len + 1) // 2)
    return read / causal


#: FIRE's inference builds and attends this many of a block's head dimensions per call (at least one head),
#: the bias of the others not held meanwhile.  Whole-model forwards alternating in one process (2026-12-01, an
#: AMD EPYC): one head of 64 per call took the time of all 4 at once; of 8 heads of 16 at 4,096 tokens, one per
#: call took 1.14x the time of all 8, two 1.04-1.11x, four 0.96x, but four held 1.25x the memory of two, more
#: than 1.3x ALiBi's (docs/positions.md, "Long evaluation of FIRE and FoX", has the paired benchmark runs).
HEAD_GROUP_DIMS = 32


class ChunkedCall:
    """One call of the ``chunked`` kernel: its queries, contiguous keys and
    values, padding mask, the first key each head reads per block of
    ``chunk_size`` queries (:func:`block_windows`) and the output's ``[T, B,
    H, D]`` storage (what the module's ``out_proj`` reads)."""

    def __init__(self, q, k, v, bias: StackBias, key_padding_mask, chunk_size: Optional[int] = None):
        self.chunk_size = chunk_size or CHUNK_SIZE
        self.q, (self.k, self.v) = q, _contiguous(k, v)
        self.q_len, self.k_len = q.size(2), k.size(2)
        self.causal = bias.causal
        self.offset = self.k_len - self.q_len if self.causal else 0
        self.pad = padding_mask(key_padding_mask, q.dtype)
        self.starts = range(0, self.q_len, self.chunk_size)
        self.firsts = block_windows(bias, q, self.k, self.pad is not None, self.chunk_size)
        self.out = q.new_empty(self.q_len, q.size(0), q.size(1), v.size(-1))

    def attend(self, start: int, heads: slice, first: int, mask: Tensor, reverse: bool = False,
               base: int = 0) -> None:
        """Queries ``start ..`` of ``heads`` against keys ``first ..``; ``mask``
        is their bias over the keys from ``base`` to the last they see (its
        shape gives both extents), its rows in reverse order where ``reverse``."""
        stop, visible = start + mask.size(-2), base + mask.size(-1)
        mask = mask if self.pad is None else mask + self.pad[..., base:visible]
        queries = self.q[:, heads, start:stop]
        block_out = F.scaled_dot_product_attention(
            queries.flip(2) if reverse else queries, self.k[:, heads, first:visible],
            self.v[:, heads, first:visible], attn_mask=mask[..., first - base:])
        self.out[start:stop, :, heads] = (block_out.flip(2) if reverse else block_out).permute(2, 0, 1, 3)

    def extent(self, start: int) -> Tuple[int, int]:
        """(queries, keys they see) of the block from ``start``."""
        rows = min(self.chunk_size, self.q_len - start)
        return rows, self.offset + start + rows if self.causal else self.k_len

    def result(self) -> Tuple[Tensor, None]:
        return self.out.permute(1, 2, 0, 3), None


def chunked_kernel(q, k, v, bias: StackBias, key_padding_mask, dropout_p, chunk_size: Optional[int] = None):
    """Queries in blocks of ``chunk_size`` (default ``CHUNK_SIZE``); each block's
    bias a view of the shared ramp (a Toeplitz bias: causal, or an encoder's
    two-sided :func:`two_sided_ramp` with its :func:`two_sided_windows`) or
    built on the fly (``capnorm``, FIRE past its threshold), every block with
    the slopes of all ``k_len`` keys (as
    the dense kernels, so dynamic scaling agrees across kernels).  Causal blocks
    read only the keys they can see, and each head only those within its key
    windows (ALiBi's :func:`key_windows`, a learned distance bias's
    :func:`distance_windows`; exact to the dtype: the others together weigh
    less than 2^-16 of its rounding unit).  A causal Toeplitz bias's blocks are
    views of one vector per head (:func:`toeplitz_ramp`), their query rows in
    reverse order (the block's queries and output are flipped instead), and
    where the bias is one value past some distance (:func:`constant_tail`,
    T5's buckets) the keys past it run without a mask (:func:`far_and_near`).
    Other biases build each block over the keys its heads read
    (``StackBias.key_block``; FIRE one value per distance and knot, a few
    heads at a time without gradients; a per-row bias, FoX's, over its
    rows: ``[B, H, ...]``)."""
    call = ChunkedCall(q, k, v, bias, key_padding_mask, chunk_size)
    if call.causal and bias.toeplitz:
        _ramp_blocks(call, bias)
    elif bias.toeplitz and not bias.batched and call.q_len == call.k_len:
        _two_sided_blocks(call, bias)
    else:
        _built_blocks(call, bias)
    return call.result()


def _ramp_blocks(call: ChunkedCall, bias: StackBias) -> None:
    """A causal Toeplitz bias: each block a view of the :func:`toeplitz_ramp`;
    the keys past a :func:`constant_tail` without a mask."""
    q, k, v, k_len, offset = call.q, call.k, call.v, call.k_len, call.offset
    ramp = toeplitz_ramp(bias, k_len, call.chunk_size, q.dtype, q.device)
    # keys at least D from every query of a block share one bias: no mask for them (T5's buckets, a cap)
    skips = any(any(f) for f in call.firsts)
    tail = constant_tail(ramp, k_len) if call.pad is None and not torch.is_grad_enabled() else None
    if tail and offset == 0 and not skips:
        far_causal_and_band(q, k, v, ramp, tail[0], tail[1], call.chunk_size, call.out)
        return
    for start, block_firsts in zip(call.starts, call.firsts):
        rows, visible = call.extent(start)
        block = reversed_rows(ramp, offset + start, rows, visible, k_len)[None]  # last query first
        near = offset + start - tail[0] + 1 if tail else 0  # keys before it: the far bias
        for heads, first in head_groups(block_firsts):
            if near > 0 and first == 0:  # heads that read every key: the far ones without a mask
                block_out = far_and_near(q[:, heads, start:start + rows].flip(2), k[:, heads], v[:, heads], near,
                                         tail[1][heads, None], block[:, heads, :, near:])
                call.out[start:start + rows, :, heads] = block_out.flip(2).permute(2, 0, 1, 3)
            else:  # heads whose key windows leave the far keys out (or no far bias)
                call.attend(start, heads, first, block[:, heads], reverse=True)


def _two_sided_blocks(call: ChunkedCall, bias: StackBias) -> None:
    """Bidirectional self-attention (an encoder's ALiBi): views of one vector
    per head (:func:`two_sided_ramp`), with its :func:`two_sided_windows`."""
    q, k_len = call.q, call.k_len
    ramp = two_sided_ramp(bias, k_len, q.dtype, q.device)
    spans = two_sided_windows(bias, q, call.k) if call.pad is None and call.q_len > call.chunk_size else None
    for start in call.starts:
        rows = min(call.chunk_size, call.q_len - start)
        block = reversed_rows(ramp, start, rows, k_len, k_len)[None]  # last query first
        for heads, (first, end) in head_groups(spans(start, start + rows) if spans else [(0, k_len)] * q.size(1)):
            call.attend(start, heads, first, block[:, heads, :, :end], reverse=True)


def _built_blocks(call: ChunkedCall, bias: StackBias) -> None:
    """Every other bias: each block built over the keys its heads read
    (``StackBias.key_block``), or a few heads at a time where the bias says
    so (``heads_apart``: FIRE's inference)."""
    q, offset = call.q, call.offset
    # FIRE: the bias of a few heads at a time (at least HEAD_GROUP_DIMS dimensions of work per call), in
    # storage that every block reuses with their shared inputs: a fresh [H, 256, T] bias per block (32 MiB
    # at 4 heads and 8K keys) page-faulted in each time, at or above glibc's largest mmap threshold
    heads_apart = bias.heads_apart and not torch.is_grad_enabled()
    group = max(1, HEAD_GROUP_DIMS // q.size(-1))
    storage = None if not heads_apart else q.new_empty((1 + group) * min(call.chunk_size, call.q_len) * call.k_len,
                                                       dtype=torch.float32)
    for start, block_firsts in zip(call.starts, call.firsts):
        rows, visible = call.extent(start)
        if heads_apart:
            blocks = bias.reversed_head_blocks(offset + start, rows, visible, q.device, storage, group)
            for heads, block in blocks:
                for sub, first in head_groups(block_firsts[heads]):  # heads of one key window
                    call.attend(start, slice(heads.start + sub.start, heads.start + sub.stop), first,
                                block[None, sub].to(q.dtype), reverse=True)
            continue
        base = min(block_firsts)  # no head reads a key before it
        block, reverse = bias.key_block(offset + start, rows, call.k_len, q.dtype, q.device, visible, base)
        for heads, first in head_groups(block_firsts):  # a per-row bias ([B, H, ...]: FoX's) has its rows' own
            call.attend(start, heads, first, block[:, heads] if block.dim() == 4 else block[None, heads], reverse,
                        base)
        del block


# ----------------------------------------------------------------- registry and choice
KERNELS: Dict[str, Kernel] = {
    "reference": reference_kernel,
    "sdpa": sdpa_kernel,
    "flex": flex_kernel,
    "chunked": chunked_kernel,
    "blocked": blocked_kernel,
}
#: Every value of the ``alibi_attention`` option.
KERNEL_NAMES = ("auto",) + tuple(KERNELS)
#: Kernels without attention dropout.
NO_DROPOUT = ("flex", "chunked")


def kernel_for(name: str, bias: StackBias) -> Kernel:
    """The kernel registered as ``name`` that runs ``bias``: the position
    object's own where it brings one (``StackBias.own_kernels``), else the
    shared one of :data:`KERNELS`."""
    return bias.own_kernels.get(name) or KERNELS[name]


def check_kernel(name: str, bias: StackBias, dropout: float = 0.0) -> str:
    """The kernel a layer with ``bias`` and attention dropout ``dropout`` runs
    for the configured ``name``, resolved once when it is built; ``ConfigError``
    (naming what is allowed) for a combination that can never run.
    ``blocked`` skips the keys right of each query, so a bidirectional stack
    runs ``sdpa`` instead."""
    if name not in KERNEL_NAMES:
        raise ConfigError(f"alibi_attention={name!r} is not valid; allowed values: {', '.join(KERNEL_NAMES)}")
    if bias.own_kernel:  # its attention is not softmax over biased scores: no shared kernel runs it
        if dropout > 0:
            raise ConfigError(f"attention_dropout={dropout:g} is not valid with this position method, whose "
                              "attention runs its own kernel, which has no attention dropout: set "
                              "--attention-dropout 0 (attention_dropout=0)")
        if name != "auto":
            raise ConfigError(f"alibi_attention={name!r} is not valid with this position method, whose attention "
                              "is not softmax over biased scores and runs its own kernel: use auto")
        return name
    if name == "flex" and not bias.supports_flex:
        raise ConfigError("alibi_attention='flex' is not valid here; flex has a score_mod for ALiBi's fixed slopes "
                          "only, not for learned slopes or other position methods: use auto, sdpa or chunked")
    if name in NO_DROPOUT and dropout > 0:
        raise ConfigError(
            f"alibi_attention={name!r} is not valid here; {name} has no attention dropout and this model has "
            f"attention_dropout={dropout:g}: use auto (which takes {name} where it can), or to evaluate, also "
            "override attention_dropout to 0"
        )
    if name == "blocked" and not bias.causal:
        return "sdpa"
    return name


def choose_kernel(
    name: str,
    bias: StackBias,
    need_weights: bool,
    q_len: int,
    k_len: int,
    dropout_p: float = 0.0,
    incremental: bool = False,
    device: Optional[torch.device] = None,
) -> str:
    """The kernel of one call of a layer whose checked kernel is ``name``.

    Weights wanted: ``reference``.  An explicit kernel: that kernel.  ``auto``:
    FlexAttention on CUDA for full forwards without attention dropout when the
    bias supports it; ``blocked`` for CPU training of a causal stack (it skips
    the keys right of each query block, and with key windows the far keys of
    steep heads; a learned bias gets its gradient block by block; without a
    bias only with dropout, SDPA's causal flash kernel being as good without);
    ``chunked`` for long inference (linear memory, key windows), FIRE's
    inference of more than one query at any length, and an encoder's
    self-attention on the CPU past ``ENCODER_CHUNKED_FROM`` queries; ``sdpa`` for everything
    else (bidirectional training, short inference, KV-cache steps, CPU
    training of a fixed bias without dropout up to ``SHORT_TRAINING``
    queries).  docs/performance.md has the measurements behind each choice.
    """
    if need_weights:
        return "reference"
    if name != "auto":
        return name
    device = device or torch.device("cpu")
    grad = torch.is_grad_enabled()
    cpu_training = device.type == "cpu" and grad
    if bias.batched and dropout_p == 0 and not incremental and q_len > CHUNK_SIZE and not cpu_training:
        return "chunked"  # per query block c_i - c_j of the two vectors: no [B, H, T, T] bias
    if device.type == "cuda" and bias.supports_flex and dropout_p == 0 and not incremental and flex_available():
        return "flex"
    if (cpu_training and bias.causal and not incremental and q_len > 1
            and (dropout_p > 0 or not bias.zero)):
        if dropout_p == 0 and not bias.learned and q_len <= SHORT_TRAINING:
            return "sdpa"  # one flash call with the cached dense bias beats the blocks' many small calls
        return "blocked"  # without a bias or dropout, SDPA's causal flash kernel does the same
    if bias.zero:
        return "sdpa"
    if not grad and (q_len * k_len > CHUNK_THRESHOLD or (bias.heads_apart and q_len > 1)):
        return "chunked"  # FIRE's blocks, a few heads at a time, take less time and memory than its dense bias
    encoder = not bias.causal and bias.toeplitz and q_len == k_len  # bidirectional self-attention
    if not grad and device.type == "cpu" and encoder and q_len > ENCODER_CHUNKED_FROM:
        return "chunked"  # its views of one vector per head and two-sided windows (measured on CPUs only)
    return "sdpa"


def attend(q, k, v, bias: StackBias, name: str, key_padding_mask=None, dropout_p: float = 0.0,
           need_weights: bool = False, incremental: bool = False,
           ssmax: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Run the kernel :func:`choose_kernel` picks; (output ``[B, H, T, D]``,
    weights or None).  Every row scores as it would alone (:func:`row_groups`);
    a KV-cache step (``incremental``) under dynamic scaling past the training
    length is warned about once (:func:`scaling.warn_if_cache_drifts`).
    Queries are first scaled by the logit scalings (``logit_scale.py``: the
    ``logn`` method of ``bias.scaling``, SSMax's learned ``ssmax`` scales ``[H]``).
    An object that computes its attention itself (``own_kernel``) is refused: no shared
    kernel computes it, ``layer.attention`` calls its own."""
    if bias.own_kernel:
        raise TypeError(f"{type(bias).__name__} computes its attention itself (own_kernel), which no shared kernel "
                        "does: call core.layer.attention, not kernels.attend")
    directions = None if bias.causal else getattr(bias, "directions", None) or (0,) * q.size(1)  # 0: both ways
    q = scaled_queries(q, k.size(2), bias.scaling, key_padding_mask, ssmax, bias.window, directions)
    if incremental and bias.scaling.dynamic and k.size(2) > q.size(2):
        padded = 0 if key_padding_mask is None else key_padding_mask.to(torch.bool).sum(-1)
        warn_if_cache_drifts(bias.scaling, k.size(2) - q.size(2), k.size(2) - padded)
    groups = row_groups(bias, key_padding_mask, q.size(2), k.size(2))
    if groups is None:
        chosen = choose_kernel(name, bias, need_weights, q.size(2), k.size(2), dropout_p, incremental, q.device)
        return kernel_for(chosen, bias)(q, k, v, bias, key_padding_mask, dropout_p)
    out, weights = q.new_zeros(q.shape[:3] + (v.size(-1),)), None
    for rows, (cut, end), row_bias in groups:
        first_query = max(0, cut - (k.size(2) - q.size(2)))  # a full forward's leading padded queries go too
        last_query = q.size(2) - (k.size(2) - end)  # and an encoder's trailing ones
        q_rows, k_rows, v_rows = q[rows, :, first_query:last_query], k[rows, :, cut:end], v[rows, :, cut:end]
        pad = key_padding_mask[rows, cut:end]
        chosen = choose_kernel(name, row_bias, need_weights, q_rows.size(2), k_rows.size(2), dropout_p, incremental,
                               q.device)
        o, w = kernel_for(chosen, row_bias)(q_rows, k_rows, v_rows, row_bias, pad if bool(pad.any()) else None,
                                            dropout_p)
        out[rows, :, first_query:last_query] = o
        if w is not None:
            weights = weights if weights is not None else w.new_zeros(q.shape[:3] + (k.size(2),))
            weights[rows, :, first_query:last_query, cut:end] = w
    return out, weights


def row_groups(bias: StackBias, key_padding_mask: Optional[Tensor], q_len: int, k_len: int):
    """``[(rows, (cut, end), bias)]``: the batch's rows grouped so that each scores
    as it would alone (its keys ``cut .. end - 1``), or None where the batch needs
    no grouping.

    A Toeplitz bias (``i - j`` only: ALiBi, T5's, Kerple's) is not moved by
    padding, which is masked, so a batch needs no grouping, except where the
    numbers depend on more: dynamic scaling, whose factor is ``max(1, n / L)``
    with ``n`` **the row's own keys** (cached and new, padding not counted),
    and a bias that is not Toeplitz (``capnorm`` counts the keys past ``C``,
    FIRE normalizes by the query's position), for which a row's leading
    padding is ``cut`` away: positions count from its first real token; in a
    bidirectional stack (an encoder's ``capnorm`` counts the keys right of
    each query too) its trailing padding ends at ``end``.  The one definition
    of every path: fairseq's layers, the exported model (left- and
    right-padded), and the Hugging Face hooks
    (``hf.scaling``) all follow it.
    """
    scaling = bias.scaling
    if key_padding_mask is None or bias.zero or (not scaling.dynamic and bias.toeplitz):
        return None
    if bias.batched:  # built per row from the row's own tokens (FoX: padding's gates are 1): already as alone
        return None
    if torch.compiler.is_compiling():
        raise ConfigError("dynamic scaling or a non-Toeplitz bias (capnorm) on a padded batch groups the rows by "
                          "their length, which torch.compile cannot trace; compile with a static method, or pass "
                          "unpadded batches")
    pad = key_padding_mask.to(torch.bool)
    real = (~pad).sum(-1)
    leading = torch.where(real > 0, (~pad).int().argmax(-1), 0)
    cuts = leading.clamp(max=k_len - q_len if q_len < k_len else k_len).tolist()
    ends = [k_len] * len(cuts)
    if bias.toeplitz:
        cuts = [0] * len(cuts)
    elif not bias.causal and q_len == k_len:  # self-attention both ways: the keys after the last real one go
        last = k_len - (~pad).int().flip(-1).argmax(-1)
        ends = torch.where(real > 0, last, k_len).tolist()
    keys = [((cut, end), scaling.factor_at(int(n))) for cut, end, n in zip(cuts, ends, real.tolist())]
    groups = []
    for span, factor in sorted(set(keys)):
        rows = torch.tensor([i for i, key in enumerate(keys) if key == (span, factor)], device=pad.device)
        groups.append((rows, span, bias.at_factor(factor)))
    return groups
