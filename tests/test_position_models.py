"""Every ``transformer_lm_<position>`` model built in-process: its attention
against a naive reference written here, the KV cache equal to the full
forward, every kernel equal to the reference, extension methods that apply
accepted and the others refused in one line."""

import math
import types

import pytest
import torch
from fairseq import tasks

import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)
from fairseq_alibi import facts
from fairseq_alibi.core import kernels, rotary
from fairseq_alibi.core import positions as P
from fairseq_alibi.core.bias import ModuleBias
from fairseq_alibi.core.errors import ConfigError
from fairseq_alibi.core.errors import ScalingError
from fairseq_alibi.core.path import path_reference
from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.core.stickbreaking import stickbreaking_reference
from fairseq_alibi.core.scaling import Scaling
from fairseq_alibi.models.attention import rescale

from conftest import fairseq_config

TRAIN = 16
METHODS = list(POSITIONS)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dict")
    (path / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(40)))
    return path


def build(data_dir, position: str, *extra, perturb: bool = True):
    argv = [str(data_dir), "--task", "language_modeling", "--arch", facts.position_model(position),
            "--tokens-per-sample", str(TRAIN), "--decoder-layers", "2", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4", *extra]
    cfg = fairseq_config(argv)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    if not perturb:
        return model.eval()
    generator = torch.Generator().manual_seed(0)
    # learned position parameters away from their init, so they shape the scores: the stack's, and a layer's own
    learned = [model.decoder.positions] + [layer.self_attn.positions for layer in model.decoder.layers]
    seen = set()
    with torch.no_grad():
        for module in learned:
            if not isinstance(module, torch.nn.Module) or id(module) in seen:
                continue
            seen.add(id(module))
            for name, parameter in module.named_parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model.eval()


def tokens(length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, 40, (batch, length), generator=torch.Generator().manual_seed(seed))


def naive_scores(name: str, position, q, k, x=None):
    """``[B, H, T, T]`` attention logits written from each method's definition, entry by entry where it is cheap
    (``x``: the layer's input ``[T, B, C]``, FoX's gates read it)."""
    B, H, T, D = q.shape
    if name in ("rotary", "rnope"):  # pairs (x_k, x_{k+r/2}) as complex numbers times exp(i p theta)
        r = position.rotary_dim
        theta = torch.tensor([position.base ** (-2 * i / r) for i in range(r // 2)], dtype=torch.float64)
        turn = torch.exp(1j * torch.arange(T, dtype=torch.float64)[:, None] * theta)

        def rot(x):
            x = x.double()
            z = torch.complex(x[..., : r // 2], x[..., r // 2: r]) * turn
            return torch.cat([z.real, z.imag, x[..., r:]], dim=-1)

        q, k = rot(q), rot(k)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    bias = torch.zeros(B, H, T, T, dtype=torch.float64)
    if name == "fox":  # f_t = sigmoid(w_h . x_t + b_h) per row and head
        w, b = position.proj.weight.double(), position.proj.bias.double()
        gates = torch.sigmoid(torch.einsum("tbc,hc->bht", x.double(), w) + b[None, :, None])
    for i in range(T):
        for j in range(i + 1):
            d = i - j
            if name == "alibi":
                bias[:, :, i, j] = -position.base_slopes.double() * d
            elif name in ("t5bias", "kerple", "fire"):
                bias[:, :, i, j] = position.method.values(torch.tensor([[i]]), torch.tensor([[j]]))[:, 0, 0].double()
            elif name == "fox":  # sum over l = j+1 .. i of ln f_l
                for l in range(j + 1, i + 1):
                    bias[:, :, i, j] += torch.log(gates[:, :, l])
            elif name == "rnope" and d >= position.window:  # layer 0: a RoPE layer with a sliding window
                bias[:, :, i, j] = float("-inf")
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (scores + bias).masked_fill(~causal, float("-inf"))


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", METHODS)
def test_attention_equals_the_naive_definition(data_dir, name):
    model = build(data_dir, name)
    attention = model.decoder.layers[0].self_attn
    x = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, _ = attention(x, x, x, need_weights=False)
        q = attention.q_proj(x).view(12, 2, 4, 8).permute(1, 2, 0, 3)
        k = attention.k_proj(x).view(12, 2, 4, 8).permute(1, 2, 0, 3)
        v = attention.v_proj(x).view(12, 2, 4, 8).permute(1, 2, 0, 3)
        if attention.positions.own_kernel:  # not softmax over biased scores: the method's own float64 product
            heads = naive_own_attention(name, attention.positions, q, k, v, x)
        else:
            heads = torch.softmax(naive_scores(name, attention.positions, q, k, x), -1) @ v.double()
        expected = attention.out_proj(heads.float().permute(2, 0, 1, 3).reshape(12, 2, 32))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def naive_own_attention(name: str, position, q, k, v, x) -> torch.Tensor:
    """``[B, H, T, D]`` float64 output of a method with an attention of its own, from its
    naive reference (``stickbreaking_reference``: the product of the shares; ``path_reference``:
    every product of the H matrices), the layer's terms after it written out."""
    if name == "stickbreaking":  # the remainder times the head's vector, then a group norm per head
        out, remainder, _ = stickbreaking_reference(q, k, v)
        terms = position.terms
        out = out + remainder[..., None] * terms.head_bias.double()[:, None]
        mean, var = out.mean(-1, keepdim=True), out.var(-1, unbiased=False, keepdim=True)
        scale = terms.norm.weight.double().view(1, 4, 1, 8)
        shift = terms.norm.bias.double().view(1, 4, 1, 8)
        return (out - mean) / torch.sqrt(var + terms.norm.eps) * scale + shift
    assert name == "path", f"no naive definition of {name}'s own attention"
    w, beta, _ = position.proj(x)
    return path_reference(q, k, v, w, beta)[0]


def incremental(model, ids) -> torch.Tensor:
    state, steps = {}, []
    for t in range(ids.size(1)):
        out, _ = model.decoder(ids[:, : t + 1], incremental_state=state)
        steps.append(out[:, -1:])
    return torch.cat(steps, dim=1)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", METHODS)
def test_kv_cache_equals_the_full_forward(data_dir, name):
    model = build(data_dir, name)
    ids = tokens(3 * TRAIN)
    with torch.no_grad():
        full, _ = model.decoder(ids)
        torch.testing.assert_close(incremental(model, ids), full, rtol=1e-4, atol=1e-4)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("kernel", ["sdpa", "chunked"])
def test_kernels_equal_the_reference_past_the_training_length(data_dir, name, kernel):
    model = build(data_dir, name)
    if model.decoder.layers[0].self_attn.positions.own_kernel:
        pytest.skip(f"{name} runs its own attention, no shared kernel (tests/test_{name}.py: its kernel's long inputs)")
    ids = tokens(20 * TRAIN, batch=1)
    outputs = {}
    for path in ("reference", kernel):
        for layer in model.decoder.layers:
            layer.self_attn.kernel = path
        with torch.no_grad():
            outputs[path], _ = model.decoder(ids)
    torch.testing.assert_close(outputs[kernel], outputs["reference"], rtol=1e-4, atol=1e-4)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", METHODS)
def test_training_gradients_reach_the_position_parameters(data_dir, name):
    model = build(data_dir, name).train()
    ids = tokens(TRAIN)
    out, _ = model.decoder(ids)
    out.float().logsumexp(-1).mean().backward()
    positions = model.decoder.positions
    if isinstance(positions, torch.nn.Module):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in positions.parameters())
        state = model.state_dict()
        own = len(list(positions.parameters())) + len(list(positions.buffers()))
        assert sum(k.startswith("decoder.positions.") for k in state) == own
        assert not [k for k in state if ".self_attn.positions." in k]  # shared: saved once, not per layer


def test_fire_past_its_threshold_trains_through_blocked_as_through_the_reference(data_dir):
    """A 2-layer FIRE model whose threshold is below the input (training past
    it: each query block's bias built once per pass and read by both layers,
    their dS per block summed by autograd and taken back through it): the loss and
    every parameter's gradient through the blocked kernel equal those through
    the reference kernel (the dense bias of every pair)."""
    from unittest import mock

    from fairseq_alibi.core import kernels

    model = build(data_dir, "fire", "--attention-dropout", "0").train()
    fire = model.decoder.positions.method
    with torch.no_grad():
        fire.raw_threshold.fill_(math.log(math.expm1(0.4)))  # threshold 0.4 L: most queries past it
    ids = tokens(2 * TRAIN + 5)
    assert not fire.distance_only(ids.size(1))
    results = {}
    for path in ("blocked", "reference"):
        for layer in model.decoder.layers:
            layer.self_attn.kernel = path
        model.zero_grad()
        torch.manual_seed(0)  # the same draws of the model's other dropout
        with mock.patch.object(kernels, "blocked_causal_attention", wraps=kernels.blocked_causal_attention) as spy:
            out, _ = model.decoder(ids)
        assert [call.kwargs.get("blocks") is not None for call in spy.call_args_list] == [path == "blocked"] * (
            2 if path == "blocked" else 0)
        loss = out.float().logsumexp(-1).mean()
        loss.backward()
        results[path] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(results["blocked"][0], results["reference"][0])
    assert results["blocked"][1].keys() == results["reference"][1].keys()
    for name, want in results["reference"][1].items():
        got = results["blocked"][1][name]
        assert float((got - want).norm()) <= 1e-4 * float(want.norm()) + 1e-7, name


@pytest.mark.parametrize("name", ["t5bias", "kerple", "fire"])
def test_learned_biases_train_under_activation_checkpointing(data_dir, name):
    """``--checkpoint-activations`` reruns each layer's forward in its own
    backward; a learned bias built once per pass and shared by the layers
    would be backpropagated in the first rerun and found freed in the next
    (it crashed: "Trying to backward through the graph a second time").
    Each layer builds its own there: the same loss and gradients as without
    checkpointing, FIRE past its threshold too."""
    results = []
    for flags in ([], ["--checkpoint-activations"]):
        torch.manual_seed(0)  # the same weights
        model = build(data_dir, name, "--attention-dropout", "0", "--dropout", "0", *flags).train()
        if name == "fire":
            with torch.no_grad():
                model.decoder.positions.method.raw_threshold.fill_(math.log(math.expm1(0.4)))
        assert model.decoder.positions.share_graphs == (not flags)
        out, _ = model.decoder(tokens(2 * TRAIN + 5))
        loss = out.float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (ck_loss, ck_grads) = results
    torch.testing.assert_close(ck_loss, loss)
    assert ck_grads.keys() == grads.keys() and any(n.startswith("decoder.positions.") for n in grads)
    for n, want in grads.items():
        torch.testing.assert_close(ck_grads[n], want, rtol=1e-4, atol=1e-6, msg=n)


def test_fire_logs_its_learned_threshold_in_training_only(data_dir):
    """fairseq-train's log shows FIRE's threshold and ``c`` each update (the
    threshold decides which path a training pass takes); a forward in
    evaluation logs nothing, nor does a method without such scalars."""
    from fairseq.logging import metrics

    for name in ("fire", "t5bias", "alibi"):
        model = build(data_dir, name)
        with metrics.aggregate(new_root=True) as logged:
            model.train().decoder(tokens(TRAIN))
            model.eval().decoder(tokens(TRAIN))
        values = logged.get_smoothed_values()
        if name != "fire":
            assert "fire_threshold" not in values and "fire_c" not in values
            continue
        fire = model.decoder.positions.method
        assert values["fire_threshold"] == round(float(fire.threshold.detach()), 4)
        assert values["fire_c"] == round(float(fire.c.detach()), 4)
        assert logged["fire_threshold"].count == 1  # the training forward's only


@pytest.mark.slow
def test_fire_keeps_its_trained_threshold_under_another_training_length(data_dir):
    """The threshold's unit is saved with the weights: a FIRE model rebuilt with
    another alibi_train_length (an override) computes what it was trained to."""
    model = build(data_dir, "fire")
    other = build(data_dir, "fire", "--alibi-train-length", str(4 * TRAIN))
    assert float(other.decoder.positions.method.threshold) != float(model.decoder.positions.method.threshold)
    other.load_state_dict(model.state_dict())
    ids = tokens(2 * TRAIN, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(other.decoder(ids)[0], model.decoder(ids)[0])


def _stack(name: str):
    params = {p.name: p.default for p in POSITIONS[name].params}
    return P.build(name, 3, 8, params, Scaling("none", train_length=TRAIN))


#: The learned biases of one value per distance (T5's buckets, Kerple): ``ModuleBias.block`` lays them out.
TOEPLITZ = [name for name in POSITIONS if isinstance(_stack(name), ModuleBias) and _stack(name).toeplitz]


@pytest.mark.parametrize("name", TOEPLITZ)
@pytest.mark.parametrize("q_start,q_len,keys", [(0, 7, 7), (5, 3, 8), (10, 1, 11), (0, 300, 300), (20, 5, 10)])
def test_a_toeplitz_bias_per_distance_equals_the_pairwise_bias_and_its_gradients(name, q_start, q_len, keys):
    """``bias.toeplitz_block`` (one value per distance, laid out by ``unfold``) against the
    naive pairwise bias (``values`` of every (query, key)): the same floats, and through
    autograd the same parameter gradients (up to the order of float32 sums)."""
    from fairseq_alibi.core.alibi import positions as grid

    assert TOEPLITZ == ["t5bias", "kerple"]
    stack = _stack(name)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in stack.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    query, key = (p.long() for p in grid(q_len, keys, q_start, "cpu"))
    naive = stack.method.values(query, key).float().masked_fill(key > query, float("-inf"))
    block = stack.block(q_start, q_len, keys, torch.float32, "cpu")
    assert torch.equal(block, naive)
    weight = torch.randn(naive.shape, generator=generator).masked_fill(key > query, 0.0)
    grads = [torch.autograd.grad(b.masked_fill(key > query, 0.0).mul(weight).sum(), list(stack.parameters()))
             for b in (block, naive)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_learned_bias_is_built_once_per_pass(data_dir, monkeypatch):
    """T5's table is evaluated once per forward pass for all layers, and again in the next pass."""
    model = build(data_dir, "t5bias")
    calls = []
    values = type(model.decoder.positions.method).values
    monkeypatch.setattr(type(model.decoder.positions.method), "values",
                        lambda self, q, k: calls.append(1) or values(self, q, k))
    for layer in model.decoder.layers:
        layer.self_attn.kernel = "sdpa"
    with torch.no_grad():
        model.decoder(tokens(TRAIN))
        model.decoder(tokens(TRAIN))
    assert len(calls) == 2


def test_fire_past_its_threshold_builds_its_training_blocks_once_per_pass(data_dir, monkeypatch):
    """Training past FIRE's threshold, the blocks of its bias are built once
    per pass for all layers (not per layer), and again in the next pass."""
    from fairseq_alibi.core import causal_blocks

    model = build(data_dir, "fire", "--attention-dropout", "0").train()
    fire = model.decoder.positions.method
    with torch.no_grad():
        fire.raw_threshold.fill_(math.log(math.expm1(0.4)))
    calls = []
    reversed_block = type(fire).reversed_block
    monkeypatch.setattr(type(fire), "reversed_block", lambda self, *a: calls.append(a) or reversed_block(self, *a))
    ids = tokens(300)  # 3 blocks of causal_blocks.BLOCK queries
    assert -(-300 // causal_blocks.BLOCK) == 3
    for _ in range(2):
        out, _ = model.decoder(ids)
        out.float().sum().backward()
    assert len(calls) == 2 * 3


@pytest.mark.parametrize("name,spelling", [("rotary", "linear:4"), ("rotary", "ntk:4"), ("rotary", "yarn:4"),
                                           ("rotary", "ntk"), ("alibi", "ntk:4"), ("alibi", "cap")])
def test_extension_methods_that_apply(data_dir, name, spelling):
    model = build(data_dir, name)
    ids = tokens(4 * TRAIN, batch=1)
    with torch.no_grad():
        plain, _ = model.decoder(ids)
        rescale(model, Scaling.parse(spelling, TRAIN))
        scaled, _ = model.decoder(ids)
    assert (scaled - plain).abs().max() > 1e-3  # the method changes the numbers past L


def test_rotary_frequencies_follow_the_method(data_dir):
    model = build(data_dir, "rotary", "--rotary-fraction", "0.5", "--rotary-base", "500")
    positions = model.decoder.positions
    assert positions.rotary_dim == 4
    rescale(model, Scaling.parse("ntk:4", TRAIN))
    inv_freq, scale = positions.frequencies(4.0, "cpu")
    torch.testing.assert_close(inv_freq, rotary.extended_frequencies("ntk", 4.0, 4, 500.0)[0])
    rescale(model, Scaling.parse("ntk", TRAIN))  # dynamic: the factor of a 64-token pass is 4
    assert positions.scaling.factor_at(4 * TRAIN) == 4.0


@pytest.mark.parametrize("name,spelling", [("rotary", "cap"), ("rotary", "power:1:2"), ("alibi", "yarn:2"),
                                           ("t5bias", "linear:2"), ("nope", "ntk"), ("kerple", "cap"),
                                           ("fire", "yarn:2")])
@pytest.mark.fast_cases(1)
def test_a_method_that_does_not_apply_is_refused_in_one_line(data_dir, name, spelling):
    model = build(data_dir, name)
    with pytest.raises(ScalingError) as caught:
        rescale(model, Scaling.parse(spelling, TRAIN))
    message = str(caught.value)
    assert "\n" not in message and "does not apply to" in message
    assert ", ".join(POSITIONS[name].extensions) in message or name not in ("alibi", "rotary")
    with pytest.raises(ScalingError, match="does not apply to"):
        method, _, factor = spelling.partition(":")
        build(data_dir, name, "--alibi-interpolation", method, "--alibi-scale-factor", factor.split(":")[0] or "0")


@pytest.mark.slow
def test_position_models_refuse_flex_and_keep_no_dense_bias(data_dir):
    for name in ("t5bias", "kerple", "fire", "rotary", "nope"):
        model = build(data_dir, name)
        positions = model.decoder.positions
        assert not positions.supports_flex
        with pytest.raises(Exception, match="flex has a score_mod for ALiBi"):
            kernels.check_kernel("flex", positions)


@pytest.mark.parametrize("alibi_heads", [1, 3])
def test_rotary_alibi_heads_add_alibi_to_the_first_heads_and_cache_as_the_full_forward(data_dir, alibi_heads):
    """``--rotary-alibi-heads n`` (the retrieval diagnostic): the first n
    heads' logits are RoPE's plus ``-m_h (i - j)`` with the n steepest of
    ALiBi's slopes for 4 heads, the others RoPE's alone (the naive
    definition, fp64), in a full forward and in one with a KV cache; the
    checkpoint cannot be exported (no exported model holds the bias); more
    ALiBi heads than heads refused."""
    from fairseq_alibi.core.alibi import get_slopes

    model = build(data_dir, "rotary", "--rotary-alibi-heads", str(alibi_heads))
    attention = model.decoder.layers[0].self_attn
    x = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, _ = attention(x, x, x, need_weights=False)
        q, k, v = (proj(x).view(12, 2, 4, 8).permute(1, 2, 0, 3)
                   for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
        scores = naive_scores("rotary", attention.positions, q, k, x)
        distance = (torch.arange(12)[:, None] - torch.arange(12)[None, :]).double()
        scores[:, :alibi_heads] -= get_slopes(4)[:alibi_heads].double()[:, None, None] * distance
        probs = torch.softmax(scores, -1)
        expected = attention.out_proj((probs @ v.double()).float().permute(2, 0, 1, 3).reshape(12, 2, 32))
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        ids = tokens(3 * TRAIN)
        full, _ = model.decoder(ids)
        torch.testing.assert_close(incremental(model, ids), full, rtol=1e-4, atol=1e-4)
    from fairseq_alibi.export.custom import refuse_unmappable
    from fairseq_alibi.errors import ExportError

    with pytest.raises(ExportError, match="rotary-alibi-heads"):
        refuse_unmappable(types.SimpleNamespace(rotary_alibi_heads=alibi_heads))
    with pytest.raises(ConfigError, match="rotary_alibi_heads=5 is not valid with 4 heads; it must be between 0 and 4"):
        build(data_dir, "rotary", "--rotary-alibi-heads", "5")


def first_layer_weights(model, ids: torch.Tensor) -> torch.Tensor:
    """``[H, T, T]``: the first layer's attention weights in a forward of ``ids`` (one row)."""
    attention = model.decoder.layers[0].self_attn
    captured = []
    ask = attention.register_forward_pre_hook(
        lambda _m, args, kwargs: (args, dict(kwargs, need_weights=True, need_head_weights=True)), with_kwargs=True)
    keep = attention.register_forward_hook(lambda _m, _args, output: captured.append(output[1][:, 0]))
    try:
        with torch.no_grad():
            model.decoder(ids)
    finally:
        ask.remove()
        keep.remove()
    return captured[0]


def test_nope_first_layer_weighs_a_token_alike_at_every_distance(data_dir):
    """docs/retrieval.md ("the layout test"): a NoPE model's first layer
    scores a key by its token alone, so it gives one token the same weight
    near and far and cannot prefer "the nearest key before me", the head a
    two-layer model needs to find a record; RoPE's first layer can, the same
    token gets different weights at different distances."""
    ids = torch.tensor([[5, 7, 9, 7, 11, 13, 15, 17, 19, 21, 23, 7, 25]])  # token 7 at 1, 3 and 11; query at 12
    nope = first_layer_weights(build(data_dir, "nope"), ids)
    torch.testing.assert_close(nope[:, 12, 1], nope[:, 12, 11], rtol=1e-6, atol=0)
    torch.testing.assert_close(nope[:, 12, 3], nope[:, 12, 11], rtol=1e-6, atol=0)
    rotary = first_layer_weights(build(data_dir, "rotary"), ids)
    assert (rotary[:, 12, 1] - rotary[:, 12, 11]).abs().max() > 1e-3


# ----------------------------------------------------------------- methods with an attention of their own
#: Every method whose layers compute their attention themselves (``layer.attention``'s own_kernel),
#: with its variants: name -> (method, extra training flags).
OWN = {"stickbreaking": ("stickbreaking", ()), "path": ("path", ()),
       "path-fox": ("path", ("--path-forget-gate", "1")), "path-noconv": ("path", ("--path-short-conv", "0")),
       "path-fox-ssmax": ("path", ("--path-forget-gate", "1", "--ssmax"))}


def test_every_method_with_its_own_attention_has_cases():
    own = {name for name in METHODS if P.build(name, 4, 8, {p.name: p.default for p in POSITIONS[name].params},
                                               Scaling("none", 0.0, TRAIN), 2).own_kernel}
    assert own == {method for method, _ in OWN.values()}


def build_own(data_dir, case: str, *extra):
    method, flags = OWN[case]
    return build(data_dir, method, "--attention-dropout", "0", *flags, *extra)


def decoded(model, ids, pad=None, reorder=None) -> torch.Tensor:
    """Log-probs of fairseq's incremental decoding, token by token; ``reorder`` (step,
    new_order): the cache reordered at that step as beam search reorders it."""
    state, steps = {}, []
    for t in range(ids.size(1)):
        if reorder is not None and t == reorder[0]:
            model.decoder.reorder_incremental_state_scripting(state, reorder[1])
            ids = ids[reorder[1]]
            steps = [step[reorder[1]] for step in steps]  # the rows' log-probs so far follow them
        out = model.decoder(ids[:, : t + 1], incremental_state=state)
        steps.append(model.get_normalized_probs(out, log_probs=True)[:, -1:])
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("case", list(OWN))
def test_an_own_attention_decodes_with_its_cache_as_the_full_forward_and_reorders_for_beams(data_dir, case):
    """fairseq's incremental decoding (the method's own cache state: PaTH's transformed keys,
    its convolution's inputs, FoX's gate sums) equals the full forward, under logn too; beam
    search's reorder of the cache mid-row gives the reordered rows' full forward."""
    model = build_own(data_dir, case)
    ids = tokens(2 * TRAIN, batch=3)
    with torch.no_grad():
        full = model.get_normalized_probs(model(ids), log_probs=True)
        torch.testing.assert_close(decoded(model, ids), full, rtol=1e-4, atol=1e-4)
        order = torch.tensor([2, 0, 0])
        torch.testing.assert_close(decoded(model, ids, reorder=(9, order)), full[order], rtol=1e-4, atol=1e-4)
        if "logn" in POSITIONS[OWN[case][0]].extensions:
            rescale(model, Scaling.parse("logn", TRAIN // 4))
            logn = model.get_normalized_probs(model(ids), log_probs=True)
            assert (logn - full).abs().max() > 1e-3  # past L/4 keys logn sharpens
            torch.testing.assert_close(decoded(model, ids), logn, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(OWN))
@pytest.mark.parametrize("side", ["left", "right"])
def test_an_own_attention_scores_a_padded_row_as_its_unpadded_self(data_dir, case, side):
    """Through the model's layers, full forward and token by token with the cache (the
    layer's padding mask, and the method's: padded keys transparent to stick-breaking,
    beta = 0 and no convolution input for PaTH)."""
    model = build_own(data_dir, case)
    pad = model.decoder.dictionary.pad()
    ids = tokens(TRAIN, batch=2)
    short = ids[1, :11]
    padded = ids.clone()
    padded[1] = pad
    if side == "left":
        padded[1, -11:] = short
        real = slice(TRAIN - 11, TRAIN)
    else:
        padded[1, :11] = short
        real = slice(0, 11)
    with torch.no_grad():
        batch = model.get_normalized_probs(model(padded), log_probs=True)
        alone = model.get_normalized_probs(model(short[None]), log_probs=True)
        torch.testing.assert_close(batch[1, real], alone[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch[0], model.get_normalized_probs(model(ids[:1]), log_probs=True)[0],
                                   rtol=1e-4, atol=1e-4)
        # token by token with the cache, the padding mask of each step extended
        torch.testing.assert_close(decoded(model, padded)[1, real], alone[0], rtol=1e-4, atol=1e-4)


def test_ssmax_is_refused_in_one_line_where_no_logit_method_applies(data_dir):
    """SSMax scales a softmax's logits: stick-breaking has none (nor takes logn), so
    --ssmax is refused where the model is built; PaTH takes it (its case above)."""
    for name in METHODS:
        applies = "logn" in POSITIONS[name].extensions
        if applies:
            continue
        with pytest.raises(ConfigError, match=f"ssmax=True is not valid with position method {name}: .*--ssmax$"):
            build(data_dir, name, "--ssmax", "--attention-dropout", "0")
    assert [n for n in METHODS if "logn" not in POSITIONS[n].extensions] == ["stickbreaking"]
