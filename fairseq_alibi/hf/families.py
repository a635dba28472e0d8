"""Which Hugging Face model is this: the ALiBi families, their slopes and training lengths.

BLOOM, MPT, Falcon with ``config.alibi=True`` (transformers 5.23) and the
models ``alibi-export-hf`` writes (family ``fairseq``, this package's
``modeling_alibi``).  Imports transformers lazily and never fairseq.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core.alibi import get_slopes
from ..core.configuration_alibi import MODEL_TYPE
from ..errors import ConfigError, UnsupportedModelError

SUPPORTED_MODELS = (
    "BLOOM (BloomModel, BloomForCausalLM), MPT (MptModel, MptForCausalLM), "
    "Falcon with config.alibi=True (FalconModel, FalconForCausalLM) and fairseq models "
    "exported by alibi-export-hf (AlibiLMModel, AlibiForCausalLM)"
)
#: The family of models written by ``alibi-export-hf`` (this package's ``modeling_alibi``).
EXPORTED = "fairseq"


def _families():
    # Imported lazily: transformers is only needed by users of this module.
    from transformers.models.bloom.modeling_bloom import BloomModel
    from transformers.models.falcon.modeling_falcon import FalconModel
    from transformers.models.mpt.modeling_mpt import MptModel

    return (("bloom", BloomModel), ("mpt", MptModel), ("falcon", FalconModel))


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
            f"{type(model).__name__} (model_type {model_type!r}) has no ALiBi bias to scale; "
            f"supported: {SUPPORTED_MODELS}"
        )
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


def config_family(config) -> str:
    """The family :func:`resolve` would find, read from a model's config alone
    (before its weights are loaded), else ``UnsupportedModelError``."""
    model_type = getattr(config, "model_type", None)
    if model_type == MODEL_TYPE:
        return EXPORTED
    if model_type in ("bloom", "mpt") or (model_type == "falcon" and getattr(config, "alibi", False)):
        return model_type
    why = ("config.alibi=False: this Falcon uses rotary position embeddings, not ALiBi" if model_type == "falcon"
           else f"model_type {model_type!r} has no ALiBi bias to scale")
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


def base_slopes(model) -> torch.Tensor:
    """The unscaled slopes of a supported model (float32 ``[H]`` on the CPU), head order as the model's."""
    family, base = resolve(model)
    config = base.config
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
    it); exported models: ``alibi_train_length``.  Other configs record none.
    """
    model_type = getattr(config, "model_type", None)
    name = {"mpt": "max_seq_len", "bloom": "seq_length", MODEL_TYPE: "alibi_train_length"}.get(model_type)
    value = getattr(config, name, None) if name else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
