"""``benchmarks/encoder_attention.py`` (an encoder's ALiBi in long
evaluation against bias-free attention): its keys read against a count of
the pairs the chunked kernel hands SDPA, a tiny run's rows and table, its
argument errors."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO, count_sdpa_pairs
from fairseq_alibi.core import kernels as K
from fairseq_alibi.core.bias import AlibiBias, LearnedAlibiBias

sys.path.insert(0, str(REPO / "benchmarks"))
import encoder_attention  # noqa: E402


@pytest.fixture
def small_blocks(monkeypatch):
    """The chunked kernel from 300 x 300 pairs on, in blocks of 64 queries."""
    monkeypatch.setattr(K, "CHUNK_THRESHOLD", 256 * 256)
    monkeypatch.setattr(K, "CHUNK_SIZE", 64)


@pytest.mark.parametrize("mode", ["symmetric", "split", "learned"])
def test_keys_read_counts_the_pairs_the_chunked_kernel_scores(mode, small_blocks, monkeypatch):
    """The share of the T x T pairs every SDPA call of the chunked kernel
    scores: below 1 with the two-sided windows (a split head reads one side;
    learned slopes are fixed in inference)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (3 * torch.randn(1, 8, 700, 16, generator=gen) for _ in range(3))
    bias = LearnedAlibiBias(8) if mode == "learned" else AlibiBias(8, mode=mode)
    scored = count_sdpa_pairs(monkeypatch)
    with torch.no_grad():
        K.attend(q, k, v, bias, "auto")
        read = encoder_attention.keys_read(bias, q, k)
    assert read == pytest.approx(sum(scored) / (8 * 700 * 700))
    assert read < 1.0


def test_a_tiny_run_times_every_case_against_bias_free_attention(small_blocks, capsys):
    rows = encoder_attention.run(300, 4, 16, ["symmetric", "split", "learned"], repeats=1)
    assert [r["case"] for r in rows] == [encoder_attention.BIAS_FREE, "symmetric", "split", "learned"]
    free = rows[0]["seconds"]
    assert rows[0]["ratio"] == 1.0 and rows[0]["keys_read"] == 1.0
    for row in rows[1:]:
        assert row["kernel"] == "chunked" and row["ratio"] == pytest.approx(row["seconds"] / free)
        assert 0 < row["keys_read"] <= 1.0
    encoder_attention.main(["--lengths", "300", "--heads", "2", "--head-dim", "8", "--repeats", "1",
                            "--modes", "split"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:-2] == ["|---|---|---|---|---|---|"]
    assert lines[-2].startswith("| 300 | no bias | sdpa |") and lines[-1].startswith("| 300 | split | chunked |")


@pytest.mark.parametrize("args,message", [(["--heads", "0"], "argument --heads: must be a positive integer, got 0"),
                                          (["--lengths", "64", "0"],
                                           "argument --lengths: must be a positive integer, got 0"),
                                          (["--modes", "causal"], "invalid choice: 'causal'")])
def test_bad_arguments_are_one_error_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        encoder_attention.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
