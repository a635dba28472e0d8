"""A fairseq ``transformer_lm_alibi`` decoder (or a sibling with another
position method) as a Hugging Face causal LM.

This file travels with every exported model (``alibi-export-hf``) together
with ``configuration_alibi.py`` and the maths modules it imports from beside
it: the ALiBi bias (``bias.AlibiBias``: slopes, context extension, caches) and
the attention kernels (``kernels.attend``: SDPA with one ``[1, H, T, S]`` bias
shared by the batch and the layers, the linear-memory chunked kernel for long
inputs) are this package's own code, not a copy.  Only torch and transformers
are imported besides.

Module and parameter names are fairseq's (``model.layers.0.self_attn.q_proj``
is ``decoder.layers.0.self_attn.q_proj``; ``lm_head`` is fairseq's output
projection or adaptive softmax), so an export renames prefixes and nothing
else, and every layer computes what fairseq's computes, in the same order:
pre- or post-norm layers, the embedding scale, the embedding layer norm,
input/output projections, fairseq's activations, NormFormer's extra scales,
adaptive input and adaptive softmax (whose ``logits`` are the full-vocabulary
log-probabilities fairseq's ``get_log_prob`` gives).

Position methods: ``config.position_method`` names an entry of
``positions.POSITIONS`` (ALiBi by default; rotary, T5 bias, Kerple, FIRE,
NoPE, FoX, RNoPE-SWA), whose stack object the fairseq decoder builds too: the
same bias or rotation, computed by the same code; a learned one (T5, Kerple,
FIRE) is the decoder's submodule ``positions``, named as fairseq names it.
Each layer takes its own object from the stack as fairseq's layers do
(``at_layer``: a hybrid's windowed RoPE or NoPE layer; ``for_layer``: FoX's
gate, ``self_attn.forget_gate``), and ``config.ssmax`` adds SSMax's learned
scales (``self_attn.ssmax.scale``).  FoX has no KV cache here (refused in one
line; ``use_cache`` is false in its config).

Padding: a 2-D ``attention_mask`` marks padded keys; ALiBi depends on ``i - j``
only, so a left-padded row scores as its unpadded run, and with dynamic
scaling each row's factor comes from its own number of keys.  The KV cache is
transformers' (``DynamicCache``, or ``StaticCache``, whose empty slots are cut
off; ``generate()`` keeps the 2-D mask for it, see ``create_masks_for_generate``);
with a static factor incremental decoding equals the full forward, with
dynamic scaling cached keys keep the slopes they were computed with (as in
fairseq; warned once past the training length).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .scaling import Scaling
from .bias import StackBias
from .configuration_alibi import refuse_model_arguments
from .configuration_alibi import AlibiLMConfig, scaling_of_rope
from .positions import SINUSOIDAL, attention_entry
from .positions import build as build_positions
from .errors import InputError
from .layer import attention, bind_call, wire
from .ssmax import ScalableSoftmax


def gelu_accurate(x: Tensor) -> Tensor:
    """fairseq's ``gelu_accurate`` (tanh approximation), term for term."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


#: fairseq's ``--activation-fn`` values (``swish`` is broken in fairseq 0.12 itself).
ACTIVATIONS = {
    "relu": F.relu,
    "relu_squared": lambda x: F.relu(x).pow(2),
    "gelu": lambda x: F.gelu(x.float()).type_as(x),
    "gelu_accurate": gelu_accurate,
    "gelu_fast": gelu_accurate,
    "tanh": torch.tanh,
    "linear": lambda x: x,
}


