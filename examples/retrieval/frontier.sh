#!/usr/bin/env bash
# The retrieval-perplexity frontier of the context-extension methods
# (docs/results/retrieval-frontier.md; the advice: docs/retrieval.md, "Which method, when"): every method of a grid on
#   * retrieval: `lines` and `passkey` from 1x to 8x L, every seed of the
#     retrieval recipe (examples/retrieval/run.sh) on two corpora: TUNE seeds
#     (parameters are chosen on them) and REPORT seeds (the numbers shown);
#   * perplexity to 16x L with per-position losses: the same retrieval models
#     on their own held-out text, and the demo models
#     (examples/language_model/demo.sh, real English) on their test split;
# then examples/retrieval/frontier.py draws retrieval at 8x against the
# perplexity cost at 16x, with intervals, and writes the tables.
#
# The models are trained by the recipes themselves (resumable; a trained model
# is reused): this script calls them with MODELS=alibi and evaluates nothing
# twice (every tool resumes from its results.json).
#
#   examples/retrieval/frontier.sh                # everything, about 3 CPU hours on 2 cores
#   STEP=evaluate examples/retrieval/frontier.sh  # only the evaluations (models trained)
cd "$(dirname "$0")/../.."
RECIPE_TAG=frontier
source examples/lib.sh  # the preamble (VENV_BIN, strict mode, Ctrl-C) and stamp
OUT=${OUT:-outputs/frontier}
STEP=${STEP:-all}
# Retrieval models: TUNE seeds on the recipe's corpus, REPORT seeds on a corpus the docs never used.
TUNE_SEEDS=${TUNE_SEEDS:-1 2}
TUNE_CORPUS=${TUNE_CORPUS:-1}
REPORT_SEEDS=${REPORT_SEEDS:-31 32 33 34 35}
REPORT_CORPUS=${REPORT_CORPUS:-5}
DEMO_SEEDS=${DEMO_SEEDS:-1 2}
L=${L:-128}
DIGITS=${DIGITS:-3}
# The grid: every candidate on the tune side; the report side takes the informative ones (default: the same).
METHODS=${METHODS:-none,ntk,ntk:2,cap,cap:2,cap:4,log:1:0.25,log:1:0.5,log:1:1,power:1:0.5,power:1:1,power:1:1.5,power:1:2,capnorm:0.5,capnorm,capnorm:2}
REPORT_METHODS=${REPORT_METHODS:-$METHODS}
LENGTHS=${LENGTHS:-1x,2x,4x,8x}
DEPTHS=${DEPTHS:-5}
SAMPLES=${SAMPLES:-20}   # per (length, depth): 100 prompts per length
PPL_LENGTHS=${PPL_LENGTHS:-1x,2x,4x,8x,16x}
THREADS=${THREADS:-$(nproc)}

corpus_dir() { echo "$OUT/retrieval-c$1"; }
data_dir() { echo "$OUT/data/retrieval-c$1"; }

