#!/usr/bin/env bash
# The paper's comparison, and the field's, in miniature (the `make compare` recipe):
# every position method trained identically, swept from 1x to 16x L.
#
#   1. the embedded corpus (as `make demo`);
#   2. for each seed in SEEDS and each method in POSITIONS (default: sinusoidal and
#      every position method of fairseq_alibi/core/positions.py): a small LM trained
#      with the demo's settings at L tokens, only the arch differing
#      (transformer_lm = sinusoidal, transformer_lm_<method> for the others);
#   3. alibi-sweep over every model from 1x to 16x L (nonoverlapping valid
#      perplexity), then the EXTENSIONS on the models of the methods that have
#      extension methods (the registry's: ALiBi's cap, capnorm, power, ntk; RoPE's
#      linear, ntk, yarn), each model under those that apply to it; the default
#      list keeps the methods that apply to some model of the run, so any subset
#      of POSITIONS runs (a list given that holds a method applying to none is refused);
#   4. examples/positions/report.py: the figure (perplexity against evaluation
#      length, one line per method, a band over seeds) and the tables, of this
#      run's seeds and methods only.
#
# The speed/memory tables are benchmarks/positions_cost.py (docs/results/positions-cost-*.md;
# docs/positions.md, "Speed and memory").
# Resumable (examples/lib.sh): a finished model (its trained.ok) is not retrained,
# an interrupted one (Ctrl-C) resumes from its last saved update (every SAVE_EVERY
# updates) when the same command is run again, swept cells are kept. The previous
# run's report (positions.md, the figures) is removed when a run starts.
# Every setting can be overridden from the environment, e.g.
#   SEEDS="1" UPDATES=200 POSITIONS="alibi rotary" OUT=outputs/compare-small examples/positions/compare.sh
cd "$(dirname "$0")/../.."
RECIPE_TAG=compare
source examples/lib.sh

DATA=${DATA:-data-bin/embedded}
# The embedded corpus's valid/test paragraphs that train holds: drop (default) or keep (the corpus
# before 2026-12-02, which docs/results/positions-seven-methods.md and positions-field-methods.md were measured on).
HELD_OUT_OVERLAP=${HELD_OUT_OVERLAP:-drop}
OUT=${OUT:-outputs/compare}
L=${L:-64}
LAYERS=${LAYERS:-2}
DIM=${DIM:-128}
FFN=${FFN:-512}
HEADS=${HEADS:-8}
UPDATES=${UPDATES:-1200}
SAVE_EVERY=${SAVE_EVERY:-100}
MAX_TOKENS=${MAX_TOKENS:-2048}
LR=${LR:-0.002}
WARMUP=${WARMUP:-100}
DROPOUT=${DROPOUT:-0.1}
SEEDS=${SEEDS:-1 2 3}
# POSITIONS (default: sinusoidal and every method of the registry) and EXTENSIONS (default: the
# list below less the methods that apply to no model of the run): recipe_settings, below.
LENGTHS=${LENGTHS:-1x,2x,4x,8x,16x}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
PARALLEL=${PARALLEL:-1}
EVAL_THREADS=${EVAL_THREADS:-$(nproc)}   # threads of the sweeps (one process at a time)
training_threads

# Checked before anything runs: the methods (default: every model), the extension methods (the
# default list less those that apply to no model of the run), the seeds.
recipe_settings POSITIONS EXTENSIONS "$DEFAULT_EXTENSIONS"
[ -n "${SEEDS// /}" ] || { echo "error: SEEDS must name at least one seed" >&2; exit 1; }
mkdir -p "$OUT"
fresh_report "$OUT/positions.md" "$OUT/positions.png" "$OUT/positions.csv" "$OUT/extensions.png"

# Data of the user's own (binarized, no corpus.json) is used as it is; the embedded corpus is
# built, or rebuilt where its settings differ (a no-op when they match).
if [ -f "$DATA/train.bin" ] && [ -f "$DATA/valid.bin" ] && [ ! -f "$DATA/corpus.json" ]; then
  stamp "1/4 corpus: $DATA already binarized"
else
  stamp "1/4 corpus -> $DATA"
  python -m fairseq_alibi.corpus --destdir "$DATA" --as-built --held-out-overlap "$HELD_OUT_OVERLAP"
fi

train() {  # train SEED NAME: the demo's settings for every method; only the arch differs
  local seed=$1 name=$2
  lm_train_args "$name"
  # shellcheck disable=SC2086  # EXTRA_TRAIN_ARGS: the words as typed
  train_model "$OUT/seed$seed/$name" "seed $seed $name" "$(arch_of "$name"), L=$L, $UPDATES updates" \
    "$DATA" "${LM_ARGS[@]}" --sample-break-mode none --dropout "$DROPOUT" --seed "$seed" \
    --log-format simple --log-interval 100 --cpu $EXTRA_TRAIN_ARGS
}
TRAIN_STEP=2/4 FOLLOW="" run_trainings train < <(for seed in $SEEDS; do for name in $POSITIONS; do echo "$seed $name"; done; done)

checkpoints=() extended=()
for seed in $SEEDS; do
  for name in $POSITIONS; do
    checkpoints+=(--checkpoint "${name}_s$seed=$OUT/seed$seed/$name/checkpoint_last.pt")
    case " $EXTENDED " in *" $name "*) extended+=(--checkpoint "${name}_s$seed=$OUT/seed$seed/$name/checkpoint_last.pt") ;; esac
  done
done
stamp "3/4 sweep: every model at $LENGTHS -> $OUT/sweep"
OMP_NUM_THREADS=$EVAL_THREADS alibi-sweep "$DATA" "${checkpoints[@]}" --lengths "$LENGTHS" \
  --methods none --modes nonoverlapping --output-dir "$OUT/sweep" --cpu --no-progress
report_extensions=()
if [ ${#extended[@]} -gt 0 ]; then
  stamp "3/4 sweep: extension methods {$EXTENSIONS} on {$EXTENDED} -> $OUT/extensions"
  OMP_NUM_THREADS=$EVAL_THREADS alibi-sweep "$DATA" "${extended[@]}" --lengths "$LENGTHS" \
    --methods "$EXTENSIONS" --modes nonoverlapping --output-dir "$OUT/extensions" --cpu --no-progress
  report_extensions=(--extensions "$OUT/extensions/results.json")
fi
stamp "4/4 report -> $OUT/positions.md, $OUT/positions.png, $OUT/positions.csv"
write_report "$OUT/positions.md" python examples/positions/report.py "$OUT/sweep/results.json" \
  "${report_extensions[@]}" --positions "$POSITIONS" --seeds "$SEEDS" --lengths "$LENGTHS" \
  --extension-methods "$EXTENSIONS" --output "$OUT"
stamp "done"
