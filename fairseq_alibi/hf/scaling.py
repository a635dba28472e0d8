"""Context extension for Hugging Face ALiBi models: the hooks of ``apply_alibi_scaling``.

``apply_alibi_scaling(model, method, factor, train_length, alpha)`` makes a
transformers 5.23 model use the bias of ``fairseq_alibi.core.Scaling`` -- the
one scaling spec of fairseq models too, with the same spelling -- so a sweep
compares like with like.  It hooks into the model *instance* (forward
pre-hooks and one instance attribute), copies no modeling code, and
``remove_alibi_scaling`` / ``alibi_scaling`` undo it exactly.

While scaled, the bias is :func:`fairseq_alibi.core.alibi.bias` of the attended
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
package's own positions, of any method: scaling them rescales those natively
(no hooks), under the methods of their position method (RoPE's ``yarn`` for
a rotary export, for instance).  GPT-NeoX (rotary) is scaled through
transformers' own ``rope_parameters``: its rotary embedding is rebuilt from
them (:func:`~fairseq_alibi.core.configuration_alibi.neox_rope_parameters`,
the translation ``alibi-export-hf --format gpt-neox`` writes), so its numbers
are transformers' RoPE scaling, not a copy of ours.

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

from ..core import alibi
from ..core.configuration_alibi import neox_computes, neox_rope_parameters
from ..core.errors import ConfigError, InputError
from ..core.positions import extensions
from ..core.scaling import DISTANCE_METHODS, Scaling, check_applies, warn_if_cache_drifts
from ..errors import UnsupportedModelError
from .families import EXPORTED, NEOX, base_slopes, hf_train_length, position_method, resolve

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
        """float32 slopes on ``device`` of a pass over ``kv_len`` keys: ``[H]``
        for an int or a 0-d tensor (a static cache's length: no branch on its
        value), ``[B, H]`` for one key count per row (dynamic scaling of a
        padded batch: each row's factor from its own keys)."""
        base, exponents = (torch.tensor(v, dtype=torch.float32, device=device) for v in (self.slopes, self.exponents))
        return alibi.scaled_slopes(self.scaling, base, kv_len, exponents)

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
        raise InputError(
            f"past_key_values must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}"
        )
    past = cache.get_seq_length() if cache is not None else 0  # an int, or a tensor (StaticCache)
    # a cache made without a config has no layers before its first update (and no maximum)
    cache_max = int(cache.get_max_length()) if cache is not None and getattr(cache, "layers", True) else -1
    mask = arguments.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise InputError(
            f"ALiBi scaling needs a 2-D [batch, keys] attention_mask (or none), got shape {tuple(mask.shape)}: "
            "pass the tokenizer's attention_mask (a static cache takes it 2-D too)"
        )
    kv_len = past + q_len
    # dynamic scaling: each row's factor from its own keys (docs/evaluating.md, "Padded batches")
    lengths = mask.sum(-1) if mask is not None and state.scaling.dynamic else kv_len
    state.last_factor = state.scaling.factor_at(lengths)
    warn_if_cache_drifts(state.scaling, past, lengths)
    state.current = dict(q_len=q_len, past=past, kv_len=kv_len, cache_max=cache_max, mask=mask, built=None,
                         slopes=state.scaled_slopes(lengths, tokens.device))


def _row_slopes(current: Dict[str, Any], device) -> torch.Tensor:
    """float32 ``[B', H]`` slopes of this pass, ``B'`` 1 or one row each."""
    slopes = current["slopes"].to(device)
    return slopes if slopes.dim() == 2 else slopes[None]


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
            raise InputError(f"attention_mask has {mask.shape[-1]} columns for {kv} keys (cached + new tokens)")
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
    slopes = _row_slopes(current, device)[:, :, None, None]
    bias = alibi.bias(slopes, queries[:, None, :, None], keys[:, None, None, :], state.scaling,
                      alibi.LOOK_LEFT, masked_value=0.0)
    return bias.expand(batch, -1, -1, -1)


def _bloom_block_hook(state: ScalingState, block, args, kwargs):
    """BloomBlock pre-hook: replace the ``alibi`` argument (``[B*H, 1 or q, kv]``)."""
    current = state.current
    if current is None:
        return None
    if "alibi" not in kwargs:
        raise UnsupportedModelError("BloomBlock was not called with alibi=...: this transformers version is not "
                                    "supported (install the one requirements.txt pins)")
    if current["built"] is None:
        upstream = kwargs["alibi"]
        heads = state.num_heads
        batch, kv = upstream.shape[0] // heads, upstream.shape[-1]
        if state.bias_form == "relative":
            bias = relative_bias(state, kv, batch, upstream.device).reshape(batch * heads, current["q_len"], kv)
        else:  # BLOOM's own form: slope * key position, cast as a whole
            _, keys = _positions(current, kv, upstream.device)
            bias = _row_slopes(current, upstream.device)[:, :, None] * keys[:, None, :]
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
        raise UnsupportedModelError(
            "Falcon did not fold ALiBi into a float 4-D attention mask: load it with attn_implementation='sdpa' "
            "or 'eager', under the transformers version requirements.txt pins"
        )
    if current["built"] is None:
        batch, kv = upstream.shape[0], upstream.shape[-1]
        dtype, device = upstream.dtype, upstream.device
        head_dim = block.self_attention.head_dim
        if state.bias_form == "relative":
            bias = (relative_bias(state, kv, batch, device) / math.sqrt(head_dim)).to(dtype)
        else:  # Falcon's own form: bfloat16 slope * key position, then the model dtype
            _, keys = _positions(current, kv, device)
            slopes = _row_slopes(current, device)
            bias = (slopes.to(torch.bfloat16)[:, :, None] * keys[:, None, :]).to(dtype)
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
            slopes = _mpt_slopes(current, scaling)
            length = max(sequence_length, current["kv_len"], current["cache_max"])
        slopes = slopes.to(device)[:, None, None]
        if scaling.method in DISTANCE_METHODS and current is not None:
            queries = torch.arange(current["past"], current["kv_len"], device=device)[:, None]
            keys = torch.arange(max(current["kv_len"], current["cache_max"]), device=device)[None, :]
            return alibi.bias(slopes, queries, keys, scaling, alibi.LOOK_LEFT, masked_value=0.0)
        keys = torch.arange(length, device=device)[None, :]
        return alibi.bias(slopes, torch.tensor(length - 1, device=device), keys, scaling, alibi.LOOK_BOTH)

    return build_mpt_alibi_tensor


def _mpt_slopes(current: Dict[str, Any], scaling: Scaling) -> torch.Tensor:
    """The ``[H]`` slopes of an MPT pass: MPT adds one bias to every row of the
    batch, so rows whose own numbers would differ are refused, never scored
    under another row's bias."""
    slopes = current["slopes"]
    if slopes.dim() == 2:
        if not bool((slopes == slopes[:1]).all()):
            raise InputError("MPT adds one ALiBi bias to every row of a batch, and with dynamic scaling the "
                             "padded rows of this batch have factors of their own: score rows of one length "
                             "together (or one at a time), or use a static factor")
        slopes = slopes[0]
    mask = current["mask"]
    if not scaling.relative and mask is not None and bool((mask[:, 0] == 0).any()):
        raise InputError(f"{scaling.method} counts a query's keys from the first column, and MPT's bias is "
                         "shared by the batch's rows: left-padded rows would count their padding; pad on the "
                         "right or score rows one at a time")
    return slopes


#: What transformers' GPT-NeoX computes of RoPE's methods (``neox_rope_parameters``).
NEOX_METHODS = ("none", "linear (static)", "ntk (static or dynamic)", "yarn (static)")


def extensions_of(family: str, position: str) -> Tuple[str, ...]:
    """The extension methods a model of ``family`` takes: an export's and
    GPT-NeoX's those of their position method (``core.positions``); BLOOM's,
    MPT's and Falcon's those the hooks here compute (``alibi.EXTENSIONS``:
    no ``logn``, which scales the logits these models compute themselves)."""
    if family not in (EXPORTED, NEOX):
        return alibi.EXTENSIONS
    return extensions(position)


def _checked_scaling(model, family: str, method, factor, train_length, alpha, bias_form: str) -> Scaling:
    """The complete scaling spec of the arguments (``ConfigError`` naming the
    bad one).  The training length defaults to what the config records; an
    exported model's is its own (``Scaling.for_model``), another model's a
    record the user may correct."""
    if bias_form not in BIAS_FORMS:
        raise ConfigError(f"bias_form={bias_form!r} is not valid; allowed values: {', '.join(BIAS_FORMS)}")
    if isinstance(method, Scaling):
        if factor != 0.0 or train_length is not None or alpha is not None:
            raise ConfigError("give a Scaling alone, or method, factor, train_length and alpha, not both")
        scaling = method
    else:
        scaling = Scaling(method, factor, train_length, alpha)
    recorded = hf_train_length(getattr(model, "config", None))
    if family == EXPORTED or scaling.train_length is None:
        scaling = scaling.for_model(recorded)
    position = position_method(model.config)
    scaling = check_applies(scaling, position, extensions_of(family, position)).complete()
    if family in (EXPORTED, NEOX) and bias_form != "relative":
        raise ConfigError(f"bias_form={bias_form!r} applies to BLOOM and Falcon; a {family} model computes its "
                          "own positions (bias_form='relative')")
    if family == NEOX and not neox_computes(scaling):
        raise ConfigError(f"{'dynamic ' if scaling.dynamic else ''}{scaling.method} has no transformers rope_type; "
                          f"GPT-NeoX takes {', '.join(NEOX_METHODS)} (an alibi-export-hf export in the default "
                          "format computes every method)")
    if bias_form == "upstream" and scaling.method in DISTANCE_METHODS:
        raise ConfigError(f"bias_form='upstream' builds a bias of key positions only, which cannot transform "
                          f"distances; use the default bias_form='relative' with {scaling.method}")
    return scaling


def apply_alibi_scaling(model, method="none", factor: float = 0.0, train_length: Optional[int] = None,
                        bias_form: str = "relative", *, alpha: Optional[float] = None):
    """Extend the context of a BLOOM, MPT, Falcon (alibi=True), GPT-NeoX or exported model in place.

    ``method``, ``factor``, ``train_length`` and ``alpha`` are
    ``fairseq_alibi.core.Scaling``'s (or pass a ``Scaling`` as ``method``):
    ``none``; ``linear`` or ``ntk`` with a static ``factor >= 1`` or
    ``factor=0`` for dynamic scaling (``max(1, kv_length / train_length)`` per
    forward pass, ``kv_length`` the cached plus new tokens of each row, padding
    not counted); ``cap``, ``log`` or ``power`` (both with ``alpha``) or
    ``capnorm`` past ``factor x train_length`` (``factor=0`` meaning 1).
    ``train_length`` defaults to what the model's config records
    (``hf_train_length``).  ``bias_form``: ``relative`` (default, ``-slope *
    (i - j)`` formed in float32) or ``upstream`` (the model's own form, with
    the scaled slopes; not with the distance methods).  An exported model
    takes its own position method's methods (RoPE's yarn for rotary); GPT-NeoX
    takes transformers' own RoPE scaling (static linear and yarn, ntk),
    through its config's ``rope_parameters``.

    Applying again replaces the previous scaling.  Returns ``model``.  The hooks
    belong to this instance: copy a model before scaling it, not after.
    """
    family, base = resolve(model)
    scaling = _checked_scaling(model, family, method, factor, train_length, alpha, bias_form)
    if getattr(base, _STATE_ATTR, None) is not None:
        remove_alibi_scaling(model)
    slopes = base_slopes(model) if family != NEOX else None  # a rotary model has none
    state = ScalingState(family=family, scaling=scaling, bias_form=bias_form,
                         slopes=tuple(slopes.tolist()) if slopes is not None else (),
                         exponents=tuple(alibi.slope_exponents(slopes, scaling.method).tolist())
                         if slopes is not None else (),
                         forward_parameters=tuple(inspect.signature(base.forward).parameters))
    if family == EXPORTED:
        _scale_exported(state, base)
        return model
    if family == NEOX:
        _scale_neox(state, base)
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
    if state.bias_form != "relative":
        raise ConfigError(f"bias_form={state.bias_form!r} applies to BLOOM and Falcon; an exported model always "
                          "forms -slope * (i - j) (bias_form='relative')")
    state.saved_attrs["alibi_scaling"] = base.config.alibi_scaling
    base.set_alibi_scaling(state.scaling)
    setattr(base, _STATE_ATTR, state)


def _neox_rotary(base, rope_parameters: dict):
    """GPT-NeoX's rotary embedding built by transformers from ``rope_parameters`` (set in its config)."""
    base.config.rope_parameters = rope_parameters
    loaded = base.rotary_emb.inv_freq  # the rebuilt frequencies go where the loaded ones are, in their dtype
    return type(base.rotary_emb)(base.config).to(device=loaded.device, dtype=loaded.dtype)


def _scale_neox(state: ScalingState, base) -> None:
    """GPT-NeoX: its config's ``rope_parameters`` for the method, its rotary embedding rebuilt from them
    by transformers; the loaded ones are kept to restore."""
    import copy

    loaded = copy.deepcopy(dict(base.config.rope_parameters))
    head_dim = base.config.hidden_size // base.config.num_attention_heads
    rotary_dim = int(head_dim * loaded.get("partial_rotary_factor", 1.0))
    wanted = neox_rope_parameters(state.scaling, loaded.get("rope_theta", 10000.0), rotary_dim, head_dim)
    if loaded.get("rope_type", "default") != "default" and state.scaling.method != "none":
        raise ConfigError(f"this GPT-NeoX is already extended (rope_parameters {loaded}); scale a model with "
                          "rope_type 'default'")
    if state.scaling.method == "none":
        wanted = loaded
    state.saved_attrs["rope_parameters"] = loaded
    state.saved_attrs["rotary_emb"] = base.rotary_emb
    base.rotary_emb = _neox_rotary(base, wanted)
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
    if state.family == NEOX:
        base.config.rope_parameters = state.saved_attrs.pop("rope_parameters")
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
    last = base.last_alibi_factor if state.family == EXPORTED else state.last_factor
    return dict(state.settings(), last_factor=plain_factor(last))


def plain_factor(factor) -> Any:
    """A pass's factor as plain numbers: one float, or one per row where rows differ (None before any pass)."""
    if factor is None or not isinstance(factor, torch.Tensor):
        return None if factor is None else float(factor)
    values = factor.flatten().tolist()
    return values[0] if len(set(values)) == 1 else values


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
