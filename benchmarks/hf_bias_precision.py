"""How far the BLOOM and Falcon absolute ALiBi biases are from exact (docs/hf.md).

    python benchmarks/hf_bias_precision.py

BLOOM builds ``slope * j`` over absolute key positions and casts it to the
activation dtype; Falcon multiplies bfloat16 slopes by bfloat16 positions even
for float32 models.  Softmax ignores a per-row constant, so the exact bias of
the last query is ``slope * j`` in float64; printed per head: the largest
error and how many distinct values the 64 keys nearest the last query get
(64 when exact).  The relative form ``-slope * (i - j)`` built in float32 and
cast once keeps all 64.
"""

import torch

from fairseq_alibi.core.alibi import get_slopes


def report(name: str, heads: int, length: int, upstream) -> None:
    slopes = get_slopes(heads).double()
    positions = torch.arange(length, dtype=torch.float64)
    exact = slopes[:, None] * positions
    got = upstream(slopes, positions).double()
    error = (got - exact).abs().max(dim=1).values
    near = [len(torch.unique(row[-64:])) for row in got]
    print(f"{name}: {heads} heads, {length} keys: max error {error.max():.2f} (head {int(error.argmax())}), "
          f"distinct values among the 64 nearest keys of head 0: {near[0]} (of 64)")


if __name__ == "__main__":
    # BLOOM: float32 product, cast to the activation dtype (bloom-1b7: 16 heads, 6144 tokens)
    report("BLOOM bf16", 16, 6144, lambda s, p: (s.float()[:, None] * p.float()).to(torch.bfloat16))
    # Falcon: bfloat16 slopes times bfloat16 positions, for any model dtype (32 heads, 2048 tokens)
    report("Falcon", 32, 2048, lambda s, p: s.float().to(torch.bfloat16)[:, None] * p.to(torch.bfloat16))
