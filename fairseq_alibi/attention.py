"""ALiBi self-attention for fairseq, with several interchangeable kernels.

``AlibiBias`` is created once per layer stack and shared by all its layers: it
turns the stack's configuration into (scaled) slopes for the current length and
owns the caches (the one dense bias, the merged padding mask, FlexAttention's
block mask), so the bias is built once per forward, not per layer, and never per
batch row.

``AlibiMultiheadAttention`` subclasses fairseq's ``MultiheadAttention`` and
keeps its parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) and
its KV-cache layout, so checkpoints and beam-search reordering work unchanged.
Only ``forward`` is replaced.

Attention paths (config field ``alibi_attention``):

* ``reference``: explicit scores + bias + softmax in fp32; the ground truth, and
  the only path that can return attention weights;
* ``sdpa``: ``F.scaled_dot_product_attention`` with one ``[1, H, T, S]`` bias
  broadcast over the batch, cached across layers and batches (CPU: the flash
  kernel, the training path; CUDA: the memory-efficient kernel);
* ``flex``: FlexAttention (CUDA, compiled) with ALiBi as a ``score_mod`` and a
  cached causal block mask: nothing ``T x T`` is materialized, forward or backward;
* ``chunked``: queries in blocks, the bias of each block built on the fly, so
  memory grows linearly with the length (long evaluation without FlexAttention);
* ``blocked``: causal attention in query blocks that only compute the keys they
  can see (``causal_blocks.blocked_causal_attention``): with attention dropout,
  explicit scores, dropout and a hand-written backward per block (the CPU path
  for training with dropout, where SDPA can only use its math kernel over the
  whole ``T x T`` square); without, one SDPA call per block.  Causal biases
  without a gradient only (otherwise ``sdpa``);
* ``auto``: looked up in ``AUTO_PATHS`` from the device and the regime
  (training, training with attention dropout, short or long inference);
  ``reference`` whenever attention weights are requested.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor

from . import alibi
from .causal_blocks import blocked_causal_attention

ATTENTION_PATHS = ("auto", "reference", "sdpa", "flex", "chunked", "blocked")
BIAS_KINDS = ("causal", "symmetric")

# Inference with more query x key pairs than this is "long" (linear-memory path).
CHUNK_THRESHOLD = 1024 * 1024
# Queries per block on the chunked path; its bias ramp is H x CHUNK_SIZE x
# (T + CHUNK_SIZE) values (docs/performance.md has the measurement behind it).
CHUNK_SIZE = 512

REGIMES = ("train", "train_dropout", "decode", "short", "long")

# The ``auto`` choice, as one table: device kind -> path per regime.
#   train          gradients on, no attention dropout (CPU: ``blocked`` wins on an
#                  idle machine but lost under load, see docs/performance.md)
#   train_dropout  gradients on, attention dropout > 0 (FlexAttention has none;
#                  CPU SDPA falls back to its math kernel, so CPU takes ``blocked``)
#   long           no gradients, more than CHUNK_THRESHOLD query x key pairs
#   decode         no gradients, a (short) incremental step against a KV cache
#   short          no gradients, any other short input
AUTO_PATHS: Dict[str, Dict[str, str]] = {
    #                              train   train_dropout decode  short   long
    "cpu":       dict(zip(REGIMES, ("sdpa", "blocked",   "sdpa", "sdpa", "chunked"))),
    "cuda":      dict(zip(REGIMES, ("sdpa", "sdpa",      "sdpa", "sdpa", "chunked"))),
    "cuda+flex": dict(zip(REGIMES, ("flex", "sdpa",      "sdpa", "flex", "flex"))),
}


def flex_available() -> bool:
    """FlexAttention can be imported (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def regime(grad: bool, dropout_p: float, q_len: int, k_len: int, incremental: bool = False) -> str:
    """The ``AUTO_PATHS`` column for one forward call."""
    if grad:
        return "train_dropout" if dropout_p > 0 else "train"
    if q_len * k_len > CHUNK_THRESHOLD:
        return "long"
    return "decode" if incremental else "short"


def device_kind(device: torch.device, flex_ok: bool) -> str:
    if device.type == "cuda":
        return "cuda+flex" if flex_ok and flex_available() else "cuda"
    return "cpu"


class AlibiBias:
    """Slopes and bias of one layer stack, shared by all its attention layers.

    A plain object rather than an ``nn.Module``: it has no parameters, nothing
    of it belongs in the state dict, and its caches are keyed by device and
    dtype, so it needs no ``.to()``.  Each cache holds one entry (the most recent
    shape), so it never grows.
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
        self._merged: Optional[tuple] = None  # (bias, padding mask, its version, merged)
        self._block_mask: Optional[tuple] = None  # (key, BlockMask)
        self._ramp: Optional[tuple] = None  # (key, ramp of the chunked path)

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
        """``[H, q_len, k_len]`` bias for queries ``q_start ..`` over ``k_len`` keys.

        The causal block is built with one ``[H, q_len, k_len]`` allocation (in
        place ``-inf``, float32 distances: exact below 2^24 positions), which is
        what the chunked path calls once per block and layer; it equals
        ``alibi.causal_bias`` exactly (tested)."""
        slopes = self.slopes(k_len, device)
        if self.kind == "causal":
            return _causal_block(slopes, q_start, q_len, k_len, dtype, device)
        return alibi.symmetric_bias(slopes, q_len, k_len, dtype, device, q_start)

    def causal_window(self, q_start: int, q_len: int, visible: int, k_len: int, dtype, device) -> Tensor:
        """``[H, q_len, visible]`` causal bias of queries ``q_start ..`` over the
        first ``visible`` keys, with the slopes of a ``k_len``-key forward: a
        view, no copy.

        The bias only depends on ``query - key``, so every block of the chunked
        path is a window of one ramp ``R[h, i, j] = -m_h * (P + i - j)``
        (``P = k_len - 1``, ``chunk`` rows, ``P + chunk`` columns): block
        ``(s, rows)`` is ``R[:, :rows, P - s : P - s + visible]``.  The ramp is
        built once per forward (shared by all layers and blocks) and is linear
        in the length: ``H x chunk x (T + chunk)``."""
        rows = max(CHUNK_SIZE, q_len)
        top = k_len - 1
        width = (top + rows + 7) // 8 * 8  # aligned rows for CUDA kernels
        key = (k_len, rows, dtype, str(device), self.interpolation, self.scale_factor)
        if self._ramp is None or self._ramp[0] != key:
            self._ramp = None
            ramp = _causal_block(self.slopes(k_len, device), top, rows, width, dtype, device)
            self._ramp = (key, ramp)
        offset = top - q_start
        return self._ramp[1][:, :q_len, offset : offset + visible]

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """The whole ``[H, q_len, k_len]`` bias, cached for the most recent shape.

        The first layer of a forward pass builds it, the others reuse it, and so
        do later batches of the same length.  It is built directly in the
        activation dtype, so no layer re-casts it.
        """
        key = (q_len, k_len, dtype, str(device), self.interpolation, self.scale_factor)
        if self._dense_key != key:
            self._dense = self._dense_key = None  # free the old one before building
            if self.kind == "causal":
                slopes = self.slopes(k_len, device)
                dense = alibi.causal_bias(slopes, q_len, k_len, dtype, device, k_len - q_len)
            else:
                dense = self.block(0, q_len, k_len, dtype, device)
            self._dense = _aligned(dense)
            self._dense_key = key
        return self._dense

    def merged_mask(self, bias: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """The additive mask for SDPA: ``[1, H, T, S]`` without padding (a view of
        ``bias``, nothing copied), else ``[B, H, T, S]`` with ``-inf`` at padded
        keys, built once per forward and shared by the layers (they all receive
        the same padding-mask tensor)."""
        if key_padding_mask is None:
            return bias[None]
        if bias.requires_grad:  # a learned bias: per layer, nothing to share
            return bias[None] + _padding_mask(key_padding_mask, bias.dtype)
        cached = self._merged
        if (
            cached is not None
            and cached[0] is bias
            and cached[1] is key_padding_mask
            and cached[2] == key_padding_mask._version
        ):
            return cached[3]
        self._merged = None
        merged = bias[None] + _padding_mask(key_padding_mask, bias.dtype)
        self._merged = (bias, key_padding_mask, key_padding_mask._version, merged)
        return merged

    def causal_block_mask(self, q_len: int, k_len: int, device):
        """FlexAttention block mask of causal attention (queries the last ``q_len``
        of ``k_len`` keys), cached for the most recent shape."""
        key = (q_len, k_len, str(device))
        if self._block_mask is None or self._block_mask[0] != key:
            self._block_mask = (key, _causal_block_mask(q_len, k_len, device))
        return self._block_mask[1]


def alibi_options(args) -> dict:
    """The ALiBi config fields every stack shares (``alibi_interpolation``,
    ``alibi_scale_factor``, ``alibi_train_length``, ``alibi_attention``), read
    from a fairseq config as ``AlibiBias`` keyword arguments."""
    train_length = getattr(args, "alibi_train_length", None)
    return dict(
        interpolation=getattr(args, "alibi_interpolation", "none"),
        scale_factor=getattr(args, "alibi_scale_factor", 0.0),
        train_length=int(train_length) if train_length is not None else None,
        attention_path=getattr(args, "alibi_attention", "auto"),
    )


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


def _causal_block(slopes: Tensor, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
    """``alibi.causal_bias`` with fewer and smaller temporaries (see ``AlibiBias.block``)."""
    query = torch.arange(q_start, q_start + q_len, device=device, dtype=torch.float32)
    keys = torch.arange(k_len, device=device, dtype=torch.float32)
    distance = query[:, None] - keys[None, :]
    bias = torch.mul(distance, -slopes.to(device=device, dtype=torch.float32)[:, None, None])
    bias.masked_fill_(distance < 0, float("-inf"))
    return bias if dtype == torch.float32 else bias.to(dtype)


def _aligned(bias: Tensor) -> Tensor:
    """On CUDA, give the bias a row stride that is a multiple of 8 elements (a
    view into padded storage): the memory-efficient SDPA kernel needs aligned
    mask rows and would otherwise copy the mask, or fall back to the math kernel."""
    if bias.device.type != "cuda" or bias.size(-1) % 8 == 0:
        return bias
    rounded = (bias.size(-1) + 7) // 8 * 8
    storage = bias.new_empty(*bias.shape[:-1], rounded)
    storage[..., : bias.size(-1)].copy_(bias)
    return storage[..., : bias.size(-1)]


def reference_attention(q, k, v, bias, key_padding_mask=None, dropout_p=0.0):
    """Explicit softmax(q k^T / sqrt(d) + bias) v.  Shapes: q ``[B,H,T,D]``,
    k/v ``[B,H,S,D]``, bias ``[H,T,S]``.  Returns (output, probabilities)."""
    scores = torch.matmul(q.float() * q.size(-1) ** -0.5, k.float().transpose(-1, -2))
    scores = scores + bias.float()
    pad = _padding_mask(key_padding_mask, torch.float32)
    if pad is not None:
        scores = scores + pad
    probs = torch.softmax(scores, dim=-1)
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(dropped, v.float()).to(q.dtype), probs.to(q.dtype)


def sdpa_attention(q, k, v, bias, key_padding_mask=None, dropout_p=0.0):
    """Fused attention with one ``[H, T, S]`` bias broadcast over the batch."""
    mask = bias.to(q.dtype)[None]
    pad = _padding_mask(key_padding_mask, q.dtype)
    if pad is not None:
        mask = mask + pad
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def chunked_attention(q, k, v, bias_block, causal: bool, key_padding_mask=None, chunk_size=None):
    """Inference attention in query blocks of ``chunk_size`` (default ``CHUNK_SIZE``).

    ``bias_block(q_start, q_len, visible)`` returns the ``[H, q_len, visible]``
    bias of one block (built on the fly, or a view of a shared ramp), so memory
    grows linearly with the length; causal blocks only read the keys they can see.
    """
    chunk_size = chunk_size or CHUNK_SIZE
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
        del block
    return torch.cat(outputs, dim=2)


# ----------------------------------------------------------------- FlexAttention
FLEX_BLOCK = 128
_compiled_flex: Optional[Callable] = None


def _flex_kernel(device: torch.device) -> Callable:
    """Compiled FlexAttention on CUDA (fused, nothing T x T); elsewhere the eager
    implementation, which materializes the scores and exists only so that the
    score_mod can be checked against the reference without a GPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _causal_mask_mod(offset: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask_mod


def _causal_block_mask(q_len: int, k_len: int, device):
    """The causal ``BlockMask`` for queries that are the last ``q_len`` of
    ``k_len`` keys.  For ``q_len == k_len`` (every full forward) it is written
    down directly, block by block, in O((T / 128)^2) memory: query block ``i``
    sees key blocks ``0 .. i-1`` in full and block ``i`` through the mask_mod.
    Other shapes go through ``create_block_mask``."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    offset = k_len - q_len
    mask_mod = _causal_mask_mod(offset)
    if q_len != k_len:
        return create_block_mask(mask_mod, None, None, q_len, k_len, device=device)
    n = (q_len + FLEX_BLOCK - 1) // FLEX_BLOCK
    rows = torch.arange(n, device=device, dtype=torch.int32)
    cols = torch.arange(n, device=device, dtype=torch.int32)
    kv_num_blocks = torch.ones(1, 1, n, device=device, dtype=torch.int32)
    # Row i: its diagonal block first, the remaining entries are never read.
    kv_indices = ((rows[:, None] + cols[None, :]) % n)[None, None].contiguous()
    full_kv_num_blocks = rows[None, None].clone()
    full_kv_indices = cols.expand(n, n)[None, None].contiguous()
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(q_len, k_len),
    )


def alibi_score_mod(slopes: Tensor, causal: bool, offset: int = 0, key_padding_mask: Optional[Tensor] = None):
    """FlexAttention ``score_mod`` adding ``-slope[h] * distance`` (fp32, integer
    distance, as ``alibi.causal_bias``); ``-inf`` at padded keys when a
    ``[B, S]`` padding mask is given.  The causal ``-inf`` comes from the block mask."""
    if causal:
        def bias_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx)
    else:
        def bias_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

    return with_key_padding(bias_mod, key_padding_mask)


def with_key_padding(score_mod, key_padding_mask: Optional[Tensor]):
    """``score_mod`` with ``-inf`` at the keys a ``[B, S]`` padding mask marks."""
    if key_padding_mask is None:
        return score_mod
    pad = key_padding_mask.to(torch.bool)

    def padded_mod(score, b, h, q_idx, kv_idx):
        return torch.where(pad[b, kv_idx], float("-inf"), score_mod(score, b, h, q_idx, kv_idx))

    return padded_mod


def flex_attention_alibi(q, k, v, score_mod, block_mask) -> Tensor:
    return _flex_kernel(q.device)(q, k, v, score_mod=score_mod, block_mask=block_mask)


# ----------------------------------------------------------------- the module
class AlibiMultiheadAttention(MultiheadAttention):
    """Self-attention with ALiBi; a drop-in for fairseq's ``MultiheadAttention``."""

    def __init__(self, embed_dim: int, num_heads: int, bias: AlibiBias, **kwargs):
        super().__init__(embed_dim, num_heads, self_attention=True, **kwargs)
        if bias.num_heads != num_heads:
            raise ValueError(f"ALiBi bias has {bias.num_heads} heads, attention has {num_heads}")
        self.alibi = bias

    # The places the bias comes from; a subclass with another bias (for example
    # learned slopes) overrides these and keeps every kernel path.  One that
    # overrides bias_block/dense_bias but not flex_score_mod never gets ``flex``
    # from ``auto`` (its bias would be ignored there).
    def bias_block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        """``[H, q_len, k_len]`` bias for queries ``q_start ..`` (built on the fly)."""
        return self.alibi.block(q_start, q_len, k_len, dtype, device)

    def dense_bias(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """The whole ``[H, q_len, k_len]`` bias (shared and cached across layers)."""
        return self.alibi.dense(q_len, k_len, dtype, device)

    def flex_score_mod(self, q_len: int, k_len: int, device, key_padding_mask: Optional[Tensor]):
        """The FlexAttention ``score_mod`` equal to ``dense_bias`` (plus padding)."""
        offset = k_len - q_len if self.causal else 0
        return alibi_score_mod(self.alibi.slopes(k_len, device), self.causal, offset, key_padding_mask)

    @property
    def causal(self) -> bool:
        return self.alibi.kind == "causal"

    def _flex_consistent(self) -> bool:
        cls, base = type(self), AlibiMultiheadAttention
        custom_bias = cls.dense_bias is not base.dense_bias or cls.bias_block is not base.bias_block
        return not custom_bias or cls.flex_score_mod is not base.flex_score_mod

    def choose_path(
        self,
        q_len: int,
        k_len: int,
        need_weights: bool,
        incremental: bool = False,
        dropout_p: float = 0.0,
        device: Optional[torch.device] = None,
    ) -> str:
        """``reference`` if weights are wanted, the configured path if not
        ``auto``, else the ``AUTO_PATHS`` entry for this device and regime."""
        if need_weights:
            return "reference"
        if self.alibi.attention_path != "auto":
            path = self.alibi.attention_path
        else:
            kind = device_kind(device or torch.device("cpu"), self._flex_consistent())
            path = AUTO_PATHS[kind][regime(torch.is_grad_enabled(), dropout_p, q_len, k_len, incremental)]
        if path == "blocked" and not self.causal:
            return "sdpa"  # the blocked path skips the keys above the diagonal
        return path

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
        path = self.choose_path(
            tgt_len, src_len, need_weights, incremental_state is not None, dropout_p, q.device
        )
        weights = None
        if path == "chunked":
            # Blocks see ``visible`` keys but take the slopes of all ``src_len``
            # (as the dense path does, so dynamic scaling agrees across paths).
            if self.causal and type(self).bias_block is AlibiMultiheadAttention.bias_block:
                def block(q_start, q_len, visible):
                    return self.alibi.causal_window(q_start, q_len, visible, src_len, q.dtype, q.device)
            else:
                def block(q_start, q_len, visible):
                    return self.bias_block(q_start, q_len, src_len, q.dtype, q.device)[..., :visible]

            out = chunked_attention(q, k, v, block, self.causal, key_padding_mask)
        elif path == "flex":
            if not self._flex_consistent():
                raise ValueError(
                    f"alibi_attention=flex: {type(self).__name__} overrides the bias hooks "
                    "but not flex_score_mod, so FlexAttention would ignore its bias"
                )
            if dropout_p > 0:
                raise ValueError("alibi_attention=flex has no attention dropout; use sdpa or auto")
            block_mask = (
                self.alibi.causal_block_mask(tgt_len, src_len, q.device) if self.causal else None
            )
            score_mod = self.flex_score_mod(tgt_len, src_len, q.device, key_padding_mask)
            out = flex_attention_alibi(q, k, v, score_mod, block_mask)
        else:
            bias = self.dense_bias(tgt_len, src_len, q.dtype, q.device)
            if path == "reference":
                out, weights = reference_attention(q, k, v, bias, key_padding_mask, dropout_p)
            elif path == "blocked" and not bias.requires_grad:
                mask = self.alibi.merged_mask(bias.to(q.dtype), key_padding_mask)
                out = blocked_causal_attention(q, k, v, mask, dropout_p)
            else:
                mask = self.alibi.merged_mask(bias.to(q.dtype), key_padding_mask)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        out = self.out_proj(out)
        if need_weights and weights is not None:
            weights = weights.transpose(0, 1)  # [H, B, T, S], fairseq's layout
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights
