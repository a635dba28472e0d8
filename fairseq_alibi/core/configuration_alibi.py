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

The other position methods (``position_method``: every entry of
``positions.POSITIONS``, and ``sinusoidal``) hold their params in
``position_params`` and a logit method (``logn``) in ``alibi_scaling``.  A
method whose entry's ``scaling_key`` is ``rope_parameters`` (RoPE) spells its
base, rotated share and context extension as transformers spells them where
transformers defines the same method (:func:`rope_parameters_of`,
:func:`scaling_of_rope`, the one translation both ways).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from transformers import PreTrainedConfig

from .errors import ConfigError, ScalingError
from .positions import ROPE_PARAMETERS, attention_entry, check_params, exported_methods
from .scaling import NO_SCALING, Scaling

#: ``model_type`` of every exported model (``config.json``).
MODEL_TYPE = "fairseq_alibi_lm"
#: An invalid ``alibi_scaling`` (one line naming it, what was given and what is allowed).
AlibiScalingError = ScalingError
#: ``rope_type`` of each RoPE extension of ``rotary.py`` (static factor, dynamic).  Static
#: ``linear`` and ``yarn`` are transformers' types of the same definition, dynamic ``ntk`` is
#: transformers' ``dynamic`` at factor 1; the others have no transformers type and are named here.
ROPE_TYPES = {("none", False): "default", ("linear", False): "linear", ("linear", True): "linear_dynamic",
              ("ntk", False): "ntk", ("ntk", True): "dynamic", ("yarn", False): "yarn", ("yarn", True): "yarn_dynamic",
              ("logn", False): "logn"}
#: The keys a ``rope_parameters`` dictionary of an exported rotary model may hold.
ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow")
#: YaRN's ramp ends as ``rotary.py`` fixes them (transformers' defaults too).
YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}


def rope_parameters_of(scaling: Scaling, base: float, fraction: float) -> Dict[str, Any]:
    """The ``rope_parameters`` of a rotary model with RoPE base ``base``, rotated
    share ``fraction`` of each head, extended by ``scaling`` (complete)."""
    value: Dict[str, Any] = {"rope_type": ROPE_TYPES[(scaling.method, scaling.dynamic)],
                             "rope_theta": float(base), "partial_rotary_factor": float(fraction)}
    if scaling.method == "none":
        return value
    value["factor"] = 1.0 if scaling.dynamic else float(scaling.factor)
    if scaling.method in ("yarn", "logn") or scaling.dynamic:
        value["original_max_position_embeddings"] = int(scaling.complete().train_length)
    if scaling.method == "yarn":
        value.update(YARN_BETAS)
    return value


def partial_rotary_factor(rotary_dim: int, head_dim: int) -> Optional[float]:
    """A ``partial_rotary_factor`` transformers' GPT-NeoX reads back as ``rotary_dim`` (``int(head_dim x f)``), or None."""
    factor = rotary_dim / head_dim
    for candidate in (factor, float(torch.nextafter(torch.tensor(factor, dtype=torch.float64),
                                                    torch.tensor(2.0, dtype=torch.float64)))):
        if int(head_dim * candidate) == rotary_dim:
            return candidate
    return None


def neox_computes(scaling: Scaling) -> bool:
    """transformers has a ``rope_type`` for ``scaling`` (:func:`neox_rope_parameters` is not None)."""
    return neox_rope_parameters(scaling, 10000.0, 4, 4) is not None


def neox_rope_parameters(scaling: Scaling, base: float, rotary_dim: int, head_dim: int) -> Optional[dict]:
    """transformers' ``rope_parameters`` computing ``scaling`` on RoPE of base
    ``base`` over ``rotary_dim`` of ``head_dim`` dimensions; None where it has no such type."""
    value = {"rope_type": "default", "rope_theta": float(base),
             "partial_rotary_factor": partial_rotary_factor(rotary_dim, head_dim)}
    if scaling.method == "none":
        return value
    if scaling.method in ("linear", "yarn") and scaling.dynamic:
        return None
    if scaling.method == "ntk":
        if scaling.dynamic:
            return dict(value, rope_type="dynamic", factor=1.0)
        return dict(value, rope_theta=float(base) * float(scaling.factor) ** (rotary_dim / (rotary_dim - 2)))
    if scaling.method == "linear":
        return dict(value, rope_type="linear", factor=float(scaling.factor))
    if scaling.method == "yarn":
        return dict(value, rope_type="yarn", factor=float(scaling.factor),
                    original_max_position_embeddings=int(scaling.complete().train_length), **YARN_BETAS)
    return None  # logn and ALiBi's methods: no transformers rope_type


