"""fairseq-alibi: ALiBi models for fairseq, loaded as a plugin.

Importing this package applies the fairseq/torch/NumPy fixes of ``patches.py``
and ``trust_patches.py`` and registers the models and architectures with fairseq;
``fairseq-train --user-dir "$(alibi-user-dir)"`` does the same for stock CLIs.
"""

__version__ = "0.1.0"

from . import patches, trust_patches  # noqa: E402

patches.apply()
trust_patches.apply()

from . import models  # noqa: F401,E402  (registers with fairseq)
