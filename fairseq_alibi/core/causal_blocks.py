"""Causal attention in query blocks that only compute the keys they can see
(the ``blocked`` attention path; ``auto`` takes it for CPU training of a
causal stack, with and without attention dropout).

On CPU, ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` cannot use
the flash kernel (it has no dropout) and runs the math kernel: full ``T x T``
scores, a ``T x T`` dropout draw and every elementwise pass over the whole
square, although half of it is masked.  Query block ``[s, e)`` of causal
attention only sees keys ``[0, e)``, so this path computes, per block, scores
against those keys only: with 128-query blocks at T=512 it touches 10/16 of the
square (and draws 10/16 of the dropout mask).

* with dropout: the maths is the reference's (``softmax(q k^T / sqrt(d) +
  bias) -> dropout -> @ v``), with a hand-written backward (flash-attention
  style, ``delta = rowsum(dO * O)``) over the saved probabilities and dropped
  probabilities of each block; the ``1 / (1 - p)`` dropout scale is folded into
  ``v`` (and into the gradient of ``v``) instead of a pass over the square;
* without dropout: one call of the CPU flash kernel per block and head (per
  group of heads with the same key window when the batch has one row), with
  the block's slice of the bias as its mask, and one call of its backward; the
  gradients go straight into whole ``dq, dk, dv`` tensors; nothing ``T x T``
  is saved;
* a learned bias (a mask that requires a gradient: T5's buckets, Kerple, FIRE)
  takes the first path with or without dropout: its backward has each block's
  score gradient ``dS`` at hand, and the mask's gradient is ``dS`` itself,
  summed over the batch where the mask is broadcast over it (``[1, H, T, S]``,
  never ``[B, H, T, S]``), written block by block; the keys right of a block
  get none.  The flash kernel returns no ``dS``.  A Toeplitz bias given per
  distance reduces it to one value per distance.  T5's bias needs ``dS``
  only in a band (it is one value per head from its last bucket on) and, in
  a full forward without dropout or padding, runs on flash calls
  (:class:`_FarAndBand`);
* a per-row cumulative term ``c_i - c_j`` (one running sum per row and
  head: FoX's gates, ``fox.py``) is given as ``c`` itself (``cumulative``),
  not as a mask: each block builds its own ``[B, H, block, visible]`` bias
  and the backward reduces its ``dS`` to ``dc`` (``+`` the row sums at the
  block's queries, ``-`` the column sums at its keys), so no ``[B, H, T,
  S]`` bias or gradient exists (a dense mask made FoX train at about half
  ALiBi's speed, docs/positions.md); without dropout FoX's own blocked
  kernel runs the flash kernel instead (``fox.FlashGates``), which gets
  ``dc`` without ``dS``.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .bias import cumulative_bias, distance_ramp, reversed_rows

# Queries per block (see docs/performance.md): BLOCK with dropout, and the
# least without it, where longer inputs take larger blocks (block_size).
BLOCK = 128
MAX_BLOCK = 512
#: Queries per block of T5's band (:class:`_FarAndBand`): its explicit backward
#: costs the band's area, ``block + D`` keys per query, so its blocks are
#: smaller than the flash path's.
BAND_BLOCK = 64


#: Keys left out of a row together weigh at most this share of one rounding
#: unit (``eps``) of the row's softmax sum: 2^-40 of it in float32.
SKIPPED_SHARE = 2.0**-16


def negligible_gap(k_len: int, dtype: torch.dtype) -> float:
    """How far below its row's largest score a key may be left out: ``k_len``
    keys that each weigh less than ``exp(-gap)`` of the row's largest weight
    move its softmax sum by less than ``SKIPPED_SHARE * eps`` (relative), and
    an output by less than twice that times the largest ``|v|``: 2^16 times
    below the rounding of ``dtype`` itself.  36.7 for 16K float32 keys.  The
    key windows (``kernels.key_windows``) leave such keys out; the explicit
    path raises their scores to this floor (:func:`_softmax_above_floor`)."""
    return math.log(k_len / (torch.finfo(dtype).eps * SKIPPED_SHARE))


def _softmax_above_floor(scores: Tensor, gap: float) -> Tensor:
    """``softmax(scores)`` over the last dimension, the scores more than
    ``gap`` (:func:`negligible_gap`) below their row's largest first set to
    ``-inf`` (in place): the keys the key windows would leave out.

    Why: a steep bias (ALiBi's steep heads, FoX's closed gates) leaves far
    keys 100 or more below the row's largest score, and ``exp`` of that is a
    subnormal number, which the CPU computes many times slower (ALiBi with
    attention dropout took 1.6x NoPE's time in this path, and NoPE's time with
    subnormals flushed; docs/performance.md).  The keys set to ``-inf``
    together weighed less than ``SKIPPED_SHARE`` of a rounding unit of the
    row: exact to the dtype, as the key windows are, and a masked key stays
    masked (a clamp to the floor would give it weight)."""
    return torch.softmax(scores.masked_fill_(scores < scores.amax(-1, keepdim=True) - gap, float("-inf")), dim=-1)


def block_size(q_len: int) -> int:
    """Queries per block without dropout: an eighth of the input, in multiples
    of 64, between ``BLOCK`` and ``MAX_BLOCK`` (fewer, larger calls as the
    input grows; docs/performance.md)."""
    return min(MAX_BLOCK, max(BLOCK, q_len // 8 // 64 * 64))


def _keep_mask(shape, p: float, dtype, device, start: int, reverse: bool = False) -> Tensor:
    """0/1 mask keeping each entry with probability ``1 - p`` (the draw of
    ``F.dropout``) for the block of queries from ``start``, its rows in
    reverse order where ``reverse`` (a Toeplitz bias's blocks: a random draw
    is the same in any order).  Tests replace it to compare against the
    reference with the same mask."""
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1.0 - p)


class _BlockedCausalAttention(torch.autograd.Function):
    """The explicit path (module docstring).  The bias is one of: ``mask``
    (dense, ``[B or 1, H, T, S]``); FoX's ``cumulative`` ``c`` (``mask`` then
    only padding or None); a Toeplitz bias's ``per_distance`` values ``[H, S]``
    at distances ``0 .. S - 1`` (``mask`` padding or None), whose blocks are
    views of one vector with their query rows in reverse order (a row's keys
    read the vector forwards, so successive queries step backwards through
    it, and a view cannot step backwards): such a block's queries, output
    and output gradient are flipped instead, ``block x D`` values where the
    bias has ``block x S``, and its ``dS`` reduces to the per-distance
    gradient along anti-diagonals (:func:`_antidiagonal_sums`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, block, cumulative, steep, per_distance, *blocks):
        bsz, heads, q_len, head_dim = q.shape
        k_len = k.size(2)
        offset = k_len - q_len  # queries are the last q_len positions
        scale = head_dim**-0.5
        keep = 1.0 - dropout_p
        gap = negligible_gap(k_len, q.dtype) if steep else None
        qs = (q * scale).contiguous()
        k = k.contiguous()
        vs = (v / keep if dropout_p > 0 else v).contiguous()
        reverse = per_distance is not None or bool(blocks)
        # padding: a [B, 1, 1, S] mask, or the bias merged with it ([B, H, T, S], B > 1)
        padded = mask is not None and (mask.size(-2) == 1 or mask.size(0) > 1)
        ramp = None if per_distance is None else distance_ramp(per_distance.flip(-1).to(q.dtype), block)
        probs, kept_probs, outputs = [], [], []
        for start in range(0, q_len, block):
            stop = min(start + block, q_len)
            visible = offset + stop
            queries = qs[:, :, start:stop].flip(2) if reverse else qs[:, :, start:stop]
            scores = torch.matmul(queries, k[:, :, :visible].transpose(-1, -2))
            built = blocks[start // block] if blocks else None
            scores.add_(_block_bias(mask, cumulative, ramp, start, stop, offset, visible, q.dtype, k_len, built))
            p = _softmax_above_floor(scores, gap) if steep else torch.softmax(scores, dim=-1)
            if padded:  # a padded query with every key masked (a window past a short row's end): weights 0, not NaN
                p = p.nan_to_num_(nan=0.0)
            del scores
            kept = p * _keep_mask(p.shape, dropout_p, p.dtype, p.device, start, reverse) if dropout_p > 0 else p
            o = torch.matmul(kept, vs[:, :, :visible])
            outputs.append(o.flip(2) if reverse else o)
            probs.append(p)
            kept_probs.append(kept)
        # [T, B, H, D] storage (what the module's out_proj reads), seen as [B, H, T, D]
        out = torch.cat([o.permute(2, 0, 1, 3) for o in outputs]).permute(1, 2, 0, 3)
        ctx.save_for_backward(qs, k, vs, out)
        ctx.probs, ctx.kept = probs, kept_probs
        ctx.block, ctx.scale, ctx.keep, ctx.dropout_p = block, scale, keep, dropout_p
        ctx.mask_shape = mask.shape if ctx.needs_input_grad[3] else None
        ctx.cumulative_shape = cumulative.shape if ctx.needs_input_grad[6] else None
        ctx.reverse = reverse
        ctx.distances = per_distance.shape if ctx.needs_input_grad[8] else None
        ctx.blocks_wanted = [ctx.needs_input_grad[9 + i] for i in range(len(blocks))]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qs, k, vs, out = ctx.saved_tensors
        probs, kept_probs = ctx.probs, ctx.kept
        ctx.probs = ctx.kept = None
        q_len, k_len = qs.size(2), k.size(2)
        offset = k_len - q_len
        reverse = ctx.reverse
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dP * P)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(vs)
        # the mask's gradient (a learned bias): dS, batch-summed where the mask is broadcast
        dmask = None if ctx.mask_shape is None else qs.new_zeros(ctx.mask_shape)
        # FoX's c: + each block's row sums of dS at its queries, - its column sums at its keys
        dc = None if ctx.cumulative_shape is None else qs.new_zeros(ctx.cumulative_shape, dtype=torch.float32)
        # a Toeplitz bias: the gradient of its ramp (bias.distance_ramp), one value per entry
        dramp = None if ctx.distances is None else qs.new_zeros(
            (ctx.distances[0], ctx.distances[1] + ctx.block), dtype=torch.float32)
        # a bias given block by block (FIRE past its threshold): each block's dS, summed over the batch
        dblocks = [None] * len(ctx.blocks_wanted)
        dqs = []
        for i, start in enumerate(range(0, q_len, ctx.block)):
            stop = min(start + ctx.block, q_len)
            visible = offset + stop
            p, kept = probs[i], kept_probs[i]
            probs[i] = kept_probs[i] = None
            do, queries, row_delta = grad_out[:, :, start:stop], qs[:, :, start:stop], delta[:, :, start:stop]
            if reverse:
                do, queries, row_delta = do.flip(2), queries.flip(2), row_delta.flip(2)
            dv[:, :, :visible] += torch.matmul(kept.transpose(-1, -2), do)
            # d scores = P * (dP - delta), dP = (dO v^T) * mask: with kept = P * mask
            # that is (dO v^T) * kept - P * delta
            ds = torch.matmul(do, vs[:, :, :visible].transpose(-1, -2))
            if kept is p:
                ds.sub_(row_delta).mul_(p)
            else:
                ds.mul_(kept).addcmul_(p, row_delta, value=-1)
            del p, kept
            dq = torch.matmul(ds, k[:, :, :visible])
            dqs.append(dq.flip(2) if reverse else dq)
            dk[:, :, :visible] += torch.matmul(ds.transpose(-1, -2), queries)
            if dmask is not None:
                dmask[:, :, start:stop, :visible] = ds.sum(0, keepdim=True) if dmask.size(0) == 1 else ds
            if dc is not None:
                dc[:, :, offset + start: offset + stop] += ds.sum(-1, dtype=torch.float32)
                dc[:, :, :visible] -= ds.sum(-2, dtype=torch.float32)
            if dramp is not None:
                first = k_len - offset - stop  # the ramp entry of the block's first row (its last query), key 0
                dramp[:, first: first + stop - start + visible - 1] += _antidiagonal_sums(
                    ds.sum(0, dtype=torch.float32))
            if dblocks and ctx.blocks_wanted[i]:
                dblocks[i] = ds.sum(0, dtype=torch.float32)
        dq = torch.cat(dqs, dim=2)
        dq.mul_(ctx.scale)
        if ctx.dropout_p > 0:
            dv.div_(ctx.keep)
        dd = None if dramp is None else dramp[:, :k_len].flip(-1)
        return (dq, dk, dv, dmask, None, None, dc, None, dd, *dblocks)


