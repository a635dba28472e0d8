"""The axes every evaluation tool shares: models (``NAME=PATH``), methods
(``Scaling`` spellings) and lengths (``64``, ``2k``, ``4x``), parsed and checked
before anything runs; and the order of ``--methods`` that reports follow."""

from __future__ import annotations

import os
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from ..core.positions import extensions
from ..core.scaling import Scaling
from ..errors import EvaluationError, not_a_file
from ..options import INT32_MAX
from .protocols import ModelInfo

DEFAULT_METHODS = "none,linear:2,linear,ntk:2,ntk"
MAX_LENGTH = INT32_MAX  # fairseq's block code counts tokens in int32 (options.INTEGER_OPTIONS)


def parse_methods(spec: str) -> List[Scaling]:
    """``none,linear:2,linear,ntk:4,cap:0.5`` -> methods (order kept, duplicates
    dropped), without a training length: each model's is added by :func:`methods_for`."""
    methods: List[Scaling] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        method = Scaling.parse(item)
        if method not in methods:
            methods.append(method)
    if not methods:
        raise EvaluationError("no methods given")
    return methods


def applicable(info: ModelInfo) -> Tuple[str, ...]:
    """The extension methods that apply to a model (``core.positions``, or fewer where its backend
    says so: ``ModelInfo.extensions``; ``none`` only without a position method)."""
    if getattr(info, "extensions", None) is not None:  # (a caller may describe a model by its position alone)
        return info.extensions
    return extensions(info.position)


def check_methods_apply(infos: Sequence[ModelInfo], methods: Sequence[Scaling]) -> None:
    """Refuse, in one line, a method that applies to none of the models."""
    for method in methods:
        if not any(method.method in applicable(info) for info in infos):
            which = "; ".join(f"{info.name} ({info.position or 'sinusoidal'}): {', '.join(applicable(info))}"
                              for info in infos)
            raise EvaluationError(f"{method.spelling} does not apply to any model of this run; the methods that "
                                  f"do: {which}")


def methods_for(info: ModelInfo, methods: Sequence[Scaling]) -> List[Scaling]:
    """The methods of one model that apply to it (``none`` alone where none
    does), complete with its training length."""
    methods = [m for m in methods if m.method in applicable(info)] or [Scaling()]
    for method in methods:
        if method.needs_train_length and info.train_length is None:
            raise EvaluationError(f"{info.name}: {method.spelling} needs the length the model was trained at, "
                                  f"which it does not record{info.missing_length_hint}")
    return [method.with_train_length(info.train_length).complete() for method in methods]


def parse_lengths(spec: str) -> List[Tuple[str, float]]:
    """``64,2k`` -> absolute; ``1x,16x`` -> relative to the training length."""
    out = []
    for item in (s.strip().lower() for s in spec.split(",")):
        if not item:
            continue
        try:
            if item.endswith("x"):
                kind, value = "x", float(item[:-1])
            elif item.endswith("k"):
                kind, value = "abs", int(round(float(item[:-1]) * 1024))
            else:
                kind, value = "abs", int(item)
        except ValueError:
            raise EvaluationError(
                f"bad length {item!r}: use integers (64), thousands of tokens (2k = 2048) "
                "or multiples of the training length (4x)"
            ) from None
        if not value > 0 or value != value or value == float("inf"):
            raise EvaluationError(f"bad length {item!r}: must be a positive number")
        if kind == "abs" and value > MAX_LENGTH:
            raise EvaluationError(f"bad length {item!r}: at most {MAX_LENGTH} tokens (fairseq counts in int32)")
        out.append((kind, value))
    if not out:
        raise EvaluationError("no lengths given")
    return out


def resolve_lengths(lengths: Sequence[Tuple[str, float]], train_length: Optional[int], name: str = "") -> List[int]:
    """Token counts, sorted and distinct, for a model trained at ``train_length``."""
    out = []
    for kind, value in lengths:
        if kind == "x":
            if not train_length:
                raise EvaluationError(
                    f"{name + ': ' if name else ''}relative lengths (Nx) need the model's training length, which "
                    "it does not record; give absolute lengths (or --train-length for --hf models)"
                )
            scaled = value * train_length
            if not 1 <= round(min(scaled, MAX_LENGTH + 1)) <= MAX_LENGTH:
                raise EvaluationError(f"length {value:g}x of {train_length} tokens is {scaled:g} tokens: "
                                      f"not between 1 and {MAX_LENGTH}")
            length = int(round(scaled))
        else:
            length = int(value)
        if length not in out:
            out.append(length)
    return sorted(out)


def check_max_tokens(max_tokens: Optional[int], longest: int, what: str, unit: str) -> None:
    """``--max-tokens`` holds one ``unit`` (a window, a prompt) of ``longest`` tokens."""
    if max_tokens is not None and max_tokens < longest:
        raise EvaluationError(f"--max-tokens {max_tokens} is smaller than {what} ({longest} tokens): {unit} must "
                              "fit in a batch; raise --max-tokens")


def parse_named(specs: Sequence[str], default_name: Callable[[str], str], what: str) -> List[Tuple[str, str]]:
    """``[NAME=]VALUE`` items -> (name, value); ``default_name(value)`` names a bare one."""
    out: List[Tuple[str, str]] = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            name, value = default_name(spec), spec
        if not name or not value:
            raise EvaluationError(f"bad {what[:-1]} {spec!r}: use NAME=PATH or PATH")
        if any(n == name for n, _ in out):
            raise EvaluationError(f"two {what} named {name!r}: name them with NAME=...")
        out.append((name, value))
    return out


def check_checkpoint_paths(pairs: Sequence[Tuple[str, str]]) -> None:
    for _, path in pairs:
        if not os.path.isfile(path):
            raise EvaluationError(not_a_file(path, "checkpoint"))


def method_rank(methods: Iterable[Scaling]) -> Callable[[dict], int]:
    """Sort key of a record's method in the order the user gave (others after them)."""
    order = {m.key: i for i, m in enumerate(methods)}
    return lambda cell: order.get(Scaling.from_record(cell).key, len(order))
