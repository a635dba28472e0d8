"""Every error a user can fix, and the one way the console scripts report them.

* :class:`UserError` (``core/errors.py``, the root: the core raises it too) and
  its subclasses carry a message that says what was wrong, what is allowed and
  what to do.  Models, tools and CLIs raise them; nobody rewords them.
* :func:`describe` turns a known foreign exception (a missing file, a
  checkpoint whose weights do not fit its model, ...) into such a message, or
  returns None for a bug, whose traceback must be seen.
* :func:`report_errors` wraps every console script: a user-fixable error
  becomes one ``error: ...`` line on stderr and exit status 1
  (``FAIRSEQ_ALIBI_TRACEBACK=1`` prints the traceback too); Ctrl-C becomes one
  line and exit status 130.

No fairseq import at module level: this module is imported by every other.
"""

from __future__ import annotations

import difflib
import errno
import functools
import os
import re
import sys
from typing import Iterable, Optional

from .core.errors import (  # noqa: F401
    ConfigError, InputError, KernelUnsupportedError, ScalingError, UserError, plural, warn_once,
)
from .splits import split_problem


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says why and what to do."""


class UnsafeCheckpointError(CheckpointError):
    """The file needs types outside the allowlist; nothing of it was built."""


class CorruptCheckpointError(CheckpointError):
    """The file is missing, truncated, or not a PyTorch checkpoint at all."""


class ForkCheckpointError(CheckpointError):
    """An unconverted checkpoint of the ALiBi fork reached fairseq's loader."""


class ModelOptionsError(UserError, ValueError):
    """Options fairseq cannot build a model or task from (one of fairseq's own checks failed)."""


class UnsupportedModelError(UserError, ValueError):
    """A Hugging Face model without an ALiBi bias ``fairseq_alibi.hf`` knows how to scale."""


class HFLoadError(UserError, ValueError):
    """A Hugging Face model or tokenizer could not be loaded."""


class ExportError(UserError, ValueError):
    """A checkpoint, dictionary, option or output directory ``alibi-export-hf`` cannot use."""


class EvaluationError(UserError):
    """Bad input to an evaluation tool (sweep, retrieval): files, names, grid."""


class PromptError(EvaluationError, ValueError):
    """A retrieval task that cannot be built as asked (template, vocabulary, length)."""


class DataError(UserError):
    """A data directory's file (a dictionary, a binarized split) that cannot be read as one."""


class TextInputError(UserError):
    """A text a tool reads (a corpus, a dictionary, a prompt file) that is not a
    readable, non-empty UTF-8 file (``inputs.check_text``)."""


class CorpusError(UserError):
    """A problem with the embedded corpus's inputs or outputs."""



#: Keys fairseq's hub interface adds to the overrides itself (its files, its options).
HUB_KEYS = ("data", "bpe_codes", "sentencepiece_model", "bpe_merges", "bpe_vocab", "user_dir", "generation_args",
            "is_vocoder")

def one_line(text) -> str:
    return " ".join(str(text).split())


def closest(word: str, choices: Iterable[str], n: int = 3) -> str:
    """``"; did you mean a, b?"`` for the nearest choices, or ``""``."""
    near = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)
    return f"; did you mean {', '.join(near)}?" if near else ""


#: The files fairseq-train writes that a user evaluates first: suggested first.
FIRST_CHECKPOINTS = ("checkpoint_best.pt", "checkpoint_last.pt")


def _checkpoint_order(name: str):
    """``checkpoint_best.pt``, ``checkpoint_last.pt``, then the others, the
    newest epoch and update first (``checkpoint12.pt`` before ``checkpoint9.pt``)."""
    numbers = [int(n) for n in re.findall(r"\d+", name)]
    first = FIRST_CHECKPOINTS.index(name) if name in FIRST_CHECKPOINTS else len(FIRST_CHECKPOINTS)
    return first, [-n for n in numbers], name


def checkpoint_files(directory: str) -> str:
    """The ``.pt`` files of a directory, for a message about a directory given as a
    checkpoint: ``checkpoint_best.pt`` and ``checkpoint_last.pt`` first, then the newest."""
    try:
        names = sorted((n for n in os.listdir(directory) if n.endswith(".pt")), key=_checkpoint_order)
    except OSError:
        names = []
    if not names:
        return f"{directory} is a directory, not a file (and holds no .pt checkpoint)"
    shown = ", ".join(os.path.join(directory, n) for n in names[:4])
    more = f" ({len(names) - 4} more .pt files there)" if len(names) > 4 else ""
    return f"{directory} is a directory; give a checkpoint file in it, e.g. {shown}{more}"


