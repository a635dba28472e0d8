"""RNoPE-SWA (``transformer_lm_rnope``, ``core/hybrid.py``): windowed RoPE
layers against an explicit band mask on every kernel (the blocked and chunked
kernels skipping the key blocks left of the window), NoPE layers with full
attention interleaved, the KV cache equal to the full forward, extension
methods reaching the layers they apply to."""

import math

import pytest
import torch

import fairseq_alibi.models  # noqa: F401  (registers the models)
from fairseq_alibi.core import causal_blocks, kernels
from fairseq_alibi.core.bias import CausalMask
from fairseq_alibi.core.hybrid import HybridPositions, WindowedRotary
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.models.attention import rescale

from test_position_models import TRAIN, build, data_dir, incremental, tokens  # noqa: F401 (data_dir: a fixture)


def explicit_window(q, k, v, window):
    """softmax over keys j with 0 <= i - j < window, written with an explicit boolean mask (float64)."""
    T = q.size(2)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    seen = (j <= i) & (i - j < window)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.size(-1))
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v.double()


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "chunked", "blocked"])
def test_the_window_is_the_explicit_mask_on_every_kernel(kernel):
    torch.manual_seed(0)
    T, window = 300, 37
    bias = WindowedRotary(4, 8, window)
    q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
    with torch.no_grad():
        out, _ = kernels.attend(q, k, v, bias, kernel)
    torch.testing.assert_close(out.double(), explicit_window(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel,dropout", [("reference", 0.0), ("reference", 0.3), ("sdpa", 0.0), ("blocked", 0.0),
                                            ("blocked", 0.3)])
def test_a_padded_query_whose_window_holds_only_padding_gets_zeros_not_nan(kernel, dropout):
    """A right-padded row shorter than the window's reach: its padded queries
    past ``length + window`` see only padded keys.  Every kernel gives them
    output 0 and every gradient stays finite (a NaN there, ignored by the
    loss, reached every weight through 0 * NaN: RNoPE with attention dropout
    failed at L = 2048 on a short last batch); the real queries equal the
    explicit windowed attention over the row's own keys."""
    torch.manual_seed(0)
    T, window, short = 100, 16, 30
    bias = WindowedRotary(4, 8, window)
    pad = torch.arange(T)[None, :] >= torch.tensor([T, short])[:, None]
    q, k, v = (torch.randn(2, 4, T, 8, requires_grad=True) for _ in range(3))
    out, _ = kernels.attend(q, k, v, bias, kernel, key_padding_mask=pad, dropout_p=dropout)
    out.sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))
    assert bool(out.isfinite().all()) and bool((out[1, :, short + window - 1:] == 0).all())
    if dropout == 0:
        with torch.no_grad():
            torch.testing.assert_close(out[1, :, :short].double(), explicit_window(
                q[1:, :, :short], k[1:, :, :short], v[1:, :, :short], window)[0], rtol=1e-5, atol=1e-5)


def test_masked_softmax_gives_a_row_without_keys_zeros_and_zero_gradients():
    scores = torch.tensor([[0.5, float("-inf"), 1.0], [float("-inf")] * 3]).requires_grad_()
    probs = kernels.masked_softmax(scores)
    torch.testing.assert_close(probs[0], torch.softmax(scores[0].detach(), -1))
    assert probs[1].tolist() == [0.0, 0.0, 0.0]
    (probs * torch.arange(6.0).view(2, 3)).sum().backward()
    assert scores.grad.isfinite().all() and scores.grad[1].tolist() == [0.0, 0.0, 0.0]


def test_the_blocked_and_chunked_kernels_skip_the_blocks_left_of_the_window():
    T, window = 600, 50
    first = kernels.sliding_windows(WindowedRotary(4, 8, window), 4, 0)
    calls = causal_blocks._block_calls(T, T, causal_blocks.block_size(T), 4, first)
    assert any(start > 0 and lo > 0 for start, _, _, lo, _ in calls)  # later blocks start past key 0
    for start, stop, _, lo, _ in calls:
        assert lo <= max(0, start - window + 1)  # and never past a key the block's first query sees
    assert kernels.sliding_windows(CausalMask(4), 4, 0) is None  # full attention: nothing skipped


