"""Context extension for Hugging Face ALiBi models: the hooks of ``apply_alibi_scaling``.

``apply_alibi_scaling(model, method, factor, train_length, alpha)`` makes a
transformers 5.23 model use the bias of ``fairseq_alibi.alibi.Scaling`` -- the
one scaling spec of fairseq models too, with the same spelling -- so a sweep
compares like with like.  It hooks into the model *instance* (forward
pre-hooks and one instance attribute), copies no modeling code, and
``remove_alibi_scaling`` / ``alibi_scaling`` undo it exactly.

While scaled, the bias is :func:`fairseq_alibi.alibi.bias` of the attended
positions: distances ``i - j`` as integers, times the slope in float32, one
final cast.  That also repairs three upstream defects that corrupt
long-context measurements (see docs/hf.md):

* BLOOM (and Falcon) build ``slope * j`` over absolute key positions in the
  activation dtype (Falcon even in bfloat16 for float32 models): at long
  lengths adjacent keys get the same bias.  The default ``bias_form="relative"``
  forms ``-slope * (i - j)`` instead; ``bias_form="upstream"`` keeps their form.
* Falcon's eager attention (also taken with ``output_attentions=True``) adds
  ALiBi twice; the scaled model adds it once on every path.
* MPT ignores ``attn_config.alibi_bias_max`` and fails on inputs longer than
  ``max_seq_len``; the scaled model honours both.

Models exported by ``alibi-export-hf`` (family ``fairseq``) carry this
package's own bias: scaling them rescales it natively (no hooks).

Dynamic scaling (``factor=0``) picks the factor per forward pass from the
number of keys (cached + new tokens) and the training length.  Keys already in a
KV cache were computed under earlier slopes, so with dynamic scaling
incremental decoding differs from recomputing the whole sequence; a static
factor keeps incremental decoding exact.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import alibi
from ..alibi import DISTANCE_METHODS, Scaling, ScalingError
from .families import EXPORTED, base_slopes, hf_train_length, resolve

BIAS_FORMS = ("relative", "upstream")
_STATE_ATTR = "_fairseq_alibi_scaling"
_MISSING = object()


@dataclass
class ScalingState:
    """What one scaled model instance holds: its spec, slopes and hooks, and
    the lengths and bias of the forward pass under way (``current``).

    The slopes are numbers, not tensors: a tensor held here would be neither
    parameter nor buffer, left behind by ``model.to()``, and on the meta
    device (or uninitialized after ``to_empty``) when the model was built
    there.  Each forward pass makes them on its own device
    (:meth:`scaled_slopes`); under ``torch.compile`` they are constants."""

    family: str
    scaling: Scaling
    bias_form: str
    slopes: Tuple[float, ...]  # unscaled
    exponents: Tuple[float, ...]  # alibi.slope_exponents of the method, computed once
    forward_parameters: Tuple[str, ...]  # the base model's forward arguments, in order
    handles: List[Any] = field(default_factory=list)
    saved_attrs: Dict[str, Any] = field(default_factory=dict)
    current: Optional[Dict[str, Any]] = None  # per forward pass
    last_factor: Any = None  # the factor of the latest forward pass (a tensor with a static cache)

    @property
    def num_heads(self) -> int:
        return len(self.slopes)

    def scaled_slopes(self, kv_len, device) -> torch.Tensor:
        """float32 ``[H]`` on ``device``: the slopes of a pass over ``kv_len`` keys
        (an int, or a static cache's length tensor: no branch on its value)."""
        base, exponents = (torch.tensor(v, dtype=torch.float32, device=device) for v in (self.slopes, self.exponents))
        return self.scaling.slopes(base, kv_len, exponents)

    def settings(self) -> Dict[str, Any]:
        s = self.scaling
        return dict(method=s.method, factor=s.factor, train_length=s.train_length, alpha=s.alpha,
                    bias_form=self.bias_form)


def _start_forward(state: ScalingState, module, args, kwargs) -> None:
    """Forward pre-hook of the base model: record lengths and slopes for this pass.
    Traceable by ``torch.compile(fullgraph=True)``: the argument names were read
    when the hooks were installed, and a static cache's length stays a tensor."""
    arguments = dict(zip(state.forward_parameters, args), **kwargs)
    tokens = arguments.get("input_ids")
    if tokens is None:
        tokens = arguments.get("inputs_embeds")
    if tokens is None:
        state.current = None  # the model itself will raise its own error
        return
    q_len = tokens.shape[1]
    cache = arguments.get("past_key_values")
    if cache is not None and not hasattr(cache, "get_seq_length"):
        raise TypeError(
            f"past_key_values must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}"
        )
    past = cache.get_seq_length() if cache is not None else 0  # an int, or a tensor (StaticCache)
    # a cache made without a config has no layers before its first update (and no maximum)
    cache_max = int(cache.get_max_length()) if cache is not None and getattr(cache, "layers", True) else -1
    mask = arguments.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"ALiBi scaling needs a 2-D [batch, keys] attention_mask (or none), got shape {tuple(mask.shape)}"
        )
    kv_len = past + q_len
    state.last_factor = state.scaling.factor_at(kv_len)
    state.current = dict(q_len=q_len, past=past, kv_len=kv_len, cache_max=cache_max, mask=mask, built=None,
                         slopes=state.scaled_slopes(kv_len, tokens.device))


