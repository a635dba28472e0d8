"""The fairseq side of an export: a checkpoint read safely, its model built
exactly as fairseq builds it, and the dictionary its ids come from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..core.positions import SINUSOIDAL, exported_methods
from ..core.scaling import Scaling
from ..errors import ExportError, checkpoint_files, one_line
from .. import facts

#: fairseq-preprocess pads dictionaries to a multiple of this (``--padding-factor``).
PADDING_FACTOR = 8


@dataclass
class Source:
    """A fairseq ALiBi LM ready to export."""

    path: str
    model: Any  # fairseq's TransformerLanguageModel, eval mode, float32
    cfg: Any  # the checkpoint's config (OmegaConf)
    dictionary: Any  # fairseq.data.Dictionary
    train_length: Optional[int]
    scaling: Scaling  # what the checkpoint's config asks for
    unk_aliases: int = 0  # tokenizer ids after the dictionary's, read as <unk> (export/tokenizer.py)
    add_bos_token: bool = False  # the task's --add-bos-token
    weights_dtype: str = "float32"  # what the checkpoint's weights hold (the model is built in float32)
    position: str = "alibi"  # core.positions name, or SINUSOIDAL (fairseq's stock transformer_lm)

    @property
    def start(self) -> int:
        """The id fairseq's inference puts before a prompt (``build_dataset_for_inference``,
        ``inference_step``): ``<s>`` for a model trained with ``--add-bos-token``, else ``</s>``."""
        return self.dictionary.bos() if self.add_bos_token else self.dictionary.eos()


def read_checkpoint(path: str) -> Dict[str, Any]:
    """The checkpoint dict of ``path`` as fairseq's loader gives it (config as
    OmegaConf, old layouts upgraded), read with allowlisted unpickling; an
    unconverted 2021-fork checkpoint is refused with the conversion command.
    Unlike fairseq's loader it accepts a bare ``{"cfg", "model"}`` file."""
    from .. import models  # noqa: F401  (first: fairseq through the plugin's patches, 1-3 s a start)
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    from .. import safe_load
    from ..fork import refuse_fork

    if not os.path.isfile(path):
        raise ExportError(checkpoint_files(path) if os.path.isdir(path) else f"checkpoint file not found: {path}")
    state = safe_load.load(path)
    safe_load.check_checkpoint(path, state)
    refuse_fork(path, state)
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
    if not state.get("optimizer_history"):  # training bookkeeping an export does not need
        state["optimizer_history"] = [{"criterion_name": "?", "optimizer_name": "?", "lr_scheduler_state": {},
                                       "num_updates": 0}]
    if not isinstance(state.get("extra_state"), dict):
        state["extra_state"] = {}
    try:
        return checkpoint_utils._upgrade_state_dict(state)  # what load_checkpoint_to_cpu does after reading
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{path} is not a usable fairseq checkpoint ({type(exc).__name__}: {one_line(exc)})") from None


def import_user_dir(path: str, state: Dict[str, Any]) -> None:
    """Import the package the checkpoint was trained with (its config's ``common.user_dir``)
    as fairseq's CLIs import ``--user-dir`` (``utils.import_user_module``), so a position
    method it registers (``positions.register``) is known here; this plugin's own directory,
    wherever it was trained, is the one loaded already.  One that is not here is refused."""
    cfg = state.get("cfg")
    common = cfg.get("common") if cfg is not None else None
    user_dir = common.get("user_dir") if common is not None else None
    if not user_dir or os.path.basename(os.path.normpath(str(user_dir))) == __name__.split(".")[0]:
        return
    import argparse

    from fairseq import utils

    try:
        utils.import_user_module(argparse.Namespace(user_dir=str(user_dir)))
    except FileNotFoundError:
        raise ExportError(f"{path} was trained with --user-dir {user_dir} (its config's common.user_dir), which is "
                          "not here: its model's code is there; put that package at that path and export again"
                          ) from None
    except ImportError as exc:
        raise ExportError(f"cannot import {path}'s user dir {user_dir} (its config's common.user_dir): "
                          f"{one_line(exc)}") from None


def check_language_model(path: str, state: Dict[str, Any]) -> str:
    """The position method of a causal LM this tool exports (``sinusoidal`` for
    fairseq's stock ``transformer_lm``); anything else refused, saying what it is."""
    model_cfg, task_cfg = facts.checkpoint_sections(state)
    arch = facts.checkpoint_arch(model_cfg)
    family = facts.model_family(arch)
    task = task_cfg.get("_name")
    if family in facts.language_models() and task in (None, "language_modeling"):
        position = facts.position_of(family) or SINUSOIDAL
        if position not in exported_methods():
            raise ExportError(f"{path} is a {position} language model ({family}); alibi-export-hf does not export "
                              f"{position} models yet (the exported model computes {', '.join(exported_methods())}): "
                              "evaluate it in fairseq (alibi-eval-lm, alibi-sweep)")
        return position
    raise not_exportable(path, arch, family, task)


