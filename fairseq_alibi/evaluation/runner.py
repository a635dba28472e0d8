"""The evaluation runner: one grid of models x methods x cells, for every tool.

``alibi-sweep`` and ``alibi-retrieval`` are each a *measure* (``perplexity.py``,
``retrieval.py``: what a cell is, how to run it, how to report it) run over
models of a *backend* (``backends.py``: fairseq checkpoints; ``hf_backend.py``:
Hugging Face models).  The runner owns the grid, once, and each tool's command
line:

* the plan, validated as a whole before anything runs: the axes every tool
  shares (``axes.py``: models, methods, lengths); each model described (a
  fairseq checkpoint read, without its optimizer state; a Hugging Face model's
  config and tokenizer) once and loaded once, models one at a time, then
  evaluated under each method in turn;
* the output directory (``store.py``: its lock, ``results.json`` rewritten
  atomically after each cell, a cell reused only while its identity is
  unchanged); what the user sees as it runs (``progress.py``); the reports, in
  the order of ``--methods``;
* the arguments every tool shares, and a tool's ``main``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..core.scaling import METHOD_SYNTAX, Scaling
from ..errors import plural, report_errors
from .axes import DEFAULT_METHODS, applicable, check_methods_apply, method_rank, methods_for, parse_methods
from .progress import Countdown, progress, quiet_logging
from .protocols import Backend, Cell, Described, EvaluationModel, Measure
from .store import OutputLock, ResultStore, prepare_output_dir

logger = logging.getLogger("fairseq_alibi.evaluation")


@dataclass
class Plan:
    described: Described
    methods: List[Scaling]
    cells: List[Cell] = field(default_factory=list)


def tool_parser(prog: str, description: str, epilog: str, data_help: str, output_dir: str, data_optional=False):
    """A tool's argument parser: DATA and the options every tool shares."""
    import argparse

    from ..arguments import OneLineParser

    parser = OneLineParser(prog=prog, description=description, epilog=epilog,
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
                        help="a Hugging Face model, instead of or beside --checkpoint: BLOOM, MPT, Falcon (alibi), "
                        "GPT-NeoX (rotary) or a model exported by alibi-export-hf; a directory written by save_pretrained or a hub "
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
    (``parse_methods(args.methods)``); returns the cells of this run's grid,
    which the tables and reports show (``results.json`` also keeps the cells of
    earlier runs in the same directory, for a later run to reuse)."""
    specs = backend.specs(args)
    prepare_output_dir(args.output_dir)
    with OutputLock(args.output_dir, measure.tool):
        described = [backend.describe(name, source) for name, source in specs]
        check_methods_apply([d.info for d in described], methods)
        plans = [Plan(d, methods_for(d.info, methods), measure.cells(d)) for d in described]
        for d, plan in zip(described, plans):
            kept = {m.key for m in plan.methods}
            skipped = [m.spelling for m in methods if m.key not in kept]
            if skipped:
                logger.warning("%s (%s): %s %s not apply to it (the methods that do: %s); evaluated with %s",
                               d.info.name, d.info.position or d.info.model, ", ".join(skipped),
                               plural(len(skipped), "does", "do"),
                               ", ".join(applicable(d.info)), ", ".join(m.spelling for m in plan.methods))
        store = ResultStore(args.output_dir, lambda cell: record_key(cell, measure), measure.order)
        identities = {d.info.name: f"{d.info.identity}|{backend.data_identity}|{measure.settings_identity()}"
                      for d in described}
        store.reuse(lambda cell: identities.get(cell.get("checkpoint")))
        if store.stale:
            logger.info("%d stored cells were computed from other models, data or settings: those of this grid are "
                        "recomputed, the others kept as they are", store.stale)
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
        grid = {key_of(p, m, c) for p in plans for m in p.methods for c in p.cells}
        results = sorted((cell for key, cell in store.cells.items() if key in grid), key=measure.order)
        derived = measure.report(args.output_dir, results, methods)
        if derived:  # the intervals, paired comparisons: in results.json too
            store.write(meta, **derived)
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
