"""Intervals (evaluation/intervals.py), paired comparisons (paired.py), the tables
that show them and the plots' styles, on small fixed samples: each checked against
a computation written out here (Wilson's formula, the t-interval, scipy's Student
t), by properties an interval must have (the same for any order or batching of the
windows), and on the figures the reports produce (colours per method across runs,
shared axes, every line and band named, the paired panel).  No model runs here:
the cells are built by hand.
"""

from __future__ import annotations

import csv
import random
import statistics

import pytest
from scipy import stats

from conftest import wilson_by_hand
from fairseq_alibi.evaluation import intervals, paired, report, styles
from fairseq_alibi.evaluation import perplexity as sweep



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
    loss = [round(n * rng.uniform(3.0, 6.0), 6) for n in tokens]
    return loss, tokens


def t_interval_by_hand(num, den, level=0.95):
    """The ratio estimator's t-interval written out: ratio, residuals, their variance."""
    n = len(num)
    ratio = sum(num) / sum(den)
    residual_var = sum((x - ratio * d) ** 2 for x, d in zip(num, den)) / (n - 1)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * (n * residual_var) ** 0.5 / sum(den)
    return ratio, ratio - half, ratio + half


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 10, 29, 30, 45, 299, 300, 301, 1000, 10 ** 6])
@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.99])
def test_t_quantile_is_students(df, level):
    assert intervals.t_value(df, level) == pytest.approx(stats.t.ppf(0.5 + level / 2, df), rel=1e-9)
    for t in (-3.0, -0.4, 0.0, 1.0, 2.5, 40.0) if df <= 300 else ():  # the series serves up to 300
        assert intervals.t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)


@pytest.mark.parametrize("count,seed", [(2, 0), (3, 1), (7, 2), (40, 3), (333, 4)])
def test_ratio_interval_is_the_t_interval_written_out(count, seed):
    loss, tokens = windows(count, seed)
    got = intervals.ratio_interval(loss, tokens, "window")
    ratio, low, high = t_interval_by_hand(loss, tokens)
    assert (got.value, got.low, got.high) == pytest.approx((ratio, low, high), rel=1e-12)
    assert got.n == count and got.reason is None
    ppl = intervals.perplexity_interval(loss, tokens)
    assert (ppl.value, ppl.low, ppl.high) == pytest.approx((2 ** ratio, 2 ** low, 2 ** high), rel=1e-12)
    values = [x / n for x, n in zip(loss, tokens)]  # a plain mean: the textbook s / sqrt(n)
    mean = intervals.mean_interval(values)
    half = stats.t.ppf(0.975, count - 1) * statistics.stdev(values) / count ** 0.5
    assert (mean.low, mean.high) == pytest.approx((statistics.mean(values) - half, statistics.mean(values) + half))


def reorderings(units, seed):
    """The same units in other orders and batchings: shuffled, reversed, sorted,
    and cut into batches of random sizes, scored in a random batch order."""
    rng = random.Random(seed)
    shuffled = units[:]
    rng.shuffle(shuffled)
    cuts = sorted(rng.sample(range(1, len(units)), min(4, len(units) - 1)))
    batches = [units[a:b] for a, b in zip([0] + cuts, cuts + [len(units)])]
    rng.shuffle(batches)
    yield from (shuffled, units[::-1], sorted(units), [u for batch in batches for u in reversed(batch)])


@pytest.mark.parametrize("count,seed", [(2, 5), (5, 6), (46, 7), (250, 8)])
def test_intervals_are_a_function_of_the_windows_not_their_order_or_batches(count, seed):
    loss, tokens = windows(count, seed)
    other, _ = windows(count, seed + 100)
    ppl = intervals.perplexity_interval(loss, tokens)
    change = intervals.paired_interval(loss, other, tokens)
    prompts = intervals.mean_interval(other)
    for order in reorderings(list(zip(loss, other, tokens)), seed):
        got_loss, got_other, got_tokens = map(list, zip(*order))
        assert intervals.perplexity_interval(got_loss, got_tokens) == ppl  # exactly, not approximately
        assert intervals.paired_interval(got_loss, got_other, got_tokens) == change
        assert intervals.mean_interval(got_other) == prompts


def test_one_window_or_windows_alike_have_no_interval_and_say_why():
    one = intervals.perplexity_interval([11.51 * 32 / 32 * 3.5], [32])
    assert one.low is None and one.high is None and one.interval is None and one.n == 1
    assert one.reason == "1 window: no interval"
    alike = intervals.perplexity_interval([160.0] * 4, [32] * 4)
    assert alike.interval is None and alike.value == 32.0 and alike.reason == "4 windows, all alike: no interval"
    assert intervals.mean_interval([-1.25]).reason == "1 prompt: no interval"
    assert intervals.perplexity_interval([], []) is None
    same = intervals.paired_interval([10.0, 20.0, 30.0], [10.0, 20.0, 30.0], [8, 8, 8])
    assert same.value == 1.0 and same.interval is None and same.reason == "identical on all 3 windows"


def test_intervals_contain_the_estimate_and_narrow_with_more_windows():
    for seed in range(5):
        loss, tokens = windows(40, seed)
        point = 2.0 ** (sum(loss) / sum(tokens))
        low, high = intervals.perplexity_interval(loss, tokens).interval
        assert low < point < high
        more = intervals.perplexity_interval(*windows(640, seed)).interval
        assert more[1] - more[0] < (high - low) / 2  # 16x the windows: about a quarter of the width


def test_paired_interval_is_the_t_interval_of_per_window_differences():
    """Two methods on the same windows: a shared difficulty per window and a small
    shift; the paired interval is the t-interval of the differences (written out
    here), excludes 1, and is far narrower than either cell's own interval."""
    rng = random.Random(11)
    tokens = [32] * 30
    difficulty = [32 * rng.uniform(3.0, 6.0) for _ in tokens]
    base = [round(d, 6) for d in difficulty]
    method = [round(d * 1.01 + rng.gauss(0, 0.3), 6) for d in difficulty]
    got = intervals.paired_interval(method, base, tokens)
    diffs = [a - b for a, b in zip(method, base)]
    ratio, low, high = t_interval_by_hand(diffs, tokens)
    assert (got.value, got.low, got.high) == pytest.approx((2 ** ratio, 2 ** low, 2 ** high), rel=1e-12)
    assert got.value == pytest.approx(2 ** (sum(method) / 960) / 2 ** (sum(base) / 960), rel=1e-12)
    assert 1.0 < got.low
    own = [intervals.perplexity_interval(x, tokens).interval for x in (method, base)]
    assert own[0][0] < own[1][1]  # the cells' own intervals overlap ...
    assert (got.high - got.low) < (own[0][1] - own[0][0]) / own[1][1] / 5  # ... the paired one is much narrower


# ------------------------------------------------------------------ tables
def cell(checkpoint="m", method="none", factor=1.0, label="none", mode="nonoverlapping", length=32, seed=0,
         windows_kept=True, count=30, text="text-1", **extra):
    """A perplexity cell of ``count`` windows (indices 0..count-1 in the text, in order;
    their token counts the text's, their losses drawn from ``seed``)."""
    _, tokens = windows(count, 0)
    rng = random.Random(seed)
    loss = [round(n * rng.uniform(3.0, 6.0), 6) for n in tokens]
    mean = sum(loss) / sum(tokens)
    out = dict(checkpoint=checkpoint, method=method, factor=factor, label=label, mode=mode, length=length,
               stride=length if mode == "nonoverlapping" else 8, subset="valid", train_length=32, loss=mean,
               ppl=2.0 ** mean, tokens=sum(tokens), **extra)
    if windows_kept:
        out.update(window_loss=loss, window_tokens=tokens, window_index=list(range(count)), text_digest=text)
    return out


def rank(record):
    return {"none": 0, "linear": 1, "ntk": 2, "cap": 3}.get(record["method"], 9)


