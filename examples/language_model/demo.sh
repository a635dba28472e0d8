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
# Resumable (examples/lib.sh): the corpus step is a no-op when done; a finished
# model (its `trained.ok`) is not retrained, an interrupted one (Ctrl-C) resumes
# from its last saved update (every SAVE_EVERY updates) when the same command is
# run again; sweep cells already in results.json are skipped.  A training that
# fails ends the demo with one `error:` line (the model, the trainer's reason, its
# log) and exit status 1.
# Every setting below can be overridden from the environment, e.g.
#   UPDATES=800 OUT=outputs/demo800 examples/language_model/demo.sh
cd "$(dirname "$0")/../.."
RECIPE_TAG=demo
source examples/lib.sh

DATA=${DATA:-data-bin/embedded}
# The embedded corpus's valid/test paragraphs that train holds: drop (default) or keep (the corpus
# before 2026-12-02).
HELD_OUT_OVERLAP=${HELD_OUT_OVERLAP:-drop}
OUT=${OUT:-outputs/demo}
L=${L:-64}                  # training length (tokens per sample)
LAYERS=${LAYERS:-2}
DIM=${DIM:-128}
FFN=${FFN:-512}
HEADS=${HEADS:-8}
UPDATES=${UPDATES:-1200}
SAVE_EVERY=${SAVE_EVERY:-100}
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
training_threads
fresh_report "$OUT/sweep/results.md" "$OUT/sweep/perplexity.png" "$OUT/sweep/per_position.png"

stamp "1/3 corpus -> $DATA"
python -m fairseq_alibi.corpus --destdir "$DATA" --as-built --held-out-overlap "$HELD_OUT_OVERLAP"

train() {  # train NAME: identical settings for both models; only the arch (position handling) differs
  local name=$1
  lm_train_args "$name"
  # shellcheck disable=SC2086  # EXTRA_TRAIN_ARGS: the words as typed
  train_model "$OUT/$name" "$name" "$(arch_of "$name"), L=$L, $UPDATES updates" "$DATA" "${LM_ARGS[@]}" \
    --sample-break-mode none --dropout "$DROPOUT" --seed "$SEED" --log-format simple --log-interval 25 \
    --cpu $EXTRA_TRAIN_ARGS
}
# fairseq's progress lines of both runs are shown, prefixed with the model name.
TRAIN_STEP=2/3 FOLLOW="train_inner|valid on|num. shared model params|done training|Error|error" \
  run_trainings train < <(printf '%s\n' alibi sinusoidal)

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
