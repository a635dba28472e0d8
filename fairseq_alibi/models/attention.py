"""Self-attention with a position method for fairseq: the layer, and rescaling a built model.

``PositionMultiheadAttention`` subclasses fairseq's ``MultiheadAttention`` and
keeps its parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) and
its KV-cache layout, so checkpoints and beam-search reordering work unchanged.
Only ``forward`` is replaced: the stack's shared position object
(``positions``, a ``core.bias.StackBias``: ALiBi, a learned bias, or the causal
mask with rotated queries and keys) gives the bias and the rotation, and the
kernel comes from ``core/kernels.py``, resolved once when the layer is built.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from ..core import layer
from ..core.bias import StackBias
from ..core.scaling import Scaling
from ..core.ssmax import ScalableSoftmax


def attach_shared(module: torch.nn.Module, name: str, shared) -> None:
    """``module.<name> = shared`` without making it ``module``'s submodule: a
    stack's position object belongs to the stack (its parameters are saved and
    moved once), its layers only read it (also before ``Module.__init__``)."""
    module.__dict__[name] = shared


class PositionMultiheadAttention(MultiheadAttention):
    """Self-attention with a position method; a drop-in for fairseq's ``MultiheadAttention``."""

    def __init__(self, embed_dim: int, num_heads: int, positions: StackBias, kernel: str = "auto",
                 ssmax_length: Optional[int] = None, layer_index: Optional[int] = None, **kwargs):
        """``positions``: the stack's object, and ``layer_index`` this layer's
        place in the stack (a hybrid chooses by it), or None where
        ``positions`` is already this layer's choice (``core.layer.wire``)."""
        super().__init__(embed_dim, num_heads, self_attention=True, **kwargs)
        if positions.num_heads != num_heads:
            raise ValueError(f"the position bias has {positions.num_heads} heads, attention has {num_heads}")
        self.kernel = layer.wire(self, positions, kernel, self.dropout_module.p, index=layer_index)
        if ssmax_length is not None:  # scalable softmax: a learned s per head (core/ssmax.py); absent otherwise
            self.ssmax = ScalableSoftmax(num_heads, ssmax_length)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Same contract as fairseq's; ``attn_mask`` (fairseq's future mask) is
        not used: the causal structure comes from the ALiBi bias itself."""
        if before_softmax or static_kv:
            raise NotImplementedError("ALiBi self-attention supports neither before_softmax nor static_kv")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.size()
        heads, head_dim = self.num_heads, self.head_dim

        def split_heads(x: Tensor) -> Tensor:  # [T, B, C] -> [B, H, T, D]
            return x.view(x.size(0), bsz, heads, head_dim).permute(1, 2, 0, 3)

        q = split_heads(self.q_proj(query))
        k = split_heads(self.k_proj(query))
        v = split_heads(self.v_proj(query))
        past = self._cached_length(incremental_state)
        carried = self._get_input_buffer(incremental_state).get("prev_positions") if past else None
        q, k, positions, carry = layer.bind_call(self.positions, q, k, query, past, key_padding_mask, carried)
        saved = None
        if incremental_state is not None:
            k, v, key_padding_mask, saved = self._extend_cache(incremental_state, k, v, key_padding_mask, bsz, carry,
                                                               positions.own_cache)

        dropout_p = self.dropout_module.p if self.training else 0.0
        ssmax = self.ssmax.scale if "ssmax" in self._modules else None
        out, weights = layer.attention(positions, self.kernel, q, k, v, query, past, key_padding_mask, dropout_p,
                                       need_weights, ssmax, saved)
        if saved is not None and positions.own_cache:  # the object extended its own state: keep it
            self._set_input_buffer(incremental_state, saved)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim))
        if not need_weights or weights is None:
            return out, None  # the reference kernel computes weights either way: not asked, not returned
        weights = weights.transpose(0, 1)  # [H, B, T, S], fairseq's layout
        return out, weights if need_head_weights else weights.mean(dim=0)

    def _cached_length(self, incremental_state) -> int:
        """Keys already in the KV cache (the new tokens' first position)."""
        if incremental_state is None:
            return 0
        saved = self._get_input_buffer(incremental_state)
        return saved["prev_key"].size(2) if "prev_key" in saved else 0

    def _extend_cache(self, incremental_state, k: Tensor, v: Tensor, key_padding_mask, bsz: int,
                      carry: Optional[Tensor] = None, own_cache: bool = False):
        """``(keys, values, padding mask, the cache dict)``: the keys and values
        with the cached ones prepended and the cache updated (with the position
        object's ``carry``: FoX's cumulative log-gates of every cached key,
        ``[B, H, S]``); where the object keeps its own state (``own_cache``:
        PaTH's transformed keys, its convolution's and gate's state) the new
        keys and values as they are and the padding mask alone extended, the
        object's ``attend`` extending the dict.  fairseq's
        ``reorder_incremental_state`` reorders every tensor of the dict on its
        first (batch) dimension, the object's state too (beam search)."""
        saved = self._get_input_buffer(incremental_state)
        cached = saved["prev_key"].size(2) if "prev_key" in saved else 0
        if not own_cache and cached:
            k = torch.cat([saved["prev_key"], k], dim=2)
            v = torch.cat([saved["prev_value"], v], dim=2)
        key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
            key_padding_mask=key_padding_mask,
            prev_key_padding_mask=saved.get("prev_key_padding_mask"),
            batch_size=bsz,
            src_len=cached + k.size(2) if own_cache else k.size(2),
            static_kv=False,
        )
        if not own_cache:
            saved["prev_key"], saved["prev_value"] = k, v
        saved["prev_key_padding_mask"] = key_padding_mask
        if carry is not None:
            saved["prev_positions"] = carry
        self._set_input_buffer(incremental_state, saved)
        return k, v, key_padding_mask, saved


def biases(model: torch.nn.Module):
    """Every distinct position object of a model (one per stack; one per layer when learned)."""
    seen = {}
    for module in model.modules():
        if isinstance(module, PositionMultiheadAttention):
            owner = module.positions.stack  # a hybrid's layer: its stack rescales every kind of layer
            seen.setdefault(id(owner), owner)
    return list(seen.values())


def rescale(model: torch.nn.Module, scaling: Scaling) -> None:
    """Evaluate a built model under ``scaling`` from its next forward on: the
    same numbers as rebuilding it with the method's ``--model-overrides``
    (``ScalingError`` for a method that does not apply to its position method)."""
    found = biases(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no position attention to rescale")
    for bias in found:
        bias.rescale(scaling)
