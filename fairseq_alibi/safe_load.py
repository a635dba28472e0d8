"""Allowlisted unpickling: the only way this project reads a checkpoint file.

A ``.pt`` file is a pickle, and unpickling an untrusted pickle can run any code.
Every load in this project goes through :func:`load`, which calls
``torch.load(..., weights_only=True)`` with exactly the extra types listed in
:data:`SAFE_GLOBALS` allowed for that one call.  A file that needs anything else
is refused with :class:`UnsafeCheckpointError` before any of its objects are
built; there is no fallback to unrestricted unpickling, and the
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` environment variable does not change this
(torch honours an explicit ``weights_only=True``).

What fairseq checkpoints contain, found by scanning real files with
``torch.serialization.get_unsafe_globals_in_checkpoint``:

* fairseq 0.12 (this project's own checkpoints, including ``checkpoint_last.pt``
  with Adam state, meters and the data-iterator position, single process or
  torchrun/gloo): only tensors, storages and ``collections.OrderedDict``, all of
  which torch allows already.  fairseq 0.12 saves ``cfg`` as a plain dict.
* the ALiBi fork (fairseq 1.0.0a0): its trainer saves ``cfg`` as a plain dict
  of resolved values (``OmegaConf.to_container``), like fairseq 0.12.
* a ``cfg`` pickled as an OmegaConf ``DictConfig`` (other fairseq 1.0-era
  snapshots and hand-made files) brings the OmegaConf container classes and
  the type objects its node metadata records (``typing.Any``, ``dict``,
  ``list``, ``int``) and a ``collections.defaultdict``.
* pre-hydra fairseq (up to 0.10): the options are an ``argparse.Namespace``
  under ``args`` (fairseq 1.0-era configs may embed one too).

The published fork files could not be scanned here (no network); the fork
layout is reproduced in tests (conftest.fork_layout) from the fork's source.
If a real file needs one more harmless type, the refusal names it.

Nothing else is allowed: no numpy scalars (fairseq 0.12 does not write them),
no enums (fairseq converts them to strings before saving) and no fairseq
classes.  No fairseq import here, so this module can be read on its own.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import re
import typing
import zipfile
from typing import Any, List

import torch
from omegaconf import DictConfig, ListConfig
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode

from .errors import (  # noqa: F401
    CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, checkpoint_files, plural,
)


# Each entry is a type a fairseq checkpoint is known to reference (see the
# module docstring for where each comes from).  Allowing a type lets the file
# name it and build instances of it, so only plain data holders are listed.
SAFE_GLOBALS: List[Any] = [
    DictConfig,  # a cfg pickled as an OmegaConf config (fairseq 1.0-era snapshots)
    ListConfig,  # list values inside such a cfg
    ContainerMetadata,  # DictConfig/ListConfig bookkeeping
    Metadata,  # value-node bookkeeping
    AnyNode,  # every leaf value of an untyped OmegaConf config
    typing.Any,  # recorded as the key/element/ref type in that metadata
    dict,  # recorded as a ref/object type in that metadata
    list,  # recorded as a ref/object type in that metadata
    int,  # recorded as the key type of list metadata
    collections.defaultdict,  # OmegaConf metadata flags
    argparse.Namespace,  # pre-hydra checkpoints' ``args``
]

# The first bytes of torch's legacy (pre-1.6, non-zip) format: a pickled
# protocol-2 long holding torch's magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _global_names(obj) -> List[str]:
    names = []
    for item in obj:
        module = getattr(item, "__module__", None)
        name = getattr(item, "__qualname__", None) or getattr(item, "__name__", None)
        names.append(f"{module}.{name}")
    return names


def _check_container(path: str) -> None:
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"checkpoint file not found: {path}")
    if os.path.isdir(path):
        raise CorruptCheckpointError(checkpoint_files(path))
    if zipfile.is_zipfile(path):
        _check_crc(path)
        return
    with open(path, "rb") as handle:
        head = handle.read(len(_LEGACY_MAGIC))
    if head == _LEGACY_MAGIC:
        return
    size = os.path.getsize(path)
    raise CorruptCheckpointError(
        f"{path} is not a readable PyTorch checkpoint ({size} bytes, neither a torch zip "
        "archive nor the legacy format): it is truncated, corrupt, or another kind of file"
    )


def _check_crc(path: str) -> None:
    """A torch zip archive records a CRC-32 of every member; torch's reader does
    not check them, so bytes changed inside tensor data would load as wrong weights."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a readable PyTorch checkpoint (damaged zip archive: {_first_line(str(exc))})"
        ) from None
    if bad is not None:
        raise CorruptCheckpointError(
            f"{path} is damaged: its member {bad} fails its checksum (the bytes changed after the file was "
            "written: a disk error or an incomplete copy); nothing was loaded; use another copy of the checkpoint"
        )


