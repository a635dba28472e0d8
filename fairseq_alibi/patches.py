"""Every change this package makes to fairseq, torch or NumPy, in one place.

:func:`apply` runs once, from ``fairseq_alibi.models`` (so both the
``alibi-*`` console scripts and stock CLIs run with ``--user-dir`` get it), and
is idempotent.  Each change alters behaviour only where stock fairseq 0.12
would crash or silently do the wrong thing:

* ``numpy.compat.long``: NumPy 2 removed it and fairseq 0.12's
  ``TokenBlockDataset`` (``eos`` break mode: generation, the hub interface)
  still spells it.
* torchrun on a machine without CUDA: fairseq would make every worker train
  alone (world size = number of GPUs = 1) or crash in ``rank % 0``; the config
  is taken from torchrun's environment, with gloo (the only CPU backend).
* a distributed run's process group is destroyed after fairseq's final
  barrier (``process_group_destroyed_after_training``): fairseq never tears it
  down, and a gloo group left to interpreter exit can abort a finished worker
  ("terminate called without an active exception").
* ``DistributedDataParallel`` of a CPU module: fairseq passes ``device_ids``,
  which PyTorch rejects for CPU modules; they are dropped.
* checkpoint reading in ``fairseq.checkpoint_utils``: every file goes through
  :func:`safe_load.load` (allowlisted unpickling, never arbitrary code), and an
  unconverted checkpoint of the 2021 fork is refused (it would silently run as
  a sinusoidal model).
* the hub interface's ``from_pretrained``: local paths that are missing or of
  the wrong kind are named (``checked_hub_paths``).
* ``--model-overrides`` / hub keywords: fairseq silently drops a key no
  config has and checks no value, so an ALiBi field newer than the checkpoint
  is added to its config (``models.config.adopt_new_fields``), any other key
  the checkpoint's config lacks is warned about, and ``alibi*`` and integer
  values are checked (``models.config.check_override_keys``).
* a data directory's ``dict.txt`` and binarized splits (``.idx``/``.bin``):
  one that fairseq cannot read (another encoding or format, empty, truncated,
  half a split) is one error naming the file (``checked_data_files``).
* checkpoint copies (``checkpoint_last.pt``, ``checkpoint_best.pt``) are
  written atomically, so a crash never leaves a truncated one; a full disk
  while writing one is one error, at once, with no ``.tmp`` left behind.
* ``fairseq.distributed.utils.torch``: resuming under torchrun broadcasts the
  state as a pickle read back with ``torch.load``; the safe loader reads it
  (torch's default allowlist refuses the OmegaConf cfg).

* ``fairseq.models.build_model`` and ``fairseq.tasks.setup_task``: fairseq's
  own failed checks while building a model or a task (an ``AssertionError``
  such as ``embed_dim must be divisible by num_heads``, or a torch error on
  sizes fairseq computed from the options) are one ``ModelOptionsError``
  naming the check, so every console script prints one ``error:`` line and
  the hub API says what to change; raised from this package, they stay
  tracebacks (bugs) (``build_assertions``).
* ``from_pretrained`` logs the whole configuration object at INFO (hundreds
  of fields); that record is kept for DEBUG (``quiet_hub_config``).
* scikit-learn and SciPy's statistics, which fairseq imports on import for
  tasks this plugin never runs (1.3 s of every console script's start), load
  on first use instead (``deferred_metric_imports``).
* fairseq's batch-loading thread (a daemon, ``BackgroundConsumer``) is stopped
  and joined at exit: killed at interpreter shutdown in the middle of a torch
  operation, it aborts a finished run ("terminate called without an active
  exception", exit status -6) (``loader_threads_stop_at_exit``).
* ``fairseq.data.data_utils.batch_by_size`` drops a last batch whose size is
  not a multiple of ``--required-batch-size-multiple`` (default 8), so
  ``fairseq-generate`` and ``fairseq-validate`` silently skip up to
  ``--batch-size - 1`` lines (fairseq issue 5036); outside fairseq's
  ``Trainer`` that batch is kept.  The trainer's own iterators (training, and
  validation during training) keep fairseq's batches, so a training run is
  the stock one (``remainder_batches_kept``).
* third-party warnings known to be harmless here (hydra deprecations, CPU-only
  torch notices) are filtered; ``FAIRSEQ_ALIBI_WARNINGS=1`` shows them.

Two scoped changes are not applied globally: :func:`decoder_class` swaps the
decoder class the stock LM builder instantiates, for the duration of one
``build_model`` call; :func:`guarded_eval_lm` is applied by ``alibi-eval-lm``,
and by :func:`apply` to a stock ``fairseq-eval-lm`` run with ``--user-dir``
(no perplexity printed from nothing scored, from part of the split, or from a
NaN loss).

:func:`apply` runs from ``fairseq_alibi.models`` (whatever registers the
models with fairseq), never from ``fairseq_alibi`` or ``fairseq_alibi.hf``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import logging
import os
import queue
import shutil
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from typing import Any, Callable, List

import numpy as np
import torch

from . import safe_load
from .fork import refuse_fork

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def restore_numpy_compat_long() -> None:
    try:
        np.compat.long  # noqa: B018  (NumPy 1.x: present, nothing to do)
    except AttributeError:
        np.compat = types.SimpleNamespace(long=np.int64)


def _destroy_process_group() -> None:
    """A gloo group left to the interpreter's exit can abort a worker
    ("terminate called without an active exception"); fairseq never tears it down."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_on_cpu() -> None:
    from fairseq.distributed import utils as dist_utils
    from omegaconf import open_dict

    stock = dist_utils.infer_init_method
    if getattr(stock, "_alibi_cpu_torchrun", False):
        return

    def infer_init_method(cfg, force_distributed=False):
        if (
            cfg.distributed_init_method is None
            and not getattr(cfg, "tpu", False)
            and not getattr(cfg, "pipeline_model_parallel", False)
            and torch.cuda.device_count() == 0
            and all(key in os.environ for key in TORCHRUN_ENV)
            and int(os.environ["WORLD_SIZE"]) > 1
        ):
            with open_dict(cfg):
                cfg.distributed_init_method = "env://"
                cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
                cfg.distributed_rank = int(os.environ["RANK"])
                cfg.device_id = int(os.environ.get("LOCAL_RANK", 0))
                cfg.distributed_no_spawn = True  # torchrun made the processes
                cfg.distributed_backend = "gloo"  # nccl needs CUDA; gloo is the CPU backend
            atexit.register(_destroy_process_group)
            return
        return stock(cfg, force_distributed)

    infer_init_method._alibi_cpu_torchrun = True
    dist_utils.infer_init_method = infer_init_method


