"""PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda and Kim, "PaTH
Attention: Position Encoding via Accumulating Householder Transformations",
arXiv 2505.16381): a data-dependent multiplicative position encoding.

Each token ``t`` gives, per head, a unit vector ``w_t`` and ``beta_t = 2
sigmoid(.)`` in ``(0, 2)``, and with them ``H_t = I - beta_t w_t w_t^T``
(a Householder reflection at ``beta = 2``; its eigenvalue ``1 - beta`` may be
negative).  Query ``i`` scores key ``j <= i``

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)

(``s_ii = q_i . k_i / sqrt(d)``), then softmax, optionally with FoX's forget
gate bias ``c_i - c_j`` added (PaTH-FoX; the gate is ``fox.py``'s).

Choices, each checked against the authors' layer (flash-linear-attention's
``PaTHAttention``) and kernel tests, read through the project's search tool:

* ``w``: a low-rank projection ``x -> 32 -> H * D`` without biases (theirs,
  for multi-head attention), then, optionally and by default, a causal
  depthwise convolution of width 3 without bias followed by SiLU (their
  ``ShortConvolution(kv_dim, 3)``, whose activation defaults to SiLU), then
  L2-normalized per head as ``w / sqrt(|w|^2 + 1e-6)`` (their ``l2_norm``).
* ``beta = 2 sigmoid(x W_b + b)``, one per head (their ``bt_proj``, with a bias).
* Initialization: normal weights with standard deviation 0.02, zero biases
  (their models' ``initializer_range``; the convolution too), so ``beta``
  starts near 1 for every token.
* The forget gate (``path_forget_gate``): FoX's ``logsigmoid(x W_g + b)`` per
  head, this package's ``LayerForgetGate`` itself.  With ``1`` its bias
  ``c_i - c_j`` is added **unscaled** to ``s_ij`` (FoX's softmax), so that
  PaTH-FoX with every ``beta = 0`` is exactly this package's FoX; with ``2``
  it is divided by ``sqrt(d)`` first, as the authors' kernel has it (its
  scores are ``(q . k + c_i - c_j) / sqrt(d)``): the same family of models,
  the gate's parameterization differing.
* No QK norm (theirs is optional and off by default); no attention dropout
  (refused where the model is built).
* Padding (ours; their layer packs rows): a padded token's ``beta`` is 0
  (``H = I``), its projection is 0 before the convolution, and it is masked
  as a key, so a left- or right-padded row scores as its unpadded self.

The kernel (:func:`path_attention`): tokens in blocks of ``c``.  Within a
block, products of consecutive ``H`` have the compact (UT) form: with ``W``
the block's ``w`` rows, ``L = strictly_lower(W W^T) diag(beta)`` and ``T =
(I + L)^{-1}`` (one triangular inverse per block), a key carried through the
later ``H`` of its block is ``k_j - sum_t beta_t a_tj w_t`` with ``a = T
strictly_lower(W K^T)``, a query carried back to its block's start is ``q_i -
sum_t beta_t (lower(Q W^T) T W)_it``, and the whole block is ``M = I - (beta
W)^T T W``.  (The upper form ``(I + U)^{-1}``, ``U = strictly_upper(W W^T)
diag(beta)``, that a query's side suggests, is never formed: ``(I +
U)^{-T} diag(beta) = diag(beta) T``.)  A query row is carried through a block
as ``q M``, the ``d x d`` matrix formed once per block where ``d <= 2c``,
there the cheaper, else as ``q - (q (beta W)^T) (T W)``.  The queries then
sweep the earlier blocks from the diagonal backwards, all query blocks at
once (one step per block distance: query block ``m`` scores key block ``m -
d``), each step scoring a block of keys and carrying the queries through
that block's ``M``, with an online softmax; a query block leaves the sweep
once it has scored the first block, so the state shrinks step by step (no
concatenation).  Blocks are the leading axis (``[n, B, H, c, d]``), so a run
of blocks is one contiguous batch of the CPU's batched product, and the
scale ``1 / sqrt(d)`` is folded into the queries.  Time ``O(T^2 d)``, memory
``O(T d)`` per head (``[B, H, T, c]`` scores per step), ``T / c`` steps.
Where a gradient is taken the sweep is :class:`_TrainingSweep`, on
blocks merged in pairs up to :data:`SWEEP_BLOCK` tokens (:func:`_merged_terms`:
the triangular inverses stay small, the sweep's products grow and its steps
fewer), with a backward of its own (the softmax's, from each step's weights kept, and the
queries' gradients carried back through the blocks they went through; every
step's terms kept, ``O(T^2)`` in all, as dense attention's); autograd runs
through the block terms.  On the CPU in float32 (bfloat16 computed so), with
``native.py``'s library built, the block terms, their merges and the sweep are
C++ calls with backwards of their own instead (:class:`_BlockTerms`,
:class:`_Merge`, :class:`_FusedSweep`;
docs/results/performance-new-methods-cpu-6.md).  The naive reference (:func:`path_reference`)
forms every product ``H_i ... H_{j+1}`` as a matrix, in float64: the tests' oracle.

KV cache: the cached keys are kept transformed, ``H_t ... H_{j+1} k_j``; each
new token ``t`` updates every cached key ``k <- k - beta_t (k . w_t) w_t``
(a block of new tokens: ``K <- K M^T``, the blocks' products multiplied
first, one ``d x d`` product per key) before its own key is appended, and
the convolution's last two inputs are carried, so incremental decoding is the
full forward.  The new tokens' queries, carried to their start, score the
cached keys in one call of torch's fused CPU attention, which also returns
each row's log-sum-exp, merged into the sweep's online softmax.

Long evaluation (no gradient, more than :data:`CHUNK` tokens) is the cache's
path chunk by chunk (:func:`_by_chunks`): most pairs are then scored by the
fused kernel, and only the pairs within a chunk by the sweep
(``benchmarks/new_methods_cpu.py`` times it; docs/results/performance-new-methods-cpu-3.md).
Without a gradient or padding, on the CPU in float32 or bfloat16, the same
chunks, block terms, sweep, cache and forgotten keys are one C++ call instead
(:func:`_fused`, ``native.py``'s ``fa_path_forward``): the Python steps and
the temporaries between them were most of the eager path's cost
(docs/results/performance-new-methods-cpu-6.md).

Pure torch, no fairseq: this file travels with exported models.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .bias import OwnAttentionStack
from .causal_blocks import negligible_gap
from .fox import ForgetGates, LayerForgetGate
from .native import path_block_terms as native_block_terms, path_block_terms_backward as native_block_terms_backward
from .native import path_forward as native_forward, path_w as native_w, runs_for as native_runs
from .native import scaled as native_scaled, take as native_take
from .native import path_sweep_backward as native_sweep_backward, path_sweep_forward as native_sweep_forward
from .native import path_merge as native_merge, path_merge_backward as native_merge_backward
from .scaling import LOGIT_METHODS, NO_SCALING, Scaling
from .stickbreaking import add_product, refuse_dropout

#: Tokens per block of the kernel where gradients are taken (``BLOCK``; the training sweep merges them in pairs
#: up to ``SWEEP_BLOCK`` while it keeps at least ``SWEEP_STEPS`` blocks: :func:`_merges`), and where none are
#: (twice the head dimension, 32 to 64: :func:`inference_block`), and tokens per chunk where none are (a longer
#: input is read chunk by chunk, each chunk's queries scoring the keys before it in one fused attention call:
#: :func:`_by_chunks`).  Chosen on the CPU (an AMD EPYC, one thread, 4 heads of 64) with
#: ``benchmarks/kernel_blocks.py``, the evaluation sizes with its ``--eval``: blocks of 64 in chunks of 512 the
#: fastest at 2,048 and 8,192 tokens, and blocks of 32 with 8 heads of 16
#: (docs/results/performance-new-methods-cpu-4.md).
BLOCK = 64
SWEEP_BLOCK = 128
SWEEP_STEPS = 4
INFERENCE_BLOCKS = (32, 64)
CHUNK = 512
#: Queries and cached keys per product of the fused CPU call (:func:`_fused`) over the keys before a chunk.
FUSED_QUERY_BLOCK = 128
FUSED_KEY_BLOCK = 256
#: The fused call's blocks and chunks where all its keys (the cache's and the new) are at most
#: :data:`SHORT_FUSED` and the head dimension at most twice the block: smaller blocks cost fewer products for
#: their compact forms, and smaller chunks carry fewer queries through their blocks, while the cache read once
#: per chunk is still short (3-9 % less time at 1,024-3,072 tokens with heads of 16-64, even at 4,096 and
#: 8,192, slower at 16,384 by 5 %; with heads of 128, whose block products are D x D, 9 % slower at 3,072:
#: docs/results/performance-new-methods-cpu-6.md and -7.md).
SHORT_FUSED = 4096
SHORT_FUSED_BLOCKS = (32, 256)
#: The rank of the projection that gives ``w`` (the authors').
W_RANK = 32
#: The width of the short convolution on ``w`` (the authors').
CONV_WIDTH = 3
#: ``w / sqrt(|w|^2 + eps)`` (the authors' l2_norm).
NORM_EPS = 1e-6
#: The initial standard deviation of every PaTH projection (the authors' initializer_range).
INIT_STD = 0.02
#: Below this a float32 softmax's shifted score is taken as -inf: exp(-87) = 1.6e-38 is float32's last
#: normal decade (smallest normal 1.18e-38).
SUBNORMAL = -87.0


def path_reference(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, gate: Optional[Tensor] = None,
                   key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The naive PaTH attention in float64: ``(output [B, H, T, D], weights
    [B, H, T, S])`` with every ``H_i ... H_{j+1}`` formed as a matrix.  ``q``
    the last ``T`` of the ``S`` tokens whose ``k``, ``v``, ``w`` ``[B, H, S, D]``
    and ``beta`` ``[B, H, S]`` are given (keys untransformed); ``gate``: FoX's
    cumulative log gates ``c`` ``[B, H, S]`` or None; padded tokens get ``beta
    = 0`` and are masked as keys."""
    q, k, v, w, beta = (t.to(torch.float64) for t in (q, k, v, w, beta))
    B, H, T, D = q.shape
    S = k.size(2)
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    if pad is not None:
        beta = beta.masked_fill(pad[:, None], 0.0)
    eye = torch.eye(D, dtype=torch.float64, device=q.device)
    householder = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]  # [B, H, S, D, D]
    scores = q.new_full((B, H, T, S), float("-inf"))
    for row in range(T):
        i = S - T + row
        product = eye.expand(B, H, D, D)  # H_i ... H_{j+1}, for j = i first
        for j in range(i, -1, -1):
            scores[:, :, row, j] = (q[:, :, row, None, :] @ product @ k[:, :, j, :, None])[..., 0, 0]
            product = product @ householder[:, :, j]
    scores = scores / math.sqrt(D)
    if gate is not None:
        c = gate.to(torch.float64)
        scores = scores + c[:, :, S - T:, None] - c[:, :, None, :]
    if pad is not None:
        scores = scores.masked_fill(pad[:, None, None], float("-inf"))
    empty = scores.amax(-1, keepdim=True) == float("-inf")
    weights = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return weights @ v, weights


