"""Retrieval prompts built to a target length in tokens: passkey and LongEval-style lines.

Pure Python (no torch, no fairseq), so the same builders serve
``alibi-retrieval`` and the synthetic training corpus of
``examples/retrieval`` (``python -m fairseq_alibi.evaluation.prompts``).

A prompt is a list of *words* (whitespace tokens) and an answer (words too).
Its **length** is what the model processes to score it in one teacher-forced
forward pass: the end-of-sentence token fairseq prepends, the prompt, and the
answer without its last word, i.e. ``len(prompt) + len(answer)``.

* ``passkey`` (Mohtashami & Jaggi): a header, filler sentences cycled until the
  target length, the needle ``The pass key is 1 2 3 4 5 . Remember it . 1 2 3 4
  5 is the pass key .`` inserted between two filler sentences at the requested
  depth, then ``What is the pass key ? The pass key is``; answer ``1 2 3 4 5``.
* ``lines`` (LongEval, LongChat): a header, records
  ``line KEY : REGISTER_CONTENT is 1 2 3 .``, then the question
  ``now the record is over . tell me the REGISTER_CONTENT in line KEY . line
  KEY : REGISTER_CONTENT is``; answer ``1 2 3`` (the queried record's number).
  The question ends with the record's own prefix, so the answer is what
  followed that prefix in the record.

Numbers are written digit by digit (``1 2 3``) by default, so a word-level
dictionary needs only the ten digits; ``number_format="joined"`` writes one
word (``123``), for subword models or dictionaries of whole numbers.

Every text is a template field that can be replaced (``--template
FIELD=TEXT``); words are matched to the dictionary as written, else
lowercased, else capitalized, so one template serves cased and uncased
vocabularies.  The filler ``dictionary`` draws sentences of random frequent
dictionary words, and line keys default to words of the dictionary that the
template does not use: a model's own vocabulary always suffices for them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

DIGITS = tuple("0123456789")
TASKS = ("passkey", "lines")

TEMPLATES: Dict[str, Dict[str, str]] = {
    "passkey": {
        "header": "There is an important info hidden inside a lot of irrelevant text . Find it and "
        "memorize them . I will quiz you about the important information there .",
        "filler": "The grass is green . | The sky is blue . | The sun is yellow . | Here we go . | "
        "There and back again .",
        "needle": "The pass key is {number} . Remember it . {number} is the pass key .",
        "question": "What is the pass key ? The pass key is",
    },
    "lines": {
        "header": "below is a record of lines i want you to remember .",
        "line": "line {key} : REGISTER_CONTENT is {number} .",
        "question": "now the record is over . tell me the REGISTER_CONTENT in line {key} . "
        "line {key} : REGISTER_CONTENT is",
    },
}
DEFAULT_DIGITS = {"passkey": 5, "lines": 5}


class PromptError(ValueError):
    """A task that cannot be built as asked (the message says why and what to do)."""


@dataclass
class Prompt:
    prompt: List[str]
    answer: List[str]
    depth: float  # relative position of the needle / queried record in the context, 0..1
    meta: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.answer)


# ------------------------------------------------------------------ vocabulary


class Vocabulary:
    """The words a model can read; ``None`` words means any word (subword models)."""

    SPECIAL = re.compile(r"^(<.*>|madeupword\d+)$")
    WORD = re.compile(r"^[^\W\d_][\w-]*$")

    def __init__(self, words: Optional[Sequence[str]] = None):
        self.ordered = list(words) if words is not None else None
        self.words = set(words) if words is not None else None

    @property
    def open(self) -> bool:
        return self.words is None

    def spell(self, word: str) -> Optional[str]:
        """``word`` as the dictionary has it (as written, lowercased, capitalized), or None."""
        if self.words is None:
            return word
        for form in (word, word.lower(), word.capitalize()):
            if form in self.words:
                return form
        return None

    def content_words(self, exclude=()) -> List[str]:
        """Dictionary words that start with a letter and hold only letters, digits,
        ``-`` or ``_`` (frequency order), minus ``exclude``."""
        if self.ordered is None:
            return []
        skip = set(exclude)
        return [w for w in self.ordered if self.WORD.match(w) and w not in skip and not self.SPECIAL.match(w)]


class Speller:
    """Maps template words to dictionary words and collects the missing ones."""

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        self.missing: List[str] = []

    def __call__(self, text: str) -> List[str]:
        out = []
        for word in text.split():
            form = self.vocab.spell(word)
            if form is None:
                if word not in self.missing:
                    self.missing.append(word)
                form = word
            out.append(form)
        return out


# ------------------------------------------------------------------ tasks


def bins(n: int) -> List[float]:
    """Centres of ``n`` equal depth bins over [0, 1]."""
    return [(b + 0.5) / n for b in range(n)]


def pick_in_bin(count: int, depth_bin: int, n_bins: int, rng: random.Random) -> int:
    """An index in ``0..count-1`` whose relative position lies in the bin (nearest if none does)."""
    if count <= 1:
        return 0
    lo, hi = depth_bin / n_bins, (depth_bin + 1) / n_bins
    inside = [i for i in range(count) if lo <= i / (count - 1) < hi or (hi >= 1.0 and i == count - 1)]
    if inside:
        return rng.choice(inside)
    centre = (lo + hi) / 2
    return min(range(count), key=lambda i: abs(i / (count - 1) - centre))


class Task:
    """A built-in task, checked against a vocabulary once, then built to any length."""

    def __init__(self, name: str, vocab: Vocabulary, *, digits: Optional[int] = None,
                 number_format: str = "spaced", filler: str = "template",
                 template: Optional[Dict[str, str]] = None, keys: Optional[Sequence[str]] = None,
                 seed: int = 0):
        if name not in TASKS:
            raise PromptError(f"unknown task {name!r}: choose {', '.join(TASKS)} or a .jsonl file")
        self.name = name
        self.vocab = vocab
        self.fields = dict(TEMPLATES[name])
        unknown = sorted(set(template or {}) - set(self.fields))
        if unknown:
            raise PromptError(
                f"unknown template field(s) {', '.join(unknown)} for task {name}: "
                f"the fields are {', '.join(self.fields)}"
            )
        self.fields.update(template or {})
        self.digits = digits or DEFAULT_DIGITS[name]
        if self.digits < 1:
            raise PromptError("--digits must be at least 1")
        if number_format not in ("spaced", "joined"):
            raise PromptError(f"unknown number format {number_format!r}: use spaced or joined")
        self.number_format = number_format
        spell = Speller(vocab)
        templ = {k: v for k, v in self.fields.items()}
        # Words of the templates (placeholders removed) must be in the dictionary.
        self.words = {k: spell(re.sub(r"\{\w+\}", " ", v)) for k, v in templ.items() if k != "filler"}
        self.numbers: List[str] = []  # whole-number words of a closed vocabulary ("joined")
        if number_format == "spaced":
            for d in DIGITS:
                if vocab.spell(d) is None and d not in spell.missing:
                    spell.missing.append(d)
        elif not vocab.open:
            self.numbers = [w for w in vocab.ordered if w.isdigit() and len(w) == self.digits and w[0] != "0"]
            if len(self.numbers) < 2:
                raise PromptError(
                    f"--number-format joined: the dictionary has {len(self.numbers)} {self.digits}-digit "
                    "number words; use another --digits or --number-format spaced"
                )
        rng = random.Random(seed)
        if name == "passkey":
            if filler == "template":
                self.filler = [spell(s) for s in self.fields["filler"].split("|") if s.strip()]
            elif filler == "dictionary":
                self.filler = self._dictionary_filler(rng)
            else:
                self.filler = [spell(s) for s in filler.split("|") if s.strip()]
            if not self.filler:
                raise PromptError("the filler is empty: give sentences separated by '|'")
        self.keys: List[str] = []
        if name == "lines":
            if keys:
                self.keys = [w for w in (spell(k)[0] for k in keys if k.strip())]
            else:
                used = {w for ws in self.words.values() for w in ws} | set(DIGITS)
                self.keys = vocab.content_words(exclude=used)
            if not vocab.open and not self.keys:
                raise PromptError("no dictionary words left to use as line keys: give --keys W1,W2,...")
        if spell.missing:
            shown = ", ".join(spell.missing[:20]) + (" ..." if len(spell.missing) > 20 else "")
            hint = (
                "use --filler dictionary (filler sentences of the model's own words), " if name == "passkey" else ""
            )
            raise PromptError(
                f"task {name}: {len(spell.missing)} word(s) are not in the model's dictionary: {shown}. "
                f"Every word must be in the dictionary (none is replaced by <unk>); {hint}"
                "replace template texts with --template FIELD=TEXT "
                f"(fields: {', '.join(self.fields)}), or --number-format joined if the dictionary "
                "has whole numbers but not single digits"
            )

    def _dictionary_filler(self, rng: random.Random) -> List[List[str]]:
        words = self.vocab.content_words()[:2000]
        if len(words) < 10:
            raise PromptError("the dictionary has too few words for a dictionary filler: give --filler TEXT")
        stop = [self.vocab.spell(".")] if self.vocab.spell(".") else []
        return [rng.sample(words, rng.randint(5, 9)) + stop for _ in range(64)]

    # ---------------------------------------------------------------- pieces

    def number(self, rng: random.Random) -> List[str]:
        if self.numbers:
            return [rng.choice(self.numbers)]
        digits = [str(rng.randint(1, 9))] + [str(rng.randint(0, 9)) for _ in range(self.digits - 1)]
        if self.number_format == "joined":
            return ["".join(digits)]
        return [self.vocab.spell(d) or d for d in digits]

    def _fill(self, field_name: str, **values) -> List[str]:
        """Template ``field_name`` with placeholders replaced by word lists."""
        out: List[str] = []
        spelled = iter(self.words[field_name])
        for piece in self.fields[field_name].split():
            holes = re.findall(r"\{(\w+)\}", piece)
            if holes and re.fullmatch(r"\{\w+\}", piece):
                out.extend(values[holes[0]])
            else:
                out.append(next(spelled))
        return out

    def minimum_length(self) -> int:
        n = ["0"] * (1 if self.number_format == "joined" else self.digits)
        if self.name == "passkey":
            return (len(self.words["header"]) + len(self._fill("needle", number=n))
                    + len(self.words["question"]) + len(n))
        key = ["k"]
        return (len(self.words["header"]) + len(self._fill("line", key=key, number=n))
                + len(self._fill("question", key=key)) + len(n))

    def build(self, length: int, depth_bin: int, n_bins: int, rng: random.Random) -> Prompt:
        """A prompt of at most ``length`` tokens, within one filler sentence / record of it."""
        if length < self.minimum_length():
            raise PromptError(
                f"length {length} is shorter than the shortest {self.name} prompt "
                f"({self.minimum_length()} tokens: header, one {'needle' if self.name == 'passkey' else 'record'}, "
                "question and answer); use longer --lengths"
            )
        if self.name == "passkey":
            return self._passkey(length, depth_bin, n_bins, rng)
        return self._lines(length, depth_bin, n_bins, rng)

    def _passkey(self, length, depth_bin, n_bins, rng) -> Prompt:
        number = self.number(rng)
        header, question = self.words["header"], self.words["question"]
        needle = self._fill("needle", number=number)
        budget = length - len(header) - len(needle) - len(question) - len(number)
        sentences: List[List[str]] = []
        used = 0
        start = rng.randrange(len(self.filler))
        while True:
            s = self.filler[(start + len(sentences)) % len(self.filler)]
            if used + len(s) > budget:
                break
            sentences.append(s)
            used += len(s)
        at = pick_in_bin(len(sentences) + 1, depth_bin, n_bins, rng)  # needle before sentence `at`
        body = [w for s in sentences[:at] for w in s] + needle + [w for s in sentences[at:] for w in s]
        prompt = header + body + question
        depth = at / len(sentences) if sentences else 0.5
        return Prompt(prompt, number, depth, {"needle_offset": len(header) + sum(map(len, sentences[:at]))})

    def _lines(self, length, depth_bin, n_bins, rng) -> Prompt:
        header = self.words["header"]
        probe_n = self.number(rng)
        line_len = len(self._fill("line", key=["k"], number=probe_n))
        question_len = len(self._fill("question", key=["k"]))
        count = (length - len(header) - question_len - len(probe_n)) // line_len
        if not self.vocab.open and count > len(self.keys):
            raise PromptError(
                f"a lines prompt of {length} tokens needs {count} distinct line keys, the dictionary "
                f"offers {len(self.keys)}: use shorter --lengths or give more --keys"
            )
        keys = rng.sample(self.keys, count) if self.keys else [f"k{i}" for i in rng.sample(range(10 * count), count)]
        numbers = [self.number(rng) for _ in range(count)]
        target = pick_in_bin(count, depth_bin, n_bins, rng)
        body = [w for k, n in zip(keys, numbers) for w in self._fill("line", key=[k], number=n)]
        prompt = header + body + self._fill("question", key=[keys[target]])
        depth = target / (count - 1) if count > 1 else 0.5
        return Prompt(prompt, numbers[target], depth,
                      {"lines": count, "key": keys[target], "needle_offset": len(header) + target * line_len})


# ------------------------------------------------------------------ training corpus


def training_example(task: Task, max_length: int, rng: random.Random, queries: int = 4) -> List[str]:
    """One ``lines`` training document of at most ``max_length`` words: a prompt of a
    random number of records (random queried record) with its answer, then up to
    ``queries - 1`` more records of the record repeated (``line KEY : ... is N .``),
    each a further retrieval the model is trained on."""
    line_len = len(task._fill("line", key=["k"], number=task.number(rng)))
    lo = task.minimum_length()
    length = rng.randint(lo, max_length)
    prompt = task.build(length, rng.randrange(1 << 16), 1 << 16, rng)
    words = prompt.prompt + prompt.answer + task._fill("line", key=[], number=[])[-1:]
    count = prompt.meta["lines"]
    records = [prompt.prompt[len(task.words["header"]) + i * line_len:][:line_len] for i in range(count)]
    while len(words) + line_len <= max_length and queries > 1:
        words += rng.choice(records)
        queries -= 1
    return words


def main(argv=None) -> int:
    """Write a synthetic ``lines`` corpus: ``train.txt``/``valid.txt`` of one document per line."""
    import argparse
    import os

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--destdir", required=True)
    p.add_argument("--max-length", type=int, required=True, help="words per document at most (< tokens per sample)")
    p.add_argument("--keys", type=int, default=256, help="size of the key pool")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--train-docs", type=int, default=40000)
    p.add_argument("--valid-docs", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    keys = [f"k{i}" for i in range(args.keys)]
    task = Task("lines", Vocabulary(None), digits=args.digits, keys=keys)
    os.makedirs(args.destdir, exist_ok=True)
    for split, n, seed in (("train", args.train_docs, args.seed), ("valid", args.valid_docs, args.seed + 1000)):
        rng = random.Random(seed)
        with open(os.path.join(args.destdir, f"{split}.txt"), "w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(" ".join(training_example(task, args.max_length, rng, args.queries)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
