"""``alibi-retrieval``: retrieval accuracy over prompt lengths x ALiBi context-extension methods.

The grid is checkpoints x methods x lengths x depths, as in ``alibi-sweep``
(same ``--checkpoint``, ``--lengths`` and ``--methods`` syntax; non-ALiBi
language models such as the sinusoidal ``transformer_lm`` get ``none`` only),
with a retrieval task instead of perplexity:

* ``passkey``: a pass key hidden in filler text, asked for at the end;
* ``lines``: LongEval-style records ``line KEY : REGISTER_CONTENT is N``, one of
  them asked for at the end;
* ``FILE.jsonl``: your own prompts, one JSON object per line with ``prompt``
  and ``answer`` (and optionally ``group``, to aggregate by); ``--lengths``
  does not apply, the length is the prompt's own.

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

``--hf MODEL`` evaluates a Hugging Face BLOOM, MPT or Falcon (alibi) model
instead (no DATA directory): prompts through its own tokenizer (its bos token
prepended where it has one), each method applied with
``hf.apply_alibi_scaling``; everything else is the same.

Outputs in ``--output-dir``: ``results.json`` (every cell; the resume state),
``results.csv``, ``results.md``, ``accuracy.png`` (accuracy vs length) and, for
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

from ..errors import EvaluationError, PromptError, report_errors
from . import prompts as P
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

logger = logging.getLogger("fairseq_alibi.retrieval")

RESULT_FIELDS = (
    "checkpoint", "task", "method", "factor", "label", "effective_factor", "group", "length",
    "length_ratio", "train_length", "depth", "needle_distance", "n", "correct", "accuracy", "answer_logprob", "seconds",
)
FLOAT_FIELDS = ("accuracy", "answer_logprob", "length_ratio", "effective_factor", "seconds", "depth",
                "needle_distance")


# --------------------------------------------------------------------------- samples


@dataclass
class Sample:
    """One prompt and its answer as token ids of the model's dictionary."""

    prompt: List[int]
    answer: List[int]
    depth: Optional[float]  # bin centre; None for JSONL prompts
    group: str
    length: int  # tokens processed: prepended eos + prompt + answer minus its last token
    distance: Optional[int] = None  # tokens from the needle's start to the end of the prompt

    @staticmethod
    def make(prompt: List[int], answer: List[int], depth, group, distance=None) -> "Sample":
        return Sample(prompt, answer, depth, group, len(prompt) + len(answer), distance)


class Encoder:
    """Text -> dictionary ids, as the checkpoint reads text: word by word against the
    dictionary, or through its BPE / tokenizer (fairseq's ``encode_fn``) if it has one."""

    def __init__(self, dictionary, bpe=None, tokenizer=None):
        self.dictionary = dictionary
        self.bpe, self.tokenizer = bpe, tokenizer

    @property
    def subword(self) -> bool:
        return self.bpe is not None or self.tokenizer is not None

    def vocabulary(self) -> P.Vocabulary:
        if self.subword:
            return P.Vocabulary(None)
        d = self.dictionary
        return P.Vocabulary([d[i] for i in range(d.nspecial, len(d))])

    def unknown(self, words: Sequence[str]) -> List[str]:
        d = self.dictionary
        return [w for w in words if d.index(w) == d.unk()]

    def encode(self, text: str, where: str = "") -> List[int]:
        d = self.dictionary
        if self.subword:
            x = text
            if self.tokenizer is not None:
                x = self.tokenizer.encode(x)
            if self.bpe is not None:
                x = self.bpe.encode(x)
            ids = [d.index(t) for t in x.split()]
            if d.unk() in ids:
                raise EvaluationError(f"{where}the text {text[:60]!r} encodes to <unk> tokens with the checkpoint's BPE")
            return ids
        words = text.split()
        self.check_words(words, where)
        return [d.index(w) for w in words]

    def check_words(self, words: Sequence[str], where: str = "") -> None:
        """Every word must be in the dictionary (word-level models)."""
        missing = [] if self.subword else self.unknown(words)
        if missing:
            shown = ", ".join(sorted(set(missing))[:20])
            raise EvaluationError(
                f"{where}{len(set(missing))} word(s) not in the model's dictionary: {shown}; every word of "
                "a prompt and answer must be in the dictionary (none is replaced by <unk>): rewrite "
                "them with the model's own words"
            )


