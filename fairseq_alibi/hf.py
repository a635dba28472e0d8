"""Context extension for Hugging Face ALiBi models (BLOOM, MPT, Falcon with ALiBi,
and fairseq models exported by ``alibi-export-hf``).

``apply_alibi_scaling(model, method, factor, train_length)`` makes a
transformers 5.23 model use the bias of ``fairseq_alibi.alibi.Scaling`` -- the
one scaling spec of fairseq models too, with the same spelling: ``linear`` and
``ntk`` with a static factor >= 1 or ``0`` for dynamic, ``cap`` with its cap in
training lengths -- so a sweep compares like with like.  It hooks into
the model *instance* (forward pre-hooks and one instance attribute), copies no
modeling code, and ``remove_alibi_scaling`` / ``alibi_scaling`` undo it exactly.

While scaled, the bias is built the way the fairseq path builds it: distances
``i - j`` as integers, times the slope in float32, one final cast.  That also
repairs three upstream defects that corrupt long-context measurements
(see docs/hf.md):

* BLOOM (and Falcon) build ``slope * j`` over absolute key positions in the
  activation dtype (Falcon even in bfloat16 for float32 models): at long
  lengths adjacent keys get the same bias.  The default ``bias_form="relative"``
  forms ``-slope * (i - j)`` instead; ``bias_form="upstream"`` keeps their form.
* Falcon's eager attention (also taken with ``output_attentions=True``) adds
  ALiBi twice; the scaled model adds it once on every path.
* MPT ignores ``attn_config.alibi_bias_max`` and fails on inputs longer than
  ``max_seq_len``; the scaled model honours both.

Models exported by ``alibi-export-hf`` (family ``fairseq``) carry this
package's own bias: scaling them rescales it natively (no hooks), and
:func:`load_hf_model` loads them with this package's ``modeling_alibi`` classes,
never with the code files of their directory.

Dynamic scaling (``factor=0``) picks the factor per forward pass from the
number of keys (cached + new tokens) and the training length.  Keys already in a
KV cache were computed under earlier slopes, so with dynamic scaling
incremental decoding differs from recomputing the whole sequence; a static
factor keeps incremental decoding exact.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .alibi import Scaling, get_slopes
from .errors import HFLoadError, UnsupportedModelError

BIAS_FORMS = ("relative", "upstream")
SUPPORTED_MODELS = (
    "BLOOM (BloomModel, BloomForCausalLM), MPT (MptModel, MptForCausalLM), "
    "Falcon with config.alibi=True (FalconModel, FalconForCausalLM) and fairseq models "
    "exported by alibi-export-hf (AlibiLMModel, AlibiForCausalLM)"
)
#: The family of models written by ``alibi-export-hf`` (this package's ``modeling_alibi``).
EXPORTED = "fairseq"
_STATE_ATTR = "_fairseq_alibi_scaling"


# ---------------------------------------------------------------------------
# Which model is this?
# ---------------------------------------------------------------------------


def _families():
    # Imported lazily: transformers is only needed by users of this module.
    from transformers.models.bloom.modeling_bloom import BloomModel
    from transformers.models.falcon.modeling_falcon import FalconModel
    from transformers.models.mpt.modeling_mpt import MptModel

    return (("bloom", BloomModel), ("mpt", MptModel), ("falcon", FalconModel))


def _exported(base) -> bool:
    """A decoder of ``modeling_alibi`` (this package's, or its copy in a model directory)."""
    from .configuration_alibi import MODEL_TYPE

    config = getattr(base, "config", None)
    return getattr(config, "model_type", None) == MODEL_TYPE and hasattr(base, "set_alibi_scaling")


def _resolve(model) -> Tuple[str, torch.nn.Module]:
    """(family, base model) for a supported model, else ``UnsupportedModelError``."""
    base = getattr(model, "base_model", model)
    if _exported(base):
        return EXPORTED, base
    for family, cls in _families():
        if isinstance(base, cls):
            break
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}) has no ALiBi bias to scale; "
            f"supported: {SUPPORTED_MODELS}"
        )
    if family == "falcon":
        if not base.config.alibi:
            raise UnsupportedModelError(
                f"{type(model).__name__} has config.alibi=False: this Falcon uses rotary "
                f"position embeddings, not ALiBi; supported: {SUPPORTED_MODELS}"
            )
        impl = base.config._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise UnsupportedModelError(
                f"Falcon with attn_implementation={impl!r} cannot take an ALiBi bias "
                "(transformers' flash-attention path refuses alibi); load the model with "
                "attn_implementation='sdpa' or 'eager'"
            )
    return family, base


