"""The parameters of position methods and the values each takes: one
declaration per parameter, read by every entry point that can set one.

A position method (``positions.POSITIONS``) declares each of its options as a
:class:`Param`: its config field, its default, what it is, the values it takes
(a :class:`Range`) and its :data:`ROLES` entry, which says whether a trained
model may be evaluated with another value.  From that one declaration come

* the ``--help`` text of its flag (:attr:`Param.help`: what it is, the
  range, the default);
* the check of a value before anything is built (:meth:`Param.problem`), the
  same wherever the value comes from: a training flag (``--fire-hidden``,
  checked by the console scripts before fairseq loads), the model's config
  when it is built (hub keywords, Hydra, overrides), ``--model-overrides``,
  and the exported model's Hugging Face config;
* what an override at evaluation may do (:meth:`Param.override_problem`): a
  ``setting`` applies, a ``shape`` parameter would not fit the trained
  weights, a ``learned`` one is an initial value the weights replaced.

Declaring a new parameter::

    Param("fox_gate_bias", 5.0, "the forget gate's initial bias",
          Range(float, low=-20.0, high=20.0), LEARNED)

No torch or fairseq import: the console scripts check flags with it before
loading either, and it travels with every exported model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

#: The roles a parameter plays, and what an override at evaluation means for each.
SETTING, SHAPE, LEARNED = "setting", "shape", "learned"
ROLES = {
    SETTING: "computed from its value at every forward pass, so a trained model may be evaluated with another one",
    SHAPE: "it sets the model's shape (the sizes of its weights, or how they split into heads), so a trained "
           "model keeps the value it was trained with",
    LEARNED: "it is the initial value of a quantity the model learns, so a trained model holds the learned value "
             "in its weights and another initial value would change nothing",
}


def role_problem(name: str, role: str, value: Any, trained: Any, flag: Optional[str]) -> Optional[str]:
    """Why a model trained with ``name=trained`` cannot be evaluated with
    ``name=value`` (a ``shape`` or ``learned`` parameter), or None; ``flag``:
    the training flag that would give a model that value (None: no training
    takes it)."""
    if role == SETTING or value == trained:
        return None
    train = f", or train a model with {flag} {value!r}" if flag else ""
    return (f"model override {name}={value!r} cannot apply to this checkpoint (trained with {name}={trained!r}): "
            f"{ROLES[role]}; leave it out{train}")


def _number_text(value: float) -> str:
    """``1024``, ``0.5``, ``2147483647``, ``1e12``: how a range end is written in messages."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e10 else f"{value:g}".replace("e+", "e")


@dataclass(frozen=True)
class Range:
    """The values a parameter takes: finite numbers of ``kind`` (``int`` or
    ``float``; an ``int`` parameter refuses 2.5 and True) from ``low`` to
    ``high``, each end included unless ``open_low`` / ``open_high``; and the
    ``special`` values outside that interval, each with what it means (FIRE's
    threshold 0 means "the training length")."""

    kind: type
    low: float
    high: float
    open_low: bool = False
    open_high: bool = False
    special: Tuple[Tuple[Any, str], ...] = ()

    def allows(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if any(value == v for v, _ in self.special):
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    @property
    def text(self) -> str:
        """``an integer in [1, 1024]``, ``0 (the training length) or a number in [1, 2147483647]``."""
        what = "an integer" if self.kind is int else "a number"
        interval = (f"{'(' if self.open_low else '['}{_number_text(self.low)}, "
                    f"{_number_text(self.high)}{')' if self.open_high else ']'}")
        specials = "".join(f"{_number_text(v)} ({meaning}) or " for v, meaning in self.special)
        return f"{specials}{what} in {interval}"


@dataclass(frozen=True)
class Param:
    """One parameter of a position method.

    * ``name``: its config field (``--model-overrides`` key, hub keyword, HF
      config key); the training flag is ``--`` + the name with dashes;
    * ``default``: its value when not given (its type is the flag's type);
    * ``summary``: what it is, in a few words (error messages repeat it);
    * ``valid``: the :class:`Range` of values it takes, checked before any
      model is built;
    * ``role``: :data:`SETTING`, :data:`SHAPE` or :data:`LEARNED` (:data:`ROLES`);
    * ``note``: more for ``--help`` alone (how a value is rounded, ...).
    """

    name: str
    default: Any
    summary: str
    valid: Range
    role: str = SETTING
    note: str = ""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Param {self.name}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if not self.valid.allows(self.default):
            raise ValueError(f"Param {self.name}: the default {self.default!r} is not {self.valid.text}")

    @property
    def flag(self) -> str:
        """The training flag: ``--fire-hidden``."""
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        """The ``--help`` text: what it is, the values it takes, its default."""
        note = f" ({self.note})" if self.note else ""
        return f"{self.summary}{note}: {self.valid.text}; default {self.default!r}"

    def problem(self, value: Any) -> Optional[str]:
        """``"must be ..."`` if ``value`` is not one this parameter takes, else None."""
        return None if self.valid.allows(value) else f"must be {self.valid.text} ({self.summary})"

    def override_problem(self, value: Any, trained: Any) -> Optional[str]:
        """Why a trained model (whose config holds ``trained``) cannot be
        evaluated with ``value``, as one sentence naming the key, or None: a
        ``setting`` takes any value in range, the other roles only the one
        trained with (:func:`role_problem`)."""
        refused = role_problem(self.name, self.role, value, trained, self.flag if self.valid.allows(value) else None)
        if refused:
            return refused
        problem = self.problem(value)
        return f"model override {self.name}={value!r} is not valid; it {problem}" if problem else None
