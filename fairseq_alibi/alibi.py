"""The ALiBi maths: head slopes, context-extension scaling and bias builders.

Pure torch, no fairseq import, so that every formula here can be read and
tested on its own.  Conventions used throughout:

* ``slopes`` is a float32 tensor of shape ``[H]``, one positive slope per head;
* a bias is *added* to attention scores, so ALiBi's bias is ``-slope * distance``;
* query ``i`` and key ``j`` are absolute positions; with a KV cache the ``q_len``
  queries are the last ``q_len`` positions of the ``k_len`` keys.

Distances are formed as integers and multiplied by the slope in float32 before
the single final cast, so the bias for nearby keys (the ones that matter after
softmax) keeps full relative precision in fp16/bf16 at any length.  The
reference fork's ``+slope * j`` shortcut does not: at 16K keys fp16 cannot tell
adjacent values of ``slope * j`` apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch

#: Context-extension methods: ``linear`` and ``ntk`` scale the slopes, ``cap``
#: clamps the distance (LM-Infinite), ``none`` leaves both alone.
METHODS = ("none", "linear", "ntk", "cap")
SLOPE_METHODS = ("linear", "ntk")
BIAS_MODES = ("causal", "symmetric", "split", "learned")
BIDIRECTIONAL_MODES = ("symmetric", "split", "learned")


def _power_of_two_slopes(n: int) -> list:
    """Geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8)."""
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def _check_heads(num_heads) -> None:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")


def get_slopes(num_heads: int) -> torch.Tensor:
    """The paper's per-head slopes, in the paper's head order, as float32 ``[H]``.

    For ``H`` not a power of two: the slopes of the closest lower power of two
    ``c``, then every other slope of the ``2c`` sequence, first ``H - c`` of them
    (so the sequence is not monotonic, exactly as in the reference code).
    """
    _check_heads(num_heads)
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = _power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def scale_slopes(slopes: torch.Tensor, method: str, factor: float) -> torch.Tensor:
    """Slopes for evaluating ``factor`` times longer than the training length.

    * ``none`` and ``cap``: unchanged (``cap`` changes distances, not slopes);
    * ``linear`` (position interpolation): every slope divided by ``factor``;
    * ``ntk`` (NTK-ALiBi): the steepest head unchanged, the flattest divided by
      ``factor``, geometric in log-slope in between:
      ``m / factor ** ((log m_max - log m) / (log m_max - log m_min))``.
      With equal slopes (one head) there is no spread to interpolate over and it
      falls back to ``linear``.
    """
    if method not in METHODS:
        raise ScalingError("method", method, f"allowed values: {', '.join(METHODS)}")
    factor = float(factor)
    if not factor >= 1.0 or math.isinf(factor):
        raise ScalingError("factor", factor, "a slope-scaling factor must be a finite number >= 1")
    slopes = slopes.to(torch.float32)
    if method not in SLOPE_METHODS or factor == 1.0:
        return slopes.clone()
    if method == "linear":
        return slopes / factor
    log_slopes = slopes.log()
    log_max, log_min = log_slopes.max(), log_slopes.min()
    spread = log_max - log_min
    if spread <= 0:
        return slopes / factor
    exponent = (log_max - log_slopes) / spread
    return slopes / factor**exponent


# ---------------------------------------------------------------------------
# The scaling spec: method, static factor or dynamic, training length.
# ---------------------------------------------------------------------------


class ScalingError(ValueError):
    """An invalid scaling setting.  ``field`` is ``method``, ``factor`` or
    ``train_length``; ``value`` what was given; ``reason`` what is allowed.
    Callers that know the user's name for the field (a config key, a command
    line option) re-word it; ``str()`` reads on its own."""

    def __init__(self, field: str, value, reason: str):
        super().__init__(f"{field}={value!r} is not valid; {reason}")
        self.field, self.value, self.reason = field, value, reason


def _number(value) -> Optional[float]:
    """``value`` as a float if it is a real number (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _checked_factor(method: str, factor) -> float:
    """The factor of a valid (method, factor), normalized: ``none`` stores 1, ``cap:0`` is ``cap:1``."""
    if method not in METHODS:
        raise ScalingError("method", method, f"allowed values: {', '.join(METHODS)}")
    value = _number(factor)
    if value is None or not math.isfinite(value) or value < 0:
        raise ScalingError("factor", factor, "it must be a finite number >= 0")
    if method in SLOPE_METHODS and 0 < value < 1:
        raise ScalingError("factor", factor,
                           "use 0 for dynamic scaling (max(1, length / training length)) or a static factor >= 1")
    if method == "none" or (method == "cap" and value == 0):
        return 1.0  # none: no scaling; cap: the training length itself
    return value


def _parsed_factor(method: str, arg: str) -> float:
    """The factor of ``--methods`` item ``method:arg`` (``dynamic`` or nothing: 0)."""
    if method == "cap" and arg in ("dynamic", "dyn"):
        raise ScalingError("factor", arg, "cap has no dynamic form; cap:F caps at F training lengths")
    if arg in ("", "dynamic", "dyn"):
        return 0.0
    try:
        factor = float(arg)
    except ValueError:
        raise ScalingError("factor", arg, "expected a number or 'dynamic'") from None
    if factor <= 0 or (method in SLOPE_METHODS and factor < 1):
        raise ScalingError("factor", arg, "a static factor must be >= 1 (write 'dynamic' or leave it out for "
                           "dynamic scaling)" if method in SLOPE_METHODS else "the cap must be a positive number "
                           "of training lengths")
    return factor


@dataclass(frozen=True)
class Scaling:
    """How one model extends its context at evaluation; validated on creation.

    * ``method``: ``none``, ``linear`` (every slope / factor), ``ntk`` (steepest
      head kept, flattest / factor, geometric in between) or ``cap`` (every
      distance above ``factor * train_length`` seen as that distance,
      LM-Infinite's distance limit: ``-m * min(i - j, C)``);
    * ``factor``: for ``linear``/``ntk`` ``0`` means dynamic,
      ``max(1, keys / train_length)`` per forward pass, else a static factor
      ``>= 1``; for ``cap`` the cap in training lengths (any ``F > 0``; ``0``
      means 1, the training length itself); ``none`` stores 1 whatever is given;
    * ``train_length``: the length the model was trained at; dynamic methods and
      ``cap`` need it (:meth:`complete` checks).
    """

    method: str = "none"
    factor: float = 0.0
    train_length: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "factor", _checked_factor(self.method, self.factor))
        length = self.train_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ScalingError("train_length", length, "it must be a positive integer (the training tokens_per_sample)")

    @classmethod
    def parse(cls, text: str, train_length: Optional[int] = None) -> "Scaling":
        """``none``, ``linear[:F|:dynamic]``, ``ntk[:F|:dynamic]`` or ``cap[:F]``."""
        name, _, arg = str(text).strip().partition(":")
        name = name.strip().lower()
        if name == "none" and arg:
            raise ScalingError("method", text, "'none' takes no factor")
        return cls(name, _parsed_factor(name, arg.strip().lower()), train_length)

    @property
    def dynamic(self) -> bool:
        return self.method in SLOPE_METHODS and self.factor == 0

    @property
    def needs_train_length(self) -> bool:
        return self.dynamic or self.method == "cap"

    def complete(self) -> "Scaling":
        """``self``, after checking it has the training length it needs."""
        if self.needs_train_length and self.train_length is None:
            what = "dynamic scaling" if self.dynamic else "the distance cap (cap:F caps at F x L)"
            raise ScalingError("train_length", None, f"{what} needs the training length L")
        return self

    def with_train_length(self, train_length: Optional[int]) -> "Scaling":
        return replace(self, train_length=train_length)

    def factor_at(self, key_length: int) -> float:
        """The slope-scaling factor of a forward pass over ``key_length`` keys
        (always 1 for ``none`` and ``cap``)."""
        if self.method not in SLOPE_METHODS:
            return 1.0
        if not self.dynamic:
            return self.factor
        return max(1.0, key_length / float(self.complete().train_length))

    def slopes(self, base: torch.Tensor, key_length: int) -> torch.Tensor:
        """float32 ``[H]``: ``base`` scaled for a forward pass over ``key_length`` keys."""
        return scale_slopes(base, self.method, self.factor_at(key_length))

    @property
    def distance_cap(self) -> Optional[int]:
        """``C`` of ``-m * min(|i - j|, C)``, or None (no cap)."""
        if self.method != "cap":
            return None
        return max(1, round(self.factor * self.complete().train_length))

    @property
    def spelling(self) -> str:
        """The ``--methods`` item: ``none``, ``ntk``, ``ntk:2``, ``cap``, ``cap:0.5``."""
        if self.method == "none" or self.dynamic or (self.method == "cap" and self.factor == 1):
            return self.method
        return f"{self.method}:{self.factor:g}"

    @property
    def label(self) -> str:
        """For tables: ``none``, ``linear dynamic``, ``ntk x2``, ``cap x0.5``."""
        if self.method == "none":
            return "none"
        if self.dynamic:
            return f"{self.method} dynamic"
        return f"{self.method} x{self.factor:g}"


