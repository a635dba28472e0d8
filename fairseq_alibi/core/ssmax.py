"""Scalable softmax (SSMax, Nakanishi 2025, "Scalable-Softmax Is Superior for
Attention", arXiv 2501.19399): each query's logits multiplied by ``s_h ln n``,
``n`` the number of keys it sees and ``s_h`` learned per head and layer, so
that the largest attention weight does not fade as ``n`` grows.

The factor is applied to the queries with the other logit scalings
(``logit_scale.py``); this module holds the parameter.

Initialization: the material on the paper we could read states ``s`` is a
learned scalar per head and layer, and that the query is multiplied by ``s ln
n``, but not the value ``s`` starts from.  We start every ``s_h`` at
``1 / ln L`` (``L`` the training length): at ``n = L`` keys SSMax then equals
softmax, so a model begins at the temperature of standard attention at its
training length, and shorter queries begin cooler (``ln n < ln L``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .errors import ConfigError


def initial_scale(train_length: int) -> float:
    """``1 / ln L``: SSMax's factor ``s ln n`` is 1 at ``n = L``."""
    if isinstance(train_length, bool) or not isinstance(train_length, int) or train_length < 2:
        raise ConfigError(f"ssmax needs the training length (alibi_train_length, tokens_per_sample) as an integer "
                          f">= 2 to initialize its scales; got {train_length!r}")
    return 1.0 / math.log(train_length)


class ScalableSoftmax(nn.Module):
    """One layer's SSMax scales: ``scale`` ``[H]`` (float32, learned)."""

    def __init__(self, num_heads: int, train_length: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((num_heads,), initial_scale(train_length), dtype=torch.float32))
