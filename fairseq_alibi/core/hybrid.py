"""RoPE/NoPE hybrids: RNoPE-SWA (Yang et al. 2025, "Rope to Nope and Back
Again: A New Hybrid Attention Strategy", arXiv 2501.18795).

Most layers are RoPE layers with a sliding window (each query sees its last
``window`` keys, itself included: local, recency-biased attention); every
``nope_every``-th layer is a NoPE layer with full causal attention (no
position information: retrieval over the whole context).  The stack's object
(:class:`HybridPositions`) gives each layer its own (:meth:`at_layer`): one
:class:`WindowedRotary` shared by the RoPE layers, one ``CausalMask`` shared
by the NoPE layers.

Defaults (``positions.py``): a NoPE layer every 4th layer (three windowed
RoPE layers to one NoPE layer, the paper's interleaving), every 2nd or 3rd in
a stack of 2 or 3 layers (:meth:`HybridPositions.fit_depth`; a stack without
a NoPE layer, or without a RoPE layer, is not the method and is refused by its
registry entry, ``positions._rnope_depth``), and a window of half
the training length (our choice: the paper's window relative to its training
length was not in the material we could read; ``rnope_window`` sets it).
A window narrower than the records of docs/retrieval.md's ``lines`` task
(8 keys for its 9-token records, against the default 64) is what lets the
hybrid learn that task: each record token then sees one key, its own.

The window is a band mask (``-inf`` at ``i - j >= window``); the ``blocked``
and ``chunked`` kernels skip the key blocks left of it
(``kernels.sliding_windows``), exactly: every skipped key is masked.  RoPE's
extension methods apply to the RoPE layers, a logit method (``logn``) to
every layer (``n`` capped by the window: a windowed layer past ``window``
keys sees ``window`` of them).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .alibi import positions
from .bias import CausalMask, StackBias
from .errors import ConfigError
from .rotary import DEFAULT_BASE, ROPE_METHODS, RotaryPositions
from .scaling import LOGIT_METHODS, NO_SCALING, Scaling, check_applies

#: The extension methods of the hybrid: RoPE's (on its RoPE layers) and the logit methods (every layer).
RNOPE_EXTENSIONS = ROPE_METHODS + LOGIT_METHODS
#: The paper's interleaving: a NoPE layer after every three windowed RoPE layers.
DEFAULT_NOPE_EVERY = 4
#: ``rnope_nope_every`` 0: :data:`DEFAULT_NOPE_EVERY`, or the stack's depth where it has fewer layers.
AUTO_NOPE_EVERY = 0


def window_mask(q_start: int, q_len: int, keys: int, window: Optional[int], device) -> Tensor:
    """bool ``[q_len, keys]``: True where query ``q_start + i`` does not see
    key ``j`` (right of it, or ``window`` or more keys back)."""
    query, key = positions(q_len, keys, q_start, device)
    hidden = key > query
    if window is not None:
        hidden = hidden | (query - key >= window)
    return hidden


class WindowedRotary(RotaryPositions):
    """RoPE with a sliding window of ``window`` keys: queries and keys rotated
    as :class:`RotaryPositions`, and a band mask as the bias (``0`` inside the
    window, ``-inf`` outside), Toeplitz."""

    zero = False

    def __init__(self, num_heads: int, head_dim: int, window: int, base: float = DEFAULT_BASE,
                 scaling: Scaling = NO_SCALING):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"rnope_window={window!r} is not valid; it must be a positive number of keys "
                              "(0 in the config: half the training length)")
        self.window = window
        super().__init__(num_heads, head_dim, base, 1.0, scaling)

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        hidden = window_mask(q_start, q_len, keys or k_len, self.window, device).expand(self.num_heads, -1, -1)
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


class HybridPositions(StackBias):
    """RNoPE-SWA's stack: windowed RoPE layers, a full-attention NoPE layer every ``nope_every`` layers."""

    def __init__(self, num_heads: int, head_dim: int, window: int, nope_every: int = AUTO_NOPE_EVERY,
                 base: float = DEFAULT_BASE, scaling: Scaling = NO_SCALING):
        StackBias.__init__(self, num_heads)
        #: As configured, checked by the registry with the stack's depth (0: resolved by :meth:`fit_depth`).
        self.configured_nope_every = nope_every
        self.nope_every = nope_every or DEFAULT_NOPE_EVERY
        self.rope = WindowedRotary(num_heads, head_dim, window, base)
        self.nope = CausalMask(num_heads)
        for layer_kind in (self.rope, self.nope):
            layer_kind.__dict__["owner"] = self  # rescaled through this stack (models.attention.rescale)
        self.rescale(scaling)

    @property
    def window(self) -> int:  # type: ignore[override]
        """The RoPE layers' window (the NoPE layers have none)."""
        return self.rope.window

    def fit_depth(self, layers: int) -> None:
        """Resolve ``nope_every`` 0 for a stack of ``layers`` layers (``positions.build``
        calls it, after the registry checked the depth: ``_rnope_depth``)."""
        if self.configured_nope_every == AUTO_NOPE_EVERY:
            self.nope_every = min(DEFAULT_NOPE_EVERY, layers)

    def is_nope(self, index: int) -> bool:
        """Layer ``index`` (from 0) is a NoPE layer: the last of each group of ``nope_every``."""
        return (index + 1) % self.nope_every == 0

    def at_layer(self, index: int) -> StackBias:
        return self.nope if self.is_nope(index) else self.rope

    def rescale(self, scaling: Scaling) -> None:
        self.scaling = check_applies(scaling, "rnope", RNOPE_EXTENSIONS).complete()
        self.rope.rescale(self.scaling)
        self.nope.rescale(self.scaling if self.scaling.method in LOGIT_METHODS else NO_SCALING)

    def block(self, q_start, q_len, k_len, dtype, device, keys=None) -> Tensor:
        raise ConfigError("the hybrid's layers differ: each layer reads its own object (at_layer)")