#: Buffers that are not data: the model never reads their values, so they are not
#: checked.  fairseq registers ``_float_tensor`` (``torch.FloatTensor(1)``, one
#: uninitialized element) in ``AdaptiveInput``, ``AdaptiveSoftmax``'s tied head and,
#: up to fairseq 0.12.2 and in the 2021 fork, ``SinusoidalPositionalEmbedding``,
#: only to mark the module's device and dtype (``.new(...)``, ``.to(...)``).  What
#: the memory held is saved with it: a real ``transformer_lm_wiki103_alibi``
#: checkpoint held 2.94e+26 there, the same model saved in fp16 ``inf``.
MARKER_BUFFERS = ("_float_tensor",)


def is_marker(name: str) -> bool:
    """Whether a state-dict entry is a marker buffer (:data:`MARKER_BUFFERS`), not data."""
    return name.rsplit(".", 1)[-1] in MARKER_BUFFERS


def check_finite(path: str, state: Any) -> None:
    """A checkpoint's model weights (parameters and the buffers the model reads; not
    the :data:`MARKER_BUFFERS`) are finite numbers: a NaN or inf weight makes every
    result NaN (or silently wrong), never a result to print."""
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        return
    for name, tensor in model.items():
        if is_marker(str(name)) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CorruptCheckpointError(
                f"{path}: weight {name} holds {bad} NaN/inf {plural(bad, 'value')}; the checkpoint is damaged or its "
                "training diverged; use an earlier checkpoint"
            )


def check_checkpoint(path: str, state: Any) -> None:
    """``state`` is what fairseq saves: a dict of ``model`` weights and a config
    (``cfg``, or ``args`` before fairseq 0.10).  Another PyTorch file (a bare
    state dict, a tensor, a list) met fairseq's loader as a KeyError or a
    TypeError traceback."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or (
            state.get("cfg") is None and state.get("args") is None):
        raise CheckpointError(f"{path} is not a fairseq checkpoint: it has no config ('cfg' or 'args') and 'model' "
                              "weights (a file fairseq-train saved is; a bare state dict is not)")


def _unsafe_globals(path: str) -> List[str]:
    """The globals the file needs that are not allowed (read without running it)."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # legacy format or unreadable: the caller has the message
        return []


def load(path, map_location="cpu", extra_globals=()) -> Any:
    """``torch.load`` of ``path`` restricted to tensors and :data:`SAFE_GLOBALS`.

    ``path`` is a file name (or an open binary file); ``extra_globals`` adds
    types for one caller's own non-checkpoint data (see ``patches.distributed.safe_broadcast``).  Raises
    :class:`UnsafeCheckpointError` for a file that needs other types and
    :class:`CorruptCheckpointError` for a missing, truncated, foreign or
    damaged file (zip checksums) and for model weights that are not finite.
    """
    if isinstance(path, (str, bytes, os.PathLike)):
        path = os.fsdecode(path)
        _check_container(path)
        source = path
    else:
        source, path = path, getattr(path, "name", "<stream>")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS + list(extra_globals)):
            state = torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        needed = (_unsafe_globals(path) if source is path else []) or _GLOBAL_RE.findall(text)
        if needed:
            raise UnsafeCheckpointError(
                f"refusing to load {path}: it needs {', '.join(sorted(set(needed)))}, outside "
                "fairseq-alibi's allowlist of types a checkpoint may contain; nothing in the "
                "file was run (see fairseq_alibi/safe_load.py)"
            ) from None
        raise CorruptCheckpointError(
            f"{path} is not a readable PyTorch checkpoint (corrupt pickle data: {_cause(text)})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a readable PyTorch checkpoint (truncated or corrupt: "
            f"{type(exc).__name__}: {_first_line(str(exc))})"
        ) from None
    check_finite(path, state)
    return state


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:200]
    return "no details"


def _cause(text: str) -> str:
    """The specific line of torch's weights-only error, without its generic preamble."""
    for line in text.strip().splitlines():
        line = line.strip()
        if line and not line.startswith(("Weights only load failed", "Check the documentation")):
            return line[:200]
    return _first_line(text)


def allowed_global_names() -> List[str]:
    """Dotted names of :data:`SAFE_GLOBALS`, for documentation and tests."""
    return _global_names(SAFE_GLOBALS)
