"""The ALiBi maths against naive references written here, independently."""

import math

import pytest
import torch

from conftest import causal_bias, fork_causal_bias, symmetric_bias

from fairseq_alibi.core import alibi
from fairseq_alibi.core.scaling import Scaling


def naive_slopes(num_heads):
    """Straight from the paper's description, in plain floats."""

    def geometric(n):
        first = 2 ** (-8 / n)
        return [first * first**i for i in range(n)]

    c = 1
    while c * 2 <= num_heads:
        c *= 2
    extra = geometric(2 * c)[::2][: num_heads - c] if num_heads > c else []
    return geometric(c) + extra


def naive_ntk(slopes, factor):
    """NTK-ALiBi as published (powers of two): 1 / (2^(8h/H) * a^((h-1)/(H-1)))."""
    H = len(slopes)
    return [1.0 / (2 ** (8 * h / H) * factor ** ((h - 1) / (H - 1))) for h in range(1, H + 1)]


@pytest.mark.parametrize("num_heads", range(1, 65))
def test_slopes_match_naive_reference(num_heads):
    slopes = alibi.get_slopes(num_heads)
    assert slopes.dtype == torch.float32 and slopes.shape == (num_heads,)
    torch.testing.assert_close(slopes, torch.tensor(naive_slopes(num_heads)), rtol=1e-6, atol=0)


