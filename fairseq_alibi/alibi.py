"""The ALiBi maths: head slopes, the scaling spec and the one bias function.

Pure torch, no fairseq import, so that every formula here can be read and
tested on its own (and travels with every exported Hugging Face model).  The
module holds the two ideas of this project, each once:

* :class:`Scaling`, how a model extends its context at evaluation (method,
  its parameters, the training length), validated in ``__post_init__`` only,
  with its translations to and from every spelling users write: ``--methods``
  items (:meth:`Scaling.parse`, :attr:`Scaling.spelling`), model config fields
  and ``--model-overrides`` (:meth:`Scaling.from_config`,
  :meth:`Scaling.config_values`), the Hugging Face ``alibi_scaling``
  dictionary (:meth:`Scaling.from_hf`, :meth:`Scaling.to_hf`) and keyword
  arguments (the constructor, ``hf.apply_alibi_scaling``);
* :func:`bias`, the one function from query and key positions to the bias:
  the dense bias, the chunked kernel's ramp, FlexAttention's ``score_mod``,
  the Hugging Face hooks and the exported model all call it.

A new method is a branch of :meth:`Scaling.distance` (a distance transform,
times the slope), of :meth:`Scaling.penalty` (a bias term of its own) or of
:func:`slope_exponents` (a slope scaling), plus an entry in :data:`METHODS`;
every path then has it.

Conventions:

* ``slopes`` is a float32 tensor of shape ``[H]``, one positive slope per head;
* a bias is *added* to attention scores, so ALiBi's bias is ``-slope * distance``;
* query ``i`` and key ``j`` are absolute positions; with a KV cache the ``q_len``
  queries are the last ``q_len`` positions of the ``k_len`` keys.

Distances are exact integers (held in float32, exact below 2**24 positions),
multiplied by the slope in float32 before the single final cast, so the bias
for nearby keys (the ones that matter after softmax) keeps full relative
precision in fp16/bf16 at any length.  The reference fork's ``+slope * j``
shortcut does not: at 16K keys fp16 cannot tell adjacent values of ``slope * j``
apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

#: Context-extension methods (docs/usage.md has the table):
#: ``linear`` and ``ntk`` scale the slopes; ``cap``, ``log``, ``power`` and
#: ``capnorm`` change the bias past ``C = factor x train_length``; ``none`` changes nothing.
METHODS = ("none", "linear", "ntk", "cap", "log", "power", "capnorm")
SLOPE_METHODS = ("linear", "ntk")
DISTANCE_METHODS = ("cap", "log", "power", "capnorm")
#: The methods with a tail parameter ``alpha``, and its value when none is given
#: (docs/retrieval.md, "Which method, when", has the measurements):
#: ``log``: past C the distance grows as ``C + alpha C ln(d / C)``;
#: ``power``: past C the bias is the cap's minus ``alpha ln(d / C)`` (weights fall as ``(C / d) ** alpha``).
DEFAULT_ALPHA = {"log": 1.0, "power": 1.5}  # the members frontier.sh chose on its tune side (docs/retrieval.md)
TAIL_METHODS = tuple(DEFAULT_ALPHA)
#: The ``--methods`` grammar, for messages and ``--help``.
METHOD_SYNTAX = ("none, linear[:F|:dynamic], ntk[:F|:dynamic], cap[:F], log[:F[:ALPHA]], power[:F[:ALPHA]] "
                 "or capnorm[:F]")

BIAS_MODES = ("causal", "symmetric", "split", "learned")
BIDIRECTIONAL_MODES = ("symmetric", "split", "learned")


# ---------------------------------------------------------------------------
# Slopes
# ---------------------------------------------------------------------------


def _power_of_two_slopes(n: int) -> list:
    """Geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8)."""
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def _check_heads(num_heads) -> None:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")


def get_slopes(num_heads: int) -> Tensor:
    """The paper's per-head slopes, in the paper's head order, as float32 ``[H]``
    on the CPU (also inside a ``torch.device("meta")`` block: slopes are data).

    For ``H`` not a power of two: the slopes of the closest lower power of two
    ``c``, then every other slope of the ``2c`` sequence, first ``H - c`` of them
    (so the sequence is not monotonic, exactly as in the reference code).
    """
    _check_heads(num_heads)
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = _power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")


def slope_exponents(slopes: Tensor, method: str) -> Tensor:
    """float32 ``[H]`` ``t`` of ``slope / factor ** t``, computed once per model
    (a forward pass then has no branch on tensor values):

    * ``linear`` (position interpolation): ``t = 1``, every slope / factor;
    * ``ntk`` (NTK-ALiBi): ``t = (log m_max - log m) / (log m_max - log m_min)``,
      the steepest head unchanged, the flattest / factor, geometric in between;
      with equal slopes (one head) there is no spread and ``t = 1`` (linear);
    * every other method: ``t = 0`` (slopes unchanged).
    """
    slopes = slopes.detach().to(torch.float32)
    if method == "linear":
        return torch.ones_like(slopes)
    if method != "ntk":
        return torch.zeros_like(slopes)
    log_slopes = slopes.log()
    spread = float(log_slopes.max() - log_slopes.min())
    if spread <= 0:
        return torch.ones_like(slopes)
    return (log_slopes.max() - log_slopes) / spread


def scale_slopes(slopes: Tensor, method: str, factor: float) -> Tensor:
    """Slopes for evaluating ``factor`` times longer than the training length
    (``slopes / factor ** slope_exponents(slopes, method)``)."""
    if method not in METHODS:
        raise ScalingError("method", method, f"allowed values: {', '.join(METHODS)}")
    factor = float(factor)
    if not factor >= 1.0 or math.isinf(factor):
        raise ScalingError("factor", factor, "a slope-scaling factor must be a finite number >= 1")
    return slopes.to(torch.float32) / factor ** slope_exponents(slopes, method)


# ---------------------------------------------------------------------------
# The scaling spec and its spellings
# ---------------------------------------------------------------------------


class ScalingError(ValueError):
    """An invalid scaling setting.  ``field`` is the name the user wrote it
    under (``factor``, ``alibi_scale_factor``, ``alibi_scaling``, ...), ``value``
    what was given, ``reason`` what is allowed; ``str()`` reads on its own."""

    def __init__(self, field: str, value, reason: str):
        super().__init__(f"{field}={value!r} is not valid; {reason}")
        self.field, self.value, self.reason = field, value, reason

    def renamed(self, names: Dict[str, str]) -> "ScalingError":
        """The same error under the user's name for the field (``names[field]``)."""
        return ScalingError(names.get(self.field, self.field), self.value, self.reason)


