"""How a model extends its context at evaluation: the one scaling spec.

:class:`Scaling` (method, factor, training length, tail parameter) is validated
in ``__post_init__`` only, by one function per field, and translated to and
from every spelling users write: ``--methods`` items (:meth:`Scaling.parse`,
:attr:`Scaling.spelling`), model config fields and ``--model-overrides``
(:meth:`Scaling.from_config`, :meth:`Scaling.config_values`), the Hugging Face
``alibi_scaling`` dictionary (:meth:`Scaling.from_hf`, :meth:`Scaling.to_hf`)
and keyword arguments (the constructor, ``hf.apply_alibi_scaling``).

The spec says *what* is asked for; the maths of each method lives with the
position method it applies to (``alibi.py``: slopes, distances, penalties),
and ``positions.py`` says which methods apply to which position method.
:data:`METHOD_TABLE` is the one table of methods: the README, ``--help`` and
the docs are checked against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from .errors import ScalingError, plural, warn_once, warned


@dataclass(frozen=True)
class MethodInfo:
    """One context-extension method: its name, its kind (``none``; ``scale``: a
    static factor >= 1 or dynamic; ``distance``: acts past ``C = factor x
    train_length``), its tail parameter's default (or None), whether the bias
    it gives depends on ``i - j`` alone, and a one-line summary for tables."""

    name: str
    kind: str
    summary: str
    default_alpha: Optional[float] = None
    relative: bool = True


#: Every context-extension method, in the order tables list them.
METHOD_TABLE: Tuple[MethodInfo, ...] = (
    MethodInfo("none", "none", "as trained"),
    MethodInfo("linear", "scale", "position interpolation: distances / factor (ALiBi: every slope / factor; RoPE: "
               "every frequency / factor)"),
    MethodInfo("ntk", "scale", "NTK-aware: fast components kept, slow ones / factor, geometric in between (ALiBi: "
               "steepest head kept, flattest slope / factor; RoPE: base x factor^(d / (d - 2)))"),
    MethodInfo("yarn", "scale", "RoPE only: each frequency between kept and / factor by its wavelength against L "
               "(beta 32 and 1), logits scaled by (0.1 ln factor + 1)^2 (YaRN)"),
    MethodInfo("cap", "distance", "every distance past C counted as C (LM-Infinite's distance limit)"),
    MethodInfo("log", "distance", "distances past C grow as C + alpha C ln(d / C)", default_alpha=1.0),
    MethodInfo("power", "distance", "the cap minus alpha ln(d / C): far weights fall as (C / d) ** alpha",
               default_alpha=1.5),
    MethodInfo("capnorm", "distance", "the cap, the far keys' total weight held at that of C keys", relative=False),
    MethodInfo("logn", "logit", "any position method: each query's logits times max(1, ln n / ln B), n the keys "
               "it sees, B = F x L (default L): log-n scaling, Qwen's logn attention"),
)
METHOD_INFO: Dict[str, MethodInfo] = {m.name: m for m in METHOD_TABLE}
METHODS = tuple(METHOD_INFO)
#: Methods with a factor that is static (>= 1) or dynamic (0: ``max(1, keys / L)``).
SCALE_METHODS = tuple(m.name for m in METHOD_TABLE if m.kind == "scale")
#: Methods that change the bias past ``C = factor x train_length``.
DISTANCE_METHODS = tuple(m.name for m in METHOD_TABLE if m.kind == "distance")
#: Methods that scale each query's logits by a function of the keys it sees
#: (``logit_scale.py``), leaving the position method's bias or rotation alone.
LOGIT_METHODS = tuple(m.name for m in METHOD_TABLE if m.kind == "logit")
#: Methods whose factor counts training lengths (``0`` means 1): ``C`` of the
#: distance methods, the base length ``B`` of the logit methods.
LENGTH_METHODS = DISTANCE_METHODS + LOGIT_METHODS
#: The tails' ``alpha`` when none is given (docs/retrieval.md, "Which method, when").
DEFAULT_ALPHA = {m.name: m.default_alpha for m in METHOD_TABLE if m.default_alpha is not None}
TAIL_METHODS = tuple(DEFAULT_ALPHA)
#: The ``--methods`` grammar, for messages and ``--help``.
METHOD_SYNTAX = ", ".join(
    m.name + {"none": "", "scale": "[:F|:dynamic]", "logit": "[:F]",
              "distance": "[:F[:ALPHA]]" if m.default_alpha else "[:F]"}[m.kind]
    for m in METHOD_TABLE)

#: The config key of each field of the spec (fairseq model configs, ``--model-overrides``).
CONFIG_KEYS = {"method": "alibi_interpolation", "factor": "alibi_scale_factor", "train_length": "alibi_train_length",
               "alpha": "alibi_tail_alpha"}
#: The config field of the one spelling (a ``--methods`` item, ``ntk:2``), named for what it holds,
#: for every position method; ``CONFIG_KEYS``' method, factor and alpha are its older names (aliases).
SPELLING_KEY = "position_scaling"
#: The keys an ``alibi_scaling`` dictionary (Hugging Face configs) may hold.
HF_KEYS = ("type", "factor", "train_seq_len", "alpha")
_DYNAMIC = ("dynamic", "dyn")
#: The longest length a factor may stand for, in tokens: fairseq's int32 lengths (``positions.MAX_TOKENS``).
#: A factor counts training lengths (each at least one token), so no factor is above it either, and
#: ``factor x train_length`` (a scale method's extended context, ``C``, a logit method's ``B``) is not.
MAX_TOKENS = 2**31 - 1


# ------------------------------------------------------------------ one check per field
def real(value) -> Optional[float]:
    """``value`` as a float if it is a real number (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def checked_method(method) -> str:
    if method not in METHOD_INFO:
        raise ScalingError("method", method, f"allowed values: {', '.join(METHODS)}")
    return method


def factor_rule(method: str) -> str:
    """What a factor of ``method`` must be, worded once for every entry point
    (``--methods``, config fields and overrides, ``alibi_scaling``, keywords)."""
    if method in SCALE_METHODS:
        return f"{method} takes a static factor >= 1, or dynamic scaling (max(1, length / training length))"
    if method in DISTANCE_METHODS:
        return f"{'the cap' if method == 'cap' else method + chr(39) + 's C'} must be a positive number of training lengths"
    if method in LOGIT_METHODS:
        return f"{method}'s base length must be a positive number of training lengths"
    return "it must be a finite number >= 0"


def checked_factor(method: str, factor) -> float:
    """The factor of a valid (method, factor), normalized: ``none`` stores 1, a
    distance method's ``0`` is 1 (the training length itself), a scale method's
    ``0`` is dynamic."""
    value = real(factor)
    if value is None or not math.isfinite(value) or value < 0 or (method in SCALE_METHODS and 0 < value < 1):
        raise ScalingError("factor", factor, factor_rule(method))
    if method != "none" and value > MAX_TOKENS:
        raise ScalingError("factor", factor, f"{factor_rule(method)}, and F x the training length a number of "
                           f"tokens, at most {MAX_TOKENS} (int32)")
    if method == "none" or (method in LENGTH_METHODS and value == 0):
        return 1.0
    return value


def checked_alpha(method: str, alpha) -> Optional[float]:
    """A tail method's ``alpha`` (its default when not given); None for other methods."""
    if method not in TAIL_METHODS:
        if alpha is not None:
            raise ScalingError("alpha", alpha, f"only the tails ({', '.join(TAIL_METHODS)}) take alpha")
        return None
    if alpha is None:
        return DEFAULT_ALPHA[method]
    value = real(alpha)
    if value is None or not math.isfinite(value) or value <= 0:
        raise ScalingError("alpha", alpha, "the tail's growth must be a finite number > 0 (alpha = 0 is cap)")
    return value


def checked_train_length(length) -> Optional[int]:
    """A training length: None (unknown) or a positive integer."""
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MAX_TOKENS):
        raise ScalingError("train_length", length, f"it must be an integer in [1, {MAX_TOKENS}] (the training tokens_per_sample)")
    return length


