"""A fairseq-preprocess directory as the evaluation tools read it: checked with
errors that name what is missing, and a split read back as text (for the Hugging
Face models beside fairseq checkpoints).  Used by both backends."""

from __future__ import annotations

import os
from typing import Optional

from ..errors import DataError, EvaluationError
from ..inputs import check_text
from ..splits import split_problem


def split_text(data: str, subset: str) -> str:
    """A fairseq-preprocess split as text: each sentence's ids read back as words through
    ``dict.txt``, a line per sentence (its ``</s>`` is the line's end), so that a tokenizer
    with the same vocabulary reads back the same ids."""
    from fairseq.data import Dictionary, data_utils

    check_data(data, subset)
    dictionary = Dictionary.load(os.path.join(data, "dict.txt"))
    dataset = data_utils.load_indexed_dataset(os.path.join(data, subset), dictionary)
    lines = []
    for i in range(len(dataset)):
        ids = dataset[i].tolist()
        if not ids or ids[-1] != dictionary.eos():
            raise EvaluationError(f"{os.path.join(data, subset)}: sentence {i} does not end with </s>; it was not "
                                  "binarized line by line by fairseq-preprocess, so it cannot be read back as text")
        lines.append(" ".join(dictionary[t] for t in ids[:-1]))
    return "\n".join(lines) + "\n"


def check_data(data: str, subset: Optional[str] = None) -> None:
    """A fairseq-preprocess output directory (with ``subset``'s files, if given): its
    dictionary UTF-8 text, the split whole (``inputs``), before any output is written."""
    if not os.path.isdir(data):
        if os.path.exists(data):
            raise EvaluationError(f"{data} is a file, not a data directory: give the fairseq-preprocess output "
                                  "directory (with dict.txt)")
        raise EvaluationError(f"data directory not found: {data}")
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise EvaluationError(f"no dict.txt file in {data}: not a fairseq-preprocess output directory")
    check_text(os.path.join(data, "dict.txt"), "dictionary")
    if subset is None:
        return
    problem = split_problem(os.path.join(data, subset))
    if problem:
        raise DataError(problem)
    if not all(os.path.isfile(os.path.join(data, f"{subset}.{ext}")) for ext in ("bin", "idx")):
        found = sorted(n[:-4] for n in os.listdir(data) if n.endswith(".bin"))
        raise EvaluationError(
            f"subset {subset!r} not found in {data} (expected {subset}.bin and {subset}.idx); "
            f"subsets there: {', '.join(found) or 'none'}"
        )
