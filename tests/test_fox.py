"""The Forgetting Transformer (``transformer_lm_fox``, ``core/fox.py``): its
bias against a loop over the gates, fixed gates equal to ALiBi, padded rows
equal to unpadded ones, every kernel equal to the reference, incremental
decoding equal to the full forward, gradients reaching the gates."""

import math

import pytest
import torch

import fairseq_alibi.models  # noqa: F401  (registers the models)
from fairseq_alibi.core import fox, kernels
from fairseq_alibi.core.fox import ForgetGates, GateBias, LayerForgetGate, log_gates
from fairseq_alibi.core.errors import ConfigError
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.models.attention import PositionMultiheadAttention

from test_position_models import TRAIN, build, data_dir, incremental, tokens  # noqa: F401 (data_dir: a fixture)

HEADS, DIM = 4, 32


def gate(seed: int = 0) -> LayerForgetGate:
    torch.manual_seed(seed)
    layer = ForgetGates(HEADS, DIM, Scaling()).for_layer()
    with torch.no_grad():  # gates spread over (0, 1), not all near the init's 0.5
        layer.proj.weight.normal_(std=0.4)
        layer.proj.bias.normal_(std=1.0)
    return layer


def loop_bias(layer: LayerForgetGate, x: torch.Tensor) -> torch.Tensor:
    """float64 ``[B, H, T, T]``: ``sum_{l=j+1..i} ln f_l`` written as loops, ``-inf`` right of each query."""
    T, B, _ = x.shape
    bias = torch.full((B, HEADS, T, T), float("-inf"), dtype=torch.float64)
    w, b = layer.proj.weight.double(), layer.proj.bias.double()
    for row in range(B):
        for h in range(HEADS):
            f = [1.0 / (1.0 + math.exp(-float(x[t, row].double() @ w[h] + b[h]))) for t in range(T)]
            for i in range(T):
                for j in range(i + 1):
                    bias[row, h, i, j] = sum(math.log(f[l]) for l in range(j + 1, i + 1))
    return bias


def test_the_bias_is_the_loop_over_the_gates():
    layer = gate()
    x = torch.randn(10, 2, DIM)
    with torch.no_grad():
        bias, carried = layer.bind(x, None, None)
        dense = bias.dense(10, 10, torch.float32, "cpu")
    assert dense.shape == (2, HEADS, 10, 10) and carried.shape == (2, HEADS, 10)
    torch.testing.assert_close(dense.double(), loop_bias(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "chunked", "blocked"])
def test_every_kernel_equals_the_reference(kernel):
    layer = gate(1)
    T = 70
    x = torch.randn(T, 2, DIM)
    q, k, v = (torch.randn(2, HEADS, T, 8) for _ in range(3))
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, :9] = True  # left padding in row 1
    with torch.no_grad():
        for mask in (None, pad):
            bias, _ = layer.bind(x, mask, None)
            expected, _ = kernels.attend(q, k, v, bias, "reference", mask)
            if kernel == "chunked":  # small query blocks: the per-block c_i - c_j, never the whole square
                out, _ = kernels.kernel_for("chunked", bias)(q, k, v, bias, mask, 0.0, chunk_size=16)
            else:
                out, _ = kernels.attend(q, k, v, bias, kernel, mask)
            real = slice(None) if mask is None else slice(9, None)
            torch.testing.assert_close(out[1, :, real], expected[1, :, real], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[0], expected[0], rtol=1e-5, atol=1e-5)


def test_blocked_trains_the_gates_as_the_reference():
    """CPU training's kernel (``blocked`` without dropout: the flash kernel,
    one bias per row and call, ``c``'s gradient from its backward) gives the
    gates, the input and q, k, v the reference kernel's gradients; right padding in one row (as fairseq pads a training batch:
    every query sees a real key), 150 queries (blocks of 128 and a partial one)."""
    layer = gate(2)
    T = 150
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, 2, DIM, generator=gen)
    q, k, v = (torch.randn(2, HEADS, T, 8, generator=gen) for _ in range(3))
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, -9:] = True
    weight = torch.randn(2, HEADS, T, 8, generator=gen)
    weight[1, :, -9:] = 0  # padded queries: read by no loss
    grads = []
    for kernel in ("blocked", "reference"):
        layer.zero_grad()
        leaves = [t.clone().requires_grad_() for t in (x, q, k, v)]
        bias, _ = layer.bind(leaves[0], pad, None)
        assert kernels.choose_kernel("auto", bias, False, T, T, 0.1) == "blocked"  # CPU training with dropout
        if kernel == "blocked":  # c_i - c_j per block from c: the whole square is never built
            bias.dense = None
        out, _ = kernels.attend(*leaves[1:], bias, kernel, pad)
        (out * weight).sum().backward()
        grads.append([t.grad for t in leaves] + [p.grad.clone() for p in layer.parameters()])
    # float32 both.  The flash path's dc is a difference of two sums (fox.FlashGates) whose total
    # over a row's keys is 0, so the gate's bias gradient (a sum of dc over the later tokens) loses digits:
    # 5e-5 of its norm from a float64 run here, against the reference kernel's 1e-5.
    for got, want in zip(*grads):
        assert (got - want).norm() <= 2e-4 * want.norm()


