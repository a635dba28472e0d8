"""``transformer_lm_alibi``: fairseq's transformer LM with ALiBi instead of positions.

What changes against the stock model, and nothing else:

* the decoder has no position embeddings and no cap on its input length;
* every decoder self-attention is ``AlibiMultiheadAttention``, all layers sharing
  one causal ``AlibiBias`` (slopes scaled once per forward, one cached bias);
* three config fields choose the eval-time context extension and one the kernel.

Every stock ``transformer_lm*`` architecture gets an ``<arch>_alibi`` twin, and
``transformer_lm_bloom_alibi`` trains BLOOM's layer shape (``alibi-export-hf
--format bloom`` exports it to stock transformers' ``BloomForCausalLM``).
"""

from dataclasses import dataclass
from typing import Optional

from fairseq.distributed import fsdp_wrap
from fairseq.models import ARCH_CONFIG_REGISTRY, register_model, register_model_architecture
from fairseq.models import transformer_lm as stock
from fairseq.models.transformer import TransformerConfig, TransformerDecoder
from fairseq.modules import TransformerDecoderLayer
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.utils import safe_getattr
from omegaconf import II

from .. import patches
from .attention import AlibiMultiheadAttention
from ..core.bias import AlibiBias
from .. import facts
from ..errors import ConfigError
from .config import AlibiConfig, build_bias, option


@dataclass
class AlibiLanguageModelConfig(stock.TransformerLanguageModelConfig, AlibiConfig):
    alibi_train_length: Optional[int] = option(
        II("task.tokens_per_sample"), "the length the model was trained at (defaults to the task's "
        "tokens_per_sample when training; stored resolved in the checkpoint)")
    # Unset means "same as decoder_embed_dim": avoids the stock 512-wide default
    # that silently adds projections to smaller or larger models.
    decoder_input_dim: Optional[int] = option(None, "decoder input dimension (default: decoder_embed_dim)")
    decoder_output_dim: Optional[int] = option(None, "decoder output dimension (default: decoder_embed_dim)")


class AlibiDecoderLayer(TransformerDecoderLayer):
    """Stock decoder layer whose self-attention is ALiBi attention."""

    def __init__(self, args, alibi_bias: AlibiBias, kernel: str = "auto", no_encoder_attn=False):
        self.alibi, self.alibi_kernel = alibi_bias, kernel  # plain attributes, read by build_self_attention
        super().__init__(args, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, args, add_bias_kv=False, add_zero_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("ALiBi attention does not support bias_kv, zero_attn or cross_self_attention")
        return self_attention(self, embed_dim, cfg.decoder.attention_heads, cfg.attention_dropout)


def self_attention(layer, embed_dim: int, heads: int, dropout: float) -> AlibiMultiheadAttention:
    """The ALiBi self-attention of a stock layer that holds its stack's ``alibi``
    bias and ``alibi_kernel`` name (and fairseq's quant-noise settings)."""
    return AlibiMultiheadAttention(
        embed_dim, heads, layer.alibi, kernel=layer.alibi_kernel, dropout=dropout,
        q_noise=layer.quant_noise, qn_block_size=layer.quant_noise_block_size,
    )


def wrap_layer(layer, args):
    """fairseq's activation checkpointing and FSDP wrapping of one layer."""
    if getattr(args, "checkpoint_activations", False):
        layer = checkpoint_wrapper(layer, offload_to_cpu=getattr(args, "offload_activations", False))
        return fsdp_wrap(layer, min_num_params=0)
    return fsdp_wrap(layer, min_num_params=getattr(args, "min_params_to_wrap", 0))


class AlibiTransformerDecoder(TransformerDecoder):
    """Stock decoder without position embeddings, built from ALiBi layers."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        args.no_token_positional_embeddings = True
        self.alibi = build_bias(args, args.decoder_attention_heads)  # before the layers are built
        self.alibi_kernel = getattr(args, "alibi_attention", "auto")
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)

    def build_decoder_layer(self, args, no_encoder_attn=False):
        return wrap_layer(AlibiDecoderLayer(args, self.alibi, self.alibi_kernel, no_encoder_attn), args)

    def max_positions(self):
        """ALiBi has no position table: the input length is not capped."""
        return facts.UNBOUNDED_POSITIONS

    def buffered_future_mask(self, tensor):
        """Only a causal flag for the layers: the ALiBi bias carries the mask."""
        return tensor.new_zeros(())


@register_model(facts.ALIBI_LM, dataclass=AlibiLanguageModelConfig)
class AlibiTransformerLanguageModel(stock.TransformerLanguageModel):
    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def build_model(cls, args, task):
        # Again here: the arch function runs before the dataclass defaults are
        # filled in, so with no --decoder-embed-dim it could not set these.
        _default_io_dims(args)
        facts.resolve_train_length(args, task)
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


# "transformer_lm" -> "transformer_lm_alibi", "transformer_lm_wiki103" ->
# "transformer_lm_wiki103_alibi" (the paper's model), ...
for _name in facts.stock_archs(facts.STOCK_LM):
    _fn = _twin(ARCH_CONFIG_REGISTRY[_name])
    if _name == facts.STOCK_LM:  # register_model already made this arch name
        ARCH_CONFIG_REGISTRY[facts.ALIBI_LM] = _fn
    else:
        register_model_architecture(facts.ALIBI_LM, facts.twin_name(_name))(_fn)


#: The BLOOM-shaped preset.
BLOOM_ARCH = "transformer_lm_bloom_alibi"


@register_model_architecture(facts.ALIBI_LM, BLOOM_ARCH)
def transformer_lm_bloom_alibi(args):
    """BLOOM's layer shape (``facts.bloom_shape_problems``): pre-norm, embedding
    layer norm, tanh GELU (``gelu_accurate``), FFN = 4 x d, no embedding scale,
    no input/output projections; sizes as ``transformer_lm_alibi`` (d=512, 6
    layers, 8 heads).  A given option that breaks the shape is refused (one line)."""
    for flag in ("decoder_normalize_before", "layernorm_embedding", "no_scale_embedding"):
        setattr(args, flag, True)
    args.activation_fn = safe_getattr(args, "activation_fn", facts.BLOOM_ACTIVATIONS[0])
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 512)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 4 * args.decoder_embed_dim)
    ARCH_CONFIG_REGISTRY[facts.ALIBI_LM](args)
    dim = args.decoder_embed_dim
    broken = facts.bloom_shape_problems(dict(
        normalize_before=True, layernorm_embedding=True, embed_scale=1.0, embed_quant_noise=False, unk_aliases=0,
        final_layer_norm=not safe_getattr(args, "no_decoder_final_norm", False),
        activation_function=args.activation_fn, ffn_dim=args.decoder_ffn_embed_dim, hidden_size=dim,
        project_in=args.decoder_input_dim != dim, project_out=args.decoder_output_dim != dim,
        adaptive_input=safe_getattr(args, "adaptive_input", False),
        adaptive_softmax=safe_getattr(args, "adaptive_softmax_cutoff", None) is not None,
        **{name: safe_getattr(args, name, False) for name in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")},
    ))
    if broken:
        raise ConfigError(f"--arch {BLOOM_ARCH} has BLOOM's shape (gelu_accurate, FFN = 4 x d = {4 * dim}, "
                          f"input/output dims = d, final norm, no adaptive input/softmax); this model has "
                          f"{'; '.join(broken)}: use --arch transformer_lm_alibi for other shapes")
