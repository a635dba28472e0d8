"""Configuration of a fairseq ALiBi language model exported to Hugging Face.

This file travels with every exported model (``alibi-export-hf``), next to
``modeling_alibi.py`` and the maths modules it imports (``alibi.py``,
``bias.py``, ``kernels.py``, ``causal_blocks.py``, ``flex.py``): it imports
only torch, transformers and its siblings, so ``AutoConfig.from_pretrained(OUT,
trust_remote_code=True)`` works without this package installed.

Context extension is ``alibi_scaling``, Cerebras BTLM's convention extended to
every method of ``scaling.Scaling``, whose ``from_hf`` and ``to_hf`` are the one
translation (their docstrings list the forms): ``None`` or ``{"type": "none"}``
(as trained); ``{"type": "linear" | "ntk", "factor": F}`` (static) or ``{...,
"train_seq_len": N}`` (dynamic); ``{"type": "cap" | "log" | "power" | "capnorm",
"factor": F}`` (past ``F x alibi_train_length``), with ``"alpha": A`` for the
tails ``log`` and ``power``.
"""

from __future__ import annotations

from typing import Optional

from transformers import PreTrainedConfig

from .errors import ScalingError
from .scaling import Scaling

#: ``model_type`` of every exported model (``config.json``).
MODEL_TYPE = "fairseq_alibi_lm"
#: An invalid ``alibi_scaling`` (one line naming it, what was given and what is allowed).
AlibiScalingError = ScalingError


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
        check_position_params(self)  # and a position parameter out of its range

    def scaling(self) -> Scaling:
        """The ``scaling.Scaling`` of ``alibi_scaling`` (``ScalingError`` if invalid)."""
        return Scaling.from_hf(self.alibi_scaling, self.alibi_train_length)


def check_position_params(config) -> None:
    """The parameters of the config's position method (``position``, ALiBi when
    absent; each under its fairseq config name, ``fire_hidden``), checked against
    their declaration (``params.Param``) when the config is read, as the fairseq
    side checks them before building: ``ConfigError`` naming the key and its
    range.  ALiBi has none, so its exports need no ``positions.py``."""
    name = getattr(config, "position", None) or "alibi"
    if name == "alibi":
        return
    from .positions import check_params, position

    check_params(name, {p.name: getattr(config, p.name, p.default) for p in position(name).params})
