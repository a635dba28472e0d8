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
``position_params`` and a logit method (log-n scaling, ``scaling.LOGIT_METHODS``) in
``alibi_scaling``.  A
method whose entry's ``scaling_key`` is ``rope_parameters`` (RoPE) spells its
base, rotated share and context extension as transformers spells them where
transformers defines the same method (:func:`rope_parameters_of`,
:func:`scaling_of_rope`, the one translation both ways).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from transformers import PreTrainedConfig

from .errors import ConfigError, ScalingError, plural
from .positions import ROPE_PARAMETERS, attention_entry, check_params, exported_methods
from .positions import params_of, ssmax_problem
from .scaling import NO_SCALING, Scaling
from .methods import REGISTERED  # noqa: F401  (registers an exported model's method from outside the core)

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
        raise invalid(f"unknown {plural(len(unknown), 'key')} {', '.join(unknown)}; allowed keys: "
                      f"{', '.join(ROPE_KEYS)}")
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


#: Keys transformers itself writes into a config.json that ``PreTrainedConfig`` does not declare
#: (the remote-code map, a quantized model's settings): read by transformers, not by this model.
TRANSFORMERS_KEYS = ("auto_map", "quantization_config")
#: The fields a ``from_pretrained`` keyword may set to other than the exported value: the context
#: extension (:func:`load_keywords`), the kernel, the cache, dropout, generation's token ids.  Every
#: other field of this config is fixed by the weights (shapes, norms, the position method and its params).
LOAD_SETTINGS = ("alibi_scaling", "rope_parameters", "alibi_attention", "use_cache", "dropout", "attention_dropout",
                 "activation_dropout", "bos_token_id", "eos_token_id")
#: ``rope_parameters``' entries fixed by the weights (the RoPE base and rotated share).
ROPE_FIXED = ("rope_theta", "partial_rotary_factor")


def transformers_key(key: str) -> bool:
    """``key`` is transformers' own: declared by ``PreTrainedConfig`` (a field, a class attribute,
    a property such as ``torch_dtype``), private, or in :data:`TRANSFORMERS_KEYS`."""
    return hasattr(PreTrainedConfig, key) or key.startswith("_") or key in TRANSFORMERS_KEYS


def not_read(keys, config) -> str:
    """One line refusing ``keys``, which no part of an exported model reads."""
    what = "context extension: " + ("rope_parameters" if config.rope_parameters is not None else "alibi_scaling")
    return (f"{', '.join(map(str, keys))}: not a setting of this exported model ({what}; the rest of its config.json "
            "is fixed by its weights); leave "
            f"{'it' if len(keys) == 1 else 'them'} out")


def refuse_model_arguments(config, args, kwargs) -> None:
    """The model's own constructor takes a config alone: ``from_pretrained`` hands it the
    keywords that neither it nor the config took (``rope_theta=...``), refused here in one
    line (a TypeError before); a config field given beside an explicit ``config=`` too."""
    if args:
        raise ConfigError(f"this exported model takes its config alone, not {len(args)} more positional "
                          f"{plural(len(args), 'argument')}")
    if kwargs:
        fields = getattr(type(config), "__dataclass_fields__", {})
        passed = [key for key in kwargs if key in fields]
        hint = f"; with config= given, set {', '.join(passed)} on that config" if passed else ""
        raise ConfigError(not_read(sorted(kwargs), config) + hint)


def load_keywords(cls, saved: Dict[str, Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``from_pretrained``'s keywords checked against the exported config ``saved``:
    a field fixed by the weights may only repeat its exported value; ``rope_scaling``
    (transformers' older name) is ``rope_parameters``, whose RoPE base and rotated share
    are the exported ones (``{"rope_type": "yarn", "factor": 2.0}`` extends the model
    as trained); the scaling itself is checked with the config."""
    kwargs = dict(kwargs)
    if "rope_scaling" in kwargs:
        if "rope_parameters" in kwargs:
            raise ConfigError("rope_scaling is transformers' older name of rope_parameters: give one of the two")
        kwargs["rope_parameters"] = kwargs.pop("rope_scaling")
    fields = getattr(cls, "__dataclass_fields__", {})
    for key, value in kwargs.items():
        key = cls.attribute_map.get(key, key)
        if key not in fields or transformers_key(key) or key in LOAD_SETTINGS:
            continue
        exported = saved.get(key, fields[key].default)
        if value != exported:
            raise ConfigError(f"{key}={value!r} cannot be given when loading this model: it was exported with "
                              f"{key}={exported!r}, which its weights were trained with; leave it out")
    rope, exported = kwargs.get("rope_parameters"), saved.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(exported, dict):
        for key in ROPE_FIXED:
            if key in rope and key in exported and rope[key] != exported[key]:
                raise ConfigError(f"rope_parameters {key}={rope[key]!r} cannot be given when loading this model: it "
                                  f"was exported with {key}={exported[key]!r}, which its weights were trained with; "
                                  "leave it out (the context extension alone: rope_type, factor)")
        kwargs["rope_parameters"] = {**{k: exported[k] for k in ROPE_FIXED if k in exported}, **rope}
    return kwargs


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
        unread = sorted(key for key in kwargs if key in vars(self) and not transformers_key(key))
        if unread:  # transformers keeps an unknown key as an attribute that nothing here reads
            raise ConfigError(not_read(unread, self))
        self.scaling()  # refuse an invalid alibi_scaling when the config is read
        check_position_params(self)  # and a position parameter out of its range
        check_position_param_keys(self)  # or one it does not read

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any], **kwargs):
        """transformers' ``from_dict`` (``from_pretrained``'s keywords set after the
        config is read, unchecked), with :func:`load_keywords` first and the config's
        checks again after: a keyword either takes effect as the same setting does in
        fairseq, or is refused in one line."""
        kwargs = load_keywords(cls, config_dict, kwargs)
        made = super().from_dict(config_dict, **kwargs)
        config = made[0] if isinstance(made, tuple) else made
        config.scaling()
        check_position_params(config)
        check_position_param_keys(config)
        return made

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
        if self.rope_parameters is not None:  # the RoPE of rnope's layers, for one, is extended by alibi_scaling
            try:
                spelled = f": alibi_scaling={scaling_of_rope(self.rope_parameters, self.alibi_train_length).to_hf()}"
            except ScalingError:
                spelled = ""
            raise ScalingError("rope_parameters", self.rope_parameters, f"this {self.position_method} model reads no "
                               f"rope_parameters; its context extension is alibi_scaling{spelled}")
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

def check_position_param_keys(config) -> None:
    """Every key of ``position_params`` is a parameter the position method reads, with
    the value it reads (a rotary model's base and share come from ``rope_parameters``):
    ``ConfigError`` naming the others, never a key ignored."""
    name = getattr(config, "position_method", None)
    given = config.position_settings()  # the declared defaults filled in
    declared = {param.name for _, param in params_of([name])}
    unread = sorted(str(key) for key, value in (config.position_params or {}).items()
                    if key not in declared or given[key] != value)
    if unread:
        them = "it" if len(unread) == 1 else "them"
        raise ConfigError(f"position_params {', '.join(unread)}: this {name} model does not read {them} (its "
                          f"parameters: {', '.join(sorted(declared)) or 'none'}"
                          f"{', read from rope_parameters' if config.rope_parameters is not None else ''}); leave "
                          f"{them} out")


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
    problem = ssmax_problem(entry.name, bool(getattr(config, "ssmax", False)))
    if problem:
        raise ConfigError(problem)
    check_params(entry.name, {p.name: given[p.name] for p in entry.params}, getattr(config, "layers", None))
