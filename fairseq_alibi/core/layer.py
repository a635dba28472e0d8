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
interleaving, where it is built: ``positions.build``.)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .bias import StackBias
from .kernels import check_kernel


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