def test_paper_examples():
    assert alibi.get_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    # 6 heads: the 4-head sequence, then slopes 1 and 3 of the 8-head one.
    expected = [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    torch.testing.assert_close(alibi.get_slopes(6), torch.tensor(expected))
    assert not bool((alibi.get_slopes(6).diff() < 0).all())  # not monotonic


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", None, True])
def test_bad_head_counts(bad):
    with pytest.raises(ValueError, match="num_heads"):
        alibi.get_slopes(bad)


@pytest.mark.parametrize("num_heads", range(1, 65))
@pytest.mark.parametrize("factor", [1.0, 2.0, 3.7, 16.0])
def test_scaling_against_naive(num_heads, factor):
    slopes = alibi.get_slopes(num_heads)
    ref = naive_slopes(num_heads)
    def scaled(method):
        return alibi.scaled_slopes(Scaling(method, factor), slopes, 10**6)

    torch.testing.assert_close(scaled("none"), slopes)
    torch.testing.assert_close(scaled("linear"), torch.tensor([m / factor for m in ref]))
    ntk = scaled("ntk")
    if num_heads == 1:
        expected = [ref[0] / factor]
    else:
        lo, hi = math.log(min(ref)), math.log(max(ref))
        expected = [m / factor ** ((hi - math.log(m)) / (hi - lo)) for m in ref]
    torch.testing.assert_close(ntk, torch.tensor(expected), rtol=1e-5, atol=0)
    if num_heads & (num_heads - 1) == 0 and num_heads > 1:
        torch.testing.assert_close(ntk, torch.tensor(naive_ntk(ref, factor)), rtol=1e-5, atol=0)
    # steepest head unchanged, flattest divided by the factor
    if num_heads > 1:
        assert ntk.max().item() == pytest.approx(max(ref), rel=1e-6)
        assert ntk.min().item() == pytest.approx(min(ref) / factor, rel=1e-5)


def test_dynamic_slopes_per_row():
    """One key count per row (a padded batch under dynamic scaling) gives each row its own slopes."""
    slopes, spec = alibi.get_slopes(8), Scaling("ntk", 0, 64)
    rows = alibi.scaled_slopes(spec, slopes, torch.tensor([32, 64, 256]))
    assert rows.shape == (3, 8)
    for row, n in zip(rows, (32, 64, 256)):
        torch.testing.assert_close(row, alibi.scaled_slopes(spec, slopes, n))
    torch.testing.assert_close(rows[2], alibi.scaled_slopes(Scaling("ntk", 4.0), slopes, 1))


def naive_distance_bias(slopes, q_len, k_len, directions, method, limit, alpha=None):
    """Written from the definitions, one entry at a time, where a head looks
    (left: j <= i, right: j >= i), -inf elsewhere; distance d = |i - j|, C = limit:
    cap: -m min(d, C); log: -m d within C, -m (C + alpha C ln(d / C)) beyond;
    power: the cap, minus alpha ln(d / C) past C;
    capnorm: the cap, minus ln(max(n, C) / C) past C, n the keys past C on the sides the head sees."""
    bias = torch.empty(len(slopes), q_len, k_len)
    for h, (m, look) in enumerate(zip(slopes, directions)):
        for a in range(q_len):
            i = k_len - q_len + a
            far_left, far_right = max(0, i - limit), max(0, k_len - 1 - i - limit)
            n = {alibi.LOOK_LEFT: far_left, alibi.LOOK_RIGHT: far_right}.get(look, far_left + far_right)
            for j in range(k_len):
                seen = look == alibi.LOOK_BOTH or (look == alibi.LOOK_LEFT and j <= i) or (look == alibi.LOOK_RIGHT and j >= i)
                d = abs(i - j)
                if method == "log" and d > limit:
                    value = -m * (limit + alpha * limit * math.log(d / limit))
                else:
                    value = -m * min(d, limit)
                if method == "capnorm" and d > limit:
                    value -= math.log(max(n, limit) / limit)
                if method == "power" and d > limit:
                    value -= alpha * math.log(d / limit)
                bias[h, a, j] = value if seen else float("-inf")
    return bias


@pytest.mark.parametrize("mode", ["causal", "symmetric", "split"])
@pytest.mark.parametrize("method,alpha", [("cap", None), ("log", 0.5), ("log", 1.0), ("power", 1.0), ("power", 2.0),
                                          ("capnorm", None)])
@pytest.mark.parametrize("limit", [1, 3, 8, 100])
def test_distance_methods_against_loop(mode, method, alpha, limit):
    heads = 5
    slopes = alibi.mode_slopes(mode, heads)
    directions = alibi.head_directions(mode, heads)
    scaling = Scaling(method, 1, limit, alpha)
    for q_len, k_len in ((12, 12), (1, 15), (4, 9)):
        got = alibi.alibi_bias(slopes, q_len, k_len, directions, scaling=scaling)
        want = naive_distance_bias(slopes.tolist(), q_len, k_len, directions, method, limit, scaling.alpha)
        torch.testing.assert_close(got, want)
        if limit >= k_len:  # within C nothing changes: exactly ALiBi
            assert torch.equal(got, alibi.alibi_bias(slopes, q_len, k_len, directions))


@pytest.mark.parametrize("alpha", [0.25, 0.5, 1.0, 2.0])
def test_log_tail_is_continuous_at_c_and_grows_slowly(alpha):
    """Within C the log tail is ALiBi itself; at C it is continuous; for
    alpha = 1 so is its slope; beyond C it lies below the cap (and above
    ALiBi for alpha <= 1)."""
    slopes, limit, length = alibi.get_slopes(8), 64, 4096
    scaling = Scaling("log", 1, limit, alpha)
    row = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 8, scaling=scaling)[:, 0].flip(-1)  # by distance
    plain = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 8)[:, 0].flip(-1)
    capped = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 8, scaling=Scaling("cap", 1, limit))[:, 0].flip(-1)
    assert torch.equal(row[:, : limit + 1], plain[:, : limit + 1])
    step_in, step_out = row[:, limit] - row[:, limit - 1], row[:, limit + 1] - row[:, limit]
    torch.testing.assert_close(step_out, step_in * alpha * limit * math.log1p(1 / limit), rtol=1e-4, atol=0)
    assert bool((row[:, limit + 1 :] < capped[:, limit + 1 :]).all())
    if alpha <= 1:  # C alpha ln(d / C) < d - C: never steeper than ALiBi (alpha > 1 is, just past C)
        assert bool((row[:, limit + 1 :] > plain[:, limit + 1 :]).all())
    assert bool((row.diff(dim=-1) < 0).all())  # still falling: farther keys never gain


def test_capnorm_holds_the_far_keys_weight_at_that_of_c_keys():
    """The property capnorm is for: past C the keys together weigh exactly what
    C keys at distance C would (sum exp(bias) = C exp(-m C)), however many there
    are; within C it is the cap, so ALiBi."""
    slopes, limit = alibi.get_slopes(4), 16
    scaling = Scaling("capnorm", 1, limit)
    for length in (3 * limit, 10 * limit, 100 * limit):
        row = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 4, scaling=scaling)[:, 0].double()
        far = row[:, : length - 1 - limit]  # distances > C
        torch.testing.assert_close(far.exp().sum(-1), limit * torch.exp(-slopes.double() * limit), rtol=1e-5, atol=0)
        plain = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 4)[:, 0]
        assert torch.equal(row[:, length - 1 - limit :].float(), plain[:, length - 1 - limit :])