def _end_forward(state: ScalingState, *unused) -> None:
    state.current = None


def _positions(current: Dict[str, Any], kv: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """int64 (query positions ``[B', q]``, key positions ``[B', kv]``), ``B'`` 1 or batch.

    Without a mask positions are column indices; with one they count only the
    attended tokens (as BLOOM and Falcon do), so left padding does not shift them.
    The queries are the ``q`` columns after the ``past`` cached ones.
    """
    mask = current["mask"]
    if mask is None:
        keys = torch.arange(kv, device=device)[None, :]
    else:
        if mask.shape[-1] != kv:
            raise RuntimeError(f"attention_mask has {mask.shape[-1]} columns for {kv} keys")
        attended = mask.to(device=device, dtype=torch.long)
        keys = (attended.cumsum(-1) - 1) * attended
    start, q_len = current["past"], current["q_len"]
    if isinstance(start, int) and start + q_len > kv:
        raise RuntimeError(f"{start} cached + {q_len} new tokens exceed the {kv} keys")
    # gathered, not sliced: a static cache's start is a tensor (data, not a shape)
    return keys[:, torch.arange(q_len, device=device) + start], keys


def relative_bias(state: ScalingState, kv: int, batch: int, device) -> torch.Tensor:
    """float32 ``[B, H, q, kv]``: :func:`alibi.bias` of this pass's attended
    positions; keys right of a query (which the model masks itself) get 0, so
    its own additive mask stays finite."""
    current = state.current
    queries, keys = _positions(current, kv, device)
    slopes = current["slopes"].to(device)[None, :, None, None]
    bias = alibi.bias(slopes, queries[:, None, :, None], keys[:, None, None, :], state.scaling,
                      alibi.LOOK_LEFT, masked_value=0.0)
    return bias.expand(batch, -1, -1, -1)


def _bloom_block_hook(state: ScalingState, block, args, kwargs):
    """BloomBlock pre-hook: replace the ``alibi`` argument (``[B*H, 1 or q, kv]``)."""
    current = state.current
    if current is None:
        return None
    if "alibi" not in kwargs:
        raise RuntimeError("BloomBlock was not called with alibi=...: unsupported transformers version")
    if current["built"] is None:
        upstream = kwargs["alibi"]
        heads = state.num_heads
        batch, kv = upstream.shape[0] // heads, upstream.shape[-1]
        if state.bias_form == "relative":
            bias = relative_bias(state, kv, batch, upstream.device).reshape(batch * heads, current["q_len"], kv)
        else:  # BLOOM's own form: slope * key position, cast as a whole
            _, keys = _positions(current, kv, upstream.device)
            bias = current["slopes"].to(upstream.device)[None, :, None] * keys[:, None, :]
            bias = bias.expand(batch, -1, -1).reshape(batch * heads, 1, kv)
        current["built"] = bias.to(upstream.dtype)
    kwargs["alibi"] = current["built"]
    return args, kwargs


def _falcon_block_hook(state: ScalingState, block, args, kwargs):
    """FalconDecoderLayer pre-hook: put our bias in the float mask, zero ``alibi``.

    Falcon folds ``alibi / sqrt(head_dim)`` into the 4-D mask (what SDPA uses)
    and its eager path adds ``alibi`` again; with ``alibi`` zeroed both paths
    add the bias exactly once.
    """
    current = state.current
    if current is None:
        return None
    upstream = kwargs.get("attention_mask")
    if upstream is None or upstream.dim() != 4 or not upstream.is_floating_point() or "alibi" not in kwargs:
        raise RuntimeError(
            "Falcon did not fold ALiBi into a float 4-D attention mask: unsupported attention "
            "implementation or transformers version"
        )
    if current["built"] is None:
        batch, kv = upstream.shape[0], upstream.shape[-1]
        dtype, device = upstream.dtype, upstream.device
        head_dim = block.self_attention.head_dim
        if state.bias_form == "relative":
            bias = (relative_bias(state, kv, batch, device) / math.sqrt(head_dim)).to(dtype)
        else:  # Falcon's own form: bfloat16 slope * key position, then the model dtype
            _, keys = _positions(current, kv, device)
            slopes = current["slopes"].to(device)
            bias = (slopes.to(torch.bfloat16)[None, :, None] * keys[:, None, :]).to(dtype)
            bias = (bias / math.sqrt(head_dim))[:, :, None, :].expand(batch, -1, current["q_len"], -1)
        # Upstream's mask is its (non-negative) bias where attended, dtype-min elsewhere.
        hidden = upstream < -1
        mask = bias.masked_fill(hidden, torch.finfo(dtype).min)
        zeros = torch.zeros(batch, state.num_heads, 1, kv, dtype=kwargs["alibi"].dtype, device=device)
        current["built"] = (mask, zeros)
    kwargs["attention_mask"], kwargs["alibi"] = current["built"]
    return args, kwargs


def _mpt_alibi_builder(state: ScalingState):
    """Instance replacement of ``MptModel.build_mpt_alibi_tensor``.

    MPT's form is ALiBi's bias of the last key's row, ``[H, 1, L]`` (a per-row
    shift of every other row, which softmax ignores); the attention keeps its
    last ``kv`` columns.  ``L`` covers the keys of this pass, so inputs longer
    than ``max_seq_len`` work.  A distance method is no per-row shift of one
    row, so for those the whole ``[H, q, kv]`` bias of the pass is built (MPT
    keeps its last ``q`` rows and ``kv`` columns; ``kv`` counts a static
    cache's empty slots, which MPT masks).
    """

    def build_mpt_alibi_tensor(num_heads, sequence_length, alibi_bias_max=8, device=None):
        current, scaling = state.current, state.scaling
        if current is None:  # called outside a forward pass: the static or unscaled slopes
            slopes, length = state.scaled_slopes(sequence_length, device), sequence_length
        else:
            slopes = current["slopes"]
            length = max(sequence_length, current["kv_len"], current["cache_max"])
        slopes = slopes.to(device)[:, None, None]
        if scaling.method in DISTANCE_METHODS and current is not None:
            queries = torch.arange(current["past"], current["kv_len"], device=device)[:, None]
            keys = torch.arange(max(current["kv_len"], current["cache_max"]), device=device)[None, :]
            return alibi.bias(slopes, queries, keys, scaling, alibi.LOOK_LEFT, masked_value=0.0)
        keys = torch.arange(length, device=device)[None, :]
        return alibi.bias(slopes, torch.tensor(length - 1, device=device), keys, scaling, alibi.LOOK_BOTH)

    return build_mpt_alibi_tensor


def _checked_scaling(model, method, factor, train_length, alpha, bias_form: str) -> Scaling:
    """The complete scaling spec of the arguments (``ValueError`` naming the bad one)."""
    if bias_form not in BIAS_FORMS:
        raise ValueError(f"bias_form={bias_form!r} is not valid; allowed: {', '.join(BIAS_FORMS)}")
    if isinstance(method, Scaling):
        if factor != 0.0 or train_length is not None or alpha is not None:
            raise ValueError("give a Scaling alone, or method, factor, train_length and alpha, not both")
        scaling = method
    else:
        recorded = hf_train_length(getattr(model, "config", None)) if train_length is None else train_length
        scaling = Scaling(method, factor, recorded, alpha)
    try:
        scaling.complete()
    except ScalingError:
        what = "dynamic scaling (factor=0)" if scaling.dynamic else scaling.method
        raise ValueError(
            f"train_length=None is not valid; {what} needs the length the model was trained at, "
            "which this model's config does not record: pass train_length=L"
        ) from None
    if bias_form == "upstream" and scaling.method in DISTANCE_METHODS:
        raise ValueError(f"bias_form='upstream' builds a bias of key positions only, which cannot transform "
                         f"distances; use the default bias_form='relative' with {scaling.method}")
    return scaling


def apply_alibi_scaling(model, method="none", factor: float = 0.0, train_length: Optional[int] = None,
                        bias_form: str = "relative", *, alpha: Optional[float] = None):
    """Extend the context of a BLOOM, MPT, Falcon (alibi=True) or exported model in place.

    ``method``, ``factor``, ``train_length`` and ``alpha`` are
    ``fairseq_alibi.alibi.Scaling``'s (or pass a ``Scaling`` as ``method``):
    ``none``; ``linear`` or ``ntk`` with a static ``factor >= 1`` or
    ``factor=0`` for dynamic scaling (``max(1, kv_length / train_length)`` per
    forward pass, ``kv_length`` the cached plus new tokens); ``cap``, ``log``
    (with ``alpha``) or ``capnorm`` past ``factor x train_length`` (``factor=0``
    meaning 1).  ``train_length`` defaults to what the model's config records
    (``hf_train_length``).  ``bias_form``: ``relative`` (default, ``-slope *
    (i - j)`` formed in float32) or ``upstream`` (the model's own form, with
    the scaled slopes; not with the distance methods).

    Applying again replaces the previous scaling.  Returns ``model``.  The hooks
    belong to this instance: copy a model before scaling it, not after.
    """
    family, base = resolve(model)
    scaling = _checked_scaling(model, method, factor, train_length, alpha, bias_form)
    if getattr(base, _STATE_ATTR, None) is not None:
        remove_alibi_scaling(model)
    slopes = base_slopes(model)
    state = ScalingState(family=family, scaling=scaling, bias_form=bias_form, slopes=tuple(slopes.tolist()),
                         exponents=tuple(alibi.slope_exponents(slopes, scaling.method).tolist()),
                         forward_parameters=tuple(inspect.signature(base.forward).parameters))
    if family == EXPORTED:
        _scale_exported(state, base)
        return model
    state.handles.append(
        base.register_forward_pre_hook(
            lambda module, args, kwargs: _start_forward(state, module, args, kwargs), with_kwargs=True
        )
    )
    state.handles.append(base.register_forward_hook(lambda *a: _end_forward(state), always_call=True))
    if family in ("bloom", "falcon"):
        hook = _bloom_block_hook if family == "bloom" else _falcon_block_hook
        for block in base.h:
            state.handles.append(
                block.register_forward_pre_hook(
                    lambda module, args, kwargs, hook=hook: hook(state, module, args, kwargs), with_kwargs=True
                )
            )
    else:  # mpt: MptModel.forward calls self.build_mpt_alibi_tensor
        name = "build_mpt_alibi_tensor"
        state.saved_attrs[name] = base.__dict__.get(name, _MISSING)
        setattr(base, name, _mpt_alibi_builder(state))
    setattr(base, _STATE_ATTR, state)
    return model


def _scale_exported(state: ScalingState, base) -> None:
    """An exported model rescales its own bias; its loaded ``alibi_scaling`` is kept to restore."""
    scaling, recorded = state.scaling, base.config.alibi_train_length
    if state.bias_form != "relative":
        raise ValueError(f"bias_form={state.bias_form!r} applies to BLOOM and Falcon; an exported model always "
                         "forms -slope * (i - j) (bias_form='relative')")
    if scaling.method in DISTANCE_METHODS and scaling.train_length != recorded:
        raise ValueError(f"train_length={scaling.train_length} is not valid for {scaling.method} on an exported "
                         f"model: C is factor x its alibi_train_length ({recorded})")
    state.saved_attrs["alibi_scaling"] = base.config.alibi_scaling
    base.set_alibi_scaling(scaling.to_hf())
    setattr(base, _STATE_ATTR, state)


def remove_alibi_scaling(model):
    """Undo ``apply_alibi_scaling``: hooks removed, instance attributes restored.  Returns ``model``."""
    _, base = resolve(model)
    state = getattr(base, _STATE_ATTR, None)
    if state is None:
        return model
    for handle in state.handles:
        handle.remove()
    if state.family == EXPORTED:
        base.set_alibi_scaling(state.saved_attrs.pop("alibi_scaling"))
    for name, value in state.saved_attrs.items():
        if value is _MISSING:
            base.__dict__.pop(name, None)
        else:
            setattr(base, name, value)
    del base.__dict__[_STATE_ATTR]
    return model


def alibi_scaling_settings(model) -> Optional[Dict[str, Any]]:
    """The settings a model is scaled with (``method``, ``factor``, ...), or None."""
    _, base = resolve(model)
    state = getattr(base, _STATE_ATTR, None)
    if state is None:
        return None
    last = state.last_factor
    return dict(state.settings(), last_factor=float(last) if last is not None else None)


@contextlib.contextmanager
def alibi_scaling(model, method="none", factor: float = 0.0, train_length: Optional[int] = None,
                  bias_form: str = "relative", *, alpha: Optional[float] = None):
    """``with alibi_scaling(model, "ntk", 2.0): ...`` -- scaled inside, as before outside."""
    _, base = resolve(model)
    previous = getattr(base, _STATE_ATTR, None)
    previous = previous.settings() if previous is not None else None
    apply_alibi_scaling(model, method, factor, train_length, bias_form, alpha=alpha)
    try:
        yield model
    finally:
        remove_alibi_scaling(model)
        if previous is not None:
            apply_alibi_scaling(model, **previous)
