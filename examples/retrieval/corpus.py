"""Write the synthetic ``lines`` training corpus of the retrieval experiment.

Each document is one line of ``train.txt`` / ``valid.txt`` (at most
``--max-length`` words): a ``lines`` prompt of ``alibi-retrieval`` (the same
builder, ``fairseq_alibi.evaluation.prompts.Lines``) with a random number of
records and a random queried record, its answer, then up to ``--queries - 1``
of the record's lines repeated, each a further retrieval to learn from.

With ``--filler-share P`` a share P of the documents (drawn one by one) put
sentences of random corpus words between their records instead: one record
at least, at most half of what a random length holds, the rest filler, one
question.  The passkey of ``alibi-retrieval --filler dictionary`` is one
record in such filler, a prompt the plain corpus never shows.  P = 0 (the
default) writes the plain corpus, document for document as before.
``--filler-words keys`` (the default) draws the sentences from the keys and
the template's words, what ``--filler dictionary`` draws from this corpus's
dictionary (with the default 256 keys, 256 of its 275 words); ``non-keys`` from as many words
that are not keys (``f0``, ``f1``, ...) and the template's words, so that no
key but a record's own stands near it.

``--layout adjacent`` writes records ``line KEY N .`` and questions ending
``line KEY`` (the header and the question's words otherwise the same; a
shorter record, so more of them per document): the record's number
right after its key, so that finding the record is the copying an induction
head does (a head that carries the token before), where the default layout
(``record``) puts three template words between the key and the number.  The
evaluation must use the same layout: ``--template-args`` prints the
``alibi-retrieval --template`` arguments of a layout, for ``lines`` and for
the recipe's passkey (one record in filler), one per line.

    python examples/retrieval/corpus.py --destdir DIR --max-length 127 --keys 256 --digits 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import List

from fairseq_alibi.evaluation.prompts import Lines, Vocabulary


# The ``lines`` templates each layout replaces (the rest is ``Lines``' own).
LAYOUTS = {
    "record": {},
    "adjacent": {"line": "line {key} {number} .",
                 "question": "now the record is over . tell me the REGISTER_CONTENT in line {key} . line {key}"},
}


def layout_fields(layout: str) -> dict:
    """Every ``lines`` template field of a layout (``Lines``' own where it replaces none)."""
    return dict(Lines.template, **LAYOUTS[layout])


def lines_task(vocabulary: Vocabulary, digits: int, layout: str = "record", **options) -> Lines:
    """The ``lines`` task of a layout (:data:`LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: allowed are {', '.join(LAYOUTS)}")
    return Lines(vocabulary, digits=digits, template=LAYOUTS[layout], **options)


def template_args(layout: str, task: str) -> List[str]:
    """``alibi-retrieval`` arguments (``--template``, ``FIELD=TEXT``, ...) that
    build a layout's prompts: ``lines`` (nothing for the default layout), or
    ``passkey``, the recipe's passkey of the lines vocabulary: one record of
    key ``k1`` in filler, asked for as ``lines`` asks."""
    fields = layout_fields(layout)
    if task == "lines":
        pairs = list(LAYOUTS[layout].items())
    else:
        pairs = [("header", fields["header"]), ("needle", fields["line"].replace("{key}", "k1")),
                 ("question", fields["question"].replace("{key}", "k1"))]
    return [arg for name, text in pairs for arg in ("--template", f"{name}={text}")]


def training_example(task: Lines, max_length: int, rng: random.Random, queries: int = 4) -> List[str]:
    """One document of at most ``max_length`` words (see the module docstring)."""
    line_len = len(task.record("k", task.number(rng)))
    length = rng.randint(task.minimum_length(), max_length)
    prompt = task.build(length, rng.randrange(1 << 16), 1 << 16, rng)
    words = prompt.prompt + prompt.answer  # a prompt and its answer fill at most `length` words
    if len(words) < max_length:  # the record's closing "." where it fits (as filler_example's)
        words += task.record("k", [])[-1:]
    count = prompt.meta["lines"]
    header = len(task.words["header"])
    records = [prompt.prompt[header + i * line_len:][:line_len] for i in range(count)]
    while len(words) + line_len <= max_length and queries > 1:
        words += rng.choice(records)
        queries -= 1
    return words


FILLER_WORDS = ("keys", "non-keys")


def filler_words(task: Lines, kind: str = "keys") -> List[str]:
    """The words filler sentences draw from: the template's words and either
    the keys (``keys``: what ``--filler dictionary`` draws from this corpus's
    dictionary) or as many words that are no key (``non-keys``: f0, f1, ...)."""
    if kind not in FILLER_WORDS:
        raise ValueError(f"filler words {kind!r}: allowed are {', '.join(FILLER_WORDS)}")
    template = {w for ws in task.words.values() for w in ws if Vocabulary.WORD.match(w)}
    pool = set(task.keys) if kind == "keys" else {f"f{i}" for i in range(len(task.keys))}
    return sorted(pool | template)


def filler_example(task: Lines, words: List[str], max_length: int, rng: random.Random) -> List[str]:
    """One document of at most ``max_length`` words: the header, records
    (at most half of what the length holds) with filler sentences (5-9 of
    ``words`` and a full stop) at random places between them, the question
    about one record and its answer."""
    number_width = task.number_width()
    line_len = len(task.record("k", task.number(rng)))
    fixed = len(task.words["header"]) + len(task.fill("question", key=["k"])) + number_width + 1  # 1: "."
    length = rng.randint(min(task.minimum_length() + 1, max_length), max_length)
    count = rng.randint(1, max(1, (length - fixed) // line_len // 2))  # at most half of the body records
    keys = rng.sample(task.keys, count)
    numbers = [task.number(rng) for _ in keys]
    budget = length - fixed - count * line_len
    sentences: List[List[str]] = []
    while True:
        sentence = rng.sample(words, rng.randint(5, 9)) + ["."]
        if len(sentence) > budget:
            break
        sentences.append(sentence)
        budget -= len(sentence)
    at_records = set(rng.sample(range(count + len(sentences)), count))  # slots of the records, in order
    pieces, records, fill = [], iter(zip(keys, numbers)), iter(sentences)
    for slot in range(count + len(sentences)):
        pieces += task.record(*next(records)) if slot in at_records else next(fill)
    target = rng.randrange(count)
    document = task.words["header"] + pieces + task.fill("question", key=[keys[target]]) + numbers[target]
    return document + ["."] if len(document) < max_length else document


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--destdir", help="where train.txt and valid.txt are written (required)")
    p.add_argument("--max-length", type=int, help="words per document at most (< tokens per sample; required)")
    p.add_argument("--keys", type=int, default=256, help="size of the key pool")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--train-docs", type=int, default=40000)
    p.add_argument("--valid-docs", type=int, default=500)
    p.add_argument("--filler-share", type=float, default=0.0,
                   help="share of documents with filler sentences between their records (0-1)")
    p.add_argument("--filler-words", choices=FILLER_WORDS, default="keys",
                   help="what filler sentences draw from besides the template's words: the keys (default) or "
                        "as many words that are not keys (f0, f1, ...)")
    p.add_argument("--layout", choices=tuple(LAYOUTS), default="record",
                   help="record: line KEY : REGISTER_CONTENT is N . (the default); adjacent: line KEY N .")
    p.add_argument("--template-args", choices=("lines", "passkey"),
                   help="print the layout's alibi-retrieval --template arguments for this task (one per line) "
                        "and exit")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.template_args:  # the one use that writes no corpus
        for arg in template_args(args.layout, args.template_args):  # none for the default layout's lines
            print(arg)
        return 0
    if args.destdir is None or args.max_length is None:
        p.error("--destdir and --max-length are required (but with --template-args)")
    if not 0.0 <= args.filler_share <= 1.0:
        p.error(f"--filler-share must be between 0 and 1 (a share of the documents), got {args.filler_share}")
    if args.filler_words != "keys" and not args.filler_share:
        p.error(f"--filler-words {args.filler_words} needs filler documents: give --filler-share above 0, e.g. 0.25")
    for name in ("keys", "digits", "queries", "train_docs", "valid_docs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    task = lines_task(Vocabulary(None), args.digits, args.layout, keys=[f"k{i}" for i in range(args.keys)])
    if args.max_length < task.minimum_length():
        p.error(f"--max-length {args.max_length} is too short for one record and its question with "
                f"{args.digits} digits: at least {task.minimum_length()} words (give a larger L)")
    filler = filler_words(task, args.filler_words)
    os.makedirs(args.destdir, exist_ok=True)
    for split, n, seed in (("train", args.train_docs, args.seed), ("valid", args.valid_docs, args.seed + 1000)):
        rng = random.Random(seed)
        with open(os.path.join(args.destdir, f"{split}.txt"), "w", encoding="utf-8") as f:
            for _ in range(n):
                # (no draw at share 0: the plain corpus stays the one earlier versions wrote)
                if args.filler_share and rng.random() < args.filler_share:
                    words = filler_example(task, filler, args.max_length, rng)
                else:
                    words = training_example(task, args.max_length, rng, args.queries)
                f.write(" ".join(words) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
