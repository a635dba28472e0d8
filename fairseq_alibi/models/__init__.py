"""The plugin's fairseq models: importing this package registers them and
applies ``patches`` (fairseq's ``--user-dir`` imports it)."""

from .. import patches

patches.deferred_metric_imports()  # first: fairseq imported without the metrics it never uses here

from . import config  # noqa: E402

patches.apply(override_checks=(config.adopt_new_fields, config.check_override_keys))

from . import transformer_lm  # noqa: F401,E402
from . import roberta  # noqa: F401,E402
from . import transformer  # noqa: F401,E402