def test_key_windows_leave_out_only_keys_that_weigh_nothing():
    """Two heads with steep gates (f = 0.3: c falls by 1.2 a token) and two
    near 1, 700 queries: ``gate_windows`` starts the steep heads' late blocks
    past key 0 and the others at 0, and the blocked kernel (training) and the
    chunked one (inference; and with gradients on the steep heads, whose late
    blocks start past key 0) with those windows give the reference's output
    and gradients of q, k, v and c."""
    T, D = 700, 16
    gen = torch.Generator().manual_seed(8)
    gates = torch.tensor([0.3, 0.3, 0.999, 0.99])[None, :, None].expand(2, HEADS, T)
    jitter = torch.rand(2, HEADS, T, generator=gen) * 0.5 + 0.75  # gates vary per token
    c0 = (torch.log(gates) * jitter).cumsum(-1)
    q0, k0, v0 = (torch.randn(2, HEADS, T, D, generator=gen) for _ in range(3))
    first = fox.gate_windows(GateBias(c0), q0, k0)(512, 640)
    assert first[0] > 0 and first[1] > 0 and first[2] == first[3] == 0, first
    weight = torch.randn(2, HEADS, T, D, generator=gen)
    results = {}
    for kernel in ("blocked", "reference", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (q0, k0, v0, c0)]
        with torch.set_grad_enabled(kernel != "chunked"):
            bias = GateBias(leaves[3])
            out, _ = kernels.kernel_for(kernel, bias)(*leaves[:3], bias, None, 0.0)
        if kernel == "chunked":
            results[kernel] = [out]
            continue
        (out * weight).sum().backward()
        results[kernel] = [out.detach()] + [t.grad for t in leaves]
    torch.testing.assert_close(results["chunked"][0], results["reference"][0], rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("out", "q", "k", "v", "c"), results["blocked"], results["reference"]):
        assert (got - want).norm() <= 2e-4 * want.norm(), name
    # chunked with gradients (an explicit alibi_attention=chunked in training), the two steep heads alone:
    # a late block's bias is built over its window's keys only (GateBias.key_block from the heads' first key)
    steep = [t[:, :2].clone() for t in (q0, k0, v0, c0, weight)]
    for kernel in ("chunked", "reference"):
        leaves = [t.clone().requires_grad_() for t in steep[:4]]
        bias = GateBias(leaves[3])
        out, _ = kernels.kernel_for(kernel, bias)(*leaves[:3], bias, None, 0.0, **(
            {"chunk_size": 128} if kernel == "chunked" else {}))
        (out * steep[4]).sum().backward()
        results[kernel] = [out.detach()] + [t.grad for t in leaves]
    for name, got, want in zip(("out", "q", "k", "v", "c"), results["chunked"], results["reference"]):
        assert (got - want).norm() <= 2e-5 * want.norm(), name


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_inference_splits_each_block_and_matches_the_reference(dtype, tol):
    """Long inference (the chunked kernel: each block's earlier keys under one
    shared row of bias, merged with its own keys by log-sum-exp) against the
    reference kernel, gates from steep to near 1, float32 and bfloat16."""
    layer = gate(4)
    T = 300
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, 2, DIM, generator=gen)
    q, k, v = (torch.randn(2, HEADS, T, 8, generator=gen).to(dtype) for _ in range(3))
    with torch.no_grad():
        bias, _ = layer.bind(x, None, None)
        expected, _ = kernels.reference_kernel(q.float(), k.float(), v.float(), bias, None, 0.0)
        got, _ = kernels.kernel_for("chunked", bias)(q, k, v, bias, None, 0.0, chunk_size=64)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def test_kernel_choice_builds_no_square_bias_for_long_inputs():
    """Long inference: chunked; CPU training, with or without dropout: blocked
    (both build c_i - c_j per query block)."""
    bias = GateBias(torch.zeros(1, HEADS, 600))
    with torch.no_grad():
        assert kernels.choose_kernel("auto", bias, False, 600, 600) == "chunked"
    for dropout in (0.0, 0.1):
        assert kernels.choose_kernel("auto", bias, False, 600, 600, dropout) == "blocked"
    layer = gate()
    assert kernels.check_kernel("blocked", layer) == "blocked"  # a per-row bias: its gradient per row
    with pytest.raises(Exception, match="flex has a score_mod for ALiBi"):
        kernels.check_kernel("flex", layer)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_unpadded_rows(side):
    torch.manual_seed(2)
    attention = PositionMultiheadAttention(DIM, HEADS, ForgetGates(HEADS, DIM, Scaling()), kernel="sdpa").eval()
    with torch.no_grad():
        attention.forget_gate.proj.weight.normal_(std=0.4)
        attention.forget_gate.proj.bias.normal_()
    real, lead = 11, 5
    x = torch.randn(real, 1, DIM)
    padded = torch.randn(real + lead, 1, DIM)  # padding positions hold arbitrary vectors
    pad = torch.zeros(1, real + lead, dtype=torch.bool)
    span = slice(lead, None) if side == "left" else slice(0, real)
    padded[span] = x
    pad[0, :lead] = side == "left"
    pad[0, real:] = side == "right"
    with torch.no_grad():
        alone, _ = attention(x, x, x, need_weights=False)
        batch, _ = attention(padded, padded, padded, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(batch[span], alone, rtol=1e-5, atol=1e-5)


def test_fixed_gates_exp_minus_slope_equal_alibi(data_dir):
    """w = 0, b_h = logit(exp(-m_h)): every gate is exp(-m_h), D_ij = -m_h (i - j): ALiBi's model outputs."""
    alibi = build(data_dir, "alibi")
    fox = build(data_dir, "fox")
    slopes = alibi.decoder.positions.base_slopes.double()
    missing, unexpected = fox.load_state_dict(alibi.state_dict(), strict=False)
    assert not unexpected and missing and all(".forget_gate." in key for key in missing)
    with torch.no_grad():
        for layer in fox.decoder.layers:
            proj = layer.self_attn.forget_gate.proj
            proj.weight.zero_()
            proj.bias.copy_(torch.log(torch.exp(-slopes) / -torch.expm1(-slopes)))  # logit(exp(-m))
    ids = tokens(3 * TRAIN)
    with torch.no_grad():
        torch.testing.assert_close(fox.decoder(ids)[0], alibi.decoder(ids)[0], rtol=1e-4, atol=1e-4)
        fox.decoder.layers[0].self_attn.forget_gate.proj.bias.add_(0.5)
        assert not torch.allclose(fox.decoder(ids)[0], alibi.decoder(ids)[0], atol=1e-3)  # the gates matter


def test_incremental_decoding_equals_the_full_forward_past_the_training_length(data_dir):
    model = build(data_dir, "fox")
    ids = tokens(4 * TRAIN)
    with torch.no_grad():
        full, _ = model.decoder(ids)
        torch.testing.assert_close(incremental(model, ids), full, rtol=1e-4, atol=1e-4)


def test_each_layer_has_its_own_gates_and_they_learn(data_dir):
    model = build(data_dir, "fox").train()
    gates = [layer.self_attn.forget_gate for layer in model.decoder.layers]
    assert gates[0] is not gates[1]
    state = model.state_dict()
    assert {k for k in state if "forget_gate" in k} == {
        f"decoder.layers.{i}.self_attn.forget_gate.proj.{p}" for i in range(2) for p in ("weight", "bias")}
    out, _ = model.decoder(tokens(TRAIN))
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for g in gates for p in g.parameters())


