"""Facts about the plugin's models, each stated once: names, the stock
architectures that have twins, the unbounded input length, the training
length, and where a checkpoint keeps its model and task configuration.

No fairseq import at module level (the registries are read when asked), so
``fork.py`` and the evaluation tools can use it before the models load.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Tuple

from .core.positions import POSITIONS

#: The registered model of the causal ALiBi LM, and fairseq's stock (sinusoidal) LM.
ALIBI_LM = "transformer_lm_alibi"
STOCK_LM = "transformer_lm"


def position_model(position: str) -> str:
    """The registered LM of a ``core.positions`` method: ``transformer_lm_<name>``."""
    return f"{STOCK_LM}_{position}"


def language_models() -> Tuple[str, ...]:
    """Every causal LM the tools evaluate: the stock one and one per position method registered."""
    return (STOCK_LM,) + tuple(position_model(name) for name in POSITIONS)


def position_of(model: Optional[str]) -> Optional[str]:
    """The position method of a registered LM (``alibi``, ``rotary``, ...), or
    None for fairseq's stock sinusoidal LM and anything else."""
    for name in POSITIONS:
        if model == position_model(name):
            return name
    return None

#: ``max_positions`` of every ALiBi model: no position table, so no cap on the
#: input length (fairseq takes the minimum over task and model).
UNBOUNDED_POSITIONS = 1 << 30


def twin_name(stock_arch: str) -> str:
    """The ALiBi twin of a stock ``transformer_lm*`` or ``transformer*`` arch:
    ``transformer_lm`` -> ``transformer_lm_alibi``, ``X`` -> ``X_alibi``."""
    return f"{stock_arch}_alibi"


def stock_archs(model: str) -> List[str]:
    """Every architecture fairseq registers for the stock model ``model``
    (``transformer_lm``: the ones whose twins ``transformer_lm_alibi`` registers)."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return sorted(name for name, family in ARCH_MODEL_NAME_REGISTRY.items() if family == model)


def model_family(arch: Optional[str]) -> Optional[str]:
    """The registered model an architecture belongs to, or None."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return ARCH_MODEL_NAME_REGISTRY.get(arch) if arch else None


def _unresolved(value) -> bool:
    return value is None or value == "" or (isinstance(value, str) and value.startswith("${"))


def resolve_train_length(args, task=None) -> None:
    """Set ``args.alibi_train_length`` where it is unset (or still the
    dataclass default's unresolved ``${task.tokens_per_sample}``) to the
    ``tokens_per_sample`` the model is being built with (its config's, else the
    task's).  A value the user gave is kept as it is: the scaling spec checks it."""
    if not _unresolved(getattr(args, "alibi_train_length", None)):
        return
    value = getattr(args, "tokens_per_sample", None)
    if _unresolved(value) and task is not None:
        value = getattr(task.cfg, "tokens_per_sample", None)
    args.alibi_train_length = None if _unresolved(value) else value


# ----------------------------------------------------------- checkpoint configs


def plain(obj: Any) -> Any:
    """A config (OmegaConf, dict, list or argparse Namespace) as plain Python
    data, interpolations left as their ``${...}`` strings."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(obj):
        return OmegaConf.to_container(obj, resolve=False)
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    if isinstance(obj, dict):
        return {key: plain(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [plain(value) for value in obj]
    return obj


def _section(obj) -> Dict[str, Any]:
    section = plain(obj)
    return section if isinstance(section, dict) else {}


def checkpoint_sections(state: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(model config, task config) of a checkpoint dict as plain dicts, from its
    ``cfg`` (fairseq >= 0.10) or its ``args`` (older files); ``({}, {})`` when
    it has neither."""
    if not isinstance(state, dict):
        return {}, {}
    cfg = state.get("cfg")
    if cfg is not None:
        get = cfg.get if hasattr(cfg, "get") else (lambda key: None)
        return _section(get("model")), _section(get("task"))
    args = _section(state.get("args"))
    return args, args


def checkpoint_arch(model_cfg: Dict[str, Any]) -> Optional[str]:
    """The architecture a model config names (``_name`` or, pre-hydra, ``arch``)."""
    return model_cfg.get("_name") or model_cfg.get("arch")


def checkpoint_train_length(model_cfg: Dict[str, Any], task_cfg: Dict[str, Any]) -> Optional[int]:
    """The training length a checkpoint records: ``alibi_train_length``, else
    the task's, else the model's ``tokens_per_sample``; None if none is a positive int."""
    for section, key in ((model_cfg, "alibi_train_length"), (task_cfg, "tokens_per_sample"),
                         (model_cfg, "tokens_per_sample")):
        value = section.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


#: BLOOM's layer shape (``transformer_lm_bloom_alibi`` trains it, ``alibi-export-hf
#: --format bloom`` holds it): the fairseq activations equal to BLOOM's tanh GELU.
BLOOM_ACTIVATIONS = ("gelu_accurate", "gelu_fast")


def bloom_shape_problems(fields: dict) -> List[str]:
    """What BLOOM's layer shape cannot hold of a decoder described field by field
    (``export.custom.describe``'s names, ``AlibiLMConfig``'s): pre-norm layers,
    embedding and final layer norms, tanh GELU, FFN = 4 x d, no embedding scale,
    projections, adaptive input/softmax or NormFormer scales."""
    found = []
    if not fields["normalize_before"]:
        found.append("post-norm layers")
    if not fields["layernorm_embedding"]:
        found.append("no embedding layer norm")
    if not fields["final_layer_norm"]:
        found.append("no final layer norm")
    if fields["activation_function"] not in BLOOM_ACTIVATIONS:
        found.append(f"activation {fields['activation_function']} (BLOOM: gelu_accurate)")
    if fields["ffn_dim"] != 4 * fields["hidden_size"]:
        found.append(f"FFN {fields['ffn_dim'] / fields['hidden_size']:.3g}x d (BLOOM: 4x d)")
    if fields["embed_scale"] != 1.0:
        found.append("a scaled embedding (BLOOM: --no-scale-embedding)")
    return found + extras_no_stock_model_holds(fields)


def extras_no_stock_model_holds(fields: dict) -> List[str]:
    """The parts of a decoder (described as for ``bloom_shape_problems``) that no stock
    transformers architecture exported to holds: input/output projections, adaptive
    input or softmax, NormFormer scales, SSMax's learned logit scales, tokenizer pieces
    the dictionary lacks."""
    found = []
    if fields["project_in"] or fields["project_out"] or fields["embed_quant_noise"]:
        found.append("input/output projections")
    if fields["adaptive_input"]:
        found.append("adaptive input")
    if fields["adaptive_softmax"]:
        found.append("adaptive softmax")
    if any(fields[k] for k in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")):
        found.append("NormFormer scales")
    if fields["ssmax"]:
        found.append("SSMax (learned logit scales per head)")
    if fields["unk_aliases"]:
        found.append(f"{fields['unk_aliases']} tokenizer pieces the dictionary lacks (read as <unk>)")
    return found
