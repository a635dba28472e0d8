"""Intervals on the numbers the evaluation tools report: pure functions, no I/O.

* :func:`wilson`: the Wilson score interval of a binomial proportion (retrieval
  accuracy: ``correct`` of ``n`` prompts);
* :func:`bootstrap_ratio`: a percentile bootstrap interval of ``sum(num) /
  sum(den)`` over units resampled with replacement (perplexity: per-window
  summed losses over per-window token counts, then ``2 ** ratio``; a mean
  log-probability: per-prompt values over ones).  The resampling is fixed by
  ``seed``: resample ``b`` draws ``numpy.random.default_rng(seed).integers(0,
  n, size=n)``, the ``b``-th such draw of one generator, so the interval is a
  function of the data alone.

Units, not tokens, are resampled: tokens of one window share their context and
are not independent; windows are nearly so.  Both are two-sided at ``level``
(default 95 %).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Optional, Sequence, Tuple

LEVEL = 0.95
RESAMPLES = 1000
SEED = 0
#: Index draws held in memory at once (resamples are drawn in blocks of rows).
_BLOCK = 2_000_000


def z_value(level: float = LEVEL) -> float:
    """The standard normal quantile of a two-sided ``level`` (1.959964 for 95 %)."""
    if not 0 < level < 1:
        raise ValueError(f"level {level} is not between 0 and 1")
    return NormalDist().inv_cdf(0.5 + level / 2)


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


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], transform: Callable[[float], float] = float,
                    resamples: int = RESAMPLES, seed: int = SEED,
                    level: float = LEVEL) -> Optional[Tuple[float, float]]:
    """(low, high): percentiles ``(1 - level) / 2`` and ``(1 + level) / 2`` of
    ``transform(sum(num[i]) / sum(den[i]))`` over ``resamples`` resamples ``i`` of the
    units with replacement (see the module docstring for the draws); None for no units."""
    import numpy as np

    num_a, den_a = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if num_a.shape != den_a.shape or num_a.ndim != 1:
        raise ValueError(f"{num_a.shape} numerators for {den_a.shape} denominators")
    n = num_a.size
    if n == 0 or resamples < 1:
        return None
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    rows = max(1, _BLOCK // n)
    for start in range(0, resamples, rows):
        count = min(rows, resamples - start)
        draws = rng.integers(0, n, size=(count, n))  # row b is the b-th draw of size n
        ratios = num_a[draws].sum(axis=1) / den_a[draws].sum(axis=1)
        stats[start:start + count] = [transform(r) for r in ratios]
    low, high = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def perplexity_interval(window_loss: Sequence[float], window_tokens: Sequence[int],
                        **options) -> Optional[Tuple[float, float]]:
    """Bootstrap interval of ``2 ** (sum loss / sum tokens)`` over windows
    (``window_loss``: each window's summed loss in bits)."""
    return bootstrap_ratio(window_loss, window_tokens, lambda r: 2.0 ** r, **options)


def mean_interval(values: Sequence[float], **options) -> Optional[Tuple[float, float]]:
    """Bootstrap interval of the mean of ``values``."""
    return bootstrap_ratio(values, [1.0] * len(values), **options)


def perplexity_ratio_interval(loss_a: Sequence[float], loss_b: Sequence[float], window_tokens: Sequence[int],
                              **options) -> Optional[Tuple[float, float]]:
    """Paired bootstrap interval of ``ppl_a / ppl_b`` of two methods scored on the
    same windows: ``2 ** (sum(a - b) / sum tokens)``, the same windows resampled
    for both (much tighter than two separate intervals, which share the text's
    own difficulty)."""
    return bootstrap_ratio([a - b for a, b in zip(loss_a, loss_b)], window_tokens, lambda r: 2.0 ** r, **options)
