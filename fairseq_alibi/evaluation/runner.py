"""The evaluation runner: one grid of models x methods x cells, for every tool.

``alibi-sweep`` and ``alibi-retrieval`` are each a *measure* (``perplexity.py``,
``retrieval.py``: what a cell is, how to run it, how to report it) run over
models of a *backend* (``backends.py``: fairseq checkpoints; ``hf_backend.py``:
Hugging Face models).  The runner owns everything else, once:

* the axes every tool shares: models (``NAME=PATH``), methods
  (``Scaling`` spellings), lengths (``64``, ``2k``, ``4x``);
* the output directory: a lock (a second run writing the same directory is
  refused, never interleaved), ``results.json`` rewritten atomically after each
  cell (the resume state), and a cell reused only when its identity -- the
  model file, the data and the settings that change its numbers -- is unchanged;
* the plan, validated as a whole before anything runs; each model described
  (a fairseq checkpoint read, without its optimizer state; a Hugging Face
  model's config and tokenizer) once and loaded once, models one at a time,
  then evaluated under each method in turn; the progress bar; the reports, in
  the order of ``--methods``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..core.scaling import METHOD_SYNTAX, Scaling
from ..errors import EvaluationError, no_space, not_a_file, report_errors
from ..options import INT32_MAX
from .protocols import Backend, Cell, Described, EvaluationModel, Measure, ModelInfo  # noqa: F401  (re-exported)

logger = logging.getLogger("fairseq_alibi.evaluation")

DEFAULT_METHODS = "none,linear:2,linear,ntk:2,ntk"
MAX_LENGTH = INT32_MAX  # fairseq's block code counts tokens in int32 (options.INTEGER_OPTIONS)


# ------------------------------------------------------------------ the axes


def parse_methods(spec: str) -> List[Scaling]:
    """``none,linear:2,linear,ntk:4,cap:0.5`` -> methods (order kept, duplicates
    dropped), without a training length: each model's is added by :func:`methods_for`."""
    methods: List[Scaling] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        method = Scaling.parse(item)
        if method not in methods:
            methods.append(method)
    if not methods:
        raise EvaluationError("no methods given")
    return methods


def methods_for(info: ModelInfo, methods: Sequence[Scaling]) -> List[Scaling]:
    """The methods of one model, complete with its training length: every
    method for an ALiBi model; ``none`` only for any other (no slopes to scale)."""
    if not info.alibi:
        return [Scaling()]
    for method in methods:
        if method.needs_train_length and info.train_length is None:
            raise EvaluationError(f"{info.name}: {method.spelling} needs the length the model was trained at, "
                                  f"which it does not record{info.missing_length_hint}")
    return [method.with_train_length(info.train_length).complete() for method in methods]


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
            ) from None
        if not value > 0 or value != value or value == float("inf"):
            raise EvaluationError(f"bad length {item!r}: must be a positive number")
        if kind == "abs" and value > MAX_LENGTH:
            raise EvaluationError(f"bad length {item!r}: at most {MAX_LENGTH} tokens (fairseq counts in int32)")
        out.append((kind, value))
    if not out:
        raise EvaluationError("no lengths given")
    return out


def resolve_lengths(lengths: Sequence[Tuple[str, float]], train_length: Optional[int], name: str = "") -> List[int]:
    """Token counts, sorted and distinct, for a model trained at ``train_length``."""
    out = []
    for kind, value in lengths:
        if kind == "x":
            if not train_length:
                raise EvaluationError(
                    f"{name + ': ' if name else ''}relative lengths (Nx) need the model's training length, which "
                    "it does not record; give absolute lengths (or --train-length for --hf models)"
                )
            scaled = value * train_length
            if not 1 <= round(min(scaled, MAX_LENGTH + 1)) <= MAX_LENGTH:
                raise EvaluationError(f"length {value:g}x of {train_length} tokens is {scaled:g} tokens: "
                                      f"not between 1 and {MAX_LENGTH}")
            length = int(round(scaled))
        else:
            length = int(value)
        if length not in out:
            out.append(length)
    return sorted(out)


