"""Intervals (evaluation/intervals.py), the tables that show them and the plots'
styles, on small fixed samples: each checked against a computation written out
here (Wilson's formula, a resampling loop), by properties an interval must have,
and on the figures the reports produce (colours per method across runs, shared
axes, every line and band named).  No model runs here: the cells are built by hand.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import wilson_by_hand
from fairseq_alibi.evaluation import intervals, report, styles



@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (8, 10), (10, 10), (45, 60), (1, 1), (500, 1000)])
def test_wilson_is_its_formula(k, n):
    low, high = intervals.wilson(k, n)
    assert (low, high) == pytest.approx(wilson_by_hand(k, n), abs=1e-12)
    assert 0 <= low <= k / n <= high <= 1


def test_wilson_known_values_and_edges():
    assert intervals.wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # the textbook example
    assert intervals.wilson(0, 10)[0] == 0 and intervals.wilson(10, 10)[1] == 1
    assert intervals.wilson(0, 0) is None
    narrow, wide = intervals.wilson(80, 100), intervals.wilson(8, 10)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    with pytest.raises(ValueError):
        intervals.wilson(11, 10)


def windows(count: int, seed: int = 0):
    """Per-window summed losses (bits) and token counts, of varying sizes and difficulty."""
    rng = random.Random(seed)
    tokens = [rng.choice((16, 32, 32, 32)) for _ in range(count)]
    loss = [n * rng.uniform(3.0, 6.0) for n in tokens]
    return loss, tokens


def bootstrap_by_hand(loss, tokens, resamples, seed):
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(resamples):
        pick = rng.integers(0, len(loss), size=len(loss))
        stats.append(2.0 ** (sum(loss[i] for i in pick) / sum(tokens[i] for i in pick)))
    return tuple(np.percentile(stats, [2.5, 97.5]))


@pytest.mark.parametrize("block", [intervals._BLOCK, 100])  # all resamples in one draw, or two per draw
def test_bootstrap_equals_a_resampling_loop_with_the_same_seed(block, monkeypatch):
    monkeypatch.setattr(intervals, "_BLOCK", block)
    loss, tokens = windows(37)
    got = intervals.perplexity_interval(loss, tokens, resamples=300, seed=5)
    assert got == pytest.approx(bootstrap_by_hand(loss, tokens, 300, 5), rel=1e-12)
    assert got != pytest.approx(intervals.perplexity_interval(loss, tokens, resamples=300, seed=6), rel=1e-9)


def test_bootstrap_contains_the_estimate_and_narrows_with_more_windows():
    for seed in range(5):
        loss, tokens = windows(40, seed)
        point = 2.0 ** (sum(loss) / sum(tokens))
        low, high = intervals.perplexity_interval(loss, tokens)
        assert low < point < high
        more = intervals.perplexity_interval(*windows(640, seed))
        assert more[1] - more[0] < (high - low) / 2  # 16x the windows: about a quarter of the width
    same = [5.0 * 32] * 20
    assert intervals.perplexity_interval(same, [32] * 20) == pytest.approx((32.0, 32.0))
    assert intervals.perplexity_interval([], []) is None
    assert intervals.mean_interval([1.0, 2.0, 3.0, 4.0])[0] < 2.5 < intervals.mean_interval([1.0, 2.0, 3.0, 4.0])[1]


# ------------------------------------------------------------------ tables
def cell(checkpoint="m", method="none", factor=1.0, label="none", mode="nonoverlapping", length=32, seed=0,
         windows_kept=True, **extra):
    loss, tokens = windows(30, seed)
    mean = sum(loss) / sum(tokens)
    out = dict(checkpoint=checkpoint, method=method, factor=factor, label=label, mode=mode, length=length,
               stride=length if mode == "nonoverlapping" else 8, subset="valid", train_length=32, loss=mean,
               ppl=2.0 ** mean, tokens=sum(tokens), **extra)
    if windows_kept:
        out.update(window_loss=loss, window_tokens=tokens)
    return out


def rank(record):
    return {"none": 0, "linear": 1, "ntk": 2, "cap": 3}.get(record["method"], 9)


def test_perplexity_table_adds_the_interval_beside_the_unchanged_number():
    new, old = cell(seed=1), cell(length=64, seed=2, windows_kept=False)  # old: a results.json of before
    table = report.perplexity_table(report.with_ppl_intervals([new, old]), rank)
    row = next(line for line in table.splitlines() if line.startswith("| m | none |"))
    low, high = intervals.perplexity_interval(new["window_loss"], new["window_tokens"])
    assert f"| {new['ppl']:.2f} [{low:.1f}, {high:.1f}] | {old['ppl']:.2f} |" in row
    assert "95 % interval: bootstrap over windows" in table
    plain = report.perplexity_table([new], rank)  # without intervals: exactly the table of before
    assert f"| m | none | 32 | {new['ppl']:.2f} |" in plain and "[" not in plain


def test_retrieval_tables_show_wilson_and_prompt_bootstrap_intervals():
    cells = [dict(checkpoint="m", method="none", factor=1.0, label="none", train_length=32, task="lines",
                  length=64, depth=d, n=10, correct=k, answer_logprob=-1.5,
                  sample_logprob=[-1.0 - i / 10 for i in range(10)]) for d, k in ((0.25, 7), (0.75, 9))]
    table = report.retrieval_tables(cells, rank)
    low, high = intervals.wilson(16, 20)
    assert f"| m | none | 32 | 80 [{100 * low:.0f}, {100 * high:.0f}] |" in table
    lp_low, lp_high = intervals.mean_interval(cells[0]["sample_logprob"] * 2)
    assert f"| -1.50 [{lp_low:.2f}, {lp_high:.2f}] |" in table


# ------------------------------------------------------------------ plots
@pytest.fixture()
def figures(monkeypatch):
    """The figures the report functions produce, kept open for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def lines_by_label(fig):
    return {line.get_label(): line for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def sweep_cells(methods):
    out = []
    for method, factor, label in methods:
        for mode in ("nonoverlapping", "sliding"):
            for length in (32, 64, 128):
                out.append(cell(method=method, factor=factor, label=label, mode=mode, length=length,
                                seed=length + len(label), per_position=[4.0 - p / length for p in range(length)],
                                per_position_count=[3] * length))
    return out


def test_a_methods_colour_and_marker_stay_across_runs_and_panels_share_their_axes(figures, tmp_path):
    first = [("none", 1.0, "none"), ("linear", 2.0, "linear x2"), ("ntk", 0.0, "ntk dynamic"), ("cap", 1.0, "cap x1")]
    second = [("cap", 1.0, "cap x1"), ("linear", 2.0, "linear x2")]  # other methods, another order
    for methods in (first, second):
        cells = report.with_ppl_intervals(sweep_cells(methods))
        report.plot_perplexity(str(tmp_path / "ppl.png"), cells, rank)
        report.plot_per_position(str(tmp_path / "pos.png"), cells, rank)
    ppl_one, pos_one, ppl_two, pos_two = figures
    for a, b in ((ppl_one, ppl_two), (pos_one, pos_two), (ppl_one, pos_two)):
        for label in ("cap x1", "linear x2"):
            line_a = next(v for k, v in lines_by_label(a).items() if f": {label}" in k)
            line_b = next(v for k, v in lines_by_label(b).items() if f": {label}" in k)
            assert (line_a.get_color(), line_a.get_marker()) == (line_b.get_color(), line_b.get_marker())
    one = lines_by_label(ppl_one)
    assert len({(line.get_color(), line.get_marker()) for line in one.values()}) == len(one)  # none/cap/ntk apart
    for fig in (ppl_one, pos_one):
        left, right = fig.axes[:2]
        assert left.get_shared_y_axes().joined(left, right) and left.get_ylim() == right.get_ylim()


def test_every_line_band_and_mark_is_named(figures, tmp_path):
    cells = report.with_ppl_intervals(sweep_cells([("none", 1.0, "none"), ("ntk", 0.0, "ntk dynamic")]))
    report.plot_perplexity(str(tmp_path / "ppl.png"), cells, rank)
    report.plot_per_position(str(tmp_path / "pos.png"), cells, rank)
    ppl, pos = figures
    texts = [t.get_text() for t in ppl.axes[0].get_legend().get_texts()]
    assert "m: none" in texts and "training length: 32 tokens" in texts
    assert "shaded: 95 % interval: bootstrap over windows" in texts
    assert len(ppl.axes[0].collections) == 2  # one band per line
    band = ppl.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    ours = [c for c in cells if c["mode"] == "nonoverlapping" and c["method"] == "none"]
    assert min(band) == pytest.approx(min(c["ppl_low"] for c in ours)) and max(band) == pytest.approx(
        max(c["ppl_high"] for c in ours))
    texts = [t.get_text() for t in pos.axes[0].get_legend().get_texts()]
    assert "m: none (window 128, 3 windows)" in texts and "training length: 32 tokens" in texts
    assert "L=" not in " ".join(texts)
    assert "over every window that scored them" in pos._suptitle.get_text()


def test_retrieval_accuracy_plot_has_wilson_bars_named(figures, tmp_path):
    cells = [dict(checkpoint="m", method=m, factor=f, label=label, train_length=32, task="lines", length=n,
                  depth=0.5, n=10, correct=k, accuracy=k / 10, answer_logprob=-1.0)
             for m, f, label in (("none", 1.0, "none"), ("cap", 1.0, "cap x1")) for n, k in ((32, 9), (64, 4))]
    report.plot_retrieval_accuracy(str(tmp_path / "acc.png"), cells, rank)
    fig, = figures
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "bars: 95 % Wilson interval" in texts and "training length: 32 tokens" in texts
    low, high = intervals.wilson(4, 10)
    segments = [seg for coll in ax.collections for seg in coll.get_segments()]
    assert any(seg[0][1] == pytest.approx(100 * low) and seg[1][1] == pytest.approx(100 * high) for seg in segments)


def test_styles_are_a_fixed_table_with_a_stable_fallback():
    assert len(set(styles.STYLES.values())) == len(styles.STYLES)  # no two known methods alike
    assert styles.method_style("linear:dynamic") == styles.method_style("linear") == styles.STYLES["linear"]
    assert styles.method_style("cap:1") == styles.STYLES["cap"] and styles.method_style("ntk:2.0") == styles.STYLES["ntk:2"]
    unknown = styles.method_style("log:3:0.25")
    assert unknown == styles.method_style("log:3:0.25") and unknown.marker == styles.MARKERS["log"]
    assert unknown.color in styles.FALLBACK_COLORS and unknown.color not in {s.color for s in styles.STYLES.values()}
    assert styles.method_style("newmethod:2").marker in styles.FALLBACK_MARKERS
    assert styles.cell_spelling({"method": "cap", "factor": 0.5, "label": "cap x0.5"}) == "cap:0.5"
