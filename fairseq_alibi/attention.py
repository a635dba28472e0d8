"""ALiBi self-attention for fairseq: the shared bias of a layer stack and the kernels.

``AlibiBias`` is created once per layer stack and shared by all its layers: it
turns the stack's configuration into (scaled) slopes for the current length and
owns the caches (the one dense bias, the merged padding mask, FlexAttention's
block mask, the chunked kernel's ramp), so the bias is built once per forward,
not per layer, and never per batch row.  Its ``mode`` says where each head
looks: ``causal`` (the LM), ``symmetric`` or ``split`` (encoders).
``LearnedAlibiBias`` (mode ``learned``) is the one subclass with parameters:
each encoder layer trains its own left/right slopes.

``AlibiMultiheadAttention`` subclasses fairseq's ``MultiheadAttention`` and
keeps its parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) and
its KV-cache layout, so checkpoints and beam-search reordering work unchanged.
Only ``forward`` is replaced; the bias comes from its ``alibi`` object.

Kernels (config field ``alibi_attention``):

* ``reference``: explicit scores + bias + softmax in fp32; the ground truth, and
  the only kernel that can return attention weights;
* ``sdpa``: ``F.scaled_dot_product_attention`` with one ``[1, H, T, S]`` bias
  broadcast over the batch, cached across layers and batches;
* ``flex``: FlexAttention (CUDA, compiled) with ALiBi as a ``score_mod`` and a
  cached causal block mask: nothing ``T x T`` is materialized, forward or
  backward; no attention dropout, and only for biases with ``supports_flex``;
* ``chunked``: queries in blocks, the bias of each block built on the fly, so
  memory grows linearly with the length (long evaluation without FlexAttention);
* ``blocked``: causal attention in query blocks that only compute the keys they
  can see (``causal_blocks.blocked_causal_attention``): with attention dropout,
  explicit scores, dropout and a hand-written backward per block (CPU SDPA
  would run its math kernel over the whole ``T x T`` square); without, one
  SDPA call per block.  Causal biases only (a bidirectional one gets ``sdpa``);
* ``auto``: :func:`choose_kernel`.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from . import alibi
from .causal_blocks import blocked_causal_attention
from .errors import ConfigError, warn_once

KERNELS = ("auto", "reference", "sdpa", "flex", "chunked", "blocked")

# Inference with more query x key pairs than this is "long" (linear-memory kernel).
CHUNK_THRESHOLD = 1024 * 1024
# Queries per block of the chunked kernel; its bias ramp is H x CHUNK_SIZE x
# (T + CHUNK_SIZE) values (docs/performance.md has the measurement behind it).
CHUNK_SIZE = 512


def flex_available() -> bool:
    """FlexAttention can be imported (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def choose_kernel(
    bias: "AlibiBias",
    need_weights: bool,
    q_len: int,
    k_len: int,
    dropout_p: float = 0.0,
    incremental: bool = False,
    device: Optional[torch.device] = None,
) -> str:
    """The kernel of one forward call.

    Weights wanted: ``reference`` (the only kernel that returns them).  An
    explicit ``alibi_attention``: that kernel (``blocked`` only for a causal
    bias, ``sdpa`` otherwise).  ``auto``: FlexAttention on CUDA for full
    forwards without attention dropout when the bias supports it; ``blocked``
    for CPU training with attention dropout (causal bias); ``chunked`` for long
    inference (linear memory); ``sdpa`` for everything else (training, short
    inference, KV-cache steps).
    """
    if need_weights:
        return "reference"
    device = device or torch.device("cpu")
    kernel = bias.kernel
    if kernel == "auto":
        grad = torch.is_grad_enabled()
        if device.type == "cuda" and bias.supports_flex and dropout_p == 0 and not incremental and flex_available():
            kernel = "flex"
        elif device.type == "cpu" and grad and dropout_p > 0:
            kernel = "blocked"
        elif not grad and q_len * k_len > CHUNK_THRESHOLD:
            kernel = "chunked"
        else:
            kernel = "sdpa"
    if kernel == "blocked" and not bias.causal:
        return "sdpa"  # the blocked kernel skips the keys right of the query
    return kernel


def masked_value_for(mode: str, dtype: torch.dtype) -> float:
    """What the bias puts on the side a head does not see.

    ``-inf`` for the causal LM (every query sees at least itself).  For
    ``split`` a finite stand-in, so that a query whose whole visible side is
    padding (a padding position itself) still has a defined softmax: with
    ``-inf`` its row would be NaN, and NaN poisons every later layer through
    ``0 * NaN``.  Large enough that ``exp`` of it is exactly 0 next to any real
    score (fairseq's own convention: -1e8, or -1e4 in 16-bit types).
    """
    if mode != "split":
        return float("-inf")
    return -1e8 if dtype in (torch.float32, torch.float64) else -1e4


class AlibiBias:
    """Slopes and bias of one layer stack, shared by all its attention layers.

    A plain object rather than an ``nn.Module``: it has no parameters, nothing
    of it belongs in the state dict, and its caches are keyed by device and
    dtype, so it needs no ``.to()``.  Each cache holds one entry (the most recent
    shape), so it never grows.  For mode ``learned`` it is the stack's config:
    :meth:`for_layer` makes each layer its own :class:`LearnedAlibiBias`.
    """

    #: FlexAttention can express this bias as a ``score_mod`` (``choose_kernel``).
    supports_flex = True

    def __init__(
        self,
        num_heads: int,
        mode: str = "causal",
        interpolation: str = "none",
        scale_factor: float = 0.0,
        train_length: Optional[int] = None,
        kernel: str = "auto",
    ):
        validate_options(interpolation, scale_factor, train_length, kernel)
        if mode not in alibi.BIAS_MODES:
            raise ConfigError(
                f"alibi_bidirectional={mode!r} is not valid; allowed values: "
                f"{', '.join(alibi.BIDIRECTIONAL_MODES)} (causal for decoders)"
            )
        self.num_heads = num_heads
        self.mode = mode
        self.interpolation = interpolation
        self.scale_factor = float(scale_factor)
        self.train_length = train_length
        self.kernel = kernel
        self.directions = alibi.head_directions(mode, num_heads)
        self.base_slopes = alibi.mode_slopes(mode, num_heads)
        self._slopes_cache: Dict[tuple, Tensor] = {}
        self._dense: Optional[tuple] = None  # (key, bias)
        self._merged: Optional[tuple] = None  # (bias, padding mask, its version, merged)
        self._block_mask: Optional[tuple] = None  # (key, BlockMask)
        self._ramp: Optional[tuple] = None  # (key, ramp of the chunked kernel)

    @property
    def causal(self) -> bool:
        return self.mode == "causal"

    def options(self) -> dict:
        return dict(interpolation=self.interpolation, scale_factor=self.scale_factor,
                    train_length=self.train_length, kernel=self.kernel)

    def for_layer(self) -> "AlibiBias":
        """The bias one layer's attention uses: this shared object, or for
        mode ``learned`` a new one with that layer's own trained slopes."""
        if self.mode == "learned":
            return LearnedAlibiBias(self.num_heads, **self.options())
        return self

    def factor(self, k_len: int) -> float:
        return alibi.resolve_scale_factor(self.interpolation, self.scale_factor, self.train_length, k_len)

    def slopes(self, k_len: int, device=None) -> Tensor:
        """float32 ``[H]`` slopes for a forward pass over ``k_len`` keys."""
        key = (self.factor(k_len), str(device))
        if key not in self._slopes_cache:
            if len(self._slopes_cache) > 64:
                self._slopes_cache.clear()
            scaled = alibi.scale_slopes(self.base_slopes, self.interpolation, key[0])
            self._slopes_cache[key] = scaled.to(device)
        return self._slopes_cache[key]

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        """``[H, q_len, k_len]`` bias for queries ``q_start ..`` over ``k_len`` keys."""
        return alibi.alibi_bias(
            self.slopes(k_len, device), q_len, k_len, self.directions, q_start, dtype, device,
            masked_value_for(self.mode, dtype),
        )

    def window(self, q_start: int, q_len: int, visible: int, k_len: int, dtype, device) -> Tensor:
        """``[H, q_len, visible]`` bias of queries ``q_start ..`` over the first
        ``visible`` keys, with the slopes of a ``k_len``-key forward (the chunked kernel).

        Causal: a view, no copy.  The bias only depends on ``query - key``, so
        every block is a window of one ramp ``R[h, i, j] = -m_h * (P + i - j)``
        (``P = k_len - 1``, ``chunk`` rows, ``P + chunk`` columns): block
        ``(s, rows)`` is ``R[:, :rows, P - s : P - s + visible]``.  The ramp is
        built once per forward (shared by all layers and blocks) and is linear
        in the length: ``H x chunk x (T + chunk)``.
        """
        if not self.causal:
            return self.block(q_start, q_len, k_len, dtype, device)[..., :visible]
        rows = max(CHUNK_SIZE, q_len)
        top = k_len - 1
        width = (top + rows + 7) // 8 * 8  # aligned rows for CUDA kernels
        key = (k_len, rows, dtype, str(device), self.interpolation, self.scale_factor)
        if self._ramp is None or self._ramp[0] != key:
            self._ramp = None
            slopes = self.slopes(k_len, device)
            self._ramp = (key, alibi.alibi_bias(slopes, rows, width, self.directions, top, dtype, device))
        offset = top - q_start
        return self._ramp[1][:, :q_len, offset : offset + visible]

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """The whole ``[H, q_len, k_len]`` bias (queries the last ``q_len`` of
        the keys), cached for the most recent shape: the first layer of a
        forward builds it, the others and later batches of the same length
        reuse it.  Built directly in the activation dtype."""
        key = (q_len, k_len, dtype, str(device), self.interpolation, self.scale_factor)
        if self._dense is None or self._dense[0] != key:
            self._dense = None  # free the old one before building
            self._dense = (key, _aligned(self.block(k_len - q_len, q_len, k_len, dtype, device)))
        return self._dense[1]

    def merged_mask(self, bias: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """The additive mask for SDPA: ``[1, H, T, S]`` without padding (a view of
        ``bias``, nothing copied), else ``[B, H, T, S]`` with ``-inf`` at padded
        keys, built once per forward and shared by the layers (they all receive
        the same padding-mask tensor)."""
        if key_padding_mask is None:
            return bias[None]
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

    def score_mod(self, q_len: int, k_len: int, device, key_padding_mask: Optional[Tensor] = None):
        """FlexAttention ``score_mod`` equal to :meth:`dense` (fp32, from the
        integer distance), with ``-inf`` at the keys a ``[B, S]`` padding mask
        marks.  The causal ``-inf`` comes from :meth:`block_mask`."""
        slopes = self.slopes(k_len, device)
        offset = k_len - q_len
        if self.causal:
            def bias_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx + offset - kv_idx)
        elif self.mode == "split":
            directions = torch.tensor(self.directions, device=device)
            masked = masked_value_for("split", torch.float32)

            def bias_mod(score, b, h, q_idx, kv_idx):
                distance = q_idx + offset - kv_idx
                hidden = directions[h] * distance > 0  # left heads hide j > i, right heads j < i
                return torch.where(hidden, masked, score - slopes[h] * distance.abs())
        else:
            def bias_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx + offset - kv_idx).abs()

        return with_key_padding(bias_mod, key_padding_mask)

    def block_mask(self, q_len: int, k_len: int, device):
        """FlexAttention block mask: causal attention (queries the last ``q_len``
        of ``k_len`` keys), cached for the most recent shape; None otherwise."""
        if not self.causal:
            return None
        key = (q_len, k_len, str(device))
        if self._block_mask is None or self._block_mask[0] != key:
            self._block_mask = (key, _causal_block_mask(q_len, k_len, device))
        return self._block_mask[1]


