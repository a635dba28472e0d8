"""The fused CPU loops (``core/native.py``): each loop against a float64
computation of its formula (extreme and NaN inputs, masks, lengths that are
not a whole number of vectors), the build's cache and its fallbacks (switched
off, no compiler), and the arguments it refuses."""

import logging
import os

import pytest
import torch

from fairseq_alibi.core import native, stickbreaking
from fairseq_alibi.core.stickbreaking import stickbreaking_attention, stickbreaking_reference


def sticks_float64(z, kept, pad, base):
    """The stick-breaking loop's formula in float64: ``(weights times the stick before each key, stick left)``."""
    heads, cols, rows = z.shape
    z = z.double()
    seen = torch.arange(cols)[:, None] >= base - torch.arange(rows)[None, :]
    if pad is not None:
        seen = seen[None] & (pad == 0)[..., None]
    beta = torch.where(seen, torch.sigmoid(z), 0.0)
    left = torch.where(seen, torch.sigmoid(-z), 1.0)
    after = torch.cumprod(left, 1) * kept.double()[:, None]  # the stick after each key
    before = torch.cat([kept.double()[:, None], after[:, :-1]], 1)
    return beta * before, after[:, -1]


def test_the_library_builds_here():
    """This machine has a compiler and AVX2: the loops must run (a skip would hide a broken build)."""
    assert native.status() == "built", native.status()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("heads,cols,rows,base", [(3, 40, 37, 9), (2, 33, 16, 0), (1, 5, 1, 3), (2, 17, 48, -4)])
def test_the_stickbreaking_loop_is_its_float64_formula(heads, cols, rows, base, in_place):
    """Scores from N(0, 6^2) and extremes (|z| of 100 and about float32's exp limit) in rows that fill
    whole vectors and in the scalar tail, a padded key, a stick that is not 1 before the block; the
    weights written into a buffer of their own or over the scores."""
    gen = torch.Generator().manual_seed(heads * cols + rows)
    z = 6 * torch.randn(heads, cols, rows, generator=gen)
    z[0, 2, : min(rows, 5)] = torch.tensor([100.0, -100.0, 87.5, -87.5, 0.0])[: min(rows, 5)]
    kept = 0.5 + torch.rand(heads, rows, generator=gen)
    pad = torch.zeros(heads, cols, dtype=torch.uint8)
    pad[-1, cols // 2] = 1
    want_weights, want_left = sticks_float64(z, kept, pad, base)
    weights, left = (z if in_place else torch.empty_like(z)), kept.clone()
    native.stickbreaking_terms(z, weights, left, pad, base)
    # float32's running product over up to 40 keys: a few units in the last place per key
    torch.testing.assert_close(weights.double(), want_weights, rtol=2e-6, atol=1e-37)
    torch.testing.assert_close(left.double(), want_left, rtol=2e-6, atol=1e-37)
    assert bool((weights[pad.bool()[..., None].expand_as(weights)] == 0).all())  # padding weighs exactly 0
    unseen = torch.arange(cols)[:, None] < base - torch.arange(rows)[None, :]
    assert bool((weights[:, unseen] == 0).all())


def test_nan_passes_through():
    z = torch.zeros(1, 3, 20)
    z[0, 1, 4] = float("nan")
    weights, kept = torch.empty_like(z), torch.ones(1, 20)
    native.stickbreaking_terms(z, weights, kept, None, 0)
    assert bool(weights[0, 1, 4].isnan()) and bool(kept[0, 4].isnan()) and bool(weights[0, 2, 4].isnan())
    assert not bool(weights[0, :, 5].isnan().any())


def test_wrong_arguments_are_refused():
    z = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="float32"):
        native.stickbreaking_terms(z.double(), z.double(), torch.ones(2, 4), None, 0)
    with pytest.raises(ValueError, match="kept"):
        native.stickbreaking_terms(z, torch.empty_like(z), torch.ones(2, 5), None, 0)
    with pytest.raises(ValueError, match="contiguous"):
        native.stickbreaking_terms(z.transpose(1, 2).contiguous().transpose(1, 2), torch.empty_like(z),
                                   torch.ones(2, 4), None, 0)
    with pytest.raises(ValueError, match="pad"):
        native.stickbreaking_terms(z, torch.empty_like(z), torch.ones(2, 4), torch.zeros(2, 3, dtype=torch.bool), 0)


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """The module as before its first use, building into ``tmp_path``."""
    monkeypatch.setattr(native, "_state", {"library": None, "tried": False, "why": "not built yet"})
    monkeypatch.setenv(native.DIRECTORY, str(tmp_path))
    return tmp_path


