"""Bidirectional ALiBi for encoders: config fields, the shared bias, the attention
modules and an encoder without position embeddings.

Three ``--alibi-bidirectional`` modes:

* ``symmetric``: ``-m_h * |i - j|`` for every head, the paper's slopes;
* ``split``: half the heads see only keys to their left, half only keys to
  their right, each with ``-m * distance`` (the two halves mirror each other and
  share the slopes of ``ceil(H / 2)`` heads); with an odd head count the last
  head sees both sides with the symmetric bias (``alibi.split_directions``);
* ``learned``: separate left and right slopes per head and per layer, trained,
  parametrized as ``softplus(raw) + 1e-6`` so the bias stays negative,
  initialised to the paper's slopes on both sides.

``symmetric`` and ``split`` have no parameters: one ``BidirectionalBias`` per
encoder stack scales the slopes once per length and caches one dense bias that
all layers reuse, as the causal LM does.  ``learned`` slopes are parameters of
each layer's attention module (``alibi_left`` / ``alibi_right``, the raw
softplus inputs), so every layer can learn its own range; the bias is then
built per layer and per forward (it carries gradients).

Interpolation (``alibi_interpolation`` / ``alibi_scale_factor`` /
``alibi_train_length``) has the LM's semantics and applies to all modes: the
factor is resolved from the key length of the forward pass; the learned mode
scales its left and right slopes together (NTK spreads over all ``2H``).

All modes plug into ``AlibiMultiheadAttention`` through its ``bias_block`` /
``dense_bias`` / ``causal`` hooks, so the reference, sdpa and chunked paths
apply unchanged; ``symmetric`` and ``split`` also give a ``flex_score_mod``
(FlexAttention on CUDA), ``learned`` does not (``auto`` keeps it off flex).
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerConfig, TransformerEncoder
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from .. import alibi
from ..attention import (
    AlibiBias,
    AlibiMultiheadAttention,
    alibi_options,
    with_key_padding,
)
from .config import AlibiSlopeConfig

# Same value as the LM: no position table, so no cap on the input length.
UNBOUNDED_POSITIONS = 1 << 30


@dataclass
class AlibiEncoderConfig(AlibiSlopeConfig):
    """ALiBi fields of the encoder models (added to their argparse options)."""

    alibi_bidirectional: str = field(
        default="symmetric",
        metadata={
            "help": "encoder self-attention bias: "
            f"{' | '.join(alibi.BIDIRECTIONAL_MODES)} (symmetric: -m|i-j| every head; "
            "split: half the heads look only left, half only right, an odd last head "
            "both ways; learned: per-layer left/right slopes, trained, kept negative)"
        },
    )
    alibi_train_length: Optional[int] = field(
        default=None,
        metadata={
            "help": "the length the model was trained at (masked LM: defaults to the "
            "task's tokens_per_sample; translation: set it to use dynamic scaling)"
        },
    )


def masked_value_for(dtype: torch.dtype) -> float:
    """Finite stand-in for ``-inf`` on the side a split head does not see.

    Finite so that a query whose whole visible side is padding (a padding
    position itself) still has a defined softmax: with ``-inf`` its row would
    be NaN, and NaN values poison every later layer through ``0 * NaN``.  Large
    enough that ``exp`` of it is exactly 0 next to any real score (fairseq's
    own convention for additive masks: -1e8, or -1e4 in 16-bit types).
    """
    return -1e8 if dtype in (torch.float32, torch.float64) else -1e4


class BidirectionalBias:
    """The fixed-slope bias of one encoder stack, shared by all its layers.

    A plain object, like ``AlibiBias``: no parameters, nothing in the state
    dict, caches keyed by device and dtype.  ``kernel`` is the ``AlibiBias``
    handed to every layer's attention (it validates the options and carries
    the kernel choice).
    """

    def __init__(
        self,
        num_heads: int,
        mode: str = "symmetric",
        interpolation: str = "none",
        scale_factor: float = 0.0,
        train_length: Optional[int] = None,
        attention_path: str = "auto",
    ):
        if mode not in alibi.BIDIRECTIONAL_MODES:
            raise ValueError(
                f"alibi_bidirectional={mode!r} is not valid; "
                f"allowed values: {', '.join(alibi.BIDIRECTIONAL_MODES)}"
            )
        self.kernel = AlibiBias(
            num_heads,
            interpolation=interpolation,
            scale_factor=scale_factor,
            train_length=train_length,
            kind="symmetric",
            attention_path=attention_path,
        )
        self.num_heads = num_heads
        self.mode = mode
        self.interpolation = interpolation
        self.scale_factor = float(scale_factor)
        self.train_length = train_length
        self.base_slopes = alibi.split_slopes(num_heads) if mode == "split" else alibi.get_slopes(num_heads)
        self._slopes_cache: Dict[tuple, Tensor] = {}
        self._dense_key: Optional[tuple] = None
        self._dense: Optional[Tensor] = None

    def factor(self, seq_len: int) -> float:
        return alibi.resolve_scale_factor(
            self.interpolation, self.scale_factor, self.train_length, seq_len
        )

    def scale(self, slopes: Tensor, seq_len: int) -> Tensor:
        """``slopes`` interpolated for a forward over ``seq_len`` keys (differentiable)."""
        return alibi.scale_slopes(slopes, self.interpolation, self.factor(seq_len))

    def slopes(self, seq_len: int, device=None) -> Tensor:
        """float32 ``[H]`` fixed slopes for ``seq_len`` keys (symmetric / split)."""
        key = (self.factor(seq_len), str(device))
        if key not in self._slopes_cache:
            if len(self._slopes_cache) > 64:
                self._slopes_cache.clear()
            self._slopes_cache[key] = self.scale(self.base_slopes, seq_len).to(device)
        return self._slopes_cache[key]

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        slopes = self.slopes(k_len, device)
        if self.mode == "split":
            return alibi.split_bias(
                slopes, q_len, k_len, dtype, device, q_start, masked_value_for(dtype)
            )
        if self.mode == "symmetric":
            return alibi.symmetric_bias(slopes, q_len, k_len, dtype, device, q_start)
        raise RuntimeError("learned slopes live in the attention modules, not the shared bias")

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """Whole-matrix bias, built by the first layer and reused by the others."""
        key = (q_len, k_len, dtype, str(device), self.factor(k_len))
        if self._dense_key != key:
            self._dense = self.block(0, q_len, k_len, dtype, device)
            self._dense_key = key
        return self._dense

    def score_mod(self, k_len: int, device, key_padding_mask: Optional[Tensor] = None):
        """FlexAttention ``score_mod`` of ``block`` (symmetric / split), with
        ``-inf`` at padded keys when a ``[B, S]`` padding mask is given."""
        slopes = self.slopes(k_len, device)
        if self.mode == "symmetric":
            def bias_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx - kv_idx).abs()
        elif self.mode == "split":
            directions = alibi.split_directions(self.num_heads).to(device)
            masked = masked_value_for(torch.float32)

            def bias_mod(score, b, h, q_idx, kv_idx):
                hidden = directions[h] * (kv_idx - q_idx) < 0
                return torch.where(hidden, masked, score - slopes[h] * (q_idx - kv_idx).abs())
        else:
            raise RuntimeError("learned slopes live in the attention modules, not the shared bias")
        return with_key_padding(bias_mod, key_padding_mask)

    def attention(self, embed_dim: int, **kwargs) -> AlibiMultiheadAttention:
        """A new self-attention module of this stack's mode."""
        cls = LearnedAlibiAttention if self.mode == "learned" else BidirectionalAlibiAttention
        return cls(embed_dim, self.num_heads, self, **kwargs)