def scaling_of_rope(value: Any, train_length: Optional[int]) -> Scaling:
    """The ``Scaling`` of a ``rope_parameters`` value (see :data:`ROPE_TYPES`;
    ``original_max_position_embeddings`` defaults to ``alibi_train_length``).
    Errors name ``rope_parameters`` in one line."""
    types = {rope_type: key for key, rope_type in ROPE_TYPES.items()}

    def invalid(reason: str) -> ScalingError:
        return ScalingError("rope_parameters", value, reason)

    if value is None:
        return NO_SCALING
    if not isinstance(value, dict):
        raise invalid('give a dictionary such as {"rope_type": "linear", "factor": 2.0}')
    unknown = sorted(str(key) for key in value if key not in ROPE_KEYS)
    if unknown:
        raise invalid(f"unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(ROPE_KEYS)}")
    rope_type = value.get("rope_type", "default")
    if rope_type not in types:
        raise invalid(f"rope_type must be one of {', '.join(types)}")
    method, dynamic = types[rope_type]
    factor = value.get("factor")
    if method != "none" and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1):
        raise invalid(f"rope_type {rope_type} takes \"factor\": a number >= 1")
    if rope_type == "dynamic" and factor != 1:
        raise invalid("this model computes transformers' dynamic NTK at factor 1 only (base x (n / L) ** "
                      "(d / (d - 2)) past L); at factor F transformers stretches it to F n / L - (F - 1): give "
                      "\"factor\": 1.0, or load the GPT-NeoX export with transformers")
    if method == "yarn" and any(value.get(k, v) != v for k, v in YARN_BETAS.items()):
        raise invalid("yarn's ramp ends are beta_fast 32 and beta_slow 1 here")
    length = value.get("original_max_position_embeddings", train_length)
    try:
        return Scaling(method, 0.0 if dynamic else (factor or 0.0), length).complete()
    except ScalingError as exc:
        raise invalid(f"{exc.field}={exc.value!r}: {exc.reason}") from None


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
    position_method: str = "alibi"
    position_params: Optional[dict] = None
    ssmax: bool = False
    rope_parameters: Optional[dict] = None
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

    def convert_rope_params_to_dict(self, **kwargs):
        """``rope_parameters`` is read by :func:`scaling_of_rope` alone (transformers'
        standardization would fill a non-rotary model's in and warn)."""
        return kwargs

    def validate_rope(self) -> None:
        """The config's own check of ``rope_parameters`` (:meth:`scaling`), where
        ``save_pretrained`` runs transformers' validation: that one reads fields this
        config lacks (YaRN's ``max_position_embeddings``: an AttributeError, and no
        export of a rotary model under ``yarn:F`` in this format) and warns about
        the types it does not know (``logn``)."""
        self.scaling()

    def validate(self) -> None:
        """transformers' checks of a config, with :meth:`validate_rope` this
        config's own: the list is ``PreTrainedConfig``'s, collected when that class
        was defined, so an override of one of its methods alone is never called."""
        for validator in getattr(type(self), "__class_validators__", ()):
            if validator.__name__ == "validate_rope":
                self.validate_rope()
            else:
                validator(self)

    def scaling(self) -> Scaling:
        """The ``scaling.Scaling`` of ``alibi_scaling`` (ALiBi) or
        ``rope_parameters`` (rotary); ``ScalingError`` if invalid."""
        if self.position_method not in exported_methods():
            raise ConfigError(f"position_method={self.position_method!r} is not valid; allowed values: "
                              f"{', '.join(exported_methods())}")
        if self.rope_spelled():
            if self.alibi_scaling is not None:
                raise ScalingError("alibi_scaling", self.alibi_scaling, f"a {self.position_method} model has no "
                                   "alibi_scaling; its context extension is rope_parameters")
            return scaling_of_rope(self.rope_parameters, self.alibi_train_length)
        scaling = Scaling.from_hf(self.alibi_scaling, self.alibi_train_length)
        allowed = attention_entry(self.position_method).extensions  # the logit methods (logn): every method's
        if scaling.method not in allowed:
            raise ScalingError("alibi_scaling", self.alibi_scaling, f"a {self.position_method} model's context "
                               f"extension is one of {', '.join(allowed)}")
        return scaling

    def rope_spelled(self) -> bool:
        """The position method's params and context extension are transformers' ``rope_parameters``
        (its entry's ``scaling_key``), not ``position_params`` and ``alibi_scaling``."""
        return attention_entry(self.position_method).scaling_key == ROPE_PARAMETERS

    def set_scaling(self, scaling: Scaling) -> None:
        """Write ``scaling`` (complete) into the key the position method spells it in."""
        if self.rope_spelled():
            rope = self.rope_parameters or {}
            self.rope_parameters = rope_parameters_of(scaling, rope.get("rope_theta", 10000.0),
                                                      rope.get("partial_rotary_factor", 1.0))
        else:
            self.alibi_scaling = scaling.to_hf()

    def position_settings(self) -> Dict[str, Any]:
        """The position method's parameters (``positions.Param`` names): a
        rotary model's base and rotated share come from ``rope_parameters``; a
        parameter the config does not hold takes its declared default (as on
        the fairseq side), so a hand-written config builds."""
        params = dict(self.position_params or {})
        if self.rope_spelled():
            rope = self.rope_parameters or {}
            params["rotary_base"] = rope.get("rope_theta", 10000.0)
            params["rotary_fraction"] = rope.get("partial_rotary_factor", 1.0)
        return {**{p.name: p.default for p in attention_entry(self.position_method).params}, **params}

def check_position_params(config) -> None:
    """The parameters of the config's position method (``position_method``;
    rotary's from ``rope_parameters``, the others' from ``position_params``),
    checked against their declaration (``params.Param``) when the config is
    read, as the fairseq side checks them before building: ``ConfigError``
    naming the key and its range.  ALiBi has none."""
    name = getattr(config, "position_method", None)
    if name not in exported_methods():
        return  # an unknown name is refused by ``scaling()``
    given = config.position_settings()  # the declared defaults filled in
    entry = attention_entry(name)
    check_params(entry.name, {p.name: given[p.name] for p in entry.params}, getattr(config, "layers", None))