NO_SCALING = Scaling()


def resolve_scale_factor(
    method: str, scale_factor: float, train_length: Optional[int], seq_len: int
) -> float:
    """The slope factor of a forward pass over ``seq_len`` keys (:meth:`Scaling.factor_at`)."""
    return Scaling(method, scale_factor, train_length).factor_at(seq_len)


# ---------------------------------------------------------------------------
# Bias builders.  Every head looks left (keys j <= i: the causal LM), right
# (j >= i) or both ways; the bias is ``-slope * |i - j|`` on the side a head
# sees and ``masked_value`` on the other.
# ---------------------------------------------------------------------------

#: Head directions: keys to the left of the query, both sides, to the right.
LOOK_LEFT, LOOK_BOTH, LOOK_RIGHT = -1, 0, 1

#: Smallest learned slope: the softplus parametrization adds it, so a learned
#: slope stays strictly positive (the bias strictly negative) even where the
#: softplus underflows in float32.
MIN_LEARNED_SLOPE = 1e-6


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


def split_slopes(num_heads: int) -> torch.Tensor:
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


def mode_slopes(mode: str, num_heads: int) -> torch.Tensor:
    """The unscaled slopes of a bias mode (``split`` shares them between sides)."""
    return split_slopes(num_heads) if mode == "split" else get_slopes(num_heads)


