"""The default format: this package's ``AlibiForCausalLM``, exact for every
``transformer_lm_alibi`` variant and every other position method's LM
(``transformer_lm_<method>``, fairseq's stock sinusoidal ``transformer_lm``).
Its modules carry fairseq's names, so the weights only change prefix
(``decoder.`` -> ``model.``; the output projection or adaptive softmax ->
``lm_head.``; a learned bias stays ``positions.``); the config is read off the
*built* fairseq decoder, not re-derived from flags."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, FrozenSet, Set

from ..core.configuration_alibi import AlibiLMConfig, rope_parameters_of
from ..core.positions import POSITIONS, ROPE_PARAMETERS, attention_entry
from ..errors import ExportError, plural
from ..core.modeling_alibi import ACTIVATIONS, AlibiForCausalLM

#: ``auto_map`` of every exported model: the classes of the files that travel with it.
AUTO_MAP = {
    "AutoConfig": "configuration_alibi.AlibiLMConfig",
    "AutoModel": "modeling_alibi.AlibiLMModel",
    "AutoModelForCausalLM": "modeling_alibi.AlibiForCausalLM",
}
#: fairseq buffers that hold no weights (version stamps, dtype carriers).
NOT_WEIGHTS = ("._float_tensor", ".version")
RENAMES = (("decoder.adaptive_softmax.", "lm_head."), ("decoder.output_projection.", "lm_head."), ("decoder.", "model."))


def hf_name(name: str) -> str:
    """The exported model's name of a fairseq parameter."""
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    raise ExportError(f"unexpected weight {name!r} in the fairseq model: not a transformer_lm decoder")


def hf_weights(model) -> Dict[str, object]:
    """The fairseq model's state dict under the exported model's names."""
    return {hf_name(name): tensor for name, tensor in model.state_dict().items() if not name.endswith(NOT_WEIGHTS)}


class ReadWeights(dict):
    """:func:`hf_weights` that notes each name read: a stock format's mapping
    that leaves one unread has no place for part of the model
    (:meth:`check_all_read`), which its load would not notice."""

    def __init__(self, weights):
        super().__init__(weights)
        self.read = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def check_all_read(self, fmt: str) -> None:
        left = sorted(set(self) - self.read)
        if left:
            raise ExportError(f"the {fmt} format has no place for {len(left)} {plural(len(left), 'weight')} "
                              "of this model "
                              f"({', '.join(left[:4])}); export it in the default format (--format custom)")


def refuse_unmappable(cfg) -> None:
    """One line for the fairseq options no Hugging Face layer here reproduces."""
    if getattr(cfg, "rotary_alibi_heads", 0):
        raise ExportError("a rotary model with ALiBi heads (--rotary-alibi-heads, a diagnostic) cannot be exported: "
                          "neither GPT-NeoX nor this plugin's Hugging Face model holds the heads' bias")
    activation = cfg.activation_fn
    if activation not in ACTIVATIONS:
        raise ExportError(f"activation_fn {activation!r} cannot be exported (supported: {', '.join(ACTIVATIONS)}; "
                          "fairseq 0.12's swish does not run)")
    if getattr(cfg, "character_embeddings", False):
        raise ExportError("character embeddings (--character-embeddings) cannot be exported")
    if getattr(cfg, "base_layers", 0):
        raise ExportError("BASE layers (--base-layers) cannot be exported")
    if getattr(cfg, "decoder_learned_pos", False) and not getattr(cfg, "no_token_positional_embeddings", False):
        raise ExportError("learned position embeddings (--decoder-learned-pos) cannot be exported; the stock "
                          "transformer_lm is exported with its sinusoidal embeddings")


def position_fields(source) -> dict:
    """``AlibiLMConfig``'s position fields of ``source``: the method, its
    parameters (a rotary model's in ``rope_parameters``) and its context extension."""
    cfg, position, scaling = source.cfg.model, source.position, source.scaling
    if position not in POSITIONS:  # fairseq's stock transformer_lm
        return dict(position_method=position)
    entry = POSITIONS[position]
    params = {p.name: getattr(cfg, p.name, p.default) for p in entry.params}
    if entry.scaling_key == ROPE_PARAMETERS:
        return dict(position_method=position,
                    rope_parameters=rope_parameters_of(scaling, params["rotary_base"], params["rotary_fraction"]))
    # ALiBi's own methods, or a logit method (logn) on any other position method; None: as trained
    return dict(position_method=position, position_params=params or None, alibi_scaling=scaling.to_hf())


