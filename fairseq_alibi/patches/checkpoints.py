"""Checkpoint files in ``fairseq.checkpoint_utils``: how they are read, which
are refused, how their copies and a full disk are handled, and what the
model overrides of a loaded checkpoint are checked against."""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Iterable

import torch

from .. import safe_load
from ..fork import refuse_fork

#: A check of model overrides: ``check(overrides, cfg)`` raises or warns
#: before fairseq applies ``overrides`` to a checkpoint's ``cfg``.
OverrideCheck = Callable[[Any, Any], None]


class SafeTorch:
    """Stands in for ``torch`` inside one fairseq module: the same module,
    except that ``load`` is :func:`safe_load.load` followed by each of
    ``inspectors`` (``inspector(name, obj)``, which may refuse the file)."""

    def __init__(self, module, extra_globals=()):
        self._module = module
        self._extra_globals = tuple(extra_globals)
        self.inspectors = []

    def __getattr__(self, name):
        return getattr(self._module, name)

    def load(self, f, map_location=None, **_ignored):
        # ``weights_only`` and ``pickle_module`` from a caller are ignored on
        # purpose: there is no unrestricted load through this object.
        name = getattr(f, "name", None)
        source = name if isinstance(name, str) and os.path.isfile(name) else f
        obj = safe_load.load(source, map_location=map_location or "cpu", extra_globals=self._extra_globals)
        for inspect in self.inspectors:
            inspect(name if isinstance(name, str) else "<stream>", obj)
        return obj


