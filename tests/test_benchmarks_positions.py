"""``benchmarks/positions_cost.py`` (the position methods' speed and memory
table): one tiny run (two methods, one attention dropout, one length: each run
is a fresh process), its report's structure and every ratio against the
medians it prints, its JSON against its report; the report of several columns
and tables from made-up measurements; the summaries against a naive
recomputation here; its argument errors; its memory measurement.  The
other position benchmarks (``train_throughput.py``, ``position_kernels.py``,
``fox_kernel.py`` and the learned-bias ones) on tiny settings."""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "benchmarks"))
import positions_cost  # noqa: E402
import train_throughput  # noqa: E402

SCRIPT = REPO / "benchmarks" / "positions_cost.py"
LENGTH = 16
# One attention dropout and one length, the fewest runs (every run is a fresh process);
# the report's several columns and tables are checked on measurements made up here.
TINY = ["--methods", "t5bias", "fire", "alibi+ssmax", "--attention-dropout", "0.1", "--repeats", "1", "--updates", "3", "--skip", "1",
        "--length", str(LENGTH), "--max-tokens", "64", "--layers", "1", "--embed-dim", "16", "--heads", "2",
        "--ffn", "32", "--eval-multiples", "4", "--eval-calls", "1"]
RATIO = re.compile(r"^(\S+) \[(\S+), (\S+)\]$")
#: A ratio column's header and the method whose row is its denominator.
BASES = {"/ sinusoidal": "sinusoidal", "/ ALiBi": "alibi"}


def ratio_columns(methods):
    return ["/ sinusoidal"] + ["/ ALiBi"] * ("alibi" in methods)


@pytest.fixture(scope="module")
def tiny_run(lm_data_bin, tmp_path_factory):
    """(stdout, JSON) of one tiny run on the suite's corpus."""
    out = tmp_path_factory.mktemp("positions_cost")
    result = run_cli([sys.executable, SCRIPT, *TINY, "--data", lm_data_bin, "--json", out / "cost.json",
                      "--markdown", out / "cost.md"], timeout=600)
    assert (out / "cost.md").read_text() in result.stdout
    return result.stdout, json.loads((out / "cost.json").read_text())


def tables(markdown: str):
    """``{title: [row cells]}`` of every ``### title`` followed by a Markdown table (header row first)."""
    found, title = {}, None
    for line in markdown.splitlines():
        if line.startswith("### "):
            title = line[4:]
            found[title] = []
        elif line.startswith("|") and title and not line.startswith("|---"):
            found[title].append([cell.strip() for cell in line.strip("|").split("|")])
    return found


def half_unit(text: str) -> float:
    """Half a unit of the last printed digit: the rounding of a printed value."""
    return 0.5 * 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)


def assert_printed_ratio(value: str, base: str, ratio: str) -> None:
    """``ratio`` is ``value / base`` to the rounding of all three printed numbers."""
    v, b, r = float(value), float(base), float(ratio)
    dv, db, dr = half_unit(value), half_unit(base), half_unit(ratio)
    assert (v - dv) / (b + db) - dr <= r <= (v + dv) / (b - db) + dr, (value, base, ratio)


def check_report(markdown: str, methods, dropouts, multiples, repeats: int) -> int:
    """The report's tables (rows, columns, titles) and every ``ratio [low, high]``
    against the printed medians; the number of ratios checked."""
    found = tables(markdown)
    train = [t for t in found if t.startswith("Training")]
    evals = [t for t in found if t.startswith("Evaluation")]
    assert len(train) == 1 and len(evals) == len(multiples)
    assert found[train[0]][0] == ["method"] + [c for d in dropouts for c in [f"wps, attention dropout {float(d)}"]
                                               + ratio_columns(methods)]
    for title, multiple in zip(evals, multiples):
        assert f"{multiple * LENGTH} tokens ({multiple}x L)" in title
        assert found[title][0] == ["method", "keys read"] + [c for name in ("seconds", "peak MiB", "own MiB")
                                                             for c in [name] + ratio_columns(methods)]
    checked = 0
    for title in train + evals:
        header, rows = found[title][0], found[title][1:]
        assert [row[0] for row in rows] == methods and all(len(row) == len(header) for row in rows)
        for column in (i for i, name in enumerate(header) if name in BASES):
            value_column = max(i for i in range(column) if header[i] not in BASES)
            base = rows[methods.index(BASES[header[column]])][value_column]
            for row in rows:
                if row[1].startswith("not run: "):
                    assert set(row[2:]) == {"-"}
                    continue
                if row[column] == "-":  # no ratio only where the baseline's median is 0
                    assert float(base) == 0, (title, row)
                    continue
                ratio, low, high = RATIO.match(row[column]).groups()
                assert_printed_ratio(row[value_column], base, ratio)
                if repeats % 2:  # an odd count: the medians' ratio lies within the pairs' range
                    assert float(low) <= float(ratio) <= float(high), (title, row)
                if repeats == 1:  # one pair, the medians' own ratio
                    assert low == high == ratio, (title, row)
                checked += 1
    return checked


@pytest.mark.slow
def test_tiny_run_report(tiny_run):
    stdout, data = tiny_run
    assert f"Command: `python benchmarks/positions_cost.py {' '.join(TINY)}" in stdout
    assert re.search(r"\(code: commit [0-9a-f]{7,}( with uncommitted changes)?\)$", stdout.splitlines()[2])
    assert data["code"] in stdout.splitlines()[2]
    host = next(line for line in stdout.splitlines() if line.startswith("Host: "))
    assert f"torch {torch.__version__}" in host and "1 thread(s) per run" in host and "load average" in host
    assert check_report(stdout, ["sinusoidal", "t5bias", "fire", "alibi+ssmax"], ["0.1"], [4], repeats=1) >= 6
    assert positions_cost.KEYS_READ_NOTE in stdout
    # FIRE's threshold from its run's log, each counted update's (3 updates, 1 skipped: 2), and only FIRE's
    ((first, last),) = re.findall(r"^- fire, attention dropout 0\.1: (\S+) -> (\S+); \d of 2 counted updates below",
                                  stdout, re.M)
    (run,) = data["train"]["0.1"]["fire"]["fire_threshold"]
    assert len(run) == 2 and (first, last) == (f"{run[0]:.2f}", f"{run[-1]:.2f}")
    assert abs(run[0] - LENGTH) < 0.5  # starts at the training length (a few warm-up steps of lr ~1e-5 move it)
    assert all("fire_threshold" not in entry for m, entry in data["train"]["0.1"].items() if m != "fire")
    assert data["threads"] == 1 and data["torch"] == torch.__version__ and set(data["train"]) == {"0.1"}


@pytest.mark.slow
def test_json_holds_what_the_report_prints(tiny_run):
    stdout, data = tiny_run
    assert data["markdown"] in stdout
    for drop, methods in data["train"].items():
        for method, entry in methods.items():
            assert len(entry["values"]) == 1 and entry["median"] == entry["values"][0] > 0
            assert entry["ratio"] == pytest.approx(entry["median"] / methods["sinusoidal"]["median"], rel=1e-12)
            assert positions_cost.significant(entry["median"]) in stdout
    for length, result in data["eval"].items():
        for method, cells in result["cells"].items():
            (cell,) = cells
            assert cell["seconds"] == statistics.median(cell["calls"]) > 0
            assert cell["own_mib"] == cell["peak_mib"] - cell["ready_mib"] >= 0
            assert result["compared"]["peak_mib"][method]["median"] == cell["peak_mib"]
            # 64 tokens: SDPA's one call scores every causal pair; stock attention the whole square, and so does
            # FIRE's chunked kernel (its inference at any length), one block of 64 queries
            assert cell["keys_read"] == (2 * 64 / 65 if method in ("sinusoidal", "fire") else 1.0)
            assert f"| {method} | {positions_cost.significant(cell['keys_read'])} |" in stdout