def _distributed_main_then_destroy(i, main, cfg, kwargs):
    """fairseq's ``distributed_main`` (train, then a barrier of all ranks), then
    the process group torn down while every rank is alive and idle."""
    from fairseq.distributed import utils as dist_utils

    dist_utils._alibi_stock_distributed_main(i, main, cfg, kwargs)
    _destroy_process_group()


def process_group_destroyed_after_training() -> None:
    """A finished worker's gloo group left to interpreter exit could still
    abort it (seen once in ~50 torchrun runs, after the last checkpoint)."""
    from fairseq.distributed import utils as dist_utils

    if dist_utils.distributed_main is _distributed_main_then_destroy:
        return
    dist_utils._alibi_stock_distributed_main = dist_utils.distributed_main
    dist_utils.distributed_main = _distributed_main_then_destroy  # call_main looks it up by name


def cpu_ddp() -> None:
    from fairseq.models import distributed_fairseq_model as dfm

    stock = dfm.DistributedDataParallel
    if getattr(stock, "_alibi_cpu_ddp", False):
        return

    class DistributedDataParallel(stock):
        _alibi_cpu_ddp = True

        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            param = next(module.parameters(), None)
            if param is not None and param.device.type == "cpu":
                device_ids = output_device = None
            super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)

    dfm.DistributedDataParallel = DistributedDataParallel


