"""Kerple's logarithmic bias (Chi et al. 2022, "KERPLE: Kernelized Relative
Positional Embedding for Length Extrapolation").

Kerple derives relative biases from conditionally positive definite kernels;
its log variant adds ``-r1 * log(1 + r2 * (i - j))`` to the score of query
``i`` over key ``j <= i``, with ``r1, r2 > 0`` learned per head.  Near the
query it is ALiBi-like (``-r1 r2 (i - j)`` for ``i - j << 1 / r2``), far
away it decays only logarithmically, so distant keys are penalized less than
by ALiBi's line; it is Toeplitz (a function of ``i - j`` alone) and defined
at any distance, so it extrapolates as it is.  The paper reports longer
extrapolation than ALiBi on OpenWebText2, GitHub and ArXiv.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .alibi import get_slopes, learned_slopes as positive, learned_slopes_inverse as positive_inverse


def causal_distance(query: Tensor, key: Tensor) -> Tensor:
    """float32 ``max(i - j, 0)`` of positions ``query [q, 1]`` and ``key [1, k]``
    (integers, cast once; exact below 2**24): keys after the query, which the
    causal mask hides, count as distance 0."""
    return (query.to(torch.float32) - key.to(torch.float32)).clamp(min=0)


class KerpleLog(nn.Module):
    """Kerple's log bias, ``r1 = softplus(raw_r1) + 1e-6`` and likewise ``r2``
    (``alibi.learned_slopes``): softplus is linear for large values (no
    overflow, unlike ``exp``) and relative (``exp``-like) near 0, where an
    optimizer step then moves a small ``r2`` by a fraction of itself; the
    floor keeps both strictly positive where softplus underflows.

    Init: ``r1 = 1`` and ``r2`` = ALiBi's slopes for ``num_heads`` heads, so at
    step 0 head ``h`` is ALiBi's head ``h`` up to distance ``~1 / m_h`` and bends
    logarithmically past it: the heads differ (knees from ~1 to 256 tokens)
    and the model starts from a recency bias known to train, without a seed.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.raw_r1 = nn.Parameter(torch.empty(num_heads))
        self.raw_r2 = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.raw_r1.copy_(positive_inverse(torch.ones(self.num_heads)))
            self.raw_r2.copy_(positive_inverse(get_slopes(self.num_heads)))

    @property
    def r1(self) -> Tensor:
        """float32 ``[H]``, > 0: the bias's scale per head."""
        return positive(self.raw_r1)

    @property
    def r2(self) -> Tensor:
        """float32 ``[H]``, > 0: the distance's scale per head (the knee at ``~1 / r2``)."""
        return positive(self.raw_r2)

    def values(self, query: Tensor, key: Tensor) -> Tensor:
        """The float32 bias ``[H, q, k]`` of queries ``query [q, 1]`` over keys
        ``key [1, k]`` (integer positions; a KV cache's queries start after 0)."""
        d = causal_distance(query, key)
        return -self.r1[:, None, None] * torch.log1p(self.r2[:, None, None] * d)
