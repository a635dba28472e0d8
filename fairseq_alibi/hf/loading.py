"""Loading Hugging Face causal LMs safely: local directories, hub names, exported models.

A directory written by ``alibi-export-hf`` is loaded with this package's
``modeling_alibi`` classes, never with the code files it carries; any other
model with code of its own is refused (``trust_remote_code`` is never set).
Every failure is one ``HFLoadError`` line saying what was wrong and what to do.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
from typing import List, Optional, Tuple

import torch

from ..core.configuration_alibi import MODEL_TYPE
from ..errors import HFLoadError
from ..inputs import check_text
from .families import SUPPORTED_MODELS

#: safetensors' names of the floating dtypes.
_SAVED_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: The modules an exported model carries (``export/writer.py``), as this package has them.
_CORE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")
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

    from ..core.configuration_alibi import AlibiLMConfig
    from ..core.modeling_alibi import AlibiForCausalLM

    AutoConfig.register(MODEL_TYPE, AlibiLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(AlibiLMConfig, AlibiForCausalLM, exist_ok=True)
    return AlibiForCausalLM


def _model_class(directory: str):
    """The class to load a local directory with: this package's for an exported
    model, transformers' own otherwise; any other model with code of its own is refused."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return AutoModelForCausalLM  # transformers' error names the missing config.json
    check_text(path, "model config")
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


def _fairseq_checkpoints(path: str) -> List[str]:
    """``[path]`` for a ``.pt`` file, the ``.pt`` files of a directory (at most
    three), else ``[]``: a fairseq checkpoint where a Hugging Face model was asked for."""
    if os.path.isdir(path):
        return [os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".pt")][:3]
    return [path] if path.endswith(".pt") and os.path.isfile(path) else []


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
    checkpoints = _fairseq_checkpoints(name_or_dir) if what else []
    if checkpoints:
        held = (f"{name_or_dir} is a fairseq checkpoint" if checkpoints == [name_or_dir] else
                f"{name_or_dir} holds fairseq checkpoints ({', '.join(os.path.basename(c) for c in checkpoints)})")
        raise HFLoadError(
            f"{held}, not a Hugging Face model: export one (alibi-export-hf {checkpoints[0]} OUTPUT_DIR) and "
            "load that directory, or load it with fairseq after `import fairseq_alibi.models`, which registers "
            "the models (docs/training.md, Python)"
        )
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


def saved_dtypes(directory: str) -> List[str]:
    """The floating dtypes a local model's safetensors files hold, read from
    their headers (no weight loaded); ``[]`` for a hub name or other formats."""
    from safetensors import safe_open

    if not os.path.isdir(directory):
        return []
    found = set()
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as weights:
                found |= {weights.get_slice(key).get_dtype() for key in weights.keys()}
    return sorted(_SAVED_DTYPES[kind] for kind in found if kind in _SAVED_DTYPES)


def code_differences(directory: str) -> List[str]:
    """The code files of an exported ``directory`` that are not this package's
    modules of the same name byte for byte (changed, or unknown here)."""
    return sorted(name for name in os.listdir(directory) if name.endswith(".py") and not (
        os.path.isfile(os.path.join(_CORE_DIR, name))
        and filecmp.cmp(os.path.join(directory, name), os.path.join(_CORE_DIR, name), shallow=False)))


def loaded_notes(name_or_dir: str, model) -> Tuple[str, Optional[str]]:
    """(what a loaded model computes in, against what its files hold; a warning
    when an exported model's own code is not what :func:`load_hf_model` ran)."""
    computed = str(model.dtype).replace("torch.", "")
    saved = saved_dtypes(name_or_dir)
    note = (f"{'/'.join(saved)} weights as saved, computed in {computed}" if saved else f"computed in {computed}")
    if not os.path.isdir(name_or_dir) or getattr(model.config, "model_type", None) != MODEL_TYPE:
        return note, None
    differ = code_differences(name_or_dir)
    if not differ:
        return note + "; its code files are this package's", None
    return note, (f"its code files differ from this package's ({', '.join(differ)}): the numbers are this "
                  "package's AlibiForCausalLM on its weights, not what its own code computes; re-export it with "
                  "this version, or score it with transformers (trust_remote_code=True)")
