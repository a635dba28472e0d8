#!/usr/bin/env bash
# Retrieval beyond the training length, in miniature, offline, on CPU
# (the `make retrieval-demo` recipe; docs/retrieval.md has the results).
#
#   1. write a synthetic LongEval-style `lines` corpus: documents of at most
#      L-1 words, each a record of `line KEY : REGISTER_CONTENT is 1 2 3 .`
#      lines, the question about one of them with its answer, then a few of the
#      record's lines repeated (more retrievals to learn from); binarize it;
#   2. train a small ALiBi LM and the stock sinusoidal transformer_lm with
#      identical settings at training length L (they retrieve within L);
#   3. alibi-retrieval --task lines from 1x to 8x L: none, linear and NTK,
#      static and dynamic, over several needle depths.
#
# Resumable like examples/language_model/demo.sh: a finished model (its
# trained.ok) is not retrained, an interrupted one (or one trained for fewer
# than UPDATES) resumes from checkpoint_last.pt, and finished retrieval cells
# of unchanged checkpoints are kept.
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
WARMUP=${WARMUP:-100}
SEED=${SEED:-1}
OUT=${OUT:-outputs/retrieval}
DATA=${DATA:-data-bin/retrieval-L$L}
LENGTHS=${LENGTHS:-1x,1.5x,2x,3x,4x,6x,8x}
METHODS=${METHODS:-none,linear:2,linear:4,linear,ntk:2,ntk:4,ntk}
DEPTHS=${DEPTHS:-5}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
MODELS=${MODELS:-alibi sinusoidal}   # which of the two to train and evaluate
if [ "$PARALLEL" = 1 ]; then TRAIN_THREADS=${TRAIN_THREADS:-1}; else TRAIN_THREADS=${TRAIN_THREADS:-$(nproc)}; fi

start=$(date +%s)
stamp() { echo "[retrieval $(( $(date +%s) - start ))s] $*"; }

if [ ! -f "$DATA/train.bin" ]; then
  stamp "1/3 synthetic lines corpus (L=$L, $KEYS keys, $DIGITS digits, $DOCS documents) -> $DATA"
  python examples/retrieval/corpus.py --destdir "$DATA/raw" --max-length $((L - 1)) \
    --keys "$KEYS" --digits "$DIGITS" --train-docs "$DOCS" --valid-docs 300 --seed "$SEED"
  fairseq-preprocess --only-source --trainpref "$DATA/raw/train.txt" --validpref "$DATA/raw/valid.txt" \
    --destdir "$DATA" --workers 2 > "$DATA/preprocess.log" 2>&1
else
  stamp "1/3 corpus: $DATA already binarized"
fi

train() {  # train NAME ARCH
  local name=$1 arch=$2 dir="$OUT/$1"
  # trained.ok records the UPDATES a finished model was trained for; a larger
  # UPDATES resumes it from checkpoint_last.pt.
  if [ -f "$dir/trained.ok" ] && [ -f "$dir/checkpoint_last.pt" ] && [ "$(cat "$dir/trained.ok")" = "$UPDATES" ]; then
    stamp "$name: already trained ($dir/checkpoint_last.pt, $UPDATES updates)"
    return
  fi
  mkdir -p "$dir"
  stamp "2/3 training $name ($arch, L=$L, $UPDATES updates; log in $dir/train.log)"
  # Identical settings; only the arch (position handling) differs. Each document
  # is a whole line of the corpus (--sample-break-mode complete packs whole
  # documents into blocks of L tokens), so no record is cut from its question.
  OMP_NUM_THREADS=$TRAIN_THREADS MKL_NUM_THREADS=$TRAIN_THREADS alibi-train "$DATA" --task language_modeling \
    --arch "$arch" --decoder-layers "$LAYERS" --decoder-embed-dim "$DIM" --decoder-input-dim "$DIM" \
    --decoder-output-dim "$DIM" --decoder-ffn-embed-dim "$FFN" --decoder-attention-heads "$HEADS" \
    --decoder-normalize-before --share-decoder-input-output-embed \
    --tokens-per-sample "$L" --sample-break-mode complete --max-tokens "$MAX_TOKENS" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 --weight-decay 0.01 \
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-7 \
    --dropout 0.0 --max-update "$UPDATES" --seed "$SEED" \
    --save-dir "$dir" --save-interval-updates 250 --keep-interval-updates 1 --no-epoch-checkpoints \
    --validate-interval-updates 500 --log-format simple --log-interval 50 --num-workers 0 \
    $DEVICE_FLAGS $EXTRA_TRAIN_ARGS >> "$dir/train.log" 2>&1
  echo "$UPDATES" > "$dir/trained.ok"
  stamp "$name: trained"
}