def made_up_measurements(methods, dropouts, multiples, repeats, rng):
    """``train`` and ``evaluation`` as the script builds them, from random values
    (the last method's longest cells all failed)."""
    def compare(scale):
        return positions_cost.compared({m: [rng.uniform(0.5, 2) * scale for _ in range(repeats)] for m in methods})

    train = {str(float(d)): compare(5000) for d in dropouts}
    evaluation = {str(m * LENGTH): {"compared": {k: compare(s) for k, s in (("seconds", 0.3), ("keys_read", 1.0),
                                                                           ("peak_mib", 400), ("own_mib", 50))},
                                    "not_run": {}}
                  for m in multiples}
    evaluation[str(multiples[-1] * LENGTH)]["not_run"] = {methods[-1]: "exit 1: out of memory"}
    return train, evaluation


@pytest.mark.parametrize("repeats", [2, 3])
def test_report_of_several_columns_and_tables(repeats):
    opts = positions_cost.parse_args(["--length", str(LENGTH), "--repeats", str(repeats)])
    opts.vocab = 100
    train, evaluation = made_up_measurements(opts.methods, (0, 0.1), (8, 64), repeats, random.Random(repeats))
    markdown = positions_cost.render(opts, "python benchmarks/positions_cost.py", [1.0, 2.0], train, evaluation)
    checked = check_report(markdown, opts.methods, ["0", "0.1"], [8, 64], repeats)
    n = len(opts.methods)  # every registered method and the sinusoidal baseline, each with / sinusoidal and / ALiBi
    assert checked == 2 * (n * 2 + n * 3 + (n - 1) * 3)  # training, the first length, the second less a failed row
    assert f"| {opts.methods[-1]} | not run: exit 1: out of memory |" in markdown


