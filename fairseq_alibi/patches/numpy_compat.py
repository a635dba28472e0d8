"""NumPy 2 against fairseq 0.12: the one name fairseq still spells the NumPy 1 way."""

from __future__ import annotations

import types

import numpy as np


def restore_numpy_compat_long() -> None:
    """``numpy.compat.long`` is ``numpy.int64`` again.

    Kind: crash.  Stock: NumPy 2 removed ``numpy.compat``, and fairseq 0.12's
    ``TokenBlockDataset`` (``--sample-break-mode eos``: generation, the hub
    interface) still reads ``np.compat.long``, an AttributeError.  Under NumPy 1
    the name exists and nothing changes."""
    try:
        np.compat.long  # noqa: B018  (NumPy 1.x: present, nothing to do)
    except AttributeError:
        np.compat = types.SimpleNamespace(long=np.int64)