def _number(text: str, what: str, dynamic_allowed: bool) -> float:
    """A number written in a ``--methods`` item."""
    try:
        return float(text)
    except ValueError:
        raise ScalingError(what, text, "expected a number" + (" or 'dynamic'" if dynamic_allowed else "")) from None


@dataclass(frozen=True)
class Scaling:
    """How one model extends its context at evaluation; validated on creation.

    * ``method``: one of :data:`METHODS` (:data:`METHOD_TABLE` says what each does);
    * ``factor``: for the scale methods ``0`` means dynamic, ``max(1, keys /
      train_length)`` per forward pass, else a static factor ``>= 1``; for the
      distance methods ``C`` in training lengths (any ``F > 0``; ``0`` means 1);
      ``none`` stores 1 whatever is given;
    * ``train_length``: the length the model was trained at; dynamic scaling
      and the distance methods need it (:meth:`complete` checks);
    * ``alpha``: the tail's growth (``log`` and ``power`` only; defaults :data:`DEFAULT_ALPHA`).
    """

    method: str = "none"
    factor: float = 0.0
    train_length: Optional[int] = None
    alpha: Optional[float] = None

    def __post_init__(self):
        method = checked_method(self.method)
        object.__setattr__(self, "factor", checked_factor(method, self.factor))
        object.__setattr__(self, "alpha", checked_alpha(method, self.alpha))
        length = checked_train_length(self.train_length)
        if length is not None and self.factor * length > MAX_TOKENS and method != "none":
            raise ScalingError("factor", self.factor, f"{method} at {self.factor:g} x {length} training tokens stands "
                               f"for {self.factor * length:g} tokens, past the longest length, {MAX_TOKENS} "
                               f"(int32): give a factor of at most {MAX_TOKENS // length}")
        if length is not None and method in DISTANCE_METHODS and self.factor * length < 1:
            raise ScalingError("factor", self.factor, f"{method} at {self.factor:g} x {length} training tokens "
                               f"starts at {self.factor * length:g} tokens; C must be at least one token")
        if length is not None and method in LOGIT_METHODS and self.factor * length < 2:
            raise ScalingError("factor", self.factor, f"{method} at {self.factor:g} x {length} training tokens has a "
                               f"base length of {self.factor * length:g} tokens; it must be at least 2 (ln B > 0)")

    # --------------------------------------------------------------- spellings
    @classmethod
    def parse(cls, text: str, train_length: Optional[int] = None) -> "Scaling":
        """A ``--methods`` item (:data:`METHOD_SYNTAX`): ``none``, ``ntk``,
        ``ntk:2``, ``linear:dynamic``, ``cap:0.5``, ``log:1:0.25``."""
        name, _, arg = str(text).strip().partition(":")
        name, arg = name.strip().lower(), arg.strip().lower()
        checked_method(name)
        if name == "none" and (arg or ":" in str(text)):
            raise ScalingError("method", text, "'none' takes no factor")
        alpha = None
        if name in TAIL_METHODS and ":" in arg:
            arg, _, text_alpha = arg.partition(":")
            alpha = _number(text_alpha.strip(), "alpha", False)
        elif ":" in arg:
            raise ScalingError("method", text, f"{name} takes one parameter; allowed: {METHOD_SYNTAX}")
        arg = arg.strip()
        if not arg and ":" in str(text):  # ``yarn:`` (a script's ``yarn:$F`` with F unset): no method's spelling
            raise ScalingError("factor", arg, "a factor must follow the colon: " + factor_rule(name) + (
                f": write {name}:F, or for dynamic scaling {name}:dynamic or {name} alone" if name in SCALE_METHODS
                else f": write {name}:F, or {name} alone for F = 1"))
        if arg in _DYNAMIC and name not in SCALE_METHODS:
            raise ScalingError("factor", arg, f"{name} has no dynamic form; {name}:F starts at F training lengths")
        factor = 0.0 if arg in _DYNAMIC + ("",) else _number(arg, "factor", name in SCALE_METHODS)
        if factor <= 0 and arg not in _DYNAMIC + ("",):  # the grammar spells dynamic as a word, and C > 0
            raise ScalingError("factor", arg, factor_rule(name) + (f"; for dynamic scaling write {name}:dynamic or "
                                                                   f"{name} alone" if name in SCALE_METHODS else ""))
        return cls(name, factor, train_length, alpha)

    @property
    def spelling(self) -> str:
        """The ``--methods`` item: ``none``, ``ntk``, ``ntk:2``, ``cap``, ``cap:0.5``, ``log:1:0.25``."""
        if self.method == "none" or self.dynamic:
            return self.method
        if self.method in TAIL_METHODS and self.alpha != DEFAULT_ALPHA[self.method]:
            return f"{self.method}:{self.factor:g}:{self.alpha:g}"
        if self.method in LENGTH_METHODS and self.factor == 1:
            return self.method
        return f"{self.method}:{self.factor:g}"

    @property
    def label(self) -> str:
        """For tables: ``none``, ``linear dynamic``, ``ntk x2``, ``cap x0.5``, ``log x1 a0.5``."""
        if self.method == "none":
            return "none"
        if self.dynamic:
            return f"{self.method} dynamic"
        tail = f" a{self.alpha:g}" if self.method in TAIL_METHODS else ""
        return f"{self.method} x{self.factor:g}{tail}"

    @property
    def key(self) -> Tuple[str, float, Optional[float]]:
        """What identifies the method in stored results: (method, factor, alpha)."""
        return (self.method, float(self.factor), self.alpha)

    @classmethod
    def from_record(cls, record: Dict[str, Any], train_length: Optional[int] = None) -> "Scaling":
        """The spec of a stored result (``method``, ``factor``, ``alpha`` fields)."""
        return cls(record["method"], record["factor"], train_length, record.get("alpha"))

    @classmethod
    def from_config(cls, cfg) -> "Scaling":
        """The spec of a model config (attributes or a dict): ``position_scaling``
        (one spelling, ``ntk:2``) or its older names, the ``alibi_*`` fields
        (``alibi_interpolation``, ``alibi_scale_factor``, ``alibi_tail_alpha``);
        both given and different is refused.  Errors name the config key
        (``alibi_scale_factor=...``, ``position_scaling=...``)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda key, default=None: getattr(cfg, key, default))
        train_length = get(CONFIG_KEYS["train_length"], None)
        spelled = get(SPELLING_KEY, None)
        if isinstance(spelled, str) and spelled.strip() and get(CONFIG_KEYS["method"], "none") in (None, "none"):
            return cls._spelled_with_older_values(spelled, train_length, get)
        try:
            aliases = cls(get(CONFIG_KEYS["method"], "none"), get(CONFIG_KEYS["factor"], 0.0), train_length,
                          get(CONFIG_KEYS["alpha"], None))
        except ScalingError as exc:
            raise exc.renamed(CONFIG_KEYS) from None
        spelled = get(SPELLING_KEY, None)
        if spelled is None or (isinstance(spelled, str) and not spelled.strip()):
            return aliases
        if not isinstance(spelled, str):
            raise ScalingError(SPELLING_KEY, spelled, f"give one method spelling ({METHOD_SYNTAX})")
        try:
            scaling = cls.parse(spelled, train_length)
        except ScalingError as exc:
            raise ScalingError(SPELLING_KEY, spelled, exc.reason) from None
        if aliases.method != "none" and aliases.key != scaling.key:
            raise ScalingError(SPELLING_KEY, spelled, f"the older names of the same setting say {aliases.spelling} "
                               f"({CONFIG_KEYS['method']}={aliases.method!r}, {CONFIG_KEYS['factor']}="
                               f"{aliases.factor:g}); give one of the two")
        return scaling

    @classmethod
    def _spelled_with_older_values(cls, spelled: str, train_length, get) -> "Scaling":
        """``position_scaling`` where the older method name is unset: the older
        factor and alpha, read by nothing now, must be unset or agree with it
        (``--position-scaling linear:2 --alibi-scale-factor 4`` would otherwise
        evaluate at 2 without a word)."""
        try:
            scaling = cls.parse(spelled, train_length)
        except ScalingError as exc:
            raise ScalingError(SPELLING_KEY, spelled, exc.reason) from None
        factor, alpha = get(CONFIG_KEYS["factor"], 0.0), get(CONFIG_KEYS["alpha"], None)
        for key, value, meant in (("factor", factor, scaling.factor), ("alpha", alpha, scaling.alpha)):
            unset = value is None or (key == "factor" and not isinstance(value, bool) and real(value) == 0)
            if not unset and (meant is None or real(value) != meant):
                has = f"{scaling.method} takes no {key}" if meant is None else f"{key} {meant:g}"
                raise ScalingError(CONFIG_KEYS[key], value, f"{SPELLING_KEY}={spelled!r} sets the method ({has}); "
                                   f"give the {key} in {SPELLING_KEY} alone ({METHOD_SYNTAX})")
        return scaling

    def config_values(self) -> Dict[str, Any]:
        """The config fields (``--model-overrides``) that select this method: ``position_scaling``,
        and its older names set to agree with it (a checkpoint may hold either)."""
        values = {SPELLING_KEY: self.spelling, CONFIG_KEYS["method"]: self.method,
                  CONFIG_KEYS["factor"]: 0.0 if self.method == "none" else self.factor}
        if self.alpha is not None:
            values[CONFIG_KEYS["alpha"]] = self.alpha
        return values

    @classmethod
    def from_hf(cls, value: Any, train_length: Optional[int]) -> "Scaling":
        """The spec of an ``alibi_scaling`` value (BTLM's convention, extended):
        ``None`` or ``{"type": "none"}``; ``{"type": <scale method>, "factor":
        F}`` (static) or ``{..., "train_seq_len": N}`` (dynamic); ``{"type":
        <distance method>, "factor": F}``, with ``"alpha": A`` for the tails
        (C in training lengths, ``train_length``: the model's
        ``alibi_train_length``).  Errors name ``alibi_scaling``."""

        def invalid(reason: str) -> ScalingError:
            return ScalingError("alibi_scaling", value, reason)

        if value is None:
            value = {"type": "none"}
        if not isinstance(value, dict):
            raise invalid('give a dictionary such as {"type": "linear", "factor": 2.0}, or None')
        unknown = sorted(str(key) for key in value if key not in HF_KEYS)
        if unknown:
            raise invalid(f"unknown {plural(len(unknown), 'key')} {', '.join(unknown)}; allowed keys: "
                          f"{', '.join(HF_KEYS)}")
        method = value.get("type")
        if method not in METHOD_INFO:
            raise invalid(f"type must be one of {', '.join(METHODS)}")
        has_factor, has_length = "factor" in value, "train_seq_len" in value
        if method == "none" and (has_factor or has_length):
            raise invalid("type 'none' takes neither factor nor train_seq_len")
        if method in SCALE_METHODS and has_factor == has_length:
            raise invalid(f'{method} takes "factor": F (static, F >= 1) or "train_seq_len": N '
                          "(dynamic, max(1, length / N)), exactly one of them")
        if method in LOGIT_METHODS and has_length:
            raise invalid(f'{method} takes "factor": F (its base length in training lengths, alibi_train_length; '
                          "default 1), no train_seq_len")
        if method in DISTANCE_METHODS and (has_length or not has_factor):
            raise invalid(f'{method} takes "factor": F (C in training lengths, alibi_train_length)'
                          + (' and optionally "alpha": A' if method in TAIL_METHODS else "") + ", no train_seq_len")
        if has_factor and real(value["factor"]) == 0:  # dynamic is spelled with train_seq_len here
            raise invalid(f"factor must be a positive number (for dynamic {method} give train_seq_len instead)"
                          if method in SCALE_METHODS else "factor must be a positive number of training lengths")
        length = value["train_seq_len"] if has_length else train_length
        try:
            return cls(method, value.get("factor", 0.0), length, value.get("alpha")).complete()
        except ScalingError as exc:
            name = {"train_length": "train_seq_len" if has_length else "alibi_train_length"}.get(exc.field, exc.field)
            raise invalid(f"{name}={exc.value!r}: {exc.reason}") from None

    def to_hf(self) -> Optional[dict]:
        """The ``alibi_scaling`` value of this spec (None for no scaling)."""
        if self.method == "none":
            return None
        if self.dynamic:
            return {"type": self.method, "train_seq_len": self.complete().train_length}
        value = {"type": self.method, "factor": float(self.factor)}
        if self.alpha is not None:
            value["alpha"] = float(self.alpha)
        return value

    # --------------------------------------------------------------- meaning
    @property
    def info(self) -> MethodInfo:
        return METHOD_INFO[self.method]

    @property
    def dynamic(self) -> bool:
        return self.method in SCALE_METHODS and self.factor == 0

    @property
    def needs_train_length(self) -> bool:
        return self.dynamic or self.method in LENGTH_METHODS

    @property
    def relative(self) -> bool:
        """The bias depends on ``i - j`` alone (every method but ``capnorm``,
        whose far-key term depends on how many keys lie past ``C``)."""
        return self.info.relative

    def complete(self) -> "Scaling":
        """``self``, after checking it has the training length it needs."""
        if self.needs_train_length and self.train_length is None:
            what = "dynamic scaling (factor 0)" if self.dynamic else f"{self.method} (which starts at F x L)"
            raise ScalingError("train_length", None, f"{what} needs the length L the model was trained at, which "
                               "was not given and is not recorded: pass it (train_length=L, alibi_train_length)")
        return self

    def with_train_length(self, train_length: Optional[int]) -> "Scaling":
        return replace(self, train_length=train_length)

    def for_model(self, recorded: Optional[int]) -> "Scaling":
        """This spec on a model that records training length ``recorded``: the
        recorded length where none was given; a distance method's ``C`` counts
        in the model's own training length, so another one is refused.
        Complete (:meth:`complete`)."""
        if self.train_length is None:
            return self.with_train_length(recorded).complete()
        if self.method in LENGTH_METHODS and recorded is not None and self.train_length != recorded:
            raise ScalingError("train_length", self.train_length, f"{self.method} counts "
                               f"{'C' if self.method in DISTANCE_METHODS else 'its base length'} in the model's own "
                               f"training length alibi_train_length={recorded}; leave train_length out")
        return self.complete()

    def factor_at(self, key_length: Union[int, Tensor]) -> Union[float, Tensor]:
        """The scale factor of a forward pass (of one row) over ``key_length``
        keys (always 1 for the methods without one).  A tensor length (a static
        KV cache's under ``torch.compile``, or one per row) gives a tensor
        factor, without a branch on its value."""
        if self.method not in SCALE_METHODS:
            return 1.0
        if not self.dynamic:
            return self.factor
        ratio = key_length / float(self.complete().train_length)
        return ratio.clamp(min=1.0) if isinstance(ratio, Tensor) else max(1.0, ratio)

    @property
    def distance_limit(self) -> Optional[int]:
        """``C``, the distance past which a distance method acts, or None."""
        if self.method not in DISTANCE_METHODS:
            return None
        return max(1, round(self.factor * self.complete().train_length))

    @property
    def logit_base(self) -> Optional[float]:
        """``B = factor x train_length``, the key count past which a logit
        method scales the logits (``ln n / ln B``), or None for other methods."""
        if self.method not in LOGIT_METHODS:
            return None
        return self.factor * self.complete().train_length

    def at_factor(self, factor: float) -> "Scaling":
        """The static spec a dynamic one is at ``factor`` (one row's, one pass's)."""
        return replace(self, factor=float(factor)) if self.dynamic else self


NO_SCALING = Scaling()


def check_applies(scaling: Scaling, position: str, allowed) -> Scaling:
    """``scaling`` if its method is among ``allowed`` (what a position method's
    maths handles), else one ``ScalingError`` naming the methods that apply."""
    if scaling.method not in allowed:
        raise ScalingError("method", scaling.method, f"{scaling.method} does not apply to {position} models; "
                           f"the methods that do: {', '.join(allowed)}")
    return scaling


def warn_if_cache_drifts(scaling: Scaling, cached: Union[int, Tensor], keys: Union[int, Tensor]) -> None:
    """Warn once that a KV-cache step under dynamic scaling past the training
    length approximates a full forward: the cached keys and values (of every
    layer after the first) were computed under earlier, smaller factors.
    ``cached``: the keys already in the cache; ``keys``: cached + new, an int
    or one count per row.  Every generation path calls it (fairseq's
    incremental decoding, exported models, the Hugging Face hooks); once said,
    it reads no tensor again (no device sync per step)."""
    if not scaling.dynamic or torch.compiler.is_compiling():
        return
    length = scaling.complete().train_length
    message = (f"dynamic {scaling.method} scaling past the training length ({length} tokens) with a KV cache: "
               "cached keys keep the scaling of the earlier, smaller factors they were computed under (ALiBi's slopes, "
               "RoPE's rotations), so generation approximates a full forward "
               f"of the same text; for exact generation use a static {scaling.method} factor (the longest length "
               f"/ {length})")
    if message in warned or int(cached) == 0:
        return
    if int(keys.max() if isinstance(keys, Tensor) else keys) > length:
        warn_once(message)
