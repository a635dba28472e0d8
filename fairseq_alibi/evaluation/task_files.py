"""Retrieval prompts from files (``alibi-retrieval --task FILE.jsonl``), recognized by their fields.

Every format becomes the same items: a prompt, the answer that must follow it
(scored by greedy exact match from one teacher-forced forward, as every task of
the tool), and a group to report by.

* **own** (``prompt``, ``answer``, optional ``group``): as written;
* **LongEval lines** (DachengLi1/LongChat ``lines/testcases/*.jsonl``:
  ``prompt``, ``expected_number``, ``random_idx``, ``correct_line``...): the
  prompt with the completion cue LongEval appends for a base model,
  ``Line <KEY>: <REGISTER_CONTENT> is``; the answer is the number as the
  record writes it (`` <2416>``).  LongEval samples 15 tokens and reads their
  last integer; greedy exact match of the record's value is the deterministic
  form of the same question.  Grouped by ``num_lines``;
* **LongEval topics** (``prompt``, ``topics``): the prompt with the cue
  ``\\n ASSISTANT: The first topic is``; the answer is the first topic.  Grouped
  by the number of topics;
* **RULER** (NVIDIA/RULER ``prepare.py`` output: ``input``, ``outputs``,
  ``answer_prefix``...): the prompt is ``input + answer_prefix`` (RULER splits
  the prefix off the prompt it generates), the answer its single output; outputs
  that repeat one answer (qa_1's SQuAD annotators often agree) are that answer.
  Records with several different outputs (all of them credited in multi-value
  tasks, any one in qa_*, anywhere in a free generation) cannot be scored as one
  answer and are refused.

The prompt and the answer are tokenized separately (the answer's leading space
kept), so the answer's tokens are exactly the ones scored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List

from ..errors import EvaluationError
from ..inputs import check_text

LONGEVAL_LINES_CUE = "Line <{key}>: <REGISTER_CONTENT> is"
LONGEVAL_TOPICS_CUE = "\n ASSISTANT: The first topic is"


@dataclass
class FileItem:
    prompt: str
    answer: str
    group: str
    line: int  # where it came from, for messages


def _text(obj: dict, key: str, where: str, fmt: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        what = "missing" if key not in obj else "not a non-empty string"
        raise EvaluationError(f"{where}field {key!r} is {what} ({fmt} format)")
    return value


def _own(obj: dict, where: str) -> FileItem:
    group = obj.get("group", "")
    if not isinstance(group, (str, int, float)) or isinstance(group, bool):
        raise EvaluationError(f"{where}'group' must be a string or a number")
    return FileItem(_text(obj, "prompt", where, "own"), _text(obj, "answer", where, "own"), str(group), 0)


def _longeval_lines(obj: dict, where: str) -> FileItem:
    prompt = _text(obj, "prompt", where, "LongEval lines")
    number, index = obj.get("expected_number"), obj.get("random_idx")
    if isinstance(number, bool) or not isinstance(number, int):
        raise EvaluationError(f"{where}'expected_number' must be an integer (LongEval lines format)")
    if not isinstance(index, list) or not index or isinstance(index[0], (list, dict)):
        raise EvaluationError(f"{where}'random_idx' must be [line key, position] (LongEval lines format)")
    group = obj.get("num_lines", "")
    return FileItem(prompt + LONGEVAL_LINES_CUE.format(key=index[0]), f" <{number}>",
                    f"{group} lines" if group != "" else "", 0)


def _longeval_topics(obj: dict, where: str) -> FileItem:
    prompt = _text(obj, "prompt", where, "LongEval topics")
    topics = obj.get("topics")
    if not isinstance(topics, list) or not topics or not all(isinstance(t, str) and t.strip() for t in topics):
        raise EvaluationError(f"{where}'topics' must be a non-empty list of strings (LongEval topics format)")
    return FileItem(prompt + LONGEVAL_TOPICS_CUE, " " + topics[0].strip(), f"{len(topics)} topics", 0)


def _ruler(obj: dict, where: str) -> FileItem:
    text = _text(obj, "input", where, "RULER")
    prefix = obj.get("answer_prefix", "")
    outputs = obj.get("outputs")
    if not isinstance(prefix, str):
        raise EvaluationError(f"{where}'answer_prefix' must be a string (RULER format)")
    if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) and o.strip() for o in outputs):
        raise EvaluationError(f"{where}'outputs' must be a non-empty list of strings (RULER format)")
    answers = list(dict.fromkeys(o.strip() for o in outputs))  # one answer given twice is one answer
    if len(answers) > 1:
        raise EvaluationError(
            f"{where}a RULER record with {len(answers)} different outputs: RULER credits all of them (multi-value "
            "tasks) or any one (qa_*) anywhere in a free generation, which one teacher-forced answer cannot score; "
            "use tasks with one answer per record (niah_single_*, niah_multikey_*, qa_2)"
        )
    return FileItem(text + prefix, " " + answers[0], "", 0)


#: Each format: the fields that recognize it, and its reader.
FORMATS: Dict[str, tuple] = {
    "LongEval lines": (("prompt", "expected_number", "random_idx"), _longeval_lines),
    "LongEval topics": (("prompt", "topics"), _longeval_topics),
    "RULER": (("input", "outputs"), _ruler),
    "own": (("prompt", "answer"), _own),
}


def recognize(obj: dict) -> str:
    """The format whose fields ``obj`` has (the first that fits, in FORMATS order;
    an object with a ``prompt`` or an ``answer`` and no other signature is ours)."""
    for name, (fields, _) in FORMATS.items():
        if all(f in obj for f in fields):
            return name
    if "prompt" in obj or "answer" in obj:
        return "own"
    known = "; ".join(f"{name}: {', '.join(fields)}" for name, (fields, _) in FORMATS.items())
    raise EvaluationError(f"fields {', '.join(sorted(obj)) or '(none)'} match no known format ({known})")


def read_task_file(path: str) -> List[FileItem]:
    """Every prompt of a JSONL file (one format per file), checked line by line."""
    if not os.path.exists(path):
        raise EvaluationError(f"prompt file not found: {path} (--task takes passkey, lines or a .jsonl file)")
    check_text(path, "prompt file", bom_ok=True)
    items: List[FileItem] = []
    fmt = None
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is no JSON
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}: "
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise EvaluationError(f"{where}not valid JSON ({getattr(exc, 'msg', exc)}); one JSON object per line") from None
        if not isinstance(obj, dict):
            raise EvaluationError(f"{where}expected a JSON object (own format: 'prompt' and 'answer')")
        try:
            name = recognize(obj)
        except EvaluationError as exc:
            raise EvaluationError(f"{where}{exc}") from None
        if fmt is not None and name != fmt:
            raise EvaluationError(f"{where}a {name} record in a file of {fmt} records: one format per file")
        fmt = name
        reader: Callable = FORMATS[name][1]
        item = reader(obj, where)
        item.line = n
        items.append(item)
    if not items:
        raise EvaluationError(f"{path} holds no prompts: write one JSON object per line with 'prompt' and 'answer'")
    return items
