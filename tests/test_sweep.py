"""``alibi-sweep``: the grid, its outputs, resuming, per-position losses, and
agreement with a direct ``fairseq-eval-lm`` run.

Checkpoints: the session ALiBi fixture from conftest.py (6 heads, trained at
32 tokens) and the stock sinusoidal ``transformer_lm`` fixture trained on the
same data (module fixture).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import EXAMPLES, TRAIN_LENGTH, cli_env, ctrl_c_restored, parse_eval, run_cli, tool

from fairseq_alibi.evaluation import backends
from fairseq_alibi.evaluation import perplexity as sweep

STRIDE = 16
METHODS = "none,linear:2,ntk,cap:0.5"  # none, a static and a dynamic method, the distance cap
LENGTHS = "1x,2x"  # 32, 64


def sweep_argv(data, out, alibi, sinusoidal, *extra):
    return [
        str(data), "-c", f"alibi={alibi}", "-c", f"sin={sinusoidal}",
        "--lengths", LENGTHS, "--methods", METHODS, "--modes", "nonoverlapping,sliding",
        "--stride", str(STRIDE), "--max-tokens", "256", "--output-dir", str(out),
        "--cpu", "--no-progress", *extra,
    ]


@pytest.fixture(scope="module")
def sweep_run(lm_data_bin, alibi_checkpoint, sinusoidal_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    rc = sweep.main(sweep_argv(lm_data_bin, out, alibi_checkpoint, sinusoidal_checkpoint, "--per-position"))
    assert rc == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    return out, cells


def expected_keys():
    keys = set()
    lengths = (TRAIN_LENGTH, 2 * TRAIN_LENGTH)
    for name, methods in (("alibi", [("none", 1.0), ("linear", 2.0), ("ntk", 0.0), ("cap", 0.5)]),
                          ("sin", [("none", 1.0)])):
        for method, factor in methods:
            for length in lengths:
                keys.add((name, method, factor, "nonoverlapping", length, length))
                keys.add((name, method, factor, "sliding", length, STRIDE))
    return keys


@pytest.mark.slow
def test_outputs_have_every_cell(sweep_run):
    out, cells = sweep_run
    for name in ("results.json", "results.csv", "results.md", "perplexity.png",
                 "per_position.csv", "per_position.png"):
        assert (out / name).stat().st_size > 0, name
    got = {(c["checkpoint"], c["method"], c["factor"], c["mode"], c["length"], c["stride"]) for c in cells}
    assert got == expected_keys()  # the sinusoidal model only with "none"
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(cells)
    assert set(sweep.RESULT_FIELDS) <= set(rows[0])
    for row in rows:
        loss, ppl = float(row["loss"]), float(row["ppl"])
        assert loss > 0 and math.isclose(ppl, 2 ** loss, rel_tol=1e-4)
        assert int(row["tokens"]) > 0 and float(row["seconds"]) >= 0
    # Every token of the split is scored once in every cell, also for the
    # sinusoidal model at twice its training length (not silently skipped).
    assert len({c["tokens"] for c in cells}) == 1
    table = (out / "results.md").read_text()
    assert "### nonoverlapping" in table and f"### sliding, stride {STRIDE}" in table
    assert "| sin | none |" in table and "| alibi | linear x2 |" in table and "| alibi | ntk dynamic |" in table


def paired_by_hand(cell, base):
    """ppl(cell) / ppl(base) and its 95 % t-interval over the per-window differences,
    windows matched by their index in the text."""
    from scipy import stats

    base_of = dict(zip(base["window_index"], base["window_loss"]))
    diffs = [loss - base_of[i] for i, loss in zip(cell["window_index"], cell["window_loss"])]
    tokens = cell["window_tokens"]
    ratio = sum(diffs) / sum(tokens)
    spread = sum((d - ratio * n) ** 2 for d, n in zip(diffs, tokens)) / (len(diffs) - 1)
    half = stats.t.ppf(0.975, len(diffs) - 1) * (len(diffs) * spread) ** 0.5 / sum(tokens)
    return 2 ** ratio, 2 ** (ratio - half), 2 ** (ratio + half)


@pytest.mark.slow
def test_results_carry_intervals_and_paired_changes(sweep_run):
    out, cells = sweep_run
    stored = json.loads((out / "results.json").read_text())
    by = {(c["checkpoint"], c["label"], c["mode"], c["length"]): c for c in cells}
    for c in cells:
        assert c["ppl_low"] < c["ppl"] < c["ppl_high"] and c["ppl_no_interval"] is None
        assert sorted(c["window_index"]) == list(range(len(c["window_index"])))  # every window once, by its index
    pairs = {(p["kind"], p["checkpoint"], p["label"], p["mode"], p["length"]): p for p in stored["paired"]}
    assert len(pairs) == len(stored["paired"]) == 3 * 2 * 2 + 2 * 2  # alibi's 3 methods vs none; sin vs alibi
    for key, cell, base in ((("method", "alibi", "cap x0.5", "nonoverlapping", 64), by[("alibi", "cap x0.5",
                             "nonoverlapping", 64)], by[("alibi", "none", "nonoverlapping", 64)]),
                            (("checkpoint", "sin", "none", "sliding", 32), by[("sin", "none", "sliding", 32)],
                             by[("alibi", "none", "sliding", 32)])):
        p = pairs[key]
        assert (p["ppl_ratio"], p["ppl_ratio_low"], p["ppl_ratio_high"]) == pytest.approx(paired_by_hand(cell, base),
                                                                                          rel=1e-9)
        assert p["ppl_ratio"] == pytest.approx(cell["ppl"] / base["ppl"], rel=1e-6)
    same = pairs[("method", "alibi", "ntk dynamic", "nonoverlapping", TRAIN_LENGTH)]  # dynamic = none up to L
    assert same["ppl_ratio"] == 1.0 and same["ppl_ratio_low"] is None and same["no_interval"].startswith("identical")
    table = (out / "results.md").read_text()
    assert "| alibi | cap x0.5 vs none |" in table and "| sin vs alibi | none |" in table
    with open(out / "results.csv", newline="") as f:
        assert "ppl_no_interval" in next(csv.reader(f))


@pytest.mark.slow
def test_intervals_do_not_depend_on_window_order_or_batching(sweep_run, lm_data_bin, alibi_checkpoint, tmp_path):
    """The fixture sweep batches windows (--max-tokens 256); one window per batch here
    scores them in another order: the same intervals, the same paired changes."""
    out, cells = sweep_run
    argv = [str(lm_data_bin), "-c", f"alibi={alibi_checkpoint}", "--lengths", LENGTHS, "--methods", "none,cap:0.5",
            "--batch-size", "1", "--output-dir", str(tmp_path), "--cpu", "--no-progress"]
    assert sweep.main(argv) == 0
    one = json.loads((tmp_path / "results.json").read_text())
    by = {(c["label"], c["length"]): c for c in cells if c["checkpoint"] == "alibi" and c["mode"] == "nonoverlapping"}
    for c in one["cells"]:
        batched = by[(c["label"], c["length"])]
        assert c["window_index"] != batched["window_index"] or c["window_index"] != sorted(c["window_index"])
        mine, theirs = dict(zip(c["window_index"], c["window_loss"])), dict(zip(batched["window_index"],
                                                                                 batched["window_loss"]))
        assert mine.keys() == theirs.keys() and [mine[i] for i in mine] == pytest.approx([theirs[i] for i in mine],
                                                                                       abs=2e-6)
        assert (c["ppl_low"], c["ppl_high"]) == pytest.approx((batched["ppl_low"], batched["ppl_high"]), rel=1e-8)
    stored = json.loads((out / "results.json").read_text())["paired"]
    for p in one["paired"]:
        batched = next(q for q in stored if q["checkpoint"] == "alibi" and q["mode"] == "nonoverlapping"
                       and (q["label"], q["length"]) == (p["label"], p["length"]))
        assert (p["ppl_ratio_low"], p["ppl_ratio_high"]) == pytest.approx(
            (batched["ppl_ratio_low"], batched["ppl_ratio_high"]), rel=1e-8)


@pytest.mark.slow
def test_dynamic_scaling_is_identity_up_to_training_length(sweep_run):
    _, cells = sweep_run
    by = {(c["checkpoint"], c["label"], c["mode"], c["length"]): c["loss"] for c in cells}
    for mode in ("nonoverlapping", "sliding"):
        assert by[("alibi", "ntk dynamic", mode, TRAIN_LENGTH)] == pytest.approx(
            by[("alibi", "none", mode, TRAIN_LENGTH)], abs=1e-6)
        # ...but not beyond it, nor for a static factor at the training length.
        assert by[("alibi", "ntk dynamic", mode, 2 * TRAIN_LENGTH)] != pytest.approx(
            by[("alibi", "none", mode, 2 * TRAIN_LENGTH)], abs=1e-6)
    assert by[("alibi", "linear x2", "nonoverlapping", TRAIN_LENGTH)] != pytest.approx(
        by[("alibi", "none", "nonoverlapping", TRAIN_LENGTH)], abs=1e-6)


@pytest.mark.slow
def test_per_position_losses_average_to_the_loss(sweep_run):
    out, cells = sweep_run
    for c in cells:
        losses, counts = c["per_position"], c["per_position_count"]
        assert len(losses) == c["length"]
        assert sum(counts) == c["tokens"]
        mean = sum(l * n for l, n in zip(losses, counts) if n) / sum(counts)
        assert mean == pytest.approx(c["loss"], abs=1e-5)
        if c["mode"] == "sliding":
            # Only the last `stride` positions are scored, except in the first window.
            scored = [i for i, n in enumerate(counts) if n]
            assert counts[c["length"] - STRIDE] > counts[0]
            assert scored[-1] == c["length"] - 1
    with open(out / "per_position.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(sum(1 for n in c["per_position_count"] if n) for c in cells)


@pytest.mark.slow
def test_resume_skips_done_cells(sweep_run, lm_data_bin, alibi_checkpoint, sinusoidal_checkpoint,
                                 tmp_path, monkeypatch):
    out, cells = sweep_run
    resumed = tmp_path / "resume"
    resumed.mkdir()
    (resumed / "results.json").write_text((out / "results.json").read_text())

    built = []
    real = backends.FairseqModel.windows

    def counting(self, length, stride, **settings):
        built.append(("cell", length, stride))
        return real(self, length, stride, **settings)

    monkeypatch.setattr(backends.FairseqModel, "windows", counting)
    argv = sweep_argv(lm_data_bin, resumed, alibi_checkpoint, sinusoidal_checkpoint, "--per-position")
    assert sweep.main(argv) == 0
    assert built == []  # nothing left to do
    assert len(json.loads((resumed / "results.json").read_text())["cells"]) == len(cells)
    assert (resumed / "perplexity.png").exists()  # outputs rebuilt from the saved cells

    # A larger grid runs only the new cells.
    argv[argv.index("--lengths") + 1] = "1x,2x,3x"
    argv[argv.index("--methods") + 1] = "none"
    assert sweep.main(argv) == 0
    cells_run = [b for b in built if b[0] == "cell"]
    assert sorted(cells_run) == sorted([("cell", 96, 96), ("cell", 96, STRIDE)] * 2)  # alibi + sin
    after = json.loads((resumed / "results.json").read_text())["cells"]
    assert len(after) == len(cells) + 4


@pytest.mark.parametrize("checkpoint,label", [("alibi", "linear x2"), ("alibi", "ntk dynamic"), ("alibi", "cap x0.5"),
                                              ("sin", "none")])
@pytest.mark.slow
def test_sliding_window_matches_fairseq_eval_lm(sweep_run, lm_data_bin, alibi_checkpoint,
                                                sinusoidal_checkpoint, alibi_user_dir, checkpoint, label):
    _, cells = sweep_run
    cell = next(c for c in cells if c["checkpoint"] == checkpoint and c["label"] == label
                and c["mode"] == "sliding" and c["length"] == 2 * TRAIN_LENGTH)
    path = alibi_checkpoint if checkpoint == "alibi" else sinusoidal_checkpoint
    overrides = cell["command"].split("--model-overrides ", 1)[1].strip('"')
    result = run_cli([
        tool("fairseq-eval-lm"), lm_data_bin, "--user-dir", alibi_user_dir, "--path", path,
        "--gen-subset", "valid", "--tokens-per-sample", cell["length"],
        "--context-window", cell["length"] - STRIDE, "--max-tokens", 256, "--cpu",
        "--model-overrides", overrides,
    ])
    result = parse_eval(result.output)
    assert result.tokens == cell["tokens"]
    assert round(cell["loss"], 4) == pytest.approx(result.loss, abs=1.5e-4)
    assert round(cell["ppl"], 2) == pytest.approx(result.ppl, abs=0.011)


@pytest.mark.parametrize("length, context, overrides, extra", [
    (32, 0, {}, dict()),
    (64, 48, {"alibi_scaling": "ntk:2.0"}, dict(max_tokens=256, cpu=True)),
    (96, 16, {"max_target_positions": 96, "tokens_per_sample": 96}, dict(subset="test", batch_size=3)),
])
@pytest.mark.slow
def test_eval_lm_config_is_what_fairseq_composes_from_the_command_line(lm_data_bin, alibi_checkpoint, length, context,
                                                                         overrides, extra):
    from omegaconf import OmegaConf

    argv = backends.eval_lm_argv(str(lm_data_bin), str(alibi_checkpoint), length, overrides, context, **extra)
    composed = backends.composed_eval_lm_config(argv)
    if context:  # what fairseq_cli.eval_lm.main does before building the task
        composed.task.tokens_per_sample -= context
    built = backends.eval_lm_config(str(lm_data_bin), str(alibi_checkpoint), length, overrides, context, **extra)
    assert OmegaConf.to_container(built, resolve=True) == OmegaConf.to_container(composed, resolve=True)
    built.task.tokens_per_sample = 1  # a copy: the next call is not changed by this one
    again = backends.eval_lm_config(str(lm_data_bin), str(alibi_checkpoint), length, overrides, context, **extra)
    assert again.task.tokens_per_sample == length - context


def test_bad_input_fails_clearly(lm_data_bin, alibi_checkpoint, tmp_path, capsys):
    out = tmp_path / "o"

    def fails(argv, message):
        with pytest.raises(SystemExit) as exit_info:
            sweep.main([str(a) for a in argv])
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, err

    base = ["--output-dir", out, "--cpu", "--no-progress"]
    fails([lm_data_bin, "-c", tmp_path / "missing.pt", *base], "checkpoint not found")
    fails([tmp_path / "nodata", "-c", alibi_checkpoint, *base], "data directory not found")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--subset", "dev", *base], "subset 'dev' not found")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--methods", "none,cubic", *base], "method='cubic' is not valid; allowed values")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--methods", "linear:0.5", *base], "linear takes a static factor >= 1")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--methods", "cap:0", *base], "factor='0' is not valid; the cap must be a positive number")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--stride", 8, *base], "--stride 8 applies to --modes sliding")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--train-length", 32, *base], "apply to --hf models only")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--modes", "sliding", *base], "needs --stride")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--modes", "sliding", "--stride", -3, *base], "--stride -3 is not valid")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--modes", "overlapping", *base], "unknown mode")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--lengths", "abc", *base], "bad length 'abc'")
    fails([lm_data_bin, *base], "no checkpoints given")
    fails([lm_data_bin, "-c", alibi_checkpoint.parent, *base], "is a directory; give a checkpoint file in it")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--modes", "sliding", "--stride", 2 * TRAIN_LENGTH,
           "--lengths", "1x", *base], "is not below every evaluation length")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--lengths", "4x", "--max-tokens", 64, *base],
          "is smaller than the longest evaluation length")
    # windows longer than the split: its whole text under a longer length's name (and, far beyond, an
    # OverflowError traceback or a per-position buffer that filled the memory)
    fails([lm_data_bin, "-c", alibi_checkpoint, "--lengths", "1x,2k", *base], "evaluation length 2048 exceeds the")
    fails([lm_data_bin, "-c", alibi_checkpoint, "--lengths", "1e9x", *base], "not between 1 and 2147483647")
    assert not (out / "results.json").exists()


@pytest.mark.slow
def test_stale_cells_are_recomputed(sweep_run, lm_data_bin, alibi_checkpoint, tmp_path):
    """Same NAME= and output directory, another checkpoint file: new numbers, not the stored ones."""
    out, _ = sweep_run
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    (rerun / "results.json").write_text((out / "results.json").read_text())
    other = tmp_path / "other.pt"
    other.write_bytes(alibi_checkpoint.read_bytes())
    stored = {c["label"]: c["ppl"] for c in json.loads((out / "results.json").read_text())["cells"]
              if c["checkpoint"] == "alibi" and c["mode"] == "nonoverlapping" and c["length"] == TRAIN_LENGTH}
    # Same weights, other file: recomputed (identity changed), equal numbers.
    argv = [lm_data_bin, "-c", f"alibi={other}", "--lengths", "1x", "--methods", "none", "--max-tokens", "256",
            "--output-dir", rerun, "--cpu", "--no-progress"]
    calls = []
    real = backends.FairseqModel.windows

    def counting(self, *a, **k):
        calls.append(a)
        return real(self, *a, **k)

    backends.FairseqModel.windows = counting
    try:
        assert sweep.main([str(a) for a in argv]) == 0
    finally:
        backends.FairseqModel.windows = real
    assert len(calls) == 1
    cells = [c for c in json.loads((rerun / "results.json").read_text())["cells"] if c["checkpoint"] == "alibi"]
    cell = next(c for c in cells if (c["label"], c["mode"], c["length"]) == ("none", "nonoverlapping", TRAIN_LENGTH))
    assert cell["path"] == str(other) and cell["ppl"] == pytest.approx(stored["none"], rel=1e-9)
    # the stored cells this run's grid does not hold are kept as they were, for a run of the first file
    assert {c["path"] for c in cells if c is not cell} == {str(alibi_checkpoint)}


@pytest.mark.slow
def test_console_script(lm_data_bin, alibi_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # a fresh process: what it imports, on stderr
    result = run_cli([
        tool("alibi-sweep"), lm_data_bin, "-c", alibi_checkpoint, "--lengths", "1x",
        "--methods", "none", "--output-dir", tmp_path, "--cpu",
    ], fresh=True)
    assert "| none |" in result.stdout
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert "fairseq_alibi.patches" in imported and "fairseq" in imported
    # fairseq came in through the plugin's patches (patches.deferred_metric_imports): no scikit-learn
    assert not [name for name in imported if name.split(".")[0] == "sklearn"]
    monkeypatch.delenv("PYTHONPROFILEIMPORTTIME")
    assert (tmp_path / "results.csv").exists()
    bad = run_cli([tool("alibi-sweep"), lm_data_bin, "-c", alibi_checkpoint, "--methods", "cubic"],
                  expect_ok=False)
    assert bad.returncode == 1 and bad.output.startswith("error: method=") and "Traceback" not in bad.output


@pytest.mark.slow
def test_masked_lm_checkpoint_is_refused_in_one_line(lm_data_bin, sinusoidal_checkpoint, tmp_path, capsys):
    """A roberta_alibi checkpoint stores its model config as an argparse
    Namespace (a model without a dataclass): named, not crashed on."""
    state = torch.load(sinusoidal_checkpoint, weights_only=True)
    state["cfg"]["model"] = argparse.Namespace(_name="roberta_alibi", arch="roberta_alibi", encoder_layers=2)
    state["cfg"]["task"]["_name"] = "masked_lm"
    path = tmp_path / "mlm.pt"
    torch.save(state, path)
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([str(lm_data_bin), "-c", f"mlm={path}", "--output-dir", str(tmp_path / "o"), "--cpu",
                    "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert "is a roberta_alibi checkpoint" in err and "task masked_lm" in err and "causal language models" in err


@pytest.mark.slow
def test_ctrl_c_says_rerunning_resumes(lm_data_bin, alibi_checkpoint, tmp_path):
    out = tmp_path / "o"
    proc = subprocess.Popen(
        [tool("alibi-sweep"), lm_data_bin, "-c", alibi_checkpoint, "--lengths", "1x,2x,4x,8x,16x",
         "--methods", "none,linear:2,linear,ntk:2,ntk", "--output-dir", out, "--cpu", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
        preexec_fn=ctrl_c_restored,
    )
    deadline = time.time() + 240
    while not (out / "results.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, stderr[-2000:])
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("alibi-sweep interrupted") and "run the same command again to resume" in last


def test_far_attention_example(lm_data_bin, alibi_checkpoint):
    """examples/language_model/far_attention.py (docs/extrapolation.md) on the tiny model:
    a cap beyond the window changes nothing, and a cap at L can only move attention
    to far keys (every far bias rises to -m*L, the near ones stay)."""
    result = run_cli([sys.executable, EXAMPLES / "language_model" / "far_attention.py", lm_data_bin,
                      alibi_checkpoint, "--length", 4 * TRAIN_LENGTH, "--windows", 4,
                      "--methods", "none,cap:100,cap"])
    rows = {}
    for line in result.stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            label, layer, *shares = [part.strip() for part in line.strip("|").split("|")]
            rows[(label, int(layer))] = [float(v) for v in shares]
    assert {layer for _, layer in rows} == {1, 2} and len(rows) == 6
    for layer in (1, 2):
        assert rows[("cap x100", layer)] == rows[("none", layer)]
        assert all(c >= n for c, n in zip(rows[("cap x1", layer)], rows[("none", layer)]))
        assert rows[("cap x1", layer)][-1] > rows[("none", layer)][-1]


def test_results_csv_tells_tail_alphas_apart(tmp_path):
    """Two tails that differ only in alpha differ in a column of their own, not only in ``label``."""
    from fairseq_alibi.evaluation import report

    cells = [dict(checkpoint="a", method="log", factor=1.0, alpha=alpha, label=f"log x1 a{alpha:g}", loss=1.0)
             for alpha in (0.5, 1.0)]
    report.write_csv(str(tmp_path / "results.csv"), cells, sweep.RESULT_FIELDS, sweep.FLOAT_FIELDS)
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(row["alpha"]) for row in rows] == [0.5, 1.0]


@pytest.mark.slow
def test_per_position_note_stays_inside_the_figure(tmp_path, monkeypatch):
    """The explanatory title of per_position.png is wrapped to the figure's width, never cut at its edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_alibi.evaluation import report

    seen = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kwargs):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        seen["title"] = fig._suptitle.get_window_extent(renderer)
        seen["figure"] = fig.bbox
        return real_savefig(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    cell = dict(checkpoint="a", method="none", factor=1.0, label="none", mode="nonoverlapping", stride=64,
                length=64, train_length=32, per_position=[3.0 - i / 64 for i in range(64)],
                per_position_count=[4] * 64)
    report.plot_per_position(str(tmp_path / "per_position.png"), [cell], lambda c: 0)
    title, figure = seen["title"], seen["figure"]
    assert figure.x0 <= title.x0 and title.x1 <= figure.x1 and title.y1 <= figure.y1
    plt.close("all")


def test_an_output_directory_never_writes_through_its_symbolic_links(tmp_path):
    """A link planted in an output directory (.lock, a figure, a table, their
    temporary files) is never followed: the lock refuses a linked .lock, and every
    file is a new one renamed over its name (it replaced the link, not its target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_alibi.errors import EvaluationError
    from fairseq_alibi.evaluation import report, store

    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("PRECIOUS")
    (out / ".lock").symlink_to(victim)
    with pytest.raises(EvaluationError, match=r"\.lock is a symbolic link; remove it"):
        with store.OutputLock(str(out), "test"):
            pass
    (out / ".lock").unlink()
    for name in ("results.md", "perplexity.png"):
        (out / name).symlink_to(victim)
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old temporary names: a pid away
        (out / f"results.md.tmp{pid}").symlink_to(victim)
    with store.OutputLock(str(out), "test"):
        store.atomic_write(str(out / "results.md"), "table\n")
        fig = plt.figure()
        report.save_figure(fig, str(out / "perplexity.png"))
        plt.close(fig)
    assert victim.read_text() == "PRECIOUS"
    assert not (out / "results.md").is_symlink() and (out / "results.md").read_text() == "table\n"
    assert not (out / "perplexity.png").is_symlink() and (out / "perplexity.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("results.md.tmp")) == [
        ".lock", "perplexity.png", "results.md"]
