#!/usr/bin/env bash
# "Train short, test long" in miniature, offline, on CPU (the `make demo` recipe).
#
#   1. build the embedded corpus (CPython's own documentation, ~0.9M tokens);
#   2. train a small ALiBi LM and the stock sinusoidal transformer_lm with
#      identical settings (sizes, pre-norm, seed, batch, updates, lr) at a
#      short training length L;
#   3. sweep both from 1x to 16x L (nonoverlapping valid perplexity; ALiBi also
#      with linear / NTK slope interpolation), print the table, write the plots.
#
# Resumable: the corpus step is a no-op when done; a finished model (marked by
# its `trained.ok`) is not retrained, an interrupted one resumes from
# checkpoint_last.pt; sweep cells already in results.json are skipped.
# Every setting below can be overridden from the environment, e.g.
#   UPDATES=800 OUT=outputs/demo800 examples/language_model/demo.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV_BIN=${VENV_BIN:-.venv/bin}
export PATH="$PWD/$VENV_BIN:$PATH"
DATA=${DATA:-data-bin/embedded}
OUT=${OUT:-outputs/demo}
L=${L:-64}                  # training length (tokens per sample)
LAYERS=${LAYERS:-2}
DIM=${DIM:-128}
FFN=${FFN:-512}
HEADS=${HEADS:-8}
UPDATES=${UPDATES:-1200}
MAX_TOKENS=${MAX_TOKENS:-2048}   # 32 sequences of 64 tokens per update
LR=${LR:-0.002}
WARMUP=${WARMUP:-100}
DROPOUT=${DROPOUT:-0.1}
SEED=${SEED:-1}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}   # more fairseq-train flags, for both models
LENGTHS=${LENGTHS:-1x,2x,4x,8x,16x}
METHODS=${METHODS:-none,linear:2,linear,ntk:2,ntk,cap:0.5,cap,cap:2}
# The two models train side by side, one thread each (small matrices: two
# single-threaded processes use two cores better than one process with two
# threads); PARALLEL=0 trains them one after the other with all cores.
PARALLEL=${PARALLEL:-1}
if [ "$PARALLEL" = 1 ]; then TRAIN_THREADS=${TRAIN_THREADS:-1}; else TRAIN_THREADS=${TRAIN_THREADS:-$(nproc)}; fi

start=$(date +%s)
stamp() { echo "[demo $(( $(date +%s) - start ))s] $*"; }

stamp "1/3 corpus -> $DATA"
python -m fairseq_alibi.corpus --destdir "$DATA"

train() {  # train NAME ARCH
  local name=$1 arch=$2 dir="$OUT/$1"
  if [ -f "$dir/trained.ok" ] && [ -f "$dir/checkpoint_last.pt" ]; then
    stamp "$name: already trained ($dir/checkpoint_last.pt)"
    return
  fi
  mkdir -p "$dir"
  stamp "2/3 training $name ($arch, L=$L, $UPDATES updates; log also in $dir/train.log)"
  # Identical settings for both models; only the arch (position handling) differs.
  # decoder-input/output-dim must equal decoder-embed-dim, or fairseq adds
  # 512-wide projections to the sinusoidal model.
  OMP_NUM_THREADS=$TRAIN_THREADS MKL_NUM_THREADS=$TRAIN_THREADS alibi-train "$DATA" --task language_modeling --arch "$arch" \
    --decoder-layers "$LAYERS" --decoder-embed-dim "$DIM" --decoder-input-dim "$DIM" \
    --decoder-output-dim "$DIM" --decoder-ffn-embed-dim "$FFN" --decoder-attention-heads "$HEADS" \
    --decoder-normalize-before --share-decoder-input-output-embed \
    --tokens-per-sample "$L" --sample-break-mode none --max-tokens "$MAX_TOKENS" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 --weight-decay 0.01 \
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-7 \
    --dropout "$DROPOUT" --max-update "$UPDATES" --seed "$SEED" \
    --save-dir "$dir" --save-interval-updates 100 --keep-interval-updates 1 --no-epoch-checkpoints \
    --validate-after-updates "$UPDATES" \
    --log-format simple --log-interval 25 --num-workers 0 --cpu $EXTRA_TRAIN_ARGS \
    >> "$dir/train.log" 2>&1
  touch "$dir/trained.ok"
  stamp "$name: trained"
}

# Show fairseq's progress lines of both runs, prefixed with the model name.
follow() {
  tail -q -n +1 -F --pid=$$ "$OUT/$1/train.log" 2>/dev/null \
    | grep --line-buffered -E "train_inner|valid on|num. shared model params|done training|Error|error" \
    | sed -u "s/^/[$1] /"
}

mkdir -p "$OUT/alibi" "$OUT/sinusoidal"
touch "$OUT/alibi/train.log" "$OUT/sinusoidal/train.log"
follow alibi & f1=$!
follow sinusoidal & f2=$!
trap 'kill $f1 $f2 2>/dev/null || true' EXIT
if [ "$PARALLEL" = 1 ]; then
  train alibi transformer_lm_alibi & p1=$!
  train sinusoidal transformer_lm & p2=$!
  wait $p1; wait $p2
else
  train alibi transformer_lm_alibi
  train sinusoidal transformer_lm
fi
sleep 1; kill $f1 $f2 2>/dev/null || true

stamp "3/3 sweep $LENGTHS x {$METHODS} -> $OUT/sweep"
alibi-sweep "$DATA" --checkpoint alibi="$OUT/alibi/checkpoint_last.pt" \
  --checkpoint sinusoidal="$OUT/sinusoidal/checkpoint_last.pt" \
  --lengths "$LENGTHS" --methods "$METHODS" --modes nonoverlapping \
  --per-position --output-dir "$OUT/sweep" --cpu

python - "$OUT/sweep/results.json" <<'EOF'
import json, sys
cells = json.load(open(sys.argv[1]))["cells"]
ppl = {(c["checkpoint"], c["label"], c["length_ratio"]): c["ppl"] for c in cells if c["mode"] == "nonoverlapping"}
for name in ("alibi", "sinusoidal"):
    base, at8 = ppl.get((name, "none", 1.0)), ppl.get((name, "none", 8.0))
    if base and at8:
        print(f"{name:>10}: ppl {base:.2f} at 1x, {at8:.2f} at 8x (ratio {at8 / base:.3f})")
EOF
stamp "done: table $OUT/sweep/results.md, plot $OUT/sweep/perplexity.png"
