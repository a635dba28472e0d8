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

from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .alibi import learned_slopes as positive, learned_slopes_inverse as positive_inverse
from .bias import distance_ramp, reversed_rows
from .kerple import causal_distance
from .kernels import chunked_kernel
from .native import fire_forward, runs_for as native_runs, scaled

#: Rows per group of :meth:`Fire.reversed_block`: a group pays up to ``ROW_GROUP ** 2`` pairwise values per
#: knot its rows straddle, and a few small operations per group.
ROW_GROUP = 64
#: The initial values of the reference implementation: ``c`` of psi, the threshold ``L`` (in tokens).
INIT_C = 0.1
INIT_THRESHOLD = 512.0
#: Queries and keys per block of the fused C++ evaluation (``native.py``), stick-breaking's fused sizes.
FUSED_BLOCK = 64
FUSED_KEY_BLOCK = 128


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

    def logged_scalars(self) -> Dict[str, Tensor]:
        """The threshold (tokens) and psi's ``c``, for the training log: a
        training run's words/s come from the per-distance path while the
        threshold is at least ``L - 1`` (:meth:`distance_only`), and from the
        blocks past it."""
        return {"fire_threshold": self.threshold.detach(), "fire_c": self.c.detach()}

    def distance_only(self, k_len: int) -> bool:
        """Whether the bias of a pass over ``k_len`` keys is a function of the
        distance alone: every query (positions below ``k_len``) is at most
        the threshold, so every normalizer is ``psi(threshold)``.  In training
        at L with the initial threshold L that holds, and the blocked kernel
        then builds the bias from one value per distance (``ModuleBias.
        per_distance``): ``values(d, 0)`` is the value of every pair at
        distance ``d``, bit for bit.  The threshold is learned: once it is
        below ``L - 1`` (a few dozen updates at a learning rate of 1e-4 in
        ``benchmarks/train_throughput.py``'s setting), a training pass
        builds its bias with :meth:`reversed_block` instead: block by block
        for the blocked kernel (``ModuleBias.training_blocks``), whole for
        the others (``ModuleBias.block``)."""
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

    def fused_tables(self, q_start: int, q_len: int, k_len: int, device) -> Tuple[Tensor, ...]:
        """What the fused evaluation (``native.fire_forward``) reads, float32, no gradient: ``psi`` of every
        distance ``0 .. k_len - 1``, the normalizer ``psi(max(threshold, i))`` of every query ``q_start ..
        q_start + q_len - 1``, and the MLP as its pieces (:meth:`pieces`: knots, slopes and intercepts, these
        two one row per head), each computed as :meth:`values` computes it (the loop then divides and takes
        the product and the sum apart, as torch does there, not fused)."""
        with torch.no_grad():
            c = self.c
            psi = torch.log1p(c * torch.arange(k_len, device=device, dtype=torch.float32))
            query = torch.arange(q_start, q_start + q_len, device=device, dtype=torch.float32)
            normalizer = torch.log1p(c * torch.maximum(query, self.threshold))
            knots, slopes, intercepts = self.pieces()
            return (psi.contiguous(), normalizer.contiguous(), knots.contiguous(), slopes.t().contiguous(),
                    intercepts.t().contiguous())

    @property
    def own_kernels(self) -> Dict[str, object]:
        """The kernels this bias brings (``StackBias.own_kernels``, through ``ModuleBias``): its fused long
        evaluation in place of the shared ``chunked`` kernel."""
        return OWN_KERNELS

    def value_span(self) -> Tensor:
        """The largest over heads of the range of the bias (no gradient): the
        MLP's input lies in ``[0, 1]`` (:meth:`mlp_input`) and the MLP is
        linear between its knots, so each head's extremes are among its
        values at 0, 1 and the knots between."""
        with torch.no_grad():
            knots, slopes, intercepts = self.pieces()
            x = torch.cat([knots.new_tensor([0.0, 1.0]), knots.clamp(0.0, 1.0)])
            piece = torch.bucketize(x, knots)
            f = slopes[piece] * x[:, None] + intercepts[piece]  # [points, H]
            return (f.amax(0) - f.amin(0)).max()

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

    def reversed_block(self, q_start: int, q_len: int, keys: int, device) -> Tensor:
        """The float32 causal bias ``[H, q_len, keys]`` of queries ``q_start +
        q_len - 1`` down to ``q_start`` (last query first, as
        ``bias.reversed_rows``) over keys ``0 .. keys - 1``, ``-inf`` right of
        each query: :meth:`values` of the same pairs, bit for bit, without a
        transcendental or a lookup per pair.

        Row ``i`` reads distance ``d`` at ``x = psi(d) / n_i``.  Over a group
        of rows ``x`` of one distance lies between ``psi(d) / n_last`` and
        ``psi(d) / n_first`` (``n`` grows with ``i``; division and
        ``bucketize`` are monotone), so where those two fall in one piece
        every row of the group does, and the pair's value is that piece's
        ``slope * x + intercept``: the piece's coefficients are one vector per
        distance, laid out as a Toeplitz view (``bias.distance_ramp``), and
        ``x`` a ``[g, k]`` view of ``psi`` divided by each row's ``n``, shared
        by the heads.  The distances whose rows straddle a knot (near each
        knot, at most about ``g`` of them; none below the threshold, where
        ``n`` is one value) are written pair by pair, up to ``g x g`` pairs per
        knot: hence groups of :data:`ROW_GROUP` rows, not the caller's block."""
        knots, slopes, intercepts = self.pieces()
        groups = self._row_groups(q_start, q_len, device)
        return torch.cat([self._group_bias(self._group_inputs(span, keys, psi, knots, slopes, intercepts))
                          for span, psi in groups], dim=1)

    def reversed_head_blocks(self, q_start: int, q_len: int, keys: int, device,
                             storage: Tensor, group: int = 1) -> Iterator[Tuple[slice, Tensor]]:
        """:meth:`reversed_block` ``group`` heads at a time, without
        gradients: ``(heads, their [h, q_len, keys] bias)`` in turn (the
        last group may have fewer), each in the same ``storage`` (use one
        before asking for the next).  What the heads share (each pair's
        ``x``, the piece of each distance, the straddling pairs) is computed
        once for the block, so the bias costs the work of
        :meth:`reversed_block`'s in ``(1 + group) x q_len x keys`` floats of
        ``storage`` where the whole block takes ``H x``: one head at a time at
        4 heads and 8K keys, 16 MiB instead of 32 MiB per block of 256
        queries."""
        x_rows = storage[: q_len * keys].view(q_len, keys)
        planes = storage[q_len * keys: (1 + group) * q_len * keys].view(group, q_len, keys)
        knots, slopes, intercepts = self.pieces()
        groups = []
        for (first, rows), psi in self._row_groups(q_start, q_len, device):
            row = q_start + q_len - first - rows  # the group's first row in the block (last query first)
            groups.append((row, self._group_inputs((first, rows), keys, psi, knots, slopes, intercepts,
                                                   x_rows[None, row: row + rows])))
        for head in range(0, self.num_heads, group):
            heads = slice(head, min(head + group, self.num_heads))
            n = heads.stop - heads.start
            for row, g in groups:
                self._group_bias(g, heads, planes[:n, row: row + g.rows])
            yield heads, planes[:n]

    def _row_groups(self, q_start: int, q_len: int, device) -> List[Tuple[Tuple[int, int], Tensor]]:
        """The block's groups of at most :data:`ROW_GROUP` rows, last queries
        first: ``((first query, rows), psi at the group's distances far .. 0)``."""
        psi = torch.log1p(self.c * torch.arange(q_start + q_len - 1, -1, -1, device=device, dtype=torch.float32))
        starts = [(max(q_start, stop - ROW_GROUP), stop) for stop in range(q_start + q_len, q_start, -ROW_GROUP)]
        return [((a, b - a), psi[-b:]) for a, b in starts]

    def _group_inputs(self, span: Tuple[int, int], keys: int, psi: Tensor, knots: Tensor, slopes: Tensor,
                      intercepts: Tensor, x_out: Optional[Tensor] = None) -> "_Group":
        """What the heads of the group of rows ``span`` (first query, rows)
        read: ``x [1, rows, keys]`` (into ``x_out`` where given, shared by
        the heads), each head's coefficients per distance where the whole
        group shares a piece (as ramps: one gather for all heads, not one per
        head), and the pairs that straddle a knot with every head's value."""
        q_start, q_len = span
        far = q_start + q_len - 1  # the group's largest distance
        extra = q_len + max(0, keys - far - 1)  # entries right of every query's own key
        query = torch.arange(far, q_start - 1, -1, device=psi.device, dtype=torch.float32)  # the rows, last first
        normalizer = torch.log1p(self.c * torch.maximum(query, self.threshold))
        # distances in one piece for every row: the last query has the largest normalizer (smallest x)
        low, high = (torch.bucketize((psi / n).detach(), knots) for n in (normalizer[:1], normalizer[-1:]))
        # Right of each query: x 0.  The ramp's view steps by one entry along rows and columns alike, and an
        # operation whose first operand is such a view lays a fresh output out column by column (strided writes):
        # into the caller's row-major x_out (no gradients) it is divided as it is, else made row-major first.
        ramp = reversed_rows(distance_ramp(psi[None], extra, 0.0), q_start, q_len, keys, far + 1)
        if x_out is None:
            x = ramp.contiguous() / normalizer[:, None]
        else:
            x = torch.div(ramp, normalizer[:, None], out=x_out)
        pairs = None
        straddling = (low != high).nonzero()[:, 0]  # entries of psi (distance far - e)
        if straddling.numel():
            distance = far - straddling  # [S]
            row = far - query.long()  # the rows' own index in the group, last query first: 0 ..
            key = query.long()[:, None] - distance[None, :]  # [q, S]
            x_pair = psi[straddling][None, :] / normalizer[:, None]  # [q, S]
            piece = torch.bucketize(x_pair.detach(), knots)
            # the pairs the per-distance tables got wrong: another piece than `low`, a key the row sees
            wrong = (piece != low[straddling][None, :]) & (key >= 0) & (key < keys)
            piece = piece[wrong]
            values = slopes.t()[:, piece] * x_pair[wrong] + intercepts.t()[:, piece]  # [H, pairs]
            pairs = (row[:, None].expand_as(key)[wrong], key[wrong], values)
        # Right of each query: intercept -inf, slope 0 (the causal mask, and no inf * 0)
        return _Group(q_start, q_len, keys, far, x, distance_ramp(slopes[low].t(), extra, 0.0),
                      distance_ramp(intercepts[low].t(), extra, float("-inf")), pairs)

    @staticmethod
    def _group_bias(group: "_Group", heads: slice = slice(None), out: Optional[Tensor] = None) -> Tensor:
        """The group's bias ``[h, rows, keys]`` for ``heads``, into ``out`` where given."""

        def view(ramp: Tensor) -> Tensor:
            """``[h, q, k]`` view of the heads' ramp (distances far .. 0, then right of each query)."""
            return reversed_rows(ramp[heads], group.first, group.rows, group.keys, group.far + 1)

        out = torch.mul(group.x, view(group.slopes), **({} if out is None else {"out": out}))
        out += view(group.intercepts)  # not addcmul: its fused rounding is not values()'s
        if group.pairs is not None:
            rows, cols, values = group.pairs
            _put_pairs(out, rows, cols, values[heads])
        return out


