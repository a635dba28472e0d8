"""Stick-breaking attention (Tan, Shen, Yang, Panda and Courville, "Scaling
Stick-Breaking Attention: An Efficient Implementation and In-depth Study",
ICLR 2025, arXiv 2410.17980): no softmax and no position encoding.

Per head, with ``z_ij = q_i . k_j / sqrt(d)`` and ``beta_ij = sigmoid(z_ij)``,
query ``i`` gives key ``j`` the weight

    A_ij = beta_ij * prod_{j < k < i} (1 - beta_ik),   j < i,

the nearest key taking its share of the stick first, each farther key a share
of what is left; in log space ``log A_ij = logsigmoid(z_ij) + sum_{j<k<i}
logsigmoid(-z_ik)``, a suffix sum along the keys.  The weights sum to at most
1: ``sum_j A_ij = 1 - prod_{k<i} (1 - beta_ik)``, so the remainder is
``r_i = prod_{k<i} (1 - beta_ik) = exp(sum_{k<i} logsigmoid(-z_ik))``, which
this module computes as that product (never as ``1 - sum``, which loses every
digit where the stick is used up).  The layer's output per head is

    o_i = sum_j A_ij v_j + r_i * b_h,

``b_h`` a learned vector per head, then a group norm with one group per head.

Choices, each checked against the authors' code (IBM's ``stickbreaking-
attention`` kernels and dolomite-engine's ``SBAttention`` layer, read through
the project's search tool) and written down here:

* **The diagonal**: ``j < i`` strictly, the query's own key excluded.  The
  authors' kernel ``sb_attn(..., attend_current=False)`` is the default their
  model calls, and their decoding path scores ``k[..., :-1, :]``, the keys
  before the new token.  So the first token of a row has no key at all: its
  output is ``b_h`` (remainder 1) and its value vector is never read by
  itself.  ``attend_current`` is not offered.
* **The remainder vector** ``b_h``: ``head_bias``, zeros ``[H, D]`` at
  initialization (theirs: ``torch.zeros(num_heads, head_dim)``), added as
  ``rem[..., None] * head_bias`` before the norm.
* **The norm**: ``GroupNorm(num_heads, num_heads * head_dim)`` on each
  token's concatenated heads (theirs), so each head's ``D`` values are
  normalized by their own mean and variance, ``eps = 1e-5`` (torch's
  default, theirs), with a learned scale and shift per channel (ones and
  zeros); then the output projection.
* **Scale**: ``1 / sqrt(d)`` (their ``softmax_scale`` from the attention
  multiplier, ``1 / sqrt(head_dim)`` by default); no temperature is learned.
* **No attention dropout** (their softmax dropout is 0): a model with
  attention dropout is refused where it is built.
* **Padding** (ours; their padding-free path packs rows instead): a padded key
  is transparent, ``A = 0`` and ``1 - beta = 1``, so a left- or right-padded
  row weighs its real keys as its unpadded self does.

The kernel (:func:`stickbreaking_attention`) is blockwise and exact:
queries in blocks, and for each block the keys from the diagonal backwards in
blocks, the remainder of each query carried from block to block (the
flash-style order of the authors' Triton kernel), so memory grows linearly
with the length (``[B, H, block, key_block]`` at a time) in inference and in
training: its backward (a custom ``autograd.Function``) recomputes each block
from ``q``, ``k``, ``v`` and the saved outputs, with the gradient of a
weight's farther keys taken as the row's total less its nearer keys (the
``dO . O`` identity of flash attention).  Within a block the stick is a
running product along the keys, nearest first (keys and values are reversed
once per call, so that this is the memory order): ``1 - beta = sigmoid(-z)``,
exact where ``beta`` is near 1, and ``A_j = beta_j`` times the product of the
nearer keys' ``1 - beta``; no logarithm or exponential is taken, which on
the CPU costs more than the sigmoids (and an exponential that lands among
float32's subnormal numbers costs some 30 times a normal one).  Once a whole
query block's remainder is below ``exp(-120)`` (zero in float32) no farther
key can change a number, and the keys before are skipped: a long row whose
heads have spent their stick costs the keys they read, not the row.  Where
no gradient is taken (evaluation, decoding) each head stops on its own, once
its queries' remainders are below :func:`negligible_remainder` (the farther
keys then weigh under ``2^-16`` of a rounding unit, the standard ALiBi's key
windows keep), the heads still reading gathered into one batch: a trained
model's heads spend their sticks at very different distances.  On a CPU
with AVX2 (not float64) the forward, with or without a gradient, is one
C++ call (``native.py``, compiled on first use): per head and block, the
scores by torch's sgemm laid out key by key (``K Q^T``, so that the running
product along the keys is one vector step per key), the weights in one loop
written over them, the output by sgemm; elsewhere the eager passes above
run (five per block).  The
naive reference (:func:`stickbreaking_reference`) computes the product itself, in float64,
with ``[B, H, T, S]`` memory: the tests' oracle.

KV cache: the keys and values as they are (nothing is transformed), queries
the last ``T`` of ``S`` keys, so incremental decoding is the full forward.

Torch and this folder's ``native.py`` (optional, standard library and torch),
no fairseq: this file travels with exported models.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .bias import OwnAttentionStack
from .causal_blocks import SKIPPED_SHARE
from .errors import ConfigError
from .native import runs_for as native_runs, stickbreaking_forward as native_forward
from .scaling import NO_SCALING, Scaling

#: Queries per block of the kernel in training (and in evaluation where the fused forward does not run).
BLOCK = 128
#: Keys per block of the kernel there (where no ``block`` is given).  Queries and keys per block timed on the CPU
#: (an AMD EPYC, one thread, 4 heads of 64, every key block scored: ``benchmarks/kernel_blocks.py --method
#: stickbreaking --far``): 128 x 256 the fastest of 64-256 x 128-512 in training at 1,024 tokens and within
#: 3 % of the fastest in evaluation block by block at 4,096 (docs/results/performance-new-methods-cpu-4.md).
KEY_BLOCK = 256
#: Queries and keys per block of the fused C++ forward (evaluation in float32, ``native.py``), where its blocks
#: cost no Python: 64 x 128 the fastest or within 2 % of it of 64-256 x 64-512 with random inputs (sticks spent
#: within a few hundred keys, heads stopping a block sooner), and within 2 % of the fastest with every key
#: block scored, at 4,096 tokens with 4 heads of 64 and 8 of 16 (``benchmarks/kernel_blocks.py --method
#: stickbreaking --eval [--far] --batch 1 --blocks 64 128 256 --key-blocks 64 128 256 512``; an AMD EPYC, one
#: thread; docs/results/performance-new-methods-cpu-5.md).
FUSED_BLOCK = 64
FUSED_KEY_BLOCK = 128
#: A remainder below ``exp(SPENT)`` is 0 in float32 (and bfloat16): farther keys weigh nothing.
SPENT = -120.0
#: The fused forward's stopping point where a gradient is taken: the smallest positive float32, so that a head
#: stops once every stick is exactly 0 (what ``exp(SPENT)`` is in float32).
SPENT_FLOAT32 = 2.0 ** -149
#: The group norm's epsilon (torch's default, the authors' GroupNorm).
NORM_EPS = 1e-5


def _allowed(q_len: int, k_len: int, start: int, rows: int, first: int, stop: int, pad: Optional[Tensor],
             device) -> Tensor:
    """bool ``[B or 1, 1, rows, stop - first]``: key ``j`` (of ``first .. stop -
    1``) strictly before query ``i`` (of ``start .. start + rows - 1``; queries
    the last ``q_len`` of ``k_len`` keys) and not padding (``pad`` ``[B, S]``)."""
    offset = k_len - q_len
    query = torch.arange(offset + start, offset + start + rows, device=device)[:, None]
    key = torch.arange(first, stop, device=device)[None, :]
    allowed = (key < query)[None, None]
    if pad is not None:
        allowed = allowed & ~pad[:, None, None, first:stop]
    return allowed


def _excluded(q_len: int, k_len: int, start: int, rows: int, first: int, stop: int, pad: Optional[Tensor],
              device) -> Optional[Tensor]:
    """bool ``[B or 1, 1, rows, stop - first]``, True where :func:`_allowed` is
    False, with the keys from ``stop - 1`` down to ``first`` (the kernel's
    order); None where every key is allowed (a block wholly before the first
    query, no padding)."""
    if stop <= k_len - q_len + start and pad is None:
        return None
    offset = k_len - q_len
    query = torch.arange(offset + start, offset + start + rows, device=device)[:, None]
    key = torch.arange(stop - 1, first - 1, -1, device=device)[None, :]
    excluded = (key >= query)[None, None]
    if pad is not None:
        excluded = excluded | _reversed(pad[:, None, None, first:stop], 3)
    return excluded


def _reversed(x: Tensor, axis: int = 2) -> Tensor:
    """``x`` with ``axis`` reversed, as one index select on the axes before it merged (``torch.flip``, or a
    select on a 4-d tensor, takes several times as long on the CPU)."""
    flat = x.reshape((-1,) + x.shape[axis:])
    return flat.index_select(1, torch.arange(x.size(axis) - 1, -1, -1, device=x.device)).view(x.shape)


def _bmm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``a @ b`` of ``[B, H, m, n]`` and ``[B, H, n, p]`` into ``out`` (a buffer's view; no allocation)."""
    torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out=out.flatten(0, 1))
    return out