def _real(value) -> Optional[float]:
    """``value`` as a float if it is a real number (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _checked_factor(method: str, factor) -> float:
    """The factor of a valid (method, factor), normalized: ``none`` stores 1,
    a distance method's ``0`` is 1 (the training length itself)."""
    if method not in METHODS:
        raise ScalingError("method", method, f"allowed values: {', '.join(METHODS)}")
    value = _real(factor)
    if value is None or not math.isfinite(value) or value < 0:
        raise ScalingError("factor", factor, "it must be a finite number >= 0")
    if method in SLOPE_METHODS and 0 < value < 1:
        raise ScalingError("factor", factor,
                           "use 0 for dynamic scaling (max(1, length / training length)) or a static factor >= 1")
    if method == "none" or (method in DISTANCE_METHODS and value == 0):
        return 1.0
    return value


def _checked_alpha(method: str, alpha) -> Optional[float]:
    """A tail method's ``alpha`` (its default when not given); None for other methods."""
    if method not in TAIL_METHODS:
        if alpha is not None:
            raise ScalingError("alpha", alpha, f"only the tails ({', '.join(TAIL_METHODS)}) take alpha")
        return None
    if alpha is None:
        return DEFAULT_ALPHA[method]
    value = _real(alpha)
    if value is None or not math.isfinite(value) or value <= 0:
        raise ScalingError("alpha", alpha, "the tail's growth must be a finite number > 0 (alpha = 0 is cap)")
    return value


def _parsed_number(method: str, arg: str, what: str) -> float:
    try:
        value = float(arg)
    except ValueError:
        raise ScalingError(what, arg, "expected a number" + (" or 'dynamic'" if method in SLOPE_METHODS else "")) from None
    return value