def text_encoder(info: CheckpointInfo, task) -> Encoder:
    """The checkpoint's own BPE / tokenizer (from its saved config), if any."""
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(info.path)
    cfg = state.get("cfg") or {}
    bpe_cfg = cfg.get("bpe") if hasattr(cfg, "get") else None
    tok_cfg = cfg.get("tokenizer") if hasattr(cfg, "get") else None
    bpe = task.build_bpe(bpe_cfg) if bpe_cfg is not None and bpe_cfg.get("_name") else None
    tokenizer = task.build_tokenizer(tok_cfg) if tok_cfg is not None and tok_cfg.get("_name") else None
    return Encoder(task.source_dictionary, bpe, tokenizer)


def read_jsonl(path: str) -> List[dict]:
    """``prompt``, ``answer`` (non-empty strings) and optional ``group`` per line."""
    if not os.path.isfile(path):
        raise EvaluationError(f"prompt file not found: {path} (--task takes passkey, lines or a .jsonl file)")
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise EvaluationError(f"{path}:{n}: not valid JSON ({exc.msg}); one JSON object per line")
            if not isinstance(obj, dict):
                raise EvaluationError(f"{path}:{n}: expected a JSON object with 'prompt' and 'answer'")
            for key in ("prompt", "answer"):
                value = obj.get(key)
                if not isinstance(value, str) or not value.strip():
                    what = "missing" if key not in obj else "not a non-empty string"
                    raise EvaluationError(
                        f"{path}:{n}: field {key!r} is {what}; each line needs 'prompt' and 'answer' "
                        "(non-empty strings) and may have 'group'"
                    )
            group = obj.get("group", "")
            if not isinstance(group, (str, int, float)) or isinstance(group, bool):
                raise EvaluationError(f"{path}:{n}: 'group' must be a string or a number")
            items.append({"prompt": obj["prompt"], "answer": obj["answer"], "group": str(group), "line": n})
    if not items:
        raise EvaluationError(f"{path} holds no prompts: write one JSON object per line with 'prompt' and 'answer'")
    return items


def jsonl_samples(items: List[dict], encoder: Encoder, path: str) -> List[Sample]:
    out = []
    for item in items:
        where = f"{path}:{item['line']}: "
        encoder.check_words(item["prompt"].split() + item["answer"].split(), where)
        out.append(Sample.make(encoder.encode(item["prompt"], where), encoder.encode(item["answer"], where),
                               None, item["group"]))
    return out


def builtin_samples(task: P.BuiltinTask, encoder: Encoder, lengths: Sequence[int], depths: int, samples: int,
                    seed: int) -> Dict[Tuple[int, int], List[Sample]]:
    """``(length, depth bin) -> samples``, each drawn from its own seeded generator."""
    out: Dict[Tuple[int, int], List[Sample]] = {}
    centres = P.bins(depths)
    for length in lengths:
        for b in range(depths):
            cell = []
            for s in range(samples):
                rng = random.Random(f"{seed}:{task.name}:{length}:{b}/{depths}:{s}")
                prompt = task.build(length, b, depths, rng)
                offset = prompt.meta["needle_offset"]
                if encoder.subword:
                    ids = encoder.encode(" ".join(prompt.prompt))
                    ans = encoder.encode(" ".join(prompt.answer))
                    offset = len(encoder.encode(" ".join(prompt.prompt[:offset]))) if offset else 0
                else:
                    d = encoder.dictionary
                    ids, ans = [d.index(w) for w in prompt.prompt], [d.index(w) for w in prompt.answer]
                cell.append(Sample.make(ids, ans, centres[b], "", distance=len(ids) - offset))
            out[(length, b)] = cell
    return out


# --------------------------------------------------------------------------- scoring


