"""``alibi-retrieval``: retrieval accuracy over prompt lengths x context-extension methods.

The grid is checkpoints x methods x lengths x depths, as in ``alibi-sweep``
(same ``--checkpoint``, ``--lengths`` and ``--methods`` syntax; each model
under the methods that apply to its position method, ``--help`` lists them),
with a retrieval task instead of perplexity:

* ``passkey``: a pass key hidden in filler text, asked for at the end;
* ``lines``: LongEval-style records ``line KEY : REGISTER_CONTENT is N``, one of
  them asked for at the end;
* ``FILE.jsonl``: prompts from a file, recognized by its fields
  (``task_files.py``): your own (``prompt``, ``answer``, optional ``group``),
  LongEval's ``lines`` and ``topics`` test cases, or RULER's ``prepare.py``
  output; ``--lengths`` and the built-in tasks' options do not apply, the
  length is the prompt's own.

For the built-in tasks, ``--depths N`` places the needle (pass key, queried
record) in N equal bins from the start to the end of the context and
``--samples`` prompts are drawn per cell, deterministically from ``--seed``:
every checkpoint and method sees the same prompts.  See ``prompts.py`` for the
texts, and ``--template``, ``--filler``, ``--keys``, ``--digits`` and
``--number-format`` to fit them to a model's vocabulary.  Words missing from the
model's dictionary are an error, never a silent ``<unk>``.

Scoring is greedy exact match from ONE teacher-forced forward pass: the prompt
is fed as fairseq's own LM inference feeds it
(``task.build_dataset_for_inference``: the end-of-sentence token, or bos with
``--add-bos-token``, prepended; nothing appended) followed by the answer, and a
sample is correct when the argmax at every answer position is the answer's
token.  ``answer_logprob`` is the answer tokens' mean log-probability (natural
log), averaged over the cell's samples.  The model is run in inference mode, so
long prompts take the plugin's linear-memory attention path.

``--hf MODEL`` evaluates a Hugging Face BLOOM, MPT, Falcon (alibi) or
exported model instead (no DATA directory): prompts through its own tokenizer
(its bos token prepended where it has one), each method applied with
``hf.apply_alibi_scaling``; everything else is the same.  This module is the
*measure*; the grid, resuming and loading are ``runner.py``'s, the models the
backends' (``backends.py``, ``hf_backend.py``).

Outputs in ``--output-dir``: ``results.json`` (every cell; the resume state),
``results.csv``, ``results.md`` (accuracy with its 95 % Wilson interval, the
mean log-prob with a Student-t interval over prompts), ``accuracy.png``
(accuracy vs length, Wilson error bars) and, for
the built-in tasks, ``depth.png`` (depth x length accuracy per checkpoint and
method).  Finished cells are reused when the checkpoint file, data dictionary
and prompt settings are unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import EvaluationError, plural
from . import prompts as P
from . import report, runner
from .axes import check_max_tokens, method_rank, parse_lengths, resolve_lengths
from .backends import backend_for
from .runner import tool_parser
from .store import file_identity
from .task_files import read_task_file

logger = logging.getLogger("fairseq_alibi.retrieval")

RESULT_FIELDS = (
    "checkpoint", "task", "method", "factor", "alpha", "label", "effective_factor", "group", "length",
    "length_ratio", "train_length", "depth", "needle_distance", "n", "correct", "accuracy", "accuracy_low",
    "accuracy_high", "answer_logprob", "seconds",
)
FLOAT_FIELDS = ("accuracy", "accuracy_low", "accuracy_high", "answer_logprob", "length_ratio", "effective_factor", "seconds", "depth",
                "needle_distance")
#: The built-in tasks' options and their defaults (None in argparse: a file task refuses them when given).
BUILTIN_DEFAULTS = {"lengths": "1x,2x,4x,8x", "depths": 5, "samples": 10, "seed": 1, "digits": None,
                    "number_format": "spaced", "filler": "template", "keys": None, "template": []}


@dataclass
class Sample:
    """One prompt and its answer as token ids of the model's vocabulary."""

    prompt: List[int]
    answer: List[int]
    depth: Optional[float]  # bin centre; None for prompt files
    group: str
    length: int  # tokens processed: prepended eos/bos + prompt + answer minus its last token
    distance: Optional[int] = None  # tokens from the needle's start to the end of the prompt

    @staticmethod
    def make(prompt: List[int], answer: List[int], depth, group, distance=None) -> "Sample":
        return Sample(prompt, answer, depth, group, len(prompt) + len(answer), distance)


