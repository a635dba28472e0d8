"""The ALiBi config fields of the plugin's models, and their one reader.

``AlibiConfig`` declares the fields every stack shares; ``AlibiEncoderConfig``
adds the encoders' own.  :func:`scaling_from_config` turns the fields into the
one scaling spec (``alibi.Scaling``), re-wording its errors with the config
keys, and :func:`check_override_keys` warns about ``alibi*`` keys no config has.
No ``from __future__ import annotations`` here: fairseq reads the field types
to build its argparse options.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import FairseqDataclass

from ..alibi import BIDIRECTIONAL_MODES, METHODS, Scaling, ScalingError
from ..bias import AlibiBias
from ..errors import ConfigError, closest, warn_once
from ..kernels import KERNEL_NAMES


def option(default, help: str):
    """A config field with its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass
class AlibiConfig(FairseqDataclass):
    alibi_interpolation: str = option(
        "none", f"context extension at evaluation: {' | '.join(METHODS)} (linear: every slope / factor; ntk: "
        "steepest head kept, flattest / factor, geometric in between; cap: every distance above "
        "factor x alibi_train_length counted as that distance, LM-Infinite)")
    alibi_scale_factor: float = option(
        0.0, "linear/ntk: 0 = dynamic, max(1, length / alibi_train_length), otherwise a static factor >= 1; "
        "cap: the cap in training lengths (any > 0; 0 = 1)")
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


#: Every ``alibi_*`` field of the plugin's models (override keys, hub keywords).
ALIBI_FIELDS = tuple(f.name for f in dataclasses.fields(AlibiEncoderConfig) if f.name.startswith("alibi_"))
#: The config key of each field of the scaling spec.
SCALING_KEYS = {"method": "alibi_interpolation", "factor": "alibi_scale_factor", "train_length": "alibi_train_length"}


def scaling_from_config(args) -> Scaling:
    """The scaling spec of a model config (resolved fields); ``ConfigError``
    naming the key for an invalid value, a warning for a factor ``none`` ignores."""
    method = getattr(args, "alibi_interpolation", "none")
    factor = getattr(args, "alibi_scale_factor", 0.0)
    try:
        scaling = Scaling(method, factor, getattr(args, "alibi_train_length", None)).complete()
    except ScalingError as exc:
        raise ConfigError(f"{SCALING_KEYS[exc.field]}={exc.value!r} is not valid; {exc.reason}") from None
    if method == "none" and factor not in (0, 1):
        warn_once(
            f"alibi_scale_factor={factor!r} has no effect with alibi_interpolation='none'; "
            "set alibi_interpolation to linear, ntk or cap"
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


def check_override_keys(overrides, cfg=None) -> None:
    """Check ``alibi*`` overrides before they reach a model: a key no model has is
    warned about (a typo would change nothing, silently), a value of the wrong
    type is a ``ConfigError`` naming the key (ranges are checked where the
    model is built), and keys given to a model without ALiBi (``cfg``: the
    checkpoint's config, when known) are warned about as having no effect."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ConfigError(f"model overrides must be a dict such as {{'alibi_interpolation': 'ntk'}}, "
                          f"got {type(overrides).__name__}: {overrides!r}")
    for key, value in overrides.items():
        if not (isinstance(key, str) and key.startswith("alibi")):
            continue
        if key not in ALIBI_FIELDS:
            warn_once(
                f"ignored model override {key!r}: no such ALiBi field{closest(key, ALIBI_FIELDS)} "
                f"(valid: {', '.join(ALIBI_FIELDS)})"
            )
            continue
        types, name = _FIELD_TYPES[key]
        choices = _FIELD_CHOICES.get(key)
        if isinstance(value, bool) or not isinstance(value, types) or (choices and value not in choices):
            allowed = f"one of {', '.join(map(repr, choices))}" if choices else name
            raise ConfigError(f"model override {key!r}: {value!r} is not valid; {key} takes {allowed} "
                              f"(alibi-eval-lm --help lists the keys)")
    model = getattr(cfg, "model", None) if cfg is not None else None
    if model is not None and "alibi_interpolation" not in model:
        given = sorted(k for k in overrides if isinstance(k, str) and k in ALIBI_FIELDS)
        if given:
            warn_once(f"model overrides {', '.join(given)} have no effect: the checkpoint's model "
                      f"({getattr(model, '_name', None) or 'unknown'}) has no ALiBi; it is evaluated as trained")
