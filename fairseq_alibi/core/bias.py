"""The position bias of one layer stack, shared by its layers: the protocol
every kernel reads, and its implementations.

Pure torch (no fairseq): the fairseq attention layer and an exported Hugging
Face model both read their bias from here.

:class:`StackBias` is the protocol, a documented base class of
capabilities (``kernels.py`` reads nothing else): the bias of a block of
queries over their keys (:meth:`~StackBias.block`), the dense bias and the
merged padding mask, cached once per forward pass and shared by the layers
(:meth:`~StackBias.cached`: one entry per helper, the most recent key, so
nothing is built per layer or batch row and no cache grows), per-distance
values, a per-row cumulative term, key windows, a rotation, a logit scale,
kernels of its own.  Its implementations here:

* :class:`AlibiBias`: ALiBi's slopes and their scaling (``causal`` for the LM,
  ``symmetric`` or ``split`` for encoders); :class:`LearnedAlibiBias` (mode
  ``learned``) trains each encoder layer's own left/right slopes;
* :class:`ModuleBias`: a learned bias of a position module (T5's buckets,
  Kerple, FIRE: ``positions.py``), built once per forward pass for the stack;
* :class:`CausalMask`: no bias at all, the causal mask alone (NoPE; rotary
  methods subclass it and rotate queries and keys instead).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .alibi import (
    EXTENSIONS,
    BIAS_MODES,
    Direction,
    alibi_bias,
    direction_of,
    get_slopes,
    head_directions,
    learned_slopes,
    learned_slopes_inverse,
    mode_slopes,
    positions,
    scaled_slopes,
    slope_exponents,
)
from .errors import ConfigError
from .scaling import LOGIT_METHODS, NO_SCALING, Scaling, check_applies


def masked_value_for(mode: str, dtype: torch.dtype) -> float:
    """What the bias puts on the side a head does not see.

    ``-inf`` for the causal LM (every query sees at least itself).  For
    ``split`` a finite stand-in, so that a query whose whole visible side is
    padding (a padding position itself) still has a defined softmax: with
    ``-inf`` its row would be NaN, and NaN poisons every later layer through
    ``0 * NaN``.  Large enough that ``exp`` of it is exactly 0 next to any real
    score (fairseq's own convention: -1e8, or -1e4 in 16-bit types).
    """
    if mode != "split":
        return float("-inf")
    return -1e8 if dtype in (torch.float32, torch.float64) else -1e4


def padding_mask(key_padding_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    """``[B, 1, 1, S]`` additive mask (-inf at padding) or None."""
    if key_padding_mask is None:
        return None
    pad = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill(pad, float("-inf"))


def _aligned(bias: Tensor) -> Tensor:
    """On CUDA, give the bias a row stride that is a multiple of 8 elements (a
    view into padded storage): the memory-efficient SDPA kernel needs aligned
    mask rows and would otherwise copy the mask, or fall back to the math kernel."""
    if bias.device.type != "cuda" or bias.size(-1) % 8 == 0:
        return bias
    rounded = (bias.size(-1) + 7) // 8 * 8
    storage = bias.new_empty(*bias.shape[:-1], rounded)
    storage[..., : bias.size(-1)].copy_(bias)
    return storage[..., : bias.size(-1)]


def cumulative_bias(c: Tensor, q_start: int, q_len: int, keys: int, first_key: int = 0) -> Tensor:
    """float32 ``[B, H, q_len, keys - first_key]``: the per-row cumulative
    term ``c_i - c_j`` (``c`` ``[B, H, S]``, one running sum per row and head:
    FoX's log forget gates) for queries ``q_start ..`` over keys ``first_key
    .. keys - 1``, ``-inf`` right of each query."""
    query = c[..., q_start: q_start + q_len, None]
    key = c[..., None, first_key:keys]
    positions = torch.arange(q_start, q_start + q_len, device=c.device)[:, None]
    future = torch.arange(first_key, keys, device=c.device)[None, :] > positions
    return (query - key).masked_fill(future, float("-inf"))


class Same:
    """A cache-key part equal only to the very same object (tensors compare by identity)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class StackBias:
    """What every kernel reads of a stack's position object, and its caches:
    the protocol of capabilities.  The kernels (``kernels.py``) and the layer
    wiring (``layer.py``) ask for these, never for a method's name; a method
    provides what it has and keeps the defaults (nothing) for the rest
    (docs/architecture.md has the table):

    * a bias block for a range of queries and keys: :meth:`block` (and
      :meth:`key_block`, :meth:`dense`, :meth:`merged_mask`, built from it);
      ``zero``: no bias, the causal mask alone (SDPA's ``is_causal``);
    * per-distance values, a Toeplitz bias: ``toeplitz`` (a function of ``i -
      j`` alone: the chunked kernel's views of one vector per head),
      :meth:`per_distance` and :meth:`shared_from` for a learned one (its
      gradient per distance);
    * a per-row cumulative term ``c_i - c_j``: ``batched`` (one bias per batch
      row) and ``cumulative`` ``c`` ``[B, H, S]``, bound to the layer's input
      per call (:meth:`bind`; FoX's gates);
    * key windows, keys a query cannot weigh (skipped exactly): ``has_slopes``
      (ALiBi's slopes, ``kernels.key_windows``), :meth:`windows` (a bias's
      own), ``window`` (a sliding window);
    * a rotation of queries and keys: :meth:`rotate`;
    * a logit scale: ``scaling`` (a logit method, ``logn``, of
      ``logit_scale.py``; SSMax's scales are the layer's);
    * a kernel of its own: ``own_kernels``, by registry name
      (``kernels.kernel_for``);
    * an attention of its own, not softmax over biased scores: ``own_kernel``
      and ``attend(q, k, v, x, key_padding_mask, state, dropout_p)``, which
      ``layer.attention`` calls in place of every shared kernel; ``own_cache``:
      it keeps its KV-cache state itself (``state``, a batch-first dict under
      fairseq's names), so the layer skips the shared cache extension;
    * per layer: :meth:`at_layer` (a hybrid's choice), :meth:`for_layer` (a
      layer's own object, a submodule under ``layer_attribute``),
      :meth:`fit_depth`;
    * what a kernel's choice and its fast paths read: ``learned`` (carries
      gradients: nothing kept across passes; the ``blocked`` kernel returns
      its gradient), ``supports_flex`` (a FlexAttention ``score_mod``),
      ``heads_apart`` and :meth:`reversed_head_blocks`,
      :meth:`training_blocks`, :meth:`value_span`.
    """

    supports_flex = False
    has_slopes = False
    learned = False
    zero = False
    mode = "causal"
    scaling = NO_SCALING
    #: A sliding window: each query sees at most this many keys (None: all).
    window: Optional[int] = None
    #: ``block`` and ``dense`` give ``[B, H, q, k]``, one bias per batch row
    #: (data-dependent: FoX's gates), built per call, never shared or cached:
    #: ``c_i - c_j`` of ``cumulative`` ``[B, H, S]`` (the blocked kernel reads ``c`` itself).
    batched = False
    cumulative: Optional[Tensor] = None
    #: The chunked kernel's blocks without gradients come a few heads at a time
    #: (:meth:`ModuleBias.reversed_head_blocks`: FIRE's, in a few heads' memory).
    heads_apart = False
    #: The attribute under which a layer keeps its own object of
    #: :meth:`for_layer` as a submodule (its name in checkpoints).
    layer_attribute = "alibi"
    #: Kernels of the method's own, by registry name (``kernels.kernel_for``):
    #: run in place of the shared kernel of that name (FoX's blocked and
    #: chunked paths, ``fox.py``; a method that is not softmax over biased
    #: scores brings all of its own).
    own_kernels: Dict[str, Callable[..., Tuple[Tensor, Optional[Tensor]]]] = {}
    #: The object computes a layer's whole attention itself (``attend``: stick-breaking,
    #: PaTH), no shared kernel runs it: ``layer.attention`` calls it, ``check_kernel``
    #: takes ``auto`` alone and no attention dropout.
    own_kernel = False
    #: With ``own_kernel``: its KV-cache state is not the keys and values as they came
    #: (PaTH's keys change with every new token; a convolution's and a gate's state):
    #: ``attend`` extends the layer's cache dict itself, the layer only its padding mask.
    own_cache = False
    #: Whether the layers of a pass share what it builds with gradients (a
    #: learned bias's values, ``ModuleBias.cached``).  Not under activation
    #: checkpointing, where each layer's forward runs again in its own
    #: backward: a tensor built in one layer's rerun is backpropagated there,
    #: and another layer's backward would find its graph freed.
    share_graphs = True

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self._cache: Dict[str, Tuple[Hashable, Any]] = {}

    @property
    def stack(self) -> "StackBias":
        """The object that rescales this one (``models.attention.rescale``):
        itself; a hybrid stack's layer objects name the stack (``hybrid.py``)."""
        return self.__dict__.get("owner", self)

    @property
    def causal(self) -> bool:
        return self.mode == "causal"

    @property
    def toeplitz(self) -> bool:
        return True

    def cached(self, name: str, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``, or its value from the last call with the same ``name``
        and ``key`` (one entry per name: the old value is freed before a new
        one is built).  Under ``torch.compile`` nothing is cached: the graph
        builds each helper once per forward, and the keys (tensor identities
        and versions) mean nothing while tracing."""
        if torch.compiler.is_compiling():
            return build()
        entry = self._cache.get(name)
        if entry is not None and entry[0] == key:
            return entry[1]
        self._cache.pop(name, None)
        value = build()
        self._cache[name] = (key, value)
        return value

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        """``[H, q_len, keys]`` bias for queries ``q_start ..`` over the first
        ``keys`` (default all) of a forward pass's ``k_len`` keys, ``-inf`` (or
        a finite stand-in) where a head does not look."""
        raise NotImplementedError

    def training_blocks(self, q_len: int, k_len: int, block: int, device) -> Optional[List[Tensor]]:
        """The bias of each query block of a training pass, for a learned bias
        that the blocked kernel takes block by block
        (:meth:`ModuleBias.training_blocks`); None here."""
        return None

    def logged_scalars(self) -> Dict[str, Tensor]:
        """Learned scalars a training log shows each update (fairseq's
        metrics, ``models.transformer_lm``): none here; FIRE's threshold,
        which decides the path its training takes (``Fire.distance_only``)."""
        return {}

    def value_span(self) -> float:
        """An upper bound of the largest minus the least finite value of the
        bias of any pass (``inf`` where none is known): the explicit path
        skips its floor against subnormal weights where the scores with
        it cannot span that far (``kernels.may_underflow``)."""
        return 0.0 if self.zero else math.inf

    def key_block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: int,
                  first: int = 0) -> Tuple[Tensor, bool]:
        """``(bias, reversed)``: :meth:`block`'s bias over keys ``first ..
        keys - 1`` only, its rows in reverse order (last query first, as
        :func:`reversed_rows`) where ``reversed``: the form the ``chunked``
        kernel reads, which a bias overrides where it is less work than
        :meth:`block` (FoX builds only the keys of its windows, FIRE one value
        per distance and knot).  The values are :meth:`block`'s."""
        return self.block(q_start, q_len, k_len, dtype, device, keys=keys)[..., first:], False

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """The whole ``[H, q_len, k_len]`` bias (queries the last ``q_len`` of
        the keys), cached: the first layer of a forward builds it, the others
        (and, for biases without parameters, later batches of the same shape)
        reuse it.  Built directly in the activation dtype."""
        return self.cached("dense", (q_len, k_len, dtype, str(device), self.scaling.factor_at(k_len)),
                           lambda: _aligned(self.block(k_len - q_len, q_len, k_len, dtype, device)))

    def per_distance(self, k_len: int, device) -> Optional[Tensor]:
        """A learned causal bias that depends on the distance alone over a
        ``k_len``-key pass: float32 ``[H, k_len]``, its values at distances
        ``0 .. k_len - 1`` (with gradients; the blocked kernel builds its
        blocks from them and reduces their gradient per distance).  None for
        every other bias."""
        return None

    def shared_from(self, k_len: int) -> Optional[int]:
        """For a :meth:`per_distance` bias: the least distance ``D`` from which
        one learned value per head serves every key of a ``k_len``-key pass
        (T5's last bucket), so that ``per_distance[:, D]`` stands for every
        farther distance, parameter and gradient; None where there is none."""
        return None

    def merged_mask(self, bias: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """The additive mask for SDPA: ``[1, H, T, S]`` without padding (a view of
        ``bias``, nothing copied), else ``[B, H, T, S]`` with ``-inf`` at padded
        keys, built once per forward and shared by the layers (they all receive
        the same padding-mask tensor)."""
        if key_padding_mask is None:
            return bias[None]
        key = (Same(bias), Same(key_padding_mask), key_padding_mask._version)
        return self.cached("merged", key, lambda: bias[None] + padding_mask(key_padding_mask, bias.dtype))

    def at_factor(self, factor: float) -> "StackBias":
        """This bias with a dynamic factor fixed at ``factor`` (one row's); ``self`` without one."""
        return self

    def windows(self, q: Tensor, k: Tensor,
                floor: Optional[Callable[[int, int], Tensor]] = None) -> Optional[Callable[[int, int], List[int]]]:
        """Key windows of a bias that knows its own (FoX's, from its gates:
        ``fox.gate_windows``): ``first(start, stop)`` -> the first key each
        head needs for queries ``start .. stop - 1`` of a causal call without
        padding, the keys before it weighing nothing (below ``floor``,
        ``kernels.negligible_floor``); None here (ALiBi's and the learned
        distance biases' windows come from their slopes and values,
        ``kernels.key_windows`` and ``kernels.distance_windows``)."""
        return None

    def rotate(self, q: Tensor, k: Tensor, q_start: int, k_len: int,
               key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Queries and keys ``[B, H, T, D]`` at positions ``q_start ..`` of a
        pass over ``k_len`` keys, as attention sees them (rotary methods rotate
        them; every bias leaves them alone)."""
        return q, k

    def start_pass(self) -> None:
        """A new forward pass of the stack begins (learned biases rebuild then)."""

    def rescale(self, scaling: Scaling) -> None:
        """Use ``scaling`` from the next forward on; a bias without extension
        methods takes ``none`` only (``positions.check_extension`` names the
        methods of each position method where the model is built)."""
        self.scaling = check_applies(scaling, type(self).__name__, ("none",) + LOGIT_METHODS).complete()
        self._cache.clear()

    def for_layer(self) -> "StackBias":
        """The bias one layer's attention uses: the stack's own, shared."""
        return self

    def fit_depth(self, layers: int) -> None:
        """Check (and settle) the stack for ``layers`` layers, before they are
        built: only a hybrid depends on the depth (``hybrid.py``)."""

    def at_layer(self, index: int) -> "StackBias":
        """The position object of the stack's layer ``index`` (from 0): the
        stack's own; a hybrid stack chooses per layer (``hybrid.py``)."""
        return self

    def bind(self, x: Tensor, key_padding_mask: Optional[Tensor], carried: Optional[Tensor]
             ) -> Tuple["StackBias", Optional[Tensor]]:
        """``(bias for this call, state to carry in the KV cache)`` of a layer
        whose input is ``x`` ``[T, B, C]`` (new tokens; ``key_padding_mask``
        ``[B, T]`` theirs, ``carried`` what the cache holds from earlier
        calls).  Every bias but a data-dependent one (FoX: ``fox.py``) is
        itself and carries nothing."""
        return self, None


class OwnAttentionStack(StackBias):
    """The stack object of a method whose layers bring an attention of their
    own (``own_kernel``: stick-breaking's, PaTH's): no bias for the shared
    kernels and no Toeplitz structure, parameters per layer (a subclass's
    :meth:`for_layer`), and only the extension methods of its registry entry
    (``method``, its name there; ``extensions``, the methods it takes)."""

    own_kernel = True
    learned = True
    method = ""
    extensions: Tuple[str, ...] = ("none",)

    def __init__(self, num_heads: int, scaling: Scaling = NO_SCALING):
        StackBias.__init__(self, num_heads)
        self.rescale(scaling)

    @property
    def toeplitz(self) -> bool:
        return False

    def rescale(self, scaling: Scaling) -> None:
        self.scaling = check_applies(scaling, self.method, self.extensions).complete()

class AlibiBias(StackBias):
    """Slopes and bias of one layer stack, shared by all its attention layers.

    A plain object rather than an ``nn.Module``: it has no parameters, nothing
    of it belongs in the state dict, and its caches are keyed by device and
    dtype, so it needs no ``.to()``.  :meth:`rescale` changes the context
    extension of a built model in place (the evaluation tools use it to run
    one loaded checkpoint under several methods).
    """

    supports_flex = True
    has_slopes = True

    def __init__(self, num_heads: int, mode: str = "causal", scaling: Scaling = NO_SCALING):
        if mode not in BIAS_MODES:
            raise ConfigError(f"ALiBi bias mode {mode!r} is not valid; allowed values: {', '.join(BIAS_MODES)}")
        StackBias.__init__(self, num_heads)
        self.mode = mode
        self.directions = head_directions(mode, num_heads)
        self.base_slopes = mode_slopes(mode, num_heads)
        self._fixed: Dict[float, "AlibiBias"] = {}
        self.rescale(scaling)

    @property
    def toeplitz(self) -> bool:
        return self.scaling.relative

    def rescale(self, scaling: Scaling) -> None:
        """Use ``scaling`` from the next forward on (every cache is dropped)."""
        if not isinstance(scaling, Scaling):
            raise TypeError(f"scaling must be a Scaling, got {type(scaling).__name__}")
        self.scaling = check_applies(scaling, "alibi", EXTENSIONS + LOGIT_METHODS).complete()
        self.exponents = slope_exponents(self.base_slopes, self.scaling.method)
        self._cache.clear()
        self._fixed.clear()

    def at_factor(self, factor: float) -> "AlibiBias":
        """This bias with a dynamic factor fixed at ``factor`` (one row's, whose
        own key count gives it), kept for reuse; ``self`` when not dynamic.  A
        shallow copy: learned slopes stay the same parameters."""
        if not self.scaling.dynamic:
            return self
        fixed = self._fixed.get(factor)
        if fixed is None:
            fixed = copy.copy(self)
            fixed._cache, fixed._fixed = {}, {}
            fixed.rescale(self.scaling.at_factor(factor))
            if len(self._fixed) >= 64:  # one per distinct row length: bounded
                self._fixed.clear()
            self._fixed[factor] = fixed
        return fixed

    def for_layer(self) -> "AlibiBias":
        """The bias one layer's attention uses: this shared object, or for
        mode ``learned`` a new one with that layer's own trained slopes."""
        if self.mode == "learned":
            return LearnedAlibiBias(self.num_heads, self.scaling)
        return self

    def slopes(self, k_len: int, device=None) -> Tensor:
        """float32 ``[H]`` slopes for a forward pass over ``k_len`` keys."""
        factor = self.scaling.factor_at(k_len)
        return self.cached(
            "slopes", (factor, str(device)),
            lambda: scaled_slopes(self.scaling, self.base_slopes, k_len, self.exponents).to(device),
        )

    def direction(self, device=None) -> Direction:
        """The heads' directions as :func:`alibi.bias` takes them (an int, or ``[H, 1, 1]``)."""
        return self.cached("direction", str(device), lambda: direction_of(self.directions, device))

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        """``[H, q_len, keys]`` bias for queries ``q_start ..`` over the first
        ``keys`` (default all) of a forward pass's ``k_len`` keys."""
        return alibi_bias(
            self.slopes(k_len, device), q_len, keys or k_len, self.directions, q_start, dtype, device,
            masked_value_for(self.mode, dtype), self.scaling,
        )


class LearnedAlibiBias(nn.Module, AlibiBias):
    """One layer's trained left/right slopes (encoder mode ``learned``).

    Parametrized as ``softplus(raw) + 1e-6`` so the bias stays negative,
    initialised to the paper's slopes on both sides; interpolation scales the
    two sides together (NTK spreads over all ``2H``).  The bias carries
    gradients, so it is built per layer and forward, never cached or shared.
    """

    supports_flex = False  # no score_mod for trained slopes
    has_slopes = False  # trained: key windows only in inference (kernels.two_sided_windows)
    learned = True

    def __init__(self, num_heads: int, scaling: Scaling = NO_SCALING):
        nn.Module.__init__(self)
        AlibiBias.__init__(self, num_heads, mode="learned", scaling=scaling)
        raw = learned_slopes_inverse(get_slopes(num_heads))
        self.left = nn.Parameter(raw.clone())
        self.right = nn.Parameter(raw.clone())

    def for_layer(self) -> "LearnedAlibiBias":
        return self

    def side_slopes(self, k_len: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """(left, right) positive float32 ``[H]`` slopes, interpolated for ``k_len`` keys."""
        left, right = learned_slopes(self.left), learned_slopes(self.right)
        if k_len is None:
            return left, right
        both = scaled_slopes(self.scaling, torch.cat([left, right]), k_len)
        return both[: self.num_heads], both[self.num_heads :]

    def slopes(self, k_len: int, device=None) -> Tensor:
        """float32 ``[2, H]``: the left and right slopes for ``k_len`` keys."""
        return torch.stack(self.side_slopes(k_len))

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        return alibi_bias(self.side_slopes(k_len), q_len, keys or k_len, self.directions, q_start, dtype, device,
                          scaling=self.scaling)

    def dense(self, q_len: int, k_len: int, dtype, device) -> Tensor:
        """Built per layer and forward (the slopes carry gradients), copied
        out of :func:`two_sided_ramp` where it is Toeplitz: one pass over
        ``H x T x T`` where :meth:`block` takes several (the same values)."""
        if q_len != k_len or not self.toeplitz:
            return self.block(k_len - q_len, q_len, k_len, dtype, device)
        return reversed_rows(two_sided_ramp(self, k_len, dtype, device), 0, k_len, k_len, k_len).flip(-2)

    def merged_mask(self, bias: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        pad = padding_mask(key_padding_mask, bias.dtype)
        return bias[None] if pad is None else bias[None] + pad


class ModuleBias(nn.Module, StackBias):
    """A learned causal bias of a position module (``positions.py``: T5's
    buckets, Kerple, FIRE): ``values(query, key)`` gives ``[H, q, k]`` float32
    for integer positions, keys right of a query are masked here.  One per
    stack, shared by its layers (T5's convention); the dense bias is built once
    per forward pass (:meth:`start_pass`, which the decoder calls) and carries
    gradients to the module's parameters.  A module that is not Toeplitz
    (FIRE) says with ``distance_only(k_len)`` when a pass is."""

    learned = True

    def __init__(self, module: nn.Module, num_heads: int, toeplitz: bool):
        nn.Module.__init__(self)
        StackBias.__init__(self, num_heads)
        self.method = module
        self._toeplitz = toeplitz
        self._pass = 0

    @property
    def toeplitz(self) -> bool:
        return self._toeplitz

    def start_pass(self) -> None:
        self._pass += 1

    def cached(self, name: str, key: Hashable, build: Callable[[], Any]) -> Any:
        """Cached within one forward pass, with the parameters as they are now
        (with gradients, only where the layers share graphs)."""
        if torch.is_grad_enabled() and not self.share_graphs:
            return build()
        versions = tuple(p._version for p in self.parameters())
        return StackBias.cached(self, name, (key, self._pass, versions, torch.is_grad_enabled()), build)

    def per_distance(self, k_len: int, device) -> Optional[Tensor]:
        """The module's values at distances ``0 .. k_len - 1`` where a pass of
        ``k_len`` keys depends on the distance alone: always for T5's buckets
        and Kerple; for FIRE while every query is below its threshold
        (``distance_only``); cached for the pass, shared by its layers."""
        if not (self._toeplitz or self.method.distance_only(k_len)):
            return None

        def build() -> Tensor:
            distance = torch.arange(k_len, device=device, dtype=torch.int64)[:, None]
            return self.method.values(distance, torch.zeros(1, 1, dtype=torch.int64, device=device))[..., 0].to(
                torch.float32)

        return self.cached("per_distance", (k_len, str(device)), build)

    def training_blocks(self, q_len: int, k_len: int, block: int, device) -> Optional[List[Tensor]]:
        """For a learned bias that is not Toeplitz and builds blocks of rows
        (FIRE past its threshold: ``Fire.reversed_block``): the float32 bias
        ``[H, rows, visible]`` of each block of ``block`` queries (the last
        ``q_len`` of ``k_len`` keys) over the keys it sees, last query first,
        with gradients.  Built once per pass and shared by the layers: each
        layer's blocked kernel returns its ``dS`` per block as these tensors'
        gradient, autograd sums them over the layers and takes the sum back
        through the build once, so nothing ``[H, T, S]`` is formed and the
        bias costs one build and one backward per pass, not per layer.  None
        for every other bias."""
        reversed_block = getattr(self.method, "reversed_block", None)
        if self._toeplitz or reversed_block is None:
            return None
        offset = k_len - q_len

        def build() -> List[Tensor]:
            return [reversed_block(offset + start, min(block, q_len - start), offset + min(start + block, q_len),
                                   device) for start in range(0, q_len, block)]

        return self.cached("training_blocks", (q_len, k_len, block, str(device)), build)

    def logged_scalars(self) -> Dict[str, Tensor]:
        scalars = getattr(self.method, "logged_scalars", None)
        return scalars() if scalars else {}

    def value_span(self) -> float:
        span = getattr(self.method, "value_span", None)
        return float(span()) if span else math.inf

    def shared_from(self, k_len: int) -> Optional[int]:
        shared_from = getattr(self.method, "shared_from", None)
        if not (self._toeplitz and shared_from):
            return None
        return self.cached("shared_from", k_len, lambda: shared_from(k_len))  # once per pass, not per layer

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        keys = keys or k_len
        if self._toeplitz:
            return toeplitz_block(self.method.values, q_start, q_len, keys, device).to(dtype)
        if hasattr(self.method, "reversed_block"):  # FIRE: values() bit for bit, with no lookup per pair
            return self.method.reversed_block(q_start, q_len, keys, device).flip(1).to(dtype)
        query, key = (p.long() for p in positions(q_len, keys, q_start, device))
        values = self.method.values(query, key).to(torch.float32)
        return values.masked_fill(key > query, float("-inf")).to(dtype)

    def key_block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: int,
                  first: int = 0) -> Tuple[Tensor, bool]:
        reversed_block = getattr(self.method, "reversed_block", None)
        if self._toeplitz or reversed_block is None:
            return StackBias.key_block(self, q_start, q_len, k_len, dtype, device, keys, first)
        return reversed_block(q_start, q_len, keys, device)[..., first:].to(dtype), True

    @property
    def heads_apart(self) -> bool:
        return not self._toeplitz and hasattr(self.method, "reversed_head_blocks")

    @property
    def own_kernels(self):  # type: ignore[override]
        """The module's own kernels, where it brings any (FIRE's fused long evaluation)."""
        return getattr(self.method, "own_kernels", {})

    def reversed_head_blocks(self, q_start: int, q_len: int, keys: int, device,
                             storage: Tensor, group: int = 1) -> Iterator[Tuple[slice, Tensor]]:
        """Where :attr:`heads_apart`, without gradients: ``(heads, their
        [h, q_len, keys] float32 bias, last query first)`` for ``group``
        heads at a time, each in ``storage`` (``Fire.reversed_head_blocks``)."""
        return self.method.reversed_head_blocks(q_start, q_len, keys, device, storage, group)


def toeplitz_block(values: Callable[[Tensor, Tensor], Tensor], q_start: int, q_len: int, keys: int,
                   device) -> Tensor:
    """float32 ``[H, q_len, keys]`` causal bias of queries ``q_start ..`` over
    keys ``0 .. keys - 1`` of a bias that depends on the distance ``i - j``
    alone (``values(query, key)``, integer positions: T5's buckets, Kerple).

    Evaluated once per distance (``q_start + q_len`` values per head, not one
    per pair) and laid out as the rows of one vector (:func:`distance_ramp`,
    :func:`reversed_rows`, put back in query order: the dense form the
    ``sdpa`` and ``reference`` kernels read).  Autograd's gradient of the
    view sums the score gradient along each diagonal, so the backward pass
    costs one pass over ``[H, q_len, keys]`` plus a per-distance gradient,
    where the pairwise form scatters every pair into the table.  The values
    are the pairwise form's, bit for bit (the same function of the same
    distances)."""
    far = q_start + q_len - 1  # the largest distance of the block
    distance = torch.arange(far, -1, -1, device=device, dtype=torch.int64)[:, None]  # far .. 0
    far_to_near = values(distance, torch.zeros(1, 1, dtype=torch.int64, device=device))[..., 0].to(torch.float32)
    ramp = distance_ramp(far_to_near, q_len + max(0, keys - far - 1))  # -inf for every key right of a query
    return reversed_rows(ramp, q_start, q_len, keys, far + 1).flip(-2)


def distance_ramp(far_to_near: Tensor, extra: int, fill: float = float("-inf")) -> Tensor:
    """``[H, S + extra]``: a causal Toeplitz bias as one vector per head, its
    values at distances ``S - 1`` down to 0 (``far_to_near`` ``[H, S]``: the
    row of the last of ``S`` queries), then ``extra`` entries of ``fill``
    (keys right of a query: ``-inf``, the causal mask).  Query ``a`` over
    key ``j`` reads entry ``S - 1 - a + j``, so every block of the ``[H, T,
    S]`` bias is a view of it (:func:`reversed_rows`), ``H x (S + extra)``
    values where the bias has ``H x T x S``."""
    return torch.cat([far_to_near, far_to_near.new_full((far_to_near.size(0), extra), fill)], dim=-1)


def reversed_rows(ramp: Tensor, q_start: int, rows: int, keys: int, k_len: int) -> Tensor:
    """``[H, rows, keys]`` view of a :func:`distance_ramp` of ``k_len`` keys:
    the bias of the queries at positions ``q_start + rows - 1`` down to
    ``q_start`` (last query first) over keys ``0 .. keys - 1``.  Rows in
    reverse order: a row reads the ramp forwards, so the next query's row
    starts one entry earlier, and a view cannot step backwards; callers flip
    their queries and outputs instead (``rows x D`` values, not ``rows x
    keys``).  The ramp needs ``rows - 1`` entries of ``extra``."""
    first = k_len - q_start - rows
    return ramp.unfold(-1, keys, 1)[:, first: first + rows]


def two_sided_ramp(bias: "StackBias", k_len: int, dtype, device) -> Tensor:
    """A bidirectional Toeplitz bias (an encoder's ALiBi, ``Scaling.relative``)
    as one vector per head, ``[H, 2 k_len - 1]``: the last query's row (keys
    ``0 .. k_len - 1``: distances ``k_len - 1`` down to 0) then the first
    query's right of its own key (distances -1 down to ``-(k_len - 1)``).
    Query ``a`` over key ``j`` reads entry ``k_len - 1 - a + j``, as in a
    causal :func:`distance_ramp`, so every block of queries over every
    key is a :func:`reversed_rows` view of it: ``2 H T`` values where
    the bias has ``H T^2``, and no block built per block of queries (the
    chunked kernel), or the whole bias copied out of it (learned slopes'
    dense bias, per layer and forward).  Cached where the slopes are fixed;
    learned slopes build it per call."""
    def build() -> Tensor:
        last = bias.block(k_len - 1, 1, k_len, dtype, device)[:, 0]
        first = bias.block(0, 1, k_len, dtype, device)[:, 0, 1:]
        return torch.cat([last, first], dim=-1)

    if bias.learned:
        return build()
    return bias.cached("two_sided_ramp", (k_len, dtype, str(device), bias.scaling.factor_at(k_len)), build)


class CausalMask(StackBias):
    """No bias: the causal mask alone (NoPE).  ``zero``: the kernels run
    bias-free causal attention where they can (SDPA's ``is_causal``); the dense
    form (``0`` where a query sees a key, ``-inf`` to its right) serves the
    reference kernel and padded or cached calls."""

    zero = True

    def block(self, q_start: int, q_len: int, k_len: int, dtype, device, keys: Optional[int] = None) -> Tensor:
        query, key = positions(q_len, keys or k_len, q_start, device)
        hidden = (key > query).expand(self.num_heads, -1, -1)
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))
