"""``transformer_lm_alibi`` and its siblings: fairseq's transformer LM with
another position method instead of sinusoidal embeddings.

What changes against the stock model, and nothing else:

* the decoder has no position embeddings and no cap on its input length;
* every decoder self-attention is ``PositionMultiheadAttention``, all layers
  sharing one position object of ``core/positions.py`` (ALiBi's causal bias;
  a learned bias built once per forward; the causal mask with rotated queries
  and keys; or nothing but the mask);
* config fields choose the eval-time context extension (``alibi_*``: the one
  scaling spec of every position method), the kernel, and the position
  method's own parameters.

``PositionTransformerLanguageModel.build_model`` builds the stock embeddings
(plain, adaptive input or character) and ``PositionTransformerDecoder`` itself,
in the stock builder's order: the same seed gives the same weights, and the
state dict has the stock model's keys, less the position table.

``transformer_lm_alibi``: every stock ``transformer_lm*`` architecture gets an
``<arch>_alibi`` twin, and ``transformer_lm_bloom_alibi`` trains BLOOM's layer
shape (``alibi-export-hf --format bloom`` exports it to stock transformers'
``BloomForCausalLM``).  Every other entry of ``core.positions.POSITIONS`` is a
model ``transformer_lm_<name>`` (one architecture of the same name, the stock
``transformer_lm`` sizes) whose config adds the entry's ``params``.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from fairseq.distributed import fsdp_wrap
from fairseq.logging import metrics
from fairseq.models import ARCH_CONFIG_REGISTRY, MODEL_REGISTRY, register_model, register_model_architecture
from fairseq.models import transformer_lm as stock
from fairseq.models.transformer import TransformerConfig, TransformerDecoder
from fairseq.modules import TransformerDecoderLayer
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.utils import safe_getattr
import torch
from omegaconf import II

from .. import facts
from ..core import positions as P
from ..core.bias import StackBias
from ..errors import ConfigError
from .attention import PositionMultiheadAttention, attach_shared
from .config import AlibiConfig, option, scaling_from_config
from .embeddings import check_tied_adaptive, input_embedding


@dataclass
class PositionLanguageModelConfig(stock.TransformerLanguageModelConfig, AlibiConfig):
    """The stock LM's config, plus the fields every position method shares
    (``alibi_*``: the scaling spec, the kernel, the training length)."""

    alibi_train_length: Optional[int] = option(
        II("task.tokens_per_sample"), "the length the model was trained at (defaults to the task's "
        "tokens_per_sample when training; stored resolved in the checkpoint)")
    # Unset means "same as decoder_embed_dim": avoids the stock 512-wide default
    # that silently adds projections to smaller or larger models.
    decoder_input_dim: Optional[int] = option(None, "decoder input dimension (default: decoder_embed_dim)")
    decoder_output_dim: Optional[int] = option(None, "decoder output dimension (default: decoder_embed_dim)")
    ssmax: bool = option(False, "scalable softmax (SSMax, Nakanishi 2025): each query's logits times s_h ln n, n "
                         "the keys it sees, s_h learned per head and layer (initialized to 1 / ln "
                         "alibi_train_length); any position method with a softmax (not stickbreaking)")


class PositionDecoderLayer(TransformerDecoderLayer):
    """Stock decoder layer whose self-attention reads the stack's position object."""

    def __init__(self, args, positions: StackBias, kernel: str = "auto", no_encoder_attn=False,
                 ssmax_length: Optional[int] = None, layer_index: Optional[int] = None):
        attach_shared(self, "positions", positions)  # the stack's, read by build_self_attention
        self.layer_index = layer_index  # its place in the stack (core.layer.wire: a hybrid chooses by it)
        self.alibi_kernel = kernel
        self.ssmax_length = ssmax_length  # --ssmax: SSMax's scales, initialized from this training length
        super().__init__(args, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, args, add_bias_kv=False, add_zero_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("position attention does not support bias_kv, zero_attn or cross_self_attention")
        return self_attention(self, embed_dim, cfg.decoder.attention_heads, cfg.attention_dropout)


def self_attention(layer, embed_dim: int, heads: int, dropout: float) -> PositionMultiheadAttention:
    """The self-attention of a stock layer that holds its stack's ``positions``
    object and ``alibi_kernel`` name (and fairseq's quant-noise settings);
    SSMax's scales where the layer has an ``ssmax_length`` (``--ssmax``)."""
    return PositionMultiheadAttention(
        embed_dim, heads, layer.positions, kernel=layer.alibi_kernel, dropout=dropout,
        q_noise=layer.quant_noise, qn_block_size=layer.quant_noise_block_size,
        ssmax_length=getattr(layer, "ssmax_length", None), layer_index=getattr(layer, "layer_index", None),
    )


def wrap_layer(layer, args):
    """fairseq's activation checkpointing and FSDP wrapping of one layer."""
    if getattr(args, "checkpoint_activations", False):
        layer = checkpoint_wrapper(layer, offload_to_cpu=getattr(args, "offload_activations", False))
        return fsdp_wrap(layer, min_num_params=0)
    return fsdp_wrap(layer, min_num_params=getattr(args, "min_params_to_wrap", 0))


class PositionTransformerDecoder(TransformerDecoder):
    """Stock decoder without position embeddings, its layers sharing the
    position object of ``position`` (a ``core.positions`` name)."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None,
                 position: str = "alibi"):
        args.no_token_positional_embeddings = True
        positions = build_positions(args, position)
        if getattr(args, "checkpoint_activations", False):  # each layer reruns its forward in its own backward
            positions.share_graphs = False
        attach_shared(self, "positions", positions)  # before the layers are built (and Module.__init__)
        self.alibi_kernel = getattr(args, "alibi_attention", "auto")
        # the layers are built from a TransformerConfig, which drops the plugin's fields: read --ssmax here
        self.ssmax_length = safe_getattr(args, "alibi_train_length", None) if safe_getattr(args, "ssmax", False) \
            else None
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)
        if isinstance(positions, torch.nn.Module):  # learned: the stack's submodule, trained and saved once
            del self.__dict__["positions"]
            self.positions = positions

    def build_decoder_layer(self, args, no_encoder_attn=False):
        index = self.__dict__.get("_layers_built", 0)  # fairseq builds the layers in order, 0 first
        self.__dict__["_layers_built"] = index + 1
        layer = PositionDecoderLayer(args, self.positions, self.alibi_kernel, no_encoder_attn, self.ssmax_length,
                                     layer_index=index)  # its object: core.layer.wire, as the exported model's
        return wrap_layer(layer, args)

    def extract_features_scriptable(self, prev_output_tokens, *args, **kwargs):
        self.positions.start_pass()  # a learned bias is built once per pass, for every layer
        if self.training:  # in fairseq-train's log of each update (FIRE's learned threshold: which path it trains)
            for name, value in self.positions.logged_scalars().items():
                metrics.log_scalar(name, value, round=4)
        return super().extract_features_scriptable(prev_output_tokens, *args, **kwargs)

    def max_positions(self):
        """No position table: the input length is not capped."""
        return facts.UNBOUNDED_POSITIONS

    def buffered_future_mask(self, tensor):
        """Only a causal flag for the layers: the position object carries the mask."""
        return tensor.new_zeros(())


def build_positions(args, position: str) -> StackBias:
    """The position object of a decoder stack from its config: the scaling spec
    (``alibi_*`` fields, checked against the methods that apply) and the
    position method's own parameters, checked with the stack's depth."""
    entry = P.position(position)
    problem = P.ssmax_problem(position, bool(safe_getattr(args, "ssmax", False)))
    if problem:
        raise ConfigError(problem)
    heads = args.decoder_attention_heads
    params = {p.name: getattr(args, p.name, p.default) for p in entry.params}
    return P.build(position, heads, args.decoder_embed_dim // heads, params, scaling_from_config(args),
                   args.decoder_layers)


@register_model(facts.ALIBI_LM, dataclass=PositionLanguageModelConfig)
class PositionTransformerLanguageModel(stock.TransformerLanguageModel):
    """fairseq's transformer LM whose decoder is a ``PositionTransformerDecoder``
    of :attr:`position`: ``transformer_lm_alibi`` itself, and the base of every
    other position method's model (``_position_model``)."""

    #: The ``core.positions`` method of this model's decoder.
    position = "alibi"

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def build_model(cls, args, task):
        """The stock LM's embeddings (plain, adaptive input or character) and
        this model's decoder, built in the stock builder's order (so a seed
        gives the stock builder's weights)."""
        # Again here: the arch function runs before the dataclass defaults are
        # filled in, so with no --decoder-embed-dim it could not set these.
        _default_io_dims(args)
        facts.resolve_train_length(args, task)
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", stock.DEFAULT_MAX_TARGET_POSITIONS)
        embed_tokens = input_embedding(args, task.source_dictionary, cls.build_embedding)
        check_tied_adaptive(args)
        decoder = PositionTransformerDecoder(args, task.target_dictionary, embed_tokens, no_encoder_attn=True,
                                             position=cls.position)
        return cls(decoder)


#: The names these classes had while ALiBi was the only method: checkpoints'
#: users and scripts import them.
AlibiTransformerLanguageModel = PositionTransformerLanguageModel
AlibiLanguageModelConfig = PositionLanguageModelConfig


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
        ssmax=safe_getattr(args, "ssmax", False),
        **{name: safe_getattr(args, name, False) for name in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")},
    ))
    if broken:
        raise ConfigError(f"--arch {BLOOM_ARCH} has BLOOM's shape (gelu_accurate, FFN = 4 x d = {4 * dim}, "
                          f"input/output dims = d, final norm, no adaptive input/softmax); this model has "
                          f"{'; '.join(broken)}: use --arch transformer_lm_alibi for other shapes")


# ----------------------------------------------------------------- the other position methods
def _position_model(entry: P.Position):
    """Register ``transformer_lm_<name>``: the shared config
    (``PositionLanguageModelConfig``) plus the entry's parameters, its decoder built with that position method, and one
    architecture of the same name (the stock ``transformer_lm`` sizes).  ALiBi's, registered above with its twins of
    every stock architecture, is left as it is."""
    name = facts.position_model(entry.name)
    if name in MODEL_REGISTRY:
        return
    fields = [(p.name, type(p.default), option(p.default, p.help)) for p in entry.params]
    config = dataclasses.make_dataclass(f"{entry.name.capitalize()}LanguageModelConfig", fields,
                                        bases=(PositionLanguageModelConfig,))
    model = type(f"{entry.name.capitalize()}TransformerLanguageModel", (PositionTransformerLanguageModel,),
                 {"position": entry.name, "__doc__": f"fairseq's transformer LM with {entry.summary}."})
    register_model(name, dataclass=config)(model)
    ARCH_CONFIG_REGISTRY[name] = _twin(ARCH_CONFIG_REGISTRY[facts.STOCK_LM])  # register_model made the arch name


P.on_register(_position_model)  # every entry's model: now, and for a method registered later (positions.register)
