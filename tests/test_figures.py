"""The figures as a reader sees them, on synthetic results: every method of the
registry has a colour of its own, log axes print plain numbers (64, 1024; not
2^6 or 6 x 10^1), no legend box covers a plotted point of any panel, the sweep's
figure leads with the paired changes, and the comparison's and the "which method"
figures draw every method the results hold, in registry order."""

import json
import os
import random
import re

import pytest

from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.evaluation import paired, report
from fairseq_alibi.evaluation.styles import position_colour
from test_compare import example
from test_intervals import figures  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


METHODS = [("none", 1.0, "none", "none"), ("linear", 2.0, "linear x2", "linear:2"), ("ntk", 0.0, "ntk dynamic", "ntk"),
           ("cap", 0.5, "cap x0.5", "cap:0.5"), ("cap", 1.0, "cap x1", "cap")]


def rank(record):
    return next((i for i, m in enumerate(METHODS) if (m[0], m[1]) == (record["method"], record["factor"])), 9)


def sweep_cells(modes=("nonoverlapping",)):
    """The demo's shape: an ALiBi checkpoint under every method, a sinusoidal one as trained,
    64 to 1024 tokens, every cell on the same windows (so that they pair)."""
    cells = []
    for mode in modes:
        for ckpt, methods in (("alibi", METHODS), ("sinusoidal", METHODS[:1])):
            for i, (method, factor, label, spelling) in enumerate(methods):
                for k, length in enumerate((64, 128, 256, 512, 1024)):
                    base = random.Random(length)
                    noise = random.Random(f"{ckpt}{label}{length}")
                    grow = 0.03 * i * k if ckpt == "alibi" else 0.2 * (k + 1)
                    loss = [round(length * (base.gauss(5.3, 0.4) + grow + noise.gauss(0, 0.02)), 6) for _ in range(12)]
                    mean = sum(loss) / (12 * length)
                    cells.append(dict(
                        checkpoint=ckpt, method=method, factor=factor, label=label, spelling=spelling, mode=mode,
                        length=length, stride=length if mode == "nonoverlapping" else length // 2, subset="valid",
                        train_length=64, loss=mean, ppl=2 ** mean, tokens=12 * length, window_loss=loss,
                        window_tokens=[length] * 12, window_index=list(range(12)), text_digest="t",
                        per_position=[4.0 - p / length for p in range(length)], per_position_count=[12] * length))
    return report.with_ppl_intervals(cells)


def comparison_results(path, names, seeds=(1, 2)):
    cells = [dict(checkpoint=f"{name}_s{seed}", label="none", mode="nonoverlapping", length=length,
                  length_ratio=length / 64, train_length=64, subset="valid", ppl=30.0 + i + seed + length / 256)
             for i, name in enumerate(names) for seed in seeds for length in (64, 256, 1024)]
    path.write_text(json.dumps({"cells": cells}))
    return cells


def every_figure(tmp_path, figures):
    """Every plotting function of the tools and examples, once each, on synthetic results."""
    cells = sweep_cells(("nonoverlapping", "sliding"))
    report.plot_perplexity(str(tmp_path / "ppl.png"), cells, rank, paired.comparisons(cells, rank))
    report.plot_per_position(str(tmp_path / "pos.png"), cells, rank)
    retrieval = [dict(checkpoint=ckpt, method=m, factor=f, label=label, train_length=64, task="lines", length=n,
                      depth=0.5, n=20, correct=k, accuracy=k / 20, answer_logprob=-1.0)
                 for ckpt in ("a", "b") for m, f, label, _ in METHODS for n, k in ((64, 19), (256, 12), (1024, 3))]
    report.plot_retrieval_accuracy(str(tmp_path / "acc.png"), retrieval, rank)
    positions = example("examples/positions/report.py")
    comparison_results(tmp_path / "results.json", ["sinusoidal", *POSITIONS])
    assert positions.main([str(tmp_path / "results.json"), "--output", str(tmp_path)]) == 0
    which = example("examples/positions/which_method.py")
    assert which.main([os.path.join(ROOT, "docs/results/which-method.csv"), "--output",
                       str(tmp_path / "which.png")]) == 0
    return list(figures)


def test_every_registered_method_has_a_colour_of_its_own():
    names = ["sinusoidal", *POSITIONS]
    colours = {name: position_colour(name) for name in names}
    assert len(set(colours.values())) == len(names), colours
    report_module = example("examples/positions/report.py")
    assert report_module.colours([(name, "none") for name in names]) == {(n, "none"): c for n, c in colours.items()}


@pytest.mark.slow
def test_log_axes_print_plain_numbers_and_no_legend_covers_a_point(tmp_path, figures):
    drawn = every_figure(tmp_path, figures)
    assert len(drawn) == 5
    plain = re.compile(r"^\d+(\.\d+)?$")
    seen = set()
    for fig in drawn:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
                if scale != "log":
                    continue
                texts = [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
                assert all(plain.match(t.replace("\N{MINUS SIGN}", "-")) for t in texts), texts
                seen.update(texts)
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        assert legends
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for ax in fig.axes:
                for x, y in points(ax):
                    assert not (box.x0 < x < box.x1 and box.y0 < y < box.y1), (legend.get_texts()[0].get_text(), x, y)
    assert {"64", "128", "1024"} <= seen


def points(ax):
    """Every plotted point of the axes, in display coordinates: lines' vertices, bars' ends, bands' edges, scatter."""
    import numpy as np

    out = []
    for line in ax.get_lines():
        xy = np.column_stack([line.get_xdata(orig=False), line.get_ydata(orig=False)]).astype(float)
        if len(xy) and line.get_label() not in ("no difference",) and not line.get_label().endswith("(no difference)"):
            out.append(line.get_transform().transform(xy))
    for collection in ax.collections:
        if hasattr(collection, "get_offsets") and len(collection.get_offsets()) and not collection.get_paths():
            out.append(collection.get_offset_transform().transform(collection.get_offsets()))
        for path in collection.get_paths():
            out.append(collection.get_transform().transform(path.vertices))
    flat = [tuple(p) for block in out for p in block if np.all(np.isfinite(p))]
    return [p for p in flat if ax.bbox.contains(*p)]  # a mark clipped away is not seen


@pytest.mark.slow
def test_the_sweep_figure_leads_with_the_paired_changes(tmp_path, figures):
    cells = sweep_cells()
    pairs = paired.comparisons(cells, rank)
    report.plot_perplexity(str(tmp_path / "ppl.png"), cells, rank, pairs)
    fig, = figures
    top, bottom = fig.axes
    assert "change against" in top.get_ylabel() and "perplexity" in bottom.get_ylabel()
    names = [line.get_label() for line in top.get_lines() if not line.get_label().startswith("_")]
    assert "sinusoidal vs alibi: none" in names and "alibi: cap x1 vs none" in names
    assert not any(type(c).__name__ == "FillBetweenPolyCollection" or type(c).__name__ == "PolyCollection"
                   for c in bottom.collections)  # no bands in the perplexity panel: one bar per cell
    xs = [tuple(line.get_xdata()) for line in bottom.get_lines() if not line.get_label().startswith("_")
          and ":" in line.get_label() and "training" not in line.get_label()]
    assert len(set(xs)) == len(xs)  # each line's bars set apart from the others'


@pytest.mark.slow
def test_the_comparison_figure_draws_every_method_of_the_results_and_redraws_from_its_table(tmp_path, figures):
    positions = example("examples/positions/report.py")
    names = ["sinusoidal", *POSITIONS]
    comparison_results(tmp_path / "results.json", list(reversed(names)))  # any order in the results
    assert positions.main([str(tmp_path / "results.json"), "--output", str(tmp_path)]) == 0
    again = tmp_path / "again"
    assert positions.main(["--table", str(tmp_path / "positions.csv"), "--output", str(again)]) == 0
    assert (again / "positions.png").stat().st_size > 0
    first, second = figures
    for fig in (first, second):
        top, bottom = fig.axes
        drawn = [(line.get_label(), line.get_color()) for line in bottom.get_lines()
                 if not line.get_label().startswith("_")]
        assert drawn == [(name, position_colour(name)) for name in names]
        changes = [text.get_text() for text in top.get_legend().get_texts()]
        assert changes == ["alibi (no difference)", *[n for n in names if n != "alibi"]]
    for a, b in zip(first.axes[1].get_lines(), second.axes[1].get_lines()):
        assert list(a.get_ydata()) == pytest.approx(list(b.get_ydata()), rel=1e-5)


def test_the_which_method_table_covers_every_method_and_its_figure_draws_each_point(tmp_path, figures):
    which = example("examples/positions/which_method.py")
    points_ = which.read(os.path.join(ROOT, "docs/results/which-method.csv"))
    assert {p["method"] for p in points_ if not p["variant"]} == {"sinusoidal", *POSITIONS}
    which.plot(str(tmp_path / "which.png"), points_)
    fig, = figures
    labels = [c.get_label() for c in fig.axes[0].collections if not c.get_label().startswith("_")]
    drawn = [p for p in which.order(points_) if which.has_numbers(p)]
    assert labels == [which.label(p) for p in drawn]
    unmeasured = [which.label(p) for p in which.order(points_) if not which.has_numbers(p)]
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert all(name in texts for name in unmeasured) and ("not yet measured" in texts) == bool(unmeasured)
    for collection, point in zip([c for c in fig.axes[0].collections if not c.get_label().startswith("_")],
                                 drawn):
        assert tuple(collection.get_edgecolor()[0][:3]) == pytest.approx(
            __import__("matplotlib").colors.to_rgb(position_colour(point["method"])))
    bad = tmp_path / "bad.csv"
    bad.write_text("method,variant\nalibi,\n")
    with pytest.raises(SystemExit, match="^error: cannot read .*ppl_16x"):
        which.main([str(bad)])