def _parsed_factor(method: str, arg: str) -> float:
    """The factor of ``--methods`` item ``method:arg`` (``dynamic`` or nothing: 0)."""
    if method in DISTANCE_METHODS and arg in ("dynamic", "dyn"):
        raise ScalingError("factor", arg, f"{method} has no dynamic form; {method}:F starts at F training lengths")
    if arg in ("", "dynamic", "dyn"):
        return 0.0
    factor = _parsed_number(method, arg, "factor")
    if factor <= 0 or (method in SLOPE_METHODS and factor < 1):
        what = "the cap" if method == "cap" else f"{method}'s C"
        raise ScalingError("factor", arg, "a static factor must be >= 1 (write 'dynamic' or leave it out for "
                           "dynamic scaling)" if method in SLOPE_METHODS else f"{what} must be a positive number "
                           "of training lengths")
    return factor


#: The config key of each field of the spec (fairseq model configs, ``--model-overrides``).
CONFIG_KEYS = {"method": "alibi_interpolation", "factor": "alibi_scale_factor", "train_length": "alibi_train_length",
               "alpha": "alibi_tail_alpha"}
#: The keys an ``alibi_scaling`` dictionary (Hugging Face configs) may hold.
HF_KEYS = ("type", "factor", "train_seq_len", "alpha")


