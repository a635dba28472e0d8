"""One layer's wiring to its stack's position object: the one definition
for fairseq's attention layer (``models/attention.py``) and the exported
Hugging Face model (``modeling_alibi.py``).

Pure torch (no fairseq): it travels with exported models.

When a layer is built, :func:`wire` takes the stack's object for the
layer (``StackBias.at_layer``: a hybrid's choice of a windowed RoPE or a
NoPE layer), the layer's own object where it has one (``for_layer``: FoX's
gate, an encoder layer's learned slopes; a submodule of the layer under the
object's ``layer_attribute``, the name checkpoints hold) and resolves the
configured kernel once (``kernels.check_kernel``).  Per call,
:func:`bind_call` rotates the new queries and keys (RoPE) and binds the
object to the layer's input (FoX's gates of this call: ``bind``).  Nothing
is rebuilt per layer or call: the stack's object, and its caches, are
shared by the layers.  (The stack is settled for its depth, a hybrid's
interleaving, where it is built: ``positions.build``.)  Then
:func:`attention` computes the call's attention: the checked kernel
(``kernels.attend``), or the object's own attention where it brings one
(``own_kernel``: stick-breaking, PaTH), with its cache state where it keeps
its own (``own_cache``: the layer then extends only the padding mask).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .bias import StackBias
from .kernels import attend, check_kernel
from .logit_scale import scaled_queries


def wire(layer: torch.nn.Module, stack: StackBias, kernel: str, dropout: float,
         index: Optional[int] = None) -> str:
    """Give the attention ``layer`` its position object, as ``layer.positions``,
    and return its checked ``kernel`` (``kernels.check_kernel`` with the
    layer's attention dropout ``dropout``).  The object is the stack's for
    layer ``index`` (``at_layer``; ``index`` None: ``stack`` is already the
    layer's choice, or the stack has one kind of layer), or the layer's own
    (``for_layer``), which becomes the layer's submodule.  The stack's object
    is only read, not a submodule of the layer (its parameters are saved and
    moved once, with the stack)."""
    chosen = stack if index is None else stack.at_layer(index)
    own = chosen.for_layer()
    if own is not chosen:
        setattr(layer, own.layer_attribute, own)
    layer.__dict__["positions"] = own
    return check_kernel(kernel, own, dropout)


def bind_call(positions: StackBias, q: Tensor, k: Tensor, x: Tensor, past: int,
              new_pad: Optional[Tensor], carried: Optional[Tensor] = None
              ) -> Tuple[Tensor, Tensor, StackBias, Optional[Tensor]]:
    """``(q, k, bias, carry)`` of one call of a layer whose position object is
    ``positions``: the new queries and keys ``[B, H, T, D]`` (at positions
    ``past ..``) as attention sees them (rotated by a rotary method; the
    first pass's padding ``new_pad`` ``[B, T]`` gives per-row dynamic
    factors), and the bias of this call with the state to keep in the KV
    cache (a data-dependent bias binds to the layer's input ``x`` ``[T, B,
    C]``, continuing from ``carried``: FoX's gates; every other object is
    itself and carries nothing)."""
    q, k = positions.rotate(q, k, past, past + q.size(2), new_pad if past == 0 else None)
    bound, carry = positions.bind(x, new_pad, carried)
    return q, k, bound, carry


def attention(positions: StackBias, kernel: str, q: Tensor, k: Tensor, v: Tensor, x: Tensor, past: int,
              key_padding_mask: Optional[Tensor], dropout_p: float, need_weights: bool, ssmax: Optional[Tensor],
              state: Optional[Dict[str, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``(output [B, H, T, D], weights or None)`` of one call of a layer whose
    object (bound: :func:`bind_call`) is ``positions``: ``q`` the ``T`` new
    queries after ``past`` cached tokens, ``key_padding_mask`` ``[B, past +
    T]``, ``x`` the new tokens' input ``[T, B, C]``.  A shared kernel
    (``kernels.attend``, ``k`` and ``v`` every key) for a softmax over biased
    scores; the object's own ``attend`` where it brings one (``own_kernel``),
    its queries first scaled by the logit methods as ``kernels.attend`` scales
    them (the ``logn`` method of its scaling, SSMax's learned ``ssmax``: the
    object refuses them where they do not apply, when it is built), with the
    layer's cache ``state`` (a batch-first dict, fairseq's names) where it
    keeps its own (``own_cache``: ``k``, ``v`` the new tokens', the state
    extended in place), else every key with no state.  An own attention gives
    no weights."""
    if not positions.own_kernel:
        return attend(q, k, v, positions, kernel, key_padding_mask, dropout_p, need_weights, past > 0, ssmax)
    q = scaled_queries(q, past + q.size(2), positions.scaling, key_padding_mask, ssmax, positions.window)
    return positions.attend(q, k, v, x, key_padding_mask, state if positions.own_cache else None, dropout_p), None