@dataclass
class PromptCell:
    """One cell of ``alibi-retrieval``: the prompts of one task, group, length and depth."""

    task: str
    group: str
    length: int
    depth: Optional[float]
    samples: List[Sample]
    max_tokens: int  # per batch

    @property
    def key(self) -> tuple:
        return (self.task, self.group, self.length, self.depth)

    @property
    def label(self) -> str:
        return (f"L={self.length}" + (f" depth={self.depth:.2f}" if self.depth is not None else "")
                + (f" group={self.group}" if self.group else ""))


def file_samples(items, encoder, path: str) -> List[Sample]:
    out = []
    for item in items:
        where = f"{path}:{item.line}: "
        encoder.encode(f"{item.prompt} {item.answer}", where)  # every unknown word named at once
        if not encoder.encode(item.answer, where):
            raise EvaluationError(f"{where}the answer {item.answer!r} encodes to no token")
        prompt, answer = prompt_and_answer(encoder, item.prompt, item.answer, where)
        out.append(Sample.make(prompt, answer, None, item.group))
    return out


def prompt_and_answer(encoder, prompt: str, answer: str, where: str = "") -> Tuple[List[int], List[int]]:
    """The ids of ``prompt`` and of ``answer`` as the text goes on after it.

    A tokenizer whose tokens carry a word's leading space (byte-level BPE:
    GPT-2, BLOOM, MPT, Falcon; SentencePiece) spells the answer after the
    prompt's last word (`` 1``) otherwise than alone at the start of a text
    (``1``), and a model asked for the answer after the prompt writes the
    first: scored against the second, no answer could be right.  So a
    subword encoder's answer is the tail of the whole text's ids past the
    prompt's own, as lm-evaluation-harness splits a context from its
    continuation; the prompt's ids must begin the whole's (a tokenizer that
    merges across the space would change the prompt: refused)."""
    head = encoder.encode(prompt, where)
    if not encoder.subword:
        return head, encoder.encode(answer, where)
    whole = encoder.encode(f"{prompt} {answer}", where)
    if whole[:len(head)] != head or len(whole) == len(head):
        raise EvaluationError(f"{where}the tokenizer spells the end of the prompt otherwise when the answer "
                              f"{answer!r} follows it, so the answer's tokens are not the prompt's continuation: "
                              "end the prompt with a word the answer cannot join (a space or punctuation before it)")
    return head, whole[len(head):]


