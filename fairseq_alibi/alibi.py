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
from typing import Optional

import torch

INTERPOLATION_METHODS = ("none", "linear", "ntk")
BIDIRECTIONAL_MODES = ("symmetric", "split", "learned")


def _power_of_two_slopes(n: int) -> list:
    """Geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8)."""
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def get_slopes(num_heads: int) -> torch.Tensor:
    """The paper's per-head slopes, in the paper's head order, as float32 ``[H]``.

    For ``H`` not a power of two: the slopes of the closest lower power of two
    ``c``, then every other slope of the ``2c`` sequence, first ``H - c`` of them
    (so the sequence is not monotonic, exactly as in the reference code).
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")
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


def relative_distance(
    q_len: int, k_len: int, device=None, q_start: Optional[int] = None
) -> torch.Tensor:
    """``[q_len, k_len]`` int64 tensor of ``i - j`` (query minus key position).

    Queries are positions ``q_start .. q_start + q_len - 1`` (default: the last
    ``q_len`` of the ``k_len`` keys, as with a KV cache).
    """
    if q_start is None:
        q_start = k_len - q_len
    query_pos = torch.arange(q_start, q_start + q_len, device=device)
    key_pos = torch.arange(k_len, device=device)
    return query_pos[:, None] - key_pos[None, :]


def causal_bias(
    slopes: torch.Tensor,
    q_len: int,
    k_len: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    q_start: Optional[int] = None,
) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-slope * (i - j)`` for ``j <= i``, ``-inf`` above."""
    distance = relative_distance(q_len, k_len, device, q_start)
    bias = -slopes.to(device=device, dtype=torch.float32)[:, None, None] * distance
    bias = bias.masked_fill(distance < 0, float("-inf"))
    return bias.to(dtype)


def symmetric_bias(
    slopes: torch.Tensor, q_len: int, k_len: int, dtype=torch.float32, device=None,
    q_start: Optional[int] = 0,
) -> torch.Tensor:
    """``[H, q_len, k_len]``: ``-slope * |i - j|`` (bidirectional attention)."""
    distance = relative_distance(q_len, k_len, device, q_start).abs()
    bias = -slopes.to(device=device, dtype=torch.float32)[:, None, None] * distance
    return bias.to(dtype)


def fork_causal_bias(
    slopes: torch.Tensor, length: int, dtype=torch.float32, device=None
) -> torch.Tensor:
    """The reference fork's ``+slope * j`` form, kept only to pin its fp16 defect.

    Softmax ignores per-row constants, so below the diagonal this equals
    ``causal_bias`` in exact arithmetic; in low precision it does not.
    """
    key_pos = torch.arange(length, device=device, dtype=torch.float32)
    bias = slopes.to(device=device, dtype=torch.float32)[:, None, None] * key_pos
    bias = bias.expand(-1, length, -1).to(dtype)
    upper = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    return bias.masked_fill(upper, float("-inf"))
