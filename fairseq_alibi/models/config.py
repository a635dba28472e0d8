"""The ALiBi config fields of the plugin's models, and their one reader.

``AlibiConfig`` declares the fields every stack shares; ``AlibiEncoderConfig``
adds the encoders' own.  ``Scaling.from_config`` reads the scaling fields
(its errors name the config keys), :func:`build_bias` makes a stack's bias
from them, and :func:`check_override_keys` checks model overrides (hub keywords):
``alibi*`` values by declared type, fairseq's integer and real options by range
(:data:`INTEGER_OPTIONS`, :data:`REAL_OPTIONS`, the tables the console scripts check their flags
with), position-method parameters by their declaration (``core.params``: a
parameter of another method, or one fixed by training, is refused), options
that set the weights' shapes are refused, and so is a key that would change
nothing (fairseq would drop it, and print the model's result as trained).
No ``from __future__ import annotations`` here: fairseq reads the field types
to build its argparse options.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Optional

from fairseq.dataclass import FairseqDataclass

from .. import facts
from ..core import positions as P
from ..core.alibi import BIDIRECTIONAL_MODES
from ..core.params import SHAPE, role_problem
from ..core.errors import ScalingError
from ..core.scaling import (
    CONFIG_KEYS, DEFAULT_ALPHA, DISTANCE_METHODS, LOGIT_METHODS, METHOD_SYNTAX, METHOD_TABLE, METHODS, SCALE_METHODS,
    SPELLING_KEY, Scaling,
)
from ..core.bias import AlibiBias
from ..errors import HUB_KEYS, ConfigError, closest, warn_once
from ..options import INTEGER_OPTIONS, REAL_OPTIONS, integer_problem, real_problem  # the tables overrides are checked against
from ..core.kernels import KERNEL_NAMES


def option(default, help: str):
    """A config field with its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass
class AlibiConfig(FairseqDataclass):
    position_scaling: str = option(
        "", f"context extension at evaluation, for every position method, in one spelling ({METHOD_SYNTAX}; "
        "e.g. ntk:2, yarn:4, linear, cap:0.5, logn): the methods of the model's position method "
        "(docs/evaluating.md); empty: alibi_interpolation, alibi_scale_factor and alibi_tail_alpha, its older names, "
        "kept for every existing checkpoint and command")
    alibi_interpolation: str = option(
        "none", f"context extension at evaluation: {' | '.join(METHODS)} ("
        + "; ".join(f"{m.name}: {m.summary}" for m in METHOD_TABLE if m.name != "none")
        + "; C = alibi_scale_factor x alibi_train_length, d the distance)")
    alibi_scale_factor: float = option(
        0.0, f"{'/'.join(SCALE_METHODS)}: 0 = dynamic, max(1, n / alibi_train_length) with n a row's keys in "
        f"the forward pass, otherwise a static factor >= 1; {'/'.join(DISTANCE_METHODS)}: C in training lengths "
        f"(any > 0; 0 = 1); {'/'.join(LOGIT_METHODS)}: the base length in training lengths (0 = 1)")
    alibi_tail_alpha: Optional[float] = option(
        None, f"{' and '.join(DEFAULT_ALPHA)} only: the tail's growth alpha (> 0; defaults: "
        + ", ".join(f"{m} {a:g}" for m, a in DEFAULT_ALPHA.items()) + ")")
    alibi_attention: str = option("auto", f"attention kernel: {' | '.join(KERNEL_NAMES)} (docs/performance.md)")


@dataclass
class AlibiEncoderConfig(AlibiConfig):
    """The encoder models' ALiBi fields (added to their argparse options)."""

    alibi_bidirectional: str = option(
        "symmetric", f"encoder self-attention bias: {' | '.join(BIDIRECTIONAL_MODES)} (symmetric: -m|i-j| "
        "every head; split: half the heads look only left, half only right, an odd last head both ways; "
        "learned: per-layer left/right slopes, trained, kept negative)")
    alibi_train_length: Optional[int] = option(
        None, "the length the model was trained at (masked LM: defaults to the task's tokens_per_sample; "
        "translation: set it to use dynamic scaling or cap)")