def fitted_prompt(task: P.BuiltinTask, encoder, length: int, depth_bin: int, depths: int,
                  key: str) -> Tuple[P.Prompt, List[int], List[int]]:
    """A built-in prompt of at most ``length`` tokens as ``encoder`` spells it,
    with its ids and its answer's.  The task builds to a number of words; a
    word-level dictionary spells each in one token, a subword tokenizer in
    one or more, so there the word budget shrinks until the prompt and its
    answer fit in ``length`` tokens: the length a cell is labelled with is
    never less than what the model reads.  Every try draws from a generator
    seeded by ``key`` alone (the same pass key, the same first filler)."""
    budget = length
    while True:
        prompt = task.build(budget, depth_bin, depths, random.Random(key))
        ids, answer = prompt_and_answer(encoder, " ".join(prompt.prompt), " ".join(prompt.answer))
        spelled = len(ids) + len(answer)
        if spelled <= length:
            return prompt, ids, answer
        budget = min(budget - 1, budget * length // spelled)
        if budget < task.minimum_length():
            raise EvaluationError(
                f"a {task.name} prompt of {length} tokens cannot be built: this model's tokenizer spells the "
                f"shortest one ({task.minimum_length()} words) in more; use longer --lengths")


def builtin_samples(task: P.BuiltinTask, encoder, lengths: Sequence[int], depths: int, samples: int,
                    seed: int) -> Dict[Tuple[int, int], List[Sample]]:
    """``(length, depth bin) -> samples``, each drawn from its own seeded generator;
    warns where a length has fewer places for the needle than depth bins."""
    out: Dict[Tuple[int, int], List[Sample]] = {}
    centres = P.bins(depths)
    for length in lengths:
        slots = None
        for b in range(depths):
            cell = []
            for s in range(samples):
                prompt, ids, ans = fitted_prompt(task, encoder, length, b, depths,
                                                 f"{seed}:{task.name}:{length}:{b}/{depths}:{s}")
                slots = min(slots or prompt.meta["slots"], prompt.meta["slots"])
                offset = prompt.meta["needle_offset"]
                if encoder.subword:
                    offset = len(encoder.words(prompt.prompt[:offset])) if offset else 0
                cell.append(Sample.make(ids, ans, centres[b], "", distance=len(ids) - offset))
            out[(length, b)] = cell
        if slots < depths:
            logger.warning("--depths %d: a %s prompt of %d tokens has %d %s for the %s, so its depth bins "
                           "repeat the same needle positions; use --depths %d or fewer, or longer --lengths",
                           depths, task.name, length, slots, plural(slots, "place"), task.unit, slots)
    return out


def check_task_args(args, file: bool):
    """(prompt-file items or None, parsed lengths or None); the built-in tasks'
    options are refused with a prompt file, and defaulted without one."""
    if args.max_tokens is not None and args.max_tokens < 1:
        raise EvaluationError(f"--max-tokens {args.max_tokens} is not valid: a positive number")
    if not file:
        builtin_defaults(args)
        if args.depths < 1 or args.samples < 1:
            raise EvaluationError("--depths and --samples must be at least 1")
        return None, parse_lengths(args.lengths)
    if not args.task.endswith(".jsonl") and not os.path.isfile(args.task):
        raise EvaluationError(f"unknown task {args.task!r}: use passkey, lines, or a .jsonl file of prompts")
    given = [f"--{k.replace('_', '-')}" for k in BUILTIN_DEFAULTS if getattr(args, k) not in (None, [])]
    if given:
        raise EvaluationError(f"{', '.join(given)} apply to the built-in tasks (passkey, lines); a prompt "
                              "file gives each prompt and its length itself")
    return read_task_file(args.task), None


def builtin_cells(args, lengths, described) -> Dict[tuple, List[Sample]]:
    """``(group "", length, depth bin centre) -> samples`` of a built-in task for one model."""
    info = described.info
    try:
        task = build_task(args, described.encoder.vocabulary())
        built = builtin_samples(task, described.encoder, resolve_lengths(lengths, info.train_length, info.name),
                                args.depths, args.samples, args.seed)
    except EvaluationError as exc:
        raise EvaluationError(f"{info.name}: {exc}") from None
    centres = P.bins(args.depths)
    return {("", length, round(centres[b], 6)): v for (length, b), v in built.items()}


def score(model, samples: Sequence[Sample], max_tokens: int) -> List[Tuple[bool, float, List[int]]]:
    """(correct, mean answer log-prob, greedy ids) per sample, in order.  Only
    sequences of one length share a batch: no padding, and a dynamic method's
    factor is that of the sample's own length."""
    results: List[Optional[tuple]] = [None] * len(samples)
    by_length: Dict[int, List[int]] = {}
    for i, s in enumerate(samples):
        by_length.setdefault(s.length, []).append(i)
    for total, idx in by_length.items():
        per_batch = max(1, max_tokens // total)
        for start in range(0, len(idx), per_batch):
            chunk = idx[start:start + per_batch]
            batch = [(samples[i].prompt, samples[i].answer) for i in chunk]
            for i, result in zip(chunk, model.answer_scores(batch)):
                results[i] = result
    return results  # type: ignore[return-value]


def batch_tokens(max_tokens: Optional[int], grouped: Dict[tuple, List[Sample]], name: str) -> int:
    """Tokens per forward batch: ``--max-tokens`` (at least the longest prompt), or 4 x the longest."""
    longest = max(s.length for v in grouped.values() for s in v)
    check_max_tokens(max_tokens, longest, f"the longest prompt of {name}", "one prompt")
    return max_tokens or max(4 * longest, 4096)


class Retrieval:
    """The measure of ``alibi-retrieval``: one cell is (task, group, length, depth)
    of one model under one method, scored on its samples."""

    tool = "alibi-retrieval"
    backend_for = staticmethod(backend_for)

    def __init__(self, args, backend):
        self.args, self.backend = args, backend
        self.file = args.task not in P.TASKS
        self.items, self.lengths = check_task_args(args, self.file)
        self.task_name = os.path.basename(args.task) if self.file else args.task

    def settings_identity(self) -> str:
        """What changes the prompts (a cell is reused only for the same)."""
        a = self.args
        if self.file:
            parts = [os.path.abspath(a.task), file_identity(a.task)]
        else:
            parts = [a.task, a.depths, a.samples, a.seed, a.digits, a.number_format, a.filler, a.keys,
                     sorted(a.template)]
        return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]

    def meta(self) -> dict:
        a = self.args
        return {"data": os.path.abspath(a.data) if a.data else None, "hf": a.hf, "task": a.task,
                "template": None if self.file else _template(a.template),  # the fields given (the rest: the task's)
                "depths": a.depths, "samples": a.samples, "seed": a.seed}

    def cells(self, described) -> List[PromptCell]:
        """The prompts of one model (the same for every method), as cells."""
        if self.file:
            grouped: Dict[tuple, List[Sample]] = {}
            for s in file_samples(self.items, described.encoder, self.args.task):
                grouped.setdefault((s.group, s.length, None), []).append(s)
        else:
            grouped = builtin_cells(self.args, self.lengths, described)
        max_tokens = batch_tokens(self.args.max_tokens, grouped, described.info.name)
        return [PromptCell(self.task_name, group, length, depth, samples, max_tokens)
                for (group, length, depth), samples in sorted(grouped.items(),
                                                              key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0))]

    @staticmethod
    def max_length(cells: List[PromptCell]) -> int:
        return max(s.length for cell in cells for s in cell.samples) + 1

    @staticmethod
    def needs_run(stored: Optional[dict]) -> bool:
        return stored is None

    @staticmethod
    def cell_key(record: dict) -> tuple:
        depth = record.get("depth")
        return (record["task"], record.get("group", ""), int(record["length"]),
                None if depth is None else round(float(depth), 6))

    @staticmethod
    def order(record: dict) -> tuple:
        return (record["checkpoint"], record["task"], record["method"], record["factor"], record.get("alpha") or 0,
                record.get("group", ""), record["length"], -1 if record.get("depth") is None else record["depth"])

    def run(self, model, method, cell: PromptCell) -> dict:
        samples, task, group, length, depth = cell.samples, cell.task, cell.group, cell.length, cell.depth
        start = time.perf_counter()
        scored = score(model, samples, cell.max_tokens)
        correct = sum(1 for ok, _, _ in scored if ok)
        train_length = model.info.train_length
        return {
            "task": task, "effective_factor": model.effective_factor(length), "group": group, "length": length,
            "depth": depth, "length_ratio": length / train_length if train_length else None, "n": len(samples),
            "correct": correct,
            "needle_distance": (sum(s.distance for s in samples) / len(samples)
                                if samples[0].distance is not None else None),
            "accuracy": correct / len(samples), "answer_logprob": sum(lp for _, lp, _ in scored) / len(scored),
            "seconds": time.perf_counter() - start,
            "sample_correct": [ok for ok, _, _ in scored], "sample_logprob": [round(lp, 6) for _, lp, _ in scored],
        }

    @staticmethod
    def log_line(cell: dict) -> str:
        depth, group = cell.get("depth"), cell.get("group")
        return (f"{cell['checkpoint']:>12} {cell['label']:>14} L={cell['length']:<6}"
                + (f" depth={depth:.2f}" if depth is not None else "") + (f" group={group}" if group else "")
                + f" accuracy={cell['accuracy']:.2f}{report.bounds(report.accuracy_interval(cell), cell['accuracy'])}"
                + f" logprob={cell['answer_logprob']:.3f} ({cell['seconds']:.1f}s)")

    @staticmethod
    def table(cells: List[dict], rank) -> str:
        return report.retrieval_tables(cells, rank)

    def report(self, outdir: str, cells: List[dict], methods) -> None:
        rank = method_rank(methods)
        report.write_csv(os.path.join(outdir, "results.csv"),
                         report.with_intervals(cells, "accuracy", report.accuracy_interval), RESULT_FIELDS, FLOAT_FIELDS)
        report.atomic_write(os.path.join(outdir, "results.md"), report.retrieval_tables(cells, rank))
        if cells:
            report.plot_retrieval_accuracy(os.path.join(outdir, "accuracy.png"), cells, rank)
        with_depth = [c for c in cells if c.get("depth") is not None]
        if with_depth:
            report.plot_retrieval_depth(os.path.join(outdir, "depth.png"), with_depth, rank)


