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

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .alibi import get_slopes
from .bias import StackBias, padding_mask
from .errors import ConfigError
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


def gate_bias(c: Tensor, q_start: int, q_len: int, keys: int, first_key: int = 0) -> Tensor:
    """float32 ``[B, H, q_len, keys - first_key]``: ``c_i - c_j`` for queries
    ``q_start ..`` over keys ``first_key .. keys - 1``, ``-inf`` right of each query."""
    query = c[..., q_start: q_start + q_len, None]
    key = c[..., None, first_key:keys]
    positions = torch.arange(q_start, q_start + q_len, device=c.device)[:, None]
    future = torch.arange(first_key, keys, device=c.device)[None, :] > positions
    return (query - key).masked_fill(future, float("-inf"))


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
