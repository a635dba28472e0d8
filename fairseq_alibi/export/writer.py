"""Writing an export atomically, and the code files that travel with it.

Everything is written into a temporary directory beside ``OUTPUT_DIR`` and
renamed into place at the end (a crash or Ctrl-C leaves no half-written
model, only nothing); an existing non-empty ``OUTPUT_DIR`` is replaced only
with ``--force``, and then only after the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Iterable, Iterator, List

from ..errors import ExportError

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The modules an exported model loads by name (``auto_map``); their relative imports travel too.
ENTRY_MODULES = ("configuration_alibi", "modeling_alibi")
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)


def traveling_files() -> List[str]:
    """``configuration_alibi.py``, ``modeling_alibi.py`` and every sibling they
    import (``from .module import name``, the form transformers' loader follows)."""
    todo, seen = list(ENTRY_MODULES), []
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        with open(os.path.join(PACKAGE_DIR, f"{name}.py"), encoding="utf-8") as f:
            todo.extend(_RELATIVE_IMPORT.findall(f.read()))
    return [os.path.join(PACKAGE_DIR, f"{name}.py") for name in seen]


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
        stage = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".tmp", dir=parent)
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
    """Move ``stage`` to ``path``; an old ``path`` goes only once the new one is in place."""
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
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
