"""Bidirectional ALiBi for encoders: config fields, the encoder layer and an
encoder without position embeddings (shared by ``roberta_alibi`` and
``transformer_alibi``).

Three ``--alibi-bidirectional`` modes, all ``attention.AlibiBias`` modes:

* ``symmetric``: ``-m_h * |i - j|`` for every head, the paper's slopes;
* ``split``: half the heads see only keys to their left, half only keys to
  their right, each with ``-m * distance`` (the two halves mirror each other and
  share the slopes of ``ceil(H / 2)`` heads); with an odd head count the last
  head sees both sides with the symmetric bias (``alibi.split_directions``);
* ``learned``: separate left and right slopes per head and per layer, trained
  (``attention.LearnedAlibiBias``, the state dict's ``...self_attn.alibi.left``
  and ``.right``), initialised to the paper's slopes on both sides.

``symmetric`` and ``split`` have no parameters: one ``AlibiBias`` per encoder
stack scales the slopes once per length and caches one dense bias that all
layers reuse, as the causal LM does.  Interpolation (``alibi_interpolation`` /
``alibi_scale_factor`` / ``alibi_train_length``) has the LM's semantics and
applies to all modes: the factor is resolved from the key length of the
forward pass.
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerConfig, TransformerEncoder
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from .. import alibi
from ..attention import AlibiBias, AlibiMultiheadAttention, alibi_options
from ..errors import ConfigError
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


def build_bidirectional_bias(args) -> AlibiBias:
    """The encoder stack's bias from (resolved) config fields; raises
    ``ConfigError`` naming the field for an invalid value."""
    mode = getattr(args, "alibi_bidirectional", "symmetric")
    if mode not in alibi.BIDIRECTIONAL_MODES:
        raise ConfigError(
            f"alibi_bidirectional={mode!r} is not valid; "
            f"allowed values: {', '.join(alibi.BIDIRECTIONAL_MODES)}"
        )
    return AlibiBias(args.encoder_attention_heads, mode, **alibi_options(args))


class AlibiEncoderLayer(TransformerEncoderLayerBase):
    """Stock encoder layer whose self-attention is bidirectional ALiBi."""

    def __init__(self, cfg, alibi_bias: AlibiBias, return_fc=False):
        self.alibi = alibi_bias  # plain attribute, read by build_self_attention
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return AlibiMultiheadAttention(
            embed_dim,
            cfg.encoder.attention_heads,
            self.alibi,
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
        self.alibi = build_bidirectional_bias(args)  # before the layers are built
        super().__init__(args, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, cfg):
        cfg = TransformerConfig.from_namespace(cfg)
        layer = AlibiEncoderLayer(cfg, self.alibi, return_fc=self.return_fc)
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