class _FarAndBand(torch.autograd.Function):
    """Training of a causal Toeplitz bias that is one learned value per head
    from distance ``D`` on (T5's last bucket: ``StackBias.shared_from``), in a
    full forward without dropout or padding, at the flash kernel's cost:

    * forward: :func:`far_and_band_forward` (the far keys in one bias-free
      causal flash call, the nearer ones in a band per block, merged by
      log-sum-exp), keeping each row's output and log-sum-exp;
    * backward: the far keys' ``dq, dk, dv`` from the flash kernel's backward
      given the whole row's output and log-sum-exp (less the far value), which
      are what its ``P`` and ``delta = rowsum(dO * O)`` need; the band's
      explicitly (``P = exp(S - lse)``, ``dS = P (dP - delta)``, in float32), its
      ``dS`` summed along anti-diagonals into the gradient per distance
      ``< D``.  The far value's gradient is minus the sum of those: every
      row of ``dS`` sums to 0 (``sum_j P_ij dP_ij = dO_i . O_i = delta_i``), so
      the far keys' share is minus the band's, and no far ``dS`` is formed.

    ``values`` ``[H, D + 1]``: the bias at distances ``0 .. D - 1``, then the
    one value of every distance ``>= D``.  Nothing ``T x T`` is saved."""

    @staticmethod
    def forward(ctx, q, k, v, values, block):
        length, near = q.size(2), values.size(1) - 1
        far = values[:, near].float()
        ramp = _band_ramp(values, length, block, q.dtype)
        # [T, B, H, D] storage (what the module's out_proj reads), seen as [B, H, T, D]
        out = q.new_empty(length, q.size(0), q.size(1), v.size(-1)).permute(1, 2, 0, 3)
        lse = far_and_band_forward(q, k, v, ramp, near, far, block, out)
        ctx.save_for_backward(q, k, v, out, lse, far)
        ctx.block, ctx.near = block, near
        ctx.ramp = ramp
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, far = ctx.saved_tensors
        ramp, ctx.ramp = ctx.ramp, None
        near, length = ctx.near, q.size(2)
        scale = q.size(-1) ** -0.5
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # the far keys: the flash backward over them, with each row's whole output and log-sum-exp
        dq[:, :, near:], dk[:, :, : length - near], dv[:, :, : length - near] = _flash_backward(
            grad_out[:, :, near:], q[:, :, near:], k[:, :, : length - near], v[:, :, : length - near],
            out[:, :, near:], lse[:, :, near:] - far[:, None], 0.0, True, scale=scale)
        delta = (grad_out.float() * out.float()).sum(-1)
        dramp = q.new_zeros((ramp.size(0), ramp.size(1)), dtype=torch.float32)
        for start, stop, first in _band_blocks(length, near, ctx.block):
            rows = slice(start, stop)
            queries, do = q[:, :, rows].flip(2).float(), grad_out[:, :, rows].flip(2).float()
            keys, values = k[:, :, first:stop].float(), v[:, :, first:stop].float()
            scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
            scores += reversed_rows(ramp, start, stop - start, stop, length)[None, :, :, first:].float()
            p = scores.sub_(lse[:, :, rows].flip(2)[..., None]).exp_()
            ds = torch.matmul(do, values.transpose(-1, -2)).sub_(delta[:, :, rows].flip(2)[..., None]).mul_(p)
            dv[:, :, first:stop] += torch.matmul(p.transpose(-1, -2), do).to(dv.dtype)
            del p
            dq[:, :, rows] += torch.matmul(ds, keys).mul_(scale).flip(2).to(dq.dtype)
            dk[:, :, first:stop] += torch.matmul(ds.transpose(-1, -2), queries).mul_(scale).to(dk.dtype)
            begin = length - stop + first  # the ramp entry of the block's first row (its last query), key first
            dramp[:, begin: begin + (stop - start) + (stop - first) - 1] += _antidiagonal_sums(ds.sum(0))
        per_distance = dramp[:, :length].flip(-1)[:, :near]  # ramp entry e holds distance T - 1 - e
        dvalues = torch.cat([per_distance, -per_distance.sum(-1, keepdim=True)], dim=-1)
        return dq, dk, dv, dvalues, None


