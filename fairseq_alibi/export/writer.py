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
import sys
import tempfile
from types import ModuleType
from typing import Iterable, Iterator, List, Optional, Tuple

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


#: The core's module that imports the position methods registered outside it (``core/methods.py``,
#: empty there): an export of such a method writes it anew (:func:`methods_text`).
METHODS_FILE = "methods.py"
#: What a method's module may not import: an exported model loads with torch and transformers alone.
NOT_TRAVELING = ("fairseq", "fairseq_alibi")


def method_module(position: str) -> Optional[ModuleType]:
    """The module of ``position``'s code when it lives outside the core (a method a plugin
    registered at run time), which must then travel beside the core: its builder's module,
    loaded as a module of the core package (``positions.load_module``), importing the core by
    relative imports only (never fairseq nor this package by name); None for the core's own
    methods (and the stock sinusoidal model).  ``ExportError`` for one that cannot travel."""
    from ..core import positions

    if position not in positions.POSITIONS:
        return None
    build = positions.POSITIONS[position].build
    module = sys.modules.get(build.__module__)
    path = os.path.realpath(getattr(module, "__file__", None) or "")
    if os.path.dirname(path) == os.path.realpath(CORE_DIR):
        return None
    core = positions.__package__
    where = f"{build.__module__} ({path})" if module is not None else build.__module__
    if not build.__module__.startswith(core + ".") or "." in build.__module__[len(core) + 1:]:
        raise ExportError(f"the {position} method's code (its builder's module {where}) is not a module of {core}, "
                          "so an exported model's directory cannot import it: load the method's file with "
                          f"{core}.positions.load_module(PATH), its imports of the core relative "
                          "(from .bias import ModuleBias)")
    if getattr(module, build.__name__, None) is not build:
        raise ExportError(f"the {position} method's builder {build.__qualname__} is not a name of its module {path}, "
                          "which an exported model imports it by: define it at the module's top level")
    for line, imported in absolute_imports(path):
        if imported.split(".")[0] in NOT_TRAVELING:
            raise ExportError(f"the {position} method's module {path} imports {imported} (line {line}), which an "
                              "exported model does not have (it loads with torch and transformers alone): import "
                              "the core by relative imports (from .bias import ModuleBias)")
    return module


def absolute_imports(path: str) -> List[Tuple[int, str]]:
    """(line, module) of every absolute import of the Python file ``path``."""
    import ast

    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module))
    return sorted(found)


def methods_text(position: str, module: ModuleType) -> str:
    """``methods.py`` of a model whose method's code is ``module``: its relative import
    registers the method before ``configuration_alibi`` reads the registry, and makes
    transformers' remote-code loader copy the module (it follows ``from .name import``)."""
    from ..core.positions import POSITIONS

    stem, builder = module.__name__.rsplit(".", 1)[1], POSITIONS[position].build.__name__
    return (f'"""The position method of this model registered outside the core ({position}), written by '
            'alibi-export-hf:\nimporting its module registers it (core/methods.py is this file\'s empty '
            'original)."""\n\n'
            f"from .{stem} import {builder}  # noqa: F401  (registers {position})\n\n"
            f"#: The methods whose modules this file imports.\nREGISTERED = ({position!r},)\n")


def write_code(stage: str, position: str) -> None:
    """The default format's code files in ``stage``: the core's, and for a method whose code
    lives outside it (:func:`method_module`) that module and a ``methods.py`` importing it."""
    module = method_module(position)
    for path in traveling_files():
        shutil.copy(path, stage)
    if module is None:
        return
    shutil.copy(module.__file__, os.path.join(stage, module.__name__.rsplit(".", 1)[1] + ".py"))
    with open(os.path.join(stage, METHODS_FILE), "w", encoding="utf-8") as handle:
        handle.write(methods_text(position, module))


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
