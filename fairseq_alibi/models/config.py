"""The ALiBi config fields every model shares (decoder and encoder stacks).

Each model config inherits these and adds its own ``alibi_train_length``
(whose default differs: the LM resolves it from the task, the encoders at build
time).  No ``from __future__ import annotations`` here: fairseq reads the field
types to build its argparse options.
"""

from dataclasses import dataclass, field

from fairseq.dataclass import FairseqDataclass

from ..alibi import INTERPOLATION_METHODS
from ..attention import KERNELS


@dataclass
class AlibiSlopeConfig(FairseqDataclass):
    alibi_interpolation: str = field(
        default="none",
        metadata={
            "help": "context extension applied to the ALiBi slopes at evaluation: "
            f"{' | '.join(INTERPOLATION_METHODS)} (linear: every slope / factor; "
            "ntk: steepest head kept, flattest / factor, geometric in between)"
        },
    )
    alibi_scale_factor: float = field(
        default=0.0,
        metadata={
            "help": "interpolation factor: 0 = dynamic, max(1, length / alibi_train_length); "
            "otherwise a static factor >= 1"
        },
    )
    alibi_attention: str = field(
        default="auto",
        metadata={"help": f"attention kernel: {' | '.join(KERNELS)}"},
    )