def test_the_build_is_kept_and_reused(fresh_state):
    assert native.library() is not None
    built = [name for name in os.listdir(fresh_state) if name.endswith(".so")]
    assert len(built) == 1 and built[0].startswith("fairseq_alibi_native_")
    stamp = os.stat(fresh_state / built[0]).st_mtime_ns
    native._state["tried"] = False  # a new process: the same source, compiler and flags load the same file
    assert native.library() is not None
    assert os.listdir(fresh_state) == built and os.stat(fresh_state / built[0]).st_mtime_ns == stamp


def attention_case():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 45, 8, generator=gen) for _ in range(3))
    pad = torch.zeros(2, 45, dtype=torch.bool)
    pad[1, :4] = True
    return q, k, v, pad


def test_switched_off_the_eager_path_gives_the_numbers(monkeypatch):
    q, k, v, pad = attention_case()
    expected, rem, _ = stickbreaking_reference(q, k, v, pad)
    monkeypatch.setenv(native.SWITCH, "0")
    assert native.library() is None and "switched off" in native.status()
    calls = []
    monkeypatch.setattr(stickbreaking, "native_forward", lambda *a: calls.append(1))
    with torch.no_grad():
        out, remainder = stickbreaking_attention(q, k, v, pad, block=16, key_block=16)
    assert not calls
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(remainder.double(), rem, rtol=2e-5, atol=2e-5)