#: Every field the plugin adds to its models (override keys, hub keywords): ``position_scaling``,
#: then the ``alibi_*`` fields (the older names of the scaling, the kernel, the encoders' own).
ALIBI_FIELDS = tuple(f.name for f in dataclasses.fields(AlibiEncoderConfig)
                     if f.name.startswith("alibi_") or f.name == SPELLING_KEY)
#: Where a mistyped plugin key starts (warned about, never silently dropped).
FIELD_PREFIXES = ("alibi", "position_")


def field_help(*configs) -> dict:
    """``{field: its --help text}`` of every ALiBi field, read from the config
    dataclasses; a field declared by several of ``configs`` gets the first's text."""
    found = {}
    for config in configs + (AlibiEncoderConfig,):
        for f in dataclasses.fields(config):
            if f.name in ALIBI_FIELDS:
                found.setdefault(f.name, f.metadata["help"])
    return {name: found[name] for name in ALIBI_FIELDS}


def scaling_from_config(args) -> Scaling:
    """The complete scaling spec of a model config (``Scaling.from_config``):
    ``ConfigError`` for an invalid value, a warning for a factor ``none`` ignores."""
    scaling = Scaling.from_config(args).complete()
    factor = getattr(args, CONFIG_KEYS["factor"], 0.0)
    if scaling.method == "none" and factor not in (0, 1):
        applying = "; ".join(f"{entry.name}: {', '.join(m for m in entry.extensions if m != 'none')}"
                             for entry in P.POSITIONS.values() if len(entry.extensions) > 1)
        warn_once(
            f"alibi_scale_factor={factor!r} has no effect with alibi_interpolation='none'; set alibi_interpolation "
            f"to a method that applies to the model's position method ({applying})"
        )
    return scaling


def build_bias(args, num_heads: int, encoder: bool = False) -> AlibiBias:
    """A stack's shared bias from its config: causal for a decoder, the
    ``alibi_bidirectional`` mode for an encoder."""
    mode = getattr(args, "alibi_bidirectional", "symmetric") if encoder else "causal"
    if mode not in ("causal",) + BIDIRECTIONAL_MODES or (encoder and mode == "causal"):
        raise ConfigError(
            f"alibi_bidirectional={mode!r} is not valid; allowed values: {', '.join(BIDIRECTIONAL_MODES)}"
        )
    return AlibiBias(num_heads, mode, scaling_from_config(args))


def _allowed_types(annotation):
    """(Python types a value of this declared field type may have, their name)."""
    optional = getattr(annotation, "__args__", None) and type(None) in annotation.__args__
    base = next(a for a in annotation.__args__ if a is not type(None)) if optional else annotation
    types, name = {str: ((str,), "a string"), float: ((int, float), "a number"), int: ((int,), "an integer")}[base]
    return (types + (type(None),), name + " or None") if optional else (types, name)


_FIELD_TYPES = {f.name: _allowed_types(f.type) for f in dataclasses.fields(AlibiEncoderConfig)
                if f.name in ALIBI_FIELDS}
_FIELD_CHOICES = {"alibi_interpolation": METHODS, "alibi_attention": KERNEL_NAMES,
                  "alibi_bidirectional": BIDIRECTIONAL_MODES}




def _override_value_problem(key: str, value) -> Optional[str]:
    """What is wrong with one override's value (None: nothing known to be)."""
    if key in INTEGER_OPTIONS:
        return integer_problem(key, value)
    if key in REAL_OPTIONS:
        return real_problem(key, value)
    if key not in _FIELD_TYPES:
        return None
    if key == SPELLING_KEY and isinstance(value, str) and value.strip():
        try:
            Scaling.parse(value)
        except ScalingError as exc:
            return f"takes one method spelling ({METHOD_SYNTAX}); {exc.reason}"
        return None
    types, name = _FIELD_TYPES[key]
    choices = _FIELD_CHOICES.get(key)
    if isinstance(value, bool) or not isinstance(value, types) or (choices and value not in choices):
        return "takes " + (f"one of {', '.join(map(repr, choices))}" if choices else name)
    return None


