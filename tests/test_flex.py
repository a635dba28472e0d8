"""The ``flex`` kernel (``fairseq_alibi/core/flex.py``), compiled on the CPU as the
stand-in for the CUDA kernel.

torch 2.13 compiles FlexAttention for the CPU with inductor's C++ backend
(forward only): the same tracing of the ``score_mod`` closures, the same
guards, recompilations and block masks as on CUDA.  Every output is checked
against the ``reference`` kernel.  A graph takes seconds to compile (more on a
cold inductor cache), so the compiled checks are loops in one process: one case
of each kind of bias mode x method x padding (every one: ``slow``), then the
order the evaluation tools run (one model, lengths, then methods) through
fairseq layers, where a float that changed between compiles and a symbolic
length once broke the compile.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from conftest import error_lines, run_cli, tool, train_args
from test_attention import (  # noqa: F401 (dict_dir: a fixture)
    assert_as_accurate_as_reference, assert_close, build_lm, dict_dir, log_probs, make_attention, real_rows, right_padding, run,
)

from fairseq_alibi import errors
from fairseq_alibi.models import attention
from fairseq_alibi.core import alibi, flex
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.core.errors import KernelUnsupportedError
from fairseq_alibi.core import kernels as K
from fairseq_alibi.core.bias import AlibiBias

pytestmark = pytest.mark.skipif(not flex.flex_available(), reason="no FlexAttention in this torch")

HEADS, HEAD_DIM, L = 5, 16, 64  # 5 heads: split mode's middle head looks both ways
MODES = ("causal", "symmetric", "split")
#: Static and dynamic slope scaling and every distance method (150 keys: dynamic factor 2.3).
METHODS = ("none", "linear:2", "ntk", "cap:0.5", "log:1:0.25", "capnorm")


def graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def dynamic_from_this_process():
    """Automatic dynamic shapes decided by what this process sees, not by an
    earlier run's profile (local PGO in the inductor cache directory)."""
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        yield


