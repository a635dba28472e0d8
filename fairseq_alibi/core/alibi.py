"""The ALiBi maths: head slopes, what each extension method does to them or
to the distances, and the one bias function.

Pure torch, so that every formula here can be read and tested on its own (it
travels with every exported Hugging Face model).  The extension spec itself
(which method, which factor) is :class:`~.scaling.Scaling`; this module says
what it means for ALiBi:

* slope methods (``linear``, ``ntk``): :func:`slope_exponents`, :func:`scaled_slopes`;
* distance methods (``cap``, ``log``, ``power``, ``capnorm``): :func:`distance`
  (a transform of ``|i - j|``, times the slope) and :func:`penalty` (a bias
  term of its own), and :func:`reach`, their inverse, for the kernels' key windows;
* :func:`bias`, the one function from query and key positions to the bias:
  the dense bias, the chunked kernel's ramp, FlexAttention's ``score_mod``,
  the Hugging Face hooks and the exported model all call it.

A new method is a row of ``scaling.METHOD_TABLE`` plus a branch of
:func:`distance`, :func:`penalty` or :func:`slope_exponents`; every path then has it.

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
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .errors import ConfigError
from .scaling import DISTANCE_METHODS, NO_SCALING, Scaling

#: The extension methods ALiBi's maths handles (slopes and distances).
EXTENSIONS = ("none", "linear", "ntk") + DISTANCE_METHODS

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
        raise ConfigError(f"num_heads={num_heads!r} is not valid; it must be an integer >= 1")


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


def scaled_slopes(scaling: Scaling, base: Tensor, key_length: Union[int, Tensor],
                  exponents: Optional[Tensor] = None) -> Tensor:
    """float32 ``[H]`` (or ``[..., H]`` for a tensor of lengths ``[...]``):
    ``base`` scaled for a forward pass over ``key_length`` keys; pass
    ``slope_exponents(base, method)`` when computed once already."""
    if exponents is None:
        exponents = slope_exponents(base, scaling.method)
    factor = scaling.factor_at(key_length)
    if isinstance(factor, Tensor) and factor.dim() > 0:
        factor = factor[..., None]
    return base.to(torch.float32) / factor ** exponents


def reach(scaling: Scaling, bias: float, slope: float) -> float:
    """The smallest distance at which a head of ``slope`` has a bias of at
    least ``bias`` in magnitude, ``math.inf`` where it never gets there
    (past a cap): the inverse of :func:`bias`, for the kernels' key windows.
    (``capnorm``'s extra far term is left out: the window only grows.)"""
    if slope <= 0:
        return math.inf
    plain = max(0.0, float(bias) / slope)
    if scaling.method not in DISTANCE_METHODS or plain <= scaling.distance_limit:
        return plain
    limit = float(scaling.distance_limit)
    if scaling.method == "log":
        exponent = (plain - limit) / (scaling.alpha * limit)
    elif scaling.method == "power":
        exponent = (bias - slope * limit) / scaling.alpha
    else:
        return math.inf
    return limit * math.exp(exponent) if exponent < 700 else math.inf


def distance(scaling: Scaling, d: Tensor) -> Tensor:
    """The transformed distance ``d'`` of non-negative float32 distances,
    which the slope multiplies: ``d`` itself but past ``C`` (``limit``):
    ``C`` (``cap``, ``power``, ``capnorm``) or ``C + alpha C ln(d / C)``
    (``log``; continuous at ``C``, and so is its slope for ``alpha = 1``).
    Branch-free, so a compiled ``score_mod`` can call it on index tensors."""
    if scaling.method not in DISTANCE_METHODS:
        return d
    limit = float(scaling.distance_limit)
    if scaling.method == "log":
        return d.clamp(max=limit) + (scaling.alpha * limit) * torch.log(d.clamp(min=limit) / limit)
    return d.clamp(max=limit)


def penalty(scaling: Scaling, d: Tensor, query: Tensor, direction, k_len: Optional[int]) -> Optional[Tensor]:
    """The bias term of its own a method subtracts past ``C`` (None for the
    others): ``power``: ``alpha ln(d / C)``, the same in every head;
    ``capnorm``: :func:`far_penalty` of the query, for keys past ``C``."""
    if scaling.method == "power":
        limit = float(scaling.distance_limit)
        return scaling.alpha * torch.log(d.clamp(min=limit) / limit)
    if scaling.method == "capnorm":
        far = far_penalty(scaling, query.to(torch.float32), direction, k_len)
        return torch.where(d > float(scaling.distance_limit), far, 0.0)
    return None


# ---------------------------------------------------------------------------
# The bias.  Every head looks left (keys j <= i: the causal LM), right
# (j >= i) or both ways; the bias is ``-slope * d'(|i - j|)`` on the side a
# head sees and ``masked_value`` on the other.
# ---------------------------------------------------------------------------


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
    ``-slope * d'(|i - j|) - p`` (``d'`` = :func:`distance`, ``p`` =
    :func:`penalty` where a method has one) where the head looks
    (``direction``: ``LOOK_LEFT``, ``LOOK_BOTH``, ``LOOK_RIGHT`` or a tensor of
    them broadcastable to the result), ``masked_value`` on the hidden side.

    ``slopes`` broadcasts like the positions (``[H, 1, 1]`` for a dense bias, a
    0-d slope in a ``score_mod``), or is a ``(left, right)`` pair: learned
    slopes, one per side.  ``k_len`` (the number of keys) is needed only by
    ``capnorm`` on heads that look right.  The one formula of every path.
    """
    offsets = (query - key).to(torch.float32)
    if isinstance(slopes, tuple):
        slopes = torch.where(offsets >= 0, slopes[0], slopes[1])
    out = -slopes * distance(scaling, offsets.abs())
    extra = penalty(scaling, offsets.abs(), query, direction, k_len)
    if extra is not None:
        out = out - extra
    if isinstance(direction, int):
        if direction == LOOK_BOTH:
            return out
        hidden = offsets < 0 if direction == LOOK_LEFT else offsets > 0
    else:
        hidden = direction * offsets > 0  # left heads hide j > i, right heads j < i
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
    raise ConfigError(f"ALiBi bias mode {mode!r} is not valid; allowed values: {', '.join(BIAS_MODES)}")


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