def test_without_a_compiler_the_eager_path_runs_and_says_why(fresh_state, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh_state / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.library() is None
    assert native.status().startswith("not available") and "eager" in caplog.text
    assert not native.runs_for(torch.zeros(1))
    q, k, v, pad = attention_case()
    expected, _, _ = stickbreaking_reference(q, k, v, pad)
    with torch.no_grad():
        out, _ = stickbreaking_attention(q, k, v, pad, block=16, key_block=16)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


def test_a_failed_compilation_is_reported(fresh_state, monkeypatch):
    monkeypatch.setattr(native, "SOURCE", native.SOURCE + "\nthis is not C++;\n")
    assert native.library() is None
    assert "failed" in native.status()


def test_float64_and_other_devices_keep_the_eager_path():
    assert native.runs_for(torch.zeros(2, dtype=torch.float32))
    assert native.runs_for(torch.zeros(2, dtype=torch.bfloat16))  # computed in float32
    assert not native.runs_for(torch.zeros(2, dtype=torch.float64))
    assert not native.runs_for(torch.zeros(2, device="meta"))


def test_the_stickbreaking_kernel_runs_the_fused_forward_in_float32_evaluation(monkeypatch):
    """The kernel's evaluation path calls the whole fused forward for float32 (not the eager block terms);
    where torch's sgemm is not found, the eager block terms."""
    forwards, blocks = [], []
    real_forward, real_terms = stickbreaking.native_forward, stickbreaking._block_terms
    monkeypatch.setattr(stickbreaking, "native_forward", lambda *a: forwards.append(1) or real_forward(*a))
    monkeypatch.setattr(stickbreaking, "_block_terms", lambda *a: blocks.append(1) or real_terms(*a))
    q, k, v, pad = attention_case()
    with torch.no_grad():
        stickbreaking_attention(q, k, v, pad, block=16, key_block=16)
        assert forwards and not blocks
        monkeypatch.setitem(native._state, "sgemm", None)
        assert not native.forward_available()
        stickbreaking_attention(q, k, v, pad, block=16, key_block=16)
    assert len(forwards) == 1 and blocks


def test_the_fused_forward_refuses_what_it_cannot_run():
    q, k, v = torch.zeros(2, 5, 4), torch.zeros(2, 7, 4), torch.zeros(2, 7, 3)
    with pytest.raises(ValueError, match="float32"):
        native.stickbreaking_forward(q.double(), k, v, None, 4, 4, 1e-12)
    with pytest.raises(ValueError, match="at least T"):
        native.stickbreaking_forward(torch.zeros(2, 9, 4), k, v, None, 4, 4, 1e-12)
    with pytest.raises(ValueError, match="pad"):
        native.stickbreaking_forward(q, k, v, torch.zeros(2, 5, dtype=torch.uint8), 4, 4, 1e-12)
    with pytest.raises(ValueError, match="at least 1"):
        native.stickbreaking_forward(q, k, v, None, 0, 4, 1e-12)


@pytest.mark.parametrize("n,c,D", [(5, 8, 6), (3, 16, 16), (2, 5, 8)])
def test_the_path_block_terms_and_their_backward_are_autograds_in_float64(n, c, D):
    """PaTH's block terms (``path._block_terms``, through autograd in float64) against the C++ forward and its
    hand-written backward in float32: every output (the masked half of the local scores -inf in both) and
    the gradients of q, k, w and beta from random gradients of all four outputs."""
    from fairseq_alibi.core import path
    gen = torch.Generator().manual_seed(n * c + D)
    q, k = (torch.randn(n, c, D, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.nn.functional.normalize(torch.randn(n, c, D, generator=gen, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(n, c, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, w, beta)]
    terms = path._block_terms(*(t[:, None, None] for t in leaves))  # [n, B, H, c, ...] with B = H = 1
    local, carried, k_end, m = (t[:, 0, 0] for t in terms[:3] + terms[3])
    fused = native.path_block_terms(*(t.float().contiguous() for t in (q, k, w, beta)))
    seen = torch.isfinite(local)
    assert bool((torch.isinf(fused[0]) == ~seen).all())
    for got, want in zip(fused[:4], (local, carried, k_end, m)):
        torch.testing.assert_close(got.double().where(seen, 0.0) if got.shape == local.shape else got.double(),
                                   (want.where(seen, 0.0) if want.shape == local.shape else want).detach(),
                                   rtol=1e-5, atol=1e-5)
    grads = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (local, carried, k_end, m)]
    total = (local.where(seen, 0.0) * grads[0]).sum() + sum((t * g).sum() for t, g in zip((carried, k_end, m),
                                                                                          grads[1:]))
    want = torch.autograd.grad(total, leaves)
    got = native.path_block_terms_backward(*(t.float().contiguous() for t in (q, k, w, beta)), fused[4],
                                           *(g.float().contiguous() for g in grads))
    for g, e in zip(got, want):
        assert float((g.double() - e).abs().max()) < 1e-5 * float(e.abs().max())


@pytest.mark.parametrize("n,gated,padded", [(1, False, False), (4, True, True), (3, False, True)])
def test_the_path_sweep_and_its_backward_are_the_eager_sweeps(n, gated, padded):
    """PaTH's fused training sweep (``path._FusedSweep``: the C++ forward and backward) against the eager one
    (``path._TrainingSweep``, autograd's backward of nothing but its own) in float64 on the same inputs: the
    output and the gradients of every input, with the gate and key padding (a padded block's row of zeros)."""
    from fairseq_alibi.core import path
    gen = torch.Generator().manual_seed(n)
    B, H, C, D = 2, 3, 8, 6
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    local = rand(n, B, H, C, C).masked_fill(~lower, float("-inf"))
    carried, k_end, v = rand(n, B, H, C, D), rand(n, B, H, C, D), rand(n, B, H, C, D)
    m = torch.eye(D, dtype=torch.float64) + 0.3 * rand(n, B, H, D, D)
    c_new = -rand(n, B, H, C).abs().cumsum(-1) if gated else None
    key_pad = None
    if padded:
        key_pad = torch.zeros(n, B, 1, 1, C, dtype=torch.bool)
        key_pad[0, 1, ..., :5] = True
        local = local.masked_fill(key_pad, float("-inf"))
    inputs = [local, carried, k_end, v] + ([c_new] if gated else [])
    d_out = rand(n, B, H, C, D)
    results = []
    for sweep, dtype in ((path._TrainingSweep, torch.float64), (path._FusedSweep, torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        mm_ = m.to(dtype).requires_grad_()
        gate = leaves[4] if gated else None
        out = sweep.apply(*leaves[:4], gate, key_pad, mm_)
        grads = torch.autograd.grad((out.double() * d_out).sum(), leaves + [mm_])
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    seen = torch.isfinite(local)
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    for g, e in zip(got_grads, want_grads):
        if g.shape == local.shape:  # the masked scores' gradients are 0 in both
            g, e = g.double().where(seen, 0.0), e.where(seen, 0.0)
        assert float((g.double() - e).abs().max()) <= 1e-5 * float(e.abs().max()), g.shape  # n = 1: zeros


@pytest.mark.parametrize("n,merges", [(2, 1), (4, 1), (8, 2)])
def test_the_path_merge_and_its_backward_are_the_eager_merges(n, merges):
    """PaTH's fused block merge (``path._fused_merges``: the C++ merge and its backward, once per level)
    against the eager one (``path._merged_terms`` through autograd, float64): every merged term, the masked
    half of the scores -inf in both, and the gradients of every input from random gradients of all four."""
    from fairseq_alibi.core import path
    gen = torch.Generator().manual_seed(n + merges)
    B, H, C, D = 2, 3, 4, 6
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    inputs = (rand(n, B, H, C, C).masked_fill(~lower, float("-inf")), rand(n, B, H, C, D), rand(n, B, H, C, D),
              rand(n, B, H, D, D))
    results = []
    for merge, dtype in ((path._merged_terms, torch.float64), (path._fused_merges, torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        local, carried, k_end, (m,) = merge((leaves[0], leaves[1], leaves[2], (leaves[3],)), merges)
        outs = (local, carried, k_end, m)
        if not results:
            grads = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in outs]
        total = (local.double().masked_fill(torch.isinf(local), 0.0) * grads[0]).sum() + sum(
            (t.double() * g).sum() for t, g in zip(outs[1:], grads[1:]))
        results.append((outs, torch.autograd.grad(total, leaves)))
    (want, want_grads), (got, got_grads) = results
    assert got[0].shape == (n >> merges, B, H, C << merges, C << merges)
    assert bool((torch.isinf(got[0]) == torch.isinf(want[0])).all())
    for g, e in zip(got, want):
        seen = torch.isfinite(e)
        assert float((g.double()[seen] - e[seen]).abs().max()) < 1e-5 * float(e[seen].abs().max())
    seen = torch.isfinite(inputs[0])
    for g, e in zip(got_grads, want_grads):
        if g.shape == inputs[0].shape:
            g, e = g.double().where(seen, 0.0), e.where(seen, 0.0)
        assert float((g.double() - e).abs().max()) < 1e-5 * float(e.abs().max())


def test_the_path_forward_refuses_what_it_cannot_run():
    q, keys, values, beta = torch.zeros(2, 5, 4), torch.zeros(2, 7, 4), torch.zeros(2, 7, 3), torch.zeros(2, 5)
    with pytest.raises(ValueError, match="float32"):
        native.path_forward(q.double(), q, q, beta, values, keys, None, 0.0, 4, 8, 4, 4, False)
    with pytest.raises(ValueError, match="keys must be .* shape"):
        native.path_forward(q, q, q, beta, values, torch.zeros(2, 7, 5), None, 0.0, 4, 8, 4, 4, False)
    with pytest.raises(ValueError, match="contiguous"):
        native.path_forward(q, q, q, beta, values, torch.zeros(2, 4, 7).transpose(1, 2), None, 0.0, 4, 8, 4, 4, False)
    with pytest.raises(ValueError, match="at least 1"):
        native.path_forward(q, q, q, beta, values, keys, None, 0.0, 4, 0, 4, 4, False)
    with pytest.raises(ValueError, match="gate must be .* shape"):
        native.path_forward(q, q, q, beta, values, keys, torch.zeros(2, 5), 0.0, 4, 8, 4, 4, False)
    u, taps = torch.zeros(2, 5, 6), torch.zeros(3, 6)  # a batch of 2, 5 tokens, 2 heads of 3, K = 3
    assert native.path_w(u, taps, 2, torch.zeros(4, 2, 3), 1e-6).shape == (4, 5, 3)
    with pytest.raises(ValueError, match="4 heads of equal width"):
        native.path_w(u, taps, 4, None, 1e-6)
    with pytest.raises(ValueError, match="prefix must be .* shape"):
        native.path_w(u, taps, 2, torch.zeros(4, 3, 3), 1e-6)


def test_a_blas_that_computes_other_products_switches_the_fused_forwards_off(monkeypatch, caplog):
    """torch's sgemm is checked once against torch's own products before a fused forward runs: a routine that
    computes something else (here: nothing at all) is refused, with a warning, and the kernels' other paths
    give the numbers."""
    import ctypes

    noop = ctypes.CFUNCTYPE(None)(lambda: None)  # called with the sgemm's arguments, it writes nothing
    address = ctypes.cast(noop, ctypes.c_void_p).value
    assert native.forward_available() and native._sgemm_works(native._sgemm_address())
    assert not native._sgemm_works(address)
    monkeypatch.setattr(native, "_sgemm_address", lambda: address)
    monkeypatch.delitem(native._state, "sgemm")  # restored after the test
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not native.forward_available()
    assert "switched off" in caplog.text
    q, k, v, pad = attention_case()
    expected, _, _ = stickbreaking_reference(q, k, v, pad)
    with torch.no_grad():
        out, _ = stickbreaking_attention(q, k, v, pad, block=16, key_block=16)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("False", False), ("1", True), ("yes", True),
                                       (" ", True)])
def test_the_switch_takes_the_usual_spellings(value, on, monkeypatch):
    monkeypatch.setenv(native.SWITCH, value)
    assert native.switched_on() is on and (native.library() is not None) is on


def test_a_misspelt_switch_is_refused_in_one_line(monkeypatch):
    from fairseq_alibi.core.errors import ConfigError

    monkeypatch.setenv(native.SWITCH, "of")
    with pytest.raises(ConfigError, match=r"FAIRSEQ_ALIBI_NATIVE='of' is not valid: set it to 0"):
        native.library()


def test_scratch_hands_out_only_buffers_nothing_else_holds():
    """``native.Scratch``: a buffer is handed out again only once no view of it is alive; one that an autograd
    graph saved stays out of reach until that graph has run its backward (not after a backward that retains
    the graph), and the kept buffers are at most ``most``."""
    scratch = native.Scratch(most=3)
    a = scratch.take((2, 3))
    b = scratch.take((6,))
    assert a.data_ptr() != b.data_ptr()
    a_ptr = a.data_ptr()
    del a
    c = scratch.take((3, 2))  # a's buffer: nothing holds it
    assert c.data_ptr() == a_ptr and c.shape == (3, 2)
    smaller = scratch.take((4,))  # b and c are held: a new one
    assert smaller.data_ptr() not in (b.data_ptr(), c.data_ptr())
    del b, c, smaller

    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            buffer = scratch.take((6,))
            buffer.copy_(x)
            ctx.save_for_backward(buffer)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (buffer,) = ctx.saved_tensors
            return grad * buffer

    x = torch.arange(6.0, requires_grad=True)
    y = Saves.apply(x)
    held = [scratch.take((6,)) for _ in range(2)]  # the two other buffers: the saved one is not handed out
    assert len({t.data_ptr() for t in held}) == 2
    del held
    y.sum().backward(retain_graph=True)
    clobber = [scratch.take((6,)).fill_(-1.0) for _ in range(3)]  # the graph keeps its buffer: a new one
    x.grad = None
    y.sum().backward()
    assert torch.equal(x.grad, torch.arange(6.0))  # the saved buffer was not overwritten
    assert len(scratch) == 3
    del clobber, y
    scratch.clear()
    assert not len(scratch)


def test_scratch_serves_a_deep_models_layers_step_after_step():
    """Many buffers of a few sizes held at once (a model's layers from forward to backward), then let go: the
    next step takes every one of them again, nothing new allocated, and a size asked for that is smaller than
    any free buffer by more than half gets its own."""
    scratch = native.Scratch()
    shapes = [(6,), (4, 3), (5,)] * 40
    held = [scratch.take(shape) for shape in shapes]
    first = {t.data_ptr() for t in held}
    assert len(first) == len(shapes) == len(scratch)
    del held
    again = [scratch.take(shape) for shape in shapes]
    assert {t.data_ptr() for t in again} == first and len(scratch) == len(shapes)
    del again
    assert scratch.take((2,)).data_ptr() not in first  # 2 < 5 / 2: not served by a buffer of 5 or more
    assert scratch.take((3,)).data_ptr() in first  # a buffer of 5 or 6 serves 3


def test_scratch_keeps_inference_buffers_apart_and_hands_out_no_views():
    """A buffer made in inference mode serves only inference mode (torch refuses in-place writes to it, and
    saving it for a backward, outside), a normal one only calls outside it; what ``take`` hands out is no view
    (autograd treats outputs of its functions that are views apart)."""
    scratch = native.Scratch()
    with torch.inference_mode():
        made_inside = scratch.take((8,))
        inside_ptr = made_inside.data_ptr()
        del made_inside
    outside = scratch.take((8,))
    assert outside.data_ptr() != inside_ptr and not outside.is_inference() and outside._base is None
    outside.fill_(1.0)  # a normal tensor: written in place
    outside_ptr = outside.data_ptr()
    del outside
    with torch.inference_mode():
        again = scratch.take((8,))
        assert again.data_ptr() == inside_ptr
    normal = scratch.take((8,))
    assert normal.data_ptr() == outside_ptr


def test_a_fused_output_held_by_its_caller_is_never_written_again():
    """The fused calls' outputs live in kept buffers (``native.SCRATCH``): one the caller still holds keeps
    its values through later calls of every size; once dropped, the buffers serve the next calls again."""
    from fairseq_alibi.core import path
    gen = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(1, 2, 40, 8, generator=gen) for _ in range(4))
    w = torch.nn.functional.normalize(w, dim=-1)
    beta = torch.rand(1, 2, 40, generator=gen)
    with torch.no_grad():
        first, _ = path.path_attention(q, k, v, w, beta, block=4, chunk=8)
        kept = first.clone()
        for T in (40, 20, 30):  # later calls, the same size and smaller: none writes into the held output
            later, _ = path.path_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], w[:, :, :T], beta[:, :, :T],
                                           block=4, chunk=8)
            assert later.data_ptr() != first.data_ptr()
        assert torch.equal(first, kept)
        kept_before = len(native.SCRATCH)
        del first, later
        again, _ = path.path_attention(q, k, v, w, beta, block=4, chunk=8)
        assert torch.equal(again, kept) and len(native.SCRATCH) == kept_before  # nothing new allocated


def test_scratch_without_a_reference_count_never_reuses(monkeypatch):
    """Where torch cannot count a storage's references (``torch._C._storage_Use_Count`` missing, as an exported
    model may meet on another torch), every buffer is a fresh one."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    scratch = native.Scratch()
    scratch.take((6,))  # a buffer of 6, nothing referencing it once the statement is done
    assert len(scratch) == 1 and scratch._free((6, False)) is None  # not handed out again
    scratch.take((6,))
    assert len(scratch) == 2