class _SafeTorch:
    """Stands in for ``torch`` inside one fairseq module: the same module,
    except that ``load`` is :func:`safe_load.load` followed by ``inspect``."""

    def __init__(self, module, extra_globals=(), inspect=None):
        self._module = module
        self._extra_globals = tuple(extra_globals)
        self._inspect = inspect

    def __getattr__(self, name):
        return getattr(self._module, name)

    def load(self, f, map_location=None, **_ignored):
        # ``weights_only`` and ``pickle_module`` from a caller are ignored on
        # purpose: there is no unrestricted load through this object.
        name = getattr(f, "name", None)
        source = name if isinstance(name, str) and os.path.isfile(name) else f
        obj = safe_load.load(source, map_location=map_location or "cpu", extra_globals=self._extra_globals)
        if self._inspect is not None:
            self._inspect(name if isinstance(name, str) else "<stream>", obj)
        return obj


class _AtomicCopyPathManager:
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


#: What runs on a checkpoint's config and its model overrides before fairseq
#: applies them (``models/`` registers its checks here: this module imports none of it).
OVERRIDE_CHECKS: List[Callable[[Any, Any], None]] = []


def safe_checkpoint_io() -> None:
    """Safe loading + fork refusal, atomic copies, safe broadcast, checked
    override keys (see the module docstring)."""
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    if isinstance(checkpoint_utils.torch, _SafeTorch):
        return
    checkpoint_utils.torch = _SafeTorch(checkpoint_utils.torch, inspect=refuse_fork)
    checkpoint_utils.PathManager = _AtomicCopyPathManager(checkpoint_utils.PathManager)
    stock_overwrite = checkpoint_utils.overwrite_args_by_name

    depth = [0]  # fairseq recurses into each section through this name: check the whole config once

    def overwrite_args_by_name(cfg, overrides):
        if depth[0] == 0:
            for check in OVERRIDE_CHECKS:
                check(overrides, cfg)
        depth[0] += 1
        try:
            return stock_overwrite(cfg, overrides)
        finally:
            depth[0] -= 1

    checkpoint_utils.overwrite_args_by_name = overwrite_args_by_name
    # broadcast_object puts fairseq's one-int _TensorPlaceholder where each tensor was.
    placeholder = distributed_utils._TensorPlaceholder
    distributed_utils.torch = _SafeTorch(distributed_utils.torch, extra_globals=[placeholder])


def full_disk_checkpoints() -> None:
    """A full disk while fairseq writes a checkpoint: one error naming the file,
    without fairseq's three tries (5 s, then a logged traceback), and without
    the half-written ``.tmp`` it would leave behind."""
    from fairseq import checkpoint_utils

    from .errors import UserError, no_space

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


def _hub_paths_problem(model_dir: str, checkpoint_file: str, data: str) -> str:
    """What is wrong with the local paths of a hub ``from_pretrained`` call, or ``""``."""
    import tarfile

    from .errors import not_a_file

    if os.path.isfile(model_dir) and tarfile.is_tarfile(model_dir):
        return ""  # a model archive: fairseq unpacks it
    if not os.path.isdir(model_dir):
        what = "is a file: give the directory that holds it" if os.path.exists(model_dir) else "not found"
        return f"model directory {model_dir} {what} (from_pretrained(MODEL_DIR, CHECKPOINT_FILE, data_name_or_path=DATA))"
    for name in checkpoint_file.split(os.pathsep):
        if not os.path.isfile(os.path.join(model_dir, name)):
            return not_a_file(os.path.join(model_dir, name), "checkpoint file")
    if not os.path.isdir(data) and not (os.path.isfile(data) and tarfile.is_tarfile(data)):
        what = "is a file, not a directory" if os.path.exists(data) else "not found"
        return f"data directory {data} {what}: give the fairseq-preprocess output directory (with dict.txt)"
    return ""


