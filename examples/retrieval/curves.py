"""Learning curves: the held-out loss of each training against its updates,
read from the recipe's ``train.log`` (fairseq's ``valid on 'valid' subset |
loss X ... | num_updates N`` lines), as a table and a plot.

A model that has not learned to retrieve sits on a loss plateau and leaves it
when its heads form (docs/results/retrieval-demo.md, "The recipe"): the curve says when, or that it has
not by the last update.  A run resumed from a copy (the staged trainings)
carries the earlier stages' lines in its log; where one update was validated
twice (a resumed run validates again at its checkpoint) the last value counts.

    python examples/retrieval/curves.py -c rope=outputs/adjlong12/rotary/seed48/rotary \\
        -c nope=outputs/adjlong12/nope/seed48/nope --output outputs/curves/adjacent

``-c NAME=PATH``: PATH a model's directory (its ``train.log``) or a log file.
Writes ``OUTPUT.md`` (also printed: the loss every ``--every`` updates) and
``OUTPUT.png`` (every validation).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict

from key_heads import named_checkpoints  # (this directory: the script's own)
from fairseq_alibi.evaluation.report import legend_outside, save_figure  # writes no file through a link

#: One validation line of fairseq-train's simple log format: the loss (base 2; "inf" or "nan" where a run
#: diverged, kept as such) and the update it was taken at.
VALID_LINE = re.compile(r"valid on 'valid' subset \| loss (\S+) \|.*?\| num_updates (\d+)")


class CurveError(Exception):
    """A log that cannot be read as a learning curve (the message says why and what to give)."""


def read_curve(path: str) -> Dict[int, float]:
    """``{update: held-out loss}`` of the log at ``path`` (or ``path/train.log``), the last value per update."""
    log = os.path.join(path, "train.log") if os.path.isdir(path) else path
    try:
        with open(log, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CurveError(f"cannot read {log}: {e.strerror or e}; give a model directory of the recipe "
                         "(its train.log) or a fairseq-train log") from None
    except UnicodeDecodeError as e:
        raise CurveError(f"{log} is not UTF-8 text ({e.reason} at byte {e.start}); give a fairseq-train log") \
            from None
    try:
        curve = {int(updates): float(loss) for loss, updates in VALID_LINE.findall(text)}
    except ValueError as e:
        raise CurveError(f"{log} has a validation line whose loss is not a number ({e}); give an unedited "
                         "fairseq-train log") from None
    if not curve:
        raise CurveError(f"{log} has no validation line (\"valid on 'valid' subset | loss ... | num_updates N\"); "
                         "give the log of a fairseq-train run that validated at least once")
    return dict(sorted(curve.items()))


def table(curves: Dict[str, Dict[int, float]], every: int) -> str:
    """Markdown: a row per multiple of ``every`` that some curve validated at (and each curve's last update), a
    column per curve; blank where a curve has no value there."""
    updates = sorted({u for c in curves.values() for u in c if u % every == 0} |
                     {max(c) for c in curves.values()})
    lines = ["| updates | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for u in updates:
        cells = [f"{c[u]:.3f}" if u in c else "" for c in curves.values()]
        lines.append(f"| {u:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(curves: Dict[str, Dict[int, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker=".", markersize=3, linewidth=1.2, label=name)
    ax.set_xlabel("updates")
    ax.set_ylabel("held-out loss (base 2)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend_outside(ax, fontsize=8)  # outside the data
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--curve", action="append", required=True, metavar="NAME=PATH",
                   help="a model directory (its train.log) or a fairseq-train log, under a name; repeatable")
    p.add_argument("--output", required=True, help="writes OUTPUT.md and OUTPUT.png")
    p.add_argument("--every", type=int, default=500, help="table rows every this many updates (default 500)")
    p.add_argument("--title", default="held-out loss against updates")
    args = p.parse_args(argv)
    if args.every < 1:
        p.error(f"--every must be at least 1, got {args.every}")
    curves: Dict[str, Dict[int, float]] = {}
    for name, path in named_checkpoints(p, args.curve, "--curve"):
        try:
            curves[name] = read_curve(path)
        except CurveError as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 1
    text = table(curves, args.every)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output + ".md", "w", encoding="utf-8") as f:
            f.write(f"{args.title}\n\n{text}\n")
        plot(curves, args.output + ".png", args.title)
    except OSError as e:
        print(f"error: cannot write {args.output}.md/.png: {e.strerror or e}; give an --output in a writable "
              "directory", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