def add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` over any leading axes (``[..., m, p]``), ``acc`` a view
    of a larger contiguous tensor, in place (``view``, not ``flatten``: a copy
    would take the sum and drop it; ``view`` raises instead).  PaTH's kernel
    uses it too."""
    acc.view((-1,) + acc.shape[-2:]).baddbmm_(a.flatten(0, -3), b.flatten(0, -3))


def _view(space: Tensor, *shape: int) -> Tensor:
    """The first elements of the buffer ``space`` as a contiguous tensor of ``shape``."""
    return space[:math.prod(shape)].view(shape)


def stickbreaking_reference(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    """The naive stick-breaking attention, literally the product, in float64:
    ``(sum_j A_ij v_j, remainder 1 - sum_j A_ij, weights A)``, shapes
    ``[B, H, T, D]``, ``[B, H, T]``, ``[B, H, T, S]`` (queries the last ``T`` of
    ``S`` keys; ``key_padding_mask`` ``[B, S]``, True at padding)."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    allowed = _allowed(q.size(2), k.size(2), 0, q.size(2), 0, k.size(2), pad, q.device)
    beta = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~allowed, 0.0)
    left = 1.0 - beta  # 1 at keys the query does not see
    # prod_{k > j} (1 - beta_k): the cumulative product from the last key, shifted one key left
    after = torch.cumprod(left.flip(-1), dim=-1).flip(-1)
    after = torch.cat([after[..., 1:], torch.ones_like(after[..., :1])], dim=-1)
    weights = beta * after
    return weights @ v, 1.0 - weights.sum(-1), weights


def _blocks(k_len: int, q_len: int, start: int, rows: int, block: int):
    """The key blocks ``(first, stop)`` of the queries ``start .. start + rows - 1``,
    from the diagonal backwards: keys ``< offset + start + rows - 1`` only."""
    stop = k_len - q_len + start + rows - 1  # the last query's keys end before itself
    while stop > 0:
        first = max(0, stop - block)
        yield first, stop
        stop = first


def _block_terms(qs: Tensor, k: Tensor, excluded: Optional[Tensor], z: Tensor, beta: Tensor, weights: Tensor):
    """One key block's ``(beta, A, kept)`` for scaled queries ``qs`` and keys
    ``k`` nearest first, ``[B, H, rows, D]`` and ``[B, H, cols, D]``, into the
    buffers ``z``, ``beta`` and ``weights`` ``[B, H, rows, cols]`` (``weights``
    may be ``beta``, which it then overwrites): ``beta = sigmoid(z)``, the
    weights ``A_j = beta_j prod_{k nearer} (1 - beta_k)`` within the block, and
    ``kept`` ``[B, H, rows, 1]``, the share of the stick the whole block
    leaves.  ``1 - beta`` is ``sigmoid(-z)`` (exact where beta is near 1), the
    product a running one along the keys (no logarithm, no exponential); an
    excluded key has ``z = -inf``: ``beta = 0``, ``1 - beta = 1``."""
    _bmm(qs, k.transpose(-1, -2), z)
    if excluded is not None:
        z.masked_fill_(excluded, float("-inf"))
    torch.sigmoid(z, out=beta)
    kept = z.neg_().sigmoid_().cumprod_(-1)  # prod over the keys up to j, j's own included
    if weights is not beta:
        weights[..., :1].copy_(beta[..., :1])
    torch.mul(beta[..., 1:], kept[..., :-1], out=weights[..., 1:])
    return beta, weights, kept[..., -1:]


def _spent(carry: Tensor) -> bool:
    """Whether every query's remainder so far is below ``exp(SPENT)`` (0 in float32): no farther key counts."""
    return float(carry.max()) < math.exp(SPENT)


def negligible_remainder(dtype: torch.dtype) -> float:
    """Below this remainder no farther key can move an output or the
    remainder itself by more than ``SKIPPED_SHARE`` of a rounding unit of
    ``dtype`` (the farther keys' weights sum to at most the remainder, each
    output is at most the largest ``|v|``): where no gradient is taken, a
    head's queries stop reading keys there (the house's standard for keys
    left out, as ALiBi's key windows leave them: ``causal_blocks``).
    ``2^-39`` in float32."""
    return SKIPPED_SHARE * torch.finfo(dtype).eps


def _read_block(queries: Tensor, keys: Tensor, values: Tensor, carry: Tensor, first_seen: int,
                pad: Optional[Tensor], space, acc: Tensor, active: Optional[Tensor]) -> Tensor:
    """One key block for the heads still reading, no gradient, in eager
    PyTorch (where the fused forward does not run): adds ``sum_j carry A_j
    v_j`` to their rows of ``acc`` ``[heads, rows, Dv]`` (the rows
    ``active``, or all where None) and returns the stick left after the
    block ``[n, rows]``; queries ``[n, rows, D]`` (scaled), keys and values
    ``[n, cols, D]`` (nearest first), ``carry`` ``[n, rows]`` the stick each
    query has left before the block (a tensor this function may overwrite).
    Query ``r`` sees the keys ``c >= first_seen - r``; ``pad`` ``[n, cols]``
    (uint8, nonzero at padding) or None.  ``space``: three flat buffers of
    at least ``n x rows x max(cols, Dv)`` floats."""
    n, rows, _ = queries.shape
    cols, Dv = keys.size(1), values.size(-1)
    _count_scored(n * rows * cols)
    z, weights = (_view(t, n, 1, rows, cols) for t in space[:2])
    excluded = None
    if first_seen > 0:
        row = torch.arange(rows, device=queries.device)[:, None]
        excluded = (torch.arange(cols, device=queries.device)[None, :] < first_seen - row)[None, None]
    if pad is not None:
        keys_padded = pad.to(torch.bool)[:, None, None, :]
        excluded = keys_padded if excluded is None else excluded | keys_padded
    _, weights, kept = _block_terms(queries.unsqueeze(1), keys.unsqueeze(1), excluded, z, weights, weights)
    gained = torch.bmm(weights[:, 0], values, out=_view(space[2], n, rows, Dv)).mul_(carry[..., None])
    if active is None:
        acc += gained
    else:
        acc.index_add_(0, active, gained)
    return carry.mul_(kept[:, 0, :, 0])


def _count_scored(pairs: int) -> None:
    """Called with the (query, key) pairs each evaluation forward computes (whole blocks, their masked parts
    included), block by block or once for the fused forward: the benchmarks count them here."""


def _head_pad(pad: Optional[Tensor], heads: int) -> Optional[Tensor]:
    """uint8 ``[B H, S]``: each head's row of the key padding ``pad`` ``[B, S]``, the keys reversed as the
    kernel's keys are (None for None)."""
    return None if pad is None else _reversed(pad[:, None], 2)[:, 0].repeat_interleave(heads, 0).to(torch.uint8)


def _forward_by_heads(qs: Tensor, kr: Tensor, vr: Tensor, pad: Optional[Tensor], block: int, key_block: int,
                      exact: torch.dtype) -> Tuple[Tensor, Tensor]:
    """The forward where no gradient is taken: ``(sum_j A_ij v_j, remainder)``,
    ``[B, H, T, Dv]`` and ``[B, H, T]``, each head of a query block reading
    key blocks (:func:`_read_block`) until its own queries' remainders are
    all below :func:`negligible_remainder` (a trained model's heads spend
    their sticks at very different distances: one long-sighted head would
    keep every other head reading); the heads still reading are gathered
    into one batch per key block."""
    B, H, T, _ = qs.shape
    S, Dv = kr.size(2), vr.size(-1)
    floor = negligible_remainder(exact)
    heads = B * H
    qf, kf, vf = qs.flatten(0, 1), kr.flatten(0, 1), vr.flatten(0, 1)  # [B H, ., D]
    head_pad = _head_pad(pad, H)
    out = qs.new_empty((heads, T, Dv))
    rem = qs.new_empty((heads, T))
    if native_runs(qs):  # every block in one call of the C++ forward
        out, rem, scored = native_forward(qf, kf, vf, head_pad, block, key_block, floor)
        _count_scored(scored)
        return out.view(B, H, T, Dv), rem.view(B, H, T)
    space = [qs.new_empty(heads * block * max(key_block, Dv)) for _ in range(3)]
    for start in range(0, T, block):
        rows = min(block, T - start)
        part = slice(start, start + rows)
        acc = out[:, part].zero_()
        every = torch.arange(heads, device=qs.device)
        active = None  # the heads still reading (None: all of them)
        queries = qf[:, part]  # [n, rows, D]
        carry = qs.new_ones((heads, rows))
        for first, stop in _blocks(S, T, start, rows, key_block):
            keys = slice(S - stop, S - first)
            k_block, v_block = kf[:, keys], vf[:, keys]
            block_pad = None if head_pad is None else head_pad[:, keys]
            if active is not None:
                k_block, v_block = k_block.index_select(0, active), v_block.index_select(0, active)
                block_pad = None if block_pad is None else block_pad.index_select(0, active)
            if block_pad is not None and not bool(block_pad.any()):
                block_pad = None
            carry = _read_block(queries, k_block, v_block, carry, stop - (S - T) - start,
                                None if block_pad is None else block_pad.contiguous(), space, acc, active)
            reading = carry.amax(1) >= floor
            if not bool(reading.all()):  # heads whose queries have all spent their sticks stop here
                done = every if active is None else active
                rem[:, part].index_copy_(0, done[~reading], carry[~reading])
                active = done[reading]
                if active.numel() == 0:
                    break
                queries, carry = queries[reading], carry[reading]
        else:
            rem[:, part].index_copy_(0, every if active is None else active, carry)
    return out.view(B, H, T, Dv), rem.view(B, H, T)


def _prepared(q: Tensor, k: Tensor, v: Tensor):
    """``(exact dtype, q / sqrt(d), k and v reversed along the sequence)``: nearest first within a block is then
    the memory order."""
    exact = torch.promote_types(q.dtype, torch.float32)
    # contiguous whatever the inputs' layout (a product keeps its input's strides): the backward's gradients,
    # zeros like these, are summed into through views
    qs = (q.to(exact) * q.size(-1) ** -0.5).contiguous()
    return exact, qs, _reversed(k.to(exact)), _reversed(v.to(exact))


class _StickBreaking(torch.autograd.Function):
    """The blockwise kernel with its recomputing backward (linear memory).
    Keys and values reversed once, the remainder carried from block to block
    as a product (``carry`` ``[B, H, rows, 1]``), every ``[B, H, rows, cols]``
    term written into buffers allocated once per call (a fresh tensor of that
    size is a fresh mapping of memory, its pages faulted in one by one).  In
    float32 on the CPU its forward is the fused C++ call of evaluation
    (``native.py``), each head stopping once its sticks are 0; the backward
    is this class's own either way."""

    @staticmethod
    def forward(ctx, q, k, v, pad, block, key_block):
        exact, qs, kr, vr = _prepared(q, k, v)
        B, H, T, _ = q.shape
        S, Dv = k.size(2), v.size(-1)
        if native_runs(qs):  # float32 on the CPU: the fused call
            # each head stops once its sticks are 0 in float32 (below the smallest float: exp(SPENT) rounds to 0)
            out, rem, _ = native_forward(qs.flatten(0, 1), kr.flatten(0, 1), vr.flatten(0, 1), _head_pad(pad, H),
                                         block, key_block, SPENT_FLOAT32)
            out, rem = out.view(B, H, T, Dv), rem.view(B, H, T)
            ctx.save_for_backward(q, k, v, pad, out, rem)
            ctx.blocks = block, key_block
            return out.to(q.dtype), rem
        out = q.new_zeros((B, H, T, Dv), dtype=exact)
        rem = q.new_ones((B, H, T), dtype=exact)
        space = [q.new_empty(B * H * block * key_block, dtype=exact) for _ in range(2)]
        pv_space = q.new_empty(B * H * block * Dv, dtype=exact)
        for start in range(0, T, block):
            rows = min(block, T - start)
            part = slice(start, start + rows)
            carry = q.new_ones((B, H, rows, 1), dtype=exact)
            for first, stop in _blocks(S, T, start, rows, key_block):
                keys = slice(S - stop, S - first)
                z, weights = (_view(t, B, H, rows, stop - first) for t in space)
                excluded = _excluded(T, S, start, rows, first, stop, pad, q.device)
                _, weights, kept = _block_terms(qs[:, :, part], kr[:, :, keys], excluded, z, weights, weights)
                out[:, :, part].addcmul_(_bmm(weights, vr[:, :, keys], _view(pv_space, B, H, rows, Dv)), carry)
                carry = carry * kept
                if _spent(carry):
                    break
            rem[:, :, part] = carry[..., 0]
        ctx.save_for_backward(q, k, v, pad, out, rem)
        ctx.blocks = block, key_block
        return out.to(q.dtype), rem

    @staticmethod
    def backward(ctx, d_out, d_rem):
        q, k, v, pad, out, rem = ctx.saved_tensors
        block, key_block = ctx.blocks
        exact, qs, kr, vr = _prepared(q, k, v)
        B, H, T, _ = q.shape
        S = k.size(2)
        d_out = d_out.to(exact) if d_out is not None else torch.zeros_like(out)
        d_rem = d_rem.to(exact) if d_rem is not None else torch.zeros_like(rem)
        # the total of g_m A_m over a row's keys (g_m = dO . v_m), the remainder's term
        # -d_rem * rem * beta_k folded in: each z_k's farther keys are the total less its nearer ones
        total = ((d_out * out).sum(-1) + d_rem * rem)[..., None]
        dq, dkr, dvr = torch.zeros_like(qs), torch.zeros_like(kr), torch.zeros_like(vr)
        space = [q.new_empty(B * H * block * key_block, dtype=exact) for _ in range(4)]
        for start in range(0, T, block):
            rows = min(block, T - start)
            part = slice(start, start + rows)
            carry = rem.new_ones((B, H, rows, 1))
            rest = total[:, :, part]  # the total less the keys visited
            for first, stop in _blocks(S, T, start, rows, key_block):
                keys = slice(S - stop, S - first)
                z, beta, weights, ga = (_view(t, B, H, rows, stop - first) for t in space)
                excluded = _excluded(T, S, start, rows, first, stop, pad, q.device)
                beta, weights, kept = _block_terms(qs[:, :, part], kr[:, :, keys], excluded, z, beta, weights)
                d_carried = d_out[:, :, part] * carry
                _bmm(d_carried, vr[:, :, keys].transpose(-1, -2), ga).mul_(weights)  # g A, A with the carry
                carry = carry * kept
                nearer = torch.cumsum(ga, -1, out=z)  # keys from the block's nearest to j, j included
                step = nearer[..., -1:].clone()
                # dz_j = g_j A_j - beta_j (g_j A_j + sum over the farther keys of g A + d_rem rem)
                dz = torch.addcmul(ga, beta, torch.sub(ga, nearer, out=nearer).add_(rest), value=-1.0, out=ga)
                rest = rest - step
                add_product(dq[:, :, part], dz, kr[:, :, keys])
                add_product(dkr[:, :, keys], dz.transpose(-1, -2), qs[:, :, part])
                add_product(dvr[:, :, keys], weights.transpose(-1, -2), d_carried)
                if _spent(carry):
                    break
        return (dq.mul_(q.size(-1) ** -0.5).to(q.dtype), _reversed(dkr).to(k.dtype), _reversed(dvr).to(v.dtype),
                None, None, None)


def stickbreaking_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                            block: Optional[int] = None, key_block: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The blockwise kernel: ``(sum_j A_ij v_j`` ``[B, H, T, D]`` in ``q``'s
    dtype, remainder ``prod_k (1 - beta_ik)`` ``[B, H, T]`` in float32, or
    float64 for float64 inputs), queries the last ``T`` of the ``S`` keys,
    ``key_padding_mask`` ``[B, S]`` True at padding.  Computed in float32 (or
    float64), ``block`` queries (:data:`BLOCK`, or :data:`FUSED_BLOCK` for
    the fused C++ forward) and ``key_block`` keys at a time
    (:data:`KEY_BLOCK` or :data:`FUSED_KEY_BLOCK`, or ``block`` where only
    that is given); differentiable in ``q``, ``k`` and ``v`` with memory
    linear in the length (:class:`_StickBreaking`); where no gradient is
    taken, :func:`_forward_by_heads`, each head stopping at its own spent
    stick."""
    sizes = (block, key_block)
    key_block = key_block or block or KEY_BLOCK
    block = block or BLOCK
    if block < 1 or key_block < 1:
        raise ValueError(f"block and key_block must be at least 1, not {block} and {key_block}")
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    if pad is not None and not bool(pad.any()):
        pad = None
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        exact, qs, kr, vr = _prepared(q, k, v)
        if sizes == (None, None) and native_runs(qs):
            block, key_block = FUSED_BLOCK, FUSED_KEY_BLOCK
        out, rem = _forward_by_heads(qs, kr, vr, pad, block, key_block, exact)
        return out.to(q.dtype), rem
    return _StickBreaking.apply(q, k, v, pad, block, key_block)


class StickBreakingOutput(nn.Module):
    """One layer's terms after the attention: the remainder's vector per head
    (``head_bias`` ``[H, D]``, zeros at first) and the group norm with one
    group per head (``norm``), as the authors' ``SBAttention`` has them."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.head_bias = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.norm = nn.GroupNorm(num_heads, num_heads * head_dim, eps=NORM_EPS)

    def forward(self, out: Tensor, remainder: Tensor) -> Tensor:
        """``GroupNorm(out + remainder * head_bias)`` of ``out`` ``[B, H, T, D]``
        and ``remainder`` ``[B, H, T]``, computed in float32, in ``out``'s dtype."""
        B, H, T, D = out.shape
        x = out.to(torch.float32) + remainder.to(torch.float32)[..., None] * self.head_bias.to(torch.float32)[:, None]
        x = x.permute(0, 2, 1, 3).reshape(B * T, H * D)
        x = F.group_norm(x, H, self.norm.weight.to(torch.float32), self.norm.bias.to(torch.float32), self.norm.eps)
        return x.view(B, T, H, D).permute(0, 2, 1, 3).to(out.dtype)


#: The extension methods that apply: none (no softmax for logn or SSMax to sharpen, no position to scale).
STICKBREAKING_EXTENSIONS = ("none",)


def refuse_dropout(method: str, dropout: float) -> None:
    """One ``ConfigError`` line for attention dropout, which a method's own kernel does not take."""
    if dropout > 0:
        raise ConfigError(f"attention_dropout={dropout:g} is not valid with {method} attention, whose own kernel "
                          "has no attention dropout (nor do the authors' models): set --attention-dropout 0")


class StickBreakingPositions(OwnAttentionStack):
    """The stack's stick-breaking object: no parameters of its own; each layer
    gets its own terms (:meth:`for_layer`).  ``own_kernel``: a layer calls
    :meth:`LayerStickBreaking.attend` in place of the shared kernels, which
    add a bias to a softmax this method does not have."""

    method = "stickbreaking"
    extensions = STICKBREAKING_EXTENSIONS
    layer_attribute = "stickbreaking"

    def __init__(self, num_heads: int, head_dim: int, scaling: Scaling = NO_SCALING):
        self.head_dim = head_dim
        OwnAttentionStack.__init__(self, num_heads, scaling)

    def for_layer(self) -> "LayerStickBreaking":
        return LayerStickBreaking(self.num_heads, self.head_dim, self.scaling)


class LayerStickBreaking(nn.Module, StickBreakingPositions):
    """One layer's stick-breaking attention: the kernel and its terms after it
    (``terms``: ``self_attn.stickbreaking.terms.head_bias`` and ``.norm``)."""

    def __init__(self, num_heads: int, head_dim: int, scaling: Scaling = NO_SCALING):
        nn.Module.__init__(self)
        StickBreakingPositions.__init__(self, num_heads, head_dim, scaling)
        self.terms = StickBreakingOutput(num_heads, head_dim)

    def for_layer(self) -> "LayerStickBreaking":
        return self

    def attend(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, key_padding_mask: Optional[Tensor],
               state: Optional[Dict[str, Tensor]] = None, dropout_p: float = 0.0) -> Tensor:
        """The layer's attention output ``[B, H, T, D]`` (before the output
        projection) of the ``T`` new tokens' ``q``, ``k``, ``v`` ``[B, H, T, D]``;
        ``x`` (their input ``[T, B, C]``) is not read.  ``state``: the layer's KV
        cache as a dict (fairseq's names ``prev_key``, ``prev_value``, batch
        first), extended in place, or None; ``key_padding_mask`` ``[B, S0 + T]``
        covers the cached keys and the new ones."""
        refuse_dropout("stick-breaking", dropout_p)
        if state is not None:
            if "prev_key" in state:
                k = torch.cat([state["prev_key"], k], dim=2)
                v = torch.cat([state["prev_value"], v], dim=2)
            state["prev_key"], state["prev_value"] = k, v
        out, remainder = stickbreaking_attention(q, k, v, key_padding_mask)
        return self.terms(out, remainder)