def config_family(config) -> str:
    """The family :func:`_resolve` would find, read from a model's config alone
    (before its weights are loaded), else ``UnsupportedModelError``."""
    from .configuration_alibi import MODEL_TYPE

    model_type = getattr(config, "model_type", None)
    if model_type == MODEL_TYPE:
        return EXPORTED
    if model_type in ("bloom", "mpt") or (model_type == "falcon" and getattr(config, "alibi", False)):
        return model_type
    why = ("config.alibi=False: this Falcon uses rotary position embeddings, not ALiBi" if model_type == "falcon"
           else f"model_type {model_type!r} has no ALiBi bias to scale")
    raise UnsupportedModelError(f"{why}; supported: {SUPPORTED_MODELS}")


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8) -> torch.Tensor:
    """MPT's slopes with bias maximum ``b``, as float32 ``[H]``.

    MPT defines ``2^(-b k / P)`` (``P`` the power of two >= H) interleaved for
    other head counts the same way as the paper, which makes every slope the
    paper's (``b = 8``) raised to ``b / 8``.  MPT's own model always passes
    ``b = 8``, ignoring ``attn_config.alibi_bias_max``; this honours it.
    """
    if not alibi_bias_max > 0:
        raise ValueError(f"alibi_bias_max must be > 0, got {alibi_bias_max!r}")
    paper = get_slopes(num_heads).to(torch.float64)
    return torch.exp2(paper.log2() * (float(alibi_bias_max) / 8.0)).to(torch.float32)


def base_slopes(model) -> torch.Tensor:
    """The unscaled slopes of a supported model (float32 ``[H]``), head order as the model's."""
    family, base = _resolve(model)
    config = base.config
    if family == EXPORTED:
        return get_slopes(config.attention_heads)
    if family == "bloom":
        return get_slopes(config.n_head)
    if family == "mpt":
        return mpt_slopes(config.n_heads, config.attn_config.alibi_bias_max)
    return get_slopes(config.num_attention_heads)


# ---------------------------------------------------------------------------
# Scaling state and hooks
# ---------------------------------------------------------------------------


@dataclass
class _Scaling:
    family: str
    scaling: Scaling
    bias_form: str
    slopes: torch.Tensor  # unscaled
    num_heads: int
    handles: List[Any] = field(default_factory=list)
    saved_attrs: Dict[str, Any] = field(default_factory=dict)
    current: Optional[Dict[str, Any]] = None  # per forward pass
    last_factor: Optional[float] = None  # the factor of the latest forward pass

    def settings(self) -> Dict[str, Any]:
        s = self.scaling
        return dict(method=s.method, factor=s.factor, train_length=s.train_length, bias_form=self.bias_form)


_MISSING = object()


def _call_arguments(module, args, kwargs) -> Dict[str, Any]:
    """The base model's forward arguments by name, however they were passed."""
    signature = inspect.signature(module.forward)
    return signature.bind_partial(*args, **kwargs).arguments


def _start_forward(state: _Scaling, module, args, kwargs) -> None:
    """Forward pre-hook of the base model: record lengths and slopes for this pass."""
    arguments = _call_arguments(module, args, kwargs)
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
    past = int(cache.get_seq_length()) if cache is not None else 0
    # a cache made without a config has no layers before its first update (and no maximum)
    cache_max = int(cache.get_max_length()) if cache is not None and getattr(cache, "layers", True) else -1
    mask = arguments.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"ALiBi scaling needs a 2-D [batch, keys] attention_mask (or none), got shape {tuple(mask.shape)}"
        )
    kv_len = past + q_len
    state.last_factor = state.scaling.factor_at(kv_len)
    state.current = dict(
        q_len=q_len,
        past=past,
        kv_len=kv_len,
        cache_max=cache_max,
        mask=mask,
        slopes=state.scaling.slopes(state.slopes, kv_len),
        built=None,
    )


