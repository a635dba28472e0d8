"""The 2021 ALiBi fork's checkpoints: recognise them, convert them.

The reference fork (ofirpress/attention_with_linear_biases, fairseq 1.0.0a0)
saved its models as the *stock* ``transformer_lm`` family: arch
``transformer_lm_wiki103``, sinusoidal positions switched on in the config and
a ``decoder.embed_positions._float_tensor`` buffer in the weights, although its
patched decoder never added positions and applied ALiBi instead.  Loaded by an
unpatched fairseq, such a file silently runs as a sinusoidal model and gives
wrong numbers.  ``alibi-convert-checkpoint IN OUT`` rewrites it as this
plugin's ``transformer_lm_alibi`` (same weights; ``+m*j`` and ``-m*(i-j)`` give
the same softmax).  fairseq's own loader refuses an unconverted file
(``patches.checkpoints.fork_checkpoints_refused`` hooks :func:`refuse_fork` into it).

How a fork checkpoint is recognised (:func:`fork_signature`): its model config
names a stock ``transformer_lm`` architecture *and* has a ``max_tokens`` field.
That field exists only in the fork's ``TransformerLanguageModelConfig`` (its
bias was sized from it); no fairseq release has it, so a genuine stock
sinusoidal checkpoint is never mistaken for a fork one.  The position buffer is
not used as evidence: upstream fairseq <= 0.12.2 saves that buffer for every
sinusoidal model too.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from typing import Any, Dict, Optional

import torch

from . import safe_load
from .errors import CheckpointError, ForkCheckpointError, no_space, one_line, report_errors
from . import facts

FORK_ONLY_MODEL_FIELDS = ("max_tokens",)
_INTERPOLATION = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


def model_name(state: Dict[str, Any]) -> Optional[str]:
    """The architecture a checkpoint was saved with (``cfg.model._name`` or ``args.arch``)."""
    return facts.checkpoint_arch(facts.checkpoint_sections(state)[0])


def alibi_twin(arch: str) -> str:
    """The ALiBi twin of a stock ``transformer_lm*`` arch (``models/transformer_lm.py``
    registers one for every arch fairseq registers for ``transformer_lm``)."""
    if arch not in facts.stock_archs(facts.STOCK_LM):
        raise CheckpointError(f"architecture {arch!r} has no ALiBi twin in this plugin")
    return facts.twin_name(arch)


def fork_signature(state: Dict[str, Any]) -> Optional[str]:
    """Why ``state`` is an unconverted fork checkpoint, or None if it is not one."""
    if not isinstance(state, dict) or state.get("cfg") is None:
        return None  # the fork always saved a cfg (and ``args: None``)
    section, _ = facts.checkpoint_sections(state)
    arch = facts.checkpoint_arch(section)
    fork_fields = [name for name in FORK_ONLY_MODEL_FIELDS if name in section]
    if arch in facts.stock_archs(facts.STOCK_LM) and fork_fields:
        return (
            f"stock architecture {arch!r} with the fork-only model field "
            f"{', '.join(fork_fields)!s}"
        )
    return None


# --------------------------------------------------------------- conversion


def _lookup(tree: Dict[str, Any], dotted: str):
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _resolve(tree: Dict[str, Any], value: Any, seen=()) -> Any:
    """Follow ``${a.b}`` references through the plain config tree."""
    match = _INTERPOLATION.match(value) if isinstance(value, str) else None
    if not match:
        return value
    target = match.group(1)
    if target in seen:
        raise KeyError(target)
    return _resolve(tree, _lookup(tree, target), seen + (target,))


def _resolve_all(tree: Dict[str, Any], node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            try:
                out[key] = _resolve_all(tree, _resolve(tree, value))
            except KeyError:
                out[key] = value  # left for fairseq; only fork-only fields are known to dangle
        return out
    if isinstance(node, list):
        return [_resolve_all(tree, item) for item in node]
    return node


def convert_fork_state(state: Dict[str, Any], train_length: Optional[int] = None) -> Dict[str, Any]:
    """This plugin's checkpoint dict for a fork checkpoint dict (input untouched)."""
    if train_length is not None and (isinstance(train_length, bool) or not isinstance(train_length, int)
                                     or train_length < 1):
        raise CheckpointError(f"--train-length {train_length!r} is not valid: the training length is a positive "
                              "integer (the tokens per sample the fork was trained with)")
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError("not a fairseq checkpoint: it has no 'model' weights")
    reason = fork_signature(state)
    if reason is None:
        arch = model_name(state)
        family = facts.model_family(arch)
        if family == facts.ALIBI_LM:
            raise CheckpointError(f"already a {facts.ALIBI_LM} checkpoint (arch {arch}); nothing to convert")
        if arch in facts.stock_archs(facts.STOCK_LM):
            raise CheckpointError(
                f"a stock fairseq {arch} checkpoint, not one of the ALiBi fork (its model config "
                "has no fork-only 'max_tokens' field): its positions are real, so converting it "
                "to ALiBi would change what it computes"
            )
        raise CheckpointError(
            f"a checkpoint of {'arch ' + repr(arch) if arch else 'an unknown model'}"
            f"{' (model family ' + repr(family) + ')' if family else ''}, not of the ALiBi "
            "fork's transformer_lm: only transformer_lm checkpoints can be converted"
        )

    cfg = facts.plain(state["cfg"])
    cfg = _resolve_all(cfg, cfg)
    model = cfg["model"]
    arch = model.get("_name") or model.get("arch")
    if model.get("decoder_learned_pos"):
        raise CheckpointError(
            "this checkpoint has learned position embeddings; the ALiBi fork never trained those"
        )
    if train_length is None:
        train_length = model.get("tokens_per_sample")
        if train_length is None or isinstance(train_length, str):
            task = cfg.get("task") or {}
            train_length = task.get("tokens_per_sample")
    if train_length is None or isinstance(train_length, str) or int(train_length) < 1:
        raise CheckpointError(
            "cannot tell the training length: tokens_per_sample is missing or unresolved "
            f"({train_length!r}); pass --train-length"
        )
    twin = alibi_twin(arch)
    for name in FORK_ONLY_MODEL_FIELDS:
        model.pop(name, None)
    model["_name"] = twin
    if "arch" in model:
        model["arch"] = twin
    model["no_token_positional_embeddings"] = True
    model["alibi_train_length"] = int(train_length)
    model.setdefault("alibi_interpolation", "none")
    model.setdefault("alibi_scale_factor", 0.0)
    model.setdefault("alibi_attention", "auto")

    weights = collections.OrderedDict()
    for key, value in state["model"].items():
        if ".embed_positions." in key:
            if not key.endswith("._float_tensor"):
                raise CheckpointError(f"unexpected position weights {key!r}; not a fork checkpoint")
            continue
        weights[key] = value

    out = {key: value for key, value in state.items() if key not in ("cfg", "model", "args")}
    out["args"] = None
    out["cfg"] = cfg
    out["model"] = weights
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, dtype and shape included (NaN markers equal themselves)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def kept_weights(state: Dict[str, Any]) -> Dict[str, Any]:
    """The input's weights a conversion keeps: all but the unused position buffer."""
    return {key: value for key, value in state["model"].items() if ".embed_positions." not in key}