def _template(items: Sequence[str]) -> Dict[str, str]:
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise EvaluationError(f"bad --template {item!r}: use FIELD=TEXT, e.g. --template 'question=where is it ?'")
        if name.strip() in out:
            raise EvaluationError(f"--template {name.strip()} is given twice ({out[name.strip()]!r}, {text!r}): "
                                  "give each field once")
        out[name.strip()] = text
    return out


def builtin_defaults(args) -> None:
    """Fill in the built-in tasks' options the user left unset."""
    for key, value in BUILTIN_DEFAULTS.items():
        if getattr(args, key) in (None, []):
            setattr(args, key, value)


def build_task(args, vocab: P.Vocabulary) -> P.BuiltinTask:
    builtin_defaults(args)
    keys = [k for k in args.keys.split(",") if k.strip()] if args.keys is not None else None
    if args.task == "passkey" and keys is not None:
        raise EvaluationError("--keys applies to the lines task (its line keys); passkey has none")
    if args.task == "lines" and args.filler != "template":
        raise EvaluationError("--filler applies to the passkey task; lines prompts are made of records")
    options = dict(filler=args.filler) if args.task == "passkey" else dict(keys=keys)
    return P.make_task(args.task, vocab, digits=args.digits, number_format=args.number_format,
                       template=_template(args.template), seed=args.seed, **options)


