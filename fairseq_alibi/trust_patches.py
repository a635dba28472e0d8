"""Changes to fairseq from the ``trust`` branch, to be moved into ``patches.py``.

:func:`apply` runs once, from the package's ``__init__``, after
``patches.apply()``, and is idempotent.  Each change alters behaviour only
where stock fairseq 0.12 prints a traceback or noise a user cannot act on:

* ``fairseq.models.build_model`` and ``fairseq.tasks.setup_task``: an
  ``AssertionError`` raised by fairseq's own code while building a model or a
  task is fairseq checking the user's options (``embed_dim must be divisible
  by num_heads``), and a torch error on values fairseq computed from them
  (adaptive cutoffs out of order: a tensor of negative size) is the same
  class; either becomes a :class:`~.errors.ModelOptionsError` naming the
  check and where it is, so every console script prints one ``error:`` line
  and the hub API raises an exception that says what to change
  (``build_assertions``).  Raised from this package's own code, they stay
  tracebacks (bugs).
* ``fairseq.models.fairseq_model``'s ``from_pretrained`` logs the whole
  configuration at INFO (hundreds of fields); that record is kept for DEBUG
  (``quiet_hub_config``).
"""

from __future__ import annotations

import functools
import logging
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
    from .errors import ModelOptionsError, UserError

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
    """fairseq's failed checks while building a model or task -> one ``ModelOptionsError``."""
    from fairseq import models, tasks

    if not getattr(models.build_model, "_alibi_checked", False):  # a reason: see the module docstring
        models.build_model = _checked(models.build_model, "build_model")
    if not getattr(tasks.setup_task, "_alibi_checked", False):
        tasks.setup_task = _checked(tasks.setup_task, "setup_task")


class _ConfigRecordAtDebug(logging.Filter):
    """Drops the configuration object ``from_pretrained`` logs at INFO unless DEBUG is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) or record.levelno != logging.INFO:
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_hub_config() -> None:
    """``from_pretrained`` prints the whole config (a DictConfig/Namespace, not a message) at INFO."""
    logger = logging.getLogger("fairseq.models.fairseq_model")
    if not any(isinstance(f, _ConfigRecordAtDebug) for f in logger.filters):
        logger.addFilter(_ConfigRecordAtDebug())


def apply() -> None:
    """Apply every change above (idempotent)."""
    build_assertions()
    quiet_hub_config()