def test_the_gate_starts_as_the_authors_init(data_dir):
    layer = ForgetGates(HEADS, 256, Scaling()).for_layer()
    assert torch.equal(layer.proj.bias, torch.zeros(HEADS))
    assert 0.015 < float(layer.proj.weight.std()) < 0.025


@pytest.mark.parametrize("k", [1.0, 2.5])
def test_fox_init_slopes_starts_each_gate_at_exp_minus_k_slope_and_with_zero_weights_is_alibi(data_dir, k):
    """``--fox-init-slopes k``: sigmoid of each head's gate bias is exp(-k m_h)
    (m_h read from the ALiBi model, gates computed here in float64) in a layer
    the model's stack makes (``build`` moves the model's own gates off their
    init); with those biases and zero gate weights the model is ALiBi with
    slopes k m_h."""
    alibi = build(data_dir, "alibi")
    fox = build(data_dir, "fox", "--fox-init-slopes", str(k))
    slopes = alibi.decoder.positions.base_slopes.double()
    torch.manual_seed(0)
    fresh = fox.decoder.positions.for_layer().proj
    torch.testing.assert_close(torch.sigmoid(fresh.bias.detach().double()), torch.exp(-k * slopes),
                               rtol=1e-6, atol=0.0)
    assert 0.015 < float(fresh.weight.std()) < 0.025  # the weights keep the authors' init
    missing, _ = fox.load_state_dict(alibi.state_dict(), strict=False)
    assert all(".forget_gate." in key for key in missing)
    with torch.no_grad():
        for layer in fox.decoder.layers:
            layer.self_attn.forget_gate.proj.weight.zero_()
            layer.self_attn.forget_gate.proj.bias.copy_(fresh.bias)
        alibi.decoder.positions.base_slopes.mul_(k)
        ids = tokens(2 * TRAIN)
        torch.testing.assert_close(fox.decoder(ids)[0], alibi.decoder(ids)[0], rtol=1e-4, atol=1e-4)


