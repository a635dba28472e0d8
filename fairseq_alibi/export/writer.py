"""Writing an export atomically, and the code files that travel with it.

Everything is written into a temporary directory beside ``OUTPUT_DIR`` and
renamed into place at the end (a crash or Ctrl-C leaves no half-written
model, only nothing); an existing non-empty ``OUTPUT_DIR`` is replaced only
with ``--force``, and then only after the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterable, Iterator, List

from ..errors import ExportError
from ..staging import interrupts_held, stage_beside

#: The portable core: every file of it travels with an exported model.
CORE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")


def traveling_files() -> List[str]:
    """Every module of the core folder (``core/*.py`` but its ``__init__``):
    ``modeling_alibi.py`` loads its siblings by relative imports, and the
    core imports nothing outside itself (a test checks both)."""
    return sorted(os.path.join(CORE_DIR, name) for name in os.listdir(CORE_DIR)
                  if name.endswith(".py") and name != "__init__.py")


def check_output_dir(path: str, force: bool, inputs: Iterable[str] = ()) -> None:
    """Refuse, before any work, an output that cannot or may not be written: one
    that holds an input (or the working directory), which ``--force`` would delete."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportError(f"{path} exists and is not a directory")
    out = os.path.realpath(path)
    for held in [*inputs, os.getcwd()]:
        if held and os.path.commonpath([out, os.path.realpath(held)]) == out:
            what = "the working directory" if held == os.getcwd() else f"the input {held}"
            raise ExportError(f"{path} holds {what}, which writing the export there would replace; "
                              "choose an output directory outside it")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise ExportError(f"{path} is not empty; choose a new directory, or pass --force to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    existing = parent
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {path}: {existing} is not writable")


@contextlib.contextmanager
def staged_directory(path: str, force: bool, inputs: Iterable[str] = ()) -> Iterator[str]:
    """A fresh directory to fill; renamed to ``path`` when the block succeeds, removed if it fails."""
    check_output_dir(path, force, inputs)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        stage = stage_beside(path)
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        yield stage
        os.chmod(stage, 0o755)  # mkdtemp's 0700 (and safetensors' 0600) are not a model directory's modes
        for name in os.listdir(stage):
            os.chmod(os.path.join(stage, name), 0o644)
        _replace(stage, path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _replace(stage: str, path: str) -> None:
    """Move ``stage`` to ``path``; an old ``path`` goes only once the new one is in place
    (Ctrl-C waits for both renames)."""
    with interrupts_held():
        old = _swap(stage, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _swap(stage: str, path: str):
    """``stage`` renamed to ``path``; the old ``path``'s new name (or None)."""
    old = None
    if os.path.isdir(path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".old",
                               dir=os.path.dirname(os.path.abspath(path)))
        os.rmdir(old)
        os.rename(path, old)
    try:
        os.rename(stage, path)
    except OSError:
        if old is not None:
            os.rename(old, path)
        raise
    return old
