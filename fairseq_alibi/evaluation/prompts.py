"""Retrieval prompts built to a target length in tokens: passkey and LongEval-style lines.

Pure Python (no torch, no fairseq), so the same builders serve
``alibi-retrieval`` and the synthetic training corpus of
``examples/retrieval/corpus.py``.  One class per task (:class:`Passkey`,
:class:`Lines`, both :class:`BuiltinTask`); :func:`make_task` picks one by name.

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

from ..errors import PromptError, plural

DIGITS = tuple("0123456789")

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


def template_fields(task: str, defaults: Dict[str, str], given: Dict[str, str], placeholders: Dict[str, tuple]):
    """The task's template texts with ``given`` ones replacing them, checked: known
    fields only, each holding exactly its placeholders, each a word of its own.
    An unknown placeholder would fail while building, a missing one (the pass
    key's {number}, a record's {key}) would ask a question the prompt cannot
    answer, a glued one (``{key}:``) would be dropped."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise PromptError(f"unknown template {plural(len(unknown), 'field')} {', '.join(unknown)} for task {task}: "
                          f"the fields are {', '.join(defaults)}")
    fields = dict(defaults, **given)
    for name, text in fields.items():
        required = placeholders.get(name, ())
        holes = re.findall(r"\{(\w*)\}", text)
        bad = sorted({h for h in holes if h not in required})
        missing = [p for p in required if p not in holes]
        glued = [w for w in text.split() if ("{" in w or "}" in w) and not re.fullmatch(r"\{\w+\}", w)]
        if bad or missing or glued:
            what = (f"unknown {plural(len(bad), 'placeholder')} {', '.join('{' + h + '}' for h in bad)}" if bad else
                    f"no {', '.join('{' + p + '}' for p in missing)} (without it the prompt cannot be answered)"
                    if missing else f"{glued[0]!r}: a placeholder must be a word of its own (spaces around it)")
            takes = ", ".join("{" + p + "}" for p in required) or "no placeholder"
            raise PromptError(f"template {name} of task {task}: {what}; {name} takes {takes}: {text!r}")
    return fields


class BuiltinTask:
    """A built-in task: its template checked against a vocabulary once, then
    built to any length.  Subclasses set ``name`` and ``template`` and write
    :meth:`prepare` (task options, drawn from the seeded ``rng``),
    :meth:`minimum_length` and :meth:`build_prompt`."""

    name = ""
    template: Dict[str, str] = {}
    free_text = ()  # template fields that are not spelled against the vocabulary
    placeholders: Dict[str, tuple] = {}  # the placeholders each field must hold (others hold none)

    def __init__(self, vocab: Vocabulary, *, digits: Optional[int] = None, number_format: str = "spaced",
                 template: Optional[Dict[str, str]] = None, seed: int = 0, **options):
        self.vocab = vocab
        self.fields = template_fields(self.name, self.template, template or {}, self.placeholders)
        self.digits = 5 if digits is None else digits
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or self.digits < 1:
            raise PromptError(f"--digits {digits!r} is not valid: a number has at least 1 digit")
        if number_format not in ("spaced", "joined"):
            raise PromptError(f"unknown number format {number_format!r}: use spaced or joined")
        self.number_format = number_format
        spell = Speller(vocab)
        # Words of the templates (placeholders removed) must be in the dictionary.
        self.words = {k: spell(re.sub(r"\{\w+\}", " ", v)) for k, v in self.fields.items() if k not in self.free_text}
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
        self.prepare(spell, random.Random(seed), **options)
        if spell.missing:
            shown = ", ".join(spell.missing[:20]) + (" ..." if len(spell.missing) > 20 else "")
            raise PromptError(
                f"task {self.name}: {len(spell.missing)} {plural(len(spell.missing), 'word is', 'words are')} not in "
                f"the model's dictionary: {shown}. "
                f"Every word must be in the dictionary (none is replaced by <unk>); {self.missing_hint()}"
                "replace template texts with --template FIELD=TEXT "
                f"(fields: {', '.join(self.fields)}), or --number-format joined if the dictionary "
                "has whole numbers but not single digits"
            )

    def prepare(self, spell: Speller, rng: random.Random) -> None:
        """Task options, checked against the vocabulary (``spell`` collects missing words)."""

    def missing_hint(self) -> str:
        return ""

    def number(self, rng: random.Random) -> List[str]:
        if self.numbers:
            return [rng.choice(self.numbers)]
        digits = [str(rng.randint(1, 9))] + [str(rng.randint(0, 9)) for _ in range(self.digits - 1)]
        if self.number_format == "joined":
            return ["".join(digits)]
        return [self.vocab.spell(d) or d for d in digits]

    def number_width(self) -> int:
        """Words in one number."""
        return 1 if self.number_format == "joined" else self.digits

    def fill(self, field_name: str, **values: List[str]) -> List[str]:
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
        raise NotImplementedError

    def build(self, length: int, depth_bin: int, n_bins: int, rng: random.Random) -> Prompt:
        """A prompt of at most ``length`` tokens, within one filler sentence / record of it."""
        if length < self.minimum_length():
            raise PromptError(
                f"length {length} is shorter than the shortest {self.name} prompt "
                f"({self.minimum_length()} tokens: header, one {self.unit}, question and answer); "
                "use longer --lengths"
            )
        return self.build_prompt(length, depth_bin, n_bins, rng)

    def build_prompt(self, length: int, depth_bin: int, n_bins: int, rng: random.Random) -> Prompt:
        raise NotImplementedError


