"""The plugin's fairseq models: importing this package registers them and
applies ``patches.py`` (fairseq's ``--user-dir`` imports it)."""

from .. import patches

patches.apply()  # first: before anything imports fairseq

from . import config  # noqa: E402

patches.OVERRIDE_CHECKS[:] = [config.adopt_new_fields, config.check_override_keys]

from . import transformer_lm  # noqa: F401,E402
from . import roberta  # noqa: F401,E402
from . import transformer  # noqa: F401,E402