class AtomicCopyPathManager:
    """Stands in for ``PathManager`` inside ``fairseq.checkpoint_utils``: same
    class, except that a local ``copy`` writes a temporary file and renames it."""

    def __init__(self, path_manager):
        self._path_manager = path_manager

    def __getattr__(self, name):
        return getattr(self._path_manager, name)

    def copy(self, src_path, dst_path, overwrite=False):
        local = not any(
            self._path_manager.path_requires_pathmanager(p) for p in (src_path, dst_path)
        )
        if not (local and os.path.isfile(src_path)):
            return self._path_manager.copy(src_path, dst_path, overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        tmp = f"{dst_path}.tmp{os.getpid()}"
        shutil.copyfile(src_path, tmp)
        os.replace(tmp, dst_path)
        return True


def safe_checkpoint_loading() -> None:
    """Every file ``fairseq.checkpoint_utils`` reads goes through
    :func:`safe_load.load`: allowlisted unpickling, never code from the file.

    Kind: crash.  Stock: fairseq 0.12 calls ``torch.load(f)``, whose default
    allowlist (``weights_only``, torch 2.6 and later) refuses the argparse
    Namespace or OmegaConf config in every fairseq checkpoint; with
    ``weights_only=False`` it would run whatever code the file names."""
    from fairseq import checkpoint_utils

    if not isinstance(checkpoint_utils.torch, SafeTorch):
        checkpoint_utils.torch = SafeTorch(checkpoint_utils.torch)


def fork_checkpoints_refused() -> None:
    """An unconverted checkpoint of the 2021 ALiBi fork is refused with one
    error that names ``alibi-convert-checkpoint`` (``fork.refuse_fork``).

    Kind: wrong result.  Stock: fairseq loads the fork's file as the
    ``transformer_lm`` it names, a sinusoidal model, and evaluates it without
    ALiBi (a perplexity, but of another model)."""
    from fairseq import checkpoint_utils

    safe_checkpoint_loading()  # the loader whose inspectors these are
    if refuse_fork not in checkpoint_utils.torch.inspectors:
        checkpoint_utils.torch.inspectors.append(refuse_fork)


def non_checkpoints_refused() -> None:
    """A PyTorch file that is not a fairseq checkpoint (a bare state dict, a
    tensor) is refused with one error naming it (``safe_load.check_checkpoint``).

    Kind: crash.  Stock: ``KeyError: 'best_loss'`` or a ``TypeError`` from deep in
    fairseq's loader (``alibi-sweep -c``, ``--restore-file``,
    ``--finetune-from-model``)."""
    from fairseq import checkpoint_utils

    safe_checkpoint_loading()  # the loader whose inspectors these are
    if safe_load.check_checkpoint not in checkpoint_utils.torch.inspectors:
        checkpoint_utils.torch.inspectors.append(safe_load.check_checkpoint)


def atomic_checkpoint_copies() -> None:
    """The copies of a saved checkpoint (``checkpoint_last.pt``,
    ``checkpoint_best.pt``) are written to a temporary file and renamed.

    Kind: crash.  Stock: fairseq copies onto the old file in place, so a run
    killed while copying leaves a truncated ``checkpoint_last.pt``, which the
    next ``--restore-file``/resume cannot read."""
    from fairseq import checkpoint_utils

    if not isinstance(checkpoint_utils.PathManager, AtomicCopyPathManager):
        checkpoint_utils.PathManager = AtomicCopyPathManager(checkpoint_utils.PathManager)


def full_disk_checkpoints() -> None:
    """A full disk while fairseq writes a checkpoint: one error naming the file,
    at once, and the half-written ``.tmp`` removed.

    Kind: crash.  Stock: fairseq tries three times (5 s), logs a traceback,
    re-raises the OSError and leaves the ``.tmp`` file behind.  Other write
    errors keep fairseq's retries."""
    from fairseq import checkpoint_utils

    from ..errors import UserError, no_space

    stock_save, stock_inner = checkpoint_utils.torch_persistent_save, checkpoint_utils._torch_persistent_save
    if getattr(stock_save, "_alibi_full_disk", False):
        return

    def _torch_persistent_save(obj, f):
        if not isinstance(f, str):
            try:
                return torch.save(obj, f)
            except Exception as exc:  # noqa: BLE001  (anything but a full disk: fairseq's retries)
                if no_space(exc):
                    raise
        return stock_inner(obj, f)

    def torch_persistent_save(obj, filename, async_write: bool = False):
        try:
            return stock_save(obj, filename, async_write)
        except Exception as exc:
            full = no_space(exc)
            if not full:
                raise
            if os.path.isfile(filename + ".tmp"):
                os.remove(filename + ".tmp")
            raise UserError(f"cannot write {filename}: {full}") from None

    torch_persistent_save._alibi_full_disk = True
    checkpoint_utils._torch_persistent_save = _torch_persistent_save
    checkpoint_utils.torch_persistent_save = torch_persistent_save


def checked_overrides(override_checks: Iterable[OverrideCheck] = ()) -> None:
    """Model overrides (``--model-overrides``, hub keywords) go through
    ``override_checks`` before fairseq applies them to a checkpoint's config,
    once per config (fairseq recurses into each section through the same name).

    Kind: wrong result.  Stock: ``overwrite_args_by_name`` silently drops a
    key that the checkpoint's config lacks and checks no value, so a misspelt
    key, or a field newer than the checkpoint, changes nothing and the run
    goes on.  The checks are given by the caller (``fairseq_alibi.models``
    passes its config's ``adopt_new_fields`` and ``check_override_keys``);
    a later call adds the checks not yet installed, in order."""
    from fairseq import checkpoint_utils

    installed = checkpoint_utils.overwrite_args_by_name
    if not hasattr(installed, "override_checks"):
        stock_overwrite = installed
        depth = [0]

        def overwrite_args_by_name(cfg, overrides):
            if depth[0] == 0:
                for check in overwrite_args_by_name.override_checks:
                    check(overrides, cfg)
            depth[0] += 1
            try:
                return stock_overwrite(cfg, overrides)
            finally:
                depth[0] -= 1

        overwrite_args_by_name.override_checks = []
        checkpoint_utils.overwrite_args_by_name = installed = overwrite_args_by_name
    for check in override_checks:
        if check not in installed.override_checks:
            installed.override_checks.append(check)
