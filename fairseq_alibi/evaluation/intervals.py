"""Intervals on the numbers the evaluation tools report: pure functions, no I/O.

Every interval here is a function of the *multiset* of its units' numbers: the
same windows (or prompts) give the same interval whatever order they were
scored in and however they were batched.  Sums are ``math.fsum`` (correctly
rounded, so exact under any reordering); nothing is drawn at random.

* :func:`wilson`: the Wilson score interval of a binomial proportion (retrieval
  accuracy: ``correct`` of ``n`` prompts);
* :func:`ratio_interval`: a Student-t interval of ``sum(num) / sum(den)`` over
  units (windows: summed loss over tokens; prompts: a value over one each).
  Its standard error is the ratio estimator's, from each unit's residual
  ``num_i - ratio * den_i`` (for equal ``den`` it is the usual ``s / sqrt(n)``
  of a mean), and its quantile Student's t with ``n - 1`` degrees of freedom,
  which widens the interval when there are few units (12.7 standard errors at
  95 % for two, 2.01 for fifty).  Perplexity is ``2 ** ratio``, its interval
  ``2 **`` the ratio's bounds.
* :func:`paired_interval`: the same on per-window *differences* of two cells
  scored on the same windows (``loss_a - loss_b`` over tokens): the shared
  text's own difficulty cancels window by window, so a difference is known far
  more precisely than two separate intervals suggest.

Units, not tokens, are the sample: tokens of one window share their context
and are not independent; windows are nearly so.  A single unit gives no
spread, so no interval (:class:`Estimate` says why); intervals are two-sided
at ``level`` (default 95 %).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import NamedTuple, Optional, Sequence, Tuple

LEVEL = 0.95
#: Above this many degrees of freedom the t quantile comes from its expansion
#: around the normal one (error below 1e-12 there), below from the exact CDF.
_EXPANSION_DF = 300


class Estimate(NamedTuple):
    """A point estimate, its interval (``low``/``high``, None without one) and, without
    one, why not (``reason``); ``n``: the units it rests on."""

    value: float
    low: Optional[float]
    high: Optional[float]
    n: int
    reason: Optional[str] = None

    @property
    def interval(self) -> Optional[Tuple[float, float]]:
        return None if self.low is None else (self.low, self.high)

    def mapped(self, f) -> "Estimate":
        """The estimate under an increasing ``f`` (bounds mapped alike)."""
        return Estimate(f(self.value), None if self.low is None else f(self.low),
                        None if self.high is None else f(self.high), self.n, self.reason)


def z_value(level: float = LEVEL) -> float:
    """The standard normal quantile of a two-sided ``level`` (1.959964 for 95 %)."""
    _check_level(level)
    return NormalDist().inv_cdf(0.5 + level / 2)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level {level} is not between 0 and 1")


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function for a whole number of degrees of freedom,
    from its finite series in ``theta = atan(t / sqrt(df))``: for odd ``df``
    ``1/2 + (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)) / pi``, for
    even ``df`` ``1/2 + sin / 2 (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)``."""
    if df < 1 or df != int(df):
        raise ValueError(f"{df} degrees of freedom: a whole number >= 1")
    theta = math.atan2(t, math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    odd = df % 2 == 1
    term, total = 1.0, 1.0
    for k in range(1, (df - 1) // 2 if odd else df // 2):
        term *= c2 * ((2 * k) / (2 * k + 1) if odd else (2 * k - 1) / (2 * k))
        total += term
    if odd:
        return 0.5 + (theta + (s * math.cos(theta) * total if df > 1 else 0.0)) / math.pi
    return 0.5 + s * total / 2


def t_value(df: int, level: float = LEVEL) -> float:
    """Student's t quantile of a two-sided ``level`` with ``df`` degrees of freedom
    (12.706 for 1, 2.0086 for 50 at 95 %)."""
    _check_level(level)
    z = z_value(level)
    if df > _EXPANSION_DF:  # Cornish-Fisher expansion of t in z (Abramowitz & Stegun 26.7.5)
        g1 = (z ** 3 + z) / 4
        g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
        g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
        g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
        return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4
    target, low, high = 0.5 + level / 2, z, 2 * z
    while t_cdf(high, df) < target:
        low, high = high, 2 * high
    for _ in range(200):  # bisection to the float's resolution
        mid = (low + high) / 2
        if mid in (low, high):
            break
        low, high = (mid, high) if t_cdf(mid, df) < target else (low, mid)
    return (low + high) / 2


def wilson(correct: int, n: int, level: float = LEVEL) -> Optional[Tuple[float, float]]:
    """(low, high) of the Wilson score interval for ``correct`` successes in ``n``
    trials, as proportions in [0, 1]; None when ``n`` is 0."""
    if n <= 0:
        return None
    if not 0 <= correct <= n:
        raise ValueError(f"{correct} successes of {n} trials")
    z = z_value(level)
    p = correct / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at 0 and n the bounds are exactly 0 and 1 (the formula leaves a rounding residue)
    return (0.0 if correct == 0 else centre - half), (1.0 if correct == n else centre + half)


def units(n: int, unit: str) -> str:
    """``1 window``, ``46 windows``."""
    return f"{n} {unit}" + ("" if n == 1 else "s")


def ratio_interval(num: Sequence[float], den: Sequence[float], unit: str = "unit",
                   level: float = LEVEL) -> Optional[Estimate]:
    """``sum(num) / sum(den)`` with its Student-t interval over the units (see the
    module docstring); no interval for one unit or for units that do not vary
    (``reason`` says which); None for no units."""
    if len(num) != len(den):
        raise ValueError(f"{len(num)} numerators for {len(den)} denominators")
    n = len(num)
    if n == 0:
        return None
    total = math.fsum(den)
    if not total > 0:
        raise ValueError(f"denominators sum to {total}: not a ratio")
    ratio = math.fsum(num) / total
    bad = next((v for v in (*num, *den) if not math.isfinite(v)), None)
    if bad is not None:  # its spread is not a number: an interval of NaNs, printed as one
        return Estimate(ratio, None, None, n, f"a {unit} of value {bad}: no interval")
    if n == 1:
        return Estimate(ratio, None, None, 1, f"{units(1, unit)}: no interval")
    if len({x / d for x, d in zip(num, den)}) == 1:
        return Estimate(ratio, None, None, n, f"{units(n, unit)}, all alike: no interval")
    spread = math.fsum((x - ratio * d) ** 2 for x, d in zip(num, den))
    half = t_value(n - 1, level) * math.sqrt(n / (n - 1) * spread) / total
    return Estimate(ratio, ratio - half, ratio + half, n)


def perplexity_interval(window_loss: Sequence[float], window_tokens: Sequence[int],
                        level: float = LEVEL) -> Optional[Estimate]:
    """Perplexity ``2 ** (sum loss / sum tokens)`` and its interval over windows
    (``window_loss``: each window's summed loss in bits)."""
    estimate = ratio_interval(window_loss, window_tokens, "window", level)
    return estimate and estimate.mapped(lambda r: 2.0 ** r)


def mean_interval(values: Sequence[float], unit: str = "prompt", level: float = LEVEL) -> Optional[Estimate]:
    """The mean of ``values`` and its Student-t interval."""
    return ratio_interval(values, [1.0] * len(values), unit, level)


def paired_interval(loss_a: Sequence[float], loss_b: Sequence[float], window_tokens: Sequence[int],
                    level: float = LEVEL) -> Optional[Estimate]:
    """``ppl_a / ppl_b`` of two cells scored on the same windows (``loss_a[i]`` and
    ``loss_b[i]`` of one window): ``2 ** (sum(a - b) / sum tokens)``, its interval
    the t-interval of the per-window differences; no interval where every window
    differs alike (``identical on every window`` where that difference is 0)."""
    diffs = [a - b for a, b in zip(loss_a, loss_b)]
    if len(diffs) != len(loss_a) or len(diffs) != len(loss_b):
        raise ValueError(f"{len(loss_a)} windows against {len(loss_b)}")
    estimate = ratio_interval(diffs, window_tokens, "window", level)
    if estimate is None:
        return None
    if len(diffs) > 1 and not any(diffs):
        estimate = estimate._replace(reason=f"identical on all {len(diffs)} windows")
    return estimate.mapped(lambda r: 2.0 ** r)