def inference_block(head_dim: int) -> int:
    """Tokens per block where no gradient is taken: twice the head dimension, within :data:`INFERENCE_BLOCKS`
    (a block's triangular inverse grows as its cube, its products with the head dimension)."""
    low, high = INFERENCE_BLOCKS
    return min(high, max(low, 2 * head_dim))


def _solve(matrix: Tensor, rhs: Tensor, upper: bool) -> Tensor:
    """``(I + matrix)^{-1} rhs``, ``matrix`` strictly triangular (unit diagonal implied)."""
    return torch.linalg.solve_triangular(matrix, rhs, upper=upper, unitriangular=True)


def _blocked(x: Tensor, blocks: int, size: int) -> Tensor:
    """``[B, H, T, ...]`` -> ``[blocks, B, H, size, ...]``, zero-padded at the end:
    blocks first, so that a run of blocks is one contiguous batch."""
    extra = blocks * size - x.size(2)
    if extra:
        x = torch.cat([x, x.new_zeros(x.shape[:2] + (extra,) + x.shape[3:])], dim=2)
    return x.view(x.shape[:2] + (blocks, size) + x.shape[3:]).movedim(2, 0).contiguous()


def _block_terms(qb: Tensor, kb: Tensor, wb: Tensor, bb: Tensor):
    """The compact (UT) form of each block, ``[n, B, H, c, ...]``: ``(local
    scores within the block, queries carried back to the block's start, keys
    carried to its end, the block's product)``, the product as ``(M,)``, the
    ``D x D`` matrix a query row is multiplied by, where ``D <= 2c`` (then the
    cheaper), else as ``(beta W, G)``: ``q M = q - (q (beta W)^T) G``.

    One triangular inverse per block, ``T = (I + L)^{-1}``: every term the
    upper form ``(I + U)^{-1}`` would give is written with it, since ``(I +
    U)^{-T} diag(beta) = diag(beta) T`` (``U^T = diag(beta) strictly_lower(W
    W^T)``, ``L = strictly_lower(W W^T) diag(beta)``), and ``G = T W``."""
    size, D = qb.size(-2), qb.size(-1)
    eye = torch.ones(size, size, dtype=torch.bool, device=qb.device)
    strictly_lower, lower = eye.tril(-1), eye.tril()
    low = _product(wb, wb.transpose(-1, -2)).mul_(bb[..., None, :]).masked_fill_(~strictly_lower, 0.0)
    inverse = _solve(low, torch.eye(size, dtype=qb.dtype, device=qb.device).expand_as(low), upper=False)
    wbeta = wb * bb[..., None]  # [n, B, H, c, D]
    g = _product(inverse, wb)  # T W
    # keys carried through the later H of their own block: k_j - sum_t beta_t a_tj w_t
    a = _product(inverse, _product(wb, kb.transpose(-1, -2)).masked_fill(~strictly_lower, 0.0))
    k_end = kb - _product(a.transpose(-1, -2), wbeta)
    qw = _product(qb, wb.transpose(-1, -2)).masked_fill(~lower, 0.0)  # [i, t]: q_i . w_t for t <= i
    local = _product(qb, kb.transpose(-1, -2)) - _product(qw, a * bb[..., None])
    # queries carried back to their block's start, and the block's product M = I - (beta W)^T G
    carried = qb - _product(qw, g * bb[..., None])
    if D <= 2 * size:
        through = (torch.eye(D, dtype=qb.dtype, device=qb.device) - _product(wbeta.transpose(-1, -2), g),)
    else:
        through = (wbeta, g)
    return local.masked_fill(~lower, float("-inf")), carried, k_end, through, (wbeta, g)