class LearnedAlibiBias(nn.Module, AlibiBias):
    """One layer's trained left/right slopes (encoder mode ``learned``).

    Parametrized as ``softplus(raw) + 1e-6`` so the bias stays negative,
    initialised to the paper's slopes on both sides; interpolation scales the
    two sides together (NTK spreads over all ``2H``).  The bias carries
    gradients, so it is built per layer and forward, never cached or shared.
    """

    supports_flex = False  # no score_mod for trained slopes: auto keeps it off flex

    def __init__(self, num_heads: int, **options):
        nn.Module.__init__(self)
        AlibiBias.__init__(self, num_heads, mode="learned", **options)
        raw = alibi.learned_slopes_inverse(alibi.get_slopes(num_heads))
        self.left = nn.Parameter(raw.clone())
        self.right = nn.Parameter(raw.clone())

    def for_layer(self) -> "LearnedAlibiBias":
        return self

    def slopes(self, k_len: Optional[int] = None, device=None):
        """(left, right) positive float32 ``[H]`` slopes, interpolated for ``k_len`` keys."""
        left, right = alibi.learned_slopes(self.left), alibi.learned_slopes(self.right)
        if k_len is None:
            return left, right
        both = alibi.scale_slopes(torch.cat([left, right]), self.interpolation, self.factor(k_len))
        return both[: self.num_heads], both[self.num_heads :]

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        left, right = self.slopes(k_len)
        return alibi.asymmetric_bias(left, right, q_len, k_len, q_start, dtype, device)

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        return self.block(k_len - q_len, q_len, k_len, dtype, device)

    def merged_mask(self, bias: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        pad = _padding_mask(key_padding_mask, bias.dtype)
        return bias[None] if pad is None else bias[None] + pad

    def score_mod(self, *args, **kwargs):
        raise ConfigError("alibi_attention=flex does not support learned slopes; use auto, sdpa or chunked")


def alibi_options(args) -> dict:
    """The ALiBi config fields every stack shares (``alibi_interpolation``,
    ``alibi_scale_factor``, ``alibi_train_length``, ``alibi_attention``), read
    from a fairseq config as ``AlibiBias`` keyword arguments."""
    train_length = getattr(args, "alibi_train_length", None)
    return dict(
        interpolation=getattr(args, "alibi_interpolation", "none"),
        scale_factor=getattr(args, "alibi_scale_factor", 0.0),
        train_length=int(train_length) if train_length is not None else None,
        kernel=getattr(args, "alibi_attention", "auto"),
    )


def validate_options(interpolation, scale_factor, train_length, kernel) -> None:
    """Raise ``ConfigError`` naming the config field for any invalid ALiBi option."""
    if interpolation not in alibi.INTERPOLATION_METHODS:
        raise ConfigError(
            f"alibi_interpolation={interpolation!r} is not valid; "
            f"allowed values: {', '.join(alibi.INTERPOLATION_METHODS)}"
        )
    try:
        factor = float(scale_factor)
    except (TypeError, ValueError):
        factor = float("nan")
    if not (factor == 0.0 or factor >= 1.0) or factor == float("inf"):
        raise ConfigError(
            f"alibi_scale_factor={scale_factor!r} is not valid; use 0 for dynamic "
            "scaling (max(1, length / alibi_train_length)) or a static factor >= 1"
        )
    if train_length is not None and (not isinstance(train_length, int) or train_length < 1):
        raise ConfigError(
            f"alibi_train_length={train_length!r} is not valid; "
            "it must be a positive integer (the tokens_per_sample used in training)"
        )
    if interpolation != "none" and factor == 0.0 and not train_length:
        raise ConfigError(
            "dynamic ALiBi scaling (alibi_scale_factor=0) needs alibi_train_length; "
            "set it to the training tokens_per_sample, or give a static factor >= 1"
        )
    if interpolation == "none" and factor not in (0.0, 1.0):
        warn_once(
            f"alibi_scale_factor={scale_factor!r} has no effect with alibi_interpolation='none'; "
            "set alibi_interpolation to linear or ntk to scale the slopes"
        )
    if kernel not in KERNELS:
        raise ConfigError(
            f"alibi_attention={kernel!r} is not valid; "
            f"allowed values: {', '.join(KERNELS)}"
        )


def _padding_mask(key_padding_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    """``[B, 1, 1, S]`` additive mask (-inf at padding) or None."""
    if key_padding_mask is None:
        return None
    pad = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill(pad, float("-inf"))


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

    def __init__(self, embed_dim: int, num_heads: int, alibi_bias: AlibiBias, **kwargs):
        super().__init__(embed_dim, num_heads, self_attention=True, **kwargs)
        if alibi_bias.num_heads != num_heads:
            raise ValueError(f"ALiBi bias has {alibi_bias.num_heads} heads, attention has {num_heads}")
        self.alibi = alibi_bias.for_layer()  # a submodule only when it has parameters

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
        kernel = choose_kernel(
            self.alibi, need_weights, tgt_len, src_len, dropout_p, incremental_state is not None, q.device
        )
        weights = None
        if kernel == "chunked":
            # Blocks see ``visible`` keys but take the slopes of all ``src_len``
            # (as the dense kernels do, so dynamic scaling agrees across kernels).
            def block(q_start, q_len, visible):
                return self.alibi.window(q_start, q_len, visible, src_len, q.dtype, q.device)

            out = chunked_attention(q, k, v, block, self.alibi.causal, key_padding_mask)
        elif kernel == "flex":
            if dropout_p > 0:
                raise ConfigError("alibi_attention=flex has no attention dropout; use sdpa or auto")
            score_mod = self.alibi.score_mod(tgt_len, src_len, q.device, key_padding_mask)
            block_mask = self.alibi.block_mask(tgt_len, src_len, q.device)
            out = flex_attention_alibi(q, k, v, score_mod, block_mask)
        else:
            bias = self.alibi.dense(tgt_len, src_len, q.dtype, q.device)
            if kernel == "reference":
                out, weights = reference_attention(q, k, v, bias, key_padding_mask, dropout_p)
            elif kernel == "blocked":
                out = blocked_causal_attention(q, k, v, self.alibi.merged_mask(bias, key_padding_mask), dropout_p)
            else:
                mask = self.alibi.merged_mask(bias, key_padding_mask)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        out = self.out_proj(out)
        if need_weights and weights is not None:
            weights = weights.transpose(0, 1)  # [H, B, T, S], fairseq's layout
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights
