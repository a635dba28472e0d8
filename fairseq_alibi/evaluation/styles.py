"""One colour and one marker per context-extension method, the same in every plot and run.

A method is keyed by its ``--methods`` spelling (``none``, ``linear:2``, ``ntk``,
``cap:0.5``, ``log:1:0.5``, ...).  :data:`STYLES` fixes the known ones: a hue
family per method (the marker too), a shade per factor; any other spelling gets
its family's marker (or one chosen from its name) and a colour chosen from its
spelling by a hash, so it is stable from run to run as well.  Markers are drawn
hollow, so lines that lie on one another still show each method's shape.

Checkpoints are told apart by line style (:func:`line_styles`).  Position
methods (``examples/positions/report.py``) have a colour each
(:func:`position_colour`): its registry entry's ``colour`` (``core/positions.py``),
and for a method registered without one, one of its own by its place there.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, NamedTuple


class Style(NamedTuple):
    color: str
    marker: str


#: Marker of each method family (the known ones and those the core is adding).
MARKERS = {"none": "o", "linear": "s", "ntk": "^", "cap": "D", "log": "v", "power": "X", "capnorm": "P"}

#: The fixed styles: spelling -> (colour, marker).  Shades go darker with the factor;
#: the dynamic variants (spelled without a factor) take the family's darkest.
STYLES: Dict[str, Style] = {
    "none": Style("#000000", "o"),
    "linear:2": Style("#6baed6", "s"), "linear:4": Style("#3182bd", "s"), "linear:8": Style("#1c5a99", "s"),
    "linear": Style("#08306b", "s"),
    "ntk:2": Style("#74c476", "^"), "ntk:4": Style("#31a354", "^"), "ntk:8": Style("#1b7a3a", "^"),
    "ntk": Style("#00441b", "^"),
    "cap:0.5": Style("#fc9272", "D"), "cap": Style("#e6550d", "D"), "cap:2": Style("#cb181d", "D"),
    "cap:4": Style("#7f0000", "D"),
    "log": Style("#9e9ac8", "v"), "log:2": Style("#6a51a3", "v"), "log:1:0.5": Style("#3f007d", "v"),
    "power": Style("#1d91c0", "X"), "power:1:0.5": Style("#7fcdbb", "X"), "power:1:2": Style("#0c2c84", "X"),
    "capnorm": Style("#d8b365", "P"), "capnorm:2": Style("#8c510a", "P"),
}

#: Colours and markers for spellings outside :data:`STYLES` (none of them used there).
FALLBACK_COLORS = ("#e7298a", "#66a61e", "#7570b3", "#d95f02", "#1b9e77", "#a6761d", "#17becf", "#bcbd22",
                   "#8c564b", "#ff7f0e", "#9467bd", "#2ca02c")
FALLBACK_MARKERS = ("H", "h", "*", "p", "<", ">", "d", "8")


def _pick(spelling: str, choices, salt: str):
    digest = hashlib.sha256(f"{salt}:{spelling}".encode()).digest()
    return choices[int.from_bytes(digest[:4], "big") % len(choices)]


def canonical(spelling: str) -> str:
    """``linear:dynamic`` -> ``linear``, ``cap:1`` -> ``cap``, ``ntk:2.0`` -> ``ntk:2``
    (what ``Scaling`` spells); an unknown method is kept as written."""
    from ..core.errors import ScalingError
    from ..core.scaling import Scaling

    try:
        return Scaling.parse(spelling).spelling
    except (ScalingError, ValueError):
        return str(spelling).strip().lower()


def method_style(spelling: str) -> Style:
    """The colour and marker of the method spelled ``spelling``."""
    key = canonical(spelling)
    if key in STYLES:
        return STYLES[key]
    family = key.split(":", 1)[0]
    return Style(_pick(key, FALLBACK_COLORS, "color"), MARKERS.get(family) or _pick(key, FALLBACK_MARKERS, "marker"))


def cell_spelling(cell: dict) -> str:
    """The ``--methods`` spelling of a result cell (recorded; rebuilt for older cells)."""
    if cell.get("spelling"):
        return cell["spelling"]
    from ..core.errors import ScalingError
    from ..core.scaling import Scaling

    try:
        return Scaling(cell["method"], float(cell["factor"])).spelling
    except (ScalingError, ValueError, TypeError, KeyError):
        return str(cell.get("label") or cell.get("method"))


#: The line colour of fairseq's stock sinusoidal model (no registry entry; each method's is its entry's ``colour``).
SINUSOIDAL_COLOUR = "#7f7f7f"
#: Colours for position methods registered without one (tab10's rest, then tab20's light shades).
MORE_POSITION_COLOURS = ("#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
                         "#dbdb8d", "#9edae5")


def position_colour(name: str) -> str:
    """The line colour of position method ``name``, the same in every run: its registry
    entry's ``colour`` (``core/positions.py``); for an entry without one, the next of
    :data:`MORE_POSITION_COLOURS` no entry holds, in registry order (distinct while they
    last); for any other name one chosen from the name."""
    from ..core.positions import POSITIONS, SINUSOIDAL

    if name == SINUSOIDAL:
        return SINUSOIDAL_COLOUR
    if name in POSITIONS and POSITIONS[name].colour:
        return POSITIONS[name].colour
    held = {entry.colour for entry in POSITIONS.values()} | {SINUSOIDAL_COLOUR}
    free = [colour for colour in MORE_POSITION_COLOURS if colour not in held] or list(MORE_POSITION_COLOURS)
    unlisted = [p for p, entry in POSITIONS.items() if not entry.colour]
    if name in unlisted:
        return free[unlisted.index(name) % len(free)]
    return _pick(name, MORE_POSITION_COLOURS, "position")


LINE_STYLES = ("-", "--", ":", "-.")


def line_styles(checkpoints: Iterable[str]) -> Dict[str, str]:
    """A line style per checkpoint (solid, dashed, dotted, dash-dot, in sorted order)."""
    return {name: LINE_STYLES[i % len(LINE_STYLES)] for i, name in enumerate(sorted(set(checkpoints)))}


def plot_kwargs(cell: dict, linestyle: str = "-") -> dict:
    """``ax.plot`` keywords of a cell's line: its method's colour and hollow marker."""
    style = method_style(cell_spelling(cell))
    return dict(color=style.color, marker=style.marker, ms=5, mfc="none", mew=1.1, lw=1.2, ls=linestyle)
