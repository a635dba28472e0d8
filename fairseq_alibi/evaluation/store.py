"""The output directory of an evaluation tool: checked writable before any work,
locked for the whole run (a second run writing the same directory is refused,
never interleaved), files written atomically, and ``results.json``, the resume
state, rewritten after each cell; a stored cell is reused only when its
identity -- the model file, the data and the settings that change its numbers
-- is unchanged."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from typing import Callable, Dict, List, Optional

from ..errors import EvaluationError, no_space


def file_identity(path: str) -> str:
    """``size:mtime_ns`` of a file: changes whenever the file is rewritten."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def prepare_output_dir(outdir: str) -> None:
    """Create ``outdir`` and check it is a writable directory, before any work starts."""
    if os.path.exists(outdir) and not os.path.isdir(outdir):
        raise EvaluationError(f"--output-dir {outdir} is a file, not a directory; choose another --output-dir")
    try:
        os.makedirs(outdir, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".write-test-", dir=outdir)  # a new file: no link followed
        os.close(handle)
        os.remove(probe)
    except OSError as exc:
        raise EvaluationError(
            f"cannot write to output directory {outdir}: {exc.strerror or exc}; choose another --output-dir"
        ) from None


class OutputLock:
    """An exclusive lock on an output directory for the whole run: a second
    tool writing the same directory at the same time is refused (its cells
    would overwrite the first's).  Released by the operating system when the
    process ends, however it ends."""

    def __init__(self, outdir: str, tool: str):
        self.path, self.tool, self.handle = os.path.join(outdir, ".lock"), tool, None

    def __enter__(self):
        import fcntl

        try:  # never through a symbolic link: truncated, it would empty the file it points to
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise EvaluationError(f"{self.path} is a symbolic link; remove it (the tools write their lock there) "
                                  "or choose another --output-dir") from None
        self.handle = os.fdopen(descriptor, "r+", encoding="utf-8")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            self.handle.seek(0)
            holder = self.handle.read().strip() or "another process"
            self.handle.close()
            raise EvaluationError(
                f"{os.path.dirname(self.path)} is being written by {holder}; wait for it to finish "
                "(a re-run then resumes from its cells) or choose another --output-dir"
            ) from None
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"{self.tool} (pid {os.getpid()})\n")
        self.handle.flush()
        return self

    def __exit__(self, *exc_info):
        self.handle.close()  # releases the lock
        return False


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    atomic_file(path, write)


def atomic_file(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a new file beside ``path`` (created afresh: a symbolic link
    planted there is never followed), then rename it over ``path`` (which
    replaces a link at ``path`` itself, not the file it points to): whole or
    not at all."""
    directory, name = os.path.split(path)
    tmp = None
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
        os.close(handle)
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise EvaluationError(f"cannot write {path}: {no_space(exc) or exc.strerror or exc}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


class ResultStore:
    """``results.json`` of an output directory: every finished cell, rewritten
    atomically after each one.  A stored cell is reused only when its
    ``identity`` equals the current one; cells of models this run does not
    evaluate are kept as they are; the others (:attr:`stale`) are recomputed
    where this run's grid has them, and kept as they are where it has not (the
    valid split's cells of a run over the test split: a later run over valid
    checks them again)."""

    def __init__(self, outdir: str, key: Callable[[dict], tuple], order: Callable[[dict], tuple]):
        self.path = os.path.join(outdir, "results.json")
        self.key, self.order = key, order
        self.cells: Dict[tuple, dict] = {}
        self.stale = 0
        self.set_aside: Dict[tuple, dict] = {}  # stale cells, written back unless recomputed
        self.stored: List[dict] = []
        if os.path.isfile(self.path):
            try:
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
                    raise ValueError("not a results file of alibi-sweep or alibi-retrieval (no 'cells' list)")
                self.stored = data["cells"]
                for cell in self.stored:
                    key(cell)
            except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:
                raise EvaluationError(
                    f"cannot read previous results {self.path}: {type(exc).__name__}: {exc} "
                    "(another tool's results, or damaged: delete it to start over)"
                ) from None

    def reuse(self, identity_of: Callable[[dict], Optional[str]]) -> None:
        for cell in self.stored:
            current = identity_of(cell)
            if current is None or cell.get("identity") == current:
                self.cells[self.key(cell)] = cell
            else:
                self.stale += 1
                self.set_aside[self.key(cell)] = cell

    def get(self, key: tuple) -> Optional[dict]:
        return self.cells.get(key)

    def put(self, cell: dict, meta: dict) -> None:
        self.cells[self.key(cell)] = cell
        self.write(meta)

    def write(self, meta: dict, cells: Optional[List[dict]] = None, **sections) -> None:
        """``results.json``: ``meta``, every stored cell (``cells``: some of them again, with
        what the reports derive from them, such as their intervals, in place of the stored
        ones; the cells of earlier runs stay) and any further ``sections``."""
        merged = {**self.set_aside, **self.cells}
        merged.update((self.key(cell), cell) for cell in cells or ())
        cells = sorted(merged.values(), key=self.order)
        atomic_write(self.path, json.dumps({"meta": meta, "cells": cells, **sections}, indent=1) + "\n")
