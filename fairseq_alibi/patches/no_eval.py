"""fairseq reads some options with ``eval``: a checkpoint's or a YAML config's text would run."""

from __future__ import annotations

import ast
import importlib
import operator
from typing import Any

#: The fairseq modules that call ``eval`` on an option's text, and the options (fairseq 0.12.3):
#: utils' ``eval_str_list``, ``eval_str_dict`` and ``eval_bool`` (adaptive cutoffs and many more);
#: transformer_lm and lightconv_lm ``character_filters``; fconv, fconv_lm and fconv_self_att their
#: layer lists; the optimizers' betas and eps; wav2vec's, HuBERT's and s2t's layer lists; ctc's
#: ``wer_args``; the raw audio dataset's encoder spec.
EVALUATING_MODULES = (
    "fairseq.utils", "fairseq.models.transformer_lm", "fairseq.models.lightconv_lm", "fairseq.models.fconv",
    "fairseq.models.fconv_lm", "fairseq.models.fconv_self_att", "fairseq.models.wav2vec.wav2vec",
    "fairseq.models.wav2vec.wav2vec2", "fairseq.models.speech_to_text.s2t_wav_transformer",
    "fairseq.optim.adam", "fairseq.optim.cpu_adam", "fairseq.optim.adamax", "fairseq.optim.adafactor",
    "fairseq.optim.fused_lamb", "fairseq.criterions.ctc", "fairseq.models.hubert.hubert",
    "fairseq.data.audio.raw_audio_dataset",
)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> Any:
    """A literal, or a literal expression of ``+``, ``-`` and ``*`` (fconv's
    ``[(512, 3)] * 20`` and the like); anything else is refused."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(item) for item in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and any(isinstance(v, (list, tuple, str)) for v in (left, right)):
            count = right if isinstance(left, (list, tuple, str)) else left
            if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 10_000:
                raise ValueError("a repeat count of 0 to 10000")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not a literal")


def literal_expression(text: Any, *_ignored: Any) -> Any:
    """What fairseq's ``eval(text)`` gives for a literal (numbers, strings,
    tuples, lists, and ``+``, ``-``, ``*`` of them); a ``ConfigError`` for
    anything else (a name, a call, an attribute: code); eval's ``TypeError``
    for what is not text."""
    from ..errors import ConfigError

    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if not isinstance(text, str):  # as eval: fairseq's eval_bool reads this TypeError as "the default"
        raise TypeError("eval() arg 1 must be a string, bytes or code object")
    try:
        return _value(ast.parse(text.strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as exc:
        raise ConfigError(
            f"{text!r} is not a Python literal ({exc}): fairseq reads this option with eval(), which this plugin "
            "limits to literals (numbers, strings, tuples, lists and their + and *) so that a checkpoint or config "
            "never runs code; write the value itself, e.g. (0.9, 0.98)") from None


def literal_options_only() -> None:
    """The ``eval`` of fairseq's option readers (:data:`EVALUATING_MODULES`) reads
    literals only: a module's own global ``eval`` comes before the builtin one.

    Kind: safety. Stock: a checkpoint whose config holds
    ``character_filters="__import__('os').system(...)"`` (a stock
    ``transformer_lm``; read by alibi-eval-lm, the sweep, retrieval, the export,
    the hub API), or a YAML config or ``--adam-betas`` text doing the same, runs
    it when the model or optimizer is built, before any weight is checked: the
    safe unpickler lets plain strings through."""
    for name in EVALUATING_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001  (an optional dependency missing: its eval is never reached)
            continue
        module.__dict__["eval"] = literal_expression