class Passkey(BuiltinTask):
    """A pass key hidden in filler sentences, asked for at the end."""

    name, unit = "passkey", "needle"
    template = {
        "header": "There is an important info hidden inside a lot of irrelevant text . Find it and "
        "memorize them . I will quiz you about the important information there .",
        "filler": "The grass is green . | The sky is blue . | The sun is yellow . | Here we go . | "
        "There and back again .",
        "needle": "The pass key is {number} . Remember it . {number} is the pass key .",
        "question": "What is the pass key ? The pass key is",
    }
    free_text = ("filler",)
    placeholders = {"needle": ("number",)}

    def prepare(self, spell: Speller, rng: random.Random, filler: str = "template") -> None:
        self.filler_option = filler
        if filler == "template":
            self.filler = [spell(s) for s in self.fields["filler"].split("|") if s.strip()]
        elif filler == "dictionary":
            self.filler = self._dictionary_filler(rng)
        else:
            self.filler = [spell(s) for s in filler.split("|") if s.strip()]
        if not self.filler:
            raise PromptError("the filler is empty: give sentences separated by '|'")

    def missing_hint(self) -> str:
        if self.filler_option == "dictionary":
            return ""
        return "use --filler dictionary (filler sentences of the model's own words), "

    def _dictionary_filler(self, rng: random.Random) -> List[List[str]]:
        if self.vocab.open:
            raise PromptError(
                "--filler dictionary draws words from a word-level dictionary; this model reads any text "
                "through its tokenizer (Hugging Face or BPE): use the default filler or --filler 'SENTENCE | ...'"
            )
        words = self.vocab.content_words()[:2000]
        if len(words) < 10:
            raise PromptError(
                f"the dictionary has {len(words)} plain words, too few for --filler dictionary (10 at least): "
                "give --filler 'SENTENCE | SENTENCE ...'"
            )
        stop = [self.vocab.spell(".")] if self.vocab.spell(".") else []
        return [rng.sample(words, rng.randint(5, 9)) + stop for _ in range(64)]

    def minimum_length(self) -> int:
        n = ["0"] * self.number_width()
        return len(self.words["header"]) + len(self.fill("needle", number=n)) + len(self.words["question"]) + len(n)

    def build_prompt(self, length, depth_bin, n_bins, rng) -> Prompt:
        number = self.number(rng)
        header, question = self.words["header"], self.words["question"]
        needle = self.fill("needle", number=number)
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
        depth = at / len(sentences) if sentences else 0.5
        return Prompt(header + body + question, number, depth,
                      {"needle_offset": len(header) + sum(map(len, sentences[:at])), "slots": len(sentences) + 1})


