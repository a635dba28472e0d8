"""Paired comparisons of perplexity cells that scored the same windows.

Two cells of one mode, subset, stride and length that scored the same text
(the same ``text_digest``: the same tokens, window by window) are compared
window by window: the per-window differences of summed loss, over the windows'
tokens, give ``ppl_a / ppl_b`` and its paired t-interval
(``intervals.paired_interval``).  The text's own difficulty, which two separate
intervals both carry, cancels in each difference, so a difference can be far
from zero while the two cells' intervals overlap.

Which cells are compared (each row of the tables at most once per kind):

* ``method``: every method of a checkpoint against that checkpoint's
  baseline method at the same length: ``none`` where it was evaluated, else
  the first method of ``--methods``;
* ``checkpoint``: every checkpoint against the first checkpoint (in the
  tables' order, by name) that scored the same windows under the same method
  (a checkpoint beside its export; two models on one data directory).

Cells without per-window records (``window_index`` and ``text_digest``, of an
earlier version) are not compared.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

from . import intervals, styles

Rank = Callable[[dict], int]


def place(cell: dict) -> tuple:
    """Where a cell's windows come from: (mode, subset, stride, length)."""
    return (cell["mode"], cell["subset"], cell["stride"], cell["length"])


def comparable(cell: dict, base: dict) -> bool:
    """Whether two cells scored the same windows of the same text."""
    return (bool(cell.get("text_digest")) and cell.get("text_digest") == base.get("text_digest")
            and cell.get("window_index") is not None and base.get("window_index") is not None
            and place(cell) == place(base))


def paired_estimate(cell: dict, base: dict) -> Optional[intervals.Estimate]:
    """``ppl(cell) / ppl(base)`` over the windows both scored with the same tokens
    (windows are matched by their index in the text, not by their order)."""
    base_windows = {i: (loss, n) for i, loss, n in zip(base["window_index"], base["window_loss"],
                                                        base["window_tokens"])}
    pairs = [(loss, base_windows[i][0], n) for i, loss, n in zip(cell["window_index"], cell["window_loss"],
                                                                 cell["window_tokens"])
             if i in base_windows and base_windows[i][1] == n]
    if not pairs:
        return None
    return intervals.paired_interval(*zip(*pairs))


def baseline_methods(cells: Iterable[dict], rank: Rank) -> Dict[str, str]:
    """checkpoint -> the spelling of its baseline method: ``none`` if it was
    evaluated, else its first method in the ``--methods`` order."""
    spellings: Dict[str, List[dict]] = {}
    for cell in cells:
        spellings.setdefault(cell["checkpoint"], []).append(cell)
    out = {}
    for checkpoint, own in spellings.items():
        names = {styles.cell_spelling(c) for c in own}
        out[checkpoint] = "none" if "none" in names else styles.cell_spelling(min(own, key=rank))
    return out


def comparison(kind: str, cell: dict, base: dict, estimate: intervals.Estimate) -> dict:
    """The record of one paired comparison (``results.json``'s ``paired`` list)."""
    keep = ("checkpoint", "method", "factor", "alpha", "label", "spelling", "train_length", "mode", "subset",
            "stride", "length")
    out = {k: cell[k] for k in keep if k in cell}
    out.update(kind=kind, baseline_checkpoint=base["checkpoint"], baseline_label=base["label"],
               baseline_spelling=styles.cell_spelling(base), windows=estimate.n, ppl_ratio=estimate.value,
               ppl_ratio_low=estimate.low, ppl_ratio_high=estimate.high, no_interval=estimate.reason)
    return out


def comparisons(cells: List[dict], rank: Rank) -> List[dict]:
    """Every paired comparison of ``cells`` (see the module docstring), in the
    cells' order, method comparisons first."""
    baseline = baseline_methods(cells, rank)
    by_place: Dict[tuple, List[dict]] = {}
    for cell in cells:
        by_place.setdefault(place(cell), []).append(cell)
    method_rows, checkpoint_rows = [], []
    for cell in cells:
        spelling = styles.cell_spelling(cell)
        here = by_place[place(cell)]
        if spelling != baseline[cell["checkpoint"]]:
            base = next((c for c in here if c["checkpoint"] == cell["checkpoint"]
                         and styles.cell_spelling(c) == baseline[cell["checkpoint"]]), None)
            _add(method_rows, "method", cell, base)
        earlier = sorted((c for c in here if c["checkpoint"] < cell["checkpoint"]
                          and styles.cell_spelling(c) == spelling and comparable(cell, c)),
                         key=lambda c: c["checkpoint"])
        _add(checkpoint_rows, "checkpoint", cell, earlier[0] if earlier else None)
    return method_rows + checkpoint_rows


def _add(rows: List[dict], kind: str, cell: dict, base: Optional[dict]) -> None:
    if base is not None and comparable(cell, base):
        estimate = paired_estimate(cell, base)
        if estimate is not None:
            rows.append(comparison(kind, cell, base, estimate))