def get_parser() -> argparse.ArgumentParser:
    p = tool_parser(
        "alibi-retrieval", "Retrieval accuracy (passkey, LongEval-style lines, or prompt files: your own JSONL, "
        "LongEval's, RULER's) of language models over prompt lengths x context-extension methods x depths.\n\n"
        + report.methods_by_position(),
        "examples:\n  alibi-retrieval data-bin/kv --checkpoint alibi=ck/alibi.pt --task lines --digits 3 \\\n"
        "      --lengths 1x,2x,4x,8x --methods none,linear:2,linear,ntk:2,ntk,cap --depths 5 --samples 20 "
        "-o outputs/ret --cpu\n  alibi-retrieval data-bin/wikitext-103 -c ck/alibi.pt --task passkey --filler "
        "dictionary --lengths 512,1k,2k\n  alibi-retrieval --hf bloom=models/bloom-560m --task longeval/200_lines.jsonl",
        "the model's fairseq-preprocess directory (its dict.txt); not with --hf", "outputs/retrieval",
        data_optional=True,
    )
    p.add_argument("--task", default="passkey",
                   help="passkey | lines | FILE.jsonl (own {'prompt', 'answer', 'group'}, LongEval lines/topics "
                   "or RULER records, recognized by their fields) (default: %(default)s)")
    p.add_argument("--lengths", default=None,
                   help="prompt lengths in tokens: integers (2k = 2048) or Nx = N times the training length "
                   f"(default: {BUILTIN_DEFAULTS['lengths']}; built-in tasks only)")
    p.add_argument("--depths", type=int, default=None,
                   help=f"needle depth bins from start to end (default: {BUILTIN_DEFAULTS['depths']})")
    p.add_argument("--samples", type=int, default=None,
                   help=f"prompts per length and depth (default: {BUILTIN_DEFAULTS['samples']})")
    p.add_argument("--seed", type=int, default=None, help=f"prompt seed (default: {BUILTIN_DEFAULTS['seed']})")
    p.add_argument("--digits", type=int, default=None, help="digits of the pass key / record numbers (default: 5)")
    p.add_argument("--number-format", default=None, choices=("spaced", "joined"),
                   help="numbers as one word per digit (1 2 3) or one word (123) (default: spaced)")
    p.add_argument("--filler", default=None,
                   help="passkey filler: 'template' (the classic sentences, the default), 'dictionary' (sentences "
                   "of the model's own words) or sentences separated by '|'")
    p.add_argument("--keys", default=None,
                   help="lines keys, comma-separated (default: dictionary words the template does not use)")
    p.add_argument("--template", action="append", default=[], metavar="FIELD=TEXT",
                   help="replace a template text (passkey: header, filler, needle, question; lines: header, "
                   "line, question; placeholders {number}, {key}) (repeatable)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per forward batch (default: 4 x the longest)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return runner.main(argv, get_parser(), Retrieval)


if __name__ == "__main__":
    sys.exit(main())