class _BlockTerms(torch.autograd.Function):
    """:func:`_block_terms` where a gradient is taken, as two C++ calls (``native.py``'s
    ``fa_path_block_terms`` and its backward): ``(local, carried, k_end, M)`` of blocks ``[n, B, H, c, ...]``
    in float32, the product as the ``D x D`` matrix (``D <= 2c``).  Autograd through the dozen products,
    masks and scalings of :func:`_block_terms` recorded each one and took its backward as two or three more
    passes over memory; the backward here is the same chain rule written out per block (its formulas at the
    C++ function), each block's products by ``sgemm`` with the block's terms in the core's cache, and what
    the forward saves per block (``T``, ``A``, ``G`` and ``lower(Q W^T)``) instead of autograd's record."""

    @staticmethod
    def forward(ctx, qb, kb, wb, bb):
        c, D = qb.shape[-2:]
        flat = [t.reshape(-1, c, D).contiguous() for t in (qb, kb, wb)] + [bb.reshape(-1, c).contiguous()]
        local, carried, k_end, m, saved = native_block_terms(*flat)
        ctx.save_for_backward(*flat, saved)
        ctx.shapes = (qb.shape, bb.shape)
        lead = qb.shape[:-2]
        return local.view(lead + (c, c)), carried.view(qb.shape), k_end.view(qb.shape), m.view(lead + (D, D))

    @staticmethod
    def backward(ctx, d_local, d_carried, d_k_end, d_m):
        *flat, saved = ctx.saved_tensors
        n, c, D = flat[0].shape
        shapes = ((n, c, c), (n, c, D), (n, c, D), (n, D, D))
        grads = [torch.zeros(shape) if d is None else d.reshape(shape).contiguous()
                 for d, shape in zip((d_local, d_carried, d_k_end, d_m), shapes)]
        dq, dk, dw, dbeta = native_block_terms_backward(*flat, saved, *grads)
        block_shape, beta_shape = ctx.shapes
        return dq.view(block_shape), dk.view(block_shape), dw.view(block_shape), dbeta.view(beta_shape)


def _product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of ``[n, B, H, m, k]`` and ``[n, B, H, k, p]`` as one batched product of 3-d views (``matmul`` on
    5-d operands takes up to 1.5x as long on the CPU)."""
    return torch.bmm(a.flatten(0, 2), b.flatten(0, 2)).view(a.shape[:-1] + b.shape[-1:])


def _carry(queries: Tensor, through) -> Tensor:
    """Query rows ``[n, ..., c, D]`` carried back through blocks whose products are ``through`` (sliced alike)."""
    if len(through) == 1:
        return _product(queries, through[0])
    left, right = through
    return queries - (queries @ left.transpose(-1, -2)) @ right


def path_attention(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, gate: Optional[Tensor] = None,
                   key_padding_mask: Optional[Tensor] = None, past_keys: Optional[Tensor] = None,
                   past_values: Optional[Tensor] = None, block: Optional[int] = None, return_keys: bool = False,
                   chunk: Optional[int] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The blockwise kernel: ``(output [B, H, T, D] in q's dtype, keys)``.

    ``q``, ``k``, ``v``, ``w`` ``[B, H, T, D]`` and ``beta`` ``[B, H, T]`` of
    the ``T`` new tokens; ``past_keys`` / ``past_values`` ``[B, H, S0, D]``:
    the cache, keys already carried through every earlier token's ``H``;
    ``key_padding_mask`` ``[B, S0 + T]`` (True at padding); ``gate``: FoX's
    cumulative log gates ``[B, H, S0 + T]`` or None.  ``keys`` (where
    ``return_keys``): every key carried through the new tokens' ``H`` too,
    ``[B, H, S0 + T, D]``, the next call's ``past_keys``.  Computed in float32
    (float64 for float64 inputs), ``block`` tokens at a time (:data:`BLOCK`
    where a gradient is taken, else :func:`inference_block`); where no
    gradient is taken, ``chunk`` tokens (:data:`CHUNK`) per call of
    :func:`_by_chunks`."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, w, beta, gate))
    fused = not grad and _fused_runs(q, key_padding_mask, past_keys)
    keys_in_all = q.size(2) + (0 if past_keys is None else past_keys.size(2))
    if fused and keys_in_all <= SHORT_FUSED and q.size(-1) <= 2 * SHORT_FUSED_BLOCKS[0]:  # where no size is named
        block, chunk = block or SHORT_FUSED_BLOCKS[0], chunk or SHORT_FUSED_BLOCKS[1]
    if block is None:
        block = BLOCK if grad else inference_block(q.size(-1))
    chunk = chunk or CHUNK
    if block < 1 or chunk < 1:
        raise ValueError(f"block and chunk must be at least 1, not {block} and {chunk}")
    if fused:
        return _fused(q, k, v, w, beta, gate, past_keys, past_values, block, chunk, return_keys)
    if not grad and q.size(2) > chunk:
        return _by_chunks(q, k, v, w, beta, gate, key_padding_mask, past_keys, past_values, block, return_keys, chunk)
    exact = torch.promote_types(q.dtype, torch.float32)
    out_dtype = q.dtype
    q, k, v, w, beta = (t.to(exact) for t in (q, k, v, w, beta))
    B, H, T, D = q.shape
    S0 = 0 if past_keys is None else past_keys.size(2)
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    if pad is not None:
        beta = beta.masked_fill(pad[:, None, S0:], 0.0)
    size = min(block, T)
    # where the training sweep runs, blocks are merged in pairs ``merges`` times (a whole number of merged blocks)
    merges = _merges(T, size, D) if grad and not S0 else 0
    blocks = -(-T // (size << merges)) << merges
    # the scale folded into the queries: every score below is already q . k / sqrt(d)
    qb, kb, vb, wb = (_blocked(t, blocks, size) for t in (q * D ** -0.5, k, v, w))
    bb = _blocked(beta, blocks, size)  # [n, B, H, c]; 0 past the end: H = I there
    fused = grad and not S0 and not return_keys and D <= 2 * size and native_runs(q)
    if fused:  # the training sweep's terms
        local, carried, k_end, m = _BlockTerms.apply(qb, kb, wb, bb)
        terms = (local, carried, k_end, (m,))
    else:
        terms = _block_terms(qb, kb, wb, bb)
    past = None
    if S0:
        past = (past_keys.to(exact), past_values.to(exact), None if gate is None else gate.to(exact)[:, :, None, :S0],
                None if pad is None else pad[:, None, None, :S0])
    key_pad = _blocked(pad[:, None, S0:], blocks, size)[..., None, :] if pad is not None else None
    c_new = None if gate is None else _blocked(gate.to(exact)[..., S0:], blocks, size)  # [n, B, H, c]
    if grad and past is None:  # the sweep with a backward of its own, on the merged blocks
        local, carried, k_end, through = (_fused_merges if fused else _merged_terms)(terms, merges)
        vb, c_new, key_pad = _merged_blocks(vb, c_new, key_pad, merges)
        sweep = _FusedSweep if len(through) == 1 and native_runs(q) else _TrainingSweep
        out = sweep.apply(_masked(local, c_new, c_new, key_pad), carried, k_end, vb, c_new, key_pad, *through)
    else:
        out = _sweep(terms, vb, c_new, key_pad, past)
    out = out.movedim(0, 2).flatten(2, 3)[:, :, :T]
    keys = _keys_carried(terms, past_keys.to(exact) if S0 else None, T) if return_keys else None
    return out.to(out_dtype), keys


def _fused_runs(q: Tensor, key_padding_mask: Optional[Tensor], past_keys: Optional[Tensor]) -> bool:
    """Whether :func:`_fused` serves a call without a gradient: the fused CPU calls run for ``q``
    (``native.runs_for``), no padding, and, after a cache, at least ``D / 2`` new tokens (fewer, a decoding
    step, carry the cache through their blocks as two thin products, the cheaper: :func:`_keys_carried`)."""
    if key_padding_mask is not None and bool(key_padding_mask.any()):
        return False
    if past_keys is not None and 2 * q.size(2) < q.size(-1):
        return False
    return native_runs(q)


def _fused(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, gate: Optional[Tensor],
           past_keys: Optional[Tensor], past_values: Optional[Tensor], block: int, chunk: int,
           return_keys: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`path_attention` without a gradient or padding as one C++ call (``native.path_forward``): the
    same chunks, blocks and online softmax as :func:`_by_chunks` and :func:`_sweep`, in float32, each head's
    block terms, sweep and cached keys (read :data:`FUSED_KEY_BLOCK` at a time by :data:`FUSED_QUERY_BLOCK`
    queries) staying in the core's cache, the new tokens' keys carried into the cache's buffer in place; with
    the gate, the cached keys it has made negligible for every query of a chunk left out, as
    :func:`_forgotten` leaves them out (``_count_skipped`` is told how many query-key pairs that left out)."""
    B, H, T, D = q.shape
    S0 = 0 if past_keys is None else past_keys.size(2)
    flat = [native_scaled(q, D ** -0.5).view(B * H, T, D)]  # the copies in kept buffers (native.SCRATCH)
    flat += [t.to(torch.float32).reshape(B * H, *t.shape[2:]).contiguous() for t in (k, w, beta)]
    values = v if past_values is None else torch.cat([past_values, v], dim=2)
    values = values.to(torch.float32).reshape(B * H, S0 + T, v.size(-1)).contiguous()
    keys = (q.new_empty((B * H, S0 + T, D), dtype=torch.float32) if return_keys
            else native_take((B * H, S0 + T, D)))
    if S0:
        keys[:, :S0] = past_keys.reshape(B * H, S0, D)
    c = None if gate is None else gate.to(torch.float32).reshape(B * H, S0 + T).contiguous()
    gap_base = negligible_gap(1, torch.float32)  # log(keys) + this: the gap for that many keys
    out, skipped = native_forward(*flat, values, keys, c, gap_base, block, chunk, FUSED_QUERY_BLOCK, FUSED_KEY_BLOCK,
                               return_keys)
    _count_skipped(skipped)
    out = out.view(B, H, T, -1).to(q.dtype)
    return out, keys.view(B, H, S0 + T, D) if return_keys else None