def read_back(path: str, state: Dict[str, Any]) -> Dict[str, Any]:
    """The written file at ``path``, read as the loaders read it (allowlisted
    unpickling); ``CheckpointError`` unless its weights are the input's, bit for bit."""
    written = safe_load.load(path)
    expected, got = kept_weights(state), written.get("model") or {}
    differ = sorted(key for key in expected.keys() | got.keys()
                    if key not in expected or key not in got or not same_bits(expected[key], got[key]))
    if differ:
        raise CheckpointError(f"the written file does not hold the input's weights ({len(differ)} differ, e.g. "
                              f"{differ[0]}): nothing written; a bug, please report it")
    return written


def describe_written(path: str, written: Dict[str, Any]) -> str:
    """What ``alibi-convert-checkpoint`` prints, all read from the file it wrote."""
    model_cfg = facts.checkpoint_sections(written)[0]
    weights = written["model"]
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in weights.values() if t.is_floating_point()})
    return (f"wrote {path}: arch {facts.checkpoint_arch(model_cfg)}, alibi_train_length "
            f"{model_cfg.get('alibi_train_length')}; read back: {len(weights)} weight tensors "
            f"({'/'.join(dtypes) or 'none floating'}), bit for bit the input's (its unused position buffer dropped)\n")


def convert(in_path: str, out_path: str, train_length: Optional[int] = None, force: bool = False) -> Dict[str, Any]:
    """Read a fork checkpoint safely, write the converted one atomically (an
    existing output only with ``force``, never the input), read back and
    checked before it is renamed into place; returns the written state."""
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {out_path}: directory {os.path.dirname(out_path)} does not exist")
    if os.path.isdir(out_path):
        raise CheckpointError(f"cannot write {out_path}: it is a directory; give the converted file's name")
    if os.path.exists(out_path) and os.path.exists(in_path) and os.path.samefile(in_path, out_path):
        raise CheckpointError(f"the output {out_path} is the input file: converting in place would overwrite "
                              "the original; give another output path")
    if os.path.lexists(out_path) and not force:
        raise CheckpointError(f"{out_path} already exists; give a new output path, or pass --force to replace it")
    state = safe_load.load(in_path)
    converted = convert_fork_state(state, train_length)
    tmp = f"{out_path}.tmp{os.getpid()}"
    try:
        torch.save(converted, tmp)
        written = read_back(tmp, state)
        os.replace(tmp, out_path)
    except (OSError, RuntimeError) as exc:
        reason = no_space(exc) or one_line(getattr(exc, "strerror", None) or exc)
        raise CheckpointError(f"cannot write {out_path}: {reason}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return written


def parser() -> argparse.ArgumentParser:
    from .arguments import OneLineParser

    parser = OneLineParser(
        prog="alibi-convert-checkpoint",
        description="Convert a checkpoint of the ALiBi fork (ofirpress/attention_with_linear_biases) "
        "into a transformer_lm_alibi checkpoint for this plugin. The input is read with "
        "allowlisted unpickling only.",
    )
    parser.add_argument("input", help="checkpoint saved by the fork (e.g. alibi_wt103_L512.pt)")
    parser.add_argument("output", help="where to write the converted checkpoint")
    parser.add_argument(
        "--train-length",
        type=int,
        default=None,
        help="training length (tokens_per_sample) if the checkpoint does not record it",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output file (never the input)")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    with report_errors():
        written = convert(args.input, args.output, args.train_length, args.force)
        model = facts.checkpoint_sections(written)[0]
        sys.stdout.write(describe_written(args.output, written))
        dangling = sorted(k for k, v in model.items() if isinstance(v, str) and _INTERPOLATION.match(v))
        if dangling:
            sys.stderr.write(
                "warning: model fields left as unresolved references (their targets are not "
                f"in the file's config): {', '.join(dangling)}; fairseq resolves them at load "
                "time or fails naming them\n"
            )
    return 0


def refuse_fork(path: str, state: Any) -> None:
    """Raise :class:`ForkCheckpointError` if ``state`` is an unconverted fork checkpoint.

    Runs on the state as unpickled, before fairseq upgrades or resolves its
    config (the fork's dangling ``${task.max_tokens}`` would fail there first).
    """
    reason = fork_signature(state)
    if reason is not None:
        raise ForkCheckpointError(
            f"{path} is an unconverted checkpoint of the ALiBi fork ({reason}); run "
            f"`alibi-convert-checkpoint {path} CONVERTED.pt` and use CONVERTED.pt "
            "(loaded as is it would run as a sinusoidal model)"
        )
