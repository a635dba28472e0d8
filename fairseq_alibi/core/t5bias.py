"""T5's relative position bias (Raffel et al. 2020, "Exploring the Limits of
Transfer Learning with a Unified Text-to-Text Transformer").

A learned scalar per (bucket, head) is added to the attention scores, the
bucket a function of the offset between key and query: one bucket per offset
for small offsets, logarithmically wider buckets up to ``max_distance``, and
one last bucket for every offset beyond it.  In T5 one table, computed in the
first layer, serves every layer.  It extrapolates by saturating: past
``max_distance`` the bias is constant, so longer inputs only add keys at the
far bias the model trained with (the ALiBi paper finds it extrapolates better
than rotary, at a higher training and inference cost).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .alibi import get_slopes
from .errors import ConfigError


def _check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    per_side = num_buckets // 2 if bidirectional else num_buckets
    if per_side < 2 or max_distance <= per_side // 2:
        raise ConfigError(f"num_buckets={num_buckets}, max_distance={max_distance} is not valid; "
                          f"it needs at least 2 buckets per direction and max_distance > "
                          f"{per_side // 2} (the exact buckets)")


def relative_bucket(relative_position: Tensor, bidirectional: bool, num_buckets: int = 32,
                    max_distance: int = 128) -> Tensor:
    """The int64 bucket of each ``relative_position = key - query`` (T5's sign).

    Bidirectional: half the buckets for keys after the query (offset
    ``num_buckets / 2``), half for the rest, each half by ``n = |key - query|``.
    Unidirectional (a causal LM): ``n = max(query - key, 0)``, all buckets.
    Of a direction's ``b`` buckets, ``n < b / 2`` gets bucket ``n``; larger ``n``
    gets ``b/2 + floor(ln(n / (b/2)) / ln(max_distance / (b/2)) * b/2)``, at
    most ``b - 1``, so every ``n >= max_distance`` shares the last bucket.
    The logarithm is taken in float32, as T5 does (its buckets are the ones
    its tables were trained with).
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    relative_position = relative_position.to(torch.int64)
    offset = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        offset = (relative_position > 0).to(torch.int64) * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # clamp(min=exact): the log branch is only taken where n >= exact (no log of 0)
    spread = torch.log(n.clamp(min=exact).to(torch.float32) / exact) / math.log(max_distance / exact)
    far = (exact + (spread * (num_buckets - exact)).to(torch.int64)).clamp(max=num_buckets - 1)
    return offset + torch.where(n < exact, n, far)


class T5Bias(nn.Module):
    """T5's learned bucketed bias for a causal LM: one ``nn.Embedding(num_buckets,
    num_heads)`` table (one per layer stack: T5 shares it by all layers).

    Init: zeros, so that at step 0 the model has no position information (it
    is a NoPE model, ordering tokens through the causal mask alone) and every
    seed starts from the same bias; a bucket's gradient is nonzero as soon as
    its offsets carry attention, so training moves the table from there.  (T5
    draws it from N(0, d_model^-0.5), which at small widths already adds
    random order preferences per head before any training.)  ``init_slopes``
    k > 0 starts it at ALiBi's bias instead (:meth:`reset_parameters`).
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, init_slopes: float = 0.0):
        super().__init__()
        _check_buckets(num_buckets, max_distance, bidirectional=False)
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.init_slopes = float(init_slopes)
        self.table = nn.Embedding(num_buckets, num_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zeros; with ``init_slopes`` k > 0, ALiBi's bias instead: each
        bucket starts at ``-k m_h d``, ``d`` the bucket's nearest distance
        (exactly ALiBi's bias on the exact buckets, its value at the near
        edge of each log bucket), a recency per head from step 0, with
        which T5's table learns the retrieval task that it does not learn
        from zeros (docs/retrieval.md, "Why")."""
        nn.init.zeros_(self.table.weight)
        if self.init_slopes > 0:
            with torch.no_grad():
                self.table.weight.copy_(-self.init_slopes * self.first_distances()[:, None]
                                        * get_slopes(self.num_heads)[None, :])

    def first_distances(self) -> Tensor:
        """float32 ``[num_buckets]``: each bucket's nearest distance (a bucket
        no distance falls in, which coarse log buckets can leave, takes its
        predecessor's)."""
        distance = torch.arange(self.max_distance + 1)
        buckets = self.buckets(distance[:, None], torch.zeros(1, 1, dtype=torch.int64))[:, 0].tolist()
        first = [None] * self.num_buckets
        for n, b in enumerate(buckets):
            first[b] = n if first[b] is None else first[b]
        for b in range(1, self.num_buckets):  # bucket 0 holds distance 0
            first[b] = first[b - 1] if first[b] is None else first[b]
        return torch.tensor(first, dtype=torch.float32)

    def buckets(self, query: Tensor, key: Tensor) -> Tensor:
        """The int64 ``[q, k]`` buckets of integer positions ``query [q, 1]`` and
        ``key [1, k]`` (any absolute positions: a KV cache's queries start
        after 0); keys after the query share bucket 0 (the causal mask hides them)."""
        return relative_bucket(key.to(torch.int64) - query.to(torch.int64), bidirectional=False,
                               num_buckets=self.num_buckets, max_distance=self.max_distance)

    def shared_from(self, k_len: int) -> Optional[int]:
        """The least distance from which every key is in the last bucket (one
        learned value per head; ``max_distance`` or less, where the log
        buckets saturate earlier), if a pass of ``k_len`` keys reaches it, else
        None.  A property of the buckets, not of the values: a table of equal
        values (T5's zero init) still has a gradient per bucket."""
        far = int(self.first_distances()[-1])  # the last bucket always holds max_distance: never a placeholder
        return far if far < k_len else None

    def values(self, query: Tensor, key: Tensor) -> Tensor:
        """The float32 bias ``[H, q, k]`` of queries ``query [q, 1]`` over keys ``key [1, k]``."""
        return self.table(self.buckets(query, key)).to(torch.float32).permute(2, 0, 1)