def _config_keys(node) -> Iterator[str]:
    """Every key of a (nested) config, sections included; ``"*"`` for a
    Namespace section (fairseq sets any key on it: the model section of an
    argparse model, e.g. transformer_alibi, which a loaded config holds as an
    object node around the Namespace)."""
    from argparse import Namespace

    from omegaconf import DictConfig
    from omegaconf.nodes import AnyNode

    if isinstance(node, AnyNode):
        node = node._value()
    if isinstance(node, Namespace):
        yield "*"
    elif isinstance(node, (DictConfig, dict)):
        for key in node.keys():
            yield key
            yield from _config_keys(node.get(key) if isinstance(node, dict) else node._get_node(key))


def _refuse_ineffective(overrides: dict, cfg) -> None:
    """Refuse keys that would change nothing: ALiBi keys for a model without
    ALiBi, and keys the checkpoint's config has nowhere (fairseq drops them, and
    would print the model's result as trained under the user's settings)."""
    model = getattr(cfg, "model", None)
    if model is None:
        return
    name = getattr(model, "_name", None) or "unknown"
    known = set(_config_keys(cfg))
    if "alibi_interpolation" not in model:
        given = sorted(k for k in overrides if isinstance(k, str) and k in ALIBI_FIELDS)
        if given:
            raise ConfigError(f"model overrides {', '.join(given)} would have no effect: the checkpoint's model "
                              f"({name}) has no ALiBi; leave them out to evaluate it as trained")
        known.update(ALIBI_FIELDS)
    if "*" in known:  # a Namespace section takes any key
        return
    for key in overrides:
        if key in known or key in HUB_KEYS or (isinstance(key, str) and key.startswith(FIELD_PREFIXES)
                                               and key not in ALIBI_FIELDS):
            continue  # an alibi* typo was refused with the ALiBi fields
        if key in ALIBI_FIELDS:
            hint = " (an option of the ALiBi encoders, roberta_alibi and transformer_alibi)"
        else:
            hint = closest(key, [k for k in known if isinstance(k, str)]) if isinstance(key, str) else ""
        raise ConfigError(f"model override {key!r} would change nothing: the checkpoint's config ({name}) has no "
                          f"such option{hint}")


#: The ALiBi fields every ALiBi model has (a checkpoint older than one of them lacks it).
SHARED_FIELDS = tuple(f.name for f in dataclasses.fields(AlibiConfig))


def adopt_new_fields(overrides, cfg) -> None:
    """Add to an ALiBi checkpoint's model config the shared ALiBi fields that
    ``overrides`` set and it predates (``alibi_tail_alpha``): fairseq sets only
    keys a config already has, and would drop them silently."""
    from omegaconf import DictConfig, open_dict

    model = getattr(cfg, "model", None)
    if not isinstance(overrides, dict) or not isinstance(model, DictConfig) or "alibi_interpolation" not in model:
        return
    with open_dict(model):
        for key in SHARED_FIELDS:
            if key in overrides and key not in model:
                model[key] = None


#: fairseq model options that set the shape of a model's weights: a trained model keeps them.
SHAPE_OPTIONS = ("decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
                 "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_layers", "encoder_attention_heads")


def _ssmax_problem(value, trained: bool) -> str:
    if trained:
        return (f"model override ssmax={value!r} cannot apply to this checkpoint (trained with --ssmax): it holds "
                "SSMax's learned scales (a shape setting: weights of its own), which the override would drop; "
                "leave it out (a model without SSMax is another training run, without --ssmax)")
    return (f"model override ssmax={value!r} cannot apply to this checkpoint (trained without --ssmax): SSMax's "
            "scales are weights learned in training, and this checkpoint has none; leave it out, or train a model "
            "with --ssmax (for a fixed logit scale at evaluation: position_scaling 'logn')")


#: Boolean model options that add weights of their own (a trained model keeps its value), and what an
#: override of the other value would mean: SSMax's learned scales (``--ssmax``).
WEIGHT_FLAGS = {"ssmax": _ssmax_problem}


def _get(section, key, default=None):
    """``section[key]`` of a DictConfig, dict or Namespace section."""
    if isinstance(section, dict) or hasattr(section, "keys"):
        return section.get(key, default)
    return getattr(section, key, default)


def _has(section, key) -> bool:
    return key in section if isinstance(section, dict) or hasattr(section, "keys") else hasattr(section, key)