@pytest.mark.slow
def test_layers_interleave_windowed_rope_and_full_nope(data_dir):
    model = build(data_dir, "rnope", "--decoder-layers", "4", "--rnope-nope-every", "2")
    kinds = [type(layer.self_attn.positions) for layer in model.decoder.layers]
    assert kinds == [WindowedRotary, CausalMask, WindowedRotary, CausalMask]
    assert model.decoder.layers[0].self_attn.positions.window == TRAIN // 2  # the default: half of L
    assert model.decoder.layers[1].self_attn.positions.window is None
    other = build(data_dir, "rnope", "--rnope-window", "5")
    assert other.decoder.layers[0].self_attn.positions.window == 5
    assert isinstance(other.decoder.positions, HybridPositions)


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("layers,nope_layers", [(2, [1]), (3, [2]), (4, [3]), (9, [3, 7])])
def test_the_default_interleaving_has_a_nope_layer_at_every_depth(data_dir, layers, nope_layers):
    """0 (the default): the paper's every 4th layer, or the last layer of a shallower stack."""
    model = build(data_dir, "rnope", "--decoder-layers", str(layers))
    found = [i for i, layer in enumerate(model.decoder.layers) if type(layer.self_attn.positions) is CausalMask]
    assert found == nope_layers


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("flags,message", [
    (["--decoder-layers", "2", "--rnope-nope-every", "4"], "rnope_nope_every=4 with 2 layers leaves no NoPE layer"),
    (["--decoder-layers", "1"], "rnope needs at least 2 layers"),
])
def test_a_stack_that_is_not_a_hybrid_is_refused(data_dir, flags, message):
    with pytest.raises(Exception, match=message):
        build(data_dir, "rnope", *flags)


def test_every_layer_nope_is_refused_as_the_nope_method():
    """Checked once, by the registry (the param's range), before anything is built."""
    from fairseq_alibi.core import positions

    params = {p.name: p.default for p in positions.position("rnope").params}
    with pytest.raises(Exception, match=r"rnope_nope_every=1 is not valid; it must be 0 \(4, or the number"):
        positions.check_params("rnope", dict(params, rnope_nope_every=1, rnope_window=8), layers=4)


def test_a_nope_layer_attends_to_every_key_without_rotation(data_dir):
    model = build(data_dir, "rnope", "--rnope-nope-every", "2")
    attention = model.decoder.layers[1].self_attn
    T = 3 * TRAIN
    x = torch.randn(T, 1, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, _ = attention(x, x, x, need_weights=False)
        q, k, v = (proj(x).view(T, 1, 4, 8).permute(1, 2, 0, 3)
                   for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
        expected = explicit_window(q, k, v, T + 1).float()
        expected = attention.out_proj(expected.permute(2, 0, 1, 3).reshape(T, 1, 32))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("spelling", ["none", "ntk:2", "logn"])
def test_kv_cache_equals_the_full_forward(data_dir, spelling):
    model = build(data_dir, "rnope", "--decoder-layers", "4", "--rnope-nope-every", "2")
    rescale(model, Scaling.parse(spelling, TRAIN))
    ids = tokens(3 * TRAIN)
    with torch.no_grad():
        full, _ = model.decoder(ids)
        torch.testing.assert_close(incremental(model, ids), full, rtol=1e-4, atol=1e-4)


def test_extension_methods_reach_the_layers_they_apply_to(data_dir):
    model = build(data_dir, "rnope", "--rnope-nope-every", "2")
    rope, nope = (layer.self_attn.positions for layer in model.decoder.layers)
    rescale(model, Scaling.parse("ntk:4", TRAIN))
    assert rope.scaling.method == "ntk" and nope.scaling.method == "none"
    rescale(model, Scaling.parse("logn", TRAIN))
    assert rope.scaling.method == "logn" == nope.scaling.method
    with pytest.raises(Exception, match="does not apply to rnope"):
        rescale(model, Scaling.parse("cap", TRAIN))