class BidirectionalAlibiAttention(AlibiMultiheadAttention):
    """Unmasked ALiBi self-attention (symmetric or split) over a shared bias."""

    def __init__(self, embed_dim: int, num_heads: int, stack: BidirectionalBias, **kwargs):
        super().__init__(embed_dim, num_heads, stack.kernel, **kwargs)
        self.stack = stack  # plain object: not a submodule, not in the state dict

    @property
    def causal(self) -> bool:
        return False

    def bias_block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        return self.stack.block(q_start, q_len, k_len, dtype, device)

    def dense_bias(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        return self.stack.dense(q_len, k_len, dtype, device)

    def flex_score_mod(self, q_len: int, k_len: int, device, key_padding_mask: Optional[Tensor]):
        """FlexAttention ``score_mod`` equal to ``dense_bias`` plus padding."""
        return self.stack.score_mod(k_len, device, key_padding_mask)


class LearnedAlibiAttention(BidirectionalAlibiAttention):
    """ALiBi self-attention with this layer's own learned left/right slopes."""

    def __init__(self, embed_dim: int, num_heads: int, stack: BidirectionalBias, **kwargs):
        super().__init__(embed_dim, num_heads, stack, **kwargs)
        raw = alibi.learned_slopes_inverse(alibi.get_slopes(num_heads))
        self.alibi_left = nn.Parameter(raw.clone())
        self.alibi_right = nn.Parameter(raw.clone())

    def slopes(self, seq_len: Optional[int] = None):
        """(left, right) positive float32 ``[H]`` slopes, interpolated for ``seq_len``."""
        left = alibi.learned_slopes(self.alibi_left)
        right = alibi.learned_slopes(self.alibi_right)
        if seq_len is None:
            return left, right
        both = self.stack.scale(torch.cat([left, right]), seq_len)
        return both[: self.num_heads], both[self.num_heads :]

    def bias_block(self, q_start: int, q_len: int, k_len: int, dtype, device) -> Tensor:
        left, right = self.slopes(k_len)
        return alibi.asymmetric_bias(left, right, q_len, k_len, dtype, device, q_start)

    def dense_bias(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        return self.bias_block(0, q_len, k_len, dtype, device)

    # No FlexAttention score_mod for trained slopes (its backward through
    # captured tensors is untested here): the base hook makes ``auto`` keep this
    # module on sdpa / chunked, and an explicit ``flex`` fail with a clear error.
    flex_score_mod = AlibiMultiheadAttention.flex_score_mod


def build_bidirectional_bias(args) -> BidirectionalBias:
    """The encoder stack's bias from (resolved) config fields; raises ValueError
    naming the field for an invalid value."""
    return BidirectionalBias(
        num_heads=args.encoder_attention_heads,
        mode=getattr(args, "alibi_bidirectional", "symmetric"),
        **alibi_options(args),
    )


class AlibiEncoderLayer(TransformerEncoderLayerBase):
    """Stock encoder layer whose self-attention is bidirectional ALiBi."""

    def __init__(self, cfg, stack: BidirectionalBias, return_fc=False):
        self.alibi_stack = stack  # plain attribute, read by build_self_attention
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        if cfg.encoder.attention_heads != self.alibi_stack.num_heads:
            raise ValueError("encoder_attention_heads differs from the ALiBi bias's head count")
        return self.alibi_stack.attention(
            embed_dim,
            dropout=cfg.attention_dropout,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
        )


class AlibiTransformerEncoder(TransformerEncoder):
    """Stock encoder without position embeddings, built from ALiBi layers.

    Used by both ``roberta_alibi`` and ``transformer_alibi``.
    """

    def __init__(self, args, dictionary, embed_tokens, return_fc=False):
        args.no_token_positional_embeddings = True
        self.alibi_bias = build_bidirectional_bias(args)  # before the layers are built
        super().__init__(args, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, cfg):
        cfg = TransformerConfig.from_namespace(cfg)
        layer = AlibiEncoderLayer(cfg, self.alibi_bias, return_fc=self.return_fc)
        if cfg.checkpoint_activations:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
            return fsdp_wrap(layer, min_num_params=0)
        return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap)

    def max_positions(self):
        """ALiBi has no position table: the input length is not capped."""
        return UNBOUNDED_POSITIONS


def encoder_twin(stock_arch_fn, *learned_pos_flags: str):
    """The ``_alibi`` twin of a stock arch with an encoder: the stock settings,
    positions off (``learned_pos_flags`` forced False), and the ALiBi encoder
    fields' defaults wherever the stock arch left them unset."""

    def alibi_arch(args):
        stock_arch_fn(args)
        args.no_token_positional_embeddings = True
        for flag in learned_pos_flags:
            setattr(args, flag, False)
        for name, value in AlibiEncoderConfig().__dict__.items():
            if getattr(args, name, None) is None and value is not None:
                setattr(args, name, value)

    alibi_arch.__doc__ = f"ALiBi twin of {stock_arch_fn.__name__}."
    return alibi_arch