follow() {
  tail -q -n +1 -F --pid=$$ "$OUT/$1/train.log" 2>/dev/null \
    | grep --line-buffered -E "train_inner|valid on|num. shared model params|done training|Error|error" \
    | sed -u "s/^/[$1] /"
}

want() { case " $MODELS " in *" $1 "*) return 0 ;; esac; return 1; }
arch_of() { if [ "$1" = alibi ]; then echo transformer_lm_alibi; else echo transformer_lm; fi; }
followers=() trainers=() checkpoints=()
for name in alibi sinusoidal; do
  want "$name" || continue
  mkdir -p "$OUT/$name"; touch "$OUT/$name/train.log"
  follow "$name" & followers+=($!)
  checkpoints+=(--checkpoint "$name=$OUT/$name/checkpoint_last.pt")
done
[ ${#checkpoints[@]} -gt 0 ] || { echo "MODELS must name alibi and/or sinusoidal" >&2; exit 1; }
trap 'kill ${followers[*]} 2>/dev/null || true' EXIT
for name in alibi sinusoidal; do
  want "$name" || continue
  if [ "$PARALLEL" = 1 ]; then train "$name" "$(arch_of "$name")" & trainers+=($!); else train "$name" "$(arch_of "$name")"; fi
done
for pid in "${trainers[@]}"; do wait "$pid"; done
sleep 1; kill "${followers[@]}" 2>/dev/null || true

stamp "3/3 retrieval: lines at $LENGTHS x {$METHODS}, $DEPTHS depths x $SAMPLES samples -> $OUT/lines"
CPU_FLAG=""; [ "$SCALE" = gpu ] || CPU_FLAG=--cpu
OMP_NUM_THREADS=$(nproc) python -m fairseq_alibi.evaluation.retrieval "$DATA" \
  "${checkpoints[@]}" \
  --task lines --digits "$DIGITS" --lengths "$LENGTHS" --methods "$METHODS" --depths "$DEPTHS" \
  --samples "$SAMPLES" --seed "$SEED" --output-dir "$OUT/lines" $CPU_FLAG --no-progress
# Where plain ALiBi fails: accuracy by needle distance (tokens from the queried
# record to the end of the prompt), with the flattest head's bias -m_min * distance
# there, against the largest distance seen in training (< L).
python - "$OUT/lines/results.json" "$HEADS" "$L" <<'PY'
import json, sys
cells = json.load(open(sys.argv[1]))["cells"]
heads, L = int(sys.argv[2]), int(sys.argv[3])
import math
c = 2 ** int(math.floor(math.log2(heads)))
m_min = min([2 ** (-8 * (i + 1) / c) for i in range(c)] + [2 ** (-8 * (i + 1) / (2 * c)) for i in range(0, 2 * (heads - c), 2)])
print(f"flattest slope m_min = {m_min:.6g}; at the training length L={L}: bias -m_min*L = {-m_min * L:.2f}")
for name in ("alibi", "sinusoidal"):
    rows = sorted((x for x in cells if x["checkpoint"] == name and x["method"] == "none"), key=lambda x: x["needle_distance"])
    if not rows:
        continue
    print(f"{name}, method none: accuracy by needle distance (all lengths and depths, {len(rows)} cells)")
    edges = [0, L // 2, L, 2 * L, 3 * L, 4 * L, 6 * L, 8 * L + 1]
    for lo, hi in zip(edges, edges[1:]):
        sel = [x for x in rows if lo <= x["needle_distance"] < hi]
        if sel:
            k, n = sum(x["correct"] for x in sel), sum(x["n"] for x in sel)
            print(f"  distance {lo:>5}-{hi - 1:<5} accuracy {100 * k / n:5.1f}% (n={n:<4}) flattest-head bias at {hi - 1}: {-m_min * (hi - 1):6.2f}")
PY
stamp "done: table $OUT/lines/results.md, plots $OUT/lines/accuracy.png and depth.png"
