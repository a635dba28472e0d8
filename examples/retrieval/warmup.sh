#!/usr/bin/env bash
# Why some seeds never learned retrieval with 100 warm-up updates, and whether
# the 500-update recipe holds for seeds beyond the three of run.sh
# (docs/results/retrieval-demo.md, "The recipe").  Four schedules for one model seed, a 2x2
# design that separates the two things a longer warm-up changes:
#
#   warm-up | peak lr  | lr after update 500
#   100     | 3e-3     | 3e-3 * sqrt(100/t)   the old recipe
#   100     | 6.708e-3 | 3e-3 * sqrt(500/t)   fast start, the new recipe's later lr
#   500     | 1.342e-3 | 3e-3 * sqrt(100/t)   slow start, the old recipe's later lr
#   500     | 3e-3     | 3e-3 * sqrt(500/t)   the new recipe (run.sh)
#
# (inverse_sqrt: lr = peak * sqrt(warmup / t) after the warm-up), then the new
# recipe for EXTRA_SEEDS.  Each model is scored at 1x (none), as run.sh scores
# it.  The results: $OUT/*/seed*/lines/results.md; a summary table at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/retrieval-warmup}
SEED=${SEED:-2}
EXTRA_SEEDS=${EXTRA_SEEDS:-4 5 6 7 8}
common=(MODELS=alibi LENGTHS=1x METHODS=none)

run() {  # run NAME WARMUP LR SEEDS
  env "${common[@]}" OUT="$OUT/$1" WARMUP="$2" LR="$3" SEEDS="$4" examples/retrieval/run.sh
}
# Two single-seed runs at a time (one thread each), then the seeds of the new recipe.
run wu100-lr3e-3 100 0.003 "$SEED" & a=$!; run wu100-lr6.7e-3 100 0.006708 "$SEED" & b=$!; wait $a; wait $b
run wu500-lr1.3e-3 500 0.0013416 "$SEED" & a=$!; run wu500-lr3e-3 500 0.003 "$SEED" & b=$!; wait $a; wait $b
run wu500-lr3e-3 500 0.003 "$SEED $EXTRA_SEEDS"

python - "$OUT" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
print("| schedule | seed | accuracy at 1x (%) | valid loss |")
print("|---|---|---|---|")
for results in sorted(glob.glob(f"{out}/*/seed*/lines/results.json")):
    run_dir = os.path.dirname(os.path.dirname(results))
    cells = [c for c in json.load(open(results))["cells"] if c["checkpoint"] == "alibi"]
    acc = 100 * sum(c["correct"] for c in cells) / sum(c["n"] for c in cells)
    log = open(f"{run_dir}/alibi/train.log").read()
    valid = re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)
    seed = os.path.basename(run_dir)[len("seed"):]
    print(f"| {os.path.basename(os.path.dirname(run_dir))} | {seed} | {acc:.0f} | {valid[-1] if valid else '?'} |")
PY
