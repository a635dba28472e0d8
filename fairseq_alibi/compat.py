"""Fixes that keep stock fairseq 0.12 CLIs usable in this package's setting.

Imported by the model module, so ``--user-dir "$(alibi-user-dir)"`` and the
``alibi-*`` console scripts both get them.  Each fix changes behaviour only
where stock fairseq 0.12 would crash or silently do the wrong thing.

* NumPy 2 removed ``numpy.compat``; fairseq 0.12 still spells
  ``np.compat.long`` in ``TokenBlockDataset`` (``eos`` break mode, used by the
  language-modeling task for inference: generate/interactive prefixes, the
  hub interface's ``sample``/``score``).  The one alias is restored if missing.

* ``torchrun`` on a machine without CUDA: fairseq's default world size is the
  number of GPUs (so 1), which makes every torchrun worker train alone on all
  the data and write the same checkpoint; asking for the world size explicitly
  crashes in ``rank % torch.cuda.device_count()``.  When torchrun's
  environment is present and there is no CUDA device, the distributed config
  is taken from that environment (``env://``, WORLD_SIZE, RANK, LOCAL_RANK).
  fairseq then wraps the model in PyTorch DDP with ``device_ids=[device_id]``,
  which PyTorch rejects for a CPU module; for CPU modules the device ids are
  dropped (the CPU form of the same call).
"""

import atexit
import os
import types

import numpy as np
import torch

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def patch_numpy() -> None:
    try:
        np.compat.long  # noqa: B018  (NumPy 1.x: present, nothing to do)
    except AttributeError:
        np.compat = types.SimpleNamespace(long=np.int64)


def _destroy_process_group() -> None:
    """fairseq never tears its process group down; a gloo group left to the
    interpreter's exit can abort a worker ("terminate called without an active
    exception"), which torchrun then reports as a failed run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def patch_cpu_torchrun() -> None:
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
            atexit.register(_destroy_process_group)
            return
        return stock(cfg, force_distributed)

    infer_init_method._alibi_cpu_torchrun = True
    dist_utils.infer_init_method = infer_init_method


def patch_cpu_ddp() -> None:
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


patch_numpy()
patch_cpu_torchrun()
patch_cpu_ddp()