def test_data_independent_gates_stay_constant_per_head_and_learn_their_bias(data_dir):
    """``--fox-data-dependent 0`` (with ``--fox-init-slopes 1``): every layer's
    gate weight is 0 and gets no gradient, so after an optimizer step each
    head's gate is still one value for every token (ALiBi with learned
    slopes), while the gate biases did learn."""
    fresh = ForgetGates(HEADS, 256, Scaling(), 1.0, data_dependent=False).for_layer().proj
    assert not fresh.weight.requires_grad and torch.equal(fresh.weight, torch.zeros_like(fresh.weight))
    fox = build(data_dir, "fox", "--fox-data-dependent", "0", "--fox-init-slopes", "1").train()
    gates = [layer.self_attn.forget_gate.proj for layer in fox.decoder.layers]
    with torch.no_grad():  # build moved every parameter off its init
        for g in gates:
            g.weight.zero_()
    assert all(not g.weight.requires_grad for g in gates)
    before = [g.bias.detach().clone() for g in gates]
    optimizer = torch.optim.SGD([p for p in fox.parameters() if p.requires_grad], lr=1.0)
    fox.decoder(tokens(TRAIN))[0].float().logsumexp(-1).mean().backward()
    optimizer.step()
    assert all(g.weight.grad is None and torch.equal(g.weight, torch.zeros_like(g.weight)) for g in gates)
    assert all(not torch.equal(g.bias, b) for g, b in zip(gates, before))
    x = torch.randn(TRAIN, 2, gates[0].in_features)
    logf = log_gates(x, gates[0].weight, gates[0].bias)
    assert torch.equal(logf, logf[..., :1].expand_as(logf))


def test_gate_weights_started_at_zero_are_trained(data_dir):
    """``--fox-gate-init-std 0``: the gates start as one value per head for
    every token (weights exactly 0), but the weights take gradients and
    move, unlike ``--fox-data-dependent 0``; with that option the spread is
    refused in one sentence naming both."""
    fresh = ForgetGates(HEADS, 256, Scaling(), 1.0, init_std=0.0).for_layer().proj
    assert fresh.weight.requires_grad and torch.equal(fresh.weight, torch.zeros_like(fresh.weight))
    spread = ForgetGates(HEADS, 256, Scaling(), 1.0, init_std=0.5).for_layer().proj
    assert 0.4 < float(spread.weight.std()) < 0.6
    fox = build(data_dir, "fox", "--fox-gate-init-std", "0", "--fox-init-slopes", "1", perturb=False).train()
    gates = [layer.self_attn.forget_gate.proj for layer in fox.decoder.layers]
    assert all(g.weight.requires_grad and torch.equal(g.weight, torch.zeros_like(g.weight)) for g in gates)
    optimizer = torch.optim.SGD([p for p in fox.parameters() if p.requires_grad], lr=1.0)
    fox.decoder(tokens(TRAIN))[0].float().logsumexp(-1).mean().backward()
    optimizer.step()
    assert all(g.weight.grad is not None and bool(g.weight.ne(0).any()) for g in gates)
    with pytest.raises(ConfigError, match="fox_gate_init_std=0.1 .* fox_data_dependent=0"):
        build(data_dir, "fox", "--fox-gate-init-std", "0.1", "--fox-data-dependent", "0")


