#!/usr/bin/env bash
# The paper's comparison, and the field's, in miniature (the `make compare` recipe):
# every position method trained identically, swept from 1x to 16x L.
#
#   1. the embedded corpus (as `make demo`);
#   2. for each seed in SEEDS and each method in POSITIONS: a small LM trained
#      with the demo's settings at L tokens, only the arch differing
#      (transformer_lm = sinusoidal, transformer_lm_<method> for the others);
#   3. alibi-sweep over every model from 1x to 16x L (nonoverlapping valid
#      perplexity), then the extension methods on the two families that have
#      them (ALiBi: cap, capnorm, power, ntk; RoPE: linear, ntk, yarn);
#   4. examples/positions/report.py: the figure (perplexity against evaluation
#      length, one line per method, a band over seeds) and the tables.
#
# The speed/memory table is benchmarks/positions_cost.py (docs/positions.md).
# Resumable like demo.sh: a finished model (its trained.ok) is not retrained,
# an interrupted one resumes from checkpoint_last.pt, swept cells are kept.
# Every setting can be overridden from the environment, e.g.
#   SEEDS="1" UPDATES=200 POSITIONS="alibi rotary" OUT=outputs/compare-small examples/positions/compare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV_BIN=${VENV_BIN:-.venv/bin}
case "$VENV_BIN" in /*) ;; *) VENV_BIN="$PWD/$VENV_BIN" ;; esac
export PATH="$VENV_BIN:$PATH"
DATA=${DATA:-data-bin/embedded}
OUT=${OUT:-outputs/compare}
L=${L:-64}
LAYERS=${LAYERS:-2}
DIM=${DIM:-128}
FFN=${FFN:-512}
HEADS=${HEADS:-8}
UPDATES=${UPDATES:-1200}
MAX_TOKENS=${MAX_TOKENS:-2048}
LR=${LR:-0.002}
WARMUP=${WARMUP:-100}
DROPOUT=${DROPOUT:-0.1}
SEEDS=${SEEDS:-1 2 3}
POSITIONS=${POSITIONS:-sinusoidal alibi rotary t5bias nope kerple fire}
LENGTHS=${LENGTHS:-1x,2x,4x,8x,16x}
EXTENSIONS=${EXTENSIONS:-none,cap,capnorm,power,ntk:2,ntk,linear:2,linear,yarn:2,yarn:4}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
PARALLEL=${PARALLEL:-1}
if [ "$PARALLEL" = 1 ]; then TRAIN_THREADS=${TRAIN_THREADS:-1}; else TRAIN_THREADS=${TRAIN_THREADS:-$(nproc)}; fi

start=$(date +%s)
stamp() { echo "[compare $(( $(date +%s) - start ))s] $*"; }
arch_of() { if [ "$1" = sinusoidal ]; then echo transformer_lm; else echo "transformer_lm_$1"; fi; }

if [ -f "$DATA/train.bin" ] && [ -f "$DATA/valid.bin" ]; then
  stamp "1/4 corpus: $DATA already binarized"
else
  stamp "1/4 corpus -> $DATA"
  python -m fairseq_alibi.corpus --destdir "$DATA"
fi

train() {  # train SEED NAME
  local seed=$1 name=$2 dir="$OUT/seed$1/$2"
  if [ -f "$dir/trained.ok" ] && [ -f "$dir/checkpoint_last.pt" ] && [ "$(cat "$dir/trained.ok")" = "$UPDATES" ]; then
    stamp "seed $seed $name: already trained"
    return
  fi
  mkdir -p "$dir"
  stamp "2/4 training seed $seed $name ($(arch_of "$name"), L=$L, $UPDATES updates; log in $dir/train.log)"
  # The demo's settings for every method; only the arch differs.
  OMP_NUM_THREADS=$TRAIN_THREADS MKL_NUM_THREADS=$TRAIN_THREADS alibi-train "$DATA" --task language_modeling \
    --arch "$(arch_of "$name")" --decoder-layers "$LAYERS" --decoder-embed-dim "$DIM" --decoder-input-dim "$DIM" \
    --decoder-output-dim "$DIM" --decoder-ffn-embed-dim "$FFN" --decoder-attention-heads "$HEADS" \
    --decoder-normalize-before --share-decoder-input-output-embed \
    --tokens-per-sample "$L" --sample-break-mode none --max-tokens "$MAX_TOKENS" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 --weight-decay 0.01 \
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-7 \
    --dropout "$DROPOUT" --max-update "$UPDATES" --seed "$seed" \
    --save-dir "$dir" --save-interval-updates 100 --keep-interval-updates 1 --no-epoch-checkpoints \
    --validate-after-updates "$UPDATES" --log-format simple --log-interval 100 --num-workers 0 --cpu \
    $EXTRA_TRAIN_ARGS >> "$dir/train.log" 2>&1 || {
    local status=$?  # the trainer's own error line (alibi-train prints one), with where the rest is
    echo "error: training seed $seed $name failed (exit $status): $(grep '^error: ' "$dir/train.log" | tail -n 1 | cut -c8-)" \
      "(log: $dir/train.log)" >&2
    return 1
  }
  echo "$UPDATES" > "$dir/trained.ok"
  stamp "seed $seed $name: trained"
}

failed() {  # a training failed (it said why): stop the others, exit 1
  kill $(jobs -p) 2>/dev/null || true
  exit 1
}
slots=1; [ "$PARALLEL" = 1 ] && slots=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # cores (nproc alone obeys OMP_NUM_THREADS)
running=0
for seed in $SEEDS; do
  for name in $POSITIONS; do
    if [ "$running" -ge "$slots" ]; then wait -n || failed; running=$((running - 1)); fi
    train "$seed" "$name" & running=$((running + 1))
  done
done
while [ "$running" -gt 0 ]; do wait -n || failed; running=$((running - 1)); done

checkpoints=() extended=()
for seed in $SEEDS; do
  for name in $POSITIONS; do
    checkpoints+=(--checkpoint "${name}_s$seed=$OUT/seed$seed/$name/checkpoint_last.pt")
    case $name in alibi|rotary) extended+=(--checkpoint "${name}_s$seed=$OUT/seed$seed/$name/checkpoint_last.pt") ;; esac
  done
done
stamp "3/4 sweep: every model at $LENGTHS -> $OUT/sweep"
OMP_NUM_THREADS=${EVAL_THREADS:-$(nproc)} alibi-sweep "$DATA" "${checkpoints[@]}" --lengths "$LENGTHS" \
  --methods none --modes nonoverlapping --output-dir "$OUT/sweep" --cpu --no-progress
if [ ${#extended[@]} -gt 0 ]; then
  stamp "3/4 sweep: extension methods {$EXTENSIONS} on alibi and rotary -> $OUT/extensions"
  OMP_NUM_THREADS=${EVAL_THREADS:-$(nproc)} alibi-sweep "$DATA" "${extended[@]}" --lengths "$LENGTHS" \
    --methods "$EXTENSIONS" --modes nonoverlapping --output-dir "$OUT/extensions" --cpu --no-progress
fi
stamp "4/4 report -> $OUT/positions.md, $OUT/positions.png"
python examples/positions/report.py "$OUT/sweep/results.json" --extensions "$OUT/extensions/results.json" \
  --output "$OUT" | tee "$OUT/positions.md"
stamp "done"