def max_error(bias: AlibiBias, length: int, padded: bool, seed: int = 0) -> float:
    """Max |compiled flex - reference| over the real queries of a batch of two
    (the second right-padded to about half its length)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, generator=g) for _ in range(3))
    pad = right_padding([length, length // 2 + 1], length) if padded else None
    with torch.no_grad():
        out, _ = flex.flex_kernel(q, k, v, bias, pad, 0.0)
        ref, _ = K.reference_kernel(q, k, v, bias, pad, 0.0)
    diff = (out - ref).abs().transpose(1, 2)  # [B, T, H, D]
    return float((diff[~pad] if padded else diff).max())


@pytest.mark.parametrize("length", [1, 127, 128, 300])
def test_causal_block_mask_is_the_causal_mask(length):
    from torch.nn.attention.flex_attention import create_block_mask

    direct = flex.causal_block_mask(length, length, "cpu")
    generic = create_block_mask(flex.causal_mask_mod(0), None, None, length, length, device="cpu")
    assert torch.equal(direct.to_dense(), generic.to_dense())
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    assert torch.equal(direct.mask_mod(0, 0, q, k), k <= q)


#: (mode, padded, distance method) of every graph ``check_compiled`` compiled in this process.
COMPILED: set = set()


def check_compiled(cases) -> None:
    """Each (mode, padded, spelling) of ``cases``, in order, at 150 keys (two blocks, the second
    partial): compiled flex equals the reference, each (mode, distance method, padding)
    compiles its own graph, and a slope method reuses the graph of ``none`` compiled before it."""
    wrong, uncompiled = [], []
    for mode, padded, spelling in cases:
        bias = AlibiBias(HEADS, mode, Scaling.parse(spelling, L))
        before = graphs()
        error = max_error(bias, 150, padded)
        if error > 5e-6:
            wrong.append(f"{mode} {spelling} padded={padded}: max error {error:.1e}")
        new = graphs() - before
        graph = (mode, padded, "none" if spelling in ("linear:2", "ntk") else spelling)
        expected = 0 if graph in COMPILED else 1  # an earlier test of this process may have compiled it
        COMPILED.add(graph)
        if new != expected:
            uncompiled.append(f"{mode} {spelling} padded={padded}: {new} new graphs, {expected} expected")
    assert not wrong, wrong
    assert not uncompiled, uncompiled


@pytest.mark.slow  # compiling is a C++ build on the CPU: minutes on 2 loaded cores
def test_compiled_flex_modes_methods_and_padding(dynamic_from_this_process):
    """One of each kind, four compiles: a slope method after ``none``, a distance method, padding,
    the split mode (the full product is the slow test below)."""
    check_compiled([("causal", False, "none"), ("causal", False, "ntk"), ("causal", False, "capnorm"),
                    ("causal", True, "log:1:0.25"), ("split", True, "none")])


@pytest.mark.slow
def test_compiled_flex_every_mode_method_and_padding(dynamic_from_this_process):
    """Every bias mode x method x padding: 24 compiles (25 minutes on a loaded 2-core machine)."""
    check_compiled([(mode, padded, spelling) for mode in MODES for padded in (False, True) for spelling in METHODS])


@pytest.mark.slow
@pytest.mark.xfail(not flex.cpu_flex_verified(), strict=False,
                   reason="torch 2.13's compiled CPU FlexAttention is wrong at some lengths without AVX-512 "
                          "(refused to users there: flex._refuse_unverified_cpu)")
def test_compiled_flex_sequence_of_lengths_then_methods(dict_dir, dynamic_from_this_process):
    """What alibi-sweep does in one process: a model at 10 lengths, then
    rescaled under one method after another (two cap factors included), each
    at two lengths (a static, then a dynamic graph); then the encoders'
    padded attention.  Recompilations: at most 2 for the 10 lengths."""
    _, model = build_lm(dict_dir, "--alibi-attention", "flex", layers=2)
    _, reference = build_lm(dict_dir, "--alibi-attention", "reference", layers=2)
    tokens = torch.randint(4, 60, (2, 1600), generator=torch.Generator().manual_seed(1))

    def error(length: int) -> float:
        ids = tokens[:, :length]
        return float((log_probs(model, ids) - log_probs(reference, ids)).abs().max())

    before = graphs()
    sweep = [error(length) for length in range(160, 1601, 160)]
    assert max(sweep) < 1e-4, sweep
    assert 1 <= graphs() - before <= 2
    for spelling in ("ntk", "linear:2", "cap:0.5", "cap:2", "log:1:0.25", "capnorm"):
        for net in (model, reference):
            attention.rescale(net, Scaling.parse(spelling, 16))
        errors_at = [error(length) for length in (300, 200)]
        assert max(errors_at) < 1e-4, (spelling, errors_at)
    x = torch.randn(260, 2, 32)
    for mode in ("symmetric", "split"):
        for spelling in ("none", "capnorm"):
            scaling = Scaling.parse(spelling, L)
            layers = {kernel: make_attention(kernel, heads=4, mode=mode, scaling=scaling)
                      for kernel in ("flex", "reference")}
            for length in (200, 260):
                pad = right_padding([length, 90], length)
                with torch.no_grad():
                    out, ref = (layers[kernel](x[:length], x[:length], x[:length], key_padding_mask=pad,
                                               need_weights=False)[0] for kernel in ("flex", "reference"))
                real = ~pad.t()
                assert float((out - ref).abs()[real].max()) < 1e-5, (mode, spelling, length)


def test_slope_methods_share_one_variant_and_distance_methods_do_not():
    """What decides how many compiled functions a sweep builds: slope methods
    only change the slopes (tensor data), a distance method's numbers are
    constants of its graph."""
    def key(spelling, mode="causal", padded=False):
        bias = AlibiBias(HEADS, mode, Scaling.parse(spelling, L))
        return flex.variant(bias, 100, 100, "cpu", torch.zeros(1, 100, dtype=torch.bool) if padded else None)

    assert key("none") == key("linear:2") == key("ntk") == key("ntk:3")
    assert len({key("none"), key("cap"), key("cap:2"), key("log"), key("capnorm")}) == 5
    assert key("none") != key("none", padded=True) != key("none", mode="split")


@pytest.mark.slow
def test_training_with_flex_off_cuda_is_refused_in_one_line():
    attention_layer = make_attention("flex")
    x = torch.randn(20, 2, 32, requires_grad=True)
    with pytest.raises(KernelUnsupportedError) as caught:
        attention_layer(x, x, x, need_weights=False)
    message = errors.describe(caught.value)
    assert message == str(caught.value) and "\n" not in message
    assert "cannot train on cpu" in message and "alibi_attention=auto" in message
    with torch.no_grad():  # evaluation is fine
        attention_layer(x, x, x, need_weights=False)


@pytest.mark.parametrize("capability, refused", [("AVX2", True), ("DEFAULT", True), ("AVX512", False)])
def test_flex_on_a_cpu_without_avx512_is_refused_in_one_line(monkeypatch, capability, refused):
    """Compiled CPU FlexAttention gave wrong outputs at some lengths on an
    AVX2-only CPU (torch 2.13), so users get flex on the CPU only with
    AVX-512; the refusal names what to use instead, and the environment
    variable (which the suite sets) lifts it."""
    monkeypatch.delenv(flex.CPU_FLEX_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    q = torch.randn(1, HEADS, 8, 4)
    if refused:
        with pytest.raises(KernelUnsupportedError) as caught:
            flex._refuse_unverified_cpu(q)
        message = errors.describe(caught.value)
        assert "\n" not in message and capability in message
        assert "alibi_attention=auto or chunked" in message and flex.CPU_FLEX_ENV in message
    else:
        flex._refuse_unverified_cpu(q)
    monkeypatch.setenv(flex.CPU_FLEX_ENV, "1")
    flex._refuse_unverified_cpu(q)


def test_alibi_train_with_flex_on_cpu_stops_with_one_error_line(lm_data_bin, tmp_path):
    result = run_cli([tool("alibi-train"), *train_args(lm_data_bin, tmp_path, max_update=1),
                      "--alibi-attention", "flex"], expect_ok=False)
    assert result.returncode == 1, result.output[-2000:]
    lines = error_lines(result)
    assert len(lines) == 1 and "alibi_attention=flex cannot train on cpu" in lines[0], result.output[-2000:]
    assert "Traceback" not in result.output
    assert "loading train data" not in result.output  # refused at once, before fairseq loads the data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path; no GPU available")
@pytest.mark.parametrize("mode,spelling,padded", [
    ("causal", "none", False), ("causal", "capnorm", True), ("causal", "log:1:0.25", False),
    ("symmetric", "capnorm", True), ("split", "capnorm", True), ("split", "cap:0.5", False),
])
def test_cuda_compiled_flex_forward_and_backward_against_reference(mode, spelling, padded):
    """The Triton kernels, with their backward, through a fairseq layer; 300
    tokens (not a multiple of the 128-blocks)."""
    scaling = Scaling.parse(spelling, L)
    x = torch.randn(300, 2, 64).cuda()
    pad = right_padding([300, 170], 300).cuda() if padded else None
    assert_as_accurate_as_reference("flex", torch.float32, x, pad, embed_dim=64, mode=mode, scaling=scaling)


@pytest.mark.slow
def test_the_cpu_flex_check_compares_with_sdpa_and_says_so(monkeypatch, capsys):
    """benchmarks/cpu_flex_check.py: one line per length, its verdict agreeing
    with its exit status, and a difference it would report when the kernel is
    off (a stand-in that adds 1 to every output)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_flex_check.py"
    spec = importlib.util.spec_from_file_location("cpu_flex_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "LENGTHS", (64,))
    status = check.main()
    out = capsys.readouterr().out
    assert "   64 tokens: largest difference from SDPA" in out
    assert (status == 0) == out.rstrip().endswith("exact") and status in (0, 1)
    monkeypatch.setattr(check, "flex_attention", lambda q, k, v: check.F.scaled_dot_product_attention(q, k, v) + 1)
    assert check.main() == 1
    assert "NOT exact" in capsys.readouterr().out