def merged_parts(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets, from each set's
    output and log-sum-exp (``[B, H, T, D]``, ``[B, H, T]``): each weighed by
    ``exp(lse_part - lse)``; float32 ``(output, lse)``."""
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a.float() * (lse_a - lse).exp()[..., None] + o_b.float() * (lse_b - lse).exp()[..., None], lse


def far_and_band_forward(q: Tensor, k: Tensor, v: Tensor, band: Tensor, near: int, far: Tensor, block: int,
                         out: Tensor) -> Tensor:
    """The forward of a full forward's causal Toeplitz bias that is ``far``
    (float32 ``[H]``) at every distance from ``near`` on: every such key in
    one bias-free causal flash call (queries ``near ..`` over keys ``.. T -
    near``: SDPA's top-left causal mask leaves row ``r`` exactly the keys at
    least ``near`` before query ``near + r``), the nearer keys per block of
    ``block`` queries with their bias (``band``: a :func:`distance_ramp` with
    ``extra = block`` and ``-inf`` from ``near`` on; reversed-row views, the
    queries and outputs flipped), the two merged per row by log-sum-exp.
    Writes ``out`` (``[B, H, T, D]``, any strides) and returns each row's
    float32 log-sum-exp ``[B, H, T]``.  The merge weighs each part by the
    log-sum-exp the kernel returns, rounded to float32 with the row's largest
    score in it: weights within about 1e-5 (relative) for a row whose scores
    reach 100, where one call rounds each weight alone.  The training path
    (:class:`_FarAndBand`) and T5's long evaluation (``kernels.chunked_kernel``)
    both run it."""
    length = q.size(2)
    o_far, lse_far = _flash_forward(q[:, :, near:], k[:, :, : length - near], v[:, :, : length - near],
                                    is_causal=True)
    lse_far = lse_far + far[:, None]
    lse = lse_far.new_empty(q.shape[:3])
    for start, stop, first in _band_blocks(length, near, block):
        o_near, lse_near = _flash_forward(q[:, :, start:stop].flip(2), k[:, :, first:stop], v[:, :, first:stop],
                                          attn_mask=reversed_rows(band, start, stop - start, stop, length)[
                                              None, :, :, first:])
        o_near, lse_near = o_near.flip(2).float(), lse_near.flip(2)
        merge_from = max(start, near)  # queries before near have no far keys
        if merge_from < stop:
            rows, far_rows = slice(merge_from - start, stop - start), slice(merge_from - near, stop - near)
            o_near[:, :, rows], lse_near[:, :, rows] = merged_parts(o_far[:, :, far_rows], lse_far[:, :, far_rows],
                                                                    o_near[:, :, rows], lse_near[:, :, rows])
        out[:, :, start:stop] = o_near
        lse[:, :, start:stop] = lse_near
    return lse


def _band_ramp(values: Tensor, length: int, block: int, dtype) -> Tensor:
    """The :func:`distance_ramp` of the band of :class:`_FarAndBand`: the
    values at distances below ``D`` (``values[:, :D]``), ``-inf`` from ``D``
    on (those keys are the far call's)."""
    near = values.size(1) - 1
    far_to_near = F.pad(values[:, :near].flip(-1).to(dtype), (length - near, 0), value=float("-inf"))
    return distance_ramp(far_to_near, block)


def _band_blocks(length: int, near: int, block: int):
    """(first query, end query, first key) of each query block of
    :class:`_FarAndBand`: its band, the keys less than ``near`` before some
    query of the block."""
    for start in range(0, length, block):
        yield start, min(start + block, length), max(0, start - near + 1)


def far_and_band_attention(q: Tensor, k: Tensor, v: Tensor, values: Tensor, block: Optional[int] = None) -> Tensor:
    """Causal attention of a full forward (queries = keys, no padding, no
    dropout) with a Toeplitz bias that is one value per head from distance
    ``D`` on: ``values`` ``[H, D + 1]``, the bias at distances ``0 .. D - 1``
    and then the value of every farther one (:class:`_FarAndBand`, which gives
    ``values`` its gradient).  ``D`` must be below the length.  Returns
    ``[B, H, T, D]`` (stored as ``[T, B, H, D]``)."""
    if not 0 < values.size(1) - 1 < q.size(2) or q.size(2) != k.size(2):
        raise ValueError(f"far_and_band_attention needs queries = keys and 0 < D < T (D = {values.size(1) - 1}, "
                         f"{q.size(2)} queries, {k.size(2)} keys)")
    return _FarAndBand.apply(q, k, v, values, block or BAND_BLOCK)


def _antidiagonal_sums(m: Tensor) -> Tensor:
    """``[H, r + c - 1]`` sums of ``m`` ``[H, r, c]`` along its anti-diagonals
    (entry ``x``: the sum of ``m[:, i, j]`` with ``i + j = x``): the gradient of
    a ramp whose rows are its windows ``ramp[i : i + c]``.  One padded copy:
    in a ``[H, r, c + r]`` buffer row ``i``'s entry ``j`` lies ``x`` after the
    row's start at stride ``c + r - 1``, and the padding reads as 0."""
    heads, rows, cols = m.shape
    padded = F.pad(m, (0, rows))
    width = cols + rows - 1
    return padded.as_strided((heads, rows, width), (rows * (cols + rows), width, 1)).sum(1)


def _block_bias(mask: Optional[Tensor], cumulative: Optional[Tensor], ramp: Optional[Tensor], start: int,
                stop: int, offset: int, visible: int, dtype, k_len: int, built: Optional[Tensor] = None) -> Tensor:
    """The additive bias of queries ``start .. stop - 1`` (the last of the
    ``k_len`` keys, ``offset`` before the first query) over keys ``0 .. visible - 1``: the slice of the dense
    ``mask`` ``[B or 1, H, T, S]``; FoX's ``c_i - c_j`` of ``cumulative``
    (``-inf`` right of each query); a Toeplitz ``ramp``'s view
    (``bias.reversed_rows``: rows in reverse order); a ``built`` block (its
    rows in reverse order: FIRE past its threshold); the last three plus
    ``mask`` where there is one, then only the ``[B, 1, 1, S]`` padding mask."""
    if cumulative is not None:
        bias = cumulative_bias(cumulative, offset + start, stop - start, visible).to(dtype)
    elif built is not None:
        bias = built.to(dtype)
    elif ramp is not None:
        bias = reversed_rows(ramp, offset + start, stop - start, visible, k_len)
    else:
        return mask[:, :, start:stop, :visible]
    return bias if mask is None else bias + mask[..., :visible]


def blocked_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    dropout_p: float = 0.0,
    block: Optional[int] = None,
    windows: Optional[Callable[[int, int], List[int]]] = None,
    cumulative: Optional[Tensor] = None,
    steep: bool = True,
    per_distance: Optional[Tensor] = None,
    blocks: Optional[List[Tensor]] = None,
) -> Tensor:
    """Causal attention, queries the last ``q_len`` of ``k_len`` keys, in query
    blocks that only read the keys they can see.  q ``[B, H, T, D]``, k/v
    ``[B, H, S, D]``; ``mask`` the additive ``[1, H, T, S]`` or ``[B, H, T, S]``
    bias with ``-inf`` above the diagonal and at padded keys (what
    ``AlibiBias.merged_mask`` returns: inside a block that is the causal mask;
    the part right of a block is never read).  Without dropout, ``windows``
    (``kernels.key_windows``) gives each head's first key per block: the keys
    before it together weigh less than 2^-16 of a rounding unit of the
    softmax.  A ``mask`` that requires a gradient (a learned bias) gets one,
    with or without dropout (the module docstring).  A per-row cumulative
    term: ``cumulative`` ``c`` ``[B, H, S]`` (float32) instead, the bias ``c_i
    - c_j`` built block by block and ``c`` given its gradient, ``mask`` then
    only the ``[B, 1, 1, S]`` padding mask or None; it takes the explicit path
    (FoX's flash path without dropout is its own kernel's, ``fox.py``).  The
    explicit path raises the scores far below each row's largest to a floor
    (:func:`_softmax_above_floor`: steep biases would otherwise fill a block
    with subnormal ``exp`` values, which the CPU computes many times slower) unless
    the caller knows that no row's scores span far enough for a subnormal
    weight (``steep=False``: ``kernels.may_underflow``; there the floor's
    passes would cost time for nothing).  A learned Toeplitz bias
    (T5's, Kerple's, FIRE's below its threshold): ``per_distance`` ``[H, S]``,
    its values at distances ``0 .. S - 1``, instead of a dense bias, ``mask``
    then padding or None; it takes the explicit path and gets a gradient per
    distance, never a ``[H, T, S]`` bias or gradient.  A learned bias that is
    neither (FIRE past its threshold): ``blocks``, the float32 ``[H, rows,
    visible]`` bias of each block of ``block`` queries over the keys it sees,
    rows last first (``ModuleBias.training_blocks``); it takes the explicit
    path and returns each block's ``dS``, summed over the batch, as that
    block's gradient.  Returns ``[B, H, T, D]``
    (stored as ``[T, B, H, D]``)."""
    mask = None if mask is None else mask.to(q.dtype)
    if (cumulative is not None or per_distance is not None or blocks or dropout_p > 0
            or (mask.requires_grad and torch.is_grad_enabled())):
        return _BlockedCausalAttention.apply(q, k, v, mask, float(dropout_p), block or BLOCK, cumulative, steep,
                                             per_distance, *(blocks or ()))
    return _flash_blocks(q, k, v, mask, block or block_size(q.size(2)), windows)


def head_groups(firsts: List[int]) -> List[Tuple[slice, int]]:
    """Runs of consecutive heads that start at the same key: (head slice, first key)."""
    runs, begin = [], 0
    for h in range(1, len(firsts) + 1):
        if h == len(firsts) or firsts[h] != firsts[begin]:
            runs.append((slice(begin, h), firsts[begin]))
            begin = h
    return runs


def _block_calls(q_len: int, k_len: int, block: int, heads: int, windows=None,
                 per_head: bool = False) -> List[Tuple[int, int, slice, int, int]]:
    """(first query, end query, heads, first key, end key) of each call of the
    path without dropout: per query block, per group of heads with the same
    key window (``per_head``: per head); the calls' (queries, heads) partition
    the output."""
    offset = k_len - q_len
    calls = []
    for start in range(0, q_len, block):
        stop = min(start + block, q_len)
        firsts = windows(start, stop) if windows else [0] * heads
        groups = [(slice(h, h + 1), f) for h, f in enumerate(firsts)] if per_head else head_groups(firsts)
        calls += [(start, stop, group, first, offset + stop) for group, first in groups]
    return calls


_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FlashBlocks(torch.autograd.Function):
    """The CPU flash kernel once per call of :func:`_block_calls`, forward and
    backward, with the gradients written straight into whole ``dq``, ``dk``,
    ``dv`` tensors: autograd through sliced SDPA calls instead zero-fills and
    sums a full-size gradient per slice (a third of the call's time at T=512)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, calls):
        # [T, B, H, D] storage (what the module's out_proj reads), seen as [B, H, T, D]
        out = q.new_empty(q.size(2), q.size(0), q.size(1), v.size(-1)).permute(1, 2, 0, 3)
        lse = []
        for start, stop, heads, first, end in calls:
            block_out, block_lse = _flash_forward(
                q[:, heads, start:stop], k[:, heads, first:end], v[:, heads, first:end],
                attn_mask=mask[:, heads, start:stop, first:end])
            out[:, heads, start:stop] = block_out
            lse.append(block_lse)
        ctx.save_for_backward(q, k, v, mask, out, *lse)
        ctx.calls = calls
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, mask, out, *lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (start, stop, heads, first, end), block_lse in zip(ctx.calls, lse):
            gq, gk, gv = _flash_backward(
                grad_out[:, heads, start:stop], q[:, heads, start:stop], k[:, heads, first:end],
                v[:, heads, first:end], out[:, heads, start:stop], block_lse, 0.0, False,
                attn_mask=mask[:, heads, start:stop, first:end])
            dq[:, heads, start:stop] = gq
            dk[:, heads, first:end] += gk
            dv[:, heads, first:end] += gv
        return dq, dk, dv, None, None


def _flash_blocks(q, k, v, mask, block: int, windows=None) -> Tensor:
    """Without dropout: one flash call per query block and head (or group of
    heads), against the keys they can see and need, with their slice of the
    mask; nothing ``T x T`` is saved for the backward.  On CPU with gradients
    the calls and their backward run in :class:`_FlashBlocks`; elsewhere
    (another device, no gradients) through ``F.scaled_dot_product_attention``."""
    # With several rows, one head per call: the kernel reads that head's slice
    # of the (batch-broadcast) mask for every row, and one head's slice stays
    # in cache (128 x 512 floats at T=512), all heads' do not (~6% faster).
    calls = _block_calls(q.size(2), k.size(2), block, q.size(1), windows, per_head=q.size(0) > 1)
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _FlashBlocks.apply(q, k, v, mask, calls)
    # [T, B, H, D] storage (what the module's out_proj reads), seen as [B, H, T, D]
    out = q.new_empty(q.size(2), q.size(0), q.size(1), v.size(-1))
    for start, stop, heads, first, end in calls:
        out[start:stop, :, heads] = F.scaled_dot_product_attention(
            q[:, heads, start:stop], k[:, heads, first:end], v[:, heads, first:end],
            attn_mask=mask[:, heads, start:stop, first:end],
        ).permute(2, 0, 1, 3)
    return out.permute(1, 2, 0, 3)