def test_perplexity_table_adds_the_interval_or_says_why_there_is_none(tmp_path):
    new, old = cell(seed=1), cell(length=64, seed=2, windows_kept=False)  # old: a results.json of before
    single = cell(length=128, seed=3, count=1)
    cells = report.with_ppl_intervals([new, old, single])
    table = report.perplexity_table(cells, rank)
    row = next(line for line in table.splitlines() if line.startswith("| m | none |"))
    low, high = intervals.perplexity_interval(new["window_loss"], new["window_tokens"]).interval
    assert (f"| {new['ppl']:.2f} [{low:.1f}, {high:.1f}] | {old['ppl']:.2f} (no interval: no per-window losses "
            f"recorded) | {single['ppl']:.2f} (1 window: no interval) |") in row
    assert "95 % interval: Student t over windows" in table
    plain = report.perplexity_table([new], rank)  # without intervals: exactly the table of before
    assert f"| m | none | 32 | {new['ppl']:.2f} |" in plain and "[" not in plain
    report.write_csv(str(tmp_path / "results.csv"), cells, sweep.RESULT_FIELDS, sweep.FLOAT_FIELDS)
    rows = {int(r["length"]): r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert rows[128]["ppl_low"] == rows[128]["ppl_high"] == ""
    assert rows[128]["ppl_no_interval"] == "1 window: no interval"
    assert float(rows[32]["ppl_low"]) == pytest.approx(low, rel=1e-5) and rows[32]["ppl_no_interval"] == ""
    by_length = {c["length"]: c for c in cells}
    assert by_length[128]["ppl_low"] is None and by_length[128]["ppl_no_interval"] == "1 window: no interval"


def test_retrieval_tables_show_wilson_and_prompt_t_intervals_or_why_not():
    cells = [dict(checkpoint="m", method="none", factor=1.0, label="none", train_length=32, task="lines",
                  length=64, depth=d, n=10, correct=k, answer_logprob=-1.5,
                  sample_logprob=[-1.0 - i / 10 for i in range(10)]) for d, k in ((0.25, 7), (0.75, 9))]
    cells.append(dict(cells[0], length=128, depth=0.5, n=1, correct=1, answer_logprob=-0.75, sample_logprob=[-0.75]))
    table = report.retrieval_tables(cells, rank)
    low, high = intervals.wilson(16, 20)
    one_low, one_high = intervals.wilson(1, 1)
    assert f"| m | none | 32 | 80 [{100 * low:.0f}, {100 * high:.0f}] | 100 [{100 * one_low:.0f}, 100] |" in table
    values = cells[0]["sample_logprob"] * 2
    mean, half = statistics.mean(values), stats.t.ppf(0.975, 19) * statistics.stdev(values) / 20 ** 0.5
    assert f"| -1.50 [{mean - half:.2f}, {mean + half:.2f}] | -0.75 (1 prompt: no interval) |" in table


def test_percentages_near_0_or_100_are_not_shown_as_0_or_100():
    """Whole percent, but a value strictly between 0 and 100 never reads as either
    (199 of 200 was "100 [97, 100]", a perfect score it is not); the mean log-prob
    without per-prompt values says why it has no interval."""
    assert [report.percent_text(v) for v in (0.0, 100.0, 80.0, 99.5, 0.3, 99.96, 1e-9, 42.4)] == [
        "0", "100", "80", "99.5", "0.3", "99.96", "0.000000", "42"]
    low, high = intervals.wilson(199, 200)
    assert report._accuracy(199, 200) == f"99.5 [{100 * low:.0f}, {report.percent_text(100 * high)}]"
    assert float(report.percent_text(100 * high)) < 100
    assert report._accuracy(0, 10).startswith("0 [0, ") and report._accuracy(10, 10).endswith(", 100]")
    assert report._logprob(3, 4, -1.25, None) == "-1.25 (no interval: no per-prompt log-probs recorded)"


def test_non_finite_values_have_no_interval_and_say_why():
    for num, den, bad in (([1.0, float("nan")], [2, 2], "nan"), ([1.0, float("-inf")], [2, 2], "-inf"),
                          ([1.0, 2.0, 3.0], [2, float("inf"), 2], "inf")):
        estimate = intervals.ratio_interval(num, den, "window")
        assert estimate.low is None and estimate.high is None, estimate
        assert estimate.reason == f"a window of value {bad}: no interval"
    assert intervals.mean_interval([-1.0, float("-inf")]).value == float("-inf")


def test_a_precise_large_change_keeps_fixed_decimals():
    """A change of +12.3456% known to 1e-5 points reads as a number, not +1.2e+01%."""
    assert report.percent_change(1.123456, 1.12345, 1.12346, None) == "+12.34560% [+12.34500, +12.34600]"
    assert report.percent_change(1 + 1e-9, 1 - 1e-9, 1 + 3e-9, None) == "+1.0e-07% [-1.0e-07, +3.0e-07]"
    assert report.percent_change(1.0281, 1.021, 1.0352, None) == "+2.81% [+2.10, +3.52]"


# ------------------------------------------------------------------ paired comparisons
def permuted(c: dict, seed: int) -> dict:
    """The same cell with its windows listed in another order (another backend's or batching's)."""
    order = list(range(len(c["window_index"])))
    random.Random(seed).shuffle(order)
    return dict(c, **{k: [c[k][i] for i in order] for k in ("window_loss", "window_tokens", "window_index")})


def paired_by_hand(c: dict, base: dict):
    """ppl(c) / ppl(base) and its interval, windows matched by index, written out."""
    base_of = dict(zip(base["window_index"], base["window_loss"]))
    tokens_of = dict(zip(c["window_index"], c["window_tokens"]))
    diffs = [loss - base_of[i] for i, loss in zip(c["window_index"], c["window_loss"])]
    ratio, low, high = t_interval_by_hand(diffs, [tokens_of[i] for i in c["window_index"]])
    return 2 ** ratio, 2 ** low, 2 ** high


def test_paired_comparisons_match_windows_by_index_against_their_baselines():
    none, cap = cell(seed=1), cell(method="cap", factor=1.0, label="cap x1", seed=2)
    export = dict(cell(seed=3), checkpoint="export")  # another backend on the same text
    other_text = dict(cell(seed=4, text="text-2"), checkpoint="elsewhere")  # other windows: not compared
    lone = cell(checkpoint="solo", method="ntk", factor=0.0, label="ntk dynamic", seed=5)  # no none: ntk, baseline
    lone_cap = cell(checkpoint="solo", method="cap", factor=1.0, label="cap x1", seed=6)
    cells = [none, permuted(cap, 7), permuted(export, 8), other_text, lone, lone_cap]
    pairs = paired.comparisons(cells, rank)
    got = {(p["kind"], p["checkpoint"], p["label"], p["baseline_checkpoint"], p["baseline_label"]): p for p in pairs}
    expected = {("method", "m", "cap x1", "m", "none"): (cap, none),
                ("method", "solo", "cap x1", "solo", "ntk dynamic"): (lone_cap, lone),
                ("checkpoint", "m", "none", "export", "none"): (none, export),  # the first by name: export
                ("checkpoint", "solo", "cap x1", "m", "cap x1"): (lone_cap, cap)}
    assert set(got) == set(expected)
    for key, (c, base) in expected.items():
        p = got[key]
        assert (p["ppl_ratio"], p["ppl_ratio_low"], p["ppl_ratio_high"]) == pytest.approx(paired_by_hand(c, base),
                                                                                          rel=1e-12)
        assert p["windows"] == 30 and p["no_interval"] is None
    # in order: the same numbers (the pairing is by window, not by place in the list)
    again = paired.comparisons([none, cap, export, other_text, lone, lone_cap], rank)
    assert [(p["ppl_ratio"], p["ppl_ratio_low"]) for p in again] == [(p["ppl_ratio"], p["ppl_ratio_low"])
                                                                     for p in pairs]
    table = "\n".join(report.paired_tables(pairs, rank))
    p = got[("method", "m", "cap x1", "m", "none")]
    change = [100 * (p[k] - 1) for k in ("ppl_ratio", "ppl_ratio_low", "ppl_ratio_high")]
    assert f"| m | cap x1 vs none | 32 | {change[0]:+.2f}% [{change[1]:+.2f}, {change[2]:+.2f}] |" in table
    assert "| m vs export | none | 32 |" in table and "95 % paired t-interval over the shared windows" in table


def test_identical_cells_and_older_cells():
    none = cell(seed=1)
    same = dict(none, checkpoint="twin")
    older = dict(cell(seed=2, method="cap", factor=1.0, label="cap x1"), window_index=None, text_digest=None)
    pairs = paired.comparisons([none, same, older], rank)
    assert [(p["checkpoint"], p["ppl_ratio"], p["ppl_ratio_low"], p["no_interval"]) for p in pairs] == [
        ("twin", 1.0, None, "identical on all 30 windows")]  # the older cell records no window indices
    assert "| twin vs m | none | 32 | +0.00% (identical on all 30 windows) |" in "\n".join(
        report.paired_tables(pairs, rank))
    # a window that scored fewer tokens in one cell (infinite scores skipped) is left out of the pairs
    short = dict(same, window_tokens=[none["window_tokens"][0] - 1] + none["window_tokens"][1:])
    assert paired.paired_estimate(short, none).n == 29


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_every_line_band_and_mark_is_named(figures, tmp_path):
    cells = report.with_ppl_intervals(sweep_cells([("none", 1.0, "none"), ("ntk", 0.0, "ntk dynamic")]))
    report.plot_perplexity(str(tmp_path / "ppl.png"), cells, rank)
    report.plot_per_position(str(tmp_path / "pos.png"), cells, rank)
    ppl, pos = figures
    texts = [t.get_text() for t in ppl.axes[0].get_legend().get_texts()]
    assert "m: none" in texts and "training length: 32 tokens" in texts
    assert "bars: 95 % interval: Student t over windows" in texts
    assert len(ppl.axes[0].collections) == 2  # one set of bars per line
    bars = [seg for seg in ppl.axes[0].collections[0].get_segments()]
    ours = [c for c in cells if c["mode"] == "nonoverlapping" and c["method"] == "none"]
    assert [v for seg in sorted((seg[0][1], seg[1][1]) for seg in bars) for v in seg] == pytest.approx(
        [v for c in sorted(ours, key=lambda c: c["ppl_low"]) for v in (c["ppl_low"], c["ppl_high"])])
    texts = [t.get_text() for t in pos.axes[0].get_legend().get_texts()]
    assert "m: none (window 128, 3 windows)" in texts and "training length: 32 tokens" in texts
    assert "L=" not in " ".join(texts)
    assert "over every window that scored them" in pos._suptitle.get_text()


@pytest.mark.slow
def test_the_perplexity_plot_leads_with_the_paired_changes(figures, tmp_path):
    """Two methods whose own intervals overlap at every length while their paired change
    is far from 0: the top panel says so (bars of the paired interval, filled marks)."""
    cells = []
    for length in (32, 64):
        base = cell(length=length, seed=length)
        shifted = [round(x * 1.02, 6) for x in base["window_loss"]]  # 2 % more loss on every window
        mean = sum(shifted) / base["tokens"]
        cells += [base, dict(base, method="cap", factor=1.0, label="cap x1", window_loss=shifted, loss=mean,
                             ppl=2.0 ** mean)]
    cells = report.with_ppl_intervals(cells)
    pairs = paired.comparisons(cells, rank)
    report.plot_perplexity(str(tmp_path / "ppl.png"), cells, rank, pairs)
    report.plot_perplexity(str(tmp_path / "alone.png"), cells[:1], rank, paired.comparisons(cells[:1], rank))
    fig, alone = figures
    assert (tmp_path / "ppl.png").stat().st_size > 0 and len(alone.axes) == 1  # nothing to pair: no lower panel
    bottom, top = fig.axes  # bottom: the paired changes, which lead the figure (its top row)
    own = {c["method"]: (c["ppl_low"], c["ppl_high"]) for c in cells if c["length"] == 64}
    assert own["cap"][0] < own["none"][1]  # the intervals overlap ...
    assert "change against" in bottom.get_ylabel()
    texts = [t.get_text() for t in bottom.get_legend().get_texts()]
    assert "m: cap x1 vs none" in texts and "no difference" in texts
    assert "bars: 95 % paired t-interval over the shared windows" in texts
    assert "filled: the interval excludes 0 (a difference the windows show)" in texts
    segments = [seg for coll in bottom.collections for seg in coll.get_segments()]
    for p in pairs:  # ... the paired interval, drawn as a bar, excludes 0
        low, high = 100 * (p["ppl_ratio_low"] - 1), 100 * (p["ppl_ratio_high"] - 1)
        assert 0 < low and any(seg[0][1] == pytest.approx(low) and seg[1][1] == pytest.approx(high)
                               for seg in segments)
    filled = [line for line in bottom.get_lines() if line.get_label() == "_real"]
    assert [list(line.get_xdata()) for line in filled] == [[32, 64]]  # one line: not set apart
    assert filled[0].get_markerfacecolor() == filled[0].get_color()
    assert not any("without" in text for text in texts)
    one = report.with_ppl_intervals([cell(count=1), cell(method="cap", factor=1.0, label="cap x1", seed=3, count=1)])
    report.plot_perplexity(str(tmp_path / "one.png"), one, rank, paired.comparisons(one, rank))
    for ax in figures[-1].axes:  # one window: drawn without one, and said so
        what = "bar"
        assert f"a point without a {what}: no interval (results.md says why)" in [
            t.get_text() for t in ax.get_legend().get_texts()]


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