def _end_forward(state: _Scaling, *unused) -> None:
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
    if start + q_len > kv:
        raise RuntimeError(f"{start} cached + {q_len} new tokens exceed the {kv} keys")
    return keys[:, start : start + q_len], keys


def _relative_bias(slopes: torch.Tensor, current, kv: int, batch: int, device, cap: Optional[int]) -> torch.Tensor:
    """float32 ``[B, H, q, kv]``: ``-slope * min(i - j, cap)`` from integer distances."""
    queries, keys = _positions(current, kv, device)
    distance = queries[:, :, None] - keys[:, None, :]
    if cap is not None:
        distance = distance.clamp(max=cap)
    bias = -slopes.to(device)[None, :, None, None] * distance[:, None, :, :]
    return bias.expand(batch, -1, -1, -1)


def _bloom_block_hook(state: _Scaling, block, args, kwargs):
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
        slopes = current["slopes"].to(upstream.device)
        if state.bias_form == "relative":
            bias = _relative_bias(slopes, current, kv, batch, upstream.device, state.scaling.distance_cap)
            bias = bias.reshape(batch * heads, current["q_len"], kv)
        else:  # BLOOM's own form: slope * key position, cast as a whole
            _, keys = _positions(current, kv, upstream.device)
            bias = slopes[None, :, None] * keys[:, None, :]
            bias = bias.expand(batch, -1, -1).reshape(batch * heads, 1, kv)
        current["built"] = bias.to(upstream.dtype)
    kwargs["alibi"] = current["built"]
    return args, kwargs


def _falcon_block_hook(state: _Scaling, block, args, kwargs):
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
        heads = state.num_heads
        dtype, device = upstream.dtype, upstream.device
        head_dim = block.self_attention.head_dim
        slopes = current["slopes"].to(device)
        if state.bias_form == "relative":
            bias = _relative_bias(slopes, current, kv, batch, device, state.scaling.distance_cap)
            bias = bias / math.sqrt(head_dim)
            bias = bias.to(dtype)
        else:  # Falcon's own form: bfloat16 slope * key position, then the model dtype
            _, keys = _positions(current, kv, device)
            bias = (slopes.to(torch.bfloat16)[None, :, None] * keys[:, None, :]).to(dtype)
            bias = (bias / math.sqrt(head_dim))[:, :, None, :].expand(batch, -1, current["q_len"], -1)
        # Upstream's mask is its (non-negative) bias where attended, dtype-min elsewhere.
        hidden = upstream < -1
        mask = bias.masked_fill(hidden, torch.finfo(dtype).min)
        zeros = torch.zeros(batch, heads, 1, kv, dtype=kwargs["alibi"].dtype, device=device)
        current["built"] = (mask, zeros)
    kwargs["attention_mask"], kwargs["alibi"] = current["built"]
    return args, kwargs


def _mpt_alibi_builder(state: _Scaling):
    """Instance replacement of ``MptModel.build_mpt_alibi_tensor``.

    MPT's form, ``-slope * (distance to the last key)`` in float32, shape
    ``[H, 1, L]``; the attention keeps its last ``kv`` columns.  ``L`` covers
    the keys of this pass, so inputs longer than ``max_seq_len`` work.  A
    distance cap is no per-row shift of a key-only bias, so with ``cap`` the
    whole ``[H, q, kv]`` relative bias of the pass is built (MPT keeps its last
    ``q`` rows and ``kv`` columns; ``kv`` counts a static cache's empty slots,
    which MPT masks).
    """

    def build_mpt_alibi_tensor(num_heads, sequence_length, alibi_bias_max=8, device=None):
        current, cap = state.current, state.scaling.distance_cap
        if current is None:  # called outside a forward pass: the static or unscaled slopes
            slopes, length = state.scaling.slopes(state.slopes, sequence_length), sequence_length
        else:
            slopes = current["slopes"]
            length = max(sequence_length, current["kv_len"], current["cache_max"])
        if cap is not None and current is not None:
            queries = torch.arange(current["past"], current["kv_len"], device=device)
            keys = torch.arange(max(current["kv_len"], current["cache_max"]), device=device)
            distance = (queries[:, None] - keys[None, :]).clamp(max=cap)
            return -slopes.to(device)[:, None, None] * distance[None]
        distance = torch.arange(length - 1, -1, -1, device=device)
        if cap is not None:
            distance = distance.clamp(max=cap)
        return -slopes.to(device)[:, None, None] * distance[None, None, :]

    return build_mpt_alibi_tensor