def adaptive_specs(decoder, cfg):
    """(adaptive_input, adaptive_softmax) config entries, None where absent."""
    from fairseq.modules import AdaptiveInput

    embed, softmax = decoder.embed_tokens, decoder.adaptive_softmax
    adaptive_input = None
    if isinstance(embed, AdaptiveInput):
        adaptive_input = {"cutoff": list(embed.cutoff), "factor": float(cfg.adaptive_input_factor),
                          "initial_dim": int(embed.embeddings[0][0].embedding_dim)}
    adaptive_softmax = None
    if softmax is not None:
        adaptive_softmax = {"cutoff": list(softmax.cutoff), "factor": float(softmax.factor),
                            "dropout": float(softmax.dropout_module.p),
                            "tie_weights": bool(cfg.tie_adaptive_weights), "tie_proj": bool(cfg.tie_adaptive_proj)}
    return adaptive_input, adaptive_softmax


def describe(source) -> dict:
    """``AlibiLMConfig`` fields of the built fairseq model."""
    cfg, decoder, dictionary = source.cfg.model, source.model.decoder, source.dictionary
    refuse_unmappable(cfg)
    layer = decoder.layers[0]
    adaptive_input, adaptive_softmax = adaptive_specs(decoder, cfg)
    tied = bool(cfg.tie_adaptive_weights) if adaptive_softmax else bool(decoder.share_input_output_embed)
    return dict(
        vocab_size=len(dictionary), hidden_size=decoder.embed_dim, layers=len(decoder.layers),
        attention_heads=layer.self_attn.num_heads, ffn_dim=layer.fc1.out_features,
        input_embed_dim=decoder.embed_tokens.embedding_dim, output_embed_dim=decoder.output_embed_dim,
        project_in=decoder.project_in_dim is not None, project_out=decoder.project_out_dim is not None,
        embed_scale=float(decoder.embed_scale), embed_quant_noise=decoder.quant_noise is not None,
        layernorm_embedding=decoder.layernorm_embedding is not None, normalize_before=bool(layer.normalize_before),
        final_layer_norm=decoder.layer_norm is not None, activation_function=cfg.activation_fn,
        layer_norm_eps=float(layer.self_attn_layer_norm.eps),
        scale_attn=layer.attn_ln is not None, scale_fc=layer.ffn_layernorm is not None,
        scale_heads=layer.c_attn is not None, scale_resids=layer.w_resid is not None,
        dropout=float(decoder.dropout_module.p), attention_dropout=float(layer.self_attn.dropout_module.p),
        activation_dropout=float(layer.activation_dropout_module.p),
        adaptive_input=adaptive_input, adaptive_softmax=adaptive_softmax, tie_word_embeddings=tied,
        alibi_train_length=source.train_length, alibi_attention=str(getattr(cfg, "alibi_attention", "auto")),
        ssmax=bool(getattr(cfg, "ssmax", False)), use_cache=attention_entry(source.position).kv_cache,
        pad_token_id=dictionary.pad(), bos_token_id=source.start, eos_token_id=dictionary.eos(),
        unk_token_id=dictionary.unk(), unk_aliases=source.unk_aliases,
    )


def shared_groups(model, rename: Callable[[str], str]) -> Set[FrozenSet[str]]:
    """Sets of (renamed) parameter names that are one tensor."""
    groups = defaultdict(set)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups[id(parameter)].add(rename(name))
    return {frozenset(names) for names in groups.values() if len(names) > 1}


def build_custom(source, scaling) -> AlibiForCausalLM:
    """The exported model, weights loaded, ties checked against fairseq's."""
    from dataclasses import replace

    fields = position_fields(replace(source, scaling=scaling))
    config = AlibiLMConfig(**describe(source), **fields, architectures=["AlibiForCausalLM"], auto_map=dict(AUTO_MAP))
    model = AlibiForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(hf_weights(source.model), strict=False)
    if missing or unexpected:
        raise ExportError(f"the exported model's weights do not match fairseq's (missing {sorted(missing)[:4]}, "
                          f"unexpected {sorted(unexpected)[:4]}): a bug, please report it")
    if shared_groups(model, str) != shared_groups(source.model, hf_name):
        raise ExportError("the exported model ties other weights than the fairseq model: a bug, please report it")
    return model
