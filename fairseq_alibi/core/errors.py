"""The root of every error a user can fix, in the portable core.

Every user-fixable error of this package, core or fairseq side, is a
:class:`UserError`: ``str(exc)`` is the whole explanation (what was wrong, what
is allowed, what to do), on one line.  The console scripts print it as one
``error:`` line with exit status 1, the Hugging Face entry points let it
through unchanged; nobody rewords it.

This file travels with every exported model, where transformers loads it as a
module of its own (a second ``UserError`` class): ``user_error = True`` is how
``fairseq_alibi.errors.describe`` recognizes an error of such a copy.
"""

from __future__ import annotations

import logging
from typing import Any, Dict


class UserError(Exception):
    """Bad input a user can fix; ``str(exc)`` is the whole explanation."""

    user_error = True


class ConfigError(UserError, ValueError):
    """An invalid config value or argument; the message names it and what is allowed."""


class ScalingError(ConfigError):
    """An invalid context-extension setting.  ``field`` is the name the user
    wrote it under (``factor``, ``alibi_scale_factor``, ``alibi_scaling``, ...),
    ``value`` what was given, ``reason`` what is allowed."""

    def __init__(self, field: str, value: Any, reason: str):
        super().__init__(f"{field}={value!r} is not valid; {reason}")
        self.field, self.value, self.reason = field, value, reason

    def renamed(self, names: Dict[str, str]) -> "ScalingError":
        """The same error under the user's name for the field (``names[field]``)."""
        return ScalingError(names.get(self.field, self.field), self.value, self.reason)


class InputError(UserError, ValueError):
    """An input a model call cannot take (a mask's shape, a cache type); the message says what it takes."""


class KernelUnsupportedError(UserError, NotImplementedError):
    """An attention kernel asked for what it cannot do here (FlexAttention's
    backward on the CPU); the message says what to use instead."""


#: The messages :func:`warn_once` has logged in this process.
warned = set()


def plural(count: int, singular: str, several: str = "") -> str:
    """``singular`` for one thing, else ``several`` (default: ``singular`` + s):
    ``f"{n} {plural(n, 'word')} {plural(n, 'is', 'are')} ..."``, never ``word(s)``."""
    return singular if count == 1 else (several or singular + "s")


def warn_once(message: str) -> None:
    """A warning a user should act on, logged once per process (one line,
    logger ``fairseq_alibi``: the console scripts print it in fairseq's format,
    a plain Python session on stderr)."""
    if message not in warned:
        warned.add(message)
        logging.getLogger("fairseq_alibi").warning(message)