def check_max_tokens(max_tokens: Optional[int], longest: int, what: str, unit: str) -> None:
    """``--max-tokens`` holds one ``unit`` (a window, a prompt) of ``longest`` tokens."""
    if max_tokens is not None and max_tokens < longest:
        raise EvaluationError(f"--max-tokens {max_tokens} is smaller than {what} ({longest} tokens): {unit} must "
                              "fit in a batch; raise --max-tokens")


def parse_named(specs: Sequence[str], default_name: Callable[[str], str], what: str) -> List[Tuple[str, str]]:
    """``[NAME=]VALUE`` items -> (name, value); ``default_name(value)`` names a bare one."""
    out: List[Tuple[str, str]] = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            name, value = default_name(spec), spec
        if not name or not value:
            raise EvaluationError(f"bad {what[:-1]} {spec!r}: use NAME=PATH or PATH")
        if any(n == name for n, _ in out):
            raise EvaluationError(f"two {what} named {name!r}: name them with NAME=...")
        out.append((name, value))
    return out


def file_identity(path: str) -> str:
    """``size:mtime_ns`` of a file: changes whenever the file is rewritten."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


# ------------------------------------------------------------------ the output directory


def prepare_output_dir(outdir: str) -> None:
    """Create ``outdir`` and check it is a writable directory, before any work starts."""
    if os.path.exists(outdir) and not os.path.isdir(outdir):
        raise EvaluationError(f"--output-dir {outdir} is a file, not a directory; choose another --output-dir")
    try:
        os.makedirs(outdir, exist_ok=True)
        probe = os.path.join(outdir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
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

        self.handle = open(self.path, "a+", encoding="utf-8")
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
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise EvaluationError(f"cannot write {path}: {no_space(exc) or exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class ResultStore:
    """``results.json`` of an output directory: every finished cell, rewritten
    atomically after each one.  A stored cell is reused only when its
    ``identity`` equals the current one; cells of models this run does not
    evaluate are kept as they are; the others are recomputed (:attr:`stale`)."""

    def __init__(self, outdir: str, key: Callable[[dict], tuple], order: Callable[[dict], tuple]):
        self.path = os.path.join(outdir, "results.json")
        self.key, self.order = key, order
        self.cells: Dict[tuple, dict] = {}
        self.stale = 0
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

    def get(self, key: tuple) -> Optional[dict]:
        return self.cells.get(key)

    def put(self, cell: dict, meta: dict) -> None:
        self.cells[self.key(cell)] = cell
        self.write(meta)

    def write(self, meta: dict) -> None:
        cells = sorted(self.cells.values(), key=self.order)
        atomic_write(self.path, json.dumps({"meta": meta, "cells": cells}, indent=1) + "\n")


# ------------------------------------------------------------------ the run


def answer_result(logprobs, answer: Sequence[int]) -> Tuple[bool, float, List[int]]:
    """(greedy exact match, mean log-prob, greedy ids) from ``[n_answer, V]`` log-probs."""
    import torch

    target = torch.tensor(list(answer), device=logprobs.device)
    chosen = logprobs.gather(-1, target[:, None])[:, 0]
    greedy = logprobs.argmax(-1)
    return bool((greedy == target).all()), float(chosen.double().mean()), greedy.tolist()


@dataclass
class Plan:
    described: Described
    methods: List[Scaling]
    cells: List[Cell] = field(default_factory=list)


def progress(total: int, initial: int, desc: str, disable: bool):
    """The progress bar, on a terminal only: redirected to a log, a bar is lines of
    carriage returns and padding (each finished cell's line says the time left)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=disable or not sys.stderr.isatty(), desc=desc,
                unit="cell", dynamic_ncols=True, file=sys.stderr)


def duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``2h03m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Countdown:
    """Cells finished in this run and the time left, from their mean time so far."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.ran = total, done, 0
        self.start = time.monotonic()

    def finished(self) -> str:
        """Count one finished cell; ``[cell 12/48, 3m10s so far, about 9m20s left]``."""
        self.done, self.ran = self.done + 1, self.ran + 1
        spent = time.monotonic() - self.start
        left = spent / self.ran * (self.total - self.done)
        return (f"[cell {self.done}/{self.total}, {duration(spent)} so far"
                + (f", about {duration(left)} left]" if self.done < self.total else ", done]"))


def quiet_logging(verbose: bool) -> None:
    """INFO from this package; fairseq's own INFO only with ``--verbose``."""
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stderr, force=True)
    for name in ("matplotlib", "PIL", "hydra"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not verbose:
        for name in ("fairseq", "fairseq_cli"):
            logging.getLogger(name).setLevel(logging.WARNING)


def tool_parser(prog: str, description: str, epilog: str, data_help: str, output_dir: str, data_optional=False):
    """A tool's argument parser: DATA and the options every tool shares."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?" if data_optional else None, default=None, help=data_help)
    add_grid_arguments(parser, output_dir)
    return parser


def add_grid_arguments(parser, output_dir: str) -> None:
    """The options every evaluation tool shares: the models (fairseq checkpoints
    or Hugging Face models), the methods, the output directory and how to run."""
    parser.add_argument("--checkpoint", "-c", action="append", default=[], metavar="[NAME=]PATH",
                        help="a checkpoint to evaluate (repeatable)")
    parser.add_argument("--hf", action="append", default=[], metavar="[NAME=]MODEL",
                        help="a Hugging Face model, instead of or beside --checkpoint: BLOOM, MPT, Falcon (alibi) "
                        "or a model exported by alibi-export-hf; a directory written by save_pretrained or a hub "
                        "name (repeatable)")
    parser.add_argument("--train-length", type=int, default=None,
                        help="with --hf: the model's training length, for Nx lengths, dynamic methods and cap "
                        "(default: from its config where recorded)")
    parser.add_argument("--dtype", default=None,
                        help="with --hf: float32 | bfloat16 | float16 (default: the model's)")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"{METHOD_SYNTAX}, comma-separated (default: %(default)s)")
    parser.add_argument("--output-dir", "-o", default=output_dir, help="(default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="evaluate on CPU even if CUDA is available")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true", help="keep fairseq's INFO logging")


OUTPUTS = ("results.json", "results.csv", "results.md", "perplexity.png", "per_position.csv", "per_position.png",
           "accuracy.png", "depth.png")


def main(argv: Optional[Sequence[str]], parser, measure_class) -> int:
    """A tool's whole command: parse, run the grid, print the table, say where
    the files are; user errors as one ``error:`` line (exit 1), Ctrl-C as one
    line saying that a re-run resumes (exit 130)."""
    args = parser.parse_args(argv)
    quiet_logging(args.verbose)
    with report_errors(interrupted=f"{measure_class.tool} interrupted: finished cells are saved in "
                       f"{args.output_dir}/results.json; run the same command again to resume"):
        methods = parse_methods(args.methods)
        backend = measure_class.backend_for(args)
        measure = measure_class(args, backend)
        cells = run(args, methods, measure, backend)
        print(measure.table(cells, method_rank(methods)))
    present = [n for n in OUTPUTS if os.path.exists(os.path.join(args.output_dir, n))]
    print(f"results in {args.output_dir}/ ({', '.join(present)})")
    return 0


def run(args, methods: List[Scaling], measure: Measure, backend: Backend) -> List[dict]:
    """Evaluate ``measure`` on every model of ``backend`` under every method
    (``parse_methods(args.methods)``); returns every cell of the output
    directory (this run's and the ones kept from earlier runs)."""
    specs = backend.specs(args)
    prepare_output_dir(args.output_dir)
    with OutputLock(args.output_dir, measure.tool):
        described = [backend.describe(name, source) for name, source in specs]
        plans = [Plan(d, methods_for(d.info, methods), measure.cells(d)) for d in described]
        for d, plan in zip(described, plans):
            kept = {m.key for m in plan.methods}
            skipped = [m.spelling for m in methods if m.key not in kept]
            if skipped:
                logger.warning("%s (%s) is not an ALiBi model: %s do(es) not apply to it; it is evaluated with "
                               "'none' only", d.info.name, d.info.model, ", ".join(skipped))
        store = ResultStore(args.output_dir, lambda cell: record_key(cell, measure), measure.order)
        identities = {d.info.name: f"{d.info.identity}|{backend.data_identity}|{measure.settings_identity()}"
                      for d in described}
        store.reuse(lambda cell: identities.get(cell.get("checkpoint")))
        if store.stale:
            logger.info("%d stored cells were computed from other models, data or settings: recomputing them",
                        store.stale)
        total = sum(len(p.methods) * len(p.cells) for p in plans)
        todo = [[(m, c) for m in p.methods for c in p.cells if measure.needs_run(store.get(key_of(p, m, c)))]
                for p in plans]
        logger.info("%d cells in the grid, %d already done, %d to run", total, total - sum(map(len, todo)),
                    sum(map(len, todo)))
        meta = dict(measure.meta(), methods=[m.spelling for m in methods])
        bar = progress(total, total - sum(map(len, todo)), measure.tool, args.no_progress)
        countdown = Countdown(total, total - sum(map(len, todo)))
        for plan, cells in zip(plans, todo):
            if cells:
                _run_model(plan, cells, measure, backend, store, identities[plan.described.info.name], meta, bar,
                           countdown)
        bar.close()
        store.write(meta)
        results = sorted(store.cells.values(), key=measure.order)
        measure.report(args.output_dir, results, methods)
    return results


def key_of(plan: Plan, method: Scaling, cell: Cell) -> tuple:
    """The store key of a planned cell ..."""
    return (plan.described.info.name,) + method.key + tuple(cell.key)


def record_key(record: dict, measure) -> tuple:
    """... and of a finished one: the same tuple."""
    return (record["checkpoint"],) + Scaling.from_record(record).key + tuple(measure.cell_key(record))


def _run_model(plan: Plan, todo: List[Tuple[Scaling, Cell]], measure: Measure, backend: Backend, store, identity,
               meta, bar, countdown: Countdown) -> None:
    """Load one model once and run its cells, method by method."""
    info = plan.described.info
    model: EvaluationModel = backend.load(plan.described, measure.max_length(plan.cells))
    try:
        current = None
        for method, cell in todo:
            if method != current:
                model.use(method)
                current = method
            bar.set_postfix_str(f"{info.name} {method.label} {cell.label}")
            record = measure.run(model, method, cell)
            record.update(checkpoint=info.name, path=info.path, model=info.model, method=method.method,
                          factor=float(method.factor), label=method.label, spelling=method.spelling,
                          train_length=info.train_length,
                          identity=identity)
            if method.alpha is not None:
                record["alpha"] = method.alpha
            store.put(record, meta)  # the resume point, after every cell
            bar.update(1)
            bar.write(f"{measure.log_line(record)} {countdown.finished()}")
    finally:
        model.close()


def method_rank(methods: Iterable[Scaling]) -> Callable[[dict], int]:
    """Sort key of a record's method in the order the user gave (others after them)."""
    order = {m.key: i for i, m in enumerate(methods)}
    return lambda cell: order.get(Scaling.from_record(cell).key, len(order))


def check_checkpoint_paths(pairs: Sequence[Tuple[str, str]]) -> None:
    for _, path in pairs:
        if not os.path.isfile(path):
            raise EvaluationError(not_a_file(path, "checkpoint"))
