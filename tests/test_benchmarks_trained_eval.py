"""``benchmarks/trained_eval.py``: trained models' long evaluation side by side,
the attention's time and the pairs it scores counted per model."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO, run_cli, tool, train_args

sys.path.insert(0, str(REPO / "benchmarks"))
import trained_eval  # noqa: E402


def test_trained_models_are_timed_side_by_side_with_the_pairs_they_score(lm_data_bin, tmp_path, monkeypatch,
                                                                          capsys):
    """Tiny ALiBi and stick-breaking models, a few updates each: one row per
    model and length, the first model the reference (1.00); the attention's
    seconds part of the forward's; ALiBi's chunked calls (their threshold
    lowered here) counted by their share of keys read at 600 tokens (half,
    here), its SDPA calls at 40 scoring every pair; the per-pair column the attention's time over the share scored, over
    ALiBi's; a missing checkpoint one error line."""
    paths = {}
    for name, arch in (("alibi", "transformer_lm_alibi"), ("stickbreaking", "transformer_lm_stickbreaking")):
        args = train_args(lm_data_bin, tmp_path / name, max_update=3)
        args[args.index("transformer_lm_alibi")] = arch
        run_cli([tool("alibi-train"), *args])
        paths[name] = tmp_path / name / "checkpoint_last.pt"
    monkeypatch.setattr(trained_eval.K, "CHUNK_THRESHOLD", 64 * 64)
    monkeypatch.setattr(trained_eval.K, "keys_read", lambda bias, q, k: 0.5)  # what the windows would skip
    loops = []  # whether each call of the fused forward came while the loops were switched off
    real_forward = trained_eval.stickbreaking.native_forward
    monkeypatch.setattr(trained_eval.stickbreaking, "native_forward",
                        lambda *a: loops.append(os.environ.get("FAIRSEQ_ALIBI_NATIVE")) or real_forward(*a))
    argv = [str(lm_data_bin), "-c", f"alibi={paths['alibi']}", "-c", f"stickbreaking={paths['stickbreaking']}",
            "-c", f"sb-eager={paths['stickbreaking']}", "--eager", "sb-eager", "--tokens", "40", "600",
            "--repeats", "1"]
    assert trained_eval.main(argv) == 0
    out = capsys.readouterr().out
    assert "fused CPU loops: built (switched off for sb-eager)" in out
    eager_rows = [[cell.strip() for cell in line.strip("|").split("|")]
                  for line in out.splitlines() if line.startswith("| sb-eager |")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith(("| alibi |", "| stickbreaking |"))]
    assert [(row[0], row[1]) for row in rows] == [("alibi", "40"), ("stickbreaking", "40"),
                                                   ("alibi", "600"), ("stickbreaking", "600")]
    # the same checkpoint with the loops off (the eager block sizes: its own share of pairs), and no call of the
    # fused forward while they are off
    assert [row[1] for row in eager_rows] == ["40", "600"] and all(0 < float(row[2]) <= 1 for row in eager_rows)
    assert loops and "0" not in loops
    for model, tokens, share, whole, whole_ratio, attention, attention_ratio, per_pair in rows:
        assert 0 < float(attention) < float(whole)
        assert 0 < float(share) <= 1
        if model == "alibi":
            assert whole_ratio == attention_ratio == per_pair == "1.00"
    alibi_40, sb_40, alibi_600, sb_600 = rows
    assert float(alibi_40[2]) == 1.0 and float(alibi_600[2]) == 0.5  # 40 tokens: SDPA; 600: chunked
    expected = (float(sb_600[5]) / float(sb_600[2])) / (float(alibi_600[5]) / float(alibi_600[2]))
    assert float(sb_600[7]) == pytest.approx(expected, rel=0.02, abs=0.01)
    assert trained_eval.main([str(lm_data_bin), "-c", f"alibi={tmp_path / 'none.pt'}"]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert trained_eval.main([str(lm_data_bin), "-c", f"alibi={paths['alibi']}", "--eager", "sb"]) == 1
    assert capsys.readouterr().err.startswith("error: --eager names sb, which no -c NAME=PATH gives")


def test_the_keys_path_fox_leaves_out_are_not_counted_as_scored(lm_data_bin, tmp_path, monkeypatch, capsys):
    """A tiny PaTH-FoX model at 600 tokens (chunks of 512), on the eager path
    (the fused C++ call counts its own, through ``path._count_skipped``: the
    kernel's tests check it leaves out what the eager rule does): where the
    gate leaves out half the cached keys of the second chunk's fused call (the
    decision replaced here), the share scored is the causal pairs less 256
    keys for each of its 88 queries."""
    from fairseq_alibi.core import native
    monkeypatch.setenv(native.SWITCH, "0")
    args = train_args(lm_data_bin, tmp_path / "pathfox", max_update=3)
    args[args.index("transformer_lm_alibi")] = "transformer_lm_path"
    run_cli([tool("alibi-train"), *args, "--path-forget-gate", "2"])
    def _forgotten(state, flat, c_flat, keys, c_past):  # the name the benchmark's replacement looks for
        return keys.size(2) // 2

    monkeypatch.setattr(trained_eval.path, "_forgotten", _forgotten)
    argv = [str(lm_data_bin), "-c", f"pathfox={tmp_path / 'pathfox' / 'checkpoint_last.pt'}", "--tokens", "600",
            "--repeats", "1"]
    assert trained_eval.main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| pathfox |"))
    share = float(row.split("|")[3])
    assert share == pytest.approx(1 - 256 * 88 / (600 * 601 / 2), abs=6e-4)
