"""The plugin's fairseq models: importing this package registers them and
applies ``patches.py`` (fairseq's ``--user-dir`` imports it)."""

from .. import patches

patches.apply()

from . import transformer_lm  # noqa: F401,E402
from . import roberta  # noqa: F401,E402
from . import transformer  # noqa: F401,E402
