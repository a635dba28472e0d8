"""Hugging Face models: context extension and safe loading.

BLOOM, MPT, Falcon with ALiBi (transformers 5.23), GPT-NeoX (rotary, through
transformers' own RoPE scaling) and fairseq models exported by
``alibi-export-hf`` (any position method), under every method of ``fairseq_alibi.core.Scaling``
(docs/hf.md).  Split by job: ``families`` (which model is this: slopes,
training length), ``scaling`` (the hooks of ``apply_alibi_scaling``),
``loading`` (``load_hf_model``).  Importing it never imports fairseq or
changes anything in it.
"""

from .families import (  # noqa: F401
    EXPORTED, NEOX, SUPPORTED_MODELS, base_slopes, config_family, hf_train_length, mpt_slopes, position_method,
    resolve,
)
from .loading import load_hf_config, load_hf_model, loaded_notes, quiet_transformers  # noqa: F401
from .scaling import (  # noqa: F401
    BIAS_FORMS, alibi_scaling, alibi_scaling_settings, apply_alibi_scaling, extensions_of, remove_alibi_scaling,
)