def checked_hub_paths() -> None:
    """``from_pretrained(MODEL_DIR, CHECKPOINT_FILE, data_name_or_path=DATA)`` with
    local paths: a missing or wrong-kind path is one ``UserError`` naming it
    (fairseq answered a TypeError about None, or tried to unpack a text file as
    an archive).  Names of fairseq's own hub models and URLs are left to fairseq."""
    from fairseq import hub_utils

    from .errors import UserError

    stock = hub_utils.from_pretrained
    if getattr(stock, "_alibi_checked", False):
        return

    def from_pretrained(model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", archive_map=None,
                        **kwargs):
        names = archive_map or {}
        local = isinstance(model_name_or_path, str) and "://" not in model_name_or_path and model_name_or_path not in names
        if local and isinstance(data_name_or_path, str) and data_name_or_path not in names:
            data = data_name_or_path
            if data.startswith("."):  # fairseq: relative to the model directory
                data = os.path.join(model_name_or_path, data)
            problem = "://" not in data and _hub_paths_problem(model_name_or_path, str(checkpoint_file), data)
            if problem:
                raise UserError(problem)
        return stock(model_name_or_path, checkpoint_file, data_name_or_path, archive_map, **kwargs)

    from_pretrained._alibi_checked = True
    hub_utils.from_pretrained = from_pretrained


def checked_data_files() -> None:
    """A data directory's ``dict.txt`` and binarized splits: a file fairseq cannot
    read (another format, another encoding, empty, truncated, half a split) is a
    ``DataError`` or ``TextInputError`` naming it, not a traceback from deep inside
    fairseq, or a crash in the middle of a run (a truncated ``.bin`` is only read
    batch by batch); the checks are ``inputs.check_text`` and ``splits.split_problem``."""
    import struct

    from fairseq.data import Dictionary, indexed_dataset

    from .errors import DataError
    from .inputs import check_text
    from .splits import split_problem

    stock_add, stock_make = Dictionary.add_from_file, indexed_dataset.make_dataset
    if getattr(stock_make, "_alibi_checked", False):
        return

    def add_from_file(self, f):
        if not isinstance(f, str):
            return stock_add(self, f)
        if os.path.isfile(f):  # a missing one, or a directory: describe() names it as a dictionary path
            check_text(f, "dictionary")
        try:
            return stock_add(self, f)
        except (ValueError, RuntimeError) as exc:
            raise DataError(f"{f} is not a fairseq dictionary ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                            "it holds one '<token> <count>' line per symbol, in UTF-8, as alibi-preprocess writes "
                            "dict.txt") from None

    def make_dataset(path, impl, *args, **kwargs):
        problem = split_problem(path) if impl != "raw" else ""
        if problem:
            raise DataError(problem)
        try:
            return stock_make(path, impl, *args, **kwargs)
        except (ValueError, AssertionError, KeyError, IndexError, struct.error) as exc:
            raise DataError(f"the binarized split {path} (.bin/.idx) cannot be read ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}); binarize it again with alibi-preprocess") from None

    def __del__(self, stock_del=indexed_dataset.MMapIndexedDataset.__del__):
        if hasattr(self, "_bin_buffer_mmap"):  # a file that failed to open has nothing to close
            stock_del(self)

    make_dataset._alibi_checked = True
    Dictionary.add_from_file = add_from_file
    indexed_dataset.make_dataset = make_dataset
    indexed_dataset.MMapIndexedDataset.__del__ = __del__


#: Third-party warnings known to be harmless here, shown on every command
#: otherwise (message regexes).  FAIRSEQ_ALIBI_WARNINGS=1 shows them again.
HARMLESS_WARNINGS = (
    r"\s*'[^']*' is validated against ConfigStore schema",  # hydra 1.1 deprecation (a config named like a schema)
    r"\s*The version_base parameter is not specified",  # hydra, fairseq's hydra_main
    r"\s*Future Hydra versions will no longer change working directory",  # hydra
    r"hydra\.experimental\.\w+\(\) is no longer experimental",  # hydra, fairseq's config loading
    r"In '[^']*': Usage of deprecated keyword in package header",  # hydra, fairseq's yaml headers
    r"\s*The strict flag in the compose API is deprecated",  # hydra, fairseq's compose call
    r"'pin_memory' argument is set as true but no accelerator",  # torch DataLoader on CPU
    r"Support for mismatched key_padding_mask and attn_mask is deprecated",  # torch, stock fairseq MHA
    r"`torch.cuda.amp.\w+\(args...\)` is deprecated",  # torch, fairseq's fp16 code
    r".*torch.cuda.amp.\w+ is deprecated",  # torch, fairseq's fp16 code
    r"`broadcast_buffers` is deprecated",  # torch DDP: fairseq passes it (kept: its meaning differs)
)


