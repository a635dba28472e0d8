"""Write the synthetic ``lines`` training corpus of the retrieval experiment.

Each document is one line of ``train.txt`` / ``valid.txt`` (at most
``--max-length`` words): a ``lines`` prompt of ``alibi-retrieval`` (the same
builder, ``fairseq_alibi.evaluation.prompts.Lines``) with a random number of
records and a random queried record, its answer, then up to ``--queries - 1``
of the record's lines repeated, each a further retrieval to learn from.

    python examples/retrieval/corpus.py --destdir DIR --max-length 127 --keys 256 --digits 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import List

from fairseq_alibi.evaluation.prompts import Lines, Vocabulary


def training_example(task: Lines, max_length: int, rng: random.Random, queries: int = 4) -> List[str]:
    """One document of at most ``max_length`` words (see the module docstring)."""
    line_len = len(task.record("k", task.number(rng)))
    length = rng.randint(task.minimum_length(), max_length)
    prompt = task.build(length, rng.randrange(1 << 16), 1 << 16, rng)
    words = prompt.prompt + prompt.answer + task.record("k", [])[-1:]  # the record's closing "."
    count = prompt.meta["lines"]
    header = len(task.words["header"])
    records = [prompt.prompt[header + i * line_len:][:line_len] for i in range(count)]
    while len(words) + line_len <= max_length and queries > 1:
        words += rng.choice(records)
        queries -= 1
    return words


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--destdir", required=True)
    p.add_argument("--max-length", type=int, required=True, help="words per document at most (< tokens per sample)")
    p.add_argument("--keys", type=int, default=256, help="size of the key pool")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--train-docs", type=int, default=40000)
    p.add_argument("--valid-docs", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("keys", "digits", "queries", "train_docs", "valid_docs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    task = Lines(Vocabulary(None), digits=args.digits, keys=[f"k{i}" for i in range(args.keys)])
    if args.max_length < task.minimum_length():
        p.error(f"--max-length {args.max_length} is too short for one record and its question with "
                f"{args.digits} digits: at least {task.minimum_length()} words (give a larger L)")
    os.makedirs(args.destdir, exist_ok=True)
    for split, n, seed in (("train", args.train_docs, args.seed), ("valid", args.valid_docs, args.seed + 1000)):
        rng = random.Random(seed)
        with open(os.path.join(args.destdir, f"{split}.txt"), "w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(" ".join(training_example(task, args.max_length, rng, args.queries)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