def test_keys_read_counts_the_pairs_each_kernel_scores():
    """The evaluation cells' "keys read": over the attention calls of one
    forward, ``kernels.keys_read`` of each chunked call (ALiBi's windows, with
    the call's own queries and keys) weighted by its causal pairs, 1 for
    SDPA's calls; a forward that calls none of the kernels (the stock
    sinusoidal model) the full square's ``2T / (T + 1)``; the kernels restored."""
    import position_kernels
    from fairseq_alibi.core import kernels

    gen = torch.Generator().manual_seed(0)
    calls = {}
    for method, length in (("alibi", 2048), ("nope", 2048), ("alibi", 300)):
        case = position_kernels.Case(method, 4, 8, 64)
        q, k, v = (torch.randn(1, 4, length, 8, generator=gen) for _ in range(3))
        bias, _ = case.layers[0].bind(torch.zeros(length, 1, 32), None, None)
        calls[method, length] = (bias, q, k, v)

    def forward(*which):
        def run(x):
            with torch.no_grad():
                for key in which:
                    bias, q, k, v = calls[key]
                    kernels.attend(q, k, v, bias, "auto")
        return run

    real = dict(kernels.KERNELS)
    alibi, q, k, _ = calls["alibi", 2048]
    expected = kernels.keys_read(alibi, q, k)
    assert expected < 0.9  # the steep heads' windows skip keys at 2,048 tokens (32x L)
    x = torch.zeros(1, 2048)
    assert positions_cost.keys_read(forward(("alibi", 2048)), x) == pytest.approx(expected, rel=1e-12)
    assert positions_cost.keys_read(forward(("nope", 2048)), x) == 1.0
    pairs = {n: 4 * n * (n + 1) // 2 for n in (2048, 300)}
    with torch.no_grad():
        assert kernels.choose_kernel("auto", calls["alibi", 300][0], False, 300, 300) == "sdpa"
    short = 1.0  # a short call: SDPA with the dense bias scores every causal pair
    both = positions_cost.keys_read(forward(("alibi", 2048), ("alibi", 300)), x)
    assert both == pytest.approx((expected * pairs[2048] + short * pairs[300]) / sum(pairs.values()), rel=1e-12)
    assert positions_cost.keys_read(forward(), x) == 2 * 2048 / 2049
    assert kernels.KERNELS == real


def test_fire_threshold_lines_count_the_updates_below_l_minus_1(tmp_path):
    """The training table's note on FIRE's threshold: each repeat's first and
    last counted value from the JSON log (``logged_scalar``, lines without
    the key skipped), and the counted updates whose value was below L - 1,
    where FIRE's training takes its block-by-block path."""
    log = tmp_path / "fire.log"
    lines = [{"wps": "100"}] + [{"wps": "100", "fire_threshold": str(v)} for v in (16.0, 15.2, 14.99, 14.5)]
    log.write_text("".join(f"2026-12-02 | INFO | train_inner | {json.dumps(stats)}\n" for stats in lines)
                   + "2026-12-02 | INFO | train | {\"fire_threshold\": \"3.0\"}\n")  # the epoch's line: not an update
    assert positions_cost.logged_scalar(str(log), "fire_threshold") == [16.0, 15.2, 14.99, 14.5]
    opts = positions_cost.parse_args(["--length", "16"])
    train = {"0.0": {"fire": {"fire_threshold": [[15.2, 14.99, 14.5], None]}, "alibi": {}}}
    lines = positions_cost.threshold_lines(opts, train)
    assert "L - 1 = 15" in lines[1]
    assert lines[-1] == "- fire, attention dropout 0.0: 15.20 -> 14.50; 2 of 3 counted updates below L - 1."
    assert positions_cost.threshold_lines(opts, {"0.0": {"alibi": {}}}) == []


def naive_compared(per_repeat, reference="sinusoidal"):
    base = [v for v in per_repeat[reference] if v is not None]
    out = {}
    for method, values in per_repeat.items():
        done = [v for v in values if v is not None]
        pairs = [v / b for v, b in zip(values, per_repeat[reference]) if v is not None and b is not None]
        out[method] = (statistics.median(done), statistics.median(done) / statistics.median(base),
                       (min(pairs), max(pairs)))
    return out


def test_compared_against_a_naive_recomputation():
    rng = random.Random(3)
    for repeats in (1, 2, 3, 4, 5):
        per_repeat = {m: [rng.uniform(10, 1000) for _ in range(repeats)] for m in ("sinusoidal", "t5bias", "alibi")}
        per_repeat["alibi"][0] = None  # a failed cell: left out of the median and of the pairs
        if repeats == 1:
            per_repeat["alibi"] = [1.0]
        got = positions_cost.compared(per_repeat)
        for method, (median, ratio, (low, high)) in naive_compared(per_repeat).items():
            assert got[method]["median"] == pytest.approx(median, rel=1e-12)
            assert got[method]["ratio"] == pytest.approx(ratio, rel=1e-12)
            assert got[method]["range"] == pytest.approx([low, high], rel=1e-12)
        for method, (_, ratio, (low, high)) in naive_compared(per_repeat, "alibi").items():
            assert got[method]["per_alibi"]["ratio"] == pytest.approx(ratio, rel=1e-12)
            assert got[method]["per_alibi"]["range"] == pytest.approx([low, high], rel=1e-12)
    assert "per_alibi" not in positions_cost.compared({"sinusoidal": [1.0], "t5bias": [2.0]})["t5bias"]


@pytest.mark.parametrize("value", [0.000123456, 0.0123456, 1.23456, 12.3456, 999.96, 12345.6, 1234567.0])
def test_significant_keeps_four_digits_without_an_exponent(value):
    text = positions_cost.significant(value)
    assert "e" not in text
    assert abs(float(text) - value) <= half_unit(text) * (1 + 1e-9)
    assert half_unit(text) <= 5e-4 * value  # at least 4 significant digits
    assert math.isclose(float(text), value, rel_tol=5e-4)


@pytest.mark.parametrize("args,message", [
    (["--updates", "3", "--skip", "3"], "--skip must be in 1 .. 2 (fewer than --updates 3; fairseq logs the first "
                                        "update's words/s as 0), got 3"),
    (["--skip", "0"], "--skip must be in 1 .. 29"),  # the first update's 0 words/s halved a 2-update median
    (["--repeats", "0"], "argument --repeats: must be a positive integer, got 0"),
    (["--attention-dropout", "0", "1"], "--attention-dropout takes probabilities in [0, 1), got 0.0 1.0"),
    (["--methods", "learned"], "argument --methods: invalid choice: 'learned'"),
    (["--methods", "alibi", "rnope", "--layers", "1"], "--methods rnope with --layers 1: rnope needs at least 2 layers"),
    (["--attention-dropout", "--eval-multiples"], "nothing to measure: give --attention-dropout (training) or"),
    (["--memory-only", "--eval-multiples"], "--memory-only measures evaluation cells: give --eval-multiples a value"),
    (["--embed-dim", "250", "--heads", "4"], "--embed-dim 250 must be a multiple of --heads 4 (each head gets"),
    (["--max-tokens", "10"], "--max-tokens 10 must be at least --length 64: an update holds whole samples"),
] + [(["train_throughput", *args], message) for args, message in [
    (["--embed-dim", "100", "--heads", "3"], "--embed-dim 100 must be a multiple of --heads 3 (each head gets "
                                             "embed-dim / heads dimensions): give, for instance, --embed-dim 99"),
    (["--attention-dropout", "1"], "--attention-dropout takes probabilities in [0, 1), got 1.0"),
    (["--vocab", "4"], "--vocab must be at least 5"),
    (["--rounds", "0"], "argument --rounds: must be a positive integer, got 0"),
    (["--warmup", "-1"], "--warmup must be 0 or more, got -1"),
    (["--methods", "all", "rnope", "--layers", "1"], "--methods rnope with --layers 1: rnope needs at least 2 layers"),
]])
def test_bad_arguments_are_one_error_line(args, message, capsys):
    """positions_cost's, and train_throughput's where the arguments start with its name."""
    script = train_throughput if args[:1] == ["train_throughput"] else positions_cost
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(args[1:] if script is train_throughput else args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize("script,args", [(positions_cost, []), (train_throughput, ["--methods", "all"])])
def test_a_default_method_too_deep_for_the_layers_is_left_out_and_reported(script, args, capsys):
    """The issue's own command has one layer, which RNoPE (a hybrid: RoPE and
    NoPE layers) cannot have: from the defaults it is left out, said on stderr
    and in the report, and every other method stays; named, it is an error
    (test_bad_arguments_are_one_error_line)."""
    opts = script.parse_args(args + ["--layers", "1"])
    assert "rnope" not in opts.methods and list(opts.left_out) == ["rnope"]
    assert set(opts.methods) == {positions_cost.BASELINE, *positions_cost.DEFAULT_METHODS} - {"rnope"}
    assert "note: rnope left out: --methods rnope with --layers 1: rnope needs at least 2 layers" in \
        capsys.readouterr().err
    blank, paragraph = positions_cost.left_out_lines(opts)
    assert blank == "" and paragraph.startswith(
        "Left out of the default methods: rnope (--methods rnope with --layers 1: rnope needs at least 2 layers")
    if script is positions_cost:
        opts.vocab = 100
        _, evaluation = made_up_measurements(opts.methods, (), (8,), 1, random.Random(0))
        markdown = positions_cost.render(opts, "cmd", [1.0, 1.0], {}, evaluation)
        assert "Left out of the default methods: rnope (" in markdown and "| rnope |" not in markdown
    deep = script.parse_args(args + ["--layers", "2"])
    assert "rnope" in deep.methods and deep.left_out == {} and positions_cost.left_out_lines(deep) == []


def test_a_failed_training_run_is_one_error_line_and_keeps_its_log(tmp_path, monkeypatch, capsys):
    """A run that fails mid-benchmark (here a stand-in for alibi-train that
    says why on stderr) stops the benchmark with exit 1 and one ``error:``
    line quoting the run's own, not a traceback; its log stays."""
    (tmp_path / "dict.txt").write_text("w0 1\nw1 1\n")
    failing = [sys.executable, "-c", "import sys; print('loading'); print('alibi-train: error: the options do not "
               "fit', file=sys.stderr); sys.exit(1)", "--arch", "transformer_lm"]
    monkeypatch.setattr(positions_cost, "train_command", lambda *args: failing)
    keep = tmp_path / "keep"
    code = positions_cost.main(["--methods", "alibi", "--attention-dropout", "0", "--eval-multiples", "--repeats",
                                "1", "--data", str(tmp_path), "--keep", str(keep)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    log = keep / "sinusoidal_ad0.0_0.log"
    assert code == 1 and errors == [
        f"error: {os.path.basename(sys.executable)} --arch transformer_lm failed (exit 1): alibi-train: error: the "
        f"options do not fit (its log: {log})"]
    assert "loading" in log.read_text()


def test_no_evaluation_length_is_training_only():
    assert positions_cost.parse_args(["--eval-multiples"]).eval_multiples == []


def test_no_attention_dropout_is_evaluation_only():
    opts = positions_cost.parse_args(["--attention-dropout", "--length", str(LENGTH)])
    opts.vocab = 100
    _, evaluation = made_up_measurements(opts.methods, (), (8,), 1, random.Random(0))
    markdown = positions_cost.render(opts, "python benchmarks/positions_cost.py", [1.0, 2.0], {}, evaluation)
    assert "### Training" not in markdown and "### Evaluation" in markdown


def test_memory_only_cells_report_memory_and_no_time(monkeypatch):
    opts = positions_cost.parse_args(["--attention-dropout", "--memory-only", "--eval-multiples", "8", "--length",
                                      str(LENGTH), "--methods", "alibi", "fire"])
    opts.vocab = 100
    own = {"sinusoidal": 5.0, "alibi": 20.0, "fire": 40.0}
    monkeypatch.setattr(positions_cost, "measure_cell", lambda opts, method, length, dict_dir: {
        "peak_mib": 300 + own[method], "ready_mib": 300.0, "own_mib": own[method], "memory_basis": "VmHWM"})
    evaluation = positions_cost.measure_evaluation(opts, "unused", time.time())
    markdown = positions_cost.render(opts, "cmd", [1.0, 1.0], {}, evaluation)
    (row,) = [cells for title, cells in tables(markdown).items()]
    assert row[0] == ["method", "keys read", "seconds", "/ sinusoidal", "/ ALiBi", "peak MiB", "/ sinusoidal",
                      "/ ALiBi", "own MiB", "/ sinusoidal", "/ ALiBi"]
    fire = row[3][1:]  # after the keys read
    assert row[3][:5] == ["fire", "-", "-", "-", "-"]  # no keys read (counted by a timed forward), no time
    assert fire[4] == "340.0" and fire[7] == "40.00" and fire[8].startswith("8.000 [")  # own / the baseline's 5
    assert fire[9].startswith("2.000 [")  # own / ALiBi's 20
    assert evaluation[str(8 * LENGTH)]["not_run"] == {} and positions_cost.NO_RESET_NOTE not in markdown
    assert positions_cost.KEYS_READ_NOTE not in markdown
    evaluation[str(8 * LENGTH)]["memory_basis"] = ["ru_maxrss"]  # a system without /proc/self/clear_refs
    assert positions_cost.NO_RESET_NOTE in positions_cost.render(opts, "cmd", [1.0, 1.0], {}, evaluation)


#: What a memory cell does, in a fresh process with the cells' allocator settings: a
#: transient 96 MiB before (freed), then ``memory_of`` a call that holds 48 MiB, and one that holds nothing.
MEMORY_CELL = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import positions_cost
def touched(mib):
    return torch.ones(mib * 2**20 // 4)  # float32, every page written
earlier = touched(96)
del earlier
print(json.dumps([positions_cost.memory_of(lambda: touched(48).sum()), positions_cost.memory_of(lambda: None)]))
"""


def _can_reset_peak() -> bool:
    try:
        positions_cost.status_mib("VmHWM")
    except OSError:
        return False
    return positions_cost.reset_peak()


@pytest.mark.skipif(not _can_reset_peak(), reason="this system cannot reset the high-water mark through "
                    "/proc/self/clear_refs (the fallback, ru_maxrss, has its own test)")
def test_a_method_measured_in_some_repeats_only_says_so_in_its_row(monkeypatch):
    """Its median is over the repeats it has: the row names how many and why not the
    others (it looked like every other row, its median over fewer repeats)."""
    opts = positions_cost.parse_args(["--attention-dropout", "--eval-multiples", "8", "--length", str(LENGTH),
                                      "--methods", "alibi", "t5bias", "--repeats", "3"])
    opts.vocab = 100
    calls = []

    def cell(opts, method, length, dict_dir):
        calls.append(method)
        if method == "t5bias" and calls.count("t5bias") == 2:
            return {"failed": "exit 1: out of memory"}
        return {"seconds": 1.0, "keys_read": 1.0, "peak_mib": 300.0, "ready_mib": 250.0, "own_mib": 50.0,
                "memory_basis": "VmHWM"}

    monkeypatch.setattr(positions_cost, "measure_cell", cell)
    evaluation = positions_cost.measure_evaluation(opts, "unused", time.time())
    assert evaluation[str(8 * LENGTH)]["partial"] == {"t5bias": "2 of 3 repeats; exit 1: out of memory"}
    markdown = positions_cost.render(opts, "cmd", [1.0, 1.0], {}, evaluation)
    (rows,) = tables(markdown).values()
    assert [r[0] for r in rows[1:]] == ["sinusoidal", "alibi", "t5bias (2 of 3 repeats; exit 1: out of memory)"]


def test_a_cell_is_given_the_run_s_sizes_and_a_training_update_whole_samples():
    """A cell re-parses the run's options: given --max-tokens too, a length above the
    default 2048 is accepted (every cell failed there); training updates hold
    max_tokens // L whole samples (fairseq's batch multiple of 8 cut 20 to 16)."""
    opts = positions_cost.parse_args(["--length", "4096", "--max-tokens", "4096", "--attention-dropout", "0",
                                      "--eval-multiples", "1", "--methods", "alibi"])
    opts.vocab = 100
    cell = positions_cost.cell_command(opts, "alibi", 4096, "unused")
    assert positions_cost.parse_args(cell[2:]).max_tokens == 4096
    train = positions_cost.train_command("data", "alibi", opts, 0.0)
    assert train[train.index("--required-batch-size-multiple") + 1] == "1"
    opts.length, opts.max_tokens = 100, 2048
    assert "training 2000 tokens per update (20 samples)" in "\n".join(positions_cost.header(opts, "cmd", [0, 0]))


def test_memory_of_counts_what_the_calls_hold_not_an_earlier_peak():
    """A call that holds 48 MiB at once adds about 48 MiB, in a process whose
    high-water mark was raised by 96 MiB before (freed since): read from
    ``ru_maxrss`` alone, as the cells did before, that earlier peak hides it.
    In a fresh process with the cells' allocator settings, as a cell runs it
    (a warm process's heap may serve the call from pages it already holds)."""
    # a new interpreter (not run_cli's fork of a warm one): glibc reads the setting when it starts
    result = subprocess.run([sys.executable, "-c", MEMORY_CELL, str(REPO / "benchmarks")], capture_output=True,
                            text=True, timeout=300, env={**os.environ, **positions_cost.MEASURED_ALLOCATOR})
    assert result.returncode == 0, result.stderr[-2000:]
    held, idle = json.loads(result.stdout.strip().splitlines()[-1])
    assert held["memory_basis"] == idle["memory_basis"] == "VmHWM"
    assert held["own_mib"] == held["peak_mib"] - held["ready_mib"]
    assert 44 <= held["own_mib"] <= 56, held
    assert idle["own_mib"] < 4, idle


def test_the_baseline_is_always_measured_first():
    assert positions_cost.parse_args(["--methods", "fire", "alibi", "fire"]).methods == ["sinusoidal", "fire", "alibi"]
    assert positions_cost.parse_args([]).methods == list(positions_cost.METHODS) + ["alibi+ssmax"]


def test_a_ssmax_method_trains_and_evaluates_its_arch_with_the_flag():
    """``M+ssmax``: the arch of M, trained and built with ``--ssmax`` (the
    plain method without it), for every method of the registry."""
    opts = positions_cost.parse_args(["--methods", "fox+ssmax"])
    for method in positions_cost.POSITIONS:
        for name, flagged in ((method, False), (method + "+ssmax", True)):
            command = positions_cost.train_command("DATA", name, opts, 0.0)
            assert command[command.index("--arch") + 1] == f"transformer_lm_{method}"
            assert ("--ssmax" in command) == flagged
            assert ("--ssmax" in positions_cost.cell_extra_args(opts, name)) == flagged


def test_the_learned_bias_benchmark_times_both_forms_in_a_tiny_run(tmp_path):
    """``benchmarks/learned_bias.py`` on a tiny setting: a row per (method, length), each
    form timed, the ratio the one of the medians, the table printed as recorded."""
    import learned_bias

    out = tmp_path / "bias.json"
    assert learned_bias.main(["--lengths", "8", "20", "--repeats", "2", "--heads", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["length"]) for r in rows] == [(m, n) for m in ("t5bias", "kerple") for n in (8, 20)]
    for row in rows:
        assert row["pairwise_s"] > 0 and row["toeplitz_s"] > 0
        assert row["ratio"] == pytest.approx(row["toeplitz_s"] / row["pairwise_s"])
    stack = learned_bias.P.build("t5bias", 2, 8, {"t5_buckets": 8, "t5_max_distance": 16, "t5_init_slopes": 0.0},
                                 learned_bias.Scaling("none", train_length=20))
    assert torch.equal(learned_bias.toeplitz(stack, 20), learned_bias.pairwise(stack, 20))  # the same bias


def test_the_fox_kernel_benchmark_times_every_case_in_a_tiny_run(tmp_path):
    """``benchmarks/fox_kernel.py`` on a tiny setting: a row per (case, dropout),
    each case timed every repeat, the ratio the one of the medians to ALiBi's."""
    import fox_kernel

    out = tmp_path / "fox.json"
    assert fox_kernel.main(["--length", "40", "--batch", "1", "--heads", "2", "--head-dim", "8", "--repeats", "2",
                            "--dropout", "0", "0.2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["dropout"]) for r in rows] == [(c, d) for d in (0.0, 0.2) for c in fox_kernel.CASES]
    for row in rows:
        assert len(row["seconds"]) == 2 and row["median_s"] == pytest.approx(statistics.median(row["seconds"]))
        alibi = next(r for r in rows if r["case"] == "alibi" and r["dropout"] == row["dropout"])
        assert row["ratio"] == pytest.approx(row["median_s"] / alibi["median_s"])


def test_the_position_kernels_benchmark_times_every_method_of_the_registry(tmp_path, capsys):
    """``benchmarks/position_kernels.py`` on a tiny setting: every method of the
    registry (the hybrid's layer kinds, FoX's gates from an input) in a row per
    column (two dropouts, one evaluation length), each timed every repeat, the
    ratio the one of the medians to ALiBi's, evaluation with its keys read; a
    method with an attention of its own (``own_kernel``) not timed with attention
    dropout, its row and its table cell saying why, and no keys read counted."""
    import position_kernels

    out = tmp_path / "kernels.json"
    assert position_kernels.main(["--length", "40", "--batch", "1", "--heads", "2", "--head-dim", "8",
                                  "--repeats", "2", "--dropout", "0", "0.2", "--eval-length", "90",
                                  "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    columns = ["train, dropout 0", "train, dropout 0.2", "eval 90 tokens"]
    methods = ["alibi"] + [m for m in position_kernels.P.POSITIONS if m != "alibi"]
    assert [(r["method"], r["column"]) for r in rows] == [(m, c) for m in methods for c in columns]
    own = {m for m in methods if any(layer.own_kernel for layer in position_kernels.Case(m, 2, 8, 40).layers)}
    assert own  # the registry has such methods (stick-breaking, PaTH)
    refused = "no attention dropout 0.2: the method's own attention has none (refused)"
    assert [(r["method"], r["column"]) for r in rows if "refused" in r] == [
        (m, "train, dropout 0.2") for m in methods if m in own]
    for row in rows:
        if "refused" in row:
            assert row["refused"] == refused and "median_s" not in row
            assert re.search(rf"^\| {row['method']} \| [^|]+ \| [^|]+ \| {re.escape(refused)} \| - \|", printed, re.M)
            continue
        assert len(row["seconds"]) == 2 and row["median_s"] == pytest.approx(statistics.median(row["seconds"]))
        alibi = next(r for r in rows if r["method"] == "alibi" and r["column"] == row["column"])
        assert row["ratio"] == pytest.approx(row["median_s"] / alibi["median_s"])
        # evaluation only: the share of causal pairs scored (one block of 90 queries: no window skips a key);
        # none counted for an attention of its own, which no shared kernel runs
        assert ("keys_read" in row) == row["column"].startswith("eval")
        if row["method"] in own:
            assert row.get("keys_read") is None
        else:
            assert row.get("keys_read", 1.0) >= 1.0


def test_the_new_methods_benchmark_times_every_case_beside_alibi_and_sdpa(capsys):
    """``benchmarks/new_methods_cpu.py`` on a tiny setting: a row per case in
    each table (training, evaluation), ratios to ALiBi's and SDPA's medians;
    in evaluation the share of the causal pairs each scores: stick-breaking
    with z about -8 scores every block (its diagonal squares whole: above 1),
    with z about N(0, 1) at 2,000 tokens it skips the blocks of spent sticks."""
    import new_methods_cpu

    assert new_methods_cpu.main(["--lengths", "40", "--batch", "1", "--heads", "2", "--head-dim", "8",
                                 "--trained-length", "16", "--eval-lengths", "2000", "--repeats", "1"]) == 0
    tables = [[line.split(" | ") for line in t.splitlines()[2:]] for t in capsys.readouterr().out.split("\n\n")
              if t.startswith("| case | s |")]
    assert len(tables) == 2 and all([r[0][2:] for r in t] == list(new_methods_cpu.CASES) for t in tables)
    rows = [None] + tables[1]
    scored = {r[0][2:]: float(r[4]) for r in rows[1:]}
    assert scored["sdpa"] == scored["path"] == 1.0
    assert scored["stickbreaking-far"] > 1.0 > scored["stickbreaking"] > 0.0
    # the eager cases: the kernel with the fused loops off (its own block sizes, so its own share of pairs)
    assert scored["stickbreaking-far-eager"] > 1.0 > scored["stickbreaking-eager"] > 0.0
    alibi = float(rows[1][1])
    for r in rows[1:]:  # the ratio of the medians, as far as the printed seconds (4 decimals) and ratio (2) allow
        low, high = (float(r[1]) - 5e-5) / (alibi + 5e-5), (float(r[1]) + 5e-5) / (alibi - 5e-5)
        assert low - 0.005 <= float(r[2]) <= high + 0.005, r


def test_an_eager_case_runs_without_the_fused_loops(monkeypatch):
    """``new_methods_cpu``'s ``-eager`` cases switch the loops off for their calls (and back on after)."""
    import new_methods_cpu
    from fairseq_alibi.core import native, stickbreaking

    loops = []
    real_forward = stickbreaking.native_forward
    monkeypatch.setattr(stickbreaking, "native_forward", lambda *a: loops.append(1) or real_forward(*a))
    q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
    new_methods_cpu.build("stickbreaking-far-eager", 2, 8, 16).seconds(q, k, v, None, 0.0, False)
    assert not loops and native.status() == "built"
    new_methods_cpu.build("stickbreaking-far", 2, 8, 16).seconds(q, k, v, None, 0.0, False)
    assert loops


def test_a_fresh_case_keeps_no_buffer():
    """``new_methods_cpu``'s ``-fresh`` cases run the fused calls with every buffer a fresh tensor (nothing
    taken from ``native.SCRATCH``), and put the kept buffers back after."""
    import new_methods_cpu
    from fairseq_alibi.core import native

    kept, taken = native.SCRATCH, []
    real_take = kept.take
    kept.take = lambda shape: taken.append(shape) or real_take(shape)
    try:
        q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
        new_methods_cpu.build("fire-fresh", 2, 8, 16).seconds(q, k, v, None, 0.0, False)
        assert not taken and native.SCRATCH is kept
        new_methods_cpu.build("fire", 2, 8, 16).seconds(q, k, v, None, 0.0, False)
        assert taken
    finally:
        del kept.take


@pytest.mark.parametrize("evaluation", [False, True])
def test_the_kernel_blocks_benchmark_runs_each_path_size_it_names_beside_sdpa(evaluation, capsys, monkeypatch):
    """``benchmarks/kernel_blocks.py`` (PaTH): a row per block (and sweep or chunk) size after SDPA's, each
    timed with the sizes its row names (the sweep's merges counted: none where the sweep's block is the
    block), the ratio its time over SDPA's, and the kernel's own sizes as they were afterwards."""
    import kernel_blocks
    from fairseq_alibi.core import path

    merged, sizes = [], []
    original_merges, original_chunks = path._merged_terms, path._by_chunks
    monkeypatch.setattr(path, "_merged_terms", lambda terms, merges: merged.append(merges) or
                        original_merges(terms, merges))
    original_fused_merges = path._fused_merges  # the fused C++ merges, where they run
    monkeypatch.setattr(path, "_fused_merges", lambda terms, merges: merged.append(merges) or
                        original_fused_merges(terms, merges))
    monkeypatch.setattr(path, "_by_chunks", lambda *a: sizes.append(a[-3:-2] + a[-1:]) or original_chunks(*a))
    original_fused = path._fused  # the fused C++ call, where it runs: its block and chunk
    monkeypatch.setattr(path, "_fused", lambda *a: sizes.append(a[8:10]) or original_fused(*a))
    sweep_block = path.SWEEP_BLOCK
    argv = ["--lengths", "96", "--batch", "1", "--heads", "2", "--head-dim", "8", "--repeats", "1", "--blocks", "8"]
    argv += ["--eval", "--chunks", "16", "32"] if evaluation else ["--sweep-blocks", "8", "16"]
    assert kernel_blocks.main(argv) == 0
    assert path.SWEEP_BLOCK == sweep_block
    rows = kernel_blocks_rows(capsys.readouterr().out)
    names = [r[0][2:] for r in rows]
    if evaluation:
        assert names == ["sdpa", "path, blocks 8, chunks 16", "path, blocks 8, chunks 32"]
        assert sorted(set(sizes)) == [(8, 16), (8, 32)] and merged == []
    else:
        assert names == ["sdpa", "path, blocks 8, sweep 8", "path, blocks 8, sweep 16"]
        assert sorted(set(merged)) == [0, 1] and sizes == []


@pytest.mark.parametrize("evaluation", [False, True])
def test_the_kernel_blocks_benchmark_runs_each_stickbreaking_size_it_names(evaluation, capsys, monkeypatch):
    """``kernel_blocks.py --method stickbreaking``: a row per (query block, key block) after SDPA's, each
    case's calls made with its sizes, with a gradient or (``--eval``) without; with ``--far`` (here with
    ``--eval``) ``q . k / sqrt(d)`` is about -8, about 0 without."""
    import kernel_blocks
    from fairseq_alibi.core import stickbreaking

    calls, scores, original = [], [], stickbreaking.stickbreaking_attention

    def recording(q, k, v, **sizes):
        calls.append((sizes["block"], sizes["key_block"], torch.is_grad_enabled()))
        scores.append(float((q.detach() @ k.detach().transpose(-1, -2)).mean()) / q.size(-1) ** 0.5)
        return original(q, k, v, **sizes)

    monkeypatch.setattr(stickbreaking, "stickbreaking_attention", recording)
    argv = ["--method", "stickbreaking", "--lengths", "40", "--batch", "1", "--heads", "2", "--head-dim", "8",
            "--repeats", "1", "--blocks", "8", "16", "--key-blocks", "32"] + (["--eval", "--far"] if evaluation
                                                                              else [])
    assert kernel_blocks.main(argv) == 0
    rows = kernel_blocks_rows(capsys.readouterr().out)
    assert [r[0][2:] for r in rows] == ["sdpa", "stickbreaking, blocks 8, key blocks 32",
                                        "stickbreaking, blocks 16, key blocks 32"]
    assert sorted(set(calls)) == [(8, 32, not evaluation), (16, 32, not evaluation)]
    assert all(-9 < z < -7 if evaluation else abs(z) < 1 for z in scores)


def kernel_blocks_rows(out: str):
    """The table rows of ``kernel_blocks.py``'s output, SDPA's first; each ratio its time over SDPA's."""
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")][1:]
    for r in rows:
        assert float(r[2].split()[0]) == pytest.approx(float(r[1]) / float(rows[0][1]), rel=0.05, abs=0.01)
    return rows


@pytest.mark.slow  # six fresh processes and a profiled call: about 20-50 s
def test_the_new_methods_benchmark_measures_memory_cell_by_cell_and_profiles_a_case(capsys):
    """``new_methods_cpu.py --memory --profile path-eager``: a row per case
    (ALiBi and SDPA first) and a column per evaluation length, each cell a
    fresh process's ``memory_of`` of one forward, a number of MiB not below 0;
    then a row per length of PaTH's largest operators on its eager path,
    shares of its call that add up to at most 100 %, torch's fused attention
    call among them past a chunk."""
    import new_methods_cpu

    assert new_methods_cpu.main(["--lengths", "--heads", "2", "--head-dim", "8", "--trained-length", "16",
                                 "--eval-lengths", "256", "1024", "--repeats", "1", "--cases", "path-eager",
                                 "--memory", "--profile", "path-eager"]) == 0
    out, profiled = capsys.readouterr().out.split("Evaluation memory")[1].split("Where one evaluation call")
    shares = {line.split(" | ")[0][2:]: [(c.rsplit(" ", 1)[0], float(c.rsplit(" ", 1)[1].rstrip("%")))
                                          for c in line.strip(" |").split(" | ")[1:]]
              for line in profiled.splitlines() if line.startswith("| ") and line[2].isdigit()}
    assert list(shares) == ["256", "1024"] and all(0 < sum(p for _, p in r) <= 100.5 for r in shares.values())
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in [op for op, _ in shares["1024"]]
    rows = {line.split(" | ")[0][2:]: [float(c) for c in line.strip(" |").split(" | ")[1:]]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| case", "|---"))}
    assert list(rows) == ["alibi", "sdpa", "path-eager"] and all(len(r) == 2 for r in rows.values())
    assert all(mib >= 0 for r in rows.values() for mib in r)


def test_the_position_kernels_benchmark_times_t5s_two_training_paths(monkeypatch):
    """``position_kernels.py --t5-paths``: a row for T5 through the generic
    per-distance path beside T5's own; that case has no far bucket (so the
    blocked kernel cannot take the far-and-band path) where T5's own has one,
    and both paths give the same attention and gradients."""
    import position_kernels

    from fairseq_alibi.core import kernels
    rows = []
    monkeypatch.setattr(position_kernels, "write_rows", lambda path, args, r: rows.extend(r))
    assert position_kernels.main(["--length", "40", "--batch", "1", "--heads", "2", "--head-dim", "8",
                                  "--repeats", "1", "--dropout", "0", "--eval-length", "--methods", "t5bias",
                                  "--t5-paths"]) == 0
    assert [r["method"] for r in rows] == ["alibi", "t5bias", position_kernels.T5_GENERIC]
    own, generic = (position_kernels.Case(m, 2, 8, 200) for m in ("t5bias", position_kernels.T5_GENERIC))
    with torch.no_grad():
        own.stack.method.table.weight.normal_(generator=torch.Generator().manual_seed(1))
        generic.stack.method.table.weight.copy_(own.stack.method.table.weight)
    assert own.layers[0].shared_from(200) is not None and generic.layers[0].shared_from(200) is None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=gen) for _ in range(3))
    results = []
    for case in (own, generic):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        case.stack.start_pass()
        out, _ = kernels.attend(*leaves, case.layers[0], "auto", None, 0.0)
        out.sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves] + [case.stack.method.table.weight.grad.clone()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_the_position_kernels_benchmark_times_fire_past_its_threshold(monkeypatch, capsys):
    """``position_kernels.py --fire-threshold T``: a row for FIRE with its
    threshold at T beside FIRE's own (the length), whose training pass then
    has no per-distance form (its bias built block by block); a threshold that is not a
    positive number is a usage error."""
    import position_kernels

    rows = []
    monkeypatch.setattr(position_kernels, "write_rows", lambda path, args, r: rows.extend(r))
    assert position_kernels.main(["--length", "40", "--batch", "1", "--heads", "2", "--head-dim", "8",
                                  "--repeats", "1", "--dropout", "0", "--eval-length", "--methods", "fire",
                                  "--fire-threshold", "20", "39.5"]) == 0
    assert [r["method"] for r in rows] == ["alibi", "fire", "fire-threshold-20", "fire-threshold-39.5"]
    cases = {m: position_kernels.Case(m, 2, 8, 40) for m in ("fire", "fire-threshold-20", "fire-threshold-39.5")}
    assert {m: float(c.stack.method.threshold) for m, c in cases.items()} == pytest.approx(
        {"fire": 40.0, "fire-threshold-20": 20.0, "fire-threshold-39.5": 39.5})
    assert {m: c.layers[0].per_distance(40, "cpu") is None for m, c in cases.items()} == {
        "fire": False, "fire-threshold-20": True, "fire-threshold-39.5": False}
    for bad in ("0", "-5", "inf", "nan"):
        with pytest.raises(SystemExit) as exc:
            position_kernels.main(["--methods", "fire", "--fire-threshold", bad])
        assert exc.value.code == 2
        assert "--fire-threshold values must be positive numbers of tokens" in capsys.readouterr().err


def test_the_trained_windows_benchmark_compares_both_forms_on_a_checkpoint(lm_data_bin, tmp_path, monkeypatch,
                                                                            capsys):
    """``benchmarks/trained_windows.py`` on a tiny T5 model started at ALiBi's bias
    (its steepest head's far bucket 50 below its near one), trained a few updates:
    a row per length, the chunked kernel (its threshold lowered here) reading
    fewer pairs with the distance windows than without, the two forms' log-probs
    equal to rounding; a short input is no chunked call; a missing checkpoint is
    one error line."""
    from conftest import tool, train_args

    import trained_windows

    args = train_args(lm_data_bin, tmp_path, max_update=3)
    args[args.index("transformer_lm_alibi")] = "transformer_lm_t5bias"
    run_cli([tool("alibi-train"), *args, "--t5-init-slopes", "1"])
    monkeypatch.setattr(trained_windows.K, "CHUNK_THRESHOLD", 64 * 64)
    checkpoint = f"t5={tmp_path / 'checkpoint_last.pt'}"
    assert trained_windows.main([str(lm_data_bin), "-c", checkpoint, "--tokens", "40", "600", "--repeats", "1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| t5 |")]
    assert [row[1] for row in rows] == ["40", "600"]
    assert rows[0][2:4] == ["- (not chunked)"] * 2
    windows, every = float(rows[1][2]), float(rows[1][3])
    assert windows < every and every > 1 and float(rows[1][7].rstrip(" |")) < 1e-4
    assert trained_windows.main([str(lm_data_bin), "-c", f"t5={tmp_path / 'none.pt'}"]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_memory_of_falls_back_to_ru_maxrss_and_says_so(monkeypatch):
    monkeypatch.setattr(positions_cost, "reset_peak", lambda: False)
    held = positions_cost.memory_of(lambda: None)
    assert held["memory_basis"] == "ru_maxrss" and held["own_mib"] == held["peak_mib"] - held["ready_mib"] >= 0


def test_the_throughput_benchmark_pairs_every_method_update_by_update(tmp_path):
    """``benchmarks/train_throughput.py`` on a tiny model: every method's
    median words/s is of its own rounds, its speed the median of its words/s
    over ALiBi's of the same round, its range that of those ratios (the
    numbers are the benchmark's, not the suite's); ``all`` is the table's
    every method."""
    out = tmp_path / "throughput.json"
    args = ["--methods", "t5bias", "nope", "--attention-dropout", "0", "0.1", "--length", "16", "--layers", "1",
            "--embed-dim", "16", "--heads", "2", "--ffn", "32", "--vocab", "20", "--rounds", "3", "--warmup", "1",
            "--pre-norm", "--json", str(out)]
    assert train_throughput.main(args) == 0
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["0.0", "0.1"]
    for drop, methods in data["results"].items():
        assert list(methods) == ["alibi", "t5bias", "nope"]
        for method, entry in methods.items():
            for kind, speed in (("wps", "speed"), ("cpu_wps", "cpu_speed")):
                values, reference = entry[kind], methods["alibi"][kind]
                assert len(values) == 3 and all(v > 0 for v in values)
                assert entry[f"median_{kind}"] == statistics.median(values)
                ratios = [a / b for a, b in zip(values, reference)]
                assert entry[speed]["median"] == pytest.approx(statistics.median(ratios), rel=1e-12)
                assert entry[speed]["range"] == pytest.approx([min(ratios), max(ratios)], rel=1e-12)
            row = next(line for line in data["markdown"].splitlines() if line.startswith(f"| {method} |"))
            assert f"{entry['median_wps']:.0f}" in row and positions_cost.significant(entry["speed"]["median"]) in row
        assert methods["alibi"]["speed"]["median"] == 1.0
        # keys read: FoX's blocked flash calls, one block of 16 queries scoring its square whole (16 x 16 of the
        # 16 x 17 / 2 causal pairs) without dropout; NoPE's SDPA call and ALiBi's short SDPA path none
        assert methods["nope"]["keys_read"] is None and methods["alibi"]["keys_read"] is None
    fox = train_throughput.measure(train_throughput.parse_args(
        ["--methods", "fox", "--length", "16", "--layers", "1", "--embed-dim", "16", "--heads", "2", "--ffn", "32",
         "--vocab", "20", "--rounds", "1", "--warmup", "0"]), 0.0)["fox"]
    assert fox["keys_read"] == pytest.approx(16 * 16 / (16 * 17 / 2), rel=1e-12)
    # FIRE's learned threshold, which says which training path FIRE's numbers measured: at L before any update,
    # moved after them, and in the report
    fire_opts = train_throughput.parse_args(["--methods", "fire", "--length", "16", "--layers", "1", "--embed-dim",
                                             "16", "--heads", "2", "--ffn", "32", "--vocab", "20", "--rounds", "1"])
    fire = train_throughput.measure(fire_opts, 0.0)
    start, end = fire["fire"]["fire_threshold"]
    assert start == pytest.approx(16.0, rel=1e-5) and end != start and fire["alibi"]["fire_threshold"] is None
    assert (f"FIRE's learned threshold (from one value per distance while it is at least L - 1 = 15, its bias "
            f"built block by block below it), before the warm-up and after the last round: fire, attention "
            f"dropout 0.0: {start:.2f} -> {end:.2f}.") in train_throughput.render(fire_opts, "cmd", {"0.0": fire})
    everything = train_throughput.parse_args(["--methods", "nope", "all"]).methods
    assert everything[0] == "alibi" and sorted(everything) == sorted(positions_cost.DEFAULT_METHODS)

#: The tiny model of the refusal tests (train_throughput's flags; positions_cost takes the same sizes).
TINY_MODEL = ["--length", "16", "--layers", "2", "--embed-dim", "16", "--heads", "2", "--ffn", "32"]


def own_attention(opts):
    """The registered methods whose layers compute their attention themselves (``own_kernel``), at ``opts``' sizes."""
    return [m for m in positions_cost.POSITIONS if any(
        layer.own_kernel for layer in positions_cost.layer_objects(m, opts.layers, opts.heads, opts.embed_dim,
                                                                   opts.length))]


def test_what_a_method_refuses_is_read_from_its_layers_for_every_method():
    """``option_refusal`` and ``trained_dropout`` of every registered method: an
    attention of its own refuses attention dropout and every kernel name but auto,
    in words, and trains the dropout column at attention dropout 0; every other
    method takes both (its column's dropout as given), as does the stock model."""
    opts = train_throughput.parse_args(TINY_MODEL)
    own = own_attention(opts)
    assert own  # stick-breaking and PaTH
    for method in (positions_cost.BASELINE, *positions_cost.POSITIONS):
        dropout, kernel = (positions_cost.option_refusal(opts, method, 0.1),
                           positions_cost.option_refusal(opts, method, 0.0, "sdpa"))
        if method in own:
            assert dropout == "no attention dropout 0.1: the method's own attention has none (refused)"
            assert kernel == "no kernel sdpa: the method runs its own attention, auto only (refused)"
            assert positions_cost.trained_dropout(opts, method, 0.1) == (
                0.0, f"{dropout}; trained at attention dropout 0, its other dropouts {positions_cost.DROPOUT}")
        else:
            assert dropout is None and (kernel is None or method == positions_cost.BASELINE), (method, kernel)
            assert positions_cost.trained_dropout(opts, method, 0.1) == (0.1, None)
        assert positions_cost.option_refusal(opts, method, 0.0) is None
        assert positions_cost.trained_dropout(opts, method, 0.0) == (0.0, None)
    # a kernel without attention dropout, the other way round: the row quotes the layer's check
    assert positions_cost.option_refusal(opts, "alibi", 0.1, "chunked") == \
        "no attention dropout 0.1: the chunked kernel has none (refused)"
    # --ssmax of a method without a softmax: a usage error where named, in one line
    no_softmax = [m for m in positions_cost.POSITIONS if positions_cost.position_of(m + positions_cost.SSMAX) == m
                  and positions_cost.depth_problem(m + positions_cost.SSMAX, 2, 2, 16, 16)]
    assert no_softmax and set(no_softmax) <= set(own)
    for method in no_softmax:
        with pytest.raises(SystemExit):
            train_throughput.parse_args(["--methods", method + positions_cost.SSMAX, *TINY_MODEL])


def test_the_throughput_benchmark_says_in_its_row_what_a_method_refuses(capsys):
    """``train_throughput.py`` with attention dropout 0.1 (and ``--alibi-attention
    sdpa``): a method whose attention is its own is not run in that column, its
    row saying why in words, and runs where it can; ALiBi, every speed's reference,
    refusing a column is one usage error."""
    opts = train_throughput.parse_args(["--methods", "all", "--attention-dropout", "0", "0.1", "--rounds", "1",
                                        "--warmup", "0", "--vocab", "20", *TINY_MODEL])
    own = own_attention(opts)
    opts.methods = [train_throughput.REFERENCE, *own]  # the others' columns: the test above
    results = {str(d): train_throughput.measure(opts, d) for d in opts.attention_dropout}
    report = train_throughput.render(opts, "cmd", results)
    why = "no attention dropout 0.1: the method's own attention has none (refused)"
    for method in own:
        assert results["0.0"][method]["median_wps"] > 0 and results["0.1"][method] == {"refused": why}
        row = next(line for line in report.splitlines() if line.startswith(f"| {method} |"))
        assert row.endswith(f" | {why} | - | - | - |") and f"{results['0.0'][method]['median_wps']:.0f}" in row
    assert results["0.1"]["alibi"]["median_wps"] > 0
    opts = train_throughput.parse_args(["--methods", *own, "--alibi-attention", "sdpa", "--rounds", "1", "--warmup",
                                        "0", "--vocab", "20", *TINY_MODEL])
    results = train_throughput.measure(opts, 0.0)
    assert {m: results[m] for m in own} == {
        m: {"refused": "no kernel sdpa: the method runs its own attention, auto only (refused)"} for m in own}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_throughput.parse_args(["--alibi-attention", "flex", "--attention-dropout", "0", "0.1", *TINY_MODEL])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2 and len(errors) == 1 and errors[0].endswith(
        "error: --alibi-attention flex with --attention-dropout 0.1: alibi, every speed's reference, refuses it: no "
        "attention dropout 0.1: the flex kernel has none (refused); give another kernel or attention dropout")


def test_positions_cost_trains_an_attention_of_its_own_without_attention_dropout(tmp_path, monkeypatch):
    """In the attention dropout 0.1 column, a method whose attention is its own
    trains at attention dropout 0 (its other dropouts 0.1), every other method
    at 0.1, and its row says so; without such runs the benchmark stopped at the
    first refusal (alibi-train's error)."""
    opts = positions_cost.parse_args(["--attention-dropout", "0", "0.1", "--repeats", "1", "--updates", "3",
                                      "--skip", "1", "--max-tokens", "64", "--eval-multiples", *TINY_MODEL])
    own = own_attention(opts)
    trained = {}

    def run_all(jobs, parallel):
        for cmd, log in jobs:
            drop = float(cmd[cmd.index("--attention-dropout") + 1])
            trained[os.path.basename(log)] = drop
            with open(log, "w") as f:
                for update in range(3):
                    f.write(f'x | train_inner | {{"wps": "{100 + update}", "wall": "{update}"}}\n')

    monkeypatch.setattr(positions_cost, "run_all", run_all)
    train = positions_cost.measure_training(opts, "unused", str(tmp_path), time.time())
    assert set(own) <= set(opts.methods) and own
    for method in opts.methods:
        assert trained[f"{method}_ad0.0_0.log"] == 0.0 and train["0.0"][method]["attention_dropout"] == 0.0
        assert trained[f"{method}_ad0.1_0.log"] == train["0.1"][method]["attention_dropout"] == (
            0.0 if method in own else 0.1)
        assert "note" not in train["0.0"][method] and ("note" in train["0.1"][method]) == (method in own)
        assert train["0.1"][method]["median"] == 101.5
    (table,) = [rows for title, rows in tables("\n".join(positions_cost.train_table(opts, train))).items()]
    note = ("no attention dropout 0.1: the method's own attention has none (refused); trained at attention "
            "dropout 0, its other dropouts 0.1")
    assert [row[0] for row in table[1:]] == [m + (f" ({note})" if m in own else "") for m in opts.methods]


def test_keys_read_counts_every_method_s_own_kernels_and_none_for_an_attention_of_its_own(monkeypatch):
    """``positions_cost.keys_read`` of a forward of every method's model: a kernel
    the method brings (FoX's chunked kernel) is counted as the shared ones are
    (it read as the stock model's full square, 2T / (T + 1), counting nothing);
    an attention of its own (``own_kernel``) is not counted (None, '-' in the
    table), where it read as that square too.  Blocks of 32 queries: 4 in the
    forward, whose diagonal squares scored whole make 1.24 at most."""
    from common import build_lm, make_dict_dir

    from fairseq_alibi.core import kernels

    monkeypatch.setattr(kernels, "CHUNK_SIZE", 32)

    opts = positions_cost.parse_args(["--eval-multiples", "8", *TINY_MODEL])
    own, length = own_attention(opts), 8 * 16
    data = make_dict_dir(20)
    x = torch.randint(4, 20, (1, length), generator=torch.Generator().manual_seed(0))
    for method in opts.methods:
        _, model, _, _ = build_lm(positions_cost.arch_of(method), data, positions_cost.cell_extra_args(opts, method),
                                  tokens_per_sample=16)
        model.eval()

        def forward(x):
            with torch.no_grad():
                model.decoder.extract_features(x, None)

        read = positions_cost.keys_read(forward, x)
        if method == positions_cost.BASELINE:
            assert read == 2 * length / (length + 1)
        elif positions_cost.position_of(method) in own:
            assert read is None, method
        else:
            assert 0 < read < 1.5, (method, read)  # counted: at most each block's diagonal square whole