def quiet_harmless_warnings() -> None:
    """Keep the known-harmless third-party warnings above out of every command."""
    if os.environ.get("FAIRSEQ_ALIBI_WARNINGS"):
        return
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


@contextlib.contextmanager
def decoder_class(module, cls):
    """While the block runs, ``module.TransformerDecoder`` is ``cls``: the stock
    LM builder makes the embeddings (plain, adaptive or character) and then
    instantiates that name, so only the decoder class differs."""
    stock = module.TransformerDecoder
    module.TransformerDecoder = cls
    try:
        yield
    finally:
        module.TransformerDecoder = stock


def guarded_eval_lm(module) -> None:
    """Applied to ``fairseq_cli.eval_lm`` by ``alibi-eval-lm``, and by :func:`apply`
    when a stock ``fairseq-eval-lm --user-dir`` loaded the plugin: fairseq's
    ``eval_lm`` prints loss 0 / perplexity 1.00 when it scored no token, prints
    NaN as a result, and prints a perplexity over part of the split when its
    loader skipped blocks longer than the model's positions; here each stops
    with one error line (``evaluation.coverage``).  Idempotent."""
    import math

    from .errors import UserError
    from .evaluation import coverage

    stock = module.eval_lm
    if getattr(stock, "_alibi_guarded", False):
        return
    stock_main = module.main

    def main(cfg, *args, **kwargs):
        with coverage.recorded_loaders(cfg.dataset.gen_subset):
            return stock_main(cfg, *args, **kwargs)

    def eval_lm(*args, **kwargs):
        scored = [0]
        batches = kwargs.pop("batch_iterator") if "batch_iterator" in kwargs else args[2]
        tally = coverage.Tally(bool(kwargs.get("remove_bos_token", False)))

        def counted():
            for sample in batches:
                if isinstance(sample, dict) and "net_input" in sample:
                    scored[0] += int(sample.get("ntokens", 0))
                yield sample

        if "batch_iterator" in kwargs or len(args) < 3:
            kwargs["batch_iterator"] = counted()
        else:
            args = args[:2] + (counted(),) + args[3:]
        with coverage.tallied_scorer(module, tally):
            results = stock(*args, **kwargs)
        models = kwargs.get("models", args[0] if args else None)
        coverage.check_eval_lm(models, tally)  # first: a split with tokens, scored in part or not at all
        if scored[0] == 0:
            raise UserError("no token was evaluated (fairseq would print perplexity 1.00): the split is empty; "
                            "give a --gen-subset that holds text")
        if not math.isfinite(results["loss"]):
            raise UserError(
                f"the loss is {results['loss']}, not a number: the checkpoint's weights or the evaluation "
                "produce non-finite values (a diverged or damaged checkpoint?); no result is printed"
            )
        return results

    eval_lm._alibi_guarded = True
    module.eval_lm, module.main = eval_lm, main


def guarded_stock_eval_lm() -> None:
    """A stock ``fairseq-eval-lm --user-dir`` imports the plugin while parsing its
    options, its module already loaded: it gets :func:`guarded_eval_lm` too."""
    module = sys.modules.get("fairseq_cli.eval_lm")
    if module is not None and hasattr(module, "eval_lm"):
        guarded_eval_lm(module)


#: What a user changes when fairseq cannot build something, by what was being built.
_WHAT = {"build_model": ("the model", "model options (sizes, heads, layers, cutoffs, ...)"),
         "setup_task": ("the task", "task options (--task, DATA, --tokens-per-sample, ...)")}
#: What fairseq raises (or lets torch raise) on options that do not fit together.
_OPTION_ERRORS = (AssertionError, ValueError, RuntimeError, IndexError, ZeroDivisionError)


