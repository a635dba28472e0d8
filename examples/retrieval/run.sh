#!/usr/bin/env bash
# Retrieval beyond the training length, in miniature, offline, on CPU
# (the `make retrieval-demo` recipe; docs/retrieval.md has the results).
#
#   1. write a synthetic LongEval-style `lines` corpus: documents of at most
#      L-1 words, each a record of `line KEY : REGISTER_CONTENT is 1 2 3 .`
#      lines, the question about one of them with its answer, then a few of the
#      record's lines repeated (more retrievals to learn from); binarize it;
#   2. for each seed in SEEDS, train a small LM of every position method in
#      MODELS (`transformer_lm_<name>`; `sinusoidal` is the stock
#      transformer_lm, trained for the first seed only unless
#      BASELINE_SEEDS=all), all with identical settings at training length L;
#   3. alibi-retrieval --task lines at LENGTHS for each seed, every model under
#      the METHODS that apply to it (the tool names the ones it skips); then
#      examples/retrieval/summary.py puts the seeds side by side, a column per
#      model at each length (mean [min, max] over seeds, pooled Wilson interval).
#
# Two recipes (RECIPE), each a default for MODELS, METHODS, LENGTHS and the
# evaluation's name; any of them can still be set:
#   methods   (default) ALiBi under none, linear and NTK (static and dynamic)
#             and the distance cap at 1x-8x L, the sinusoidal twin as baseline
#             (docs/retrieval.md, "The experiment");
#   families  ALiBi and RoPE side by side, each under its own extension methods
#             (ALiBi: cap, capnorm, power, ntk, linear; RoPE: linear, ntk, yarn)
#             at 1x and 8x L (docs/retrieval.md, "Which method, when"):
#             RECIPE=families examples/retrieval/run.sh
#
# Resumable like examples/language_model/demo.sh: a finished model (its
# trained.ok) is not retrained, an interrupted one (or one trained for fewer
# than UPDATES) resumes from checkpoint_last.pt, and finished retrieval cells
# of unchanged checkpoints are kept.  Both recipes share the models of one OUT.
# Outputs: $OUT/seedS/<model> (checkpoints, logs) and $OUT/seedS/<evaluation>
# per seed (evaluation `lines` for RECIPE=methods, `families` for
# RECIPE=families), and across seeds $OUT/summary.{md,png} (methods) or
# $OUT/summary-families.{md,png}.
# Every setting can be overridden from the environment.  On a GPU, e.g.:
#   SCALE=gpu examples/retrieval/run.sh          (see docs/retrieval.md)
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV_BIN=${VENV_BIN:-.venv/bin}
case "$VENV_BIN" in /*) ;; *) VENV_BIN="$PWD/$VENV_BIN" ;; esac
export PATH="$VENV_BIN:$PATH"
SCALE=${SCALE:-cpu}
if [ "$SCALE" = gpu ]; then
  # Larger: L=512, 4 layers, d=256, more data and updates; one model at a time on the GPU.
  L=${L:-512}; LAYERS=${LAYERS:-4}; DIM=${DIM:-256}; FFN=${FFN:-1024}; UPDATES=${UPDATES:-20000}
  DOCS=${DOCS:-400000}; KEYS=${KEYS:-1024}; MAX_TOKENS=${MAX_TOKENS:-16384}; DEVICE_FLAGS=${DEVICE_FLAGS:-}
  PARALLEL=${PARALLEL:-0}; SAMPLES=${SAMPLES:-50}
else
  L=${L:-128}; LAYERS=${LAYERS:-2}; DIM=${DIM:-128}; FFN=${FFN:-512}; UPDATES=${UPDATES:-1500}
  DOCS=${DOCS:-40000}; KEYS=${KEYS:-256}; MAX_TOKENS=${MAX_TOKENS:-4096}; DEVICE_FLAGS=${DEVICE_FLAGS:---cpu}
  PARALLEL=${PARALLEL:-1}; SAMPLES=${SAMPLES:-20}
fi
HEADS=${HEADS:-8}
DIGITS=${DIGITS:-3}
LR=${LR:-0.003}
# 500 warm-up updates, not 100: with 100 some seeds never leave the loss
# plateau on which the retrieval head has not formed (docs/retrieval.md).
WARMUP=${WARMUP:-500}
SEEDS=${SEEDS:-${SEED:-1 2 3}}   # model seeds (initialization, batch order, evaluation prompts)
CORPUS_SEED=${CORPUS_SEED:-1}    # one corpus for every model seed
OUT=${OUT:-outputs/retrieval}
# A corpus of another seed gets its own directory (an existing one is never taken for it).
if [ "$CORPUS_SEED" = 1 ]; then DATA=${DATA:-data-bin/retrieval-L$L}; else DATA=${DATA:-data-bin/retrieval-L$L-c$CORPUS_SEED}; fi
RECIPE=${RECIPE:-methods}
case "$RECIPE" in
  methods)
    MODELS=${MODELS:-alibi sinusoidal}; METHODS=${METHODS:-none,linear:2,linear,ntk:2,ntk,cap:0.5,cap,cap:2}
    LENGTHS=${LENGTHS:-1x,1.5x,2x,3x,4x,6x,8x}; EVAL=lines; SUMMARY=summary ;;
  families)
    MODELS=${MODELS:-alibi rotary}; METHODS=${METHODS:-none,cap,capnorm,power,ntk:2,ntk,linear:2,linear,yarn:2,yarn:4}
    LENGTHS=${LENGTHS:-1x,8x}; EVAL=families; SUMMARY=summary-families ;;
  *) echo "error: RECIPE=$RECIPE is not a recipe; allowed values: methods, families" >&2; exit 1 ;;
esac
DEPTHS=${DEPTHS:-5}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
BASELINE_SEEDS=${BASELINE_SEEDS:-first}  # sinusoidal for the first seed only, or: all
if [ "$PARALLEL" = 1 ]; then TRAIN_THREADS=${TRAIN_THREADS:-1}; else TRAIN_THREADS=${TRAIN_THREADS:-$(nproc)}; fi

# MODELS: position methods of core.positions (transformer_lm_<name>) or
# sinusoidal (the stock transformer_lm), checked before anything runs.
KNOWN_MODELS="sinusoidal $(python -c 'from fairseq_alibi.core.positions import POSITIONS; print(*POSITIONS)')"
for name in $MODELS; do
  case " $KNOWN_MODELS " in *" $name "*) ;; *)
    echo "error: MODELS names '$name', which is not a position method; allowed values: $KNOWN_MODELS" >&2
    exit 1 ;;
  esac
done
arch_of() { if [ "$1" = sinusoidal ]; then echo transformer_lm; else echo "transformer_lm_$1"; fi; }
jobs_of() {  # the (seed, model) pairs to train, one per line; sinusoidal for the first seed unless BASELINE_SEEDS=all
  local first=1
  for seed in $SEEDS; do
    for name in $(echo $MODELS | tr ' ' '\n' | awk '!seen[$0]++'); do
      if [ "$name" != sinusoidal ] || [ "$first" = 1 ] || [ "$BASELINE_SEEDS" = all ]; then echo "$seed $name"; fi
    done
    first=0
  done
}
[ -n "$(jobs_of)" ] || { echo "error: MODELS must name at least one model and SEEDS at least one seed" >&2; exit 1; }

start=$(date +%s)
stamp() { echo "[retrieval $(( $(date +%s) - start ))s] $*"; }

if [ ! -f "$DATA/train.bin" ]; then
  stamp "1/3 synthetic lines corpus (L=$L, $KEYS keys, $DIGITS digits, $DOCS documents) -> $DATA"
  python examples/retrieval/corpus.py --destdir "$DATA/raw" --max-length $((L - 1)) \
    --keys "$KEYS" --digits "$DIGITS" --train-docs "$DOCS" --valid-docs 300 --seed "$CORPUS_SEED"
  alibi-preprocess --only-source --trainpref "$DATA/raw/train.txt" --validpref "$DATA/raw/valid.txt" \
    --destdir "$DATA" --workers 2 > "$DATA/preprocess.log" 2>&1
else
  stamp "1/3 corpus: $DATA already binarized"
fi

train() {  # train SEED NAME ARCH
  local seed=$1 name=$2 arch=$3 dir="$OUT/seed$1/$2"
  # trained.ok records the UPDATES a finished model was trained for; a larger
  # UPDATES resumes it from checkpoint_last.pt.
  if [ -f "$dir/trained.ok" ] && [ -f "$dir/checkpoint_last.pt" ] && [ "$(cat "$dir/trained.ok")" = "$UPDATES" ]; then
    stamp "seed $seed $name: already trained ($dir/checkpoint_last.pt, $UPDATES updates)"
    return
  fi
  mkdir -p "$dir"
  stamp "2/3 training seed $seed $name ($arch, L=$L, $UPDATES updates, warm-up $WARMUP; log in $dir/train.log)"
  # Identical settings; only the arch (position handling) differs. Each document
  # is a whole line of the corpus (--sample-break-mode complete packs whole
  # documents into blocks of L tokens), so no record is cut from its question.
  touch "$dir/train.log"
  local me=$BASHPID  # this training's shell (inside the pipeline, $BASHPID would be tail's own)
  tail -n 0 -F --pid="$me" "$dir/train.log" 2>/dev/null \
    | grep --line-buffered -E "train_inner|valid on|num. shared model params|done training|Error|error" \
    | sed -u "s/^/[seed$seed $name] /" &
  OMP_NUM_THREADS=$TRAIN_THREADS MKL_NUM_THREADS=$TRAIN_THREADS alibi-train "$DATA" --task language_modeling \
    --arch "$arch" --decoder-layers "$LAYERS" --decoder-embed-dim "$DIM" --decoder-input-dim "$DIM" \
    --decoder-output-dim "$DIM" --decoder-ffn-embed-dim "$FFN" --decoder-attention-heads "$HEADS" \
    --decoder-normalize-before --share-decoder-input-output-embed \
    --tokens-per-sample "$L" --sample-break-mode complete --max-tokens "$MAX_TOKENS" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 --weight-decay 0.01 \
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-7 \
    --dropout 0.0 --max-update "$UPDATES" --seed "$seed" \
    --save-dir "$dir" --save-interval-updates 250 --keep-interval-updates 1 --no-epoch-checkpoints \
    --validate-interval-updates 500 --log-format simple --log-interval 50 --num-workers 0 \
    $DEVICE_FLAGS $EXTRA_TRAIN_ARGS >> "$dir/train.log" 2>&1 || {
    local status=$?  # the trainer's own error line (alibi-train prints one), with where the rest is
    echo "error: training seed $seed $name failed (exit $status): $(grep '^error: ' "$dir/train.log" | tail -n 1 | cut -c8-)" \
      "(log: $dir/train.log)" >&2
    return 1
  }
  echo "$UPDATES" > "$dir/trained.ok"
  stamp "seed $seed $name: trained (valid $(grep -o "valid on 'valid' subset | loss [0-9.]*" "$dir/train.log" | tail -1 | grep -o 'loss [0-9.]*'))"
}

# At most $(nproc) trainings at once with PARALLEL=1 (one thread each), else one at a time.
slots=1; [ "$PARALLEL" = 1 ] && slots=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # cores (nproc alone obeys OMP_NUM_THREADS)
failed() {  # a training failed (it said why): stop the others, exit 1
  kill $(jobs -p) 2>/dev/null || true
  exit 1
}
running=0
while read -r seed name; do
  if [ "$running" -ge "$slots" ]; then wait -n || failed; running=$((running - 1)); fi
  train "$seed" "$name" "$(arch_of "$name")" & running=$((running + 1))
done < <(jobs_of)
while [ "$running" -gt 0 ]; do wait -n || failed; running=$((running - 1)); done

CPU_FLAG=""; [ "$SCALE" = gpu ] || CPU_FLAG=--cpu
summaries=()
for seed in $SEEDS; do
  checkpoints=() names=()
  while read -r _ name; do
    checkpoints+=(--checkpoint "$name=$OUT/seed$seed/$name/checkpoint_last.pt") names+=("$name")
  done < <(jobs_of | awk -v seed="$seed" '$1 == seed')
  [ ${#checkpoints[@]} -gt 0 ] || continue
  stamp "3/3 retrieval, seed $seed: lines at $LENGTHS x {$METHODS} on {${names[*]}}, $DEPTHS depths x $SAMPLES samples -> $OUT/seed$seed/$EVAL"
  OMP_NUM_THREADS=${EVAL_THREADS:-$(nproc)} python -m fairseq_alibi.evaluation.retrieval "$DATA" \
    "${checkpoints[@]}" \
    --task lines --digits "$DIGITS" --lengths "$LENGTHS" --methods "$METHODS" --depths "$DEPTHS" \
    --samples "$SAMPLES" --seed "$seed" --output-dir "$OUT/seed$seed/$EVAL" $CPU_FLAG --no-progress
  summaries+=("seed$seed=$OUT/seed$seed/$EVAL/results.json")
done
# Across seeds, a column per model at each length, then each model's accuracy by
# needle distance (tokens from the queried record to the end of the prompt).
python examples/retrieval/summary.py "${summaries[@]}" --plot "$OUT/$SUMMARY.png" | tee "$OUT/$SUMMARY.md"
stamp "done: per seed $OUT/seed*/$EVAL/results.md (plots accuracy.png, depth.png); across seeds $OUT/$SUMMARY.md, $OUT/$SUMMARY.png"
