"""fairseq-alibi: ALiBi models for fairseq, loaded as a plugin.

Importing this package registers the models and architectures with fairseq;
``fairseq-train --user-dir "$(alibi-user-dir)"`` does the same for stock CLIs.
"""

__version__ = "0.1.0"

from . import models  # noqa: F401,E402  (registers with fairseq)
from . import checkpoints  # noqa: F401,E402  (safe, allowlisted loading and the fork check in fairseq's loader)
