"""fairseq's integer and real options and the values each takes: the tables that
the console scripts check their flags against (``--tokens-per-sample``,
``--dropout``) and model overrides and hub keywords are checked against
(``tokens_per_sample``, ``dropout``).

No fairseq or torch import, so that a console script refuses an impossible
number before it loads either (a fraction of a second instead of seconds).
"""

from __future__ import annotations

import math
from typing import Optional

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
#: fairseq's integer options that fairseq itself never range-checks, and the
#: values each takes: checked as ``alibi-*`` flags (``--tokens-per-sample``) and
#: as model overrides / hub keywords (``tokens_per_sample``).  0 tokens per
#: sample is a ZeroDivisionError; fairseq's block and batch code counts in C
#: ints (int32 lengths) and overflows beyond; numpy takes seeds below 2**32.
INTEGER_OPTIONS = {
    "tokens_per_sample": (1, INT32_MAX), "max_target_positions": (1, INT32_MAX), "context_window": (0, INT32_MAX),
    "seed": (0, 2**32 - 1), "max_tokens": (1, INT64_MAX), "batch_size": (1, INT64_MAX),
    "max_tokens_valid": (1, INT64_MAX), "batch_size_valid": (1, INT64_MAX),
    "required_batch_size_multiple": (1, INT64_MAX), "num_workers": (0, INT64_MAX), "softmax_batch": (0, INT64_MAX),
    "beam": (1, INT64_MAX), "nbest": (1, INT64_MAX), "max_len_b": (0, INT64_MAX), "update_freq": (1, INT64_MAX),
    "log_interval": (1, INT64_MAX), "workers": (1, INT64_MAX), "decoder_layers": (1, INT64_MAX),
    "decoder_embed_dim": (1, INT64_MAX), "decoder_ffn_embed_dim": (1, INT64_MAX),
    "decoder_input_dim": (1, INT64_MAX), "decoder_output_dim": (1, INT64_MAX),
    "decoder_attention_heads": (1, INT64_MAX), "encoder_layers": (1, INT64_MAX), "encoder_embed_dim": (1, INT64_MAX),
    "encoder_ffn_embed_dim": (1, INT64_MAX), "encoder_attention_heads": (1, INT64_MAX),
}
#: fairseq's real-valued options that it never range-checks, and the interval
#: each takes, ``(least, most, least included, most included)``: a dropout of
#: NaN or below 0 trained with no dropout at all (fairseq tests ``p > 0``), 2 was
#: a traceback after a crash checkpoint was written; a NaN weight decay saved a
#: model of NaNs; a temperature of 0 or NaN was fairseq's assertion.
REAL_OPTIONS = {
    "dropout": (0.0, 1.0, True, False), "attention_dropout": (0.0, 1.0, True, False),
    "activation_dropout": (0.0, 1.0, True, False), "relu_dropout": (0.0, 1.0, True, False),
    "weight_decay": (0.0, math.inf, True, False), "clip_norm": (0.0, math.inf, True, False),
    "label_smoothing": (0.0, 1.0, True, False), "temperature": (0.0, math.inf, False, False),
}
#: Of the integer options, the ones fairseq leaves unset (None) by default.
OPTIONAL_OPTIONS = ("max_tokens", "batch_size", "max_tokens_valid", "batch_size_valid")


def integer_problem(key: str, value) -> Optional[str]:
    """``"takes ..."`` if ``value`` is not one of the integers option ``key`` takes, else None."""
    least, most = INTEGER_OPTIONS[key]
    if value is None and key in OPTIONAL_OPTIONS:
        return None
    if not isinstance(value, bool) and isinstance(value, int) and least <= value <= most:
        return None
    allowed = "takes a positive integer" if least == 1 else f"takes an integer >= {least}"
    return allowed if most == INT64_MAX else f"{allowed} (at most {most})"


def real_problem(key: str, value) -> Optional[str]:
    """``"takes ..."`` if ``value`` is not a number in option ``key``'s interval, else None."""
    least, most, low_in, high_in = REAL_OPTIONS[key]
    if not isinstance(value, bool) and isinstance(value, (int, float)) and (
            least <= value if low_in else least < value) and (value <= most if high_in else value < most):
        return None
    interval = f"{'[' if low_in else '('}{least:g}, {most:g}{']' if high_in else ')'}"
    return f"takes a number in {interval}" if math.isfinite(most) else \
        f"takes a finite number {'>=' if low_in else '>'} {least:g}"