def _scaling_of(model, method, factor, train_length, bias_form: str) -> Scaling:
    """The complete scaling spec of the arguments (``ValueError`` naming the bad one)."""
    if bias_form not in BIAS_FORMS:
        raise ValueError(f"bias_form={bias_form!r} is not valid; allowed: {', '.join(BIAS_FORMS)}")
    if isinstance(method, Scaling):
        if factor != 0.0 or train_length is not None:
            raise ValueError("give a Scaling alone, or method, factor and train_length, not both")
        scaling = method
    else:
        recorded = hf_train_length(getattr(model, "config", None)) if train_length is None else train_length
        scaling = Scaling(method, factor, recorded)
    if scaling.needs_train_length and scaling.train_length is None:
        what = "dynamic scaling (factor=0)" if scaling.dynamic else "cap"
        raise ValueError(
            f"train_length=None is not valid; {what} needs the length the model was trained at, "
            "which this model's config does not record: pass train_length=L"
        )
    if bias_form == "upstream" and scaling.method == "cap":
        raise ValueError("bias_form='upstream' builds a bias of key positions only, which cannot cap distances; "
                         "use the default bias_form='relative' with cap")
    return scaling


def apply_alibi_scaling(
    model,
    method="none",
    factor: float = 0.0,
    train_length: Optional[int] = None,
    bias_form: str = "relative",
):
    """Extend the context of a BLOOM, MPT or Falcon (alibi=True) model in place.

    ``method``, ``factor`` and ``train_length`` are ``fairseq_alibi.alibi.Scaling``'s
    (or pass a ``Scaling`` as ``method``): ``none``; ``linear`` or ``ntk`` with a
    static ``factor >= 1`` or ``factor=0`` for dynamic scaling, ``max(1,
    kv_length / train_length)`` per forward pass (``kv_length`` the cached plus
    new tokens: a KV cache built under earlier slopes then differs from
    recomputation; static factors keep incremental decoding exact); ``cap``
    (every distance above ``factor x train_length`` counted as that distance,
    ``factor=0`` meaning 1).  ``train_length`` defaults to what the model's
    config records (``hf_train_length``).  ``bias_form``: ``relative``
    (default, ``-slope * (i - j)`` formed in float32) or ``upstream`` (the
    model's own form, with the scaled slopes; not with ``cap``).

    Applying again replaces the previous scaling.  Returns ``model``.  The hooks
    belong to this instance: copy a model before scaling it, not after.
    """
    family, base = _resolve(model)
    scaling = _scaling_of(model, method, factor, train_length, bias_form)
    if getattr(base, _STATE_ATTR, None) is not None:
        remove_alibi_scaling(model)
    slopes = base_slopes(model)
    state = _Scaling(family=family, scaling=scaling, bias_form=bias_form, slopes=slopes, num_heads=slopes.numel())
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


def _scale_exported(state: _Scaling, base) -> None:
    """An exported model rescales its own bias; its loaded ``alibi_scaling`` is kept to restore."""
    from .configuration_alibi import scaling_to_hf

    scaling, recorded = state.scaling, base.config.alibi_train_length
    if state.bias_form != "relative":
        raise ValueError(f"bias_form={state.bias_form!r} applies to BLOOM and Falcon; an exported model always "
                         "forms -slope * (i - j) (bias_form='relative')")
    if scaling.method == "cap" and scaling.train_length != recorded:
        raise ValueError(f"train_length={scaling.train_length} is not valid for cap on an exported model: it caps "
                         f"at factor x its alibi_train_length ({recorded})")
    state.saved_attrs["alibi_scaling"] = base.config.alibi_scaling
    base.set_alibi_scaling(scaling_to_hf(scaling))
    setattr(base, _STATE_ATTR, state)


def remove_alibi_scaling(model):
    """Undo ``apply_alibi_scaling``: hooks removed, instance attributes restored.  Returns ``model``."""
    _, base = _resolve(model)
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
    _, base = _resolve(model)
    state = getattr(base, _STATE_ATTR, None)
    if state is None:
        return None
    return dict(state.settings(), last_factor=state.last_factor)