def _count_skipped(pairs: int) -> None:
    """Told the (query, cached key) pairs one fused call left out, summed over its heads and chunks
    (benchmarks and tests replace it)."""


def _merges(T: int, size: int, D: int) -> int:
    """How many times the training sweep merges blocks in pairs: up to :data:`SWEEP_BLOCK` tokens per merged
    block, while the sweep keeps at least :data:`SWEEP_STEPS` blocks (fewer, larger blocks score more of the
    masked half of the diagonal blocks) and the block product is a ``D x D`` matrix."""
    merges = 0
    while D <= 2 * size << merges and size << merges + 1 <= min(SWEEP_BLOCK, T // SWEEP_STEPS):
        merges += 1
    return merges


def _merged_terms(terms, merges: int):
    """The block terms of :func:`_block_terms` (``local``, ``carried``, ``k_end``, ``(M,)``) for blocks merged
    in pairs ``merges`` times.  Of an earlier block ``e`` and the next ``o``: the local scores gain the
    corner ``carried_o . k_end_e`` (``o``'s queries at ``o``'s start, ``e``'s keys at ``e``'s end: the
    same point), ``o``'s queries are carried on through ``M_e`` (``q M_e``), ``e``'s keys on through
    ``M_o`` (``k M_o^T``), and the pair's product is ``M_o M_e``."""
    local, carried, k_end, through = terms[:4]
    for _ in range(merges):
        (m,) = through
        early, late = (slice(0, None, 2), slice(1, None, 2))
        corner = _product(carried[late], k_end[early].transpose(-1, -2))
        top = torch.cat([local[early], torch.full_like(local[early], float("-inf"))], dim=-1)
        local = torch.cat([top, torch.cat([corner, local[late]], dim=-1)], dim=-2)
        carried = torch.cat([carried[early], _product(carried[late], m[early])], dim=-2)
        k_end = torch.cat([_product(k_end[early], m[late].transpose(-1, -2)), k_end[late]], dim=-2)
        through = (_product(m[late], m[early]),)
    return local, carried, k_end, through


class _Merge(torch.autograd.Function):
    """One level of :func:`_merged_terms`' merge as C++ calls (``native.py``'s ``fa_path_merge`` and its backward),
    where the block terms are fused: blocks ``[n, B, H, ...]`` in pairs.  Autograd through the eager merge took
    the pairs as strided slices, whose gradients it filled with zeros and copied back, as long as the merge's
    products themselves."""

    @staticmethod
    def forward(ctx, local, carried, k_end, m):
        n, B, H = carried.shape[:3]
        flat = [t.reshape(n, B * H, *t.shape[3:]).contiguous() for t in (local, carried, k_end, m)]
        merged = native_merge(*flat)
        ctx.save_for_backward(*flat[1:])
        ctx.shapes = [t.shape for t in (local, carried, k_end, m)]
        ctx.merged_shapes = [t.shape for t in merged]
        return tuple(t.view(n // 2, B, H, *t.shape[2:]) for t in merged)

    @staticmethod
    def backward(ctx, d_local, d_carried, d_k_end, d_m):
        carried, k_end, m = ctx.saved_tensors
        grads = [torch.zeros(shape) if d is None else d.reshape(shape).contiguous()
                 for d, shape in zip((d_local, d_carried, d_k_end, d_m), ctx.merged_shapes)]
        return tuple(g.view(shape) for g, shape in zip(native_merge_backward(carried, k_end, m, *grads), ctx.shapes))


def _fused_merges(terms, merges: int):
    """:func:`_merged_terms` by :class:`_Merge` (the block products as ``D x D`` matrices)."""
    local, carried, k_end, (m,) = terms[:4]
    for _ in range(merges):
        local, carried, k_end, m = _Merge.apply(local, carried, k_end, m)
    return local, carried, k_end, (m,)


def _merged_blocks(vb: Tensor, c_new: Optional[Tensor], key_pad: Optional[Tensor], merges: int):
    """Values ``[n, B, H, c, D]``, gates ``[n, B, H, c]`` and key padding ``[n, B, 1, 1, c]`` re-blocked as
    :func:`_merged_terms`' merged blocks (``2^merges`` consecutive blocks each)."""
    if not merges:
        return vb, c_new, key_pad
    r = 1 << merges

    def joined(x: Tensor, axis: int) -> Tensor:  # blocks [n, ...] -> [n / r, ...], r blocks along ``axis``
        x = x.unflatten(0, (x.size(0) // r, r)).movedim(1, axis - 1)
        return x.flatten(axis - 1, axis)

    return (joined(vb, -2), None if c_new is None else joined(c_new, -1),
            None if key_pad is None else joined(key_pad, -1))


def _by_chunks(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, gate: Optional[Tensor],
               key_padding_mask: Optional[Tensor], past_keys: Optional[Tensor], past_values: Optional[Tensor],
               block: int, return_keys: bool, chunk: int) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`path_attention` without a gradient, ``chunk`` new tokens per
    call, each call with the keys before its chunk as its cache (carried to
    the chunk's start): the queries of a chunk then score those keys in one
    fused attention call (:func:`_with_past`), the cheap part of the work,
    and only the pairs within a chunk go through the sweep.  Carrying the
    cache through a chunk is one ``D x D`` product per key (the chunk's
    blocks' products multiplied first)."""
    S0, T = (0 if past_keys is None else past_keys.size(2)), q.size(2)
    values = v if past_values is None else torch.cat([past_values, v], dim=2)
    keys, outs = past_keys, []
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        new = slice(start, stop)
        out, keys = path_attention(
            q[:, :, new], k[:, :, new], v[:, :, new], w[:, :, new], beta[:, :, new],
            None if gate is None else gate[..., :S0 + stop],
            None if key_padding_mask is None else key_padding_mask[:, :S0 + stop],
            keys, values[:, :, :S0 + start] if S0 + start else None, block,
            return_keys=return_keys or stop < T, chunk=chunk)
        outs.append(out)
    return torch.cat(outs, dim=2), keys if return_keys else None


def _keys_carried(terms, past_keys: Optional[Tensor], T: int) -> Tensor:
    """Every key carried through the new tokens' ``H`` (the next call's
    cache), ``[B, H, S0 + T, D]``: a key row ``k`` goes through a block as
    ``k M^T`` (``M = I - (beta W)^T G``, the block's product).  The products
    of the blocks after each block are formed once, so that each key takes
    one ``D x D`` product; where the new tokens are fewer than ``D / 2`` (a
    decoding step) the cache goes through each block as two thin products
    instead, the cheaper."""
    k_end = terms[2]
    left, right = terms[4]  # beta W and G: M^T = I - G^T (beta W)
    n, B, H, c, D = k_end.shape
    thin = 2 * T < D
    eye = torch.eye(D, dtype=k_end.dtype, device=k_end.device)
    after, new = None, []  # the product of the blocks after block m (None: I), as a key row sees them
    for m in range(n - 1, -1, -1):
        new.append(k_end[m] if after is None else k_end[m] @ after)
        if m or (past_keys is not None and not thin):
            block = eye - right[m].transpose(-1, -2) @ left[m]
            after = block if after is None else block @ after
    keys = torch.cat(new[::-1], dim=2)[:, :, :T]
    if past_keys is None:
        return keys
    if thin:
        for m in range(n):
            past_keys = past_keys - (past_keys @ right[m].transpose(-1, -2)) @ left[m]
    else:
        past_keys = past_keys @ after
    return torch.cat([past_keys, keys], dim=2)


class _Ranges(torch.autograd.Function):
    """``x[a:b]`` for every ``(a, b)`` of ``ranges`` at once, their gradients
    summed into one tensor in the backward: autograd's own slice fills a
    tensor of zeros the size of the whole ``x`` for each slice's gradient (the
    sweep takes one slice of each block term per step)."""

    @staticmethod
    def forward(ctx, x, ranges):
        ctx.ranges, ctx.shape = ranges, x.shape
        return tuple(x[a:b] for a, b in ranges)

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for (a, b), grad in zip(ctx.ranges, grads):
            if grad is not None:
                total = grad.new_zeros(ctx.shape) if total is None else total
                total[a:b] += grad
        return total, None


def _slices(x: Optional[Tensor], ranges) -> list:
    """``[x[a:b] for (a, b) in ranges]``, through :class:`_Ranges` where ``x`` takes a gradient."""
    if x is None:
        return [None] * len(ranges)
    if torch.is_grad_enabled() and x.requires_grad:
        return list(_Ranges.apply(x, ranges))
    return [x[a:b] for a, b in ranges]


def _masked(scores: Tensor, c_query: Optional[Tensor], c_key: Optional[Tensor], pad: Optional[Tensor]) -> Tensor:
    """``scores`` ``[..., c, keys]`` with FoX's gate bias ``c_i - c_j`` added (``c_query`` ``[..., c]``, ``c_key``
    ``[..., keys]``, or None) and the padded keys (``pad``, True there, or None) at ``-inf``."""
    if c_query is not None:
        scores = scores + c_query[..., None] - c_key[..., None, :]
    return scores if pad is None else scores.masked_fill(pad, float("-inf"))


def _sweep(terms, vb: Tensor, c_new: Optional[Tensor], key_pad: Optional[Tensor], past) -> Tensor:
    """The attention of every query block, ``[n, B, H, c, D]``: the diagonal
    blocks, then the earlier blocks from the diagonal backwards, all query
    blocks at once (one step per block distance ``d``: query block ``m``
    scores key block ``m - d``), with an online softmax.  The state and the
    queries hold the query blocks not yet done: block ``d`` is done at step
    ``d`` (after the cache's keys, ``past``), and leaves them."""
    local, carried, k_end, through, _ = terms
    n = local.size(0)
    k_end_t = k_end.transpose(-1, -2).contiguous()  # a contiguous right operand: the CPU's batched product is faster
    # step d's key blocks 0 .. n - d - 1, its queries' gates (blocks d ..) and the blocks they are carried through
    earlier = [(0, n - d) for d in range(1, n)]
    keys, values, c_keys = (_slices(t, earlier) for t in (k_end_t, vb, c_new))
    c_queries = _slices(c_new, [(d, n) for d in range(1, n)])
    moves = [_slices(t, [(1, n - d + 1) for d in range(1, n)]) for t in through]
    pads = _slices(key_pad, earlier)

    scores = _masked(local, c_new, c_new, key_pad)
    top = _finite_max(scores.amax(-1))
    weights = _shifted_exp(scores, top)
    state = (top, weights.sum(-1), weights @ vb)
    # without a gradient, each step's scores are written into one buffer and the state updated in place
    space = None if torch.is_grad_enabled() and any(t.requires_grad for t in (local, carried, k_end, vb)) \
        else local.new_empty(max(n - 1, 0) * local[0].numel())
    queries, done, starts = carried, [], []
    for d in range(n):
        if d:  # the queries of blocks d .. n - 1, carried back to the end of blocks 0 .. n - d - 1
            queries = queries.split([1, queries.size(0) - 1])[1]
            if d > 1:
                queries = _carry(queries, [move[d - 1] for move in moves])
            if space is not None:
                state = _softmax_step_in_place(state, queries, keys[d - 1], c_queries[d - 1], c_keys[d - 1],
                                               pads[d - 1], values[d - 1], space)
            else:
                scores = _masked(_product(queries, keys[d - 1]), c_queries[d - 1], c_keys[d - 1], pads[d - 1])
                state = _softmax_step(state, scores, values[d - 1])
        first, state = zip(*(t.split([1, t.size(0) - 1]) for t in state))
        done.append(first)
        if past is not None:  # query block d carried through block 0 too: to the start of the new tokens
            starts.append(queries[:1] if d == 0 else _carry(queries[:1], [t[:1] for t in through]))
    top, total, acc = (torch.cat(parts, 0) for parts in zip(*done))
    if past is not None:  # the cache's keys
        top, total, acc = _with_past((top, total, acc), torch.cat(starts, 0), c_new, past)
    return acc / torch.where(total > 0, total, 1.0)[..., None]


class _TrainingSweep(torch.autograd.Function):
    """:func:`_sweep` where a gradient is taken and no cache is read, with a
    backward of its own.  The forward keeps each step's carried queries and
    its weights ``exp(s - m)`` (``m`` the row's maximum over every step; ``O(T^2)``, as autograd's record of the
    sweep would, in one tensor per step rather than a dozen) and the rows'
    sums; the backward is the softmax's from those (``dS = P (dP - rowsum(dO
    O))``, ``1 / sum`` folded into ``dO``), the steps in reverse, each query
    block's gradient carried back through the block products its queries went
    through (``q M``: ``dq = g M^T``, ``dM = q^T g``), so that the elementwise
    work of the online softmax is neither recorded nor differentiated."""

    @staticmethod
    def forward(ctx, local, carried, k_end, vb, c_new, key_pad, *through):
        n = local.size(0)
        k_end_t = k_end.transpose(-1, -2).contiguous()
        scores, queries_by_step = [local], [carried]
        top = local.amax(-1)
        queries = carried
        for d in range(1, n):
            queries = queries[1:]
            if d > 1:
                queries = _carry(queries, [t[1:n - d + 1] for t in through])
            queries_by_step.append(queries)
            step = _masked(_product(queries, k_end_t[:n - d]), None if c_new is None else c_new[d:],
                           None if c_new is None else c_new[:n - d], None if key_pad is None else key_pad[:n - d])
            scores.append(step)
            torch.maximum(top[d:], step.amax(-1), out=top[d:])
        top = _finite_max(top)
        total, acc = torch.zeros_like(top), torch.zeros(vb.shape, dtype=vb.dtype, device=vb.device)
        for d, step in enumerate(scores):
            scores[d] = weights = _shifted_exp(step, top[d:])
            total[d:] += weights.sum(-1)
            add_product(acc[d:], weights, vb[:n - d])
        # 1 / the row's sum; 0 for a row with no key (padding), whose output is 0
        inverse = torch.where(total > 0, total, 1.0).reciprocal_().masked_fill_(total == 0, 0.0)[..., None]
        out = acc * inverse
        ctx.save_for_backward(k_end, vb, c_new, out, inverse, *through)
        ctx.weights, ctx.queries = scores, queries_by_step
        return out

    @staticmethod
    def backward(ctx, d_out):
        k_end, vb, c_new, out, inverse, *through = ctx.saved_tensors
        weights, queries_by_step = ctx.weights, ctx.queries
        n = k_end.size(0)
        # dS = W / sum (dO . v - rowsum(dO O)): 1 / sum folded into dO and the row term
        delta = (d_out * out).sum(-1, keepdim=True) * inverse
        d_out = (d_out * inverse).contiguous()
        d_carried, d_k, d_v = (torch.zeros_like(t) for t in (queries_by_step[0], k_end, vb))
        d_c = None if c_new is None else torch.zeros_like(c_new)
        d_through = [torch.zeros_like(t) for t in through]
        from_later = None  # the gradient of step d's queries (blocks 1 ..) from the steps after it
        for d in range(n - 1, -1, -1):
            add_product(d_v[:n - d], weights[d].transpose(-1, -2), d_out[d:])
            d_scores = _product(d_out[d:], vb[:n - d].transpose(-1, -2)).sub_(delta[d:]).mul_(weights[d])
            if d == 0:
                return (d_scores, d_carried, d_k, d_v, d_c, None, *d_through)
            if d_c is not None:
                d_c[d:] += d_scores.sum(-1)
                d_c[:n - d] -= d_scores.sum(-2)
            queries = queries_by_step[d]
            d_queries = _product(d_scores, k_end[:n - d])
            if from_later is not None:
                d_queries[1:] += from_later
            add_product(d_k[:n - d], d_scores.transpose(-1, -2), queries)
            if d == 1:
                d_carried[1:] += d_queries
            else:
                from_later = _carry_backward(queries_by_step[d - 1][1:], d_queries, through, d_through,
                                             slice(1, n - d + 1))


class _FusedSweep(torch.autograd.Function):
    """:class:`_TrainingSweep` as two C++ calls (``native.py``'s ``fa_path_sweep_forward`` and its backward),
    where the fused calls run and the block products are ``D x D`` matrices: the same steps, softmax and
    backward, per head, each step's scores, weights and carried queries written once into the buffers the
    backward reads (the same ``O(T^2)`` as the eager sweep's record), its products by ``sgemm``, without the
    eager sweep's passes over memory for masks, maxima, exponentials and sums."""

    @staticmethod
    def forward(ctx, local, carried, k_end, vb, c_new, key_pad, m):
        n, B, H, C, D = carried.shape
        flat = [t.reshape(n, B * H, *t.shape[3:]).contiguous() for t in (local, carried, k_end, vb, m)]
        gate = None if c_new is None else c_new.reshape(n, B * H, C).contiguous()
        pad = None if key_pad is None else key_pad.reshape(n, B, C).to(torch.uint8).contiguous()
        out, inverse, weights, queries = native_sweep_forward(*flat[:4], gate, pad, flat[4], H)
        ctx.save_for_backward(out, inverse, weights, queries, flat[2], flat[3], flat[4])
        ctx.shapes = (local.shape, carried.shape, vb.shape, None if c_new is None else c_new.shape, m.shape)
        return out.view(vb.shape)

    @staticmethod
    def backward(ctx, d_out):
        out, inverse, weights, queries, k_end, vb, m = ctx.saved_tensors
        local_shape, block_shape, value_shape, gate_shape, m_shape = ctx.shapes
        d_local, d_carried, d_k_end, d_v, d_gate, d_m = native_sweep_backward(
            d_out.reshape(out.shape).contiguous(), out, inverse, weights, queries, k_end, vb, m, gate_shape is not None)
        return (d_local.view(local_shape), d_carried.view(block_shape), d_k_end.view(block_shape),
                d_v.view(value_shape), None if d_gate is None else d_gate.view(gate_shape), None, d_m.view(m_shape))


def _carry_backward(queries: Tensor, grad: Tensor, through, d_through, blocks: slice) -> Tensor:
    """The gradient of the ``queries`` that :func:`_carry` carried through the
    block products ``through[..][blocks]``, given ``grad``, that of the carried
    ones; the products' gradients are added into ``d_through`` (sliced alike)."""
    if len(through) == 1:
        add_product(d_through[0][blocks], queries.transpose(-1, -2), grad)
        return _product(grad, through[0][blocks].transpose(-1, -2))
    left, right = (t[blocks] for t in through)  # y = q - (q left^T) right
    add_product(d_through[1][blocks], _product(queries, left.transpose(-1, -2)).transpose(-1, -2).neg(), grad)
    d_u = _product(grad, right.transpose(-1, -2)).neg_()
    add_product(d_through[0][blocks], d_u.transpose(-1, -2), queries)
    return grad + _product(d_u, left)


def _with_past(state, queries: Tensor, c_query: Optional[Tensor], past):
    """The online softmax's ``state`` of every query block (``queries`` ``[n,
    B, H, c, D]``, carried to the start of the new tokens) with the cache's
    keys added: ``past`` = ``(keys, values, their gates [B, H, 1, S0] or
    None, their padding [B, 1, 1, S0] or None)``.  Without a gradient, on the
    CPU, every query against every cached key is one call of torch's fused
    attention kernel, which also returns each row's log-sum-exp, merged into
    the state; the gate bias ``c_i - c_j`` goes in as ``c_ref - c_j`` (``c_ref``
    the last cached key's, so that the bias is at most 0 and small near the
    chunk), ``c_i - c_ref`` added to the log-sum-exp after."""
    keys, values, c_past, pad = past
    n, B, H, c, D = queries.shape
    flat = queries.movedim(0, 2).reshape(B, H, n * c, D)
    c_flat = None if c_query is None else c_query.movedim(0, 2).reshape(B, H, n * c)
    if _FUSED_WITH_LSE is not None and flat.device.type == "cpu" and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys, values))):
        bias = None
        if c_flat is not None:
            first = _forgotten(state, flat, c_flat, keys, c_past)
            if first == keys.size(2):  # every cached key forgotten: the state as it is
                return state
            keys, values, c_past = keys[:, :, first:], values[:, :, first:], c_past[..., first:]
            pad = None if pad is None else pad[..., first:]
            c_ref = c_past[..., -1:]
            bias = c_ref - c_past
            c_flat = c_flat - c_ref[..., 0]
        if pad is not None:
            bias = (torch.zeros(pad.shape, dtype=flat.dtype, device=flat.device) if bias is None else bias
                    ).masked_fill(pad, float("-inf"))
        out, lse = _FUSED_WITH_LSE(flat, keys, values, 0.0, False, attn_mask=bias, scale=1.0)
        if c_flat is not None:
            lse = lse + c_flat
        if pad is not None:  # a row with no unpadded cached key: the kernel gives 0 there
            lse = lse.masked_fill(pad.all(-1), float("-inf"))
        top_b = _finite_max(lse)
        weight_b = torch.exp(lse - top_b)
        past_state = (top_b, weight_b, out * weight_b[..., None])
    else:  # the scores written out
        scores = flat @ keys.transpose(-1, -2)
        if c_flat is not None:
            scores = scores + c_flat[..., None] - c_past
        if pad is not None:
            scores = scores.masked_fill(pad, float("-inf"))
        top_b = _finite_max(scores.amax(-1))
        weights = _shifted_exp(scores, top_b)
        past_state = (top_b, weights.sum(-1), weights @ values)
    top_b, total_b, acc_b = (t.view(B, H, n, c, *t.shape[3:]).movedim(2, 0) for t in past_state)
    top, total, acc = state
    new = torch.maximum(top, top_b)
    mine, theirs = torch.exp(top - new), torch.exp(top_b - new)
    return new, total * mine + total_b * theirs, acc * mine[..., None] + acc_b * theirs[..., None]


def _forgotten(state, flat: Tensor, c_flat: Tensor, keys: Tensor, c_past: Tensor) -> int:
    """How many of the first cached keys PaTH-FoX's gate has made negligible
    for every query of the call (``flat`` ``[B, H, Q, D]``, their gates'
    running sums ``c_flat`` ``[B, H, Q]``; ``keys`` ``[B, H, S0, D]`` and
    ``c_past`` ``[B, H, 1, S0]``; ``state`` the sweep's online softmax).  PaTH's
    transformations do not lengthen a vector (their eigenvalues are 1 and
    ``1 - beta``, in ``(-1, 1]``), so a carried query and key score at most
    ``|q| K`` (``K`` the longest cached key), and a row's largest weight is
    at least its largest score so far (``state``'s shift): a key whose ``c_i -
    c_j + |q_i| K`` is more than ``causal_blocks.negligible_gap`` below that
    for every row weighs less than ``2^-16`` of a rounding unit, the standard
    of FoX's and ALiBi's key windows.  ``c`` falls along the row, so those
    keys are a prefix."""
    top, total, _ = state
    n, B, H, c = top.shape
    top, total = (t.movedim(0, 2).reshape(B, H, n * c) for t in (top, total))
    reach = keys.norm(dim=-1).amax(-1, keepdim=True)  # [B, H, 1]
    # each row's highest gate-and-score allowance; rows without a key yet (padding) constrain nothing
    allowance = (c_flat + flat.norm(dim=-1) * reach - top).masked_fill(total == 0, float("-inf"))
    gap = negligible_gap(keys.size(2) + flat.size(2), flat.dtype)
    bound = allowance.amax(-1, keepdim=True) + gap  # [B, H, 1]
    return int((c_past[:, :, 0] > bound).sum(-1).min())


#: torch's fused CPU attention that also returns each row's log-sum-exp (a private op of torch 2.x; where it is
#: missing the scores are written out instead).
_FUSED_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _finite_max(top: Tensor) -> Tensor:
    """Row maxima with ``-inf`` (a row with no key yet) as 0, detached: the
    online softmax's shift, which cancels in its value and its gradient."""
    top = top.detach()
    return torch.where(torch.isfinite(top), top, torch.zeros_like(top))


def _shifted_exp(scores: Tensor, shift: Tensor) -> Tensor:
    """``exp(scores - shift)``, a difference below :data:`SUBNORMAL` taken as
    ``-inf`` (in float32: its exponential would be a subnormal number, under
    ``1.2e-38`` of the row's largest weight, and an exponential that lands
    there costs some 30 times a normal one on the CPU; FoX's gate puts a band
    of every row's far keys there)."""
    shifted = scores - shift[..., None]
    if shifted.dtype != torch.float64:
        shifted = F.threshold(shifted, SUBNORMAL, float("-inf"))
    return torch.exp(shifted)


def _softmax_step(state, scores: Tensor, values: Tensor):
    """The online softmax's ``(shift, sum, weighted values)`` with ``scores``
    ``[..., c, keys]`` of their ``values`` ``[..., keys, D]`` added."""
    top, total, acc = state
    new = torch.maximum(top, _finite_max(scores.amax(-1)))
    weights = _shifted_exp(scores, new)
    decay = torch.exp(top - new)
    return new, total * decay + weights.sum(-1), acc * decay[..., None] + _product(weights, values)


def _softmax_step_in_place(state, queries: Tensor, keys_t: Tensor, c_query: Optional[Tensor], c_key: Optional[Tensor],
                           pad: Optional[Tensor], values: Tensor, space: Tensor):
    """:func:`_softmax_step` of the scores ``queries @ keys_t`` (gate and
    padding as :func:`_masked`), where no gradient is taken: the scores
    written into the first elements of ``space``, their weights computed
    there, the state's sums and weighted values (contiguous) updated where they
    lie (a fresh tensor the size of a step's scores is a fresh mapping of
    memory, its pages faulted in one by one)."""
    top, total, acc = state
    shape = queries.shape[:-1] + keys_t.shape[-1:]
    scores = space[:math.prod(shape)].view(shape)
    torch.bmm(queries.flatten(0, 2), keys_t.flatten(0, 2), out=scores.view((-1,) + shape[-2:]))
    if c_query is not None:
        scores.add_(c_query[..., None]).sub_(c_key[..., None, :])
    if pad is not None:
        scores.masked_fill_(pad, float("-inf"))
    new = torch.maximum(top, _finite_max(scores.amax(-1)))
    scores.sub_(new[..., None])
    if scores.dtype != torch.float64:
        F.threshold(scores, SUBNORMAL, float("-inf"), inplace=True)
    scores.exp_()
    decay = torch.exp(top - new)
    total = total.mul_(decay).add_(scores.sum(-1))
    acc = acc.mul_(decay[..., None])
    add_product(acc, scores, values)
    return new, total, acc


def causal_convolution(u: Tensor, weight: Tensor, prefix: Optional[Tensor]) -> Tensor:
    """The depthwise causal convolution of ``u`` ``[B, H, T, D]`` along its tokens: channel ``(h, d)``'s
    ``weight[h D + d, 0, :]`` (``[H D, 1, K]``, ``nn.Conv1d``'s) over that channel's last ``K`` inputs, the
    ``K - 1`` before the first token read from ``prefix`` ``[B, H, K - 1, D]`` (zeros where None):
    ``F.conv1d`` over ``[B, H D, K - 1 + T]``, as ``K`` products of shifted slices, in the layout the attention
    reads: taking ``u`` to ``[B, H D, T]``, padding it in front and back would copy it three times."""
    B, H, T, D = u.shape
    K = weight.size(-1)
    taps = weight.view(H, D, K)
    out = u * taps[:, None, :, K - 1]
    for shift in range(1, K):  # out[t] += weight of u[t - shift] * u[t - shift]
        tap = taps[:, None, :, K - 1 - shift]
        if shift < T:
            out[:, :, shift:].addcmul_(u[:, :, :T - shift], tap)
        if prefix is not None:  # the first tokens' earlier inputs: prefix[K - 1 + t - shift] for t < shift
            n = min(shift, T)
            out[:, :, :n].addcmul_(prefix[:, :, K - 1 - shift:K - 1 - shift + n], tap)
    return out


class PathProjections(nn.Module):
    """One layer's PaTH terms from its input: ``w`` (``w_proj``, a rank-32
    projection, then ``w_conv``, the short causal convolution, where
    ``short_conv``) and ``beta`` (``beta_proj``)."""

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, short_conv: bool = True, rank: int = W_RANK):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.w_proj = nn.Sequential(nn.Linear(embed_dim, rank, bias=False), nn.Linear(rank, width, bias=False))
        self.w_conv = nn.Conv1d(width, width, CONV_WIDTH, groups=width, bias=False) if short_conv else None
        self.beta_proj = nn.Linear(embed_dim, num_heads)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                nn.init.normal_(module.weight, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None, conv_state: Optional[Tensor] = None
                ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(w [B, H, T, D] unit vectors, beta [B, H, T], 0 at
        padding, the convolution's state)`` of ``x`` ``[T, B, C]``;
        ``conv_state`` ``[B, H * D, 2]``: the last two projections before these
        tokens (a KV cache's; zeros at a row's start), None without the
        convolution.  Computed in float32 (float64 for a float64 ``x``);
        without a gradient, where the fused CPU calls run, ``w``'s
        convolution, SiLU and unit length are one C++ pass."""
        T, B, _ = x.shape
        exact = torch.promote_types(x.dtype, torch.float32)
        pad = None if key_padding_mask is None else key_padding_mask.to(torch.bool).T[:, :, None]  # [T, B, 1]
        H, D = self.num_heads, self.head_dim
        K = CONV_WIDTH
        first, second = self.w_proj
        taps = None if self.w_conv is None else self.w_conv.weight.to(exact)
        tracked = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        if taps is not None and not tracked and native_runs(x):
            w, state = self._fused_w(x, pad, conv_state, taps, exact)
            return w, self._beta(x, pad, exact), state
        low = first(x).transpose(0, 1).unsqueeze(1)  # [B, 1, T, rank]
        u = torch.matmul(low, second.weight.view(H, D, -1).transpose(1, 2)).to(exact)  # [B, H, T, D]
        if pad is not None:
            u = u.masked_fill(pad.permute(1, 2, 0)[..., None], 0.0)
        state = None
        if self.w_conv is not None:
            prefix = None if conv_state is None else conv_state.to(exact).view(B, H, D, K - 1).transpose(2, 3)
            tail = u[:, :, max(T - (K - 1), 0):]  # the last K - 1 inputs: the next call's prefix
            if T < K - 1:
                earlier = prefix if prefix is not None else u.new_zeros(B, H, K - 1, D)
                tail = torch.cat([earlier[:, :, T:], tail], dim=2)
            state = tail.transpose(2, 3).reshape(B, H * D, K - 1)
            u = causal_convolution(u, taps, prefix)
            u = F.silu(u, inplace=not u.requires_grad)
        scale = torch.rsqrt(torch.linalg.vector_norm(u, dim=-1, keepdim=True).square() + NORM_EPS)
        w = u * scale if u.requires_grad else u.mul_(scale)  # u is this call's own tensor: scaled in place
        return w, self._beta(x, pad, exact), state

    def _fused_w(self, x: Tensor, pad: Optional[Tensor], conv_state: Optional[Tensor], taps: Tensor,
                 exact: torch.dtype) -> Tuple[Tensor, Tensor]:
        """``(w, the convolution's state)`` without a gradient: the convolution, SiLU and unit length in one C++
        pass (``native.path_w``) over the projections as the linear layer gives them, ``[B, T, H D]``."""
        T, B, _ = x.shape
        H, D, K = self.num_heads, self.head_dim, CONV_WIDTH
        first, second = self.w_proj
        u = second(first(x).transpose(0, 1)).to(exact)  # [B, T, H D]
        if pad is not None:
            u = u.masked_fill(pad.transpose(0, 1), 0.0)
        prefix = None if conv_state is None else conv_state.to(exact).view(B, H, D, K - 1).transpose(2, 3)
        w = native_w(u.contiguous(), taps[:, 0, :].T.contiguous(), H,
                     None if prefix is None else prefix.reshape(B * H, K - 1, D).contiguous(), NORM_EPS)
        tail = u[:, max(T - (K - 1), 0):].transpose(1, 2)  # [B, H D, <= K - 1]: the next call's prefix
        if T < K - 1:
            earlier = conv_state.to(exact) if conv_state is not None else u.new_zeros(B, H * D, K - 1)
            tail = torch.cat([earlier[..., T:], tail], dim=-1)
        return w.view(B, H, T, D), tail.contiguous()

    def _beta(self, x: Tensor, pad: Optional[Tensor], exact: torch.dtype) -> Tensor:
        """``beta`` ``[B, H, T]`` of ``x`` ``[T, B, C]``, 0 at padding (``pad`` ``[T, B, 1]``)."""
        beta = 2 * torch.sigmoid(self.beta_proj(x).to(exact)).permute(1, 2, 0)
        if pad is not None:
            beta = beta.masked_fill(pad.permute(1, 2, 0), 0.0)
        return beta


#: The extension methods that apply: the logit methods (PaTH's is a softmax); it has no slopes or
#: frequencies for the others to scale.
PATH_EXTENSIONS = ("none",) + LOGIT_METHODS


class PathPositions(OwnAttentionStack):
    """The stack's PaTH object: no parameters of its own; each layer gets its
    own projections and, with ``forget_gate`` (1: its bias unscaled, 2:
    divided by ``sqrt(head_dim)``, the authors'), FoX's gate (:meth:`for_layer`).
    ``own_kernel``: a layer calls :meth:`LayerPath.attend` in place of the
    shared kernels (the keys each query sees depend on the query)."""

    own_cache = True  # its cached keys are carried through each new token's H, beside the conv's and gate's state
    method = "path"
    extensions = PATH_EXTENSIONS
    layer_attribute = "path"

    def __init__(self, num_heads: int, head_dim: int, embed_dim: int, short_conv: bool = True,
                 forget_gate: int = 0, scaling: Scaling = NO_SCALING):
        self.head_dim, self.embed_dim = head_dim, embed_dim
        self.short_conv, self.forget_gate = short_conv, forget_gate
        OwnAttentionStack.__init__(self, num_heads, scaling)

    def for_layer(self) -> "LayerPath":
        return LayerPath(self.num_heads, self.head_dim, self.embed_dim, self.short_conv, self.forget_gate,
                         self.scaling)


class LayerPath(nn.Module, PathPositions):
    """One layer's PaTH attention: ``proj`` (``w`` and ``beta``) and, for
    PaTH-FoX, ``gate`` (``fox.LayerForgetGate``, FoX's own code)."""

    def __init__(self, num_heads: int, head_dim: int, embed_dim: int, short_conv: bool = True,
                 forget_gate: int = 0, scaling: Scaling = NO_SCALING):
        nn.Module.__init__(self)
        PathPositions.__init__(self, num_heads, head_dim, embed_dim, short_conv, forget_gate, scaling)
        self.proj = PathProjections(embed_dim, num_heads, head_dim, short_conv)
        self.gate = ForgetGates(num_heads, embed_dim, self.scaling).for_layer() if forget_gate else None

    def for_layer(self) -> "LayerPath":
        return self

    def attend(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, key_padding_mask: Optional[Tensor],
               state: Optional[Dict[str, Tensor]] = None, dropout_p: float = 0.0) -> Tensor:
        """The layer's attention output ``[B, H, T, D]`` (before the output
        projection) of the ``T`` new tokens' ``q`` (already scaled by a logit
        method, if any), ``k``, ``v`` ``[B, H, T, D]`` and their input ``x``
        ``[T, B, C]``.  ``state``: the layer's KV cache as a dict, batch first,
        updated in place, or None: ``prev_key`` (the keys carried through
        every later token's ``H``), ``prev_value``, ``prev_path_conv`` (the
        convolution's last inputs) and, with the gate, ``prev_positions``
        (FoX's cumulative log gates, fairseq's name); ``key_padding_mask``
        ``[B, S0 + T]`` covers the cached keys and the new ones."""
        refuse_dropout("PaTH", dropout_p)
        caching = state is not None  # a full forward without a cache carries no key through the later H
        state = {} if state is None else state
        past_keys, past_values = state.get("prev_key"), state.get("prev_value")
        S0 = 0 if past_keys is None else past_keys.size(2)
        new_pad = None if key_padding_mask is None else key_padding_mask[:, S0:]
        w, beta, conv = self.proj(x, new_pad, state.get("prev_path_conv"))
        gate = None
        if self.gate is not None:
            _, gate = self.gate.bind(x, new_pad, state.get("prev_positions"))
        used = gate if gate is None or self.forget_gate == 1 else gate * self.head_dim ** -0.5
        out, keys = path_attention(q, k, v, w, beta, used, key_padding_mask, past_keys, past_values,
                                   return_keys=caching)
        if not caching:
            return out
        state["prev_key"] = keys.to(k.dtype)
        state["prev_value"] = v if past_values is None else torch.cat([past_values, v], dim=2)
        if conv is not None:
            state["prev_path_conv"] = conv
        if gate is not None:
            state["prev_positions"] = gate
        return out