def not_a_file(path: str, what: str = "file") -> str:
    """Why ``path`` is not a readable regular file: missing, a broken or looping
    symbolic link, a directory (see :func:`checkpoint_files`), a device or pipe."""
    if os.path.isdir(path):
        return checkpoint_files(path)
    if os.path.exists(path):
        return f"{path} is not a regular file (a device, a pipe, ...): give a {what}"
    if os.path.islink(path):
        return f"{path} is a broken symbolic link (its target {os.readlink(path)} does not exist, or links loop)"
    return f"{what} not found: {path}"


# ------------------------------------------------------------ foreign errors


def _missing_split(message: str) -> str:
    """fairseq's ``Dataset not found: SPLIT (PATH)`` -> the splits that exist there
    (or that PATH is half a split)."""
    match = re.match(r"Dataset not found: (\S+) \((.*)\)$", message)
    if not match:
        return one_line(message)
    split, prefix = match.groups()
    half = split_problem(prefix)
    if half:
        return half
    directory = os.path.dirname(prefix) or "."
    try:
        found = sorted({n.split(".")[0] for n in os.listdir(directory) if n.endswith(".bin")})
    except OSError:
        found = []
    return (
        f"split {split!r} not found in {directory} (no {split}.bin/.idx); splits there: "
        f"{', '.join(found) or 'none (run alibi-preprocess first)'}; check --gen-subset / --valid-subset"
    )


def _not_a_directory(path: str) -> str:
    """``a/b.txt/dict.txt``: which part of the path is a file where a directory is needed."""
    part = path
    while part and not os.path.isfile(part) and os.path.dirname(part) != part:
        part = os.path.dirname(part)
    if not os.path.isfile(part):
        return f"cannot use {path}: a part of it is not a directory"
    return f"{part} is a file, not a directory (fairseq opens {path}): give a directory in its place"


def _loading_frame(tb):
    """Locals of fairseq's ``load_model_ensemble_and_task`` if ``tb`` passes through it."""
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "load_model_ensemble_and_task":
            found = tb.tb_frame.f_locals
        tb = tb.tb_next
    return found


def _state_dict_sizes(detail: str) -> Optional[str]:
    """``size mismatch for X: ... [A, d] ... [B, d]`` -> a message about dictionary sizes."""
    match = re.search(
        r"size mismatch for ([\w.]*embed_tokens\.weight|[\w.]*output_projection\.weight): "
        r"copying a param with shape torch\.Size\(\[(\d+), \d+\]\) from checkpoint, the shape "
        r"in current model is torch\.Size\(\[(\d+), \d+\]\)",
        detail,
    )
    if not match:
        return None
    saved, built = int(match.group(2)), int(match.group(3))
    return (
        f"the checkpoint was trained with a dictionary of {saved} symbols, the data directory's "
        f"dict.txt gives {built}: evaluate with the data directory the model was trained on "
        "(its dict.txt)"
    )


def _describe_model_mismatch(exc: BaseException, frame) -> str:
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    filename = frame.get("filename", "the checkpoint")
    cfg = frame.get("cfg")
    arch = None
    try:
        arch = cfg.model.get("_name") if cfg is not None and cfg.model is not None else None
    except Exception:  # a config too broken to read: keep the original error only
        pass
    detail = one_line(exc)
    sizes = _state_dict_sizes(detail)
    if sizes:
        return f"cannot use {filename}: {sizes}"
    family = ARCH_MODEL_NAME_REGISTRY.get(arch) if arch else None
    what = f"arch {arch!r}" + (f", model family {family!r}" if family else "") if arch else "its model"
    if detail.startswith("Error(s) in loading state_dict"):
        missing = len(re.findall(r'"[^"]+"', detail.split("Unexpected key(s)")[0].split("size mismatch")[0]))
        mismatched = len(re.findall(r"size mismatch for ", detail))
        extra = detail.split("Unexpected key(s)")[1].split("size mismatch")[0] if "Unexpected key(s)" in detail else ""
        unexpected = len(re.findall(r'"[^"]+"', extra))
        detail = (f"its weights do not fit the model built from its config ({missing} missing names, "
                  f"{unexpected} names the model has no place for, {mismatched} of another shape)")
    elif len(detail) > 300:
        detail = detail[:300] + "..."

    overrides = frame.get("arg_overrides") or {}
    given = sorted(str(k) for k in overrides if k not in HUB_KEYS) if isinstance(overrides, dict) else []
    cause = (f"Do the model overrides given ({', '.join(given)}) change its shape? Leave them out; otherwise, is it "
             "a checkpoint of another model family or task?" if given else
             "Is it a checkpoint of another model family or task?")
    return f"cannot use {filename} ({what}) here: {type(exc).__name__}: {detail}. {cause}"


