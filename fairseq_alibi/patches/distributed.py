"""Distributed training on CPUs: torchrun, the process group, DDP, and the
state broadcast when a distributed run resumes."""

from __future__ import annotations

import atexit
import os

import torch

from .checkpoints import SafeTorch

#: The variables torchrun sets in each worker's environment.
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def _destroy_process_group() -> None:
    """A gloo group left to the interpreter's exit can abort a worker
    ("terminate called without an active exception"); fairseq never tears it down."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_on_cpu() -> None:
    """Under torchrun on a machine without CUDA, the distributed config comes
    from torchrun's environment, with gloo (the only CPU backend).

    Kind: wrong result.  Stock: fairseq counts the GPUs for the world size, so
    every worker trains a model of its own (world size 1, each saving over the
    others' checkpoints), or it crashes in ``rank % 0``.  Runs with an init
    method of their own, TPUs, pipelines or GPUs keep fairseq's inference."""
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
    infer_init_method.__wrapped__ = stock
    dist_utils.infer_init_method = infer_init_method


def _distributed_main_then_destroy(i, main, cfg, kwargs):
    """fairseq's ``distributed_main`` (train, then a barrier of all ranks), then
    the process group torn down while every rank is alive and idle."""
    from fairseq.distributed import utils as dist_utils

    dist_utils._alibi_stock_distributed_main(i, main, cfg, kwargs)
    _destroy_process_group()


def process_group_destroyed_after_training() -> None:
    """A distributed run's process group is destroyed after fairseq's final barrier.

    Kind: crash.  Stock: fairseq never tears the group down; a gloo group left
    to interpreter exit can abort a finished worker ("terminate called without
    an active exception", seen once in ~50 torchrun runs, after the last
    checkpoint was written)."""
    from fairseq.distributed import utils as dist_utils

    if dist_utils.distributed_main is _distributed_main_then_destroy:
        return
    dist_utils._alibi_stock_distributed_main = dist_utils.distributed_main
    dist_utils.distributed_main = _distributed_main_then_destroy  # call_main looks it up by name


def cpu_ddp() -> None:
    """``DistributedDataParallel`` of a module on the CPU gets no ``device_ids``.

    Kind: crash.  Stock: fairseq passes ``device_ids`` (and ``output_device``)
    whatever the device, and PyTorch rejects them for a CPU module.  A module
    on a GPU gets them as before."""
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


def safe_broadcast() -> None:
    """The state that a resuming distributed run broadcasts from rank 0 is read
    back by the safe loader (``safe_load.load``).

    Kind: crash.  Stock: ``fairseq.distributed.utils.broadcast_object`` pickles
    the state and reads it back with ``torch.load``, whose default allowlist
    (``weights_only``) refuses the OmegaConf config in it, so resuming under
    torchrun stops.  fairseq's one-int ``_TensorPlaceholder`` (where each
    tensor was) is the one type added to the allowlist."""
    from fairseq.distributed import utils as distributed_utils

    if isinstance(distributed_utils.torch, SafeTorch):
        return
    placeholder = distributed_utils._TensorPlaceholder
    distributed_utils.torch = SafeTorch(distributed_utils.torch, extra_globals=[placeholder])
