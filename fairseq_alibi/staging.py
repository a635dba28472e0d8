"""Outputs that appear whole or not at all.

A tool writes into a fresh hidden directory beside (or in) its destination,
and only a run that finished moves what it wrote into place, with Ctrl-C held
back for the few renames (:func:`interrupts_held`): an interrupted, refused or
failed run leaves no half dataset or model, only what was there before.

* :func:`staged_files`: the files of one run merged into a directory that may
  hold others (``alibi-preprocess``: a split's ``.bin`` and ``.idx``, its
  dictionary, beside splits binarized earlier);
* ``export.writer.staged_directory``: a whole directory replaced (an export).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from typing import Callable, Iterator, Optional


def existing_ancestor(path: str) -> str:
    """The nearest directory above ``path`` (or ``path`` itself) that exists."""
    here = os.path.abspath(path)
    while not os.path.isdir(here):
        here = os.path.dirname(here)
    return here


def stage_in(directory: str, name: str) -> str:
    """A new empty hidden directory in ``directory`` (so on its file system: a
    rename moves what it holds).  An ``OSError`` (not writable) is the caller's to report."""
    return tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=directory)


def stage_beside(path: str) -> str:
    """A stage in the nearest existing directory above ``path``: nothing of
    ``path`` is created before the work is done."""
    return stage_in(existing_ancestor(os.path.dirname(os.path.abspath(path))), os.path.basename(os.path.abspath(path)))


def stage_for_files(destdir: str) -> str:
    """Where files for ``destdir`` are staged: in it if it exists (a stage beside it
    would need its parent to be writable too), else beside it."""
    if os.path.isdir(destdir):
        return stage_in(destdir, os.path.basename(os.path.abspath(destdir)))
    return stage_beside(destdir)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) during the block is delivered when it ends, to whatever
    handled it before (KeyboardInterrupt, as a rule): a few renames that must
    all happen, or none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


def _merge(stage: str, destdir: str, merge: Optional[Callable[[str, str], bool]]) -> None:
    """Every entry of ``stage`` into ``destdir`` (replacing one of the same name),
    unless ``merge(staged, target)`` took care of it (a log appended to)."""
    os.makedirs(destdir, exist_ok=True)
    with interrupts_held():
        for name in sorted(os.listdir(stage)):
            staged, target = os.path.join(stage, name), os.path.join(destdir, name)
            if merge is None or not merge(staged, target):
                os.replace(staged, target)


@contextlib.contextmanager
def staged_files(destdir: str, merge: Optional[Callable[[str, str], bool]] = None) -> Iterator[str]:
    """A fresh directory to write into, whose files are moved into ``destdir``
    (created then) when the block succeeds, and which is removed in any case."""
    stage = stage_for_files(destdir)
    try:
        yield stage
        _merge(stage, destdir, merge)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
