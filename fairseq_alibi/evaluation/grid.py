"""The evaluation grid shared by ``alibi-sweep`` and ``alibi-retrieval``.

checkpoints x methods x lengths (x whatever the scorer adds): parsing the
command-line syntax of each axis, identifying checkpoints and data, loading a
language model with a method's overrides, and the result store that makes a
run resumable without ever reusing a cell computed from other files.

* **checkpoints**: ``NAME=PATH`` or ``PATH`` (named after its directory);
* **methods**: ``none``; ``linear:F`` / ``ntk:F`` (static factor F >= 1);
  ``linear`` / ``ntk`` (dynamic, ``max(1, length / train_length)``, also
  ``linear:dynamic``);
* **lengths**: absolute (``64,128``, ``2k``) or relative to each checkpoint's
  training length (``1x,2x,16x``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..alibi import Scaling, ScalingError
from ..errors import EvaluationError, checkpoint_files

ALIBI_MODEL = "transformer_lm_alibi"
LANGUAGE_MODEL_FAMILIES = ("transformer_lm", ALIBI_MODEL)


@dataclass(frozen=True)
class Method:
    name: str  # none | linear | ntk
    factor: float  # 1 for none, 0 for dynamic, else the static factor

    @property
    def label(self) -> str:
        if self.name == "none":
            return "none"
        if self.factor == 0:
            return f"{self.name} dynamic"
        return f"{self.name} x{self.factor:g}"

    def overrides(self) -> dict:
        """The ``--model-overrides`` entries of this method."""
        factor = float(self.factor) if self.name != "none" else 0.0
        return {"alibi_interpolation": self.name, "alibi_scale_factor": factor}


NO_SCALING = Method("none", 1.0)


def parse_methods(spec: str) -> List[Method]:
    """``none,linear:2,linear,ntk:4,cap:0.5`` -> methods (order kept, duplicates dropped)."""
    methods: List[Method] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        try:
            scaling = Scaling.parse(item)
        except ScalingError as exc:
            what = "unknown method" if exc.field == "method" else "bad factor in method"
            raise EvaluationError(
                f"{what} {item!r} ({exc.reason}): use none, linear[:F|:dynamic], ntk[:F|:dynamic] or cap[:F]"
            ) from None
        method = Method(scaling.method, scaling.factor)
        if method not in methods:
            methods.append(method)
    if not methods:
        raise EvaluationError("no methods given")
    return methods


def parse_lengths(spec: str) -> List[Tuple[str, float]]:
    """``64,2k`` -> absolute; ``1x,16x`` -> relative to the training length."""
    out = []
    for item in (s.strip().lower() for s in spec.split(",")):
        if not item:
            continue
        try:
            if item.endswith("x"):
                kind, value = "x", float(item[:-1])
            elif item.endswith("k"):
                kind, value = "abs", int(round(float(item[:-1]) * 1024))
            else:
                kind, value = "abs", int(item)
        except ValueError:
            raise EvaluationError(
                f"bad length {item!r}: use integers (64), thousands of tokens (2k = 2048) "
                "or multiples of the training length (4x)"
            )
        if value <= 0:
            raise EvaluationError(f"bad length {item!r}: must be positive")
        out.append((kind, value))
    if not out:
        raise EvaluationError("no lengths given")
    return out


def resolve_lengths(lengths: Sequence[Tuple[str, float]], train_length: Optional[int]) -> List[int]:
    out = []
    for kind, value in lengths:
        if kind == "x":
            if not train_length:
                raise EvaluationError(
                    "relative lengths (Nx) need the checkpoint's training length, which it does not "
                    "record; give absolute lengths"
                )
            length = int(round(value * train_length))
        else:
            length = int(value)
        if length not in out:
            out.append(length)
    return sorted(out)


def parse_named(specs: Sequence[str], default_name, what: str = "checkpoints") -> List[Tuple[str, str]]:
    """``[NAME=]VALUE`` items -> (name, value); ``default_name(value)`` names a bare one."""
    out: List[Tuple[str, str]] = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            name, value = default_name(spec), spec
        if any(n == name for n, _ in out):
            raise EvaluationError(f"two {what} named {name!r}: name them with NAME=...")
        out.append((name, value))
    return out


def parse_checkpoints(specs: Sequence[str]) -> List[Tuple[str, str]]:
    """``[NAME=]PATH`` (a bare path is named after its directory) of existing files."""
    out = parse_named(specs, lambda p: os.path.basename(os.path.dirname(os.path.abspath(p))) or os.path.basename(p))
    for _, path in out:
        if os.path.isdir(path):
            raise EvaluationError(checkpoint_files(path))
        if not os.path.isfile(path):
            raise EvaluationError(f"checkpoint not found: {path}")
    if not out:
        raise EvaluationError("no checkpoints given: add --checkpoint [NAME=]PATH")
    return out


def check_data(data: str, subset: Optional[str] = None) -> None:
    """A fairseq-preprocess output directory (with ``subset``'s files, if given)."""
    if not os.path.isdir(data):
        raise EvaluationError(f"data directory not found: {data}")
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise EvaluationError(f"no dict.txt in {data}: not a fairseq-preprocess output directory")
    if subset is None:
        return
    if not all(os.path.isfile(os.path.join(data, f"{subset}.{ext}")) for ext in ("bin", "idx")):
        found = sorted(n[:-4] for n in os.listdir(data) if n.endswith(".bin"))
        raise EvaluationError(
            f"subset {subset!r} not found in {data} (expected {subset}.bin and {subset}.idx); "
            f"subsets there: {', '.join(found) or 'none'}"
        )


# ------------------------------------------------------------- identities


def file_identity(path: str) -> str:
    """``size:mtime_ns`` of a file: changes whenever the file is rewritten."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def data_identity(data: str, subset: Optional[str] = None) -> str:
    """Identity of a data directory's dictionary and (optionally) one subset."""
    names = ["dict.txt"] + ([f"{subset}.bin", f"{subset}.idx"] if subset else [])
    parts = [os.path.abspath(data)]
    parts += [f"{n}={file_identity(os.path.join(data, n))}" for n in names if os.path.exists(os.path.join(data, n))]
    return ";".join(parts)


# ------------------------------------------------------------- checkpoints


@dataclass
class CheckpointInfo:
    name: str
    path: str
    model: str  # registered model (family) name
    arch: str
    alibi: bool
    train_length: Optional[int]
    identity: str  # path + size + mtime: a cell is reused only for the same file


def _section(cfg, key):
    """A config section as a dict (DictConfig, dict or argparse Namespace)."""
    section = cfg.get(key) if hasattr(cfg, "get") else None
    if section is None:
        return {}
    if isinstance(section, dict) or hasattr(section, "get"):
        return section
    return vars(section)


def _get(section, key):
    try:
        return section.get(key)
    except Exception:  # an unresolved interpolation
        return None


def inspect_checkpoint(name: str, path: str) -> CheckpointInfo:
    """Read a checkpoint's config; refuse anything but a causal language model."""
    from fairseq import checkpoint_utils
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    cfg = state.get("cfg")
    if cfg is None and state.get("args") is not None:
        cfg = {"model": state["args"], "task": state["args"]}
    if cfg is None or not _section(cfg, "model"):
        raise EvaluationError(f"{path} has no model configuration: not a fairseq checkpoint")
    model_cfg, task_cfg = _section(cfg, "model"), _section(cfg, "task")
    arch = _get(model_cfg, "_name") or _get(model_cfg, "arch") or "?"
    family = ARCH_MODEL_NAME_REGISTRY.get(arch, arch)
    task = _get(task_cfg, "_name") or _get(task_cfg, "task")
    if family not in LANGUAGE_MODEL_FAMILIES or task not in (None, "language_modeling"):
        raise EvaluationError(
            f"{name}: {path} is a {family} checkpoint (arch {arch}, task {task or '?'}); this tool "
            f"evaluates causal language models ({', '.join(LANGUAGE_MODEL_FAMILIES)}, task "
            "language_modeling)"
        )
    alibi = family == ALIBI_MODEL
    train_length = None
    for source, key in ((model_cfg, "alibi_train_length"), (task_cfg, "tokens_per_sample"), (model_cfg, "tokens_per_sample")):
        value = _get(source, key)
        if isinstance(value, int) and value > 0:
            train_length = value
            break
    return CheckpointInfo(name, path, family, arch, alibi, train_length, f"{os.path.abspath(path)}:{file_identity(path)}")


def usable_methods(info: CheckpointInfo, methods: Sequence[Method]) -> List[Method]:
    """Every method for an ALiBi model; only ``none`` for any other (no slopes to scale)."""
    return list(methods) if info.alibi else [NO_SCALING]


def model_overrides(info: CheckpointInfo, method: Method, max_length: int) -> dict:
    """``--model-overrides`` for evaluating ``info`` with ``method`` up to ``max_length`` tokens."""
    if info.alibi:
        return method.overrides()
    if method.name != "none":
        raise EvaluationError(f"{info.name}: interpolation methods apply to ALiBi models only")
    # Without these fairseq would skip every window longer than training.
    return {"max_target_positions": max_length, "tokens_per_sample": max_length}


def eval_lm_config(data, path, length, overrides, *, context=0, subset="valid",
                   max_tokens=None, batch_size=None, cpu=False):
    """The config ``fairseq-eval-lm`` would build from the equivalent command line."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [
        data, "--path", path, "--gen-subset", subset,
        "--tokens-per-sample", str(length), "--context-window", str(context),
        "--model-overrides", repr(overrides), "--num-workers", "0",
    ]
    if max_tokens:
        argv += ["--max-tokens", str(max_tokens)]
    if batch_size:
        argv += ["--batch-size", str(batch_size)]
    if cpu:
        argv += ["--cpu"]
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    if context > 0:  # what fairseq_cli.eval_lm.main does before building the task
        cfg.task.tokens_per_sample -= context
    return cfg


def load_language_model(info: CheckpointInfo, overrides: dict, cfg):
    """(model in eval mode, task, on_cuda): fairseq's own loader with ``overrides``."""
    import torch
    from fairseq import checkpoint_utils, tasks

    task = tasks.setup_task(cfg.task)
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([info.path], arg_overrides=overrides, task=task)
    model = models[0]
    on_cuda = torch.cuda.is_available() and not cfg.common.cpu
    if on_cuda:
        model.cuda()
    model.prepare_for_inference_(cfg)
    model.eval()
    return model, task, on_cuda


# ------------------------------------------------------------- results


class ResultStore:
    """``results.json`` of an output directory: every finished cell, rewritten
    atomically after each one, so an interrupted run resumes where it stopped.

    A cell is reused only when its key matches *and* its ``identity`` (the
    checkpoint file's and the data's size and mtime, plus the settings that
    change the numbers) equals the current one; other stored cells are
    recomputed, and :attr:`stale` counts them.
    """

    def __init__(self, outdir: str):
        self.path = os.path.join(outdir, "results.json")
        self.cells: Dict[tuple, dict] = {}
        self.stale = 0
        self._stored: List[dict] = []
        if os.path.isfile(self.path):
            try:
                with open(self.path, encoding="utf-8") as f:
                    self._stored = list(json.load(f).get("cells", []))
            except (OSError, ValueError, AttributeError) as exc:
                raise EvaluationError(f"cannot read previous results {self.path}: {exc} (delete it to start over)")

    def reuse(self, key_of, identity_of) -> None:
        """Keep the stored cells whose identity is current; ``identity_of(cell)``
        is None for a checkpoint this run does not evaluate (its cells are kept as they are)."""
        for cell in self._stored:
            current = identity_of(cell)
            if current is None or cell.get("identity") == current:
                self.cells[key_of(cell)] = cell
            else:
                self.stale += 1

    def get(self, key: tuple) -> Optional[dict]:
        return self.cells.get(key)

    def put(self, key: tuple, cell: dict, meta: dict, order) -> None:
        self.cells[key] = cell
        write_json(self.path, sorted(self.cells.values(), key=order), meta)


def atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, cells: List[dict], meta: dict) -> None:
    atomic_write(path, json.dumps({"meta": meta, "cells": cells}, indent=1) + "\n")