def _fairseq_check(exc: BaseException) -> str:
    """What failed and where, if fairseq's own code raised ``exc`` or handed torch the
    values it failed on (the innermost frame outside torch is fairseq's); ``""``
    otherwise: an error raised in this package or elsewhere is a bug, whose
    traceback must be seen."""
    import fairseq
    import torch

    roots = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (fairseq, torch)]
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(roots[1])]
    if not frames or not os.path.abspath(frames[-1].filename).startswith(roots[0]):
        return ""
    last = frames[-1]
    text = " ".join(str(exc).split())
    if isinstance(exc, AssertionError):
        text = f"its check failed: {text or (last.line or '').strip()}"
    else:
        text = f"{type(exc).__name__}: {text}"
    return f"{text} (fairseq/{os.path.relpath(last.filename, roots[0])}:{last.lineno})"


def _checked(stock, name: str):
    from .errors import ModelOptionsError, UserError

    what, options = _WHAT[name]

    @functools.wraps(stock)
    def wrapper(*args, **kwargs):
        try:
            return stock(*args, **kwargs)
        except _OPTION_ERRORS as exc:
            check = "" if isinstance(exc, UserError) else _fairseq_check(exc)
            if not check:
                raise
            raise ModelOptionsError(
                f"fairseq cannot build {what} from the options given: {check}; change the {options} it names "
                "so that they fit together (flags, --model-overrides keys and hub keywords alike; "
                "`alibi-train --help` lists them)"
            ) from exc

    wrapper._alibi_checked = True
    return wrapper


def build_assertions() -> None:
    """fairseq's failed checks while building a model or task -> one ``ModelOptionsError``."""
    from fairseq import models, tasks

    if not getattr(models.build_model, "_alibi_checked", False):  # a reason: see the module docstring
        models.build_model = _checked(models.build_model, "build_model")
    if not getattr(tasks.setup_task, "_alibi_checked", False):
        tasks.setup_task = _checked(tasks.setup_task, "setup_task")