class Lines(BuiltinTask):
    """LongEval-style records ``line KEY : REGISTER_CONTENT is N .``, one asked for at the end."""

    name, unit = "lines", "record"
    template = {
        "header": "below is a record of lines i want you to remember .",
        "line": "line {key} : REGISTER_CONTENT is {number} .",
        "question": "now the record is over . tell me the REGISTER_CONTENT in line {key} . "
        "line {key} : REGISTER_CONTENT is",
    }
    placeholders = {"line": ("key", "number"), "question": ("key",)}

    def prepare(self, spell: Speller, rng: random.Random, keys: Optional[Sequence[str]] = None) -> None:
        if keys is not None:
            self.keys = [self._key(spell, k) for k in keys]
            repeated = sorted({k for k in self.keys if self.keys.count(k) > 1})
            if repeated or not self.keys:
                raise PromptError(f"--keys repeats {', '.join(repeated)}: two records with one key would make the "
                                  "question ambiguous; give distinct keys" if repeated else
                                  "--keys names no key: give --keys W1,W2,... (or leave it out for dictionary words)")
        else:
            used = {w for ws in self.words.values() for w in ws} | set(DIGITS)
            self.keys = self.vocab.content_words(exclude=used)
        if not self.vocab.open and not self.keys:
            raise PromptError("no dictionary words left to use as line keys: give --keys W1,W2,...")

    @staticmethod
    def _key(spell: Speller, key: str) -> str:
        words = spell(key)
        if len(words) != 1:
            raise PromptError(f"--keys item {key!r} is not one word: a line key is one word of the dictionary")
        return words[0]

    def record(self, key: str, number: List[str]) -> List[str]:
        """One record line: ``line KEY : REGISTER_CONTENT is N .``."""
        return self.fill("line", key=[key], number=number)

    def minimum_length(self) -> int:
        n = ["0"] * self.number_width()
        return (len(self.words["header"]) + len(self.record("k", n))
                + len(self.fill("question", key=["k"])) + len(n))

    def build_prompt(self, length, depth_bin, n_bins, rng) -> Prompt:
        header = self.words["header"]
        probe_n = self.number(rng)
        line_len = len(self.record("k", probe_n))
        question_len = len(self.fill("question", key=["k"]))
        count = (length - len(header) - question_len - len(probe_n)) // line_len
        if not self.vocab.open and count > len(self.keys):
            raise PromptError(
                f"a lines prompt of {length} tokens needs {count} distinct line keys, the dictionary "
                f"offers {len(self.keys)}: use shorter --lengths or give more --keys"
            )
        keys = rng.sample(self.keys, count) if self.keys else [f"k{i}" for i in rng.sample(range(10 * count), count)]
        numbers = [self.number(rng) for _ in range(count)]
        target = pick_in_bin(count, depth_bin, n_bins, rng)
        body = [w for k, n in zip(keys, numbers) for w in self.record(k, n)]
        prompt = header + body + self.fill("question", key=[keys[target]])
        depth = target / (count - 1) if count > 1 else 0.5
        return Prompt(prompt, numbers[target], depth,
                      {"lines": count, "key": keys[target], "needle_offset": len(header) + target * line_len,
                       "slots": count})


TASKS = {task.name: task for task in (Passkey, Lines)}


def make_task(name: str, vocab: Vocabulary, **options) -> BuiltinTask:
    """The built-in task ``name`` fitted to ``vocab`` (options of its class)."""
    if name not in TASKS:
        raise PromptError(f"unknown task {name!r}: choose {', '.join(TASKS)} or a .jsonl file")
    return TASKS[name](vocab, **options)
