"""core/layer.py: one layer's wiring to its stack, for every registered
method; and a position object's own kernel (``StackBias.own_kernels``)
run in place of the shared one of its name."""

import pytest
import torch
from torch import nn

from fairseq_alibi.core import kernels, layer
from fairseq_alibi.core.bias import CausalMask
from fairseq_alibi.core.errors import ConfigError
from fairseq_alibi.core.logit_scale import scaled_queries
from fairseq_alibi.core.positions import POSITIONS, build
from fairseq_alibi.core.scaling import Scaling

HEADS, HEAD_DIM, LAYERS = 4, 8, 4


def stack_of(name: str):
    params = {p.name: p.default for p in POSITIONS[name].params}
    return build(name, HEADS, HEAD_DIM, params, Scaling("none", 0.0, 32), LAYERS)


@pytest.mark.parametrize("name", list(POSITIONS))
def test_wire_gives_each_layer_its_object_and_checked_kernel(name):
    """Layer i reads ``at_layer(i).for_layer()``; a layer's own object is its
    submodule under ``layer_attribute``, the stack's is not; the kernel is
    ``check_kernel``'s (blocked on a bidirectional stack is sdpa, etc.)."""
    stack = stack_of(name)
    owned = []
    configured = "auto" if stack.own_kernel else "blocked"  # an own attention takes auto alone
    for index in range(LAYERS):
        module = nn.Module()
        kernel = layer.wire(module, stack, configured, 0.0, index=index)
        chosen = stack.at_layer(index)
        assert kernel == kernels.check_kernel(configured, module.positions)
        if module.positions is chosen:  # the stack's (or the hybrid's choice): read, not owned
            assert not any(p is module.positions for p in module.children())
        else:
            assert type(module.positions) is type(chosen.for_layer())
            assert getattr(module, module.positions.layer_attribute) is module.positions
            owned.append(module.positions)
    assert len({id(o) for o in owned}) == len(owned)  # a layer's own object is its own


def test_bind_call_rotates_and_binds():
    """RoPE's queries and keys turn, ALiBi's do not; FoX binds its gates to the input and carries ``c``."""
    q, k = torch.randn(2, HEADS, 5, HEAD_DIM), torch.randn(2, HEADS, 5, HEAD_DIM)
    x = torch.randn(5, 2, HEADS * HEAD_DIM)
    alibi = stack_of("alibi")
    q1, k1, bias, carry = layer.bind_call(alibi, q, k, x, 0, None)
    assert q1 is q and k1 is k and bias is alibi and carry is None
    q2, k2, _, _ = layer.bind_call(stack_of("rotary"), q, k, x, 3, None)
    assert not torch.equal(q2, q) and not torch.equal(k2, k)
    module = nn.Module()
    layer.wire(module, stack_of("fox"), "auto", 0.0, index=0)
    _, _, gates, carry = layer.bind_call(module.positions, q, k, x, 0, None)
    assert gates.batched and carry.shape == (2, HEADS, 5) and torch.equal(gates.cumulative, carry)


def test_an_objects_own_kernel_runs_in_place_of_the_shared_one():
    calls = []

    def own(q, k, v, bias, key_padding_mask, dropout_p):
        calls.append(q.shape)
        return torch.zeros_like(q), None

    class Toy(CausalMask):
        own_kernels = {"sdpa": own}

    q = torch.randn(1, HEADS, 6, HEAD_DIM)
    out, _ = kernels.attend(q, q, q, Toy(HEADS), "sdpa")
    assert calls == [q.shape] and not out.any()
    out, _ = kernels.attend(q, q, q, Toy(HEADS), "reference")  # a name it has no kernel for: the shared one
    assert calls == [q.shape] and out.abs().sum() > 0
    assert kernels.kernel_for("sdpa", CausalMask(HEADS)) is kernels.KERNELS["sdpa"]


OWN = [name for name in POSITIONS if stack_of(name).own_kernel]


@pytest.mark.parametrize("name", OWN)
def test_an_own_attention_takes_auto_alone_and_no_dropout(name):
    """A method that computes its attention itself runs no shared kernel: every other
    kernel name, and attention dropout, are refused in one line where the layer is built."""
    stack = stack_of(name)
    assert kernels.check_kernel("auto", stack.for_layer()) == "auto"
    for kernel in kernels.KERNEL_NAMES[1:]:
        with pytest.raises(ConfigError, match=f"alibi_attention='{kernel}' is not valid with this position method"):
            layer.wire(nn.Module(), stack, kernel, 0.0, index=0)
    with pytest.raises(ConfigError, match="attention_dropout=0.1 is not valid .* set --attention-dropout 0"):
        layer.wire(nn.Module(), stack, "auto", 0.1, index=0)


class OwnAttention(CausalMask):
    """An attention of its own that records what ``layer.attention`` hands it."""

    own_kernel = True

    def __init__(self, own_cache: bool, scaling=None):
        CausalMask.__init__(self, HEADS)
        self.own_cache, self.calls = own_cache, []
        if scaling is not None:
            self.scaling = scaling

    def attend(self, q, k, v, x, key_padding_mask, state, dropout_p):
        self.calls.append((q, k, x, key_padding_mask, state))
        return q * 2


@pytest.mark.parametrize("own_cache", [False, True])
def test_layer_attention_calls_the_objects_attend_with_scaled_queries_and_its_cache_state(own_cache):
    """In place of kernels.attend: the queries times the logit scale (logn, SSMax) of every
    key seen, cached ones included; the cache dict where the object keeps its own state,
    else None (the layer extended the cache); no weights."""
    logn = Scaling.parse("logn", 4)
    positions = OwnAttention(own_cache, logn)
    past, T = 7, 3
    q = torch.randn(2, HEADS, T, HEAD_DIM)
    k = torch.randn(2, HEADS, T if own_cache else past + T, HEAD_DIM)
    x = torch.randn(T, 2, HEADS * HEAD_DIM)
    pad = torch.zeros(2, past + T, dtype=torch.bool)
    pad[1, :2] = True
    ssmax = torch.rand(HEADS) + 0.5
    state = {"prev_key": torch.zeros(2, HEADS, past, HEAD_DIM)}
    out, weights = layer.attention(positions, "auto", q, k, k, x, past, pad, 0.0, True, ssmax, state)
    expected_q = scaled_queries(q, past + T, logn, pad, ssmax)
    assert not torch.equal(expected_q, q)  # past 4 keys logn and SSMax scale
    (got_q, got_k, got_x, got_pad, got_state), = positions.calls
    torch.testing.assert_close(got_q, expected_q)
    assert got_k is k and got_x is x and got_pad is pad and weights is None
    assert (got_state is state) == own_cache and (got_state is None) != own_cache
    torch.testing.assert_close(out, 2 * expected_q)
