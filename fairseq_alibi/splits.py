"""A binarized split is whole or it is not: what to say about a half one.

fairseq reads a split as a ``.bin`` and an ``.idx`` that describes it; an
interrupted write leaves one without the other, or a pair that disagrees.
:func:`split_problem` says which, in one line, for every reader (the patched
dataset loader, ``errors.describe``, ``alibi-train``'s pre-flight, the sweep's
data check).  No import of this package: ``errors`` reads it.
"""

from __future__ import annotations

import os
import struct
from typing import Optional, Tuple


def half_split_message(prefix: str, detail: str) -> str:
    """The one message of every reader for a split that is half there."""
    directory, split = os.path.split(prefix)
    return (f"{directory or '.'} holds a half split {split!r} ({detail}): an interrupted alibi-preprocess? "
            "run it again")


def _index_length(idx: str) -> Optional[Tuple[int, int]]:
    """(sentences, bytes its ``.bin`` must have) of a fairseq mmap index, or None
    when ``idx`` is not one (another format: fairseq's readers judge it).
    Raises ``ValueError`` for an mmap index cut short or damaged: an unknown
    version or element type, which fairseq's reader meets as an assertion or a
    KeyError (the reader is imported when there is an index to read)."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    magic = MMapIndexedDataset.Index._HDR_MAGIC
    with open(idx, "rb") as handle:
        head = handle.read(len(magic))
    if head != magic:
        if magic.startswith(head):  # empty, or cut inside the magic
            raise ValueError(f"{len(head)} bytes")
        return None
    try:
        index = MMapIndexedDataset.Index(idx)
    except (struct.error, ValueError) as exc:
        raise ValueError(" ".join(str(exc).split())) from None
    except (AssertionError, KeyError) as exc:  # its header's version, its element type code
        with open(idx, "rb") as handle:
            handle.seek(len(magic))
            header = handle.read(9)
        version, code = (struct.unpack("<QB", header) if len(header) == 9 else (None, None))
        raise ValueError(f"a header fairseq cannot read (version {version}, element type code {code}; "
                         f"{type(exc).__name__})") from None
    try:
        return len(index), int(index.sizes.astype("int64").sum()) * index.dtype().itemsize
    finally:
        del index


def split_problem(prefix: str) -> str:
    """What is wrong with the binarized split ``prefix`` (``data/valid``), or ``""``
    (also when neither file exists: the caller says the split is not there)."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    split = os.path.basename(prefix)
    has_bin, has_idx = os.path.isfile(bin_path), os.path.isfile(idx_path)
    if has_bin != has_idx:
        there, missing = (".bin", ".idx") if has_bin else (".idx", ".bin")
        return half_split_message(prefix, f"{split}{there} without {split}{missing}")
    if not has_bin:
        return ""
    try:
        described = _index_length(idx_path)
    except ValueError as exc:
        return half_split_message(prefix, f"{split}.idx is cut short or damaged: {exc}")
    if described is None:
        return ""
    sentences, expected = described
    actual = os.path.getsize(bin_path)
    if sentences == 0 and actual == 0:
        return (f"the binarized split {prefix} (.bin/.idx) holds no sentence (it was binarized from an empty "
                "text); binarize it again with alibi-preprocess (a non-empty text)")
    if actual != expected:
        return half_split_message(prefix, f"{split}.bin has {actual} bytes, {split}.idx describes {expected}: "
                                  "a truncated or mixed-up pair")
    return ""
