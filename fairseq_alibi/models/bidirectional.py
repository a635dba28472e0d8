"""Bidirectional ALiBi for encoders: config fields, the encoder layer and an
encoder without position embeddings (shared by ``roberta_alibi`` and
``transformer_alibi``).

Three ``--alibi-bidirectional`` modes, all ``bias.AlibiBias`` modes:

* ``symmetric``: ``-m_h * |i - j|`` for every head, the paper's slopes;
* ``split``: half the heads see only keys to their left, half only keys to
  their right, each with ``-m * distance`` (the two halves mirror each other and
  share the slopes of ``ceil(H / 2)`` heads); with an odd head count the last
  head sees both sides with the symmetric bias (``alibi.split_directions``);
* ``learned``: separate left and right slopes per head and per layer, trained
  (``bias.LearnedAlibiBias``, the state dict's ``...self_attn.alibi.left``
  and ``.right``), initialised to the paper's slopes on both sides.

``symmetric`` and ``split`` have no parameters: one ``AlibiBias`` per encoder
stack scales the slopes once per length and caches one dense bias that all
layers reuse, as the causal LM does.  Interpolation (``alibi_interpolation`` /
``alibi_scale_factor`` / ``alibi_train_length``) has the LM's semantics and
applies to all modes: the factor is resolved from the key length of the
forward pass.
"""

from fairseq.models.transformer import TransformerConfig, TransformerEncoder
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from ..core.bias import AlibiBias
from .. import facts
from ..errors import ConfigError
from .config import AlibiEncoderConfig, build_bias
from .attention import attach_shared
from .transformer_lm import self_attention, wrap_layer


class AlibiEncoderLayer(TransformerEncoderLayerBase):
    """Stock encoder layer whose self-attention is bidirectional ALiBi."""

    def __init__(self, cfg, alibi_bias: AlibiBias, kernel: str = "auto", return_fc=False):
        attach_shared(self, "positions", alibi_bias)  # read by build_self_attention
        self.alibi_kernel = kernel
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return self_attention(self, embed_dim, cfg.encoder.attention_heads, cfg.attention_dropout)


class AlibiTransformerEncoder(TransformerEncoder):
    """Stock encoder without position embeddings, built from ALiBi layers.

    Used by both ``roberta_alibi`` and ``transformer_alibi``.
    """

    def __init__(self, args, dictionary, embed_tokens, return_fc=False):
        args.no_token_positional_embeddings = True
        self.positions = build_bias(args, args.encoder_attention_heads, encoder=True)
        self.alibi_kernel = getattr(args, "alibi_attention", "auto")
        super().__init__(args, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, cfg):
        cfg = TransformerConfig.from_namespace(cfg)
        return wrap_layer(AlibiEncoderLayer(cfg, self.positions, self.alibi_kernel, return_fc=self.return_fc), cfg)

    def max_positions(self):
        """ALiBi has no position table: the input length is not capped."""
        return facts.UNBOUNDED_POSITIONS


def encoder_twin(stock_arch_fn, *learned_pos_flags: str):
    """The ``_alibi`` twin of a stock arch with an encoder: the stock settings,
    positions off (``learned_pos_flags`` forced False), and the ALiBi encoder
    fields' defaults wherever the stock arch left them unset.  A learned-position
    flag the user set (``--encoder-learned-pos`` of transformer_alibi) is refused:
    forced off, it would train a model without the positions asked for."""

    def alibi_arch(args):
        asked = [flag for flag in learned_pos_flags if getattr(args, flag, None) is True]
        if asked:
            raise ConfigError(f"{', '.join('--' + flag.replace('_', '-') for flag in asked)}: an ALiBi model has no "
                              "position embeddings (ALiBi biases its attention instead); leave the flag out, or "
                              "train the stock arch for learned positions")
        stock_arch_fn(args)
        args.no_token_positional_embeddings = True
        for flag in learned_pos_flags:
            setattr(args, flag, False)
        for name, value in AlibiEncoderConfig().__dict__.items():
            if getattr(args, name, None) is None and value is not None:
                setattr(args, name, value)

    alibi_arch.__doc__ = f"ALiBi twin of {stock_arch_fn.__name__}."
    return alibi_arch
