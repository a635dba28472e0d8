"""``--format bloom``: stock transformers' ``BloomForCausalLM``, no custom code.

BLOOM adds ALiBi as this package does (after ``q.k / sqrt(d)``, the paper's
slopes), so a fairseq LM shaped like BLOOM maps onto it weight for weight:
pre-norm layers, the embedding layer norm (BLOOM always applies
``word_embeddings_layernorm``), a final layer norm, tanh GELU
(``gelu_accurate``), FFN = 4 x d, no embedding scale, no input/output
projections, a plain embedding and output projection (tied or not).  The
``transformer_lm_bloom_alibi`` architecture trains such models.  Anything else
is refused in one line naming what BLOOM cannot hold.  BLOOM's config has no
context extension: apply it after loading (``fairseq_alibi.hf.apply_alibi_scaling``).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from ..errors import ExportError
from ..facts import bloom_shape_problems
from .custom import ReadWeights
from .neox import fuse_per_head

def bloom_problems(fields: dict, scaling) -> List[str]:
    """What BLOOM cannot hold of a decoder (``custom.describe``'s fields) under ``scaling``."""
    found = bloom_shape_problems(fields)
    if scaling.method != "none":
        found.append(f"context extension {scaling.spelling} (BLOOM's config has none: apply "
                     "fairseq_alibi.hf.apply_alibi_scaling after loading)")
    return found


def check_bloom(fields: dict, scaling) -> None:
    """One line naming every feature BLOOM cannot hold, pointing to the default format."""
    found = bloom_problems(fields, scaling)
    if found:
        raise ExportError(f"the BLOOM format cannot hold this model: {'; '.join(found)}; export it in the default "
                          "format (--format custom), which holds every transformer_lm_alibi variant")


def bloom_weights(weights: Dict[str, torch.Tensor], heads: int, layers: int) -> Dict[str, torch.Tensor]:
    """fairseq's weights (under the default format's names) as BLOOM's, with
    q, k and v fused per head as ``[q_h; k_h; v_h]`` blocks of head_dim rows."""
    out = {"transformer.word_embeddings.weight": weights["model.embed_tokens.weight"],
           "lm_head.weight": weights["lm_head.weight"]}
    norms = {"model.layernorm_embedding": "transformer.word_embeddings_layernorm", "model.layer_norm": "transformer.ln_f"}
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        norms.update({src + "self_attn_layer_norm": dst + "input_layernorm",
                      src + "final_layer_norm": dst + "post_attention_layernorm",
                      src + "self_attn.out_proj": dst + "self_attention.dense",
                      src + "fc1": dst + "mlp.dense_h_to_4h", src + "fc2": dst + "mlp.dense_4h_to_h"})
        for kind in ("weight", "bias"):
            q, k, v = (weights[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.query_key_value.{kind}"] = fuse_per_head(q, k, v, heads)
    for old, new in norms.items():
        for kind in ("weight", "bias"):
            out[f"{new}.{kind}"] = weights[f"{old}.{kind}"]
    return out


def build_bloom(fields: dict, weights: Dict[str, torch.Tensor], scaling):
    """The stock ``BloomForCausalLM`` holding the fairseq model (refusals first)."""
    from transformers import BloomConfig, BloomForCausalLM

    check_bloom(fields, scaling)
    config = BloomConfig(
        vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"], n_layer=fields["layers"],
        n_head=fields["attention_heads"], layer_norm_epsilon=fields["layer_norm_eps"],
        hidden_dropout=fields["dropout"], attention_dropout=fields["attention_dropout"],
        bos_token_id=fields["bos_token_id"], eos_token_id=fields["eos_token_id"],
        pad_token_id=fields["pad_token_id"], tie_word_embeddings=fields["tie_word_embeddings"],
        seq_length=fields["alibi_train_length"], architectures=["BloomForCausalLM"],
    )
    model = BloomForCausalLM(config).eval()
    weights = ReadWeights(weights)
    model.load_state_dict(bloom_weights(weights, fields["attention_heads"], fields["layers"]), strict=True)
    weights.check_all_read("BLOOM")
    return model