def _distance(q_len: int, k_len: int, q_start: Optional[int], device, cap: Optional[int] = None) -> torch.Tensor:
    """float32 ``[q_len, k_len]`` of ``i - j`` (exact below 2^24 positions),
    clamped to ``[-cap, cap]`` when a distance cap is given (the sign, which
    says on which side of the query a key lies, is kept).

    Queries are positions ``q_start .. q_start + q_len - 1``; by default the
    last ``q_len`` of the ``k_len`` keys (a KV cache; 0 for a full forward).
    """
    if q_start is None:
        q_start = k_len - q_len
    query = torch.arange(q_start, q_start + q_len, device=device, dtype=torch.float32)
    keys = torch.arange(k_len, device=device, dtype=torch.float32)
    distance = query[:, None] - keys[None, :]
    return distance if cap is None else distance.clamp_(-cap, cap)


def alibi_bias(
    slopes: torch.Tensor,
    q_len: int,
    k_len: int,
    directions: Sequence[int],
    q_start: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    masked_value: float = float("-inf"),
    cap: Optional[int] = None,
) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-slope * |i - j|`` where head ``h`` looks
    (``directions[h]``: ``LOOK_LEFT``, ``LOOK_BOTH`` or ``LOOK_RIGHT``),
    ``masked_value`` elsewhere; with ``cap``, ``-slope * min(|i - j|, cap)``.

    All heads ``LOOK_LEFT`` is the causal LM's bias.  Formed in float32 with
    one ``[H, q_len, k_len]`` allocation and cast once, so nearby keys keep full
    relative precision in fp16/bf16 at any length.  Pass a finite
    ``masked_value`` when a whole query row may otherwise be masked (padding
    on the one side a head sees) and produce NaN.
    """
    directions = tuple(int(d) for d in directions)
    if len(directions) != slopes.numel():
        raise ValueError(f"{slopes.numel()} slopes but {len(directions)} head directions")
    distance = _distance(q_len, k_len, q_start, device, cap)
    slopes = slopes.to(device=device, dtype=torch.float32)[:, None, None]
    if all(d == LOOK_LEFT for d in directions):
        bias = torch.mul(distance, -slopes)
        bias.masked_fill_(distance < 0, masked_value)
    elif all(d == LOOK_RIGHT for d in directions):
        bias = torch.mul(distance, slopes)
        bias.masked_fill_(distance > 0, masked_value)
    else:
        bias = torch.mul(distance.abs(), -slopes)
        heads = torch.tensor(directions, device=device)[:, None, None]
        hidden = ((heads == LOOK_LEFT) & (distance < 0)) | ((heads == LOOK_RIGHT) & (distance > 0))
        bias.masked_fill_(hidden, masked_value)
    return bias if dtype == torch.float32 else bias.to(dtype)


def asymmetric_bias(
    left_slopes: torch.Tensor,
    right_slopes: torch.Tensor,
    q_len: int,
    k_len: int,
    q_start: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    cap: Optional[int] = None,
) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-left * (i - j)`` for keys left of the query,
    ``-right * (j - i)`` for keys right of it, ``0`` on the diagonal (each
    distance at most ``cap`` when given).

    Differentiable in both slope vectors (the learned mode trains them).
    """
    if left_slopes.shape != right_slopes.shape or left_slopes.dim() != 1:
        raise ValueError(
            f"left and right slopes must both be [H], got {tuple(left_slopes.shape)} "
            f"and {tuple(right_slopes.shape)}"
        )
    distance = _distance(q_len, k_len, q_start, device, cap)
    left = left_slopes.to(device=device, dtype=torch.float32)[:, None, None]
    right = right_slopes.to(device=device, dtype=torch.float32)[:, None, None]
    bias = -left * distance.clamp(min=0) - right * (-distance).clamp(min=0)
    return bias.to(dtype)


def learned_slopes(raw: torch.Tensor, floor: float = MIN_LEARNED_SLOPE) -> torch.Tensor:
    """Positive slopes from unconstrained parameters: ``softplus(raw) + floor``.

    Softplus is linear for large ``raw`` (no overflow, unlike ``exp``) and its
    gradient is ``sigmoid(raw)``, relative to the slope for small slopes, much
    like a log parametrization.  The floor keeps the slope > 0 in float32.
    """
    return torch.nn.functional.softplus(raw.to(torch.float32)) + floor


def learned_slopes_inverse(slopes: torch.Tensor, floor: float = MIN_LEARNED_SLOPE) -> torch.Tensor:
    """The ``raw`` parameters with ``learned_slopes(raw) == slopes`` (init)."""
    magnitude = slopes.to(torch.float32) - floor
    if not bool((magnitude > 0).all()):
        raise ValueError(f"learned ALiBi slopes must exceed {floor}, got {slopes.tolist()}")
    # softplus^-1(y) = log(expm1(y)) = y + log(-expm1(-y)), stable for large and small y
    return magnitude + torch.log(-torch.expm1(-magnitude))