def not_exportable(path: str, arch: Optional[str], family: Optional[str], task: Optional[str]) -> ExportError:
    """The one message for a checkpoint ``alibi-export-hf`` does not export: what
    it is and what exports (every causal language model of this plugin and
    fairseq's stock ``transformer_lm``)."""
    what = f"a checkpoint of arch {arch!r}" + (f" (model {family})" if family else "") + f", task {task!r}"
    return ExportError(f"{path} is {what}; alibi-export-hf exports the causal language models "
                       f"{', '.join(facts.language_models())} (task language_modeling)")


def dictionary_path(path: str, task_cfg: Dict[str, Any], given: Optional[str]) -> str:
    """``--dict`` or the training data directory's ``dict.txt``; one line if missing."""
    if given:
        if not os.path.isfile(given):
            from ..inputs import check_text

            check_text(given, "dictionary (the dict.txt the model was trained with)", flag="--dict")
        return given
    data = task_cfg.get("data")
    first = str(data).split(os.pathsep)[0] if data else None
    candidate = os.path.join(first, "dict.txt") if first else None
    if candidate and os.path.isfile(candidate):
        return candidate
    where = f"its training data directory's {candidate}" if candidate else "its config names no data directory"
    raise ExportError(f"no dictionary for {path}: {where} is not here; give the dict.txt the model was trained "
                      "with: --dict PATH")


def vocabulary_rows(weights: Dict[str, Any]) -> Optional[int]:
    """How many token ids the checkpoint's embedding has (plain or adaptive)."""
    if "decoder.embed_tokens.weight" in weights:
        return int(weights["decoder.embed_tokens.weight"].shape[0])
    bands = [w for name, w in weights.items()
             if name.startswith("decoder.embed_tokens.embeddings.") and name.endswith(".0.weight")]
    return sum(int(w.shape[0]) for w in bands) or None


def load_dictionary(path: str, rows: Optional[int]):
    """fairseq's ``Dictionary`` of ``path``, padded with fairseq-preprocess's
    ``madeupword`` symbols when that is what makes it fit ``rows``."""
    from fairseq.data import Dictionary

    try:
        dictionary = Dictionary.load(path)
    except (ValueError, RuntimeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is not a fairseq dictionary: {one_line(exc)}") from None
    if rows is not None and len(dictionary) < rows <= len(dictionary) + PADDING_FACTOR - 1:
        dictionary.pad_to_multiple_(PADDING_FACTOR)
    if rows is not None and len(dictionary) != rows:
        raise ExportError(f"the dictionary {path} has {len(dictionary)} symbols but the checkpoint's embedding "
                          f"has {rows} rows: give the dict.txt the model was trained with (--dict)")
    return dictionary


def checkpoint_dtype(weights: Dict[str, Any]) -> str:
    """The floating dtype(s) of a checkpoint's weights: ``float16`` for a model
    saved by ``--fp16`` training, ``float32`` usually."""
    import torch

    found = {str(t.dtype).replace("torch.", "") for t in weights.values()
             if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return "/".join(sorted(found)) or "float32"


def load_source(path: str, dict_path: Optional[str] = None) -> Source:
    """Read, check and build the fairseq model of ``path`` (float32, eval mode)."""
    from ..models.config import scaling_from_config  # first: fairseq through the plugin's patches
    from fairseq.tasks.language_modeling import LanguageModelingTask

    state = read_checkpoint(path)
    import_user_dir(path, state)
    position = check_language_model(path, state)
    model_cfg, task_cfg = facts.checkpoint_sections(state)
    dictionary = load_dictionary(dictionary_path(path, task_cfg, dict_path), vocabulary_rows(state["model"]))
    cfg = state["cfg"]
    try:
        model = LanguageModelingTask(cfg.task, dictionary).build_model(cfg.model)
        model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    except (RuntimeError, ValueError, KeyError, AttributeError, AssertionError) as exc:
        detail = one_line(exc)
        raise ExportError(f"cannot build the model of {path} from its config: {detail[:300]}") from None
    model.float().eval()
    return Source(path, model, cfg, dictionary, facts.checkpoint_train_length(model_cfg, task_cfg),
                  scaling_from_config(cfg.model), add_bos_token=bool(task_cfg.get("add_bos_token") or False),
                  weights_dtype=checkpoint_dtype(state["model"]), position=position)
