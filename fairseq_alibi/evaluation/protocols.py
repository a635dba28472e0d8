"""What the evaluation runner asks of a backend, a loaded model and a measure.

``runner.run`` is written against these three protocols only: a new backend
(where models come from) or a new measure (what a cell computes) implements
one of them and nothing else changes.  ``ModelInfo`` and ``Described`` are the
records passed between them; a measure's cells are its own small dataclasses,
each with a ``key`` (its identity in ``results.json``, with the model and the
method) and a ``label`` (for progress lines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from ..core.scaling import Scaling


@dataclass
class ModelInfo:
    """What the runner and the reports know of one model."""

    name: str
    path: str
    model: str  # family: a registered fairseq model, or hf:<family>
    arch: str
    position: Optional[str]  # its core.positions method; None: positions it cannot change (sinusoidal)
    train_length: Optional[int]
    identity: str  # the model file(s) and whatever else changes its numbers
    #: What to do when a method needs the training length and ``train_length`` is None.
    missing_length_hint: str = ""
    #: The extension methods its backend applies, where not all of its position method's (a BLOOM's: no logn).
    extensions: Optional[Tuple[str, ...]] = None


@dataclass
class Described:
    """One model as planned: its info, its encoder, and what loading it needs."""

    info: ModelInfo
    encoder: Any
    source: Any = None  # the backend's own (a checkpoint's unpickled state, ...)


class Cell(Protocol):
    """One cell of a measure for one model under one method."""

    @property
    def key(self) -> tuple: ...

    @property
    def label(self) -> str: ...


AnswerScore = Tuple[bool, float, List[int]]  # greedy exact match, mean answer log-prob, greedy ids


def answer_result(logprobs, answer: Sequence[int]) -> Tuple[bool, float, List[int]]:
    """(greedy exact match, mean log-prob, greedy ids) from ``[n_answer, V]`` log-probs."""
    import torch

    target = torch.tensor(list(answer), device=logprobs.device)
    chosen = logprobs.gather(-1, target[:, None])[:, 0]
    greedy = logprobs.argmax(-1)
    return bool((greedy == target).all()), float(chosen.double().mean()), greedy.tolist()


class ScoredWindow(NamedTuple):
    """One window of the perplexity text, scored: ``index``, its place in the text
    (0: the first; the same window has the same index in every backend, however
    the windows were ordered or batched); the natural log-probs of its scored
    tokens, their positions in the window, and their ids (``targets``: which text
    was scored, so that cells are compared window by window only on the same text)."""

    index: int
    scores: Any
    positions: Any
    targets: Any


class EvaluationModel(Protocol):
    """One model, loaded once, put under each method in turn."""

    info: ModelInfo

    def use(self, method: Scaling) -> None:
        """Evaluate under ``method`` (complete: it has the model's training length) from now on."""

    def close(self) -> None:
        """Free the model."""

    def effective_factor(self, length: int) -> float:
        """The slope factor a forward pass over ``length`` keys uses."""

    def answer_scores(self, batch: Sequence[Tuple[List[int], List[int]]]) -> List[AnswerScore]:
        """(exact match, mean log-prob, greedy ids) of equal-length (prompt, answer) pairs."""

    def windows(self, length: int, stride: int, max_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> Tuple[Optional[int], Iterator[ScoredWindow]]:
        """(tokens to score, iterator of :class:`ScoredWindow`), as
        ``fairseq-eval-lm --tokens-per-sample length --context-window (length - stride)``."""

    def command(self, length: int, stride: int, max_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> str:
        """The command line that computes the same windows (for the record)."""


class Backend(Protocol):
    """Where models come from: fairseq checkpoints, Hugging Face models, both."""

    data_identity: str  # the data a cell was computed on (a cell is reused only for the same)

    def specs(self, args) -> List[Tuple[str, Any]]:
        """(name, source) of every model the arguments name, checked."""

    def describe(self, name: str, source: Any) -> Described:
        """The model's info and encoder, read once (its weights need not be loaded)."""

    def text_tokens(self, described: Described) -> int:
        """Tokens of the perplexity text as the model reads it (the longest window)."""

    def load(self, described: Described, max_length: int) -> EvaluationModel:
        """The model, loaded for inputs of up to ``max_length`` tokens."""


class Measure(Protocol):
    """What one tool computes per cell, and how it reports."""

    tool: str  # the console script

    def settings_identity(self) -> str:
        """The settings that change a cell's numbers (a cell is reused only for the same)."""

    def meta(self) -> dict:
        """What ``results.json`` records of the run."""

    def cells(self, described: Described) -> List[Cell]:
        """Every cell of one model (the same under every method), validated before anything runs."""

    def max_length(self, cells: List[Cell]) -> int:
        """The longest input any of ``cells`` feeds the model."""

    def needs_run(self, stored: Optional[dict]) -> bool:
        """Whether a stored record (or None) must be computed again."""

    def cell_key(self, record: dict) -> tuple:
        """The ``key`` of the cell a stored record was computed for."""

    def order(self, record: dict) -> tuple:
        """Sort key of records in reports."""

    def run(self, model: EvaluationModel, method: Scaling, cell: Cell) -> dict:
        """The record of one cell."""

    def log_line(self, record: dict) -> str:
        """One line about a finished cell."""

    def table(self, records: List[dict], rank) -> str:
        """The printed summary."""

    def report(self, outdir: str, records: List[dict], methods: Sequence[Scaling]) -> Optional[dict]:
        """Every file derived from the records; what ``results.json`` adds (``cells``:
        the records with derived fields; other sections), or None."""