@contextlib.contextmanager
def alibi_scaling(model, method="none", factor: float = 0.0, train_length: Optional[int] = None,
                  bias_form: str = "relative"):
    """``with alibi_scaling(model, "ntk", 2.0): ...`` -- scaled inside, as before outside."""
    _, base = _resolve(model)
    previous = getattr(base, _STATE_ATTR, None)
    previous = previous.settings() if previous is not None else None
    apply_alibi_scaling(model, method, factor, train_length, bias_form)
    try:
        yield model
    finally:
        remove_alibi_scaling(model)
        if previous is not None:
            apply_alibi_scaling(model, **previous)


# ---------------------------------------------------------------------------
# Adapter for the evaluation tools
# ---------------------------------------------------------------------------


def hf_train_length(config) -> Optional[int]:
    """The length a model was trained at, where its config records it, else None.

    MPT: ``max_seq_len``; BLOOM: ``seq_length`` when the config has it (the
    BigScience configs do not always; ``alibi-export-hf --format bloom`` writes
    it); exported models: ``alibi_train_length``.  Other configs record none.
    """
    from .configuration_alibi import MODEL_TYPE

    model_type = getattr(config, "model_type", None)
    name = {"mpt": "max_seq_len", "bloom": "seq_length", MODEL_TYPE: "alibi_train_length"}.get(model_type)
    value = getattr(config, name, None) if name else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def quiet_transformers(quiet: bool = True):
    """transformers' and huggingface_hub's progress bars off inside (restored after)."""
    if not quiet:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    was_on, hub_was_off = transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers_logging.enable_progress_bar()
        if not hub_was_off:
            enable_progress_bars()


def _looks_local(name: str) -> bool:
    """A name meant as a path, not a hub name (``owner/name``)."""
    head = name.split("/", 1)[0]
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.exists(name)
            or ("/" in name and os.path.isdir(head)))


def _refuse_custom_code(name: str, why: str) -> HFLoadError:
    return HFLoadError(
        f"{name} is a model with its own code ({why}); fairseq-alibi runs no code from model directories "
        f"and never sets trust_remote_code: supported are {SUPPORTED_MODELS}"
    )