class _ConfigRecordAtDebug(logging.Filter):
    """Drops the configuration object ``from_pretrained`` logs at INFO unless DEBUG is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) or record.levelno != logging.INFO:
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_hub_config() -> None:
    """``from_pretrained`` prints the whole config (a DictConfig/Namespace, not a message) at INFO."""
    logger = logging.getLogger("fairseq.models.fairseq_model")
    if not any(isinstance(f, _ConfigRecordAtDebug) for f in logger.filters):
        logger.addFilter(_ConfigRecordAtDebug())


def loader_threads_stop_at_exit() -> None:
    """fairseq's loader thread is a daemon that keeps collating batches (torch ops)
    after training stops; at interpreter exit it is stopped between batches and joined."""
    from fairseq.data import iterators

    if getattr(iterators.BackgroundConsumer, "stops_at_exit", False):
        return
    stock = iterators.BackgroundConsumer

    class BackgroundConsumer(stock):
        stops_at_exit = True
        live: "weakref.WeakSet" = weakref.WeakSet()

        def __init__(self, queue, source, max_len, cuda_device):
            super().__init__(queue, source, max_len, cuda_device)
            self.stopping = threading.Event()

            def until_stopped(items):
                for item in items:
                    if self.stopping.is_set():
                        return
                    yield item

            self._source = until_stopped(source)
            BackgroundConsumer.live.add(self)

    def stop_all(timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for thread in list(BackgroundConsumer.live):
            thread.stopping.set()
            while thread.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    while True:  # make room: a blocked put() returns, the loop sees the stop
                        thread._queue.get_nowait()
                thread.join(0.02)

    iterators.BackgroundConsumer = BackgroundConsumer
    atexit.register(stop_all)


#: What fairseq imports on import, by name, for tasks this plugin never runs
#: (sentence prediction, audio classification): 1.3 s of every start, loaded on first use.
DEFERRED_IMPORTS = {"sklearn.metrics": ("f1_score", "matthews_corrcoef"), "scipy.stats": ("pearsonr", "spearmanr")}


def _stand_in(full_name: str, names, stand_ins: dict) -> types.ModuleType:
    """A module whose attributes load the real ``full_name`` (and retire the stand-ins)."""
    def real():
        package = full_name.split(".")[0]
        retire({name: module for name, module in stand_ins.items() if name.split(".")[0] == package})
        return importlib.import_module(full_name)

    def any_name(name):
        if name.startswith("__"):  # inspect and pickle probe __file__, __spec__, ...: not a use
            raise AttributeError(name)
        return getattr(real(), name)

    def deferred(name):
        return lambda *args, **kwargs: getattr(real(), name)(*args, **kwargs)

    module = types.ModuleType(full_name, "stand-in while fairseq imports: every name loads the real module")
    module.__getattr__ = any_name
    for name in names:  # taken by ``from ... import name`` at fairseq's import: must not load yet
        setattr(module, name, deferred(name))
    return module


def deferred_metric_imports() -> None:
    """Import fairseq with stand-ins for :data:`DEFERRED_IMPORTS`: the real
    modules load when fairseq first uses one of their names."""
    if "fairseq" in sys.modules:
        return  # a stock CLI with --user-dir: fairseq came first
    stand_ins = {}
    for full_name, names in DEFERRED_IMPORTS.items():
        package_name, child = full_name.split(".")
        if package_name in sys.modules or importlib.util.find_spec(package_name) is None:
            continue  # already real, or absent (fairseq's import then says so)
        package = types.ModuleType(package_name, "stand-in while fairseq imports")
        package.__path__ = []
        module = _stand_in(full_name, names, stand_ins)
        setattr(package, child, module)
        stand_ins.update({package_name: package, full_name: module})
    sys.modules.update(stand_ins)
    try:
        import fairseq  # noqa: F401
    except ImportError:  # something in fairseq needed more of these packages than the stand-ins have
        retire(stand_ins)
        import fairseq  # noqa: F401,F811  (the real packages, as without this patch)
    finally:
        retire(stand_ins)


def retire(stand_ins: dict) -> None:
    """Take the stand-ins out of ``sys.modules`` (the real modules load on the next import)."""
    for name, module in stand_ins.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]


_TRAINER = threading.local()  # depth: > 0 while fairseq's Trainer builds its batch iterators


def _in_trainer(stock):
    @functools.wraps(stock)
    def method(*args, **kwargs):
        _TRAINER.depth = getattr(_TRAINER, "depth", 0) + 1
        try:
            return stock(*args, **kwargs)
        finally:
            _TRAINER.depth -= 1

    return method


def remainder_batches_kept() -> None:
    """Every line of a split is generated or validated: fairseq 0.12 drops the
    last batch when its size is no multiple of the required one (the batches
    are consecutive slices of ``indices``, so the dropped one is the tail)."""
    from fairseq.data import data_utils
    from fairseq.trainer import Trainer

    stock = data_utils.batch_by_size
    if getattr(stock, "_alibi_keeps_remainder", False):
        return

    def batch_by_size(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                      required_batch_size_multiple=1, fixed_shapes=None):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batches = stock(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                        required_batch_size_multiple, fixed_shapes)
        kept = sum(len(batch) for batch in batches)
        if (fixed_shapes is None and kept < len(indices) and not getattr(_TRAINER, "depth", 0)
                and (kept == 0 or np.array_equal(np.concatenate(batches), indices[:kept]))):
            batches = list(batches) + [indices[kept:]]
        return batches

    batch_by_size._alibi_keeps_remainder = True
    data_utils.batch_by_size = batch_by_size
    Trainer.get_train_iterator = _in_trainer(Trainer.get_train_iterator)
    Trainer.get_valid_iterator = _in_trainer(Trainer.get_valid_iterator)


def apply() -> None:
    """Apply every global change above (idempotent)."""
    deferred_metric_imports()  # first: before anything imports fairseq
    loader_threads_stop_at_exit()
    restore_numpy_compat_long()
    quiet_harmless_warnings()
    torchrun_on_cpu()
    process_group_destroyed_after_training()
    cpu_ddp()
    safe_checkpoint_io()
    full_disk_checkpoints()
    checked_data_files()
    checked_hub_paths()
    build_assertions()
    quiet_hub_config()
    remainder_batches_kept()
    guarded_stock_eval_lm()
