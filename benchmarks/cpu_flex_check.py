"""Is compiled FlexAttention exact on this CPU?  Pure torch: no score_mod and no
mask, against SDPA, at lengths that straddle FlexAttention's 128-token block.
On an AVX2-only AMD EPYC with torch 2.13 it was off by 1.19, 0.32 and 0.14 at
24, 200 and 1,000 tokens in one run and by 0.25 at 200 only in the next (exact
at the others), which is why the ``flex``
kernel refuses the CPU without AVX-512 (``fairseq_alibi/core/flex.py``).

    python benchmarks/cpu_flex_check.py      # one line per length; exit 1 if any is off
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

LENGTHS = (24, 64, 127, 130, 200, 384, 1000)


def main() -> int:
    compiled = torch.compile(flex_attention, dynamic=False)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    worst = 0.0
    for length in LENGTHS:
        torch.manual_seed(1)
        q, k, v = (torch.randn(1, 4, length, 8) for _ in range(3))
        with torch.no_grad():
            error = float((compiled(q, k, v) - F.scaled_dot_product_attention(q, k, v)).abs().max())
        worst = max(worst, error)
        print(f"{length:5d} tokens: largest difference from SDPA {error:.3g}", flush=True)
    print("exact" if worst < 1e-4 else "NOT exact: compiled CPU FlexAttention is wrong on this CPU")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
