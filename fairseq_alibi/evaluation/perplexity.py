"""``alibi-sweep``: perplexity over a grid of evaluation lengths and context-extension methods.

The grid is checkpoints x methods x evaluation modes x lengths:

* **checkpoints**: ``NAME=PATH`` (or just ``PATH``; the name is then the file's
  directory).  ALiBi checkpoints (``transformer_lm_alibi``) take every method;
  any other language model (e.g. the stock sinusoidal ``transformer_lm``) is
  evaluated with ``none`` only, with ``max_target_positions`` and
  ``tokens_per_sample`` overridden so that fairseq does not silently drop every
  window longer than the training length;
* **methods**: ``none``; ``linear:F`` / ``ntk:F`` (static factor F >= 1);
  ``linear`` / ``ntk`` (dynamic, ``max(1, length / train_length)``; also
  written ``linear:dynamic``);
* **modes**: ``nonoverlapping`` (windows of ``length`` tokens, each token
  scored once with the context available inside its window) and ``sliding``
  (windows of ``length`` tokens advanced by ``--stride``; the last ``stride``
  tokens of each window are scored, so each has at least ``length - stride``
  tokens of context).  Sliding with stride S at length L is exactly
  ``fairseq-eval-lm --tokens-per-sample L --context-window (L - S)``;
* **lengths**: absolute (``64,128``) or relative to each checkpoint's training
  length (``1x,2x,16x``).

Evaluation runs in-process with fairseq's own pieces (eval-lm argument parser,
``load_model_ensemble_and_task`` with the overrides ``--model-overrides``
would pass, the task's ``eval_lm_dataloader`` and ``SequenceScorer``), loading
each model once per checkpoint and method.  ``loss`` is fairseq-eval-lm's:
mean negative log-likelihood per token in base 2, and ``ppl = 2 ** loss``.

Outputs in ``--output-dir``: ``results.json`` (every cell; the resume state),
``results.csv``, ``results.md`` (a table per mode, perplexity by length),
``perplexity.png``, and with ``--per-position`` ``per_position.csv`` and
``per_position.png`` (mean loss by token position within the window).  Cells
already in ``results.json`` are skipped, so an interrupted sweep continues
where it stopped.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..errors import EvaluationError, report_errors
from . import report
from .grid import (
    add_grid_arguments,
    CheckpointInfo,
    Method,
    ResultStore,
    check_data,
    data_identity,
    eval_lm_config,
    file_identity,
    inspect_checkpoint,
    load_language_model,
    model_overrides,
    parse_checkpoints,
    parse_lengths,
    parse_methods,
    prepare_output_dir,
    progress,
    quiet_logging,
    resolve_lengths,
    usable_methods,
)

logger = logging.getLogger("fairseq_alibi.sweep")

MODES = ("nonoverlapping", "sliding")
RESULT_FIELDS = (
    "checkpoint", "method", "factor", "label", "mode", "length", "stride", "context_window",
    "length_ratio", "train_length", "subset", "loss", "ppl", "tokens", "seconds",
)
FLOAT_FIELDS = ("loss", "ppl", "seconds", "length_ratio")


class Evaluator:
    """One model (checkpoint + method) evaluated at several lengths and strides."""

    def __init__(self, info: CheckpointInfo, method: Method, data: str, subset: str,
                 max_length: int, max_tokens: Optional[int], batch_size: Optional[int], cpu: bool):
        self.info, self.method, self.data, self.subset = info, method, data, subset
        self.max_tokens, self.batch_size, self.cpu = max_tokens, batch_size, cpu
        self.overrides = model_overrides(info, method, max_length)
        cfg = eval_lm_config(data, info.path, max_length, self.overrides, subset=subset,
                             max_tokens=max_tokens, batch_size=batch_size, cpu=cpu)
        self.model, _, self.use_cuda = load_language_model(info, self.overrides, cfg)

    def command(self, length: int, stride: int) -> str:
        """The equivalent fairseq-eval-lm command line (for the record)."""
        context = length - stride
        parts = [
            "fairseq-eval-lm", self.data, '--user-dir "$(alibi-user-dir)"', "--path", self.info.path,
            "--gen-subset", self.subset, "--tokens-per-sample", str(length),
        ]
        if context:
            parts += ["--context-window", str(context)]
        if self.max_tokens:
            parts += ["--max-tokens", str(self.max_tokens)]
        if self.batch_size:
            parts += ["--batch-size", str(self.batch_size)]
        if self.cpu:
            parts += ["--cpu"]
        parts += ["--model-overrides", '"' + repr(self.overrides) + '"']
        return " ".join(parts)

    def evaluate(self, length: int, stride: int, per_position: bool = False) -> dict:
        import torch
        from fairseq import tasks, utils
        from fairseq.sequence_scorer import SequenceScorer

        context = length - stride
        cfg = eval_lm_config(self.data, self.info.path, length, self.overrides, context=context,
                             subset=self.subset, max_tokens=self.max_tokens,
                             batch_size=self.batch_size, cpu=self.cpu)
        start = time.perf_counter()
        task = tasks.setup_task(cfg.task)
        task.load_dataset(self.subset)
        dataset = task.dataset(self.subset)
        expected = int(dataset.sizes.sum())
        itr = task.eval_lm_dataloader(
            dataset=dataset,
            max_tokens=cfg.dataset.max_tokens or 36000,
            batch_size=cfg.dataset.batch_size,
            max_positions=utils.resolve_max_positions(self.model.max_positions()),
            num_shards=1, shard_id=0, num_workers=0,
            data_buffer_size=cfg.dataset.data_buffer_size,
            context_window=context,
        )
        scorer = SequenceScorer(task.target_dictionary, cfg.eval_lm.softmax_batch)
        remove_bos = getattr(cfg.task, "add_bos_token", False)
        score_sum, count = 0.0, 0
        pos_sum = torch.zeros(length, dtype=torch.float64)
        pos_count = torch.zeros(length, dtype=torch.float64)
        for sample in itr:
            if "net_input" not in sample:
                continue
            if self.use_cuda:
                sample = utils.move_to_cuda(sample)
            starts = sample.get("start_indices") or [0] * sample["target"].size(0)
            hypos = scorer.generate([self.model], sample)
            for i, hypos_i in enumerate(hypos):
                scores = hypos_i[0]["positional_scores"].float().cpu()
                offset = int(starts[i])
                if remove_bos:
                    scores, offset = scores[1:], offset + 1
                positions = torch.arange(offset, offset + scores.numel())
                finite = torch.isfinite(scores)
                if not bool(finite.all()):
                    scores, positions = scores[finite], positions[finite]
                score_sum += float(scores.double().sum())
                count += scores.numel()
                if per_position:
                    pos_sum.index_add_(0, positions, -scores.double())
                    pos_count.index_add_(0, positions, torch.ones_like(positions, dtype=torch.float64))
        seconds = time.perf_counter() - start
        if count == 0:
            raise EvaluationError(
                f"{self.info.name}: no tokens were evaluated at length {length} "
                "(every window was longer than the model accepts?)"
            )
        if count != expected and not remove_bos:
            logger.warning("%s at length %d scored %d of %d tokens", self.info.name, length, count, expected)
        loss = -score_sum / count / math.log(2)
        result = {"loss": loss, "ppl": 2.0 ** loss, "tokens": count, "seconds": seconds}
        if per_position:
            mean = (pos_sum / pos_count.clamp(min=1)) / math.log(2)
            result["per_position"] = [round(float(v), 6) if c > 0 else None for v, c in zip(mean, pos_count)]
            result["per_position_count"] = [int(c) for c in pos_count]
        return result


# --------------------------------------------------------------------------- driver


@dataclass
class Plan:
    info: CheckpointInfo
    method: Method
    mode: str
    length: int
    stride: int


def build_plan(infos: List[CheckpointInfo], methods: List[Method], modes: List[str],
               lengths: List[Tuple[str, float]], stride: Optional[int],
               max_tokens: Optional[int]) -> Tuple[List[Plan], List[str]]:
    """Every cell of the grid, validated as a whole before anything runs."""
    plans, notes = [], []
    for info in infos:
        these = resolve_lengths(lengths, info.train_length)
        usable = usable_methods(info, methods)
        if len(usable) < len(methods):
            notes.append(f"{info.name} ({info.model}) is not an ALiBi model: evaluated with 'none' only")
        if "sliding" in modes and stride >= min(these):
            raise EvaluationError(
                f"--stride {stride} is not below every evaluation length of {info.name} "
                f"(shortest: {min(these)}); a sliding window scores its last STRIDE tokens, "
                "so choose a stride smaller than the shortest length"
            )
        if max_tokens is not None and max_tokens < max(these):
            raise EvaluationError(
                f"--max-tokens {max_tokens} is smaller than the longest evaluation length "
                f"{max(these)} of {info.name}: one window must fit in a batch; raise --max-tokens"
            )
        for method in usable:
            for mode in modes:
                for length in these:
                    plans.append(Plan(info, method, mode, length, length if mode == "nonoverlapping" else stride))
    return plans, sorted(set(notes), key=notes.index)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alibi-sweep",
        description="Perplexity of fairseq language models over evaluation lengths x ALiBi "
        "context-extension methods x evaluation modes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  alibi-sweep data-bin/embedded --checkpoint alibi=ck/alibi.pt "
        "--checkpoint sin=ck/sin.pt \\\n      --lengths 1x,2x,4x,8x,16x --methods none,linear:2,linear,ntk:2,ntk "
        "--modes nonoverlapping,sliding --stride 32 --output-dir outputs/sweep --cpu",
    )
    p.add_argument("data", help="fairseq-preprocess output directory (with --hf: a raw text file)")
    add_grid_arguments(p, "outputs/sweep")
    p.add_argument("--lengths", default="1x,2x,4x,8x,16x",
                   help="evaluation lengths: integers (2k = 2048), or Nx = N times the training length "
                   "(default: %(default)s)")
    p.add_argument("--modes", default="nonoverlapping", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (scored tokens per window)")
    p.add_argument("--subset", default="valid", help="split to evaluate (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per batch as fairseq-eval-lm counts them (default: 4 x the longest length)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch")
    p.add_argument("--per-position", action="store_true", help="also record mean loss by position in the window")
    return p


def cell_key(cell: dict) -> tuple:
    return (
        cell["checkpoint"], cell["method"], float(cell["factor"]), cell["mode"],
        int(cell["length"]), int(cell["stride"]), cell["subset"],
    )


def parse_modes(args) -> List[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise EvaluationError(f"unknown mode(s) {', '.join(bad or modes)}: choose from {', '.join(MODES)}")
    if "sliding" in modes and (args.stride is None or args.stride < 1):
        raise EvaluationError("--modes sliding needs --stride N (N >= 1 tokens scored per window)")
    return modes


def cell_record(info: CheckpointInfo, method: Method, mode: str, length: int, stride: int,
                subset: str, command: str, identity: str, result: dict) -> dict:
    """One finished cell, as stored and reported."""
    return {
        "checkpoint": info.name, "path": info.path, "model": info.model,
        "method": method.name, "factor": float(method.factor), "label": method.label,
        "mode": mode, "length": length, "stride": stride, "context_window": length - stride,
        "length_ratio": length / info.train_length if info.train_length else None,
        "train_length": info.train_length, "subset": subset, "command": command,
        "identity": identity, **result,
    }


def log_cell(bar, cell: dict) -> None:
    bar.update(1)
    bar.write(f"{cell['checkpoint']:>12} {cell['label']:>14} {cell['mode']:>14} L={cell['length']:<6} "
              f"stride={cell['stride']:<6} ppl={cell['ppl']:.2f} ({cell['tokens']} tokens, {cell['seconds']:.1f}s)")


def run_hf(args: argparse.Namespace) -> List[dict]:
    """The sweep over Hugging Face models on a raw text file (``--hf``)."""
    from .hf_models import HFModel, model_identity, parse_hf_models

    if args.checkpoint:
        raise EvaluationError("give either --checkpoint (fairseq, DATA a data directory) or --hf "
                              "(Hugging Face, DATA a text file), not both")
    methods, modes, lengths = parse_methods(args.methods), parse_modes(args), parse_lengths(args.lengths)
    if not os.path.isfile(args.data):
        raise EvaluationError(f"with --hf, DATA is a raw text file; {args.data} is not a file")
    with open(args.data, encoding="utf-8") as handle:
        text = handle.read()
    if not text.strip():
        raise EvaluationError(f"{args.data} is empty")
    prepare_output_dir(args.output_dir)
    subset = os.path.basename(args.data)
    data_id = f"{os.path.abspath(args.data)}={file_identity(args.data)}"
    store = ResultStore(args.output_dir)
    models = parse_hf_models(args.hf)
    identities = {name: f"{model_identity(spec, args.train_length)}|{data_id}|{args.dtype}" for name, spec in models}
    store.reuse(cell_key, lambda cell: identities.get(cell["checkpoint"]))
    if store.stale:
        logger.info("%d stored cells were computed from other models, text or settings: recomputing them",
                    store.stale)
    meta = {"data": os.path.abspath(args.data), "subset": subset, "hf": True}
    for name, spec in models:
        model = HFModel(name, spec, args.train_length, args.cpu, args.dtype)
        plans, _ = build_plan([model.info], methods, modes, lengths, args.stride, None)
        tokens = model.encode(text)
        todo = [p for p in plans if store.get((name, p.method.name, float(p.method.factor), p.mode, p.length,
                                               p.stride, subset)) is None]
        logger.info("%s: %d tokens, %d cells, %d to run", name, tokens.numel(), len(plans), len(todo))
        bar = progress(len(plans), len(plans) - len(todo), name, args.no_progress)
        for plan in todo:
            result = model.perplexity(tokens, plan.length, plan.stride, plan.method)
            cell = cell_record(model.info, plan.method, plan.mode, plan.length, plan.stride, subset,
                               model.command(plan.length, plan.stride), identities[name], result)
            store.put(cell_key(cell), cell, meta, order=_order)
            log_cell(bar, cell)
        bar.close()
        del model
    cells = sorted(store.cells.values(), key=_order)
    write_reports(args.output_dir, cells, meta)
    return cells


def run(args: argparse.Namespace) -> List[dict]:
    if args.hf:
        return run_hf(args)
    methods = parse_methods(args.methods)
    modes = parse_modes(args)
    lengths = parse_lengths(args.lengths)
    checkpoints = parse_checkpoints(args.checkpoint)
    check_data(args.data, args.subset)
    prepare_output_dir(args.output_dir)

    import fairseq_alibi  # noqa: F401  (registers the ALiBi models)

    infos = [inspect_checkpoint(name, path) for name, path in checkpoints]
    plans, notes = build_plan(infos, methods, modes, lengths, args.stride, args.max_tokens)
    for note in notes:
        logger.info(note)

    data_id = data_identity(args.data, args.subset)
    by_name = {info.name: info for info in infos}

    def identity(checkpoint: str) -> Optional[str]:
        info = by_name.get(checkpoint)
        return None if info is None else f"{info.identity}|{data_id}|{args.max_tokens}|{args.batch_size}"

    store = ResultStore(args.output_dir)
    store.reuse(cell_key, lambda cell: identity(cell["checkpoint"]))
    if store.stale:
        logger.info("%d stored cells were computed from other checkpoint files, data or settings: "
                    "recomputing them", store.stale)

    def key_of(plan: Plan) -> tuple:
        return (plan.info.name, plan.method.name, float(plan.method.factor), plan.mode, plan.length, plan.stride, args.subset)

    def needs_run(plan: Plan) -> bool:
        done = store.get(key_of(plan))
        return done is None or (args.per_position and not done.get("per_position"))

    todo = [p for p in plans if needs_run(p)]
    logger.info("%d cells in the grid, %d already done, %d to run", len(plans), len(plans) - len(todo), len(todo))
    meta = {"data": os.path.abspath(args.data), "subset": args.subset, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size}

    bar = progress(len(plans), len(plans) - len(todo), "sweep", args.no_progress)
    evaluator: Optional[Evaluator] = None
    for plan in todo:
        bar.set_postfix_str(f"{plan.info.name} {plan.method.label} {plan.mode} L={plan.length}")
        if evaluator is None or evaluator.info is not plan.info or evaluator.method != plan.method:
            evaluator = None  # free the previous model first
            max_len = max(p.length for p in plans if p.info is plan.info)
            max_tokens = args.max_tokens or 4 * max_len
            evaluator = Evaluator(plan.info, plan.method, args.data, args.subset, max_len,
                                  max_tokens, args.batch_size, args.cpu)
        result = evaluator.evaluate(plan.length, plan.stride, per_position=args.per_position)
        cell = cell_record(plan.info, plan.method, plan.mode, plan.length, plan.stride, args.subset,
                           evaluator.command(plan.length, plan.stride), identity(plan.info.name), result)
        store.put(key_of(plan), cell, meta, order=_order)  # resume point after every cell
        log_cell(bar, cell)
    bar.close()
    cells = sorted(store.cells.values(), key=_order)
    write_reports(args.output_dir, cells, meta)
    return cells


def _order(c: dict) -> tuple:
    return (c["checkpoint"], c["mode"], c["method"], c["factor"], c["length"], c["stride"])


def write_reports(outdir: str, cells: List[dict], meta: dict) -> List[str]:
    """CSV, Markdown and plots from the cells; returns the file names written."""
    written = ["results.json", "results.csv", "results.md"]
    report.write_csv(os.path.join(outdir, "results.csv"), cells, RESULT_FIELDS, FLOAT_FIELDS)
    report.atomic_write(os.path.join(outdir, "results.md"), report.perplexity_table(cells))
    if cells:
        report.plot_perplexity(os.path.join(outdir, "perplexity.png"), cells)
        written.append("perplexity.png")
    if any(c.get("per_position") for c in cells):
        report.write_per_position_csv(os.path.join(outdir, "per_position.csv"), cells)
        report.plot_per_position(os.path.join(outdir, "per_position.png"), cells)
        written += ["per_position.csv", "per_position.png"]
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_parser().parse_args(argv)
    quiet_logging(args.verbose)
    with report_errors(interrupted="alibi-sweep interrupted: finished cells are saved in "
                       f"{args.output_dir}/results.json; run the same command again to resume"):
        cells = run(args)
    subset = os.path.basename(args.data) if args.hf else args.subset
    print(report.perplexity_table([c for c in cells if c["subset"] == subset]))
    print(f"results in {args.output_dir}/ ({', '.join(_written(args.output_dir))})")
    return 0


def _written(outdir: str) -> List[str]:
    names = ("results.json", "results.csv", "results.md", "perplexity.png", "per_position.csv", "per_position.png")
    return [n for n in names if os.path.exists(os.path.join(outdir, n))]


if __name__ == "__main__":
    sys.exit(main())