def sinusoidal_table(rows: int, dim: int, padding_idx: int, device=None) -> Tensor:
    """fairseq's ``SinusoidalPositionalEmbedding`` table (stock ``transformer_lm``):
    row ``p`` is ``[sin(p w_i), cos(p w_i)]`` with ``w_i = exp(-i ln(10000) / (d/2 - 1))``,
    a zero column for an odd ``dim``, the row ``padding_idx`` zero; float32, as
    fairseq computes it (row ``p`` does not depend on ``rows``)."""
    half = dim // 2
    rate = torch.exp(torch.arange(half, dtype=torch.float, device=device) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float, device=device)[:, None] * rate[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(rows, -1)
    if dim % 2:
        table = torch.cat([table, table.new_zeros(rows, 1)], dim=1)
    table[padding_idx] = 0
    return table


def token_positions(attention_mask: Optional[Tensor], batch: int, past: int, length: int, padding_idx: int,
                    device) -> Tensor:
    """``[B, length]`` positions of the new tokens as fairseq's ``make_positions``
    numbers them: ``padding_idx + 1`` for a row's first real token, counting real
    tokens only, ``padding_idx`` at padding (so a left-padded row is numbered as
    its unpadded run)."""
    if attention_mask is None:
        return torch.arange(past, past + length, device=device).expand(batch, -1) + padding_idx + 1
    real = attention_mask.ne(0).long()
    return ((torch.cumsum(real, dim=1) * real) + padding_idx)[:, past:]


class AttentionContext:
    """What every layer's attention needs for one forward pass: the cache, the
    padding mask, whether weights are asked for.  Each layer brings its own
    position object (``StackBias.at_layer``: a hybrid's layers differ; FoX's
    gates are a layer's own) and kernel."""

    def __init__(self, cache, past: int, pad: Optional[Tensor], need_weights: bool):
        self.cache, self.past, self.pad, self.need_weights = cache, past, pad, need_weights

    def bind_call(self, positions: StackBias, q: Tensor, k: Tensor, x: Tensor) -> Tuple[Tensor, Tensor, StackBias]:
        """``(q, k, bias)`` of this call of a layer whose input is ``x`` ``[B, T,
        C]`` (``layer.bind_call``, as fairseq's layer: the new queries and keys
        rotated before the cache stores the keys, the bias bound to the input).
        FoX has no KV cache here (``AlibiLMModel.forward`` refuses one), so
        nothing is carried."""
        new_pad = self.pad[:, self.past:] if self.pad is not None else None
        q, k, bound, _ = bind_call(positions, q, k, x.transpose(0, 1), self.past, new_pad)
        return q, k, bound

    def attend(self, positions: StackBias, kernel: str, q: Tensor, k: Tensor, v: Tensor, x: Tensor,
               dropout_p: float, ssmax: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        """``layer.attention`` of the layer's call (``x`` its input ``[B, T, C]``), as fairseq's layer calls it."""
        if self.need_weights and positions.own_kernel:
            raise InputError("output_attentions is not available for this model: its position method computes its "
                             "attention with its own kernel, which forms no attention weights; leave it out")
        return attention(positions, kernel, q, k, v, x.transpose(0, 1), self.past, self.pad, dropout_p,
                         self.need_weights, ssmax)


class AlibiSelfAttention(nn.Module):
    """fairseq's ``q_proj``/``k_proj``/``v_proj``/``out_proj`` around ``kernels.attend``."""

    def __init__(self, config: AlibiLMConfig, layer_idx: int, stack: StackBias):
        super().__init__()
        dim = config.hidden_size
        self.layer_idx, self.num_heads = layer_idx, config.attention_heads
        self.head_dim = dim // self.num_heads
        self.dropout = config.attention_dropout
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        # the stack's object (or a hybrid's choice for this layer), or this layer's own (FoX's gate)
        self.kernel = wire(self, stack, config.alibi_attention, config.attention_dropout, index=layer_idx)
        # SSMax's learned scales (``ssmax.py``), as fairseq's layer holds them
        self.ssmax = ScalableSoftmax(self.num_heads, config.alibi_train_length) if config.ssmax else None

    def forward(self, x: Tensor, context: AttentionContext) -> Tuple[Tensor, Optional[Tensor]]:
        batch, length, dim = x.shape

        def heads(y: Tensor) -> Tensor:  # [B, T, C] -> [B, H, T, D]
            return y.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k, positions = context.bind_call(self.positions, q, k, x)
        if context.cache is not None:
            k, v = context.cache.update(k, v, self.layer_idx)
            keys = context.past + length
            if k.size(2) < keys:
                raise InputError(
                    f"the cache returned {k.size(2)} keys for {context.past} cached + {length} new tokens: "
                    "use a DynamicCache (generate()'s default) or a StaticCache"
                )
            # a static cache returns all its slots, the empty ones after the filled ones
            k, v = k[:, :, :keys], v[:, :, :keys]
        out, weights = context.attend(positions, self.kernel, q, k, v, x, self.dropout if self.training else 0.0,
                                      None if self.ssmax is None else self.ssmax.scale)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, dim)), weights