class Scorer:
    """One model (checkpoint + method) scoring samples with one forward each."""

    def __init__(self, info: CheckpointInfo, method: Method, data: str, max_length: int, cpu: bool,
                 max_tokens: Optional[int] = None):
        self.info, self.method = info, method
        self.overrides = model_overrides(info, method, max_length + 1)
        cfg = eval_lm_config(data, info.path, max_length + 1, self.overrides, cpu=cpu)
        self.model, self.task, self.use_cuda = load_language_model(info, self.overrides, cfg)
        self.max_tokens = max_tokens or max(4 * max_length, 4096)

    def effective_factor(self, length: int) -> float:
        from ..alibi import resolve_scale_factor

        if not self.info.alibi:
            return 1.0
        return resolve_scale_factor(self.method.name, self.method.factor, self.info.train_length, length)

    def score(self, samples: Sequence[Sample]) -> List[Tuple[bool, float, List[int]]]:
        """(correct, mean answer log-prob, greedy tokens) per sample, in order."""
        results: List[Optional[tuple]] = [None] * len(samples)
        by_length: Dict[int, List[int]] = {}
        for i, s in enumerate(samples):
            by_length.setdefault(len(s.prompt) + len(s.answer), []).append(i)
        # Only sequences of one length share a batch: no padding, and a dynamic
        # method's factor is that of the sample's own length.
        for total, idx in by_length.items():
            per_batch = max(1, self.max_tokens // total)
            for start in range(0, len(idx), per_batch):
                chunk = idx[start:start + per_batch]
                for i, r in zip(chunk, self._forward([samples[i] for i in chunk])):
                    results[i] = r
        return results  # type: ignore[return-value]

    def _forward(self, batch: Sequence[Sample]) -> List[Tuple[bool, float, List[int]]]:
        import torch
        from fairseq import utils

        # prompt + answer minus its last token: the answer's last token is a target only.
        tokens = [torch.tensor(s.prompt + s.answer[:-1], dtype=torch.long) for s in batch]
        dataset = self.task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
        sample = dataset.collater([dataset[i] for i in range(len(tokens))])
        src = sample["net_input"]["src_tokens"]
        if self.use_cuda:
            src = utils.move_to_cuda(src)
        n_prompt = len(batch[0].prompt)
        n_answer = len(batch[0].answer)
        # The prepended token shifts the input by one: input position len(prompt) + k
        # predicts answer token k.
        positions = torch.arange(n_prompt, n_prompt + n_answer, device=src.device)
        with torch.no_grad():
            features, _ = self.model.decoder.extract_features(src, None)
            logits = self.model.decoder.output_layer(features[:, positions, :])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for b, s in enumerate(batch):
            answer = torch.tensor(s.answer, device=logprobs.device)
            lp = logprobs[b].gather(-1, answer[:, None]).squeeze(-1)
            greedy = logprobs[b].argmax(-1)
            out.append((bool((greedy == answer).all()), float(lp.double().mean()), greedy.tolist()))
        return out


# --------------------------------------------------------------------------- driver


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alibi-retrieval",
        description="Retrieval accuracy (passkey, LongEval-style lines, or your own JSONL prompts) of "
        "fairseq language models over prompt lengths x ALiBi context-extension methods x depths.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  alibi-retrieval data-bin/kv --checkpoint alibi=ck/alibi.pt --task lines "
        "--digits 3 \\\n      --lengths 1x,2x,4x,8x --methods none,linear:2,linear,ntk:2,ntk --depths 5 "
        "--samples 20 -o outputs/ret --cpu\n"
        "  alibi-retrieval data-bin/wikitext-103 -c ck/alibi.pt --task passkey --filler dictionary "
        "--lengths 512,1k,2k\n  alibi-retrieval data-bin/wikitext-103 -c ck/alibi.pt --task my-prompts.jsonl",
    )
    p.add_argument("data", nargs="?", default=None,
                   help="the model's fairseq-preprocess directory (its dict.txt); not with --hf")
    add_grid_arguments(p, "outputs/retrieval")
    p.add_argument("--task", default="passkey",
                   help="passkey | lines | FILE.jsonl ({'prompt': ..., 'answer': ..., 'group': ...} per line) "
                   "(default: %(default)s)")
    p.add_argument("--lengths", default="1x,2x,4x,8x",
                   help="prompt lengths in tokens: integers (2k = 2048) or Nx = N times the training length "
                   "(default: %(default)s; not for JSONL tasks)")
    p.add_argument("--depths", type=int, default=5, help="needle depth bins from start to end (default: %(default)s)")
    p.add_argument("--samples", type=int, default=10, help="prompts per length and depth (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="prompt seed (default: %(default)s)")
    p.add_argument("--digits", type=int, default=None, help="digits of the pass key / record numbers (default: 5)")
    p.add_argument("--number-format", default="spaced", choices=("spaced", "joined"),
                   help="numbers as one word per digit (1 2 3) or one word (123) (default: %(default)s)")
    p.add_argument("--filler", default="template",
                   help="passkey filler: 'template' (the classic sentences), 'dictionary' (sentences of the "
                   "model's own words) or sentences separated by '|' (default: %(default)s)")
    p.add_argument("--keys", default=None,
                   help="lines keys, comma-separated (default: dictionary words the template does not use)")
    p.add_argument("--template", action="append", default=[], metavar="FIELD=TEXT",
                   help="replace a template text (passkey: header, filler, needle, question; lines: header, "
                   "line, question; placeholders {number}, {key}) (repeatable)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per forward batch (default: 4 x the longest)")
    return p


def _template(items: Sequence[str]) -> Dict[str, str]:
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise EvaluationError(f"bad --template {item!r}: use FIELD=TEXT, e.g. --template 'question=where is it ?'")
        out[name.strip()] = text
    return out


def build_task(args, vocab: P.Vocabulary) -> P.BuiltinTask:
    keys = [k for k in args.keys.split(",") if k.strip()] if args.keys else None
    options = dict(filler=args.filler) if args.task == "passkey" else dict(keys=keys)
    return P.make_task(args.task, vocab, digits=args.digits, number_format=args.number_format,
                       template=_template(args.template), seed=args.seed, **options)


def cell_key(cell: dict) -> tuple:
    depth = cell.get("depth")
    return (cell["checkpoint"], cell["task"], cell["method"], float(cell["factor"]), cell.get("group", ""),
            int(cell["length"]), None if depth is None else round(float(depth), 6))


def _order(c: dict) -> tuple:
    return (c["checkpoint"], c["task"], c["method"], c["factor"], c.get("group", ""), c["length"],
            -1 if c.get("depth") is None else c["depth"])


def settings_identity(args, jsonl: bool) -> str:
    """What changes the prompts (a cell is reused only for the same)."""
    if jsonl:
        parts = [os.path.abspath(args.task), file_identity(args.task)]
    else:
        parts = [args.task, args.depths, args.samples, args.seed, args.digits, args.number_format,
                 args.filler, args.keys, sorted(args.template)]
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def run(args: argparse.Namespace) -> List[dict]:
    methods = parse_methods(args.methods)
    jsonl = args.task not in P.TASKS
    if jsonl and not args.task.endswith(".jsonl") and not os.path.isfile(args.task):
        raise EvaluationError(f"unknown task {args.task!r}: use passkey, lines, or a .jsonl file of prompts")
    if args.depths < 1 or args.samples < 1:
        raise EvaluationError("--depths and --samples must be at least 1")
    lengths = None if jsonl else parse_lengths(args.lengths)
    items = read_jsonl(args.task) if jsonl else None
    hf_models: Dict[str, object] = {}
    if args.hf:
        from .hf_models import HFEncoder, HFModel, HFScorer, parse_hf_models

        if args.checkpoint or args.data:
            raise EvaluationError("--hf models read their prompts through their own tokenizer: give no DATA "
                                  "directory and no --checkpoint with --hf")
        prepare_output_dir(args.output_dir)
        for name, spec in parse_hf_models(args.hf):
            hf_models[name] = HFModel(name, spec, args.train_length, args.cpu, args.dtype)
        infos = [m.info for m in hf_models.values()]
        data_id = f"hf|{args.dtype}"
    else:
        if args.data is None:
            raise EvaluationError("give the model's data directory (its dict.txt), or --hf MODEL")
        checkpoints = parse_checkpoints(args.checkpoint)
        check_data(args.data)
        prepare_output_dir(args.output_dir)

        import fairseq_alibi  # noqa: F401  (registers the ALiBi models)

        infos = [inspect_checkpoint(name, path) for name, path in checkpoints]
        data_id = data_identity(args.data)
    task_name = os.path.basename(args.task) if jsonl else args.task
    settings = settings_identity(args, jsonl)
    by_name = {info.name: info for info in infos}

    def identity(checkpoint: str) -> Optional[str]:
        info = by_name.get(checkpoint)
        return None if info is None else f"{info.identity}|{data_id}|{settings}"

    # Prompts per checkpoint (the same for every method), validated before anything runs.
    plans: List[Tuple[CheckpointInfo, Method, Tuple, List[Sample]]] = []
    encoders: Dict[str, Encoder] = {}
    max_length: Dict[str, int] = {}
    for info in infos:
        if info.name in hf_models:
            encoder = HFEncoder(hf_models[info.name].tokenizer)
        else:
            from fairseq import tasks

            cfg = eval_lm_config(args.data, info.path, 64, {}, cpu=True)
            encoder = text_encoder(info, tasks.setup_task(cfg.task))
        encoders[info.name] = encoder
        if jsonl:
            samples = jsonl_samples(items, encoder, args.task)
            cells: Dict[tuple, List[Sample]] = {}
            for s in samples:
                cells.setdefault((s.group, s.length, None), []).append(s)
        else:
            these = resolve_lengths(lengths, info.train_length)
            task = build_task(args, encoder.vocabulary())
            try:
                built = builtin_samples(task, encoder, these, args.depths, args.samples, args.seed)
            except PromptError as exc:
                raise EvaluationError(f"{info.name}: {exc}")
            cells = {("", length, round(P.bins(args.depths)[b], 6)): v for (length, b), v in built.items()}
        max_length[info.name] = max(s.length for v in cells.values() for s in v)
        if not info.alibi and len(methods) > 1:
            logger.info("%s (%s) is not an ALiBi model: evaluated with 'none' only", info.name, info.model)
        for method in usable_methods(info, methods):
            for key, samples in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
                plans.append((info, method, key, samples))

    store = ResultStore(args.output_dir)
    store.reuse(cell_key, lambda cell: identity(cell["checkpoint"]))
    if store.stale:
        logger.info("%d stored cells were computed from other checkpoint files, data or prompt settings: "
                    "recomputing them", store.stale)

    def key_of(info, method, key) -> tuple:
        group, length, depth = key
        return (info.name, task_name, method.name, float(method.factor), group, length, depth)

    todo = [p for p in plans if store.get(key_of(p[0], p[1], p[2])) is None]
    logger.info("%d cells in the grid, %d already done, %d to run", len(plans), len(plans) - len(todo), len(todo))
    meta = {"data": os.path.abspath(args.data) if args.data else None, "hf": args.hf, "task": args.task,
            "depths": args.depths,
            "samples": args.samples, "seed": args.seed}

    bar = progress(len(plans), len(plans) - len(todo), "retrieval", args.no_progress)
    scorer: Optional[Scorer] = None
    for info, method, key, samples in todo:
        group, length, depth = key
        bar.set_postfix_str(f"{info.name} {method.label} L={length}" + (f" depth={depth:.2f}" if depth is not None else ""))
        if scorer is None or scorer.info is not info or scorer.method != method:
            scorer = None  # free the previous model first
            if info.name in hf_models:
                scorer = HFScorer(hf_models[info.name], method)
            else:
                scorer = Scorer(info, method, args.data, max_length[info.name], args.cpu, args.max_tokens)
        start = time.perf_counter()
        scored = scorer.score(samples)
        correct = sum(1 for ok, _, _ in scored if ok)
        cell = {
            "checkpoint": info.name, "path": info.path, "model": info.model, "task": task_name,
            "method": method.name, "factor": float(method.factor), "label": method.label,
            "effective_factor": scorer.effective_factor(length),
            "group": group, "length": length, "depth": depth,
            "length_ratio": length / info.train_length if info.train_length else None,
            "train_length": info.train_length, "n": len(samples), "correct": correct,
            "needle_distance": (sum(s.distance for s in samples) / len(samples)
                                if samples[0].distance is not None else None),
            "accuracy": correct / len(samples),
            "answer_logprob": sum(lp for _, lp, _ in scored) / len(scored),
            "seconds": time.perf_counter() - start,
            "sample_correct": [ok for ok, _, _ in scored],
            "sample_logprob": [round(lp, 6) for _, lp, _ in scored],
            "identity": identity(info.name),
        }
        store.put(key_of(info, method, key), cell, meta, order=_order)
        bar.update(1)
        bar.write(f"{info.name:>12} {method.label:>14} L={length:<6}"
                  + (f" depth={depth:.2f}" if depth is not None else "") + (f" group={group}" if group else "")
                  + f" accuracy={cell['accuracy']:.2f} logprob={cell['answer_logprob']:.3f} ({cell['seconds']:.1f}s)")
    bar.close()
    cells_out = sorted(store.cells.values(), key=_order)
    write_reports(args.output_dir, cells_out)
    return cells_out


def write_reports(outdir: str, cells: List[dict]) -> List[str]:
    written = ["results.json", "results.csv", "results.md"]
    report.write_csv(os.path.join(outdir, "results.csv"), cells, RESULT_FIELDS, FLOAT_FIELDS)
    report.atomic_write(os.path.join(outdir, "results.md"), report.retrieval_tables(cells))
    if cells:
        report.plot_retrieval_accuracy(os.path.join(outdir, "accuracy.png"), cells)
        written.append("accuracy.png")
    if any(c.get("depth") is not None for c in cells):
        report.plot_retrieval_depth(os.path.join(outdir, "depth.png"), [c for c in cells if c.get("depth") is not None])
        written.append("depth.png")
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_parser().parse_args(argv)
    quiet_logging(args.verbose)
    with report_errors(interrupted="alibi-retrieval interrupted: finished cells are saved in "
                       f"{args.output_dir}/results.json; run the same command again to resume"):
        cells = run(args)
    print(report.retrieval_tables(cells))
    names = ("results.json", "results.csv", "results.md", "accuracy.png", "depth.png")
    print(f"results in {args.output_dir}/ ({', '.join(n for n in names if os.path.exists(os.path.join(args.output_dir, n)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
