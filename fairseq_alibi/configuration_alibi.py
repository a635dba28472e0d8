"""Configuration of a fairseq ALiBi language model exported to Hugging Face.

This file travels with every exported model (``alibi-export-hf``), next to
``modeling_alibi.py`` and the maths modules it imports (``alibi.py``,
``bias.py``, ``kernels.py``, ``causal_blocks.py``): it imports only torch,
transformers and its siblings, so ``AutoConfig.from_pretrained(OUT,
trust_remote_code=True)`` works without this package installed.

Context extension is ``alibi_scaling``, Cerebras BTLM's convention extended to
every method of ``alibi.Scaling``:

* ``None`` or ``{"type": "none"}``: the slopes the model was trained with;
* ``{"type": "linear" | "ntk", "factor": F}``: static, ``F >= 1``;
* ``{"type": "linear" | "ntk", "train_seq_len": N}``: dynamic,
  ``max(1, keys / N)`` per forward pass;
* ``{"type": "cap", "factor": F}``: every distance above ``F`` training
  lengths (``alibi_train_length``) counted as that distance (LM-Infinite).

:func:`scaling_from_hf` and :func:`scaling_to_hf` are the one translation
between that dictionary and ``alibi.Scaling``.
"""

from __future__ import annotations

from typing import Any, Optional

from transformers import PreTrainedConfig

from .alibi import SLOPE_METHODS, Scaling, ScalingError

#: ``model_type`` of every exported model (``config.json``).
MODEL_TYPE = "fairseq_alibi_lm"
#: The keys an ``alibi_scaling`` dictionary may hold.
SCALING_KEYS = ("type", "factor", "train_seq_len")
SCALING_TYPES = ("none", "linear", "ntk", "cap")


class AlibiScalingError(ValueError):
    """An ``alibi_scaling`` value that is not valid; the message is one line
    naming ``alibi_scaling``, what was given and what is allowed."""


def _invalid(value: Any, reason: str) -> AlibiScalingError:
    return AlibiScalingError(f"alibi_scaling={value!r} is not valid; {reason}")


def _check_keys(value: Any) -> str:
    """The method of a well-formed dictionary (its ``type``)."""
    if not isinstance(value, dict):
        raise _invalid(value, 'give a dictionary such as {"type": "linear", "factor": 2.0}, or None')
    unknown = sorted(str(key) for key in value if key not in SCALING_KEYS)
    if unknown:
        raise _invalid(value, f"unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(SCALING_KEYS)}")
    method = value.get("type")
    if method not in SCALING_TYPES:
        raise _invalid(value, f"type must be one of {', '.join(SCALING_TYPES)}")
    return method


def scaling_from_hf(value: Any, train_length: Optional[int]) -> Scaling:
    """The ``alibi.Scaling`` of an ``alibi_scaling`` value (``AlibiScalingError`` if invalid).

    ``train_length`` is the model's ``alibi_train_length``, which the cap uses;
    a dynamic method uses its own ``train_seq_len``.
    """
    method = "none" if value is None else _check_keys(value)
    given = value or {}
    has_factor, has_length = "factor" in given, "train_seq_len" in given
    if method == "none" and (has_factor or has_length):
        raise _invalid(value, "type 'none' takes neither factor nor train_seq_len")
    if method in SLOPE_METHODS and has_factor == has_length:
        raise _invalid(value, f'{method} takes "factor": F (static, F >= 1) or "train_seq_len": N '
                              "(dynamic, max(1, length / N)), exactly one of them")
    if method == "cap" and (has_length or not has_factor):
        raise _invalid(value, 'cap takes "factor": F alone (the cap in training lengths, alibi_train_length)')
    factor = given.get("factor", 0.0)
    lowest = 1 if method in SLOPE_METHODS else 0
    if has_factor and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= lowest
                       or factor == 0):
        raise _invalid(value, f"factor must be a number >= 1 (for dynamic {method} give train_seq_len instead)"
                       if lowest else "factor must be a positive number of training lengths")
    length = value["train_seq_len"] if has_length else train_length
    try:
        return Scaling(method, float(factor), length).complete()
    except ScalingError as exc:
        field = {"factor": "factor", "train_length": "train_seq_len" if has_length else "alibi_train_length"}
        raise _invalid(value, f"{field.get(exc.field, exc.field)}={exc.value!r}: {exc.reason}") from None


def scaling_to_hf(scaling: Scaling) -> Optional[dict]:
    """The ``alibi_scaling`` value of a scaling spec (None for no scaling)."""
    if scaling.method == "none":
        return None
    if scaling.dynamic:
        return {"type": scaling.method, "train_seq_len": scaling.complete().train_length}
    return {"type": scaling.method, "factor": float(scaling.factor)}


class AlibiLMConfig(PreTrainedConfig):
    """A fairseq ``transformer_lm_alibi`` decoder, field by field.

    Sizes: ``hidden_size`` is fairseq's ``decoder_embed_dim``; ``input_embed_dim``
    the width of the token embedding (``decoder_input_dim``, projected to
    ``hidden_size`` when ``project_in``); ``output_embed_dim`` the width the
    output layer reads (``decoder_output_dim``, after ``project_out``).
    ``adaptive_input`` (``{"cutoff", "factor", "initial_dim"}``) and
    ``adaptive_softmax`` (``{"cutoff", "factor", "dropout", "tie_weights",
    "tie_proj"}``) describe fairseq's adaptive embedding and softmax; ``None``
    for a plain embedding and output projection.  Ids ``vocab_size`` to
    ``vocab_size + unk_aliases - 1`` are tokenizer pieces the fairseq dictionary
    lacks (a subword tokenizer's), read as ``unk_token_id`` as fairseq reads them.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_attention_heads": "attention_heads", "num_hidden_layers": "layers"}

    vocab_size: int = 8
    hidden_size: int = 64
    layers: int = 2
    attention_heads: int = 4
    ffn_dim: int = 256
    input_embed_dim: Optional[int] = None
    output_embed_dim: Optional[int] = None
    project_in: bool = False
    project_out: bool = False
    embed_scale: float = 1.0
    embed_quant_noise: bool = False
    layernorm_embedding: bool = False
    normalize_before: bool = False
    final_layer_norm: bool = False
    activation_function: str = "relu"
    layer_norm_eps: float = 1e-5
    scale_attn: bool = False
    scale_fc: bool = False
    scale_heads: bool = False
    scale_resids: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    adaptive_input: Optional[dict] = None
    adaptive_softmax: Optional[dict] = None
    alibi_train_length: Optional[int] = None
    alibi_scaling: Optional[dict] = None
    alibi_attention: str = "auto"
    unk_aliases: int = 0
    unk_token_id: Optional[int] = 3
    use_cache: bool = True
    bos_token_id: Optional[int] = 2
    eos_token_id: Optional[int] = 2
    pad_token_id: Optional[int] = 1
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        self.input_embed_dim = self.input_embed_dim or self.hidden_size
        self.output_embed_dim = self.output_embed_dim or self.hidden_size
        super().__post_init__(**kwargs)
        self.scaling()  # refuse an invalid alibi_scaling when the config is read

    def scaling(self) -> Scaling:
        """The ``alibi.Scaling`` of ``alibi_scaling`` (``AlibiScalingError`` if invalid)."""
        return scaling_from_hf(self.alibi_scaling, self.alibi_train_length)
