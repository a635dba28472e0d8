"""Logit scalings that depend on how many keys a query sees: log-n scaling
(the ``logn`` extension method, training-free) and scalable softmax (SSMax,
trained, ``ssmax.py``).

Both multiply each query's logits by a factor of ``n``, the number of keys the
query sees: its own position in its row plus one (keys in a KV cache counted,
padding not; capped by a sliding window), in a bidirectional encoder every
real key of its row (of its side, for a head that looks one way).  Both are applied to the query
vector, before any kernel runs: ``(c q) . k = c (q . k)``, so every kernel,
every position method and every cache path scores them the same way, and no
bias is touched.  They scale the content term ``q . k / sqrt(d)``; a position
bias (ALiBi's, FoX's) is added unscaled.  For rotation and ``none`` methods,
which have no bias, that is the whole logit, as in Qwen's logn attention and
in SSMax's paper (Nakanishi 2025), which both scale the query.

* ``logn`` (:func:`logn_factor`): ``max(1, ln n / ln B)``, ``B = F x L``
  (``logn:F``; ``F = 1``: the training length): 1 within ``B`` keys, then
  growing slowly, so attention does not flatten as ``n`` grows past what the
  model was trained on;
* SSMax: ``s_h ln n`` with ``s_h`` learned per head and layer.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .scaling import LOGIT_METHODS, Scaling


def keys_seen(q_len: int, k_len: int, key_padding_mask: Optional[Tensor] = None,
              window: Optional[int] = None, device=None, directions: Optional[Sequence[int]] = None) -> Tensor:
    """float32 ``n`` of each query, the number of keys it sees, shaped to scale
    queries ``[B, H, T, D]``: ``[1, 1, T, 1]`` without padding (queries are the
    last ``q_len`` of ``k_len`` keys), ``[B, 1, T, 1]`` with it (the row's real
    keys up to the query; a padded query counts 1).  ``window``: a sliding
    window of that many keys caps ``n``.  ``directions``: a bidirectional
    stack's heads, one each (negative: looks left, 0: both ways, positive:
    right), ``[B or 1, H, T, 1]``: a head that looks both ways sees every real
    key of its row, one that looks one way those on its side, its own
    included (a causal count gave an encoder's first query 1, its last T)."""
    if directions is not None:
        return _keys_seen_both_ways(q_len, k_len, key_padding_mask, window, device, directions)
    if key_padding_mask is None:
        n = torch.arange(k_len - q_len + 1, k_len + 1, device=device, dtype=torch.float32)[None, None, :, None]
    else:
        real = (~key_padding_mask.to(torch.bool)).to(torch.int32).cumsum(-1)[:, k_len - q_len:]
        n = real.to(torch.float32)[:, None, :, None]
    if window is not None:
        n = n.clamp(max=float(window))
    return n.clamp(min=1.0)


def _keys_seen_both_ways(q_len: int, k_len: int, key_padding_mask: Optional[Tensor], window: Optional[int],
                         device, directions: Sequence[int]) -> Tensor:
    """:func:`keys_seen` of a bidirectional stack (``directions``, one per head)."""
    if key_padding_mask is None:
        real = torch.ones(1, k_len, device=device, dtype=torch.float32)
    else:
        real = (~key_padding_mask.to(torch.bool)).to(torch.float32)
    left = real.cumsum(-1)[:, k_len - q_len:, None]  # [B, T, 1]: real keys up to the query, its own included
    total = real.sum(-1)[:, None, None]
    right = total - left + real[:, k_len - q_len:, None]  # from the query on
    look = torch.tensor(list(directions), device=left.device)
    n = torch.where(look < 0, left, torch.where(look > 0, right, total.expand_as(left)))  # [B, T, H]
    n = n.permute(0, 2, 1)[..., None]
    if window is not None:
        n = n.clamp(max=float(window))
    return n.clamp(min=1.0)


def logn_factor(n: Tensor, base: float) -> Tensor:
    """``max(1, ln n / ln base)``: log-n scaling past ``base`` keys."""
    return (n.log() / math.log(base)).clamp(min=1.0)


def query_factor(scaling: Scaling, ssmax: Optional[Tensor], q_len: int, k_len: int,
                 key_padding_mask: Optional[Tensor] = None, window: Optional[int] = None,
                 device=None, directions: Optional[Sequence[int]] = None) -> Optional[Tensor]:
    """The factor each query is multiplied by (``[B or 1, H or 1, T, 1]``
    float32), or None where nothing scales: ``logn``'s (``scaling``) times
    SSMax's ``s_h ln n`` (``ssmax``: ``[H]`` learned scales, or None);
    ``directions``: a bidirectional stack's (:func:`keys_seen`)."""
    if scaling.method not in LOGIT_METHODS and ssmax is None:
        return None
    n = keys_seen(q_len, k_len, key_padding_mask, window, device, directions)
    factor = None
    if scaling.method in LOGIT_METHODS:
        factor = logn_factor(n, scaling.logit_base)
    if ssmax is not None:
        learned = ssmax.to(torch.float32)[None, :, None, None] * n.log()
        factor = learned if factor is None else factor * learned
    return factor


def scaled_queries(q: Tensor, k_len: int, scaling: Scaling, key_padding_mask: Optional[Tensor] = None,
                   ssmax: Optional[Tensor] = None, window: Optional[int] = None,
                   directions: Optional[Sequence[int]] = None) -> Tensor:
    """``q`` (``[B, H, T, D]``) times :func:`query_factor`, in ``q``'s dtype;
    ``q`` itself where nothing scales."""
    factor = query_factor(scaling, ssmax, q.size(2), k_len, key_padding_mask, window, q.device, directions)
    if factor is None:
        return q
    return (q.to(torch.float32) * factor).to(q.dtype)
