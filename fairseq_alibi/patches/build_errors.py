"""Options that fairseq cannot build a model or a task from: one error that
names fairseq's failed check, not its traceback."""

from __future__ import annotations

import functools
import os
import traceback


#: What a user changes when fairseq cannot build something, by what was being built.
_WHAT = {"build_model": ("the model", "model options (sizes, heads, layers, cutoffs, ...)"),
         "setup_task": ("the task", "task options (--task, DATA, --tokens-per-sample, ...)")}
#: What fairseq raises (or lets torch raise) on options that do not fit together.
_OPTION_ERRORS = (AssertionError, ValueError, RuntimeError, IndexError, ZeroDivisionError)


def _fairseq_check(exc: BaseException) -> str:
    """What failed and where, if fairseq's own code raised ``exc`` or handed torch the
    values it failed on (the innermost frame outside torch is fairseq's); ``""``
    otherwise: an error raised in this package or elsewhere is a bug, whose
    traceback must be seen."""
    import fairseq
    import torch

    roots = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (fairseq, torch)]
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(roots[1])]
    if not frames or not os.path.abspath(frames[-1].filename).startswith(roots[0]):
        return ""
    last = frames[-1]
    text = " ".join(str(exc).split())
    if isinstance(exc, AssertionError):
        text = f"its check failed: {text or (last.line or '').strip()}"
    else:
        text = f"{type(exc).__name__}: {text}"
    return f"{text} (fairseq/{os.path.relpath(last.filename, roots[0])}:{last.lineno})"


def _checked(stock, name: str):
    from ..errors import ModelOptionsError, UserError

    what, options = _WHAT[name]

    @functools.wraps(stock)
    def wrapper(*args, **kwargs):
        try:
            return stock(*args, **kwargs)
        except _OPTION_ERRORS as exc:
            check = "" if isinstance(exc, UserError) else _fairseq_check(exc)
            if not check:
                raise
            raise ModelOptionsError(
                f"fairseq cannot build {what} from the options given: {check}; change the {options} it names "
                "so that they fit together (flags, --model-overrides keys and hub keywords alike; "
                "`alibi-train --help` lists them)"
            ) from exc

    wrapper._alibi_checked = True
    return wrapper


def build_assertions() -> None:
    """fairseq's own failed checks while building a model or a task are one
    ``ModelOptionsError`` naming the check (``fairseq.models.build_model`` and
    ``fairseq.tasks.setup_task``), so every console script prints one
    ``error:`` line and the hub API says what to change.

    Kind: crash.  Stock: an ``AssertionError`` such as ``embed_dim must be
    divisible by num_heads``, or a torch error on sizes fairseq computed from
    the options, is a traceback.  Raised from this package (not fairseq), such
    an error stays a traceback: a bug, whose traceback must be seen."""
    from fairseq import models, tasks

    if not getattr(models.build_model, "_alibi_checked", False):
        models.build_model = _checked(models.build_model, "build_model")
    if not getattr(tasks.setup_task, "_alibi_checked", False):
        tasks.setup_task = _checked(tasks.setup_task, "setup_task")
