"""FlexAttention with ALiBi: the ``flex`` kernel, compiled on CUDA and on the CPU.

Pure torch, like ``kernels.py`` (which registers :func:`flex_kernel`); it
travels with exported models.  ALiBi is a ``score_mod`` that calls
:func:`alibi.bias` on FlexAttention's index tensors, and a causal stack skips
the blocks above the diagonal through a ``BlockMask`` written down block by
block: nothing ``T x T`` is materialized.

FlexAttention is compiled on CUDA (Triton kernels, forward and backward) and on
the CPU (inductor's C++ backend, forward only: torch has no CPU backward for
it).  The CPU path is the same tracing of the same ``score_mod`` closures and
block masks, with the same guards and recompilations, so the tests use it as
the stand-in for the GPU kernel.  Training (a gradient wanted) with ``flex``
off CUDA is refused in one line.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import types
from typing import Callable, Dict, Hashable, Optional

import torch
from torch import Tensor

from .alibi import bias as alibi_bias
from .bias import AlibiBias, masked_value_for
from .errors import KernelUnsupportedError
from .scaling import DISTANCE_METHODS, NO_SCALING, Scaling

#: FlexAttention's block size (queries and keys).
FLEX_BLOCK = 128



def flex_available() -> bool:
    """FlexAttention can be imported (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------- score_mod and block mask
def score_mod(bias: AlibiBias, q_len: int, k_len: int, device, key_padding_mask: Optional[Tensor] = None):
    """FlexAttention ``score_mod`` equal to ``bias.dense``: :func:`alibi.bias`
    of one (head, query, key), with ``-inf`` at the keys a ``[B, S]`` padding
    mask marks.  The causal ``-inf`` also comes from :func:`causal_block_mask`,
    which skips the blocks above the diagonal."""
    slopes, scaling = bias.slopes(k_len, device), distance_scaling(bias.scaling)
    # The lengths as tensors, not ints: data, not guards; and a symbolic key
    # count in a score_mod breaks inductor's CPU template (torch 2.13: C++ code
    # naming an undeclared ``cur_qSplitSize0``; docs/performance.md).
    offset, keys = bias.cached("flex_lengths", (q_len, k_len, str(device)),
                               lambda: tuple(torch.tensor(n, device=device) for n in (k_len - q_len, k_len)))
    masked = masked_value_for(bias.mode, torch.float32)
    direction = bias.direction(device)
    per_head = direction.flatten() if isinstance(direction, Tensor) else None

    def bias_mod(score, b, h, q_idx, kv_idx):
        look = direction if per_head is None else per_head[h]
        return score + alibi_bias(slopes[h], q_idx + offset, kv_idx, scaling, look, masked, keys)

    return with_key_padding(bias_mod, key_padding_mask)


def with_key_padding(mod, key_padding_mask: Optional[Tensor]):
    """``mod`` with ``-inf`` at the keys a ``[B, S]`` padding mask marks."""
    if key_padding_mask is None:
        return mod
    pad = key_padding_mask.to(torch.bool)

    def padded_mod(score, b, h, q_idx, kv_idx):
        return torch.where(pad[b, kv_idx], float("-inf"), mod(score, b, h, q_idx, kv_idx))

    return padded_mod


def causal_mask_mod(offset: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask_mod


def causal_block_mask(q_len: int, k_len: int, device):
    """The causal ``BlockMask`` for queries that are the last ``q_len`` of
    ``k_len`` keys.  For ``q_len == k_len`` (every full forward) it is written
    down directly, block by block, in O((T / 128)^2) memory: query block ``i``
    sees key blocks ``0 .. i-1`` in full and block ``i`` through the mask_mod.
    Other shapes go through ``create_block_mask``."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    mask_mod = causal_mask_mod(k_len - q_len)
    if q_len != k_len:
        return create_block_mask(mask_mod, None, None, q_len, k_len, device=device)
    n = (q_len + FLEX_BLOCK - 1) // FLEX_BLOCK
    rows = torch.arange(n, device=device, dtype=torch.int32)
    cols = torch.arange(n, device=device, dtype=torch.int32)
    kv_num_blocks = torch.ones(1, 1, n, device=device, dtype=torch.int32)
    # Row i: its diagonal block first, the remaining entries are never read.
    kv_indices = ((rows[:, None] + cols[None, :]) % n)[None, None].contiguous()
    full_kv_num_blocks = rows[None, None].clone()
    full_kv_indices = cols.expand(n, n)[None, None].contiguous()
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(q_len, k_len),
    )


# ----------------------------------------------------------------- compiled FlexAttention
#: Graphs one variant may compile (dynamo's default limit is 8, past which it
#: would run FlexAttention eagerly, materializing the scores, and say so once).
RECOMPILE_LIMIT = 32
#: One compiled FlexAttention per :func:`variant` (see :func:`flex_function`).
_compiled: Dict[Hashable, Callable] = {}


def variant(bias: AlibiBias, q_len: int, k_len: int, device, key_padding_mask: Optional[Tensor]) -> Hashable:
    """What makes the compiled graphs of one call differ from another's, other
    than shapes: the device, the bias mode (head directions, masked value), the
    distance method with its numbers (slope methods only change the slopes,
    tensor data), key padding, and whether queries and keys are one sequence."""
    return (torch.device(device).type, bias.mode, distance_scaling(bias.scaling), key_padding_mask is not None,
            q_len == k_len)


def distance_scaling(scaling: Scaling) -> Scaling:
    """The part of ``scaling`` the ``score_mod`` needs beyond the slopes: the
    spec of a distance method, else no scaling (``linear``/``ntk`` are already
    in ``AlibiBias.slopes``; passing them would only add guards on their name)."""
    return scaling if scaling.method in DISTANCE_METHODS else NO_SCALING


def flex_function(key: Hashable) -> Callable:
    """Compiled FlexAttention, one function per ``key`` (a :func:`variant`).

    Why one per variant: dynamo keeps its graphs, counts recompilations and
    remembers which inputs changed (automatic dynamic shapes, also across
    processes: local PGO) per function, by file, line and name.  Each variant
    is a function of its own name, so within one only shapes vary (a static
    and a dynamic graph per shape class) and its float constants (a cap's C,
    a log tail's alpha, the masked value) never change: a float that changed
    would become a symbolic input, which FlexAttention's score_mod lowering
    cannot take (torch 2.13: ``LoweringException: RuntimeError:
    unbacked_bindings`` at ``aten._local_scalar_dense``; docs/performance.md
    has the reproduction)."""
    if key not in _compiled:
        from torch.nn.attention.flex_attention import flex_attention

        def call(q, k, v, score_mod, block_mask):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

        name = "flex_attention_" + hashlib.sha1(repr(key).encode()).hexdigest()[:16]  # stable across processes
        own = types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None, call.__closure__)
        options = {"recompile_limit": RECOMPILE_LIMIT}  # torch >= 2.13 takes it per function
        if "recompile_limit" not in inspect.signature(torch.compile).parameters:
            options = {}
        _compiled[key] = torch.compile(own, **options)
    return _compiled[key]


def cannot_train_on(device: str) -> str:
    """Why flex cannot train on ``device``, and what to do instead."""
    return (f"alibi_attention=flex cannot train on {device}: torch's FlexAttention has a backward on CUDA "
            "only; train with alibi_attention=auto (sdpa or blocked here), or evaluate without gradients "
            "(torch.no_grad())")


def _refuse_cpu_backward(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.device.type != "cuda" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise KernelUnsupportedError(cannot_train_on(q.device.type))


#: Set to 1 to run ``flex`` on a CPU without AVX-512 anyway (the test suite does, to exercise the compile
#: machinery; the comparisons it makes there are the check).
CPU_FLEX_ENV = "FAIRSEQ_ALIBI_CPU_FLEX"


def cpu_flex_verified() -> bool:
    """Whether this CPU is of the kind on which compiled CPU FlexAttention was
    found exact (AVX-512; :func:`_refuse_unverified_cpu`)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _refuse_unverified_cpu(q: Tensor) -> None:
    """``flex`` on a CPU only where its compiled kernel was found exact: with
    AVX-512.  On an AVX2-only AMD EPYC, torch 2.13's compiled CPU
    FlexAttention (no score_mod, no mask) differed from SDPA by 0.14-1.5 at
    24, 200 and 1,000 tokens in one run and at 200 only in another, and
    agreed at 64, 127, 130 and 384 (docs/performance.md, "Known limits"): a
    wrong number, not an error, at lengths that change from run to run."""
    if q.device.type != "cpu" or os.environ.get(CPU_FLEX_ENV) == "1":
        return
    if not cpu_flex_verified():
        capability = torch.backends.cpu.get_cpu_capability()
        raise KernelUnsupportedError(
            f"alibi_attention=flex on this CPU ({capability}): torch's compiled CPU FlexAttention gives wrong "
            "outputs at some lengths on CPUs without AVX-512; evaluate with alibi_attention=auto or chunked "
            f"(flex is meant for CUDA), or set {CPU_FLEX_ENV}=1 to run it anyway")


def flex_kernel(q, k, v, bias: AlibiBias, key_padding_mask, dropout_p):
    """The ``flex`` kernel (``kernels.KERNELS``): compiled FlexAttention, ALiBi as
    a ``score_mod``, a cached causal block mask for causal stacks.  On the
    CPU only with AVX-512 (:func:`_refuse_unverified_cpu`)."""
    _refuse_cpu_backward(q, k, v)
    _refuse_unverified_cpu(q)
    q_len, k_len = q.size(2), k.size(2)
    mod = score_mod(bias, q_len, k_len, q.device, key_padding_mask)
    block_mask = None
    if bias.causal:
        block_mask = bias.cached("block_mask", (q_len, k_len, str(q.device)),
                                 lambda: causal_block_mask(q_len, k_len, q.device))
    compiled = flex_function(variant(bias, q_len, k_len, q.device, key_padding_mask))
    return compiled(q, k, v, mod, block_mask), None