def prepare_output_dir(outdir: str) -> None:
    """Create ``outdir`` and check it is writable, before any work starts."""
    try:
        os.makedirs(outdir, exist_ok=True)
        probe = os.path.join(outdir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise EvaluationError(
            f"cannot write to output directory {outdir}: {exc.strerror or exc}; choose another --output-dir"
        )


DEFAULT_METHODS = "none,linear:2,linear,ntk:2,ntk"


def add_grid_arguments(parser, output_dir: str) -> None:
    """The options every evaluation tool shares: the checkpoints (or Hugging Face
    models), the methods, the output directory and how to run."""
    parser.add_argument("--checkpoint", "-c", action="append", default=[], metavar="[NAME=]PATH",
                        help="a checkpoint to evaluate (repeatable)")
    parser.add_argument("--hf", action="append", default=[], metavar="[NAME=]MODEL",
                        help="a Hugging Face BLOOM, MPT or Falcon (alibi) model instead: a directory written "
                        "by save_pretrained or a hub name (repeatable)")
    parser.add_argument("--train-length", type=int, default=None,
                        help="with --hf: the model's training length, for Nx lengths and dynamic methods "
                        "(default: from its config where recorded, MPT max_seq_len, BLOOM seq_length)")
    parser.add_argument("--dtype", default=None,
                        help="with --hf: float32 | bfloat16 | float16 (default: the model's)")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="none | linear[:F|:dynamic] | ntk[:F|:dynamic], comma-separated (default: %(default)s)")
    parser.add_argument("--output-dir", "-o", default=output_dir, help="(default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="evaluate on CPU even if CUDA is available")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true", help="keep fairseq's INFO logging")


def progress(total: int, initial: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=disable, desc=desc, unit="cell",
                dynamic_ncols=True, file=sys.stderr)


def quiet_logging(verbose: bool) -> None:
    """INFO from this package; fairseq's own INFO only with ``--verbose``."""
    import logging

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stderr, force=True)
    for name in ("matplotlib", "PIL", "hydra"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not verbose:
        for name in ("fairseq", "fairseq_cli"):
            logging.getLogger(name).setLevel(logging.WARNING)

