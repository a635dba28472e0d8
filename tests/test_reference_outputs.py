"""The numbers of every position method, kernel, dtype and path against the
reference outputs saved before the kernels and the layer wiring were
reorganized (issue 78; ``tests/reference_outputs.py`` says what is saved and
regenerates it).

On the machine (torch version and CPU vector unit) that saved them, every
value must be the same bit for bit, the kernels each case ran included,
except the keys of :data:`REORDERED`, whose order of sums a change altered
on purpose (within 1e-6, float32); elsewhere float32 values are compared
within 1e-5 and bfloat16 ones are not compared (a rounding that differs
between vector units moves a bfloat16 model by whole units)."""

from __future__ import annotations

import pytest
import torch

import reference_outputs as R

#: Key prefixes whose order of sums changed on purpose (compared within 1e-6, float32 only).
REORDERED: tuple = ()


@pytest.fixture(scope="module")
def saved():
    stored = torch.load(R.DATA, weights_only=True)
    return stored


def test_every_registered_method_and_logit_method_is_covered():
    """Each registered method has a variant; SSMax and every logit method ride on one at least."""
    from fairseq_alibi.core.positions import POSITIONS
    from fairseq_alibi.core.scaling import LOGIT_METHODS

    arches = {flag for flags, _ in R.VARIANTS.values() for flag in flags if flag.startswith("transformer_lm_")}
    assert arches == {f"transformer_lm_{name}" for name in POSITIONS}
    assert any("--ssmax" in flags for flags, _ in R.VARIANTS.values())
    spelled = {spelling.split(":")[0] for _, spelling in R.VARIANTS.values() if spelling}
    assert set(LOGIT_METHODS) <= spelled


def compare(saved, found, prefix: str) -> None:
    expected = {k: v for k, v in saved["outputs"].items() if k.startswith(prefix)}
    assert expected, f"no reference output for {prefix}: regenerate (python tests/reference_outputs.py)"
    assert sorted(found) == sorted(expected), "the cases that run changed (a kernel refused or newly run)"
    same_machine = saved["fingerprint"] == R.fingerprint()
    wrong = []
    for key, want in expected.items():
        got = found[key]
        bfloat16 = "/bfloat16/" in key
        if same_machine and not key.startswith(REORDERED):
            ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
                torch.nan_to_num(got, 1.5, 2.5, -2.5), torch.nan_to_num(want, 1.5, 2.5, -2.5))
        elif bfloat16:
            continue
        else:
            tol = 1e-6 if same_machine else 1e-5
            ok = got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=tol, atol=tol,
                                                            equal_nan=True)
        if not ok:
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            wrong.append(f"{key}: {diff}")
    assert not wrong, f"{len(wrong)} of {len(expected)} differ (from commit {saved['commit'][:10]}): " + \
        "; ".join(wrong[:12])


#: The variants that `make test` runs (the others run in the slow tier).
ORDER = ["alibi", "fox", "rnope"] + [v for v in R.VARIANTS if v not in ("alibi", "fox", "rnope")]


@pytest.mark.fast_cases(3)
@pytest.mark.parametrize("variant", ORDER)
def test_variant_matches_its_reference(saved, variant):
    found = R.compute_variant(variant)
    compare(saved, {f"{variant}/{k}": v for k, v in found.items()}, f"{variant}/")


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("mode", R.ENCODER_MODES)
def test_encoder_matches_its_reference(saved, mode):
    compare(saved, R.compute_encoder(mode), f"encoder/{mode}/")


def test_the_float64_check_measures_each_path_against_float64():
    """``reference_outputs.py --float64 VARIANT`` (run before regenerating a variant): every group of float32
    outputs (training, evaluation, cache and the sweep, per kernel) measured against the same model in
    float64, for the code with its fused calls, without them, and the stored outputs; each within float32's
    rounding and none exactly 0 (the float64 run is a different computation)."""
    groups = R.float64_check("nope")
    assert {"train/float32/auto", "eval/float32/auto", "cache/float32/auto", "sweep/auto", "sweep/train"} <= set(groups)
    for group, row in groups.items():
        assert set(row) == {"fused", "eager", "stored"}, group
        assert all(0 < error < 1e-4 for error in row.values()), (group, row)

