"""Which Hugging Face model is this: the families, their slopes, position methods and training lengths.

BLOOM, MPT, Falcon with ``config.alibi=True`` (transformers 5.23), the models
``alibi-export-hf`` writes (family ``fairseq``, this package's
``modeling_alibi``, any position method), and GPT-NeoX (family ``gpt_neox``:
rotary, extended through transformers' own ``rope_parameters``; what
``alibi-export-hf --format gpt-neox`` writes, and Pythia-style hub models).
Imports transformers lazily and never fairseq.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core.alibi import get_slopes
from ..core.configuration_alibi import MODEL_TYPE
from ..errors import ConfigError, UnsupportedModelError

SUPPORTED_MODELS = (
    "BLOOM (BloomModel, BloomForCausalLM), MPT (MptModel, MptForCausalLM), "
    "Falcon with config.alibi=True (FalconModel, FalconForCausalLM), GPT-NeoX (GPTNeoXModel, "
    "GPTNeoXForCausalLM; rotary) and fairseq models exported by alibi-export-hf (AlibiLMModel, AlibiForCausalLM)"
)
#: The family of models written by ``alibi-export-hf`` (this package's ``modeling_alibi``).
EXPORTED = "fairseq"
#: Stock transformers' GPT-NeoX: rotary position embeddings, scaled through its ``rope_parameters``.
NEOX = "gpt_neox"


def _families():
    # Imported lazily: transformers is only needed by users of this module.
    from transformers.models.bloom.modeling_bloom import BloomModel
    from transformers.models.falcon.modeling_falcon import FalconModel
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXModel
    from transformers.models.mpt.modeling_mpt import MptModel

    return (("bloom", BloomModel), ("mpt", MptModel), ("falcon", FalconModel), (NEOX, GPTNeoXModel))


def _exported(base) -> bool:
    """A decoder of ``modeling_alibi`` (this package's, or its copy in a model directory)."""
    config = getattr(base, "config", None)
    return getattr(config, "model_type", None) == MODEL_TYPE and hasattr(base, "set_alibi_scaling")


def resolve(model) -> Tuple[str, torch.nn.Module]:
    """(family, base model) for a supported model, else ``UnsupportedModelError``."""
    base = getattr(model, "base_model", model)
    if _exported(base):
        return EXPORTED, base
    for family, cls in _families():
        if isinstance(base, cls):
            break
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}) is not a model whose positions this package "
            "scales; "
            f"supported: {SUPPORTED_MODELS}"
        )
    if family == "mpt" and not mpt_has_alibi(base.config):
        raise UnsupportedModelError(f"{type(model).__name__} has attn_config.alibi=False: {MPT_WITHOUT_ALIBI}; "
                                    f"supported: {SUPPORTED_MODELS}")
    if family == "falcon":
        if not base.config.alibi:
            raise UnsupportedModelError(
                f"{type(model).__name__} has config.alibi=False: this Falcon uses rotary "
                f"position embeddings, not ALiBi; supported: {SUPPORTED_MODELS}"
            )
        impl = base.config._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise UnsupportedModelError(
                f"Falcon with attn_implementation={impl!r} cannot take an ALiBi bias "
                "(transformers' flash-attention path refuses alibi); load the model with "
                "attn_implementation='sdpa' or 'eager'"
            )
    return family, base


#: Why an MPT config without ALiBi is refused.
MPT_WITHOUT_ALIBI = ("this MPT was trained without ALiBi (learned or rotary positions), which transformers' MPT "
                     "ignores: it adds ALiBi regardless, so no number of it would be the trained model's")


def mpt_has_alibi(config) -> bool:
    """Whether an MPT config trains with ALiBi (``attn_config.alibi``, True by default)."""
    attn = getattr(config, "attn_config", None)
    alibi = attn.get("alibi", True) if isinstance(attn, dict) else getattr(attn, "alibi", True)
    return alibi is not False


def config_family(config) -> str:
    """The family :func:`resolve` would find, read from a model's config alone
    (before its weights are loaded), else ``UnsupportedModelError``."""
    model_type = getattr(config, "model_type", None)
    if model_type == MODEL_TYPE:
        return EXPORTED
    if model_type in ("bloom", NEOX) or (model_type == "falcon" and getattr(config, "alibi", False)) or (
            model_type == "mpt" and mpt_has_alibi(config)):
        return model_type
    why = ("config.alibi=False: this Falcon uses rotary position embeddings, not ALiBi" if model_type == "falcon"
           else f"attn_config.alibi=False: {MPT_WITHOUT_ALIBI}" if model_type == "mpt"
           else f"model_type {model_type!r} is not a model whose positions this package scales")
    raise UnsupportedModelError(f"{why}; supported: {SUPPORTED_MODELS}")


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8) -> torch.Tensor:
    """MPT's slopes with bias maximum ``b``, as float32 ``[H]``.

    MPT defines ``2^(-b k / P)`` (``P`` the power of two >= H) interleaved for
    other head counts the same way as the paper, which makes every slope the
    paper's (``b = 8``) raised to ``b / 8``.  MPT's own model always passes
    ``b = 8``, ignoring ``attn_config.alibi_bias_max``; this honours it.
    """
    if not alibi_bias_max > 0:
        raise ConfigError(f"alibi_bias_max={alibi_bias_max!r} is not valid; it must be a number > 0")
    paper = get_slopes(num_heads).to(torch.float64)
    return torch.exp2(paper.log2() * (float(alibi_bias_max) / 8.0)).to(torch.float32)


def position_method(config) -> str:
    """The position method (``core.positions`` name) of a supported model's config: ``alibi`` for
    BLOOM, MPT and Falcon, ``rotary`` for GPT-NeoX, an export's own ``position_method``."""
    family = config_family(config)
    if family == EXPORTED:
        return getattr(config, "position_method", "alibi")
    return "rotary" if family == NEOX else "alibi"


def base_slopes(model) -> torch.Tensor:
    """The unscaled slopes of a supported ALiBi model (float32 ``[H]`` on the CPU), head order as the model's."""
    family, base = resolve(model)
    config = base.config
    if family == NEOX:
        raise UnsupportedModelError(f"{type(model).__name__} is a rotary model: it has no ALiBi slopes")
    if family == EXPORTED:
        return get_slopes(config.attention_heads)
    if family == "bloom":
        return get_slopes(config.n_head)
    if family == "mpt":
        return mpt_slopes(config.n_heads, config.attn_config.alibi_bias_max)
    return get_slopes(config.num_attention_heads)


def hf_train_length(config) -> Optional[int]:
    """The length a model was trained at, where its config records it, else None.

    MPT: ``max_seq_len``; BLOOM: ``seq_length`` when the config has it (the
    BigScience configs do not always; ``alibi-export-hf --format bloom`` writes
    it); exported models: ``alibi_train_length``; GPT-NeoX: ``max_position_embeddings`` (transformers'
    reference length for its RoPE scaling; ``--format gpt-neox`` writes the training length there).
    Other configs record none.
    """
    model_type = getattr(config, "model_type", None)
    name = {"mpt": "max_seq_len", "bloom": "seq_length", MODEL_TYPE: "alibi_train_length",
            NEOX: "max_position_embeddings"}.get(model_type)
    value = getattr(config, name, None) if name else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
