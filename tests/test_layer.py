"""core/layer.py: one layer's wiring to its stack, for every registered
method; and a position object's own kernel (``StackBias.own_kernels``)
run in place of the shared one of its name."""

import pytest
import torch
from torch import nn

from fairseq_alibi.core import kernels, layer
from fairseq_alibi.core.bias import CausalMask
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
    for index in range(LAYERS):
        module = nn.Module()
        kernel = layer.wire(module, stack, "blocked", 0.0, index=index)
        chosen = stack.at_layer(index)
        assert kernel == kernels.check_kernel("blocked", module.positions)
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