def _checkpoint_model(cfg):
    """(model section, architecture name, position method or None) of a checkpoint's config."""
    model = getattr(cfg, "model", None) if cfg is not None else None
    if model is None and isinstance(cfg, dict):
        model = cfg.get("model")
    if model is None:
        return None, None, None
    arch = _get(model, "_name") or _get(model, "arch")
    return model, arch, facts.position_of(facts.model_family(arch) or arch)


def override_problem(key, value, cfg=None):
    """What keeps override ``key=value`` from applying to the checkpoint whose
    config is ``cfg`` (one sentence naming the key), or None.  Position-method
    parameters (``core.positions``, every registered method's): one of another
    method, or of a model without them, is refused; the model's own are checked
    by their declaration (``Param.override_problem``: a value out of range, a
    shape or learned parameter other than the trained one).  fairseq's options
    in :data:`SHAPE_OPTIONS`, and a learned position table's size, must keep
    the trained value.  Without ``cfg``, a parameter's range alone."""
    if not isinstance(key, str):
        return None
    declared = [(method, param) for method, param in P.params_of() if param.name == key]
    model, arch, position = _checkpoint_model(cfg)
    if declared:
        own = [param for method, param in declared if method == position]
        if model is None:
            problem = declared[0][1].problem(value)
            return f"model override {key}={value!r} is not valid; it {problem}" if problem else None
        if not own:
            params = [p.name for p in P.position(position).params] if position else []
            has = f"whose parameters are {', '.join(params)}" if params else "which has no position parameters"
            return (f"model override {key!r} is a parameter of {' and '.join(m for m, _ in declared)} models; this "
                    f"checkpoint is {arch} ({position or 'no position method of this plugin'}), {has}, so it would "
                    "change nothing; leave it out")
        param = own[0]
        trained = _get(model, key)
        return param.override_problem(value, param.default if trained is None else trained)
    if model is None:
        return None
    if key in WEIGHT_FLAGS and _has(model, key) and bool(value) != bool(_get(model, key)):
        return WEIGHT_FLAGS[key](value, bool(_get(model, key)))
    if key in SHAPE_OPTIONS and _get(model, key) is not None:
        return role_problem(key, SHAPE, value, _get(model, key), "--" + key.replace("_", "-"))
    learned_table = _get(model, "decoder_learned_pos") and not _get(model, "no_token_positional_embeddings")
    if key == "max_target_positions" and learned_table and _has(model, key):
        return role_problem(key, SHAPE, value, _get(model, key), None)
    return None


def check_override_keys(overrides, cfg=None) -> None:
    """Check model overrides before they reach a model: an ``alibi*`` key no
    model has is a ``ConfigError`` (a typo would change nothing, silently); a value
    of the wrong type (``alibi*``) or out of range (:data:`INTEGER_OPTIONS`) is
    a ``ConfigError`` naming the key (ALiBi ranges are checked where the model
    is built), and so is a key that cannot apply to the checkpoint
    (:func:`override_problem`: another method's parameter, one fixed by
    training, a shape); with ``cfg``, the checkpoint's whole config, a key it
    has nowhere (fairseq would drop it) and ALiBi keys given to a model without
    ALiBi are refused too: either would print the model's result as trained, as if
    under the settings the user gave."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ConfigError(f"model overrides must be a dict such as {{'alibi_interpolation': 'ntk'}}, "
                          f"got {type(overrides).__name__}: {overrides!r}")
    for key, value in overrides.items():
        if isinstance(key, str) and key.startswith(FIELD_PREFIXES) and key not in ALIBI_FIELDS and not any(
                param.name == key for _, param in P.params_of()):
            raise ConfigError(f"model override {key!r} would change nothing: no such field of this plugin"
                              f"{closest(key, ALIBI_FIELDS)} (valid: {', '.join(ALIBI_FIELDS)})")
        problem = _override_value_problem(key, value) if isinstance(key, str) else None
        if problem:
            where = " (alibi-eval-lm --help lists the keys)" if key in ALIBI_FIELDS else ""
            raise ConfigError(f"model override {key!r}: {value!r} is not valid; {key} {problem}{where}")
        problem = override_problem(key, value, cfg)
        if problem:
            raise ConfigError(problem)
    if cfg is not None:
        _refuse_ineffective(overrides, cfg)