def test_capped_bias_is_flat_past_the_cap_and_unchanged_before_it():
    """The property only ``cap`` has: past C every key gets the same bias, at
    most ``m * C`` in magnitude, whatever the length; within C it is ALiBi's."""
    slopes, cap, length = alibi.get_slopes(8), 64, 4096
    capped = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 8, scaling=Scaling("cap", 1, cap))[:, 0]
    plain = alibi.alibi_bias(slopes, 1, length, [alibi.LOOK_LEFT] * 8)[:, 0]
    far = capped[:, : length - cap]  # distances >= cap
    assert torch.equal(far, (-slopes * cap)[:, None].expand_as(far))
    assert torch.equal(capped[:, length - cap :], plain[:, length - cap :])
    assert bool((capped >= -slopes[:, None] * cap).all())


def test_asymmetric_bias_caps_both_sides():
    left, right = torch.tensor([0.5, 0.25]), torch.tensor([0.125, 1.0])
    got = alibi.alibi_bias((left, right), 9, 9, [alibi.LOOK_BOTH] * 2, scaling=Scaling("cap", 1, 3))
    for h in range(2):
        for i in range(9):
            for j in range(9):
                m = left[h] if j <= i else right[h]
                assert got[h, i, j].item() == pytest.approx(-float(m) * min(abs(i - j), 3))


def naive_causal_bias(slopes, q_len, k_len):
    bias = torch.empty(len(slopes), q_len, k_len)
    for h, m in enumerate(slopes):
        for a in range(q_len):
            i = k_len - q_len + a
            for j in range(k_len):
                bias[h, a, j] = -m * (i - j) if j <= i else float("-inf")
    return bias


@pytest.mark.parametrize("heads,q_len,k_len", [(6, 9, 9), (8, 1, 13), (3, 4, 11)])
def test_causal_bias_against_loop(heads, q_len, k_len):
    slopes = alibi.get_slopes(heads)
    expected = naive_causal_bias(slopes.tolist(), q_len, k_len)
    torch.testing.assert_close(causal_bias(slopes, q_len, k_len), expected)


def test_symmetric_bias_against_loop():
    slopes = alibi.get_slopes(5)
    got = symmetric_bias(slopes, 7, 7)
    for h in range(5):
        for i in range(7):
            for j in range(7):
                assert got[h, i, j].item() == pytest.approx(-slopes[h].item() * abs(i - j))


@pytest.mark.parametrize("dtype,rel", [(torch.float16, 2**-10), (torch.bfloat16, 2**-7)])
def test_low_precision_bias_is_accurate_at_16k(dtype, rel):
    """Relative distances keep each bias within one rounding of fp32; the
    differences between neighbouring keys (what softmax sees) survive."""
    slopes = alibi.get_slopes(8)
    length, rows = 16384, torch.tensor([0, 1, 2047, 8191, 16383])
    exact = torch.stack([causal_bias(slopes, 1, length, q_start=int(r))[:, 0] for r in rows], 1)
    low = torch.stack(
        [causal_bias(slopes, 1, length, dtype, q_start=int(r))[:, 0] for r in rows], 1
    ).float()
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(low))
    err = (low[finite] - exact[finite]).abs()
    assert bool((err <= rel * exact[finite].abs()).all())
    # the last query's nearest keys: adjacent differences are exactly the slope
    last = low[:, -1, -8:]
    torch.testing.assert_close(last.diff(dim=-1), slopes[:, None].to(dtype).float().expand(-1, 7))


@pytest.mark.slow
def test_fork_form_loses_neighbour_differences_in_fp16():
    """The fork's +m*j bias cannot tell adjacent far keys apart in fp16."""
    slopes = alibi.get_slopes(8)
    length = 16384
    fork = fork_causal_bias(slopes[:1], length, torch.float16)[0, -1].float()
    ours = causal_bias(slopes[:1], 1, length, torch.float16)[0, 0].float()
    # slope 1/2: exact neighbour difference 0.5; fp16 of 0.5 * 16383 rounds to steps of 4
    assert (fork[-8:].diff() == 0).any()
    assert torch.equal(ours[-8:].diff(), torch.full((7,), 0.5))