@dataclass(frozen=True)
class Scaling:
    """How one model extends its context at evaluation; validated on creation.

    * ``method``: ``none``; ``linear`` (every slope / factor) or ``ntk``
      (steepest head kept, flattest / factor, geometric in between); or a
      change of the bias past ``C = factor x train_length``: ``cap`` (every
      distance above ``C`` seen as ``C``, LM-Infinite's distance limit),
      ``log`` (a log tail, distances ``C + alpha C ln(d / C)``), ``power``
      (the cap minus ``alpha ln(d / C)``: far weights fall as ``(C / d) **
      alpha`` in every head) or ``capnorm`` (the cap, and the far keys' total
      weight held at that of ``C`` keys);
    * ``factor``: for ``linear``/``ntk`` ``0`` means dynamic,
      ``max(1, keys / train_length)`` per forward pass, else a static factor
      ``>= 1``; for the distance methods ``C`` in training lengths (any
      ``F > 0``; ``0`` means 1); ``none`` stores 1 whatever is given;
    * ``train_length``: the length the model was trained at; dynamic methods and
      the distance methods need it (:meth:`complete` checks);
    * ``alpha``: the tail's growth (``log`` and ``power`` only; defaults ``DEFAULT_ALPHA``).
    """

    method: str = "none"
    factor: float = 0.0
    train_length: Optional[int] = None
    alpha: Optional[float] = None

    def __post_init__(self):
        object.__setattr__(self, "factor", _checked_factor(self.method, self.factor))
        object.__setattr__(self, "alpha", _checked_alpha(self.method, self.alpha))
        length = self.train_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ScalingError("train_length", length, "it must be a positive integer (the training tokens_per_sample)")
        if length is not None and self.method in DISTANCE_METHODS and self.factor * length < 1:
            raise ScalingError("factor", self.factor, f"{self.method} at {self.factor:g} x {length} training tokens "
                               f"starts at {self.factor * length:g} tokens; C must be at least one token")

    # --------------------------------------------------------------- spellings
    @classmethod
    def parse(cls, text: str, train_length: Optional[int] = None) -> "Scaling":
        """A ``--methods`` item: ``none``, ``linear[:F|:dynamic]``,
        ``ntk[:F|:dynamic]``, ``cap[:F]``, ``log[:F[:ALPHA]]``, ``power[:F[:ALPHA]]``,
        ``capnorm[:F]``."""
        name, _, arg = str(text).strip().partition(":")
        name, arg = name.strip().lower(), arg.strip().lower()
        if name == "none" and arg:
            raise ScalingError("method", text, "'none' takes no factor")
        alpha = None
        if name in TAIL_METHODS and ":" in arg:
            arg, _, text_alpha = arg.partition(":")
            alpha = _parsed_number(name, text_alpha.strip(), "alpha")
        elif ":" in arg:
            raise ScalingError("method", text, f"{name} takes one parameter; allowed: {METHOD_SYNTAX}")
        if name not in METHODS:
            raise ScalingError("method", name, f"allowed values: {', '.join(METHODS)}")
        return cls(name, _parsed_factor(name, arg.strip()), train_length, alpha)

    @property
    def spelling(self) -> str:
        """The ``--methods`` item: ``none``, ``ntk``, ``ntk:2``, ``cap``, ``cap:0.5``, ``log:1:0.25``."""
        if self.method == "none" or self.dynamic:
            return self.method
        if self.method in TAIL_METHODS and self.alpha != DEFAULT_ALPHA[self.method]:
            return f"{self.method}:{self.factor:g}:{self.alpha:g}"
        if self.method in DISTANCE_METHODS and self.factor == 1:
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
        """The spec of a model config's ``alibi_*`` fields (attributes or a dict);
        errors name the config key (``alibi_scale_factor=...``)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda key, default=None: getattr(cfg, key, default))
        try:
            return cls(get(CONFIG_KEYS["method"], "none"), get(CONFIG_KEYS["factor"], 0.0),
                       get(CONFIG_KEYS["train_length"], None), get(CONFIG_KEYS["alpha"], None))
        except ScalingError as exc:
            raise exc.renamed(CONFIG_KEYS) from None

    def config_values(self) -> Dict[str, Any]:
        """The config fields (``--model-overrides``) that select this method."""
        values = {CONFIG_KEYS["method"]: self.method,
                  CONFIG_KEYS["factor"]: 0.0 if self.method == "none" else self.factor}
        if self.alpha is not None:
            values[CONFIG_KEYS["alpha"]] = self.alpha
        return values

    @classmethod
    def from_hf(cls, value: Any, train_length: Optional[int]) -> "Scaling":
        """The spec of an ``alibi_scaling`` value (BTLM's convention, extended):
        ``None`` or ``{"type": "none"}``; ``{"type": "linear" | "ntk", "factor": F}``
        (static) or ``{..., "train_seq_len": N}`` (dynamic); ``{"type": "cap" |
        "capnorm", "factor": F}`` and ``{"type": "log" | "power", "factor": F, "alpha": A}``
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
            raise invalid(f"unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(HF_KEYS)}")
        method = value.get("type")
        if method not in METHODS:
            raise invalid(f"type must be one of {', '.join(METHODS)}")
        has_factor, has_length = "factor" in value, "train_seq_len" in value
        if method == "none" and (has_factor or has_length):
            raise invalid("type 'none' takes neither factor nor train_seq_len")
        if method in SLOPE_METHODS and has_factor == has_length:
            raise invalid(f'{method} takes "factor": F (static, F >= 1) or "train_seq_len": N '
                          "(dynamic, max(1, length / N)), exactly one of them")
        if method in DISTANCE_METHODS and (has_length or not has_factor):
            raise invalid(f'{method} takes "factor": F (C in training lengths, alibi_train_length)'
                          + (' and optionally "alpha": A' if method in TAIL_METHODS else "") + ", no train_seq_len")
        if "alpha" in value and method not in TAIL_METHODS:
            raise invalid(f"only types {' and '.join(repr(m) for m in TAIL_METHODS)} take alpha")
        factor = value.get("factor", 0.0)
        lowest = 1 if method in SLOPE_METHODS else 0
        if has_factor and (_real(factor) is None or not factor >= lowest or factor == 0):
            raise invalid(f"factor must be a number >= 1 (for dynamic {method} give train_seq_len instead)"
                          if lowest else "factor must be a positive number of training lengths")
        length = value["train_seq_len"] if has_length else train_length
        try:
            return cls(method, factor, length, value.get("alpha")).complete()
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
    def dynamic(self) -> bool:
        return self.method in SLOPE_METHODS and self.factor == 0

    @property
    def needs_train_length(self) -> bool:
        return self.dynamic or self.method in DISTANCE_METHODS

    def complete(self) -> "Scaling":
        """``self``, after checking it has the training length it needs."""
        if self.needs_train_length and self.train_length is None:
            what = "dynamic scaling" if self.dynamic else f"{self.method} (which starts at F x L)"
            raise ScalingError("train_length", None, f"{what} needs the training length L")
        return self

    def with_train_length(self, train_length: Optional[int]) -> "Scaling":
        return replace(self, train_length=train_length)

    def factor_at(self, key_length: Union[int, Tensor]) -> Union[float, Tensor]:
        """The slope-scaling factor of a forward pass over ``key_length`` keys
        (always 1 for the methods that leave slopes alone).  A tensor length (a
        static KV cache's, under ``torch.compile``) gives a tensor factor,
        without a branch on its value."""
        if self.method not in SLOPE_METHODS:
            return 1.0
        if not self.dynamic:
            return self.factor
        ratio = key_length / float(self.complete().train_length)
        return ratio.clamp(min=1.0) if isinstance(ratio, Tensor) else max(1.0, ratio)

    def slopes(self, base: Tensor, key_length: Union[int, Tensor], exponents: Optional[Tensor] = None) -> Tensor:
        """float32 ``[H]``: ``base`` scaled for a forward pass over ``key_length``
        keys; pass ``slope_exponents(base, method)`` when computed once already."""
        if exponents is None:
            return scale_slopes(base, self.method, self.factor_at(key_length))
        return base / self.factor_at(key_length) ** exponents

    @property
    def distance_limit(self) -> Optional[int]:
        """``C``, the distance past which a distance method acts, or None."""
        if self.method not in DISTANCE_METHODS:
            return None
        return max(1, round(self.factor * self.complete().train_length))

    @property
    def relative(self) -> bool:
        """The bias depends on ``i - j`` alone (every method but ``capnorm``,
        whose far-key term depends on how many keys lie past ``C``)."""
        return self.method != "capnorm"

    def reach(self, bias: float, slope: float) -> float:
        """The smallest distance at which a head of ``slope`` has a bias of at
        least ``bias`` in magnitude, ``math.inf`` where it never gets there
        (past a cap): the inverse of :func:`bias`, for the kernels' key windows.
        (``capnorm``'s extra far term is left out: the window only grows.)"""
        if slope <= 0:
            return math.inf
        plain = max(0.0, float(bias) / slope)
        if self.method not in DISTANCE_METHODS or plain <= self.distance_limit:
            return plain
        limit = float(self.distance_limit)
        if self.method == "log":
            exponent = (plain - limit) / (self.alpha * limit)
        elif self.method == "power":
            exponent = (bias - slope * limit) / self.alpha
        else:
            return math.inf
        return limit * math.exp(exponent) if exponent < 700 else math.inf

    def distance(self, d: Tensor) -> Tensor:
        """The transformed distance ``d'`` of non-negative float32 distances,
        which the slope multiplies: ``d`` itself but past ``C`` (``limit``):
        ``C`` (``cap``, ``power``, ``capnorm``) or ``C + alpha C ln(d / C)``
        (``log``; continuous at ``C``, and so is its slope for ``alpha = 1``).
        Branch-free, so a compiled ``score_mod`` can call it on index tensors."""
        if self.method not in DISTANCE_METHODS:
            return d
        limit = float(self.distance_limit)
        if self.method == "log":
            return d.clamp(max=limit) + (self.alpha * limit) * torch.log(d.clamp(min=limit) / limit)
        return d.clamp(max=limit)

    def penalty(self, d: Tensor, query: Tensor, direction, k_len: Optional[int]) -> Optional[Tensor]:
        """The bias term of its own a method subtracts past ``C`` (None for the
        others): ``power``: ``alpha ln(d / C)``, the same in every head;
        ``capnorm``: :func:`far_penalty` of the query, for keys past ``C``."""
        if self.method == "power":
            limit = float(self.distance_limit)
            return self.alpha * torch.log(d.clamp(min=limit) / limit)
        if self.method == "capnorm":
            far = far_penalty(self, query.to(torch.float32), direction, k_len)
            return torch.where(d > float(self.distance_limit), far, 0.0)
        return None


NO_SCALING = Scaling()


# ---------------------------------------------------------------------------
# The bias.  Every head looks left (keys j <= i: the causal LM), right
# (j >= i) or both ways; the bias is ``-slope * d'(|i - j|)`` on the side a
# head sees and ``masked_value`` on the other.
# ---------------------------------------------------------------------------

#: Head directions: keys to the left of the query, both sides, to the right.
LOOK_LEFT, LOOK_BOTH, LOOK_RIGHT = -1, 0, 1

#: Smallest learned slope: the softplus parametrization adds it, so a learned
#: slope stays strictly positive (the bias strictly negative) even where the
#: softplus underflows in float32.
MIN_LEARNED_SLOPE = 1e-6

Direction = Union[int, Tensor]
Slopes = Union[Tensor, Tuple[Tensor, Tensor]]


def far_penalty(scaling: Scaling, query: Tensor, direction: Direction, k_len: Optional[int]) -> Tensor:
    """``capnorm``'s term for keys past ``C``: ``ln(max(n, C) / C)`` with ``n``
    the keys past ``C`` on the side(s) the head sees (left: ``i - C``; right:
    ``k_len - 1 - i - C``), so the far keys together weigh what ``C`` keys at
    distance ``C`` would, however many there are."""
    limit = float(scaling.distance_limit)
    left = (query - limit).clamp(min=0)
    if isinstance(direction, int) and direction == LOOK_LEFT:
        count = left
    else:
        if k_len is None:
            raise ValueError("capnorm on a head that looks right needs k_len, the number of keys")
        right = (k_len - 1 - query - limit).clamp(min=0)
        if isinstance(direction, int):
            count = right if direction == LOOK_RIGHT else left + right
        else:
            count = left * (direction <= 0) + right * (direction >= 0)
    return torch.log(count.clamp(min=limit) / limit)


def bias(
    slopes: Slopes,
    query: Tensor,
    key: Tensor,
    scaling: Scaling = NO_SCALING,
    direction: Direction = LOOK_LEFT,
    masked_value: float = float("-inf"),
    k_len: Optional[int] = None,
) -> Tensor:
    """float32 ALiBi bias of queries at positions ``query`` over keys at ``key``
    (any broadcastable shapes; integer-valued, float32 or integer tensors):
    ``-slope * d'(|i - j|) - p`` (``d'`` = :meth:`Scaling.distance`, ``p`` =
    :meth:`Scaling.penalty` where a method has one) where the head looks
    (``direction``: ``LOOK_LEFT``, ``LOOK_BOTH``, ``LOOK_RIGHT`` or a tensor of
    them broadcastable to the result), ``masked_value`` on the hidden side.

    ``slopes`` broadcasts like the positions (``[H, 1, 1]`` for a dense bias, a
    0-d slope in a ``score_mod``), or is a ``(left, right)`` pair: learned
    slopes, one per side.  ``k_len`` (the number of keys) is needed only by
    ``capnorm`` on heads that look right.  The one formula of every path.
    """
    distance = (query - key).to(torch.float32)
    if isinstance(slopes, tuple):
        slopes = torch.where(distance >= 0, slopes[0], slopes[1])
    out = -slopes * scaling.distance(distance.abs())
    penalty = scaling.penalty(distance.abs(), query, direction, k_len)
    if penalty is not None:
        out = out - penalty
    if isinstance(direction, int):
        if direction == LOOK_BOTH:
            return out
        hidden = distance < 0 if direction == LOOK_LEFT else distance > 0
    else:
        hidden = direction * distance > 0  # left heads hide j > i, right heads j < i
    return torch.where(hidden, masked_value, out)


def split_directions(num_heads: int) -> Tuple[int, ...]:
    """Direction of every head in ``split`` mode.

    The first ``H // 2`` heads look left (keys ``j <= i``), the next ``H // 2``
    look right (``j >= i``).  With an odd head count the last head looks both
    ways with the symmetric bias, so that mirroring the input maps the set of
    heads onto itself (left <-> right, the middle head to itself).
    """
    _check_heads(num_heads)
    half = num_heads // 2
    return (LOOK_LEFT,) * half + (LOOK_RIGHT,) * half + ((LOOK_BOTH,) if num_heads % 2 else ())


def head_directions(mode: str, num_heads: int) -> Tuple[int, ...]:
    """Direction of every head of a bias ``mode`` (``learned`` looks both ways)."""
    if mode == "causal":
        return (LOOK_LEFT,) * num_heads
    if mode == "split":
        return split_directions(num_heads)
    if mode in ("symmetric", "learned"):
        return (LOOK_BOTH,) * num_heads
    raise ValueError(f"unknown ALiBi bias mode {mode!r}; allowed: {', '.join(BIAS_MODES)}")


def direction_of(directions: Sequence[int], device=None) -> Direction:
    """What :func:`bias` takes for these head directions: one int when every
    head looks the same way, else an ``[H, 1, 1]`` tensor."""
    directions = tuple(int(d) for d in directions)
    if len(set(directions)) == 1:
        return directions[0]
    return torch.tensor(directions, device=device)[:, None, None]


def split_slopes(num_heads: int) -> Tensor:
    """float32 ``[H]`` slopes for ``split`` mode, in ``split_directions`` order.

    Each direction gets the paper's slopes for ``ceil(H / 2)`` heads (the left
    and right halves are mirror images with identical slopes); with an odd
    head count the two-sided middle head takes the last slope of that sequence.
    """
    _check_heads(num_heads)
    half = num_heads // 2
    per_side = get_slopes(num_heads - half)  # ceil(H / 2)
    slopes = torch.cat([per_side[:half], per_side[:half]])
    if num_heads % 2:
        slopes = torch.cat([slopes, per_side[half:]])
    return slopes


def mode_slopes(mode: str, num_heads: int) -> Tensor:
    """The unscaled slopes of a bias mode (``split`` shares them between sides)."""
    return split_slopes(num_heads) if mode == "split" else get_slopes(num_heads)


def positions(q_len: int, k_len: int, q_start: Optional[int], device) -> Tuple[Tensor, Tensor]:
    """float32 (queries ``[q_len, 1]``, keys ``[1, k_len]``): positions
    ``q_start ..`` (by default the last ``q_len`` of the keys: a KV cache) and
    ``0 .. k_len - 1``, exact below 2**24."""
    if q_start is None:
        q_start = k_len - q_len
    query = torch.arange(q_start, q_start + q_len, device=device, dtype=torch.float32)
    keys = torch.arange(k_len, device=device, dtype=torch.float32)
    return query[:, None], keys[None, :]


def alibi_bias(
    slopes: Slopes,
    q_len: int,
    k_len: int,
    directions: Sequence[int],
    q_start: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    masked_value: float = float("-inf"),
    scaling: Scaling = NO_SCALING,
) -> Tensor:
    """The dense ``[H, q_len, k_len]`` :func:`bias` of queries ``q_start ..``
    (default: the last ``q_len`` of the keys) over keys ``0 .. k_len - 1``,
    formed in float32 and cast once to ``dtype``.  ``slopes``: ``[H]``, or a
    ``(left, right)`` pair of ``[H]`` (learned slopes, differentiable).  Pass a
    finite ``masked_value`` when a whole query row may otherwise be masked
    (padding on the one side a head sees) and produce NaN.
    """
    heads = (slopes[0] if isinstance(slopes, tuple) else slopes).numel()
    if len(directions) != heads:
        raise ValueError(f"{heads} slopes but {len(directions)} head directions")
    query, key = positions(q_len, k_len, q_start, device)
    per_head = tuple(s.to(device=device, dtype=torch.float32)[:, None, None]
                     for s in (slopes if isinstance(slopes, tuple) else (slopes,)))
    out = bias(per_head if len(per_head) == 2 else per_head[0], query, key, scaling,
               direction_of(directions, device), masked_value, k_len)
    return out if dtype == torch.float32 else out.to(dtype)


def learned_slopes(raw: Tensor, floor: float = MIN_LEARNED_SLOPE) -> Tensor:
    """Positive slopes from unconstrained parameters: ``softplus(raw) + floor``.

    Softplus is linear for large ``raw`` (no overflow, unlike ``exp``) and its
    gradient is ``sigmoid(raw)``, relative to the slope for small slopes, much
    like a log parametrization.  The floor keeps the slope > 0 in float32.
    """
    return torch.nn.functional.softplus(raw.to(torch.float32)) + floor


def learned_slopes_inverse(slopes: Tensor, floor: float = MIN_LEARNED_SLOPE) -> Tensor:
    """The ``raw`` parameters with ``learned_slopes(raw) == slopes`` (init)."""
    magnitude = slopes.to(torch.float32) - floor
    if not bool((magnitude > 0).all()):
        raise ValueError(f"learned ALiBi slopes must exceed {floor}, got {slopes.tolist()}")
    # softplus^-1(y) = log(expm1(y)) = y + log(-expm1(-y)), stable for large and small y
    return magnitude + torch.log(-torch.expm1(-magnitude))