def _exported_classes():
    """This package's classes for exported models, registered with the Auto classes
    (so transformers uses them, not the directory's copies, without trust_remote_code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .configuration_alibi import MODEL_TYPE, AlibiLMConfig
    from .modeling_alibi import AlibiForCausalLM

    AutoConfig.register(MODEL_TYPE, AlibiLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(AlibiLMConfig, AlibiForCausalLM, exist_ok=True)
    return AlibiForCausalLM


def _model_class(directory: str):
    """The class to load a local directory with: this package's for an exported
    model, transformers' own otherwise; any other model with code of its own is refused."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from .configuration_alibi import MODEL_TYPE

    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return AutoModelForCausalLM  # transformers' error names the missing config.json
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise HFLoadError(f"cannot load Hugging Face model {directory!r}: {path} is not readable JSON "
                          f"({' '.join(str(exc).split())})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type == MODEL_TYPE:
        return _exported_classes()
    if isinstance(config, dict) and "auto_map" in config:
        raise _refuse_custom_code(directory, "config.json has an auto_map")
    if model_type not in CONFIG_MAPPING:
        raise _refuse_custom_code(directory, f"config.json's model_type {model_type!r} is unknown to transformers")
    return AutoModelForCausalLM


def load_hf_model(name_or_dir: str, device: str = "cpu", dtype=None, progress: bool = True):
    """(model, tokenizer) of a causal LM from a local directory or a hub name, in eval mode.

    A local directory is read with ``local_files_only`` (no network); one
    written by ``alibi-export-hf`` is loaded with this package's
    ``AlibiForCausalLM`` (its code files are never run); any other model with
    code of its own is refused.  A hub name needs the network or the Hugging
    Face cache.  ``progress=False`` silences transformers' progress bars.
    Failures raise ``HFLoadError`` with one line saying what was wrong and what to do.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise HFLoadError(f"unknown dtype {dtype!r}; allowed: {', '.join(_DTYPES)} or a torch.dtype")
        dtype = _DTYPES[dtype]
    tokenizer, model = _load(name_or_dir, progress, lambda cls, name, options: cls.from_pretrained(
        name, dtype=dtype, trust_remote_code=False, **options))
    model.to(device)
    model.eval()
    return model, tokenizer


def load_hf_config(name_or_dir: str, progress: bool = True):
    """(config, tokenizer) of what :func:`load_hf_model` would load, without its
    weights: enough to plan an evaluation of many models before loading one."""
    from transformers import AutoConfig

    tokenizer, config = _load(name_or_dir, progress, lambda cls, name, options: AutoConfig.from_pretrained(
        name, trust_remote_code=False, **options))
    return config, tokenizer


def _load(name_or_dir: str, progress: bool, read):
    """(tokenizer, ``read(model class, name, options)``), every failure one ``HFLoadError`` line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name_or_dir = os.path.expanduser(str(name_or_dir))
    local = os.path.isdir(name_or_dir)
    what = None
    if local and not os.path.isfile(os.path.join(name_or_dir, "config.json")):  # else the tokenizer's error speaks
        what = f"cannot load Hugging Face model {name_or_dir!r}: the directory holds no config.json"
    elif not local and _looks_local(name_or_dir):
        what = f"{name_or_dir} " + ("is not a model directory" if os.path.exists(name_or_dir) else "not found")
    if what:
        raise HFLoadError(
            f"{what}; give a directory written by save_pretrained or alibi-export-hf "
            "(config.json, weights, tokenizer files) or a hub name such as bigscience/bloom-560m"
        )
    model_class = _model_class(name_or_dir) if local else AutoModelForCausalLM
    options = dict(local_files_only=True) if local else {}
    try:
        with quiet_transformers(not progress):
            tokenizer = AutoTokenizer.from_pretrained(name_or_dir, trust_remote_code=False, **options)
            return tokenizer, read(model_class, name_or_dir, options)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())
        if "trust_remote_code" in reason:
            raise _refuse_custom_code(name_or_dir, "transformers asks for trust_remote_code") from None
        if len(reason) > 300:
            reason = reason[:297] + "..."
        if not local:
            raise HFLoadError(
                f"{name_or_dir!r} not found: no such local directory, and as a hub name: {reason} (a hub name "
                "needs the network or a copy in the Hugging Face cache; otherwise download it elsewhere and "
                "pass its directory)") from None
        raise HFLoadError(f"cannot load Hugging Face model {name_or_dir!r}: {reason} (check that the directory "
                          "holds config.json, the weights and the tokenizer files)") from None


def token_log_probs(model, input_ids: torch.Tensor, chunk: int = 1024, next_token: Optional[int] = None) -> torch.Tensor:
    """float32 ``[T-1]``: log-probability of each next token, teacher-forced, one forward.

    ``input_ids`` is ``[T]`` or ``[1, T]``.  With ``next_token`` (the token
    after the input) the result is ``[T]``: the last position's prediction is
    scored too, so a window of T tokens scores T of them over T keys (what a
    fairseq LM window does).  For BLOOM, MPT and Falcon the
    vocabulary projection runs ``chunk`` positions at a time, so long inputs do
    not materialize ``T x vocab`` logits in float32 at once.
    """
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"token_log_probs takes one sequence, got a batch of {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() < (1 if next_token is not None else 2):
        raise ValueError(f"token_log_probs needs a [T] sequence of at least 2 tokens, got {tuple(input_ids.shape)}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no language-model head; load it with AutoModelForCausalLM")
    device = next(model.parameters()).device
    tokens = input_ids.to(device)[None, :]
    targets = tokens[0, 1:]
    keep = tokens.shape[1] - 1  # positions whose prediction is scored
    if next_token is not None:
        targets = torch.cat([targets, torch.tensor([next_token], device=device)])
        keep += 1
    try:
        family, base = _resolve(model)
    except UnsupportedModelError:
        family = None
    with torch.inference_mode():
        if family is None:  # any other causal LM: its own logits
            logits = model(input_ids=tokens, use_cache=False).logits[0, :keep].float()
            return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].cpu()
        hidden = base(input_ids=tokens, use_cache=False).last_hidden_state[0, :keep]
        pieces = []
        for start in range(0, hidden.shape[0], chunk):
            logits = head(hidden[start : start + chunk]).float()
            pieces.append(logits.log_softmax(-1).gather(-1, targets[start : start + chunk, None])[:, 0])
        return torch.cat(pieces).cpu()
