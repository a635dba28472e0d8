"""``--format gpt-neox``: a rotary LM as stock transformers' ``GPTNeoXForCausalLM``, no custom code.

GPT-NeoX computes what a pre-norm ``transformer_lm_rotary`` computes, weight
for weight, once its parallel residual is off (``use_parallel_residual=False``):
LayerNorm before attention and before the FFN, a final LayerNorm, q, k and v
fused per head as ``[q_h; k_h; v_h]`` blocks (its ``view(..., H, 3 D)``), the
first ``rotary_ndims = int(head_dim x partial_rotary_factor)`` dimensions of
each head rotated with the same pairing (``k`` with ``k + r/2``, its
``rotate_half``), frequencies ``rope_theta ** (-2i / r)``, scores scaled by
``head_dim ** -0.5``.  fairseq's embedding scale (``sqrt(d)`` unless
``--no-scale-embedding``) is folded into the input embedding, which then
cannot be the output projection: such a model is written untied.

Context extension is transformers' own ``rope_parameters``
(:func:`neox_rope_parameters`): static ``linear`` and ``yarn`` are the same
definitions as ours; dynamic ``ntk`` is transformers' ``dynamic`` at factor 1
(reference length ``max_position_embeddings``, the training length); a static
``ntk:F`` is RoPE with the base ``rope_theta x F ** (r / (r - 2))``.  Dynamic
``linear`` and ``yarn`` have no transformers type: refused here (the default
format computes them).  What GPT-NeoX cannot hold is named in one line
(:func:`neox_shape_problems`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..core.configuration_alibi import neox_computes, neox_rope_parameters, partial_rotary_factor
from ..core.positions import NEOX, attention_entry, holding
from ..core.scaling import Scaling
from ..errors import ExportError
from ..facts import extras_no_stock_model_holds
from .custom import ReadWeights

#: transformers' ``hidden_act`` of each fairseq activation it computes alike.
NEOX_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_new", "gelu_fast": "gelu_new",
                    "tanh": "tanh", "linear": "linear", "relu_squared": "relu2"}


def rotary_settings(cfg, head_dim: int, position: str) -> tuple:
    """(base, rotated dimensions per head) of the config of a model of ``position``, a method
    GPT-NeoX holds (RoPE's params: ``rotary_base``, ``rotary_fraction``), as ``rotary.RotaryPositions`` takes them."""
    params = {p.name: getattr(cfg, p.name, p.default) for p in attention_entry(position).params}
    return float(params["rotary_base"]), int(head_dim * params["rotary_fraction"]) // 2 * 2


def neox_shape_problems(fields: dict, position: str, rotary_dim: Optional[int], scaling: Scaling) -> List[str]:
    """What GPT-NeoX cannot hold of a decoder (``custom.describe``'s fields)."""
    if NEOX not in attention_entry(position).exports:
        return [f"position method {position} (GPT-NeoX: {', '.join(holding(NEOX))})"]
    found = []
    if not fields["normalize_before"]:
        found.append("post-norm layers")
    if fields["layernorm_embedding"]:
        found.append("an embedding layer norm")
    if not fields["final_layer_norm"]:
        found.append("no final layer norm")
    if fields["activation_function"] not in NEOX_ACTIVATIONS:
        found.append(f"activation {fields['activation_function']}")
    found += extras_no_stock_model_holds(fields)
    head_dim = fields["hidden_size"] // fields["attention_heads"]
    if rotary_dim is not None and partial_rotary_factor(rotary_dim, head_dim) is None:
        found.append(f"{rotary_dim} rotated dimensions of {head_dim} (no partial_rotary_factor gives them)")
    if scaling.method in ("linear", "yarn") and scaling.dynamic:
        found.append(f"dynamic {scaling.method} scaling (transformers has static {scaling.method} only)")
    elif not neox_computes(scaling):
        found.append(f"{scaling.method} scaling (transformers has no rope_type for it)")
    return found


def check_neox(fields: dict, position: str, rotary_dim: Optional[int], scaling: Scaling) -> None:
    """One line naming everything GPT-NeoX cannot hold, pointing to the default format."""
    found = neox_shape_problems(fields, position, rotary_dim, scaling)
    if found:
        raise ExportError(f"the GPT-NeoX format cannot hold this model: {'; '.join(found)}; export it in the "
                          "default format (--format custom), which holds every model of this plugin")


#: fairseq module (default format's names, per layer) -> GPT-NeoX module.
LAYER_NAMES = {"self_attn_layer_norm": "input_layernorm", "final_layer_norm": "post_attention_layernorm",
               "self_attn.out_proj": "attention.dense", "fc1": "mlp.dense_h_to_4h", "fc2": "mlp.dense_4h_to_h"}


def fuse_per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q, k, v projections (weights or biases) fused as ``[q_h; k_h; v_h]`` blocks per head."""
    per_head = [t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(per_head, 1).reshape(-1, *q.shape[1:])


def split_per_head(fused: torch.Tensor, heads: int) -> List[torch.Tensor]:
    """The inverse of :func:`fuse_per_head`: ``[q, k, v]``."""
    blocks = fused.reshape(heads, 3, -1, *fused.shape[1:])
    return [blocks[:, i].reshape(-1, *fused.shape[1:]) for i in range(3)]


def neox_weights(weights: Dict[str, torch.Tensor], fields: dict) -> Dict[str, torch.Tensor]:
    """fairseq's weights (under the default format's names) as GPT-NeoX's; the
    embedding scale folded into the input embedding (float32, as fairseq multiplies)."""
    heads = fields["attention_heads"]
    out = {"gpt_neox.embed_in.weight": weights["model.embed_tokens.weight"].float() * fields["embed_scale"],
           "lm_head.weight": weights["lm_head.weight"],
           "gpt_neox.final_layer_norm.weight": weights["model.layer_norm.weight"],
           "gpt_neox.final_layer_norm.bias": weights["model.layer_norm.bias"]}
    for i in range(fields["layers"]):
        src, dst = f"model.layers.{i}.", f"gpt_neox.layers.{i}."
        for kind in ("weight", "bias"):
            for old, new in LAYER_NAMES.items():
                out[f"{dst}{new}.{kind}"] = weights[f"{src}{old}.{kind}"]
            q, k, v = (weights[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}attention.query_key_value.{kind}"] = fuse_per_head(q, k, v, heads)
    return out


def fairseq_weights_of_neox(state: Dict[str, torch.Tensor], fields: dict) -> Dict[str, torch.Tensor]:
    """A GPT-NeoX state dict back under fairseq's names (``decoder.``), the
    embedding scale divided out of the input embedding; the output projection
    its own tensor (``decoder.output_projection.weight``)."""
    heads, scale = fields["attention_heads"], fields["embed_scale"]
    out = {"decoder.embed_tokens.weight": state["gpt_neox.embed_in.weight"].float() / scale,
           "decoder.output_projection.weight": state["lm_head.weight"].float(),
           "decoder.layer_norm.weight": state["gpt_neox.final_layer_norm.weight"].float(),
           "decoder.layer_norm.bias": state["gpt_neox.final_layer_norm.bias"].float()}
    for i in range(fields["layers"]):
        src, dst = f"gpt_neox.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            for old, new in LAYER_NAMES.items():
                out[f"{dst}{old}.{kind}"] = state[f"{src}{new}.{kind}"].float()
            fused = state[f"{src}attention.query_key_value.{kind}"].float()
            for name, part in zip("qkv", split_per_head(fused, heads)):
                out[f"{dst}self_attn.{name}_proj.{kind}"] = part
    return out


def build_neox(fields: dict, weights: Dict[str, torch.Tensor], cfg, scaling: Scaling, position: str):
    """The stock ``GPTNeoXForCausalLM`` holding the fairseq model of ``position`` (refusals first)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    head_dim = fields["hidden_size"] // fields["attention_heads"]
    base, rotary_dim = rotary_settings(cfg, head_dim, position)
    check_neox(fields, position, rotary_dim, scaling)
    tied = fields["tie_word_embeddings"] and fields["embed_scale"] == 1.0
    config = GPTNeoXConfig(
        vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"], num_hidden_layers=fields["layers"],
        num_attention_heads=fields["attention_heads"], intermediate_size=fields["ffn_dim"],
        hidden_act=NEOX_ACTIVATIONS[fields["activation_function"]], layer_norm_eps=fields["layer_norm_eps"],
        max_position_embeddings=fields["alibi_train_length"] or 2048, use_parallel_residual=False,
        rope_parameters=neox_rope_parameters(scaling, base, rotary_dim, head_dim), attention_bias=True,
        hidden_dropout=fields["dropout"], attention_dropout=fields["attention_dropout"],
        tie_word_embeddings=tied, bos_token_id=fields["bos_token_id"], eos_token_id=fields["eos_token_id"],
        pad_token_id=fields["pad_token_id"], architectures=["GPTNeoXForCausalLM"],
    )
    model = GPTNeoXForCausalLM(config).eval()
    weights = ReadWeights(weights)
    mapped = neox_weights(weights, fields)
    weights.check_all_read("GPT-NeoX")
    if tied:
        mapped.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise ExportError(f"the GPT-NeoX model's weights do not match fairseq's (missing {sorted(missing)[:4]}, "
                          f"unexpected {sorted(unexpected)[:4]}): a bug, please report it")
    if tied:
        model.tie_weights()
    return model
