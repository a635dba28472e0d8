"""The Forgetting Transformer's forget gate (FoX: Lin, Nikishin, He and
Courville, "Forgetting Transformer: Softmax Attention with a Forget Gate",
ICLR 2025), as a data-dependent position bias.

Each layer has, per head ``h``, a scalar forget gate per token computed from
the layer's input ``x_t``: ``f_t = sigmoid(w_h . x_t + b_h)``.  Query ``i``
adds to its logit of key ``j <= i``

    D_ij = sum_{l = j+1 .. i} ln f_l = c_i - c_j,    c_t = sum_{l <= t} ln f_l,

so the bias is the difference of one cumulative sum per (batch row, head):
FoX needs no position embeddings.  With a constant gate ``f = exp(-m_h)``
(``w = 0``, ``b_h = logit(exp(-m_h))``) ``D_ij = -m_h (i - j)``: ALiBi.

What the kernels see (``bias.StackBias``): :class:`GateBias`, ``batched``
(one bias per row: ``block`` gives ``[B, H, q, k]`` built from the two
vectors, per query block in the ``chunked`` kernel and in ``blocked``, CPU
training's, which gives ``c`` its gradient block by block, so nothing ``[B, H,
T, T]`` exists there; ``reference`` and ``sdpa`` take it whole).  Padding: a padded
token's gate is 1 (``ln f = 0``), so a left- or right-padded row has the
cumulative sums of its unpadded self, shifted by a constant that cancels in
``c_i - c_j``.  KV cache: ``c`` of every cached key is carried
(``bind``'s second value), and new tokens continue from the last one.

Initialization (the authors' repository, zhixuan-lin/forgetting-transformer,
``fgate_type="full"``): the gate's projection like every linear layer there,
weights normal with standard deviation 0.02 (``initializer_range``) and a zero
bias, so gates start near ``sigmoid(0) = 0.5``; the ``T_min``/``T_max`` bias
initialization there is for their data-independent gates only.  The option
``fox_init_slopes`` k > 0 starts each head's gate bias at ``logit(exp(-k m_h))``
instead (:func:`slope_gate_bias`, ``m_h`` ALiBi's slopes), so that FoX starts
as (k times) ALiBi with a little data dependence: the test of whether FoX's
slow start on retrieval comes from gates that begin, and stay, near 0.5
(docs/retrieval.md).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .alibi import get_slopes
from .bias import StackBias, cumulative_bias, padding_mask
from .causal_blocks import (_block_calls, _flash_backward, _flash_forward, block_size, blocked_causal_attention,
                            head_groups, merged_parts)
from .errors import ConfigError
from .kernels import WINDOW_ALIGN, ChunkedCall, _contiguous, chunked_kernel, negligible_floor
from .scaling import LOGIT_METHODS, NO_SCALING, Scaling, check_applies

#: The extension methods that apply to FoX (it has no slopes or frequencies to scale).
FOX_EXTENSIONS = ("none",) + LOGIT_METHODS
#: The gate projection's initial weight standard deviation (the authors' ``initializer_range``).
GATE_INIT_STD = 0.02


def slope_gate_bias(slopes: Tensor) -> Tensor:
    """The gate biases whose gates are ``exp(-slopes)`` when the weights are 0:
    ``logit(exp(-m)) = -ln(expm1(m))`` (exact for small ``m``, where
    ``1 - exp(-m)`` would round)."""
    return -torch.log(torch.expm1(slopes))


def log_gates(x: Tensor, weight: Tensor, bias: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """float32 ``[B, H, T]`` ``ln f_t = logsigmoid(w_h . x_t + b_h)`` of ``x``
    ``[T, B, C]`` (0 at padded tokens, ``key_padding_mask`` ``[B, T]``)."""
    logits = F.linear(x, weight, bias).to(torch.float32).permute(1, 2, 0)  # [B, H, T]
    logf = F.logsigmoid(logits)
    if key_padding_mask is not None:
        logf = logf.masked_fill(key_padding_mask.to(torch.bool)[:, None, :], 0.0)
    return logf


def cumulative_gates(logf: Tensor, carried: Optional[Tensor] = None) -> Tensor:
    """``c`` ``[B, H, S]`` of every key: the cached ``carried`` (``[B, H, S0]``)
    followed by the new tokens' running sum of ``logf``, continued from the
    last cached value."""
    running = logf.cumsum(-1)
    if carried is None or carried.size(-1) == 0:
        return running
    return torch.cat([carried, carried[..., -1:] + running], dim=-1)


#: FoX's bias ``c_i - c_j`` of its gates' running sums: the per-row cumulative term (``bias.cumulative_bias``).
gate_bias = cumulative_bias


class GateBias(StackBias):
    """One call's FoX bias: ``c`` ``[B, H, S]`` (float32) of every key, as ``cumulative``."""

    batched = True
    learned = True

    def __init__(self, c: Tensor, scaling: Scaling = NO_SCALING):
        StackBias.__init__(self, c.size(1))
        self.cumulative = c
        self.scaling = scaling

    @property
    def toeplitz(self) -> bool:
        return False

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        return gate_bias(self.cumulative, q_start, q_len, keys or k_len).to(dtype)

    def key_block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: int,
                  first: int = 0) -> Tuple[Tensor, bool]:
        return gate_bias(self.cumulative, q_start, q_len, keys, first).to(dtype), False  # the window's keys only

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        return self.block(k_len - q_len, q_len, k_len, dtype, device)

    def merged_mask(self, bias: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        pad = padding_mask(key_padding_mask, bias.dtype)
        return bias if pad is None else bias + pad

    @property
    def own_kernels(self):  # type: ignore[override]
        return OWN_KERNELS

    def windows(self, q: Tensor, k: Tensor, floor=None):
        return gate_windows(self, q, k, floor)


def _check_fox_scaling(scaling: Scaling) -> Scaling:
    return check_applies(scaling, "fox", FOX_EXTENSIONS).complete()


class _UnboundGates(StackBias):
    """What the stack's FoX object and a layer's gates share before ``bind`` turns the
    gates into a :class:`GateBias`: a learned bias that is not Toeplitz (it depends on
    the input), a checked scaling, and no bias block of their own."""

    learned = True

    @property
    def toeplitz(self) -> bool:
        return False

    def rescale(self, scaling: Scaling) -> None:
        self.scaling = _check_fox_scaling(scaling)

    def block(self, q_start, q_len, k_len, dtype, device, keys=None) -> Tensor:
        raise ConfigError("FoX's bias depends on each layer's input: a layer binds its own gates first (bind)")


class ForgetGates(_UnboundGates):
    """The stack's FoX object: no parameters of its own; each layer gets its
    own gate (:meth:`for_layer`), as the paper computes one per layer."""

    def __init__(self, num_heads: int, embed_dim: int, scaling: Scaling = NO_SCALING, init_slopes: float = 0.0,
                 data_dependent: bool = True, init_std: float = GATE_INIT_STD, weight_delay: int = 0):
        StackBias.__init__(self, num_heads)
        self.embed_dim = embed_dim
        self.scaling = _check_fox_scaling(scaling)
        self.init_slopes = init_slopes
        self.data_dependent = data_dependent
        self.init_std = init_std
        self.weight_delay = weight_delay

    def for_layer(self) -> "LayerForgetGate":
        return LayerForgetGate(self.num_heads, self.embed_dim, self.scaling, self.init_slopes, self.data_dependent,
                               self.init_std, self.weight_delay)


class LayerForgetGate(nn.Module, _UnboundGates):
    """One layer's forget gates: ``proj`` (``embed_dim -> H``), saved in
    checkpoints as ``self_attn.forget_gate.proj``.  Not ``data_dependent``:
    the projection's weight is 0 and frozen (no gradient), so each head's gate
    is the learned constant ``sigmoid(b_h)``: ALiBi with learned slopes, the
    paper's data-independent ablation (``fox_data_dependent=0``).
    ``init_std``: the weights' initial standard deviation (0: they start at
    0 and are trained, the run that separates the weights' initial noise from
    what they learn).  ``weight_delay``: the number of training updates during
    which the weights keep their initial values (no gradient reaches them;
    fairseq's trainer reports each update through :meth:`set_num_updates`; a
    model that no trainer reports to, such as the exported one, holds
    nothing),
    the run that asks whether the data dependence slows only the search for
    the retrieval heads or also what is learned after it."""

    layer_attribute = "forget_gate"

    def __init__(self, num_heads: int, embed_dim: int, scaling: Scaling = NO_SCALING, init_slopes: float = 0.0,
                 data_dependent: bool = True, init_std: float = GATE_INIT_STD, weight_delay: int = 0):
        nn.Module.__init__(self)
        StackBias.__init__(self, num_heads)
        self.proj = nn.Linear(embed_dim, num_heads)
        if data_dependent:
            nn.init.normal_(self.proj.weight, std=init_std)
        else:
            nn.init.zeros_(self.proj.weight).requires_grad_(False)
        with torch.no_grad():
            if init_slopes > 0:  # gates start at exp(-k m_h): (k times) ALiBi
                self.proj.bias.copy_(slope_gate_bias(init_slopes * get_slopes(num_heads).double()))
            else:  # the authors' zero bias: gates near 0.5
                self.proj.bias.zero_()
        self.scaling = _check_fox_scaling(scaling)
        self.weight_delay = weight_delay
        # fairseq's trainer reports the update before every step and after loading a checkpoint (not saved);
        # None where no trainer reports one (the exported model, fine-tuned by another trainer): no hold then
        self.num_updates: Optional[int] = None

    def for_layer(self) -> "LayerForgetGate":
        return self

    def set_num_updates(self, num_updates: int) -> None:
        self.num_updates = num_updates

    def bind(self, x: Tensor, key_padding_mask: Optional[Tensor], carried: Optional[Tensor]
             ) -> Tuple[GateBias, Tensor]:
        held = self.num_updates is not None and self.num_updates < self.weight_delay
        weight = self.proj.weight.detach() if held else self.proj.weight
        c = cumulative_gates(log_gates(x, weight, self.proj.bias, key_padding_mask), carried)
        return GateBias(c, self.scaling), c


# ----------------------------------------------------------------- FoX's own kernels
def blocked_gates(q, k, v, bias: GateBias, key_padding_mask, dropout_p):
    """FoX's ``blocked`` kernel (CPU training): ``c_i - c_j`` built per query
    block from ``c``, its gradient reduced to ``c``'s.  Without dropout on the
    CPU the flash kernel per block (:class:`FlashGates`), with key windows
    (:func:`gate_windows`) and the floor below which a key weighs nothing
    where there is no padding; else the explicit path of
    ``causal_blocks.blocked_causal_attention`` (its ``cumulative`` term)."""
    k, v = _contiguous(k, v)
    floor = negligible_floor(q, k) if key_padding_mask is None and dropout_p == 0 else None
    pad = padding_mask(key_padding_mask, q.dtype)
    windows = gate_windows(bias, q, k, floor) if floor else None
    if dropout_p == 0 and q.device.type == "cpu":
        calls = _block_calls(q.size(2), k.size(2), block_size(q.size(2)), q.size(1), windows,
                             per_head=q.size(0) > 1)
        return FlashGates.apply(q, k, v, bias.cumulative, None if pad is None else pad.to(q.dtype), calls, floor), None
    return blocked_causal_attention(q, k, v, pad, dropout_p, windows=windows, cumulative=bias.cumulative), None


def chunked_gates(q, k, v, bias: GateBias, key_padding_mask, dropout_p, chunk_size: Optional[int] = None):
    """FoX's ``chunked`` kernel: in inference without padding, each block of
    ``chunk_size`` queries over its key windows (:func:`gate_windows`) with
    the keys before the block under one shared row of bias
    (:func:`gated_far_and_near`); otherwise the shared chunked kernel (each
    block's ``c_i - c_j`` over the keys its heads read)."""
    if key_padding_mask is not None or torch.is_grad_enabled() or not bias.causal:
        return chunked_kernel(q, k, v, bias, key_padding_mask, dropout_p, chunk_size)
    call = ChunkedCall(q, k, v, bias, None, chunk_size)
    for start, block_firsts in zip(call.starts, call.firsts):
        rows, _ = call.extent(start)
        for heads, first in head_groups(block_firsts):
            block_out = gated_far_and_near(q[:, heads, start:start + rows], call.k[:, heads], call.v[:, heads],
                                           bias.cumulative[:, heads], call.offset + start, first)
            call.out[start:start + rows, :, heads] = block_out.permute(2, 0, 1, 3)
    return call.result()


#: The kernels FoX runs in place of the shared ones of these names (``kernels.kernel_for``).
OWN_KERNELS = {"blocked": blocked_gates, "chunked": chunked_gates}


def gate_windows(bias: StackBias, q: Tensor, k: Tensor,
                 floor: Optional[Callable[[int, int], Tensor]] = None) -> Optional[Callable[[int, int], List[int]]]:
    """FoX's key windows (a ``batched`` bias ``c_i - c_j``): ``c`` falls along
    the keys (each ``ln f <= 0``), so for queries ``s ..`` of a block the bias
    of key ``j`` is at most ``c_s - c_j`` and the keys with ``c_j > c_s +
    margin + gap`` (``kernels.score_margins``, ``causal_blocks.negligible_gap``) are a prefix
    that weighs less than ``SKIPPED_SHARE`` of a rounding unit in every row:
    left out, as ``kernels.key_windows`` leaves ALiBi's far keys out.  Each head
    starts at its first needed key over the batch's rows.  Data-dependent: a
    head whose gates stay near 1 keeps every key."""
    if not (bias.batched and bias.causal):
        return None
    rising = -bias.cumulative.detach()  # [B, H, S], non-decreasing along the keys
    offset = k.size(2) - q.size(2)
    floor = floor or negligible_floor(q, k)  # the caller's, where it masks by the same floor

    def first(start: int, stop: int) -> List[int]:
        limit = rising[:, :, offset + start] + floor(start, stop)  # [B, H]
        needed = torch.searchsorted(rising, limit[..., None].contiguous())[..., 0]  # keys with c_s - c_j < floor
        return [f // WINDOW_ALIGN * WINDOW_ALIGN for f in needed.amin(0).tolist()]

    return first



def gated_far_and_near(q: Tensor, k: Tensor, v: Tensor, c: Tensor, q_start: int, first: int) -> Tensor:
    """FoX's attention (a ``batched`` bias ``c_i - c_j``, ``c`` ``[B, H, S]``)
    of the queries ``q`` (one block, positions ``q_start ..``) over keys
    ``first ..`` up to the last query.  ``c_i - c_j = (c_i - c_s) + (c_s -
    c_j)`` with ``s = q_start``: over the keys before the block the second
    term is one row every query shares (a ``[B, H, 1, keys]`` mask, no
    ``[q, k]`` bias built) and the first a constant of each query's row,
    added to that part's log-sum-exp; the block's own keys take the plain
    ``c_i - c_j`` with its causal mask.  Two flash calls merged by their
    log-sum-exps, as ``kernels.far_and_near`` (the same rounding).  Inference
    only."""
    rows = q.size(2)
    visible = q_start + rows
    near = gate_bias(c, q_start, rows, visible, first_key=q_start).to(q.dtype)
    o_near, lse_near = _flash_forward(q, k[:, :, q_start:visible], v[:, :, q_start:visible], attn_mask=near)
    if first >= q_start:
        return o_near
    shared = (c[..., q_start:q_start + 1] - c[..., first:q_start])[..., None, :].to(q.dtype)  # c_s - c_j <= 0
    o_far, lse_far = _flash_forward(q, k[:, :, first:q_start], v[:, :, first:q_start], attn_mask=shared)
    lse_far = lse_far + (c[..., q_start:visible] - c[..., q_start:q_start + 1])  # c_i - c_s, per row
    return merged_parts(o_far, lse_far, o_near, lse_near)[0].to(q.dtype)



class FlashGates(torch.autograd.Function):
    """FoX without dropout: the CPU flash kernel once per call of
    :func:`_block_calls`, each with its own ``c_i - c_j`` (plus padding) as
    the mask, built in the forward and again in the backward, never whole.

    ``c``'s gradient without ``dS``: ``c_i`` adds to every score of row ``i``,
    which the softmax ignores, so only the keys' term is left, ``dc_j = -sum_i
    dS_ij``, and with ``dS_ij = P_ij (dP_ij - delta_i)``, ``dP_ij = dO_i . v_j``,
    that is ``-(v_j . dv_j - sum_i P_ij delta_i)``.  The flash backward returns
    the last sum as the gradient of one more value column (of zeros) when
    ``dO`` carries ``delta`` in that column: q, k, v get a zero column in the
    backward (the kernel wants one head size; the scale stays ``D^-1/2``), which
    changes none of its other gradients."""

    @staticmethod
    def forward(ctx, q, k, v, cumulative, pad, calls, floor):
        scale = q.size(-1) ** -0.5
        # [T, B, H, D] storage (what the module's out_proj reads), seen as [B, H, T, D]
        out = q.new_empty(q.size(2), q.size(0), q.size(1), v.size(-1)).permute(1, 2, 0, 3)
        lse = []
        for start, stop, heads, first, end, mask in gate_calls(q, k, cumulative, pad, calls, floor):
            block_out, block_lse = _flash_forward(q[:, heads, start:stop], k[:, heads, first:end],
                                                  v[:, heads, first:end], attn_mask=mask, scale=scale)
            out[:, heads, start:stop] = block_out
            lse.append(block_lse)
        ctx.save_for_backward(q, k, v, cumulative, pad, out, *lse)
        ctx.calls, ctx.floor = calls, floor
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, cumulative, pad, out, *lse = ctx.saved_tensors
        scale, head_dim = q.size(-1) ** -0.5, v.size(-1)
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        grad_out = torch.cat([grad_out, delta.to(grad_out.dtype)], dim=-1)
        q, k, v, out = (F.pad(t, (0, 1)) for t in (q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (start, stop, heads, first, end, mask), block_lse in zip(
                gate_calls(q, k, cumulative, pad, ctx.calls, ctx.floor), lse):
            gq, gk, gv = _flash_backward(
                grad_out[:, heads, start:stop], q[:, heads, start:stop], k[:, heads, first:end],
                v[:, heads, first:end], out[:, heads, start:stop], block_lse, 0.0, False, attn_mask=mask,
                scale=scale)
            dq[:, heads, start:stop] = gq
            dk[:, heads, first:end] += gk
            dv[:, heads, first:end] += gv
        dc = None
        if ctx.needs_input_grad[3]:
            dc = dv[..., head_dim].float() - (v[..., :head_dim].float() * dv[..., :head_dim].float()).sum(-1)
        return dq[..., :-1], dk[..., :-1], dv[..., :-1], dc, None, None, None


def gate_calls(q, k, cumulative, pad, calls, floor=None):
    """The calls of :class:`FlashGates`, each with its mask: FoX's ``c_i -
    c_j`` over the call's keys (``-inf`` right of each query and below the
    block's ``floor``) plus padding."""
    offset = k.size(2) - q.size(2)
    for start, stop, heads, first, end in calls:
        bias = gate_bias(cumulative[:, heads], offset + start, stop - start, end, first)
        if floor is not None:
            bias = bias.masked_fill_(bias < floor(start, stop)[heads, None, None], float("-inf"))
        mask = bias.to(q.dtype)
        yield start, stop, heads, first, end, mask if pad is None else mask + pad[..., first:end]
