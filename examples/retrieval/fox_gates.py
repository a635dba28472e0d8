"""Where a trained FoX model's forget gates sit: per layer and head, the gate
at its bias (``sigmoid(b_h)``, a token whose projection is 0) and the norm of
the head's gate weights (how far tokens can move it), read from checkpoints.

    python examples/retrieval/fox_gates.py outputs/retr41/seed41/fox/checkpoint_2_1250.pt [...]

(docs/results/retrieval-fox-rnope-first-seed.md: gates near 0.5 keep every head local.)
"""

import argparse
import sys

import torch

from fairseq_alibi import safe_load
from fairseq_alibi.errors import CheckpointError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="fairseq checkpoints of transformer_lm_fox models")
    args = parser.parse_args(argv)
    for path in args.checkpoints:
        try:
            state = safe_load.load(path)
        except (CheckpointError, OSError, RuntimeError, ValueError) as err:
            print(f"error: cannot read {path}: {err}", file=sys.stderr)
            return 1
        gates = {name: tensor for name, tensor in state["model"].items() if name.endswith("forget_gate.proj.bias")}
        if not gates:
            print(f"error: {path} holds no FoX forget gates (forget_gate.proj); give a transformer_lm_fox checkpoint",
                  file=sys.stderr)
            return 1
        updates = state.get("optimizer_history", [{}])[-1].get("num_updates", "?")
        for name, bias in gates.items():
            weight = state["model"][name[: -len("bias")] + "weight"]
            at_bias = " ".join(f"{float(g):.2f}" for g in torch.sigmoid(bias.float()))
            norms = " ".join(f"{float(n):.2f}" for n in weight.float().norm(dim=1))
            print(f"{path} ({updates} updates) {name[: -len('.forget_gate.proj.bias')]}: "
                  f"gate at bias {at_bias}; weight norms {norms}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