if [ "$STEP" != evaluate ]; then
  stamp "training: retrieval seeds $TUNE_SEEDS (corpus $TUNE_CORPUS) and $REPORT_SEEDS (corpus $REPORT_CORPUS), demo seeds $DEMO_SEEDS"
  for pair in "$TUNE_CORPUS:$TUNE_SEEDS" "$REPORT_CORPUS:$REPORT_SEEDS"; do
    corpus=${pair%%:*}; seeds=${pair#*:}
    # the recipe's own evaluation is skipped here (one trivial cell): this script evaluates below
    SEEDS="$seeds" CORPUS_SEED=$corpus MODELS=alibi OUT=$(corpus_dir "$corpus") DATA=$(data_dir "$corpus") \
      METHODS=none LENGTHS=1x DEPTHS=1 SAMPLES=1 VENV_BIN="$VENV_BIN" examples/retrieval/run.sh
  done
  for seed in $DEMO_SEEDS; do
    SEED=$seed OUT=$OUT/demo-s$seed DATA=$OUT/data/embedded METHODS=none LENGTHS=1x \
      VENV_BIN="$VENV_BIN" examples/language_model/demo.sh
  done
fi

PASSKEY=(--task passkey --filler dictionary
         --template "header=below is a record of lines i want you to remember ."
         --template "needle=line k1 : REGISTER_CONTENT is {number} ."
         --template "question=now the record is over . tell me the REGISTER_CONTENT in line k1 . line k1 : REGISTER_CONTENT is")
for side in tune report; do
  if [ $side = tune ]; then corpus=$TUNE_CORPUS; seeds=$TUNE_SEEDS; grid=$METHODS
  else corpus=$REPORT_CORPUS; seeds=$REPORT_SEEDS; grid=$REPORT_METHODS; fi
  dir=$(corpus_dir "$corpus"); data=$(data_dir "$corpus")
  checkpoints=()
  for seed in $seeds; do
    ckpt="$dir/seed$seed/alibi/checkpoint_last.pt"
    checkpoints+=(-c "seed$seed=$ckpt")
    for task in lines passkey; do
      stamp "retrieval: corpus $corpus seed $seed $task at $LENGTHS x {$grid}"
      args=(--task lines); [ "$task" = passkey ] && args=("${PASSKEY[@]}")
      OMP_NUM_THREADS=$THREADS alibi-retrieval "$data" -c "alibi=$ckpt" "${args[@]}" --digits "$DIGITS" \
        --lengths "$LENGTHS" --methods "$grid" --depths "$DEPTHS" --samples "$SAMPLES" --seed "$seed" \
        --output-dir "$dir/seed$seed/$task" --cpu --no-progress
    done
  done
  stamp "perplexity: corpus $corpus retrieval models at $PPL_LENGTHS x {$grid}"
  OMP_NUM_THREADS=$THREADS alibi-sweep "$data" "${checkpoints[@]}" --lengths "$PPL_LENGTHS" --methods "$grid" \
    --modes nonoverlapping --per-position --output-dir "$dir/sweep" --cpu --no-progress
done
demo=()
for seed in $DEMO_SEEDS; do demo+=(-c "demo-s$seed=$OUT/demo-s$seed/alibi/checkpoint_last.pt"); done
stamp "perplexity: demo models (test split) at $PPL_LENGTHS x {$METHODS}"
OMP_NUM_THREADS=$THREADS alibi-sweep "$OUT/data/embedded" "${demo[@]}" --subset test --lengths "$PPL_LENGTHS" \
  --methods "$METHODS" --modes nonoverlapping --per-position --output-dir "$OUT/demo-sweep" --cpu --no-progress

for pair in "$TUNE_CORPUS:$TUNE_SEEDS" "$REPORT_CORPUS:$REPORT_SEEDS"; do
  corpus=${pair%%:*}; seeds=${pair#*:}; dir=$(corpus_dir "$corpus")
  for task in lines passkey; do  # by length and by needle distance, across seeds
    runs=(); for seed in $seeds; do runs+=("seed$seed=$dir/seed$seed/$task/results.json"); done
    python examples/retrieval/summary.py "${runs[@]}" --checkpoint alibi --plot "$dir/summary-$task.png" \
      > "$dir/summary-$task.md"
  done
done
stamp "frontier: tuned on seeds $TUNE_SEEDS, reported on $REPORT_SEEDS"
python examples/retrieval/frontier.py --methods "$METHODS" \
  --tune "$(corpus_dir "$TUNE_CORPUS")" --tune-seeds "$TUNE_SEEDS" \
  --report "$(corpus_dir "$REPORT_CORPUS")" --report-seeds "$REPORT_SEEDS" \
  --demo-sweep "$OUT/demo-sweep/results.json" --output "$OUT/frontier" | tee "$OUT/frontier.md"
stamp "done: $OUT/frontier.md, $OUT/frontier/frontier.png"
