"""FIRE, functional interpolation for relative positions (Li et al. 2023,
"Functional Interpolation for Relative Positions Improves Long Context
Transformers").

The bias of query ``i`` over key ``j <= i`` is a learned function of their
distance normalized by the query's position: ``f(psi(i - j) / psi(max(L, i)))``
with ``psi(x) = log(c x + 1)``, ``f`` a small MLP (one output per head) and
``c``, ``L`` (a threshold) learned.  Dividing by ``psi(i)`` ("progressive
interpolation") keeps the MLP's input in ``[0, 1]`` at every length, so a
longer input asks the MLP for no value outside the range it was trained on:
distances are read relative to how far back the context goes.  The threshold
gives the queries before ``L`` one fixed normalizer, ``psi(L)``, so there the
input is a plain function of the distance.  Not Toeplitz: the bias depends on
``i``, not only on ``i - j``.  The paper reports better length generalization
than ALiBi.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn

from .alibi import learned_slopes as positive, learned_slopes_inverse as positive_inverse
from .kerple import causal_distance

#: The initial values of the reference implementation: ``c`` of psi, the threshold ``L`` (in tokens).
INIT_C = 0.1
INIT_THRESHOLD = 512.0


class Fire(nn.Module):
    """FIRE's bias for a causal LM.  ``f``: ``Linear(1, hidden)``, ReLU,
    ``Linear(hidden, num_heads)`` with PyTorch's default init (the random
    MLP makes the heads differ at step 0).  ``c = softplus(raw_c) + 1e-6``,
    initially 0.1; the threshold is ``init_threshold * (softplus(raw) + 1e-6)``,
    a learned multiple of its initial value (as the reference implementation
    learns it), so that an optimizer step moves it by a fraction of itself
    rather than by a fraction of a token.  ``init_threshold`` defaults to that
    implementation's 512; a
    model trained on ``L_train < 512`` tokens only sees MLP inputs up to
    ``psi(L_train) / psi(512)`` in training, so pass a threshold at most
    ``L_train`` for the interpolation to act within the training length.
    """

    def __init__(self, num_heads: int, hidden: int = 32, init_threshold: float = INIT_THRESHOLD,
                 init_c: float = INIT_C):
        super().__init__()
        self.num_heads, self.init_c = num_heads, float(init_c)
        # The threshold's unit, saved with the weights: a model loaded under another training length
        # (an override of alibi_train_length) keeps the threshold it was trained with.
        self.register_buffer("threshold_unit", torch.tensor(float(init_threshold)))
        self.inner = nn.Linear(1, hidden)
        self.outer = nn.Linear(hidden, num_heads)
        self.raw_c = nn.Parameter(torch.empty(()))
        self.raw_threshold = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inner.reset_parameters()
        self.outer.reset_parameters()
        with torch.no_grad():
            self.raw_c.copy_(positive_inverse(torch.tensor(self.init_c)))
            self.raw_threshold.copy_(positive_inverse(torch.tensor(1.0)))

    @property
    def c(self) -> Tensor:
        """float32 scalar > 0: psi's scale."""
        return positive(self.raw_c)

    @property
    def threshold(self) -> Tensor:
        """float32 scalar > 0: queries before it share the normalizer ``psi(threshold)``."""
        return self.threshold_unit * positive(self.raw_threshold)

    def distance_only(self, k_len: int) -> bool:
        """Whether the bias of a pass over ``k_len`` keys is a function of the
        distance alone: every query (positions below ``k_len``) is at most
        the threshold, so every normalizer is ``psi(threshold)``.  In training
        at L with the initial threshold L that holds, and the blocked kernel
        then builds the bias from one value per distance (``ModuleBias.
        per_distance``): ``values(d, 0)`` is the value of every pair at
        distance ``d``, bit for bit."""
        return float(self.threshold.detach()) >= k_len - 1

    def mlp_input(self, query: Tensor, key: Tensor) -> Tensor:
        """float32 ``[q, k]``: ``psi(i - j) / psi(max(threshold, i))``, in ``[0, 1]``
        for every key ``j <= i`` (keys after the query, which the causal mask
        hides, get 0), at any length."""
        c = self.c
        distance = torch.log1p(c * causal_distance(query, key))
        normalizer = torch.log1p(c * torch.maximum(query.to(torch.float32), self.threshold))
        return distance / normalizer

    def pieces(self) -> Tuple[Tensor, Tensor, Tensor]:
        """The MLP as the piecewise-linear function it is (one input, ReLU):
        ``(knots [n], slopes [n + 1, H], intercepts [n + 1, H])``, float32,
        ``f(x) = slopes[s] x + intercepts[s]`` on piece ``s`` (``knots``
        sorted, piece ``s`` between knots ``s - 1`` and ``s``).  Unit ``u``
        turns on at ``-b_u / w_u``; it is on in the pieces right of its knot
        when ``w_u > 0``, left of it when ``w_u < 0``, everywhere or nowhere by
        the sign of ``b_u`` when ``w_u = 0`` (its knot a placeholder at 0)."""
        w, b = self.inner.weight.to(torch.float32)[:, 0], self.inner.bias.to(torch.float32)
        out_w, out_b = self.outer.weight.to(torch.float32), self.outer.bias.to(torch.float32)
        flat = w == 0
        knots, order = torch.where(flat, 0.0, -b / torch.where(flat, 1.0, w)).detach().sort()
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        piece = torch.arange(order.numel() + 1, device=order.device)[:, None]
        on = torch.where(w > 0, piece > rank, torch.where(w < 0, piece <= rank, b > 0)).to(torch.float32)
        return knots, on @ (w[:, None] * out_w.t()), on @ (b[:, None] * out_w.t()) + out_b

    def values(self, query: Tensor, key: Tensor) -> Tensor:
        """The float32 bias ``[H, q, k]`` of queries ``query [q, 1]`` over keys
        ``key [1, k]`` (integer positions; a KV cache's queries start after 0).

        The MLP runs as its pieces (:meth:`pieces`): each ``(i, j)`` looks up
        its piece and takes one product and one sum, so it gets the same
        float32 value whatever the shape of the call (a matrix product's
        blocking depends on the shape: a KV cache's rows would differ from the
        full forward in the last bit), and no ``[q, k, hidden]`` tensor is
        formed.  Gradients are the MLP's (zero-measure knots aside).  Each
        head's coefficients are gathered straight into ``[H, q, k]`` order, so
        the bias is contiguous as the kernels read it (a ``[q, k, H]`` gather,
        permuted, left a strided bias that every attention call copied)."""
        x = self.mlp_input(query, key)
        knots, slopes, intercepts = self.pieces()
        piece = torch.bucketize(x.detach(), knots).view(1, -1).expand(self.num_heads, -1)

        def per_head(table: Tensor) -> Tensor:
            """``table [n + 1, H]``'s entry of each ``(i, j)``'s piece, ``[H, q, k]``."""
            return table.t().gather(1, piece).view(self.num_heads, *x.shape)

        return per_head(slopes) * x + per_head(intercepts)