class AlibiDecoderLayer(nn.Module):
    """fairseq's ``TransformerDecoderLayer`` without cross-attention, in its order of operations."""

    def __init__(self, config: AlibiLMConfig, layer_idx: int, stack: StackBias):
        super().__init__()
        dim, ffn, eps = config.hidden_size, config.ffn_dim, config.layer_norm_eps
        self.self_attn = AlibiSelfAttention(config, layer_idx, stack)
        self.self_attn_layer_norm = nn.LayerNorm(dim, eps=eps)
        self.attn_ln = nn.LayerNorm(dim, eps=eps) if config.scale_attn else None
        self.c_attn = nn.Parameter(torch.ones(config.attention_heads)) if config.scale_heads else None
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.ffn_layernorm = nn.LayerNorm(ffn, eps=eps) if config.scale_fc else None
        self.w_resid = nn.Parameter(torch.ones(dim)) if config.scale_resids else None
        self.final_layer_norm = nn.LayerNorm(dim, eps=eps)
        self.activation = ACTIVATIONS[config.activation_function]
        self.normalize_before = config.normalize_before
        self.dropout, self.activation_dropout = config.dropout, config.activation_dropout

    def forward(self, x: Tensor, context: AttentionContext) -> Tuple[Tensor, Optional[Tensor]]:
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, weights = self.self_attn(x, context)
        if self.c_attn is not None:  # NormFormer's head scales, on the projected output as in fairseq
            heads = self.c_attn.numel()
            x = (x.view(*x.shape[:2], heads, -1) * self.c_attn[:, None]).reshape(x.shape)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        x = residual + F.dropout(x, self.dropout, self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = F.dropout(self.activation(self.fc1(x)), self.activation_dropout, self.training)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = F.dropout(self.fc2(x), self.dropout, self.training)
        if self.w_resid is not None:
            residual = self.w_resid * residual
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, weights


def band_bounds(cutoff: List[int]) -> List[Tuple[int, int]]:
    """``[(0, c0), (c0, c1), ...]``: the id range of every band of an adaptive layer."""
    return list(zip([0] + list(cutoff[:-1]), cutoff))


def band_dim(spec: dict, band: int) -> int:
    """Width of band ``band`` of fairseq's adaptive input (``initial_dim // factor ** band``)."""
    return int(spec["initial_dim"] // (spec["factor"] ** band))


class AdaptiveInput(nn.Module):
    """fairseq's ``AdaptiveInput``: per band an embedding and a projection to ``hidden_size``."""

    def __init__(self, config: AlibiLMConfig):
        super().__init__()
        spec = config.adaptive_input
        self.cutoff, self.embedding_dim = list(spec["cutoff"]), config.hidden_size
        self.embeddings = nn.ModuleList(
            nn.Sequential(nn.Embedding(hi - lo, band_dim(spec, band), config.pad_token_id if band == 0 else None),
                          nn.Linear(band_dim(spec, band), config.hidden_size, bias=False))
            for band, (lo, hi) in enumerate(band_bounds(self.cutoff))
        )

    def forward(self, ids: Tensor) -> Tensor:
        weight = self.embeddings[0][1].weight
        out = weight.new_zeros(ids.shape + (self.embedding_dim,))
        for band, (lo, hi) in enumerate(band_bounds(self.cutoff)):
            inside = (ids >= lo) & (ids < hi)
            if inside.any():
                out[inside] = self.embeddings[band](ids[inside] - lo)
        return out


class TransposedLinear(nn.Module):
    """``x @ weight``: a projection that shares (transposed) an adaptive-input weight (``tie_proj``)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features).normal_(std=in_features ** -0.5))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.t())


class TiedHead(nn.Module):
    """fairseq's ``TiedHeadModule``: the head band scored with the input embedding, plus cluster logits."""

    def __init__(self, input_dim: int, words: int, word_dim: int, clusters: int):
        super().__init__()
        word = nn.Linear(word_dim, words, bias=False)
        self.word_proj = word if input_dim == word_dim else nn.Sequential(nn.Linear(input_dim, word_dim, bias=False), word)
        self.class_proj = nn.Linear(input_dim, clusters, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.word_proj(x), self.class_proj(x)], dim=-1)


class AdaptiveSoftmax(nn.Module):
    """fairseq's ``AdaptiveSoftmax``; ``forward`` returns its ``get_log_prob``:
    log-probabilities over the whole vocabulary (head band, then each tail
    cluster's words plus the cluster's log-prior)."""

    def __init__(self, config: AlibiLMConfig):
        super().__init__()
        spec, adaptive_input = config.adaptive_softmax, config.adaptive_input
        self.cutoff = list(spec["cutoff"])
        input_dim, tails = config.output_embed_dim, len(self.cutoff) - 1
        tied = bool(spec.get("tie_weights"))
        if tied:
            self.head = TiedHead(input_dim, self.cutoff[0], band_dim(adaptive_input, 0), tails)
        else:
            self.head = nn.Linear(input_dim, self.cutoff[0] + tails, bias=False)
        self.tail = nn.ModuleList()
        for i, (lo, hi) in enumerate(band_bounds(self.cutoff)[1:]):
            dim = band_dim(adaptive_input, i + 1) if tied else int(input_dim // spec["factor"] ** (i + 1))
            if tied and spec.get("tie_proj"):
                proj = TransposedLinear(config.hidden_size, dim)
            else:
                proj = nn.Linear(config.hidden_size if tied else input_dim, dim, bias=False)
            self.tail.append(nn.Sequential(proj, nn.Dropout(spec.get("dropout", 0.0)), nn.Linear(dim, hi - lo, bias=False)))

    def forward(self, hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, hidden.size(-1))
        head = torch.log_softmax(self.head(flat), dim=-1)
        words = self.cutoff[0]
        parts = [head[:, :words]]
        for i, tail in enumerate(self.tail):
            parts.append(torch.log_softmax(tail(flat), dim=-1) + head[:, words + i, None])
        return torch.cat(parts, dim=-1).view(*hidden.shape[:-1], self.cutoff[-1])


def tied_weights(config: AlibiLMConfig) -> Dict[str, str]:
    """``{target: source}`` of the parameters fairseq shares between input and output."""
    if not config.tie_word_embeddings:
        return {}
    spec = config.adaptive_softmax
    if spec is None:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    band = "model.embed_tokens.embeddings"
    word = "lm_head.head.word_proj" + ("" if config.output_embed_dim == band_dim(config.adaptive_input, 0) else ".1")
    ties = {f"{word}.weight": f"{band}.0.0.weight"}
    for i in range(len(spec["cutoff"]) - 1):
        ties[f"lm_head.tail.{i}.2.weight"] = f"{band}.{i + 1}.0.weight"
        if spec.get("tie_proj"):
            ties[f"lm_head.tail.{i}.0.weight"] = f"{band}.{i + 1}.1.weight"
    return ties


class AlibiPreTrainedModel(PreTrainedModel):
    config_class = AlibiLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["AlibiDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True  # attention always runs kernels.attend (SDPA or the chunked kernel)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AlibiDecoderLayer):
            with torch.no_grad():
                for scale in (module.c_attn, module.w_resid):
                    if scale is not None:
                        scale.fill_(1.0)


def key_padding(attention_mask: Optional[Tensor], batch: int, keys: int) -> Optional[Tensor]:
    """``[B, S]`` True at padded keys, or None (no mask, or nothing padded;
    under ``torch.compile`` whether anything is padded is not asked: a branch
    on the mask's values, and an all-False mask changes no score)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, keys):
        raise InputError(
            f"attention_mask must be 2-D [batch, cached + new tokens] = [{batch}, {keys}], "
            f"got shape {tuple(attention_mask.shape)}"
        )
    pad = attention_mask == 0
    return pad if torch.compiler.is_compiling() or bool(pad.any()) else None


class AlibiLMModel(AlibiPreTrainedModel):
    """The decoder: embeddings, layers, final norm and output projection to
    ``output_embed_dim`` (``last_hidden_state`` is what the output layer reads)."""

    def __init__(self, config: AlibiLMConfig, *args, **kwargs):
        refuse_model_arguments(config, args, kwargs)
        super().__init__(config)
        dim, eps = config.hidden_size, config.layer_norm_eps
        if config.adaptive_input:
            self.embed_tokens = AdaptiveInput(config)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.input_embed_dim, config.pad_token_id)
        self.quant_noise = nn.Linear(dim, dim, bias=False) if config.embed_quant_noise else None
        self.project_in_dim = nn.Linear(config.input_embed_dim, dim, bias=False) if config.project_in else None
        self.layernorm_embedding = nn.LayerNorm(dim, eps=eps) if config.layernorm_embedding else None
        # The scaling read by this file's siblings: transformers may load configuration_alibi.py a
        # second time, as another module, with its own alibi.Scaling class.  On the CPU: from_pretrained
        # builds models on the meta device, and the slopes and frequencies are data, not weights
        # (a learned bias's parameters are loaded into it as any weight).
        scaling = (scaling_of_rope(config.rope_parameters, config.alibi_train_length)
                   if config.rope_spelled() else
                   Scaling.from_hf(config.alibi_scaling, config.alibi_train_length))
        with torch.device("cpu"):
            method = attention_entry(config.position_method).name  # the stock model's: NoPE's attention
            positions = build_positions(method, config.attention_heads, dim // config.attention_heads,
                                        config.position_settings(), scaling, config.layers)
        if config.position_method == SINUSOIDAL:  # stock transformer_lm: positions added to the embedding
            self.sinusoidal_padding_idx = config.pad_token_id
        if isinstance(positions, nn.Module):
            self.positions = positions  # learned: weights model.positions.* (fairseq's decoder.positions.*)
        else:
            self.__dict__["positions"] = positions  # slopes or frequencies: no weights, not a submodule
        self.layers = nn.ModuleList(AlibiDecoderLayer(config, i, positions) for i in range(config.layers))
        self.layer_norm = nn.LayerNorm(dim, eps=eps) if config.final_layer_norm else None
        self.project_out_dim = nn.Linear(dim, config.output_embed_dim, bias=False) if config.project_out else None
        self.last_alibi_factor = None
        self.post_init()

    @property
    def alibi(self) -> StackBias:
        """The stack's position object (the name every release before the other methods used)."""
        return self.positions

    def position_objects(self) -> List[StackBias]:
        """Every distinct object a context extension rescales: the stack's, and a
        layer's own where it has one (FoX's gates; a hybrid's layers rescale
        through their stack)."""
        found = {id(self.positions): self.positions}
        for layer in self.layers:
            stack = layer.self_attn.positions.stack
            found.setdefault(id(stack), stack)
        return list(found.values())

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def set_alibi_scaling(self, value) -> None:
        """Context extension from the next forward on: a ``scaling.Scaling``,
        None, or the config's dict (``alibi_scaling`` for ALiBi,
        ``rope_parameters`` for rotary); the config follows.  A method the
        position method has not is refused in one line (``ScalingError``)."""
        config = self.config
        if isinstance(value, Scaling):
            scaling = value.for_model(config.alibi_train_length)
        elif config.rope_spelled():
            scaling = scaling_of_rope(value, config.alibi_train_length)
        else:
            scaling = Scaling.from_hf(value, config.alibi_train_length)
        for positions in self.position_objects():
            positions.rescale(scaling)
        config.set_scaling(scaling)

    def embed(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, past: int = 0) -> Tensor:
        """fairseq's order: scale, quant-noise projection, input projection,
        sinusoidal positions (stock ``transformer_lm`` only), layer norm, dropout."""
        if self.config.unk_aliases:
            input_ids = input_ids.masked_fill(input_ids >= self.config.vocab_size, self.config.unk_token_id)
        x = self.config.embed_scale * self.embed_tokens(input_ids)
        for module in (self.quant_noise, self.project_in_dim):
            if module is not None:
                x = module(x)
        if self.config.position_method == SINUSOIDAL:
            pad = self.config.pad_token_id
            positions = token_positions(attention_mask, *input_ids.shape[:1], past, input_ids.size(1), pad, x.device)
            table = sinusoidal_table(int(positions.max()) + 1, x.size(-1), pad, x.device)
            x = x + table[positions].to(x.dtype)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return F.dropout(x, self.config.dropout, self.training)

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                past_key_values=None, inputs_embeds=None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, **kwargs) -> BaseModelOutputWithPast:
        if input_ids is None or inputs_embeds is not None:
            raise InputError("this model takes input_ids (inputs_embeds is not supported)")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        method = self.config.position_method
        if not attention_entry(method).kv_cache and (use_cache or past_key_values is not None):
            raise InputError(f"an exported {method} model has no KV cache yet (its state is not keys and values "
                             "alone): call it with use_cache=False (generate(..., use_cache=False))")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        # an int: a StaticCache's length is a tensor that its update (layer 0's) increments in place
        past = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
        batch, length = input_ids.shape
        pad = key_padding(attention_mask, batch, past + length)
        self.positions.start_pass()  # a learned bias is built once per pass, for every layer
        context = AttentionContext(past_key_values, past, pad, bool(output_attentions))
        #: the factor of this pass (per row under dynamic scaling with padding: each row's own keys)
        self.last_alibi_factor = self.positions.scaling.factor_at(past + length if pad is None else (~pad).sum(-1))
        query_pad = pad[:, past:, None] if pad is not None else None
        x = self.embed(input_ids, attention_mask, past)
        states, attentions = [x], []
        for layer in self.layers:
            x, weights = layer(x, context)
            if query_pad is not None:  # a padded query sees no key: keep its NaN out of later layers
                x = x.masked_fill(query_pad, 0.0)
                weights = None if weights is None else weights.masked_fill(query_pad[:, None], 0.0)
            states.append(x)
            attentions.append(weights)
        for module in (self.layer_norm, self.project_out_dim):
            if module is not None:
                x = module(x)
        return BaseModelOutputWithPast(
            last_hidden_state=x,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )


class AlibiForCausalLM(AlibiPreTrainedModel, GenerationMixin):
    """The decoder and fairseq's output layer (``lm_head``: a linear projection or the adaptive softmax)."""

    def __init__(self, config: AlibiLMConfig, *args, **kwargs):
        refuse_model_arguments(config, args, kwargs)
        super().__init__(config)
        self.model = AlibiLMModel(config)
        if config.adaptive_softmax:
            self.lm_head = AdaptiveSoftmax(config)
        else:
            self.lm_head = nn.Linear(config.output_embed_dim, config.vocab_size, bias=False)
        self._tied_weights_keys = tied_weights(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def set_alibi_scaling(self, value) -> None:
        """``AlibiLMModel.set_alibi_scaling`` of the decoder."""
        self.model.set_alibi_scaling(value)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, past_key_values, **kwargs):
        """``generate()`` with a static cache would turn the 2-D mask into a 4-D
        causal one; this model reads padding from the 2-D mask and builds its own
        causal bias, so the mask stays as the tokenizer made it."""
        return attention_mask

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                past_key_values=None, inputs_embeds=None, labels: Optional[Tensor] = None,
                use_cache: Optional[bool] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                logits_to_keep: int = 0, **kwargs):
        out = self.model(input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                        hidden_states=out.hidden_states, attentions=out.attentions)
        return result if return_dict is not False else result.to_tuple()


__all__ = ["AlibiLMConfig", "AlibiLMModel", "AlibiForCausalLM"]