class _Group(NamedTuple):
    """One group of rows of a block: :meth:`Fire._group_inputs`."""

    first: int  # its first query
    rows: int
    keys: int
    far: int  # its largest distance
    x: Tensor  # [1, rows, keys]
    slopes: Tensor  # [H, far + 1 + extra]: each head's slope per distance (far .. 0), then 0 right of each query
    intercepts: Tensor  # the same for the intercepts, -inf right of each query
    pairs: Optional[Tuple[Tensor, Tensor, Tensor]]  # rows, keys and every head's value [H, n] of the straddling pairs


def _put_pairs(out: Tensor, rows: Tensor, cols: Tensor, values: Tensor) -> None:
    """Write ``values [H, n]`` into ``out [H, q, k]`` at the pairs ``(rows[n], cols[n])`` of every head."""
    heads = torch.arange(out.size(0), device=out.device)[:, None].expand_as(values)
    out.index_put_((heads, rows[None].expand_as(values), cols[None].expand_as(values)), values)


def fused_chunked_kernel(q: Tensor, k: Tensor, v: Tensor, bias, key_padding_mask: Optional[Tensor], dropout_p: float,
                         chunk_size: Optional[int] = None):
    """FIRE's ``chunked`` kernel: without a gradient, in float32 (or bfloat16 and float16, computed in float32)
    on a CPU where ``native.py``'s fused forward runs, the whole attention in one C++ call: per head and block
    of :data:`FUSED_BLOCK` queries, the scores of :data:`FUSED_KEY_BLOCK` keys at a time by torch's sgemm,
    FIRE's bias added from one value per distance (per pair where a block's rows straddle a knot), an online
    softmax, the output by sgemm; nothing ``[H, rows, keys]`` is built or read back as a mask, which is most of
    the shared kernel's time.  Elsewhere, the shared ``chunked`` kernel (``kernels.chunked_kernel``)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if grad or dropout_p > 0 or not native_runs(q):
        return chunked_kernel(q, k, v, bias, key_padding_mask, dropout_p, chunk_size)
    B, H, T, D = q.shape
    S = k.size(2)
    qs = scaled(q, D ** -0.5).flatten(0, 1)  # in a kept buffer (native.SCRATCH)
    kf, vf = (t.to(torch.float32).flatten(0, 1).contiguous() for t in (k, v))
    pad = None
    if key_padding_mask is not None and bool(key_padding_mask.any()):
        pad = key_padding_mask.to(torch.bool)[:, None].expand(B, H, S).flatten(0, 1).to(torch.uint8).contiguous()
    tables = bias.cached("fused_tables", (S - T, T, S, str(q.device)),  # once per pass, shared by the layers
                         lambda: bias.method.fused_tables(S - T, T, S, q.device))
    out = fire_forward(qs, kf, vf, pad, *tables, FUSED_BLOCK, FUSED_KEY_BLOCK)
    return out.view(B, H, T, -1).to(q.dtype), None


#: :attr:`Fire.own_kernels`.
OWN_KERNELS = {"chunked": fused_chunked_kernel}
