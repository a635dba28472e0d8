"""Every change this package makes to fairseq, torch or NumPy, in one place.

:func:`apply` runs once, from the package's ``__init__`` (so both the
``alibi-*`` console scripts and stock CLIs run with ``--user-dir`` get it), and
is idempotent.  Each change alters behaviour only where stock fairseq 0.12
would crash or silently do the wrong thing:

* ``numpy.compat.long``: NumPy 2 removed it and fairseq 0.12's
  ``TokenBlockDataset`` (``eos`` break mode: generation, the hub interface)
  still spells it.
* torchrun on a machine without CUDA: fairseq would make every worker train
  alone (world size = number of GPUs = 1) or crash in ``rank % 0``; the config
  is taken from torchrun's environment, with gloo (the only CPU backend).
* ``DistributedDataParallel`` of a CPU module: fairseq passes ``device_ids``,
  which PyTorch rejects for CPU modules; they are dropped.
* checkpoint reading in ``fairseq.checkpoint_utils``: every file goes through
  :func:`safe_load.load` (allowlisted unpickling, never arbitrary code), and an
  unconverted checkpoint of the 2021 fork is refused (it would silently run as
  a sinusoidal model).
* ``--model-overrides`` / hub keywords: fairseq silently drops a key no
  config has, so an ``alibi*`` typo is warned about (``models.config.check_override_keys``).
* checkpoint copies (``checkpoint_last.pt``, ``checkpoint_best.pt``) are
  written atomically, so a crash never leaves a truncated one.
* ``fairseq.distributed.utils.torch``: resuming under torchrun broadcasts the
  state as a pickle read back with ``torch.load``; the safe loader reads it
  (torch's default allowlist refuses the OmegaConf cfg).

* third-party warnings known to be harmless here (hydra deprecations, CPU-only
  torch notices) are filtered; ``FAIRSEQ_ALIBI_WARNINGS=1`` shows them.

One scoped change is not applied globally: :func:`decoder_class` swaps the
decoder class the stock LM builder instantiates, for the duration of one
``build_model`` call.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import types
import warnings

import numpy as np
import torch

from . import safe_load

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


def safe_checkpoint_io() -> None:
    """Safe loading + fork refusal, atomic copies, safe broadcast, checked
    override keys (see the module docstring)."""
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    from .fork import refuse_fork

    if isinstance(checkpoint_utils.torch, _SafeTorch):
        return
    checkpoint_utils.torch = _SafeTorch(checkpoint_utils.torch, inspect=refuse_fork)
    checkpoint_utils.PathManager = _AtomicCopyPathManager(checkpoint_utils.PathManager)
    stock_overwrite = checkpoint_utils.overwrite_args_by_name

    def overwrite_args_by_name(cfg, overrides):
        from .models.config import check_override_keys

        check_override_keys(overrides, cfg)
        return stock_overwrite(cfg, overrides)

    checkpoint_utils.overwrite_args_by_name = overwrite_args_by_name
    # broadcast_object puts fairseq's one-int _TensorPlaceholder where each tensor was.
    placeholder = distributed_utils._TensorPlaceholder
    distributed_utils.torch = _SafeTorch(distributed_utils.torch, extra_globals=[placeholder])


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


def apply() -> None:
    """Apply every global change above (idempotent)."""
    restore_numpy_compat_long()
    quiet_harmless_warnings()
    torchrun_on_cpu()
    cpu_ddp()
    safe_checkpoint_io()
