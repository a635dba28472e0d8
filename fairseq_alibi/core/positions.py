"""Position methods: one registry entry each, the one place that says what a
method is, what it is built from and which context-extension methods apply.

A position method is one of three kinds:

* ``bias``: a ``[H, q, k]`` term added to the attention scores (ALiBi, T5's
  bucketed bias, Kerple, FIRE); its stack object is a ``bias.StackBias``, so
  every kernel of ``kernels.py`` runs it;
* ``rotation``: queries and keys rotated by their positions (RoPE), then
  bias-free causal attention;
* ``none``: no position information at all (NoPE): bias-free causal attention.

Adding a method: its maths in a module of this folder, one :class:`Position`
line in :data:`POSITIONS`; the fairseq side (``models/transformer_lm.py``)
registers a ``transformer_lm_<name>`` model for every entry, with the entry's
``params`` as config fields, and the sweep, the retrieval tool and the KV
cache find it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from .bias import AlibiBias, CausalMask, StackBias
from .errors import ConfigError, ScalingError
from .scaling import METHODS, Scaling


@dataclass(frozen=True)
class Param:
    """A parameter of a position method: its config field, default and ``--help``."""

    name: str
    default: Any
    help: str


#: ``build(num_heads, head_dim, params, scaling)`` -> the stack's position object.
Builder = Callable[[int, int, Dict[str, Any], Scaling], StackBias]


@dataclass(frozen=True)
class Position:
    """One position method: its ``name``, its ``kind`` (``bias``, ``rotation``
    or ``none``), the context-extension methods that apply to it
    (``extensions``, ``none`` among them), a one-line ``summary``, its
    ``params`` (config fields) and ``build``, which makes the object one layer
    stack shares."""

    name: str
    kind: str
    extensions: Tuple[str, ...]
    summary: str
    build: Builder
    params: Tuple[Param, ...] = ()


def _alibi(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return AlibiBias(num_heads, "causal", scaling)


def _nope(num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    return CausalMask(num_heads)


#: Every position method, in the order tables list them.
POSITIONS: Dict[str, Position] = {p.name: p for p in (
    Position("alibi", "bias", METHODS, "-m_h (i - j): a fixed slope per head (Press et al. 2022)", _alibi),
    Position("nope", "none", ("none",), "no position information: the causal mask alone (Haviv et al. 2022)",
             _nope),
)}


def position(name: str) -> Position:
    """The registry entry of ``name`` (``ConfigError`` naming the allowed ones)."""
    if name not in POSITIONS:
        raise ConfigError(f"position method {name!r} is not valid; allowed values: {', '.join(POSITIONS)}")
    return POSITIONS[name]


def check_extension(name: str, scaling: Scaling) -> Scaling:
    """``scaling`` if its method applies to position method ``name``, else a
    ``ScalingError`` naming the methods that do."""
    allowed = position(name).extensions
    if scaling.method not in allowed:
        raise ScalingError("method", scaling.method, f"{scaling.method} does not apply to {name} models; "
                           f"the methods that do: {', '.join(allowed)}")
    return scaling


def build(name: str, num_heads: int, head_dim: int, params: Dict[str, Any], scaling: Scaling) -> StackBias:
    """The position object of one layer stack of position method ``name``."""
    entry = position(name)
    return entry.build(num_heads, head_dim, params, check_extension(name, scaling))
