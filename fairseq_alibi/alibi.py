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
from typing import Optional, Sequence, Tuple

import torch

INTERPOLATION_METHODS = ("none", "linear", "ntk")
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


def _check_method(method: str) -> None:
    if method not in INTERPOLATION_METHODS:
        raise ValueError(
            f"unknown ALiBi interpolation method {method!r}; "
            f"allowed values: {', '.join(INTERPOLATION_METHODS)}"
        )


def scale_slopes(slopes: torch.Tensor, method: str, factor: float) -> torch.Tensor:
    """Slopes for evaluating ``factor`` times longer than the training length.

    * ``none``: unchanged;
    * ``linear`` (position interpolation): every slope divided by ``factor``;
    * ``ntk`` (NTK-ALiBi): the steepest head unchanged, the flattest divided by
      ``factor``, geometric in log-slope in between:
      ``m / factor ** ((log m_max - log m) / (log m_max - log m_min))``.
      With equal slopes (one head) there is no spread to interpolate over and it
      falls back to ``linear``.
    """
    _check_method(method)
    factor = float(factor)
    if not factor >= 1.0 or math.isinf(factor):
        raise ValueError(f"scale factor must be a finite number >= 1, got {factor!r}")
    slopes = slopes.to(torch.float32)
    if method == "none" or factor == 1.0:
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


def resolve_scale_factor(
    method: str, scale_factor: float, train_length: Optional[int], seq_len: int
) -> float:
    """The factor to use for a forward pass over ``seq_len`` positions.

    ``scale_factor > 0`` is static.  ``scale_factor == 0`` means dynamic:
    ``max(1, seq_len / train_length)``, so nothing changes up to the training
    length.  ``method == "none"`` always gives 1.
    """
    _check_method(method)
    if method == "none":
        return 1.0
    if scale_factor:
        return float(scale_factor)
    if not train_length:
        raise ValueError(
            "dynamic ALiBi scaling (scale factor 0) needs the training length; "
            "set alibi_train_length to the tokens_per_sample the model was trained with"
        )
    return max(1.0, seq_len / float(train_length))


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


def _distance(q_len: int, k_len: int, q_start: Optional[int], device) -> torch.Tensor:
    """float32 ``[q_len, k_len]`` of ``i - j`` (exact below 2^24 positions).

    Queries are positions ``q_start .. q_start + q_len - 1``; by default the
    last ``q_len`` of the ``k_len`` keys (a KV cache; 0 for a full forward).
    """
    if q_start is None:
        q_start = k_len - q_len
    query = torch.arange(q_start, q_start + q_len, device=device, dtype=torch.float32)
    keys = torch.arange(k_len, device=device, dtype=torch.float32)
    return query[:, None] - keys[None, :]


def alibi_bias(
    slopes: torch.Tensor,
    q_len: int,
    k_len: int,
    directions: Sequence[int],
    q_start: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    masked_value: float = float("-inf"),
) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-slope * |i - j|`` where head ``h`` looks
    (``directions[h]``: ``LOOK_LEFT``, ``LOOK_BOTH`` or ``LOOK_RIGHT``),
    ``masked_value`` elsewhere.

    All heads ``LOOK_LEFT`` is the causal LM's bias.  Formed in float32 with
    one ``[H, q_len, k_len]`` allocation and cast once, so nearby keys keep full
    relative precision in fp16/bf16 at any length.  Pass a finite
    ``masked_value`` when a whole query row may otherwise be masked (padding
    on the one side a head sees) and produce NaN.
    """
    directions = tuple(int(d) for d in directions)
    if len(directions) != slopes.numel():
        raise ValueError(f"{slopes.numel()} slopes but {len(directions)} head directions")
    distance = _distance(q_len, k_len, q_start, device)
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
) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-left * (i - j)`` for keys left of the query,
    ``-right * (j - i)`` for keys right of it, ``0`` on the diagonal.

    Differentiable in both slope vectors (the learned mode trains them).
    """
    if left_slopes.shape != right_slopes.shape or left_slopes.dim() != 1:
        raise ValueError(
            f"left and right slopes must both be [H], got {tuple(left_slopes.shape)} "
            f"and {tuple(right_slopes.shape)}"
        )
    distance = _distance(q_len, k_len, q_start, device)
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
