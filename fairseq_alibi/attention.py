"""ALiBi self-attention for fairseq, with several interchangeable kernels.

``AlibiBias`` is created once per layer stack and shared by all its layers: it
turns the stack's configuration into (scaled) slopes for the current length and
owns the one cached dense bias, so the bias is built once per forward, not per
layer and never per batch row.

``AlibiMultiheadAttention`` subclasses fairseq's ``MultiheadAttention`` and
keeps its parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) and
its KV-cache layout, so checkpoints and beam-search reordering work unchanged.
Only ``forward`` is replaced.

Attention paths (``alibi_attention``):

* ``reference``: explicit scores + bias + softmax; the ground truth, and the only
  path that can return attention weights;
* ``sdpa``: ``F.scaled_dot_product_attention`` with one ``[1, H, T, S]`` bias
  broadcast over the batch (fused kernels on CUDA; the training path on CPU);
* ``chunked``: queries in blocks, the bias of each block built on the fly, so
  memory grows linearly with the length (long-context evaluation);
* ``auto``: ``reference`` when weights are requested, ``sdpa`` while training
  or for short inputs, ``chunked`` for long inference.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor

from . import alibi

ATTENTION_PATHS = ("auto", "reference", "sdpa", "chunked")
BIAS_KINDS = ("causal", "symmetric")

# Above this many query x key pairs, inference switches to the chunked path.
CHUNK_THRESHOLD = 1024 * 1024
# Queries per block on the chunked path: B x H x CHUNK x S scores live at once.
CHUNK_SIZE = 256


class AlibiBias:
    """Slopes and bias of one layer stack, shared by all its attention layers.

    A plain object rather than an ``nn.Module``: it has no parameters, nothing
    of it belongs in the state dict, and its caches are keyed by device and
    dtype, so it needs no ``.to()``.
    """

    def __init__(
        self,
        num_heads: int,
        interpolation: str = "none",
        scale_factor: float = 0.0,
        train_length: Optional[int] = None,
        kind: str = "causal",
        attention_path: str = "auto",
    ):
        validate_options(interpolation, scale_factor, train_length, attention_path)
        if kind not in BIAS_KINDS:
            raise ValueError(f"unknown ALiBi bias kind {kind!r}; allowed: {', '.join(BIAS_KINDS)}")
        self.num_heads = num_heads
        self.base_slopes = alibi.get_slopes(num_heads)
        self.interpolation = interpolation
        self.scale_factor = float(scale_factor)
        self.train_length = train_length
        self.kind = kind
        self.attention_path = attention_path
        self._slopes_cache: Dict[tuple, Tensor] = {}
        self._dense_key: Optional[tuple] = None
        self._dense: Optional[Tensor] = None

    def slopes(self, seq_len: int, device=None) -> Tensor:
        """float32 ``[H]`` slopes for a sequence of ``seq_len`` keys."""
        factor = alibi.resolve_scale_factor(
            self.interpolation, self.scale_factor, self.train_length, seq_len
        )
        key = (factor, str(device))
        if key not in self._slopes_cache:
            if len(self._slopes_cache) > 64:
                self._slopes_cache.clear()
            scaled = alibi.scale_slopes(self.base_slopes, self.interpolation, factor)
            self._slopes_cache[key] = scaled.to(device)
        return self._slopes_cache[key]

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        """``[H, q_len, k_len]`` bias for queries ``q_start ..`` over ``k_len`` keys."""
        slopes = self.slopes(k_len, device)
        if self.kind == "causal":
            return alibi.causal_bias(slopes, q_len, k_len, dtype, device, q_start)
        return alibi.symmetric_bias(slopes, q_len, k_len, dtype, device, q_start)

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """The whole ``[H, q_len, k_len]`` bias, cached for the most recent shape.

        The first layer of a forward pass builds it, the others reuse it, and so
        do later batches of the same length.
        """
        key = (q_len, k_len, dtype, str(device), self.interpolation, self.scale_factor)
        if self._dense_key != key:
            q_start = k_len - q_len if self.kind == "causal" else 0
            self._dense = self.block(q_start, q_len, k_len, dtype, device)
            self._dense_key = key
        return self._dense


def validate_options(interpolation, scale_factor, train_length, attention_path) -> None:
    """Raise ``ValueError`` naming the config field for any invalid ALiBi option."""
    if interpolation not in alibi.INTERPOLATION_METHODS:
        raise ValueError(
            f"alibi_interpolation={interpolation!r} is not valid; "
            f"allowed values: {', '.join(alibi.INTERPOLATION_METHODS)}"
        )
    try:
        factor = float(scale_factor)
    except (TypeError, ValueError):
        factor = float("nan")
    if not (factor == 0.0 or factor >= 1.0) or factor == float("inf"):
        raise ValueError(
            f"alibi_scale_factor={scale_factor!r} is not valid; use 0 for dynamic "
            "scaling (max(1, length / alibi_train_length)) or a static factor >= 1"
        )
    if train_length is not None and (not isinstance(train_length, int) or train_length < 1):
        raise ValueError(
            f"alibi_train_length={train_length!r} is not valid; "
            "it must be a positive integer (the tokens_per_sample used in training)"
        )
    if interpolation != "none" and factor == 0.0 and not train_length:
        raise ValueError(
            "dynamic ALiBi scaling (alibi_scale_factor=0) needs alibi_train_length; "
            "set it to the training tokens_per_sample, or give a static factor >= 1"
        )
    if attention_path not in ATTENTION_PATHS:
        raise ValueError(
            f"alibi_attention={attention_path!r} is not valid; "
            f"allowed values: {', '.join(ATTENTION_PATHS)}"
        )


def _padding_mask(key_padding_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    """``[B, 1, 1, S]`` additive mask (-inf at padding) or None."""
    if key_padding_mask is None:
        return None
    pad = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill(pad, float("-inf"))


def reference_attention(q, k, v, bias, key_padding_mask=None, dropout_p=0.0):
    """Explicit softmax(q k^T / sqrt(d) + bias) v.  Shapes: q ``[B,H,T,D]``,
    k/v ``[B,H,S,D]``, bias ``[H,T,S]``.  Returns (output, probabilities)."""
    scores = torch.matmul(q * q.size(-1) ** -0.5, k.transpose(-1, -2))
    scores = scores.float() + bias.float()
    pad = _padding_mask(key_padding_mask, torch.float32)
    if pad is not None:
        scores = scores + pad
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(dropped, v), probs


def sdpa_attention(q, k, v, bias, key_padding_mask=None, dropout_p=0.0):
    """Fused attention with one bias broadcast over the batch."""
    mask = bias.to(q.dtype)[None]
    pad = _padding_mask(key_padding_mask, q.dtype)
    if pad is not None:
        mask = mask + pad
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def chunked_attention(q, k, v, bias_block, causal: bool, key_padding_mask=None, chunk_size=CHUNK_SIZE):
    """Inference attention in query blocks of ``chunk_size``.

    ``bias_block(q_start, q_len, k_len)`` returns the ``[H, q_len, k_len]`` bias
    of one block, built on the fly, so memory grows linearly with the length;
    causal blocks only read the keys they can see.
    """
    q_len, k_len = q.size(2), k.size(2)
    offset = k_len - q_len if causal else 0
    pad = _padding_mask(key_padding_mask, q.dtype)
    outputs = []
    for start in range(0, q_len, chunk_size):
        stop = min(start + chunk_size, q_len)
        visible = offset + stop if causal else k_len
        block = bias_block(offset + start, stop - start, visible)[None]
        if pad is not None:
            block = block + pad[..., :visible]
        outputs.append(
            F.scaled_dot_product_attention(
                q[:, :, start:stop], k[:, :, :visible], v[:, :, :visible], attn_mask=block
            )
        )
    return torch.cat(outputs, dim=2)


class AlibiMultiheadAttention(MultiheadAttention):
    """Self-attention with ALiBi; a drop-in for fairseq's ``MultiheadAttention``."""

    def __init__(self, embed_dim: int, num_heads: int, bias: AlibiBias, **kwargs):
        super().__init__(embed_dim, num_heads, self_attention=True, **kwargs)
        if bias.num_heads != num_heads:
            raise ValueError(f"ALiBi bias has {bias.num_heads} heads, attention has {num_heads}")
        self.alibi = bias

    # The two places the bias comes from; a subclass with another bias (for
    # example learned slopes) overrides these and keeps every kernel path.
    def bias_block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        """``[H, q_len, k_len]`` bias for queries ``q_start ..`` (built on the fly)."""
        return self.alibi.block(q_start, q_len, k_len, dtype, device)

    def dense_bias(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """The whole ``[H, q_len, k_len]`` bias (shared and cached across layers)."""
        return self.alibi.dense(q_len, k_len, dtype, device)

    @property
    def causal(self) -> bool:
        return self.alibi.kind == "causal"

    def choose_path(self, q_len: int, k_len: int, need_weights: bool) -> str:
        path = self.alibi.attention_path
        if need_weights:
            return "reference"
        if path != "auto":
            return path
        if torch.is_grad_enabled() or q_len * k_len <= CHUNK_THRESHOLD:
            return "sdpa"
        return "chunked"

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

        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            if "prev_key" in saved:
                k = torch.cat([saved["prev_key"], k], dim=2)
                v = torch.cat([saved["prev_value"], v], dim=2)
            key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
                key_padding_mask=key_padding_mask,
                prev_key_padding_mask=saved.get("prev_key_padding_mask"),
                batch_size=bsz,
                src_len=k.size(2),
                static_kv=False,
            )
            saved["prev_key"], saved["prev_value"] = k, v
            saved["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, saved)

        src_len = k.size(2)
        dropout_p = self.dropout_module.p if self.training else 0.0
        path = self.choose_path(tgt_len, src_len, need_weights)
        weights = None
        if path == "chunked":
            def block(q_start, q_len, k_len):
                return self.bias_block(q_start, q_len, k_len, q.dtype, q.device)

            out = chunked_attention(q, k, v, block, self.causal, key_padding_mask)
        else:
            bias = self.dense_bias(tgt_len, src_len, q.dtype, q.device)
            if path == "reference":
                out, weights = reference_attention(q, k, v, bias, key_padding_mask, dropout_p)
            else:
                out = sdpa_attention(q, k, v, bias, key_padding_mask, dropout_p)

        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        out = self.out_proj(out)
        if need_weights and weights is not None:
            weights = weights.transpose(0, 1)  # [H, B, T, S], fairseq's layout
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights
