"""Third-party warnings that say nothing a user of this plugin can act on."""

from __future__ import annotations

import os
import warnings

#: Third-party warnings known to be harmless here, shown on every command
#: otherwise (message regexes).  FAIRSEQ_ALIBI_WARNINGS=1 shows them again.
HARMLESS_WARNINGS = (
    r"\s*'[^']*' is validated against ConfigStore schema",  # hydra 1.1 deprecation (a config named like a schema)
    r"\s*The version_base parameter is not specified",  # hydra, fairseq's hydra_main
    r"\s*Future Hydra versions will no longer change working directory",  # hydra
    r"hydra\.experimental\.\w+\(\) is no longer experimental",  # hydra, fairseq's config loading
    r"In '[^']*': Usage of deprecated keyword in package header",  # hydra, fairseq's yaml headers
    r"\s*The strict flag in the compose API is deprecated",  # hydra, fairseq's compose call
    r"'pin_memory' argument is set as true but no accelerator",  # torch DataLoader on CPU
    r"Support for mismatched key_padding_mask and attn_mask is deprecated",  # torch, stock fairseq MHA
    r"`torch.cuda.amp.\w+\(args...\)` is deprecated",  # torch, fairseq's fp16 code
    r".*torch.cuda.amp.\w+ is deprecated",  # torch, fairseq's fp16 code
    r"`broadcast_buffers` is deprecated",  # torch DDP: fairseq passes it (kept: its meaning differs)
)


def quiet_harmless_warnings() -> None:
    """Keep the warnings of :data:`HARMLESS_WARNINGS` out of every command.

    Kind: quieting.  Stock: hydra's deprecation notices and torch's CPU-only
    notices, about fairseq's own calls, print on every command.  Here they are
    filtered, unless ``FAIRSEQ_ALIBI_WARNINGS`` is set."""
    if os.environ.get("FAIRSEQ_ALIBI_WARNINGS"):
        return
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
