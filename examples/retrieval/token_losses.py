"""Where a model's held-out loss goes on the ``lines`` corpus: its mean loss
per kind of token, so that a loss close to a retrieving model's can be told
apart from retrieval.

A document of the corpus (``corpus.py``) holds records ``line KEY :
REGISTER_CONTENT is D D D .`` (``line KEY D D D .`` with ``--layout
adjacent``), a question about one of them and repeated records.  Each word
of ``valid.txt`` is one of:

* ``retrieved 1st digit`` / ``retrieved later digit``: a digit of a record
  line whose KEY had a record earlier in the document (the question's
  answer, a repeated record).  The first can only be predicted by finding
  that record; a later one also by copying what followed the digit before
  it where that digit stood earlier (an induction head), without the key;
* ``new digit``: a digit of a KEY's first record (random: ln 10 = 2.30 nats
  at best);
* ``repeated key`` / ``new key``: the word after ``line`` when that KEY
  stood after ``line`` earlier in the document, or not;
* ``rest``: the template's words, full stops, filler.

Each document runs alone from its start (the end-of-sentence token first,
as fairseq's language model sees a document), teacher-forced; the loss of a
word is the negative log-probability the model gave it, in nats (fairseq's
logs give base 2).

    python examples/retrieval/token_losses.py DATA -c alibi=CKPT -c rotary=CKPT
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from corpus import LAYOUTS, layout_fields  # (this directory: the script's own)
from key_heads import inputs_ok, load_model, named_checkpoints

KINDS = ("retrieved 1st digit", "retrieved later digit", "new digit", "repeated key", "new key", "rest")


def record_header(layout: str = "record") -> Tuple[str, ...]:
    """The words of a layout's record line before its number, ``{key}`` where
    the key stands: ``line {key} : REGISTER_CONTENT is`` (``record``),
    ``line {key}`` (``adjacent``)."""
    line = layout_fields(layout)["line"].split()
    return tuple(line[:line.index("{number}")])


def record_key(words: List[str], i: int, header: Sequence[str] = record_header()) -> Optional[str]:
    """The KEY of the record line whose ``header`` (:func:`record_header`)
    ends at word ``i`` (its digits follow), else None."""
    start = i - len(header) + 1
    if start < 0 or any(h != "{key}" and words[start + j] != h for j, h in enumerate(header)):
        return None
    return words[start + header.index("{key}")]


def token_kinds(words: List[str], header: Sequence[str] = record_header()) -> List[str]:
    """The kind (one of :data:`KINDS`) of each word of one document."""
    kinds, seen_keys, recorded = [], set(), set()
    number_of, digits = None, 0  # the key whose number the digits being read belong to, and how many were read
    for i, word in enumerate(words):
        if i > 0 and words[i - 1] == "line" and word not in ("line", ":", "."):
            kinds.append("repeated key" if word in seen_keys else "new key")
            seen_keys.add(word)
        elif word.isdigit() and number_of is not None:
            kinds.append(("retrieved later digit" if digits else "retrieved 1st digit") if number_of in recorded
                         else "new digit")
        else:
            kinds.append("rest")
        key = record_key(words, i, header)
        if key is not None:
            number_of, digits = key, 0
        elif word.isdigit() and number_of is not None:
            digits += 1
        elif number_of is not None:
            if digits:  # the record's number ended (a header without one, "in line KEY .", records nothing)
                recorded.add(number_of)
            number_of = None
    return kinds


def record_guess(words: List[str], header: Sequence[str] = record_header()) -> List[float]:
    """The loss (nats) of each retrieved first digit (in order) under a guess
    that reads no key: any of the document's earlier records, uniformly, and
    its first digit; what a model gets that weighs every earlier record
    alike (no head that tells one record's key from another's)."""
    numbers: Dict[str, List[str]] = {}  # key -> its record's digits, once the record ended
    out, number_of, digits = [], None, []
    for i, (word, kind) in enumerate(zip(words, token_kinds(words, header))):
        if kind == "retrieved 1st digit":
            firsts = [n[0] for n in numbers.values()]
            out.append(-math.log(firsts.count(word) / len(firsts)) if word in firsts else math.inf)
        if number_of is not None and word.isdigit():
            digits.append(word)
        elif number_of is not None:
            if digits:
                numbers.setdefault(number_of, digits)
            number_of, digits = None, []
        number_of = record_key(words, i, header) or number_of
    return out


def losses_by_kind(model, dictionary, documents: List[List[str]],
                   header: Sequence[str] = record_header()) -> Dict[str, List[float]]:
    """Every word's loss (nats), grouped by :func:`token_kinds`."""
    out: Dict[str, List[float]] = {k: [] for k in KINDS}
    for words in documents:
        ids = [dictionary.index(w) for w in words]
        if dictionary.unk() in ids:
            raise ValueError(f"a word of the document is not in the model's dictionary: {words}")
        tokens = torch.tensor([[dictionary.eos()] + ids])
        with torch.no_grad():  # the model's own normalization (an adaptive softmax's too)
            logprobs = model.get_normalized_probs(model(tokens[:, :-1]), log_probs=True)
        nll = -logprobs[0].float().gather(1, tokens[0, 1:, None])[:, 0]
        for kind, loss in zip(token_kinds(words, header), nll.tolist()):
            out[kind].append(loss)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="the binarized retrieval corpus the models were trained on (its dict.txt)")
    p.add_argument("--text", help="the held-out documents, one per line (default: DATA/raw/valid.txt, "
                                  "where run.sh's corpus.py writes them)")
    p.add_argument("-c", "--checkpoint", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--documents", type=int, default=300, help="documents of raw/valid.txt to read (default 300)")
    p.add_argument("--layout", choices=tuple(LAYOUTS), default="record",
                   help="the corpus's record layout (corpus.py --layout; default record)")
    args = p.parse_args(argv)
    if args.documents < 1:
        p.error(f"--documents must be at least 1, got {args.documents}")
    pairs = named_checkpoints(p, args.checkpoint)
    if not inputs_ok(args.data, [path for _, path in pairs]):
        return 1
    valid = args.text or os.path.join(args.data, "raw", "valid.txt")
    try:
        with open(valid, encoding="utf-8") as f:
            documents = [line.split() for line in f if line.strip()][:args.documents]
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read the held-out documents {valid}: {e}; give the DATA directory "
              "run.sh wrote (it keeps the text under raw/) or --text", file=sys.stderr)
        return 1

    counts = {k: 0 for k in KINDS}
    header = record_header(args.layout)
    for kind in (k for words in documents for k in token_kinds(words, header)):
        counts[kind] += 1
    total = sum(counts.values())
    print(f"Mean loss (nats) per kind of token, {len(documents)} held-out documents of {valid} "
          f"(share of the tokens in brackets)\n")
    print("| model | " + " | ".join(f"{k} ({100 * counts[k] / total:.0f}%)" for k in KINDS) + " | all |")
    print("|---|" + "---|" * (len(KINDS) + 1))
    guesses = [x for words in documents for x in record_guess(words, header)]
    if guesses:
        print(f"| (no model: any earlier record's first digit, uniformly) | {sum(guesses) / len(guesses):.3f} | "
              + " | ".join("" for _ in KINDS[1:]) + " |  |")
    for name, path in pairs:
        model = load_model(name, path, args.data)
        if model is None:
            return 1
        try:
            by_kind = losses_by_kind(model, model.decoder.dictionary, documents, header)
        except ValueError as e:
            print(f"error: {name}: {e}; give the DATA the model was trained on", file=sys.stderr)
            return 1
        every = [x for k in KINDS for x in by_kind[k]]
        cells = [f"{sum(v) / len(v):.3f}" if v else "n/a" for v in (by_kind[k] for k in KINDS)]
        print(f"| {name} | " + " | ".join(cells) + f" | {sum(every) / len(every):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
