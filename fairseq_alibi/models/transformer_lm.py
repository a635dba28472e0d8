"""``transformer_lm_alibi``: fairseq's transformer LM with ALiBi instead of positions.

What changes against the stock model, and nothing else:

* the decoder has no position embeddings and no cap on its input length;
* every decoder self-attention is ``AlibiMultiheadAttention``, all layers sharing
  one causal ``AlibiBias`` (slopes scaled once per forward, one cached bias);
* three config fields choose the eval-time context extension and one the kernel.

Every stock ``transformer_lm*`` architecture gets an ``<arch>_alibi`` twin.
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.distributed import fsdp_wrap
from fairseq.models import (
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_NAME_REGISTRY,
    register_model,
    register_model_architecture,
)
from fairseq.models import transformer_lm as stock
from fairseq.models.transformer import TransformerConfig, TransformerDecoder
from fairseq.modules import TransformerDecoderLayer
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from omegaconf import II

from .. import patches
from ..attention import AlibiBias, AlibiMultiheadAttention, alibi_options
from .config import AlibiSlopeConfig

# Long enough for any evaluation; fairseq takes the minimum over task and model.
UNBOUNDED_POSITIONS = 1 << 30


@dataclass
class AlibiLanguageModelConfig(stock.TransformerLanguageModelConfig, AlibiSlopeConfig):
    alibi_train_length: Optional[int] = field(
        default=II("task.tokens_per_sample"),
        metadata={
            "help": "the length the model was trained at (defaults to the task's "
            "tokens_per_sample when training; stored resolved in the checkpoint)"
        },
    )
    # Unset means "same as decoder_embed_dim": avoids the stock 512-wide default
    # that silently adds projections to smaller or larger models.
    decoder_input_dim: Optional[int] = field(
        default=None, metadata={"help": "decoder input dimension (default: decoder_embed_dim)"}
    )
    decoder_output_dim: Optional[int] = field(
        default=None, metadata={"help": "decoder output dimension (default: decoder_embed_dim)"}
    )


def build_alibi_bias(args) -> AlibiBias:
    """The shared causal bias of a decoder stack, from (already resolved) config
    fields; raises ``ConfigError`` naming the field for an invalid value."""
    return AlibiBias(args.decoder_attention_heads, "causal", **alibi_options(args))


class AlibiDecoderLayer(TransformerDecoderLayer):
    """Stock decoder layer whose self-attention is ALiBi attention."""

    def __init__(self, args, alibi_bias: AlibiBias, no_encoder_attn=False):
        self.alibi = alibi_bias  # plain attribute, read by build_self_attention
        super().__init__(args, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, args, add_bias_kv=False, add_zero_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("ALiBi attention does not support bias_kv, zero_attn or cross_self_attention")
        return AlibiMultiheadAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            self.alibi,
            dropout=cfg.attention_dropout,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
        )


class AlibiTransformerDecoder(TransformerDecoder):
    """Stock decoder without position embeddings, built from ALiBi layers."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        args.no_token_positional_embeddings = True
        self.alibi = build_alibi_bias(args)  # before the layers are built
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)

    def build_decoder_layer(self, args, no_encoder_attn=False):
        layer = AlibiDecoderLayer(args, self.alibi, no_encoder_attn)
        if getattr(args, "checkpoint_activations", False):
            layer = checkpoint_wrapper(layer, offload_to_cpu=getattr(args, "offload_activations", False))
            return fsdp_wrap(layer, min_num_params=0)
        return fsdp_wrap(layer, min_num_params=getattr(args, "min_params_to_wrap", 0))

    def max_positions(self):
        """ALiBi has no position table: the input length is not capped."""
        return UNBOUNDED_POSITIONS

    def buffered_future_mask(self, tensor):
        """Only a causal flag for the layers: the ALiBi bias carries the mask."""
        return tensor.new_zeros(())


@register_model("transformer_lm_alibi", dataclass=AlibiLanguageModelConfig)
class AlibiTransformerLanguageModel(stock.TransformerLanguageModel):
    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def build_model(cls, args, task):
        # Again here: the arch function runs before the dataclass defaults are
        # filled in, so with no --decoder-embed-dim it could not set these.
        _default_io_dims(args)
        train_length = getattr(args, "alibi_train_length", None)
        # Unset, or (when built from an argparse Namespace rather than the
        # hydra config) the dataclass default's unresolved "${task...}" string.
        if train_length in (None, "", 0) or str(train_length).startswith("${"):
            args.alibi_train_length = getattr(args, "tokens_per_sample", None)
        # Fail at build time, naming the field, rather than mid-forward.
        build_alibi_bias(args)
        with patches.decoder_class(stock, AlibiTransformerDecoder):
            return super().build_model(args, task)


def _default_io_dims(args) -> None:
    embed_dim = getattr(args, "decoder_embed_dim", None)
    if embed_dim is None:  # not given and not yet defaulted: build_model sets them
        return
    for name in ("decoder_input_dim", "decoder_output_dim"):
        if getattr(args, name, None) is None:
            setattr(args, name, embed_dim)


def _twin(stock_arch_fn):
    def alibi_arch(args):
        stock_arch_fn(args)
        _default_io_dims(args)
        args.no_token_positional_embeddings = True

    alibi_arch.__doc__ = f"ALiBi twin of {stock_arch_fn.__name__}."
    return alibi_arch


# Stock arch name -> its twin: "transformer_lm" -> "transformer_lm_alibi", and
# "transformer_lm_wiki103" -> "transformer_lm_wiki103_alibi" (the paper's model).
STOCK_ARCHS = sorted(
    name for name, model in ARCH_MODEL_NAME_REGISTRY.items() if model == "transformer_lm"
)
for _name in STOCK_ARCHS:
    _fn = _twin(ARCH_CONFIG_REGISTRY[_name])
    if _name == "transformer_lm":  # register_model already made this arch name
        ARCH_CONFIG_REGISTRY["transformer_lm_alibi"] = _fn
    else:
        register_model_architecture("transformer_lm_alibi", f"{_name}_alibi")(_fn)