def test_gate_weights_wait_for_their_delay_in_fairseqs_training_step(data_dir):
    """``--fox-weight-delay N``: fairseq's own ``train_step`` (which reports the
    update to the model) leaves the gate weights without a gradient before
    update N, while the gate biases learn, and gives them one from update N
    on; refused with ``--fox-data-dependent 0``, which never trains them."""
    from fairseq import tasks
    from fairseq.optim.adam import FairseqAdam

    from conftest import fairseq_config

    argv = [str(data_dir), "--task", "language_modeling", "--arch", "transformer_lm_fox", "--tokens-per-sample",
            str(TRAIN), "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
            "--decoder-attention-heads", "4", "--fox-weight-delay", "2", "--fox-gate-init-std", "0",
            "--fox-init-slopes", "1", "--optimizer", "adam", "--lr", "0.01"]
    cfg = fairseq_config(argv)
    task = tasks.setup_task(cfg.task)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    optimizer = FairseqAdam(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    gates = [layer.self_attn.forget_gate.proj for layer in model.decoder.layers]
    ids = tokens(TRAIN)
    sample = {"net_input": {"src_tokens": ids[:, :-1].contiguous(), "src_lengths": torch.full((2,), TRAIN - 1)},
              "target": ids[:, 1:].contiguous(), "ntokens": 2 * (TRAIN - 1)}
    for update in range(4):
        biases = [g.bias.detach().clone() for g in gates]
        optimizer.zero_grad()
        task.train_step(sample, model, criterion, optimizer, update)
        optimizer.step()
        if update < 2:
            assert all(g.weight.grad is None and torch.equal(g.weight, torch.zeros_like(g.weight)) for g in gates)
        else:
            assert all(g.weight.grad is not None and bool(g.weight.grad.ne(0).any()) for g in gates)
        assert all(not torch.equal(g.bias, b) for g, b in zip(gates, biases))
    assert all(bool(g.weight.ne(0).any()) for g in gates)
    # where no trainer reports updates (the exported model under another trainer) nothing is held
    fresh = ForgetGates(HEADS, DIM, Scaling(), 1.0, weight_delay=1000).for_layer()
    fresh.bind(torch.randn(6, 2, DIM), None, None)[1].sum().backward()
    assert fresh.proj.weight.grad is not None
    with pytest.raises(ConfigError, match="fox_weight_delay=5 .* fox_data_dependent=0"):
        build(data_dir, "fox", "--fox-weight-delay", "5", "--fox-data-dependent", "0")


def test_the_gates_script_reads_each_layers_gates_from_a_checkpoint(data_dir, tmp_path, capsys):
    """``examples/retrieval/fox_gates.py``: per layer, sigmoid of each head's
    gate bias and the norm of its weight row, as the model holds them; a
    checkpoint without FoX gates refused in one ``error:`` line."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples" / "retrieval"))
    import fox_gates

    model = build(data_dir, "fox")
    path = tmp_path / "fox.pt"
    torch.save({"model": model.state_dict(), "optimizer_history": [{"num_updates": 7}]}, path)
    assert fox_gates.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(model.decoder.layers)
    for line, layer in zip(lines, model.decoder.layers):
        proj = layer.self_attn.forget_gate.proj
        gates = " ".join(f"{float(g):.2f}" for g in torch.sigmoid(proj.bias.detach()))
        norms = " ".join(f"{float(n):.2f}" for n in proj.weight.detach().norm(dim=1))
        assert "(7 updates)" in line and f"gate at bias {gates}; weight norms {norms}" in line
    torch.save({"model": build(data_dir, "alibi").state_dict()}, tmp_path / "alibi.pt")
    assert fox_gates.main([str(tmp_path / "alibi.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "holds no FoX forget gates" in err and err.count("\n") == 1
