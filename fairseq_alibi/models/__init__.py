"""fairseq registrations: importing a module registers its models and architectures."""

from . import transformer_lm  # noqa: F401
from . import roberta  # noqa: F401
from . import transformer  # noqa: F401