def no_space(exc: BaseException) -> Optional[str]:
    """A message if ``exc`` (or an error it was raised from) is a full disk or quota, else None;
    torch's writer reports a full disk only as ``unexpected pos N vs M``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {os.fsdecode(exc.filename)}" if exc.filename else ""
            return f"{exc.strerror or 'no space left on the device'}{where}: free space there, or write to another disk"
        if isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
            return "the file could not be written in full (torch: unexpected pos): is the disk full?"
        exc = exc.__cause__ or exc.__context__
    return None


#: Hydra's and omegaconf's errors for an override or config value the config does not take.
HYDRA_CONFIG_ERRORS = ("ConfigCompositionException", "OverrideParseException", "ConfigKeyError",
                       "ConfigAttributeError", "ValidationError", "MissingMandatoryValue")


def _hydra_config_error(exc: BaseException) -> Optional[str]:
    """One line for a Hydra override the config does not take (a misspelt key, a
    value of the wrong type): Hydra's message and omegaconf's cause (the key),
    and the keys nearest a misspelt one; None for another error."""
    chain = [e for e in (exc, exc.__cause__) if e is not None]
    if not any(type(e).__module__.split(".")[0] in ("hydra", "omegaconf")
               and type(e).__name__ in HYDRA_CONFIG_ERRORS for e in chain):
        return None
    parts = []
    for e in chain:
        text = str(e).split("\n    full_key:")[0]  # omegaconf's own detail lines repeat the key
        parts.append(one_line(text).rstrip("."))
    found = next(((e.key, e.parent_node) for e in chain
                  if getattr(e, "key", None) is not None and getattr(e, "parent_node", None) is not None), None)
    hint = ""
    if found and "not in" in parts[-1]:
        key, node = found
        hint = closest(str(key), [str(k) for k in node.keys()])
    elif found:
        hint = f" (key {found[0]})"
    return "Hydra config: " + "; ".join(parts) + hint


def describe(exc: BaseException) -> Optional[str]:
    """A one-line message for an error a user can fix, or None (a bug: show it all).
    ``user_error``: every :class:`UserError`, also of the copy of ``core/errors.py``
    that transformers loads from an exported model's folder."""
    if getattr(exc, "user_error", False) is True:
        return one_line(exc)
    full = no_space(exc)
    if full:
        return full
    hydra = _hydra_config_error(exc)
    if hydra:
        return hydra
    if isinstance(exc, IsADirectoryError) and exc.filename:
        name = os.fsdecode(exc.filename)
        if os.path.splitext(name)[1] not in ("", ".pt"):  # dict.txt, a .bin: not a checkpoint
            return f"{name} is a directory, not a file"
        return checkpoint_files(name)
    if isinstance(exc, FileNotFoundError) and str(exc).startswith("Dataset not found"):
        return _missing_split(str(exc))
    if isinstance(exc, FileNotFoundError) and exc.filename:
        name = os.fsdecode(exc.filename)
        base = os.path.basename(name)
        if base.startswith("dict") and base.endswith(".txt"):
            return (
                f"dictionary not found: {name} (the data directory must hold the dict.txt "
                "written by alibi-preprocess)"
            )
        return f"file not found: {name}"
    if isinstance(exc, PermissionError) or (isinstance(exc, OSError) and exc.errno == errno.EROFS):
        where = os.fsdecode(exc.filename) if exc.filename else "a file"
        return f"cannot access {where}: {exc.strerror or exc} (check its permissions, or choose another directory)"
    if isinstance(exc, OSError) and str(exc).startswith("Model file not found"):
        return not_a_file(str(exc).split(":", 1)[1].strip(), "checkpoint file")
    if isinstance(exc, NotADirectoryError) and exc.filename:
        return _not_a_directory(os.fsdecode(exc.filename))
    match = re.match(r"Sentences lengths should not exceed max_tokens=(\d+)", str(exc))
    if isinstance(exc, AssertionError) and match:
        return (
            f"a sample is longer than the batch limit of {match.group(1)} tokens (--max-tokens): fairseq puts at "
            "least one whole sample in a batch (a block of --tokens-per-sample tokens; a line with "
            "--sample-break-mode eos; a prompt); give --max-tokens at least the longest sample, or --batch-size N "
            "without --max-tokens"
        )
    frame = _loading_frame(exc.__traceback__)
    if frame is not None and isinstance(exc, (AttributeError, KeyError, ValueError, TypeError, RuntimeError, AssertionError)):
        return _describe_model_mismatch(exc, frame)
    return None


class report_errors:
    """Context manager (and decorator) for console scripts: user-fixable errors
    -> one ``error:`` line and exit 1; Ctrl-C -> one line and exit 130."""

    def __init__(self, interrupted: str = "interrupted"):
        self.interrupted = interrupted

    def __enter__(self):
        return self

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapped

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            sys.stderr.write(f"\n{self.interrupted}\n")
            sys.stderr.flush()
            raise SystemExit(130)
        if not isinstance(exc, Exception):
            return False
        message = describe(exc)
        if message is None:
            return False
        if os.environ.get("FAIRSEQ_ALIBI_TRACEBACK"):
            import traceback

            traceback.print_exception(exc_type, exc, tb)
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        raise SystemExit(1)
