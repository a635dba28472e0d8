"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer") and its
context-extension methods, as pure functions.

RoPE rotates each pair of a head's query and key dimensions by an angle
proportional to the token's position, ``p * theta_i`` with ``theta_i =
base^(-2i/d)``, so the score ``q_m . k_n`` depends on the offset ``m - n``
only (a relative method with no bias term; attention then runs bias-free).
It extrapolates poorly: past the training length the slow pairs reach angles
never seen in training, and perplexity rises soon after ``L`` (the ALiBi
paper's first figure).  Its extension methods change the frequencies at
evaluation instead: position interpolation, NTK-aware scaling, YaRN
(:func:`extended_frequencies`).

Conventions:

* pairing: GPT-NeoX / Llama, dimension ``k`` with dimension ``k + d/2`` of the
  rotated part (not GPT-J's adjacent pairs ``2k, 2k + 1``), as transformers'
  Llama does, so its ``apply_rotary_pos_emb`` is an oracle for :func:`rotate`;
* partial rotary: only the first ``rotary_dim = 2 * len(inv_freq)`` dimensions
  of each head are rotated, the rest pass through untouched;
* frequencies are float32 ``[rotary_dim // 2]``, formed from Python floats
  (double) and rounded once, on the CPU (also under a ``meta`` device block);
* angles are float32 ``position * inv_freq`` (positions cast once, exact
  below 2**24), as in every float32 RoPE: at position 65535 the rounding of
  the product shifts an angle by up to ~0.004 rad, equally for queries and
  keys of the same position.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .alibi import get_slopes, positions as grid
from .bias import CausalMask
from .errors import ConfigError, ScalingError
from .params import Range
from .scaling import LOGIT_METHODS, NO_SCALING, Scaling, check_applies

#: The extension methods this module computes, at a resolved factor >= 1.
ROPE_METHODS = ("none", "linear", "ntk", "yarn")
#: YaRN's ramp ends: pairs turning at least ``beta_fast`` times within the
#: training length are kept, at most ``beta_slow`` times interpolated.
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
DEFAULT_BASE = 10000.0
#: The bases RoPE takes: above 1, at most 1e12 (released long-context models use up to ~1e8; at 1e12
#: the slowest pair of a 128-dimension head turns by ~1.6e-12 rad per token, so it carries no position
#: within any length a model is evaluated at, and its float32 frequency nears underflow).
BASE_RANGE = Range(float, 1.0, 1e12, open_low=True)


def _check_rotary_dim(rotary_dim) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"rotary_dim={rotary_dim!r} is not valid; it must be an even integer >= 2 "
                          "(the number of rotated dimensions of a head)")
    return rotary_dim


def _check_base(base) -> float:
    if not BASE_RANGE.allows(base):
        raise ConfigError(f"rotary base={base!r} is not valid; it must be {BASE_RANGE.text}")
    return float(base)


def _frequencies(rotary_dim: int, base: float) -> list:
    """``base^(-2i/d)`` for ``i = 0 .. d/2 - 1``, in Python floats."""
    return [base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]


def _float32(values) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device="cpu")


def inv_frequencies(rotary_dim: int, base: float = DEFAULT_BASE) -> Tensor:
    """RoPE's float32 ``[rotary_dim // 2]`` frequencies ``theta_i = base^(-2i/d)``,
    ``d = rotary_dim`` (the rotated dimensions, so a partial rotary head
    spreads its frequencies over the part it rotates, as GPT-NeoX does)."""
    return _float32(_frequencies(_check_rotary_dim(rotary_dim), _check_base(base)))


def _check_factor(factor) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise ScalingError("factor", factor, "RoPE's extension methods take a resolved factor >= 1 "
                           "(a dynamic factor is max(1, length / training length))")
    return float(factor)


def yarn_attention_scale(factor: float) -> float:
    """YaRN's ``0.1 ln(s) + 1`` (1 at ``s <= 1``), applied to queries and keys
    each, so the logits are scaled by its square (Peng et al. 2023)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_ramp(rotary_dim: int, base: float, train_length: int) -> list:
    """YaRN's share of interpolation per pair: 0 (kept as trained) for the pairs
    that turn at least ``beta_fast`` times within ``train_length``, 1
    (divided by the factor) for those that turn at most ``beta_slow`` times,
    linear in the pair index between the two (fractional) pair indices where
    the number of turns ``L theta_i / 2 pi`` equals ``beta_fast`` and
    ``beta_slow``, rounded outwards (floor, ceil), the lower end at least 0 and
    the upper at most ``rotary_dim - 1``.  This is the ramp of the YaRN
    authors' code and of transformers' ``_compute_yarn_parameters``, cap
    included (``dim - 1`` is a dimension count, though the ramp runs over
    ``dim / 2`` pairs), so that an export under transformers' own YaRN agrees.
    The cap acts only where ``L / 2 pi`` nears ``base^2`` (at base 10, not at
    10,000: tests/test_trust.py compares both with transformers); where it
    brings the upper end down to the lower one, transformers adds 0.001 to it,
    and where below, its ramp runs backwards (every pair turns more than
    ``beta_fast`` times, yet all are interpolated): followed as it is.  The
    paper's equation writes the ramp linear in the number of turns instead."""
    def pair_index(turns: float) -> float:
        return rotary_dim * math.log(train_length / (2 * math.pi * turns)) / (2 * math.log(base))

    low = max(math.floor(pair_index(YARN_BETA_FAST)), 0)
    high = min(math.ceil(pair_index(YARN_BETA_SLOW)), rotary_dim - 1)
    if high == low:
        high += 0.001  # as transformers: no division by zero
    return [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(rotary_dim // 2)]


def _check_train_length(train_length) -> int:
    minimum = math.ceil(2 * math.pi * YARN_BETA_SLOW)
    if isinstance(train_length, bool) or not isinstance(train_length, int) or train_length < minimum:
        raise ConfigError(f"train_length={train_length!r} is not valid for yarn; it needs the training length, "
                          f"an integer >= {minimum} (the slowest kept pair turns once within it)")
    return train_length


def extended_frequencies(method: str, factor: float, rotary_dim: int, base: float = DEFAULT_BASE,
                         train_length: Optional[int] = None) -> Tuple[Tensor, float]:
    """``(inv_freq, attention_scale)`` of RoPE extended by ``method`` at a
    resolved factor ``s = factor >= 1`` (the caller resolves a dynamic factor,
    ``max(1, length / train_length)``):

    * ``none``: RoPE as trained, scale 1 (``factor`` is ignored);
    * ``linear``, position interpolation (Chen et al. 2023, "Extending Context
      Window of Large Language Models via Positional Interpolation"): positions
      divided by ``s``, i.e. every ``theta_i / s``; scale 1;
    * ``ntk``, NTK-aware scaling (bloc97, 2023, a Reddit post; its dynamic form is NTK with
      ``s = max(1, length / L)``): the base raised to ``base * s^(d / (d - 2))``,
      so the fastest pair is unchanged and the slowest is divided by ``s``;
      scale 1; needs ``rotary_dim >= 4``;
    * ``yarn`` (Peng et al. 2023, "YaRN: Efficient Context Window Extension of
      Large Language Models"): ``theta_i ((1 - r_i) + r_i / s)`` with ``r_i``
      :func:`yarn_ramp` over ``train_length`` (``beta_fast = 32``,
      ``beta_slow = 1``), and ``attention_scale = 0.1 ln(s) + 1`` multiplying
      the rotated queries and keys each (:func:`rotate`).
    """
    if method not in ROPE_METHODS:
        raise ScalingError("method", method, f"RoPE's extension methods are {', '.join(ROPE_METHODS)}")
    rotary_dim, base, factor = _check_rotary_dim(rotary_dim), _check_base(base), _check_factor(factor)
    plain = _frequencies(rotary_dim, base)
    if method == "none":
        return _float32(plain), 1.0
    if method == "linear":
        return _float32([theta / factor for theta in plain]), 1.0
    if method == "ntk":
        if rotary_dim < 4:
            raise ConfigError(f"rotary_dim={rotary_dim} is not valid for ntk; it needs rotary_dim >= 4 "
                              "(the base's exponent d / (d - 2))")
        return _float32(_frequencies(rotary_dim, base * factor ** (rotary_dim / (rotary_dim - 2)))), 1.0
    ramp = yarn_ramp(rotary_dim, base, _check_train_length(train_length))
    return _float32([theta * ((1 - r) + r / factor) for theta, r in zip(plain, ramp)]), yarn_attention_scale(factor)


def rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scale: float = 1.0) -> Tensor:
    """``x`` (``[B, H, T, D]`` queries or keys) rotated by RoPE at ``positions``
    (integers, ``[T]`` or ``[B, T]``): pair ``(x_k, x_{k + r/2})`` of the first
    ``r = 2 * len(inv_freq)`` dimensions turned by ``position * inv_freq[k]``
    and multiplied by ``attention_scale`` (YaRN's; 1 otherwise); dimensions
    ``r ..`` pass through untouched.  Computed in float32, returned in ``x``'s
    dtype."""
    half = inv_freq.shape[-1]
    if inv_freq.dim() != 1 or 2 * half > x.shape[-1]:
        raise ConfigError(f"inv_freq of shape {tuple(inv_freq.shape)} is not valid for heads of {x.shape[-1]} "
                          "dimensions; it must be 1-D, the rotated part (2 x its length) within a head")
    angles = positions.to(device=x.device, dtype=torch.float32)[..., None] * inv_freq.to(x.device, torch.float32)
    if angles.dim() == 3:  # [B, T, half] -> [B, 1, T, half]: one angle per batch row, shared by the heads
        angles = angles[:, None]
    cos, sin = angles.cos(), angles.sin()
    cos, signed_sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    part = x[..., : 2 * half].to(torch.float32)
    if cos.requires_grad or sin.requires_grad:  # gradients into the frequencies: autograd's own
        turned = part * cos + _swap_halves(part) * signed_sin
    else:
        turned = _Turn.apply(part, cos, signed_sin)
    if attention_scale != 1.0:
        turned = turned * attention_scale
    if 2 * half == x.shape[-1]:  # every dimension rotated: no copy to join an empty rest
        return turned.to(x.dtype)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _swap_halves(x: Tensor) -> Tensor:
    """``(x_2, x_1)`` of ``x = (x_1, x_2)`` along the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class _Turn(torch.autograd.Function):
    """``x cos + swap(x) signed_sin`` with ``signed_sin = (-sin, sin)``: the
    pairs turned, ``(x_1 cos - x_2 sin, x_2 cos + x_1 sin)``, rounded exactly
    as those two products and their sum or difference (negation is exact),
    in four passes over ``x`` where the halves' separate products and their
    join take seven.  The backward is the turn by minus the angle,
    ``g cos - swap(g) signed_sin``, four passes again, where autograd's
    through the halves zero-fills and sums a full-size gradient per half
    (together about a third less time, forward and backward, at
    ``[4, 4, 1024, 64]``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, signed_sin)
        turned = x * cos
        return turned.add_(_swap_halves(x).mul_(signed_sin))

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, signed_sin = ctx.saved_tensors
        return (grad * cos).sub_(_swap_halves(grad).mul_(signed_sin)), None, None


def rotated_dims(head_dim: int, fraction: float) -> int:
    """How many of a head's ``head_dim`` dimensions RoPE rotates at ``fraction``:
    ``head_dim x fraction`` rounded down to an even number (pairs), so a
    15-dimension head rotates 14 and its last dimension carries no position;
    at least 2 (one pair), else a ``ConfigError`` naming the smallest fraction."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError(f"rotary_fraction={fraction!r} is not valid; it must be a number in (0, 1]")
    rotated = int(head_dim * fraction) // 2 * 2
    if rotated < 2:
        remedy = (f"give rotary_fraction >= {math.ceil(2e4 / head_dim) / 1e4:g} (or fewer, wider heads)"
                  if head_dim >= 2 else "give fewer, wider heads")
        raise ConfigError(f"rotary_fraction={fraction!r} rotates {rotated} of a head's {head_dim} dimensions; "
                          f"RoPE needs at least one pair: {remedy}")
    return rotated


class RotaryPositions(CausalMask):
    """A decoder stack's RoPE: queries and keys rotated by their positions
    (:meth:`rotate`, before a KV cache stores the keys), then bias-free causal
    attention (``zero``: SDPA's ``is_causal`` where it can).  ``rotary_dim``:
    the first ``fraction`` of each head's dimensions, rounded down to an even
    number.  The extension spec's method applies to the frequencies
    (:func:`extended_frequencies`); a dynamic factor is the pass's (each row's
    own under padding, as ``kernels.row_groups`` defines it); keys already in
    a cache keep the frequencies they were rotated with, so dynamic scaling is
    an approximation in incremental decoding (a static factor stays exact)."""

    def __init__(self, num_heads: int, head_dim: int, base: float = DEFAULT_BASE, fraction: float = 1.0,
                 scaling: Scaling = NO_SCALING, alibi_heads: int = 0):
        super().__init__(num_heads)
        self.rotary_dim = rotated_dims(head_dim, fraction)
        self.base = _check_base(base)
        if not 0 <= alibi_heads <= num_heads:
            raise ConfigError(f"rotary_alibi_heads={alibi_heads!r} is not valid with {num_heads} heads; it must be "
                              f"between 0 and {num_heads}")
        self.alibi_heads = alibi_heads
        if alibi_heads:
            self.zero = False  # a bias now: not SDPA's bias-free causal path
        self.rescale(scaling)

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        """The causal mask; with ``alibi_heads``, the first (steepest) of
        ALiBi's slopes for this many heads add ``-m_h (i - j)`` to as many
        heads: a RoPE model with built-in recency heads, the diagnostic of
        docs/retrieval.md (does RoPE retrieve late for want of a
        previous-token head?).  Not extended by the spec's method (it scales
        the frequencies)."""
        mask = super().block(q_start, q_len, k_len, dtype, device, keys)
        if self.alibi_heads:
            query, key = grid(q_len, keys or k_len, q_start, device)
            slopes = get_slopes(self.num_heads)[: self.alibi_heads].to(device)
            distance = (query - key).clamp(min=0).to(torch.float32)
            mask[: self.alibi_heads] -= (slopes[:, None, None] * distance).to(dtype)
        return mask

    def rescale(self, scaling: Scaling) -> None:
        self.scaling = check_applies(scaling, "rotary", ROPE_METHODS + LOGIT_METHODS).complete()
        self._cache.clear()
        extended_frequencies(self.frequency_method, 1.0, self.rotary_dim, self.base, self.scaling.train_length)

    @property
    def frequency_method(self) -> str:
        """The extension method of the frequencies: the spec's, or ``none``
        for a logit method (``logn`` scales the queries, ``logit_scale.py``)."""
        return self.scaling.method if self.scaling.method in ROPE_METHODS else "none"

    def frequencies(self, factor: float, device) -> Tuple[Tensor, float]:
        """``(inv_freq, attention_scale)`` at a resolved factor, kept for the pass's layers."""

        def build() -> Tuple[Tensor, float]:
            inv_freq, scale = extended_frequencies(self.frequency_method, factor, self.rotary_dim, self.base,
                                                   self.scaling.train_length)
            return inv_freq.to(device), scale

        return self.cached("frequencies", (factor, str(device)), build)

    def rotate(self, q: Tensor, k: Tensor, q_start: int, k_len: int,
               key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        positions = torch.arange(q_start, q_start + q.size(2), device=q.device)
        if not (self.scaling.dynamic and key_padding_mask is not None):
            inv_freq, scale = self.frequencies(float(self.scaling.factor_at(k_len)), q.device)
            return rotate(q, positions, inv_freq, scale), rotate(k, positions, inv_freq, scale)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        factors = [float(self.scaling.factor_at(int(n))) for n in (~key_padding_mask.bool()).sum(-1).tolist()]
        for factor in sorted(set(factors)):  # each row at its own keys' factor
            rows = torch.tensor([i for i, f in enumerate(factors) if f == factor], device=q.device)
            inv_freq, scale = self.frequencies(factor, q.device)
            q_out[rows] = rotate(q[rows], positions, inv_freq, scale)
            k_out[rows] = rotate(k[rows], positions, inv_freq, scale)
        return q_out, k_out
