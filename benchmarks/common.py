"""Shared helpers for the benchmarks: build real fairseq LMs in-process.

Models are built exactly as ``fairseq-train`` builds them (argument parser,
architecture defaults, ``task.build_model``), from a throw-away data directory
that only holds a dictionary of the requested size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import tempfile
from typing import Optional

import torch


def make_dict_dir(vocab_size: int) -> str:
    """A directory with a ``dict.txt`` of ``vocab_size`` symbols (plus fairseq's 4 specials)."""
    path = os.path.join(tempfile.gettempdir(), f"alibi_bench_dict_{vocab_size}_{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "dict.txt"), "w") as f:
        for i in range(vocab_size - 4):
            f.write(f"w{i} {vocab_size - i}\n")
    return path


def build_lm(arch: str, data_dir: str, extra_args=(), tokens_per_sample: int = 512):
    """(task, model, criterion, cfg) for ``arch`` as fairseq-train would build it."""
    import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    argv = [
        data_dir,
        "--task", "language_modeling",
        "--arch", arch,
        "--tokens-per-sample", str(tokens_per_sample),
        "--max-target-positions", str(tokens_per_sample),
        "--criterion", "cross_entropy",
        "--cpu",
        *extra_args,
    ]
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)  # as fairseq_cli/train.py does
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return task, model, criterion, cfg


def model_args(embed_dim: int, layers: int, heads: int, ffn: int, dropout: float = 0.1):
    """The size flags, identical for both models (input/output dims pinned to the embed dim)."""
    return [
        "--decoder-embed-dim", str(embed_dim),
        "--decoder-input-dim", str(embed_dim),
        "--decoder-output-dim", str(embed_dim),
        "--decoder-layers", str(layers),
        "--decoder-attention-heads", str(heads),
        "--decoder-ffn-embed-dim", str(ffn),
        "--dropout", str(dropout),
        "--share-decoder-input-output-embed",
    ]


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}; {os.cpu_count()} cores; {mem_gb:.0f} GiB RAM; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); python {platform.python_version()}"
    )


def device_name(device) -> str:
    """The GPU's name for a CUDA device, else the CPU's (``machine_description``'s first part)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return machine_description().split(";")[0]


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def heads_problem(embed_dim: int, heads: int):
    """Why ``--embed-dim`` cannot be split into ``--heads`` heads, as a one-line
    error (fairseq's attention needs a whole head dimension), or None."""
    if embed_dim % heads == 0:
        return None
    return (f"--embed-dim {embed_dim} must be a multiple of --heads {heads} (each head gets embed-dim / heads "
            f"dimensions): give, for instance, --embed-dim {heads * max(1, round(embed_dim / heads))}")


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def rotated(items, shift: int) -> list:
    """``items`` in the order of a round ``shift``: rotated by ``shift`` (cases timed side by side take turns
    at going first, so that none is always timed after the same neighbour)."""
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def kernel_parser(description: str, dropout_nargs: str = "+") -> argparse.ArgumentParser:
    """The options of a benchmark of one attention call (``fox_kernel.py``,
    ``position_kernels.py``): its shape, attention dropouts, repeats, threads,
    a JSON file; :func:`parse_kernel_args` checks them."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=1024, help="tokens per row (training length L)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dropout", type=float, nargs=dropout_nargs, default=[0.0, 0.1], help="attention dropout")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write every measurement here too")
    return p


def parse_kernel_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``p``'s arguments, each size at least 1 and each dropout in [0, 1)
    (``p.error`` otherwise); sets torch's thread count."""
    args = p.parse_args(argv)
    for name in ("length", "batch", "heads", "head_dim", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(not 0 <= d < 1 for d in args.dropout):
        p.error("--dropout values must be in [0, 1)")
    torch.set_num_threads(args.threads)
    return args


def write_rows(path, args: argparse.Namespace, rows) -> None:
    """``{"args": ..., "rows": ...}`` to ``path`` (``--json``), where given."""
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


@contextlib.contextmanager
def replaced(function, replacement):
    """``function`` replaced by ``replacement`` in every module of the package
    that holds it, for the block: a module that imported it by name (``from
    .causal_blocks import _block_calls``) holds its own reference, which a
    patch of the defining module alone would miss."""
    import sys

    holders = [module for module in list(sys.modules.values())
               if (getattr(module, "__name__", "") or "").startswith("fairseq_alibi")
               and getattr(module, function.__name__, None) is function]
    for module in holders:
        setattr(module, function.__name__, replacement)
    try:
        yield holders
    finally:
        for module in holders:
            setattr(module, function.__name__, function)


class _FreshBuffers:
    """A stand-in for ``native.SCRATCH`` that keeps nothing: every buffer a fresh tensor."""

    @staticmethod
    def take(shape):
        return torch.empty(shape, dtype=torch.float32)


@contextlib.contextmanager
def fresh_buffers():
    """The fused calls' kept buffers (``native.SCRATCH``) replaced for the block by fresh tensors, as
    they were before buffers were kept: what keeping them saves, timed side by side."""
    from fairseq_alibi.core import native

    kept = native.SCRATCH
    native.SCRATCH = _FreshBuffers()
    try:
        yield
    finally:
        native.SCRATCH = kept


@contextlib.contextmanager
def fused_loops_off(off: bool = True):
    """The fused CPU loops (``core/native.py``) switched off for the block where ``off``: the eager
    PyTorch passes run instead, so that a benchmark can time both paths side by side."""
    from fairseq_alibi.core import native

    before = os.environ.get(native.SWITCH)
    if off:
        os.environ[native.SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(native.SWITCH, None)
        else:
            os.environ[native.SWITCH] = before


def refusal(objects, kernel: str = "auto", dropout: float = 0.0) -> Optional[str]:
    """Why a layer of each of ``objects`` (a stack's position objects, one per
    layer) refuses the kernel option ``kernel`` or attention dropout
    ``dropout``, in words for a benchmark's row, or None: ``kernels.check_kernel``,
    which every layer runs when it is built, asked first without dropout (the
    kernel), then with it.  A method whose object computes its attention itself
    (``own_kernel``) is said so; another refusal quotes the check."""
    from fairseq_alibi.core import kernels
    from fairseq_alibi.core.errors import ConfigError

    for obj in objects:
        for drop in (0.0, dropout):
            try:
                kernels.check_kernel(kernel, obj, drop)
            except ConfigError as err:
                if drop == 0.0:
                    why = "the method runs its own attention, auto only" if obj.own_kernel else str(err)
                    return f"no kernel {kernel}: {why} (refused)"
                why = "the method's own attention has none" if obj.own_kernel else f"the {kernel} kernel has none"
                return f"no attention dropout {dropout:g}: {why} (refused)"
    return None
