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
#      model at each length (mean [min, max] over seeds, pooled Wilson interval);
#      with PASSKEY=1 also the passkey at 1x (one record in filler), and with
#      FILLER_SHARE=P a share P of the training documents hold filler too
#      (of key words, or with FILLER_WORDS=non-keys of words that are no key).
#
# Three recipes (RECIPE), each a default for MODELS, METHODS, LENGTHS and the
# evaluation's name; any of them can still be set:
#   methods   (default) ALiBi under none, linear and NTK (static and dynamic)
#             and the distance cap at 1x-8x L, the sinusoidal twin as baseline
#             (docs/results/retrieval-demo.md);
#   families  ALiBi and RoPE side by side, each under its own extension methods
#             (ALiBi: cap, capnorm, power, ntk, linear; RoPE: linear, ntk, yarn)
#             at 1x and 8x L (docs/results/retrieval-alibi-rope.md):
#             RECIPE=families examples/retrieval/run.sh
#   every-family  every position method of the registry, each with the
#             settings under which it learned both `lines` and the passkey
#             within L here (docs/results/retrieval-every-family-recipe.md): records `line KEY N .` (LAYOUT=adjacent),
#             filler in a quarter of the training documents, PASSKEY=1, and per
#             family EXTRA_TRAIN_ARGS_<model>, UPDATES_<model>, LAYERS_<model>
#             and RoPE's filler in a tenth (FILLER_SHARE_rotary, below); then
#             every extension method at 1x-8x L.
#
# Per model (any recipe): EXTRA_TRAIN_ARGS_<model> (e.g. EXTRA_TRAIN_ARGS_fox)
# reach that model's trainer alone, after EXTRA_TRAIN_ARGS; UPDATES_<model>
# and LAYERS_<model> replace UPDATES and LAYERS for it (e.g. UPDATES_rotary=10000);
# FILLER_SHARE_<model> trains it on a corpus of its own, the same seed's records with that share of
# filler documents, binarized with the dictionary of the run's corpus (the checks and the evaluation
# read that one): a corpus whose words that dictionary lacks is refused.
#
# Until it retrieves (any recipe; every-family's default UNTIL=90): with UNTIL=P
# each model trains in stages of CHECK_EVERY updates (default 1500) up to its
# UPDATES, now a budget, and after each stage answers `lines` at 1x L (and the
# passkey with PASSKEY=1; $OUT/seedS/<model>/checks/<updates>, prompts of their own); it stops
# at the first stage where every task reaches P% (its checks in $OUT/seedS/<model>/checks.tsv),
# and the updates each model took, with every check, go to $OUT/stages.{md,png}
# (examples/retrieval/stages.py). UNTIL= (empty) trains every model to its UPDATES.
# Restarts (with UNTIL): RESTART_AT=U (or RESTART_AT_<model>, for one model) starts a model again from
# scratch when its `lines` check at U updates (a stage: a multiple of CHECK_EVERY below its budget) is
# below RESTART_BELOW% (default 10), under another training seed (the seed plus 10000 per restart: other
# initial weights and batch order; the corpus and every prompt stay the seed's), at most RESTARTS times
# (default 3); each discarded attempt is kept whole in $OUT/seedS/restarts/<model>.N and shown in stages.md.
# every-family sets RESTART_AT_rotary=3000 and RESTARTS=6: RoPE's own-key head forms by 3,000-4,500
# updates on about one run in four, late or never on the others (docs/results/retrieval-rope-lottery.md).
#
# Resumable (examples/lib.sh): a finished model (its trained.ok) is not
# retrained, an interrupted one (Ctrl-C; or one trained for fewer than UPDATES)
# resumes from its last saved update (every SAVE_EVERY updates) when the same
# command is run again, and finished retrieval cells of unchanged checkpoints
# are kept.  The recipes share the models of one OUT.  A training that fails
# ends the recipe with one `error:` line (the run, the trainer's reason, its log)
# and exit status 1, the other trainings stopped.  The METHODS of a recipe's
# default that apply to none of the MODELS are left out (any subset of models
# runs); a METHODS given that holds such a method is refused before anything runs.
# Outputs: $OUT/seedS/<model> (checkpoints, logs) and $OUT/seedS/<evaluation>
# per seed (evaluation `lines` for RECIPE=methods, `families` for
# RECIPE=families and every-family), and across seeds $OUT/summary.{md,png} (methods) or
# $OUT/summary-families.{md,png}, removed when a run starts, written at its end.
# Every setting can be overridden from the environment.  On a GPU, e.g.:
#   SCALE=gpu examples/retrieval/run.sh          (see docs/results/retrieval-demo.md, "Limits")
cd "$(dirname "$0")/../.."
RECIPE_TAG=retrieval
source examples/lib.sh

RECIPE=${RECIPE:-methods}
case "$RECIPE" in
  methods)
    MODELS=${MODELS:-alibi sinusoidal}; DEFAULT_METHODS=none,linear:2,linear,ntk:2,ntk,cap:0.5,cap,cap:2
    LENGTHS=${LENGTHS:-1x,1.5x,2x,3x,4x,6x,8x}; EVAL=lines; SUMMARY=summary ;;
  families)
    MODELS=${MODELS:-alibi rotary}; DEFAULT_METHODS=$DEFAULT_EXTENSIONS
    LENGTHS=${LENGTHS:-1x,8x}; EVAL=families; SUMMARY=summary-families ;;
  every-family)
    # What each family needed to learn both tasks within L on three seeds
    # (docs/results/retrieval-every-family-recipe.md):
    # ALiBi the recipe's 1,500 updates; FIRE, Kerple and FoX 3,000, T5 and RNoPE 4,500; T5's table started at
    # ALiBi's bias, FoX at ALiBi's slopes with its gate weights held at zero for the first 1,000
    # updates, RNoPE with a window narrower than a record. NoPE: a third layer (its first cannot prefer
    # a near key) and more updates (both tasks at 10,500 on seed 60). RoPE: more updates, and filler in a
    # tenth of its documents (a quarter held it back; a tenth: both at 4,500 on seed 60), its own corpus.
    MODELS=${MODELS:-$(models | cut -d' ' -f2-)}; DEFAULT_METHODS=$DEFAULT_EXTENSIONS
    LENGTHS=${LENGTHS:-1x,2x,4x,8x}; EVAL=families; SUMMARY=summary-families
    # RoPE's corpus of its own (a FILLER_SHARE given is every model's, RoPE's too, unless
    # FILLER_SHARE_rotary is given as well)
    [ -n "${FILLER_SHARE:-}" ] || FILLER_SHARE_rotary=${FILLER_SHARE_rotary-0.1}
    LAYOUT=${LAYOUT:-adjacent}; FILLER_SHARE=${FILLER_SHARE:-0.25}; PASSKEY=${PASSKEY:-1}
    EXTRA_TRAIN_ARGS_t5bias=${EXTRA_TRAIN_ARGS_t5bias---t5-init-slopes 1}
    EXTRA_TRAIN_ARGS_fox=${EXTRA_TRAIN_ARGS_fox---fox-init-slopes 1 --fox-gate-init-std 0 --fox-weight-delay 1000}
    EXTRA_TRAIN_ARGS_rnope=${EXTRA_TRAIN_ARGS_rnope---rnope-window 8}
    # Each family until it answers 90% of both tasks, checked every 1,500 updates: on three seeds
    # ALiBi took 1,500, FIRE, Kerple and FoX up to 3,000, T5 and RNoPE up to 4,500 (by seed, not family).
    UNTIL=${UNTIL-90}; UPDATES=${UPDATES:-4500}
    # NoPE rises late and slowly: 90% of both at 9,000-12,000 updates on three seeds, at 18,000 on a
    # fourth (73% of `lines` at 12,000), not by 12,000 on a fifth (81%, still rising): a budget of 24,000.
    UPDATES_rotary=${UPDATES_rotary-12000}; UPDATES_nope=${UPDATES_nope-24000}; LAYERS_nope=${LAYERS_nope-3}
    # RoPE forms its own-key head by 4,500 updates on about one run in four; a run below 10% `lines` at
    # 3,000 forms it late (3 of 7 by 12,000) or not at all, and on average a new draw finds it sooner
    # (docs/results/retrieval-rope-lottery.md, retrieval-restart-or-train-on.md), so it starts again under another seed,
    # up to six times, the last draw then training on to its budget (where it trains in stages past
    # 3,000; RESTART_AT_rotary= (empty) trains every draw to its budget).
    if [ -n "$UNTIL" ] && [ "${UPDATES_rotary:-$UPDATES}" -gt 3000 ] 2>/dev/null; then
      RESTART_AT_rotary=${RESTART_AT_rotary-3000}
    fi
    RESTARTS=${RESTARTS:-6} ;;
  *) echo "error: RECIPE=$RECIPE is not a recipe; allowed values: methods, families, every-family" >&2; exit 1 ;;
esac

SCALE=${SCALE:-cpu}
if [ "$SCALE" = gpu ]; then
  # Larger: L=512, 4 layers, d=256, more data and updates; one model at a time on the GPU.
  L=${L:-512}; LAYERS=${LAYERS:-4}; DIM=${DIM:-256}; FFN=${FFN:-1024}; UPDATES=${UPDATES:-20000}
  DEFAULT_DOCS=400000; DEFAULT_KEYS=1024; DOCS=${DOCS:-$DEFAULT_DOCS}; KEYS=${KEYS:-$DEFAULT_KEYS}; MAX_TOKENS=${MAX_TOKENS:-16384}; DEVICE_FLAGS=${DEVICE_FLAGS:-}
  PARALLEL=${PARALLEL:-0}; SAMPLES=${SAMPLES:-50}
else
  L=${L:-128}; LAYERS=${LAYERS:-2}; DIM=${DIM:-128}; FFN=${FFN:-512}; UPDATES=${UPDATES:-1500}
  DEFAULT_DOCS=40000; DEFAULT_KEYS=256; DOCS=${DOCS:-$DEFAULT_DOCS}; KEYS=${KEYS:-$DEFAULT_KEYS}; MAX_TOKENS=${MAX_TOKENS:-4096}; DEVICE_FLAGS=${DEVICE_FLAGS:---cpu}
  PARALLEL=${PARALLEL:-1}; SAMPLES=${SAMPLES:-20}
fi
HEADS=${HEADS:-8}
DIGITS=${DIGITS:-3}
LR=${LR:-0.003}
# 500 warm-up updates, not 100: with 100 some seeds never leave the loss
# plateau on which the retrieval head has not formed (docs/results/retrieval-demo.md, "The recipe").
WARMUP=${WARMUP:-500}
SEEDS=${SEEDS:-${SEED:-1 2 3}}   # model seeds (initialization, batch order, evaluation prompts)
CORPUS_SEED=${CORPUS_SEED:-1}    # one corpus for every model seed
# Share of training documents whose records stand between filler sentences
# (corpus.py --filler-share): 0 the plain corpus; e.g. 0.25 for models that
# must also find one record in filler (the passkey, PASSKEY=1).
FILLER_SHARE=${FILLER_SHARE:-0}
# What the filler sentences draw from besides the template's words (corpus.py --filler-words):
# keys (the default; as the passkey's dictionary filler) or non-keys (words that are no key).
FILLER_WORDS=${FILLER_WORDS:-keys}
PASSKEY=${PASSKEY:-0}            # 1: the passkey at 1x too (one record in dictionary filler) -> seedS/passkey
# Record layout (corpus.py --layout): record (line KEY : REGISTER_CONTENT is N ., the default) or
# adjacent (line KEY N .: the number right after its key); the evaluation's prompts take the same.
LAYOUT=${LAYOUT:-record}
OUT=${OUT:-outputs/retrieval}
# A corpus of another seed, number of keys, digits, documents, filler share or layout gets its own
# directory (an existing one is never taken for it; build_corpus also checks the settings a
# directory was built with, DATA given or not).
CORPUS_TAG=""; [ "$CORPUS_SEED" = 1 ] || CORPUS_TAG="-c$CORPUS_SEED"
[ "$KEYS" = "$DEFAULT_KEYS" ] || CORPUS_TAG="$CORPUS_TAG-k$KEYS"
[ "$DIGITS" = 3 ] || CORPUS_TAG="$CORPUS_TAG-d$DIGITS"
[ "$DOCS" = "$DEFAULT_DOCS" ] || CORPUS_TAG="$CORPUS_TAG-n$DOCS"
SHARE_PATTERN='^(0(\.[0-9]+)?|1(\.0+)?)$'
if ! [[ $FILLER_SHARE =~ $SHARE_PATTERN ]]; then
  echo "error: FILLER_SHARE=$FILLER_SHARE is not a share of the documents: give a number from 0 to 1, e.g. 0.25" >&2; exit 1
fi
case "$FILLER_WORDS" in
  keys|non-keys) ;;
  *) echo "error: FILLER_WORDS=$FILLER_WORDS is not allowed: keys (the default) or non-keys" >&2; exit 1 ;;
esac
if [[ $FILLER_SHARE =~ ^0(\.0+)?$ ]]; then
  [ "$FILLER_WORDS" = keys ] || { echo "error: FILLER_WORDS=$FILLER_WORDS needs filler: give FILLER_SHARE too, e.g. 0.25" >&2; exit 1; }
else
  CORPUS_TAG="$CORPUS_TAG-f$FILLER_SHARE"; [ "$FILLER_WORDS" = keys ] || CORPUS_TAG="$CORPUS_TAG-nonkeys"
fi
case "$LAYOUT" in
  record) ;;
  adjacent) CORPUS_TAG="$CORPUS_TAG-adjacent" ;;
  *) echo "error: LAYOUT=$LAYOUT is not allowed: record (the default) or adjacent" >&2; exit 1 ;;
esac
DATA=${DATA:-data-bin/retrieval-L$L$CORPUS_TAG}
case "$PASSKEY" in 0|1) ;; *) echo "error: PASSKEY=$PASSKEY is not allowed: 1 (evaluate the passkey at 1x too) or 0" >&2; exit 1 ;; esac
DEPTHS=${DEPTHS:-5}
EVAL_THREADS=${EVAL_THREADS:-$(nproc)}   # threads of the evaluations (one process at a time)
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}  # for every model; EXTRA_TRAIN_ARGS_<model> (e.g. _fox) for one
BASELINE_SEEDS=${BASELINE_SEEDS:-first}  # sinusoidal for the first seed only, or: all
SAVE_EVERY=${SAVE_EVERY:-250}
UNTIL=${UNTIL:-}                 # P: train in stages until lines (and the passkey) reach P% at 1x (above)
CHECK_EVERY=${CHECK_EVERY:-1500}
if [ -n "$UNTIL" ] && ! [[ $UNTIL =~ ^([1-9][0-9]?|100)$ ]]; then
  echo "error: UNTIL=$UNTIL is not allowed: a whole percentage from 1 to 100 (e.g. 90), or empty to train every" \
    "model to its UPDATES" >&2; exit 1
fi
RESTART_AT=${RESTART_AT:-}        # U: a model below RESTART_BELOW% `lines` at U updates starts again (above)
RESTART_BELOW=${RESTART_BELOW:-10}
RESTARTS=${RESTARTS:-3}          # the most restarts of one model (every-family: 6)
RESTART_SEED_STEP=10000          # restart N trains under the seed plus N times this
if ! [[ $RESTART_BELOW =~ ^([1-9][0-9]?|100)$ ]]; then
  echo "error: RESTART_BELOW=$RESTART_BELOW is not allowed: a whole percentage from 1 to 100 (e.g. 10)" >&2; exit 1
fi
if ! [[ $RESTARTS =~ ^[0-9]+$ ]]; then
  echo "error: RESTARTS=$RESTARTS is not allowed: the most restarts of one model, a whole number (e.g. 3)" >&2; exit 1
fi
training_threads

# MODELS: position methods of core.positions (transformer_lm_<name>) or
# sinusoidal (the stock transformer_lm); METHODS: the recipe's default less the
# methods that apply to none of them; both checked before anything runs.
recipe_settings MODELS METHODS "$DEFAULT_METHODS"
# The per-model settings name a model of the registry (a misspelt one would be ignored) and the
# update and layer counts are whole numbers (an empty per-model one: the recipe's own).
KNOWN_MODELS=$(models)
for var in UPDATES LAYERS CHECK_EVERY RESTART_AT KEYS DIGITS DOCS EVAL_THREADS \
           $(compgen -v | grep -E '^(UPDATES|LAYERS|EXTRA_TRAIN_ARGS|RESTART_AT|FILLER_SHARE)_' || true); do
  if [[ $var =~ ^(UPDATES|LAYERS|EXTRA_TRAIN_ARGS|RESTART_AT|FILLER_SHARE)_(.+)$ ]] && [[ " $KNOWN_MODELS " != *" ${BASH_REMATCH[2]} "* ]]; then
    echo "error: $var names '${BASH_REMATCH[2]}', which is not a model; allowed suffixes: $KNOWN_MODELS" >&2; exit 1
  fi
  case $var in
    EXTRA_TRAIN_ARGS_*) ;;
    FILLER_SHARE_*) [[ -z ${!var} || ${!var} =~ $SHARE_PATTERN ]] || {
         echo "error: $var=${!var} is not a share of the documents: give a number from 0 to 1, e.g. 0.1," \
           "or leave it empty for FILLER_SHARE" >&2; exit 1; } ;;
    *) [[ ${!var} =~ ^[1-9][0-9]*$ || ( $var == *_* && -z ${!var} ) ]] || {
         echo "error: $var=${!var} is not a positive whole number" >&2; exit 1; } ;;
  esac
done
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
restart_at_of() { local own="RESTART_AT_$1"; echo "${!own:-$RESTART_AT}"; }  # NAME: its restart stage, or none
budget_of() { local own="UPDATES_$1"; echo "${!own:-$UPDATES}"; }  # NAME: its UPDATES (in stages: its budget)
filler_share_of() { local own="FILLER_SHARE_$1"; echo "${!own:-$FILLER_SHARE}"; }  # NAME: its share of filler
data_of() {  # NAME: its training corpus: DATA, or one of its own filler share binarized with DATA's dictionary,
  # so that the checks and the evaluation (DATA's dictionary) feed every model the same tokens
  local share; share=$(filler_share_of "$1")
  if awk -v a="$share" -v b="$FILLER_SHARE" 'BEGIN {exit !(a + 0 == b + 0)}'; then echo "$DATA"
  else echo "$DATA/filler-$(awk -v a="$share" 'BEGIN {printf "%g", a}')"; fi
}
for name in $MODELS; do  # a restart is decided at a check: a stage of a staged training, before its budget
  at=$(restart_at_of "$name")
  [ -n "$at" ] || continue
  if [ -z "$UNTIL" ]; then
    echo "error: RESTART_AT=$at ($name) needs checks: give UNTIL too (e.g. UNTIL=90), or leave RESTART_AT empty" >&2
    exit 1
  elif [ $((at % CHECK_EVERY)) != 0 ] || [ "$at" -ge "$(budget_of "$name")" ]; then
    echo "error: RESTART_AT=$at ($name) is not one of its checks: a multiple of CHECK_EVERY=$CHECK_EVERY below" \
      "its budget of $(budget_of "$name") updates" >&2; exit 1
  fi
done

mkdir -p "$OUT"
fresh_report "$OUT/$SUMMARY.md" "$OUT/$SUMMARY.png"
[ -z "$UNTIL" ] || fresh_report "$OUT/stages.md" "$OUT/stages.png"

build_corpus() {  # DIR SHARE [DICT]: the corpus with SHARE of its documents in filler, binarized into DIR
  local dir=$1 share=$2 dict=${3:-} unk settings
  # What the corpus is built from, in DIR/corpus.settings: a DIR built with other settings is refused
  # (one from before the record: taken as is).
  settings="max-length $((L - 1)) keys $KEYS digits $DIGITS train-docs $DOCS seed $CORPUS_SEED filler-share"
  settings+=" $(awk -v a="$share" 'BEGIN {printf "%g", a}') filler-words $FILLER_WORDS layout $LAYOUT"
  settings+="${dict:+ dictionary of $DATA}"  # (the share as a number: 0.10 is 0.1, as data_of names it)
  if [ -f "$dir/train.bin" ] && [ -f "$dir/corpus.settings" ] && [ "$(cat "$dir/corpus.settings")" != "$settings" ]; then
    echo "error: $dir holds a corpus built with $(cat "$dir/corpus.settings"), not with $settings;" \
      "give another DATA, or remove $dir to build it again" >&2; exit 1
  fi
  if [ -f "$dir/train.bin" ]; then stamp "1/3 corpus: $dir already binarized"; return 0; fi
  stamp "1/3 synthetic lines corpus (L=$L, $KEYS keys, $DIGITS digits, $DOCS documents, filler in a share" \
    "of $share${dict:+, the dictionary of $DATA}) -> $dir"
  python examples/retrieval/corpus.py --destdir "$dir/raw" --max-length $((L - 1)) \
    --keys "$KEYS" --digits "$DIGITS" --train-docs "$DOCS" --valid-docs 300 --seed "$CORPUS_SEED" \
    --filler-share "$share" --filler-words "$FILLER_WORDS" --layout "$LAYOUT"
  alibi-preprocess --only-source --trainpref "$dir/raw/train.txt" --validpref "$dir/raw/valid.txt" \
    --destdir "$dir" --workers 2 ${dict:+--srcdict "$dict"} > "$dir/preprocess.log" 2>&1 || {
    echo "error: binarizing the corpus in $dir failed (log: $dir/preprocess.log)" >&2; exit 1; }
  # a word missing from a shared dictionary would train as <unk>: the same words or no corpus
  unk=$(grep -o '/\(train\|valid\)\.txt: .*% replaced' "$dir/preprocess.log" | sort -u \
        | sed -E 's|^/([a-z]+)\.txt: .* ([0-9.]+)% replaced$|\1 \2%|' | grep -v ' 0\.0*%$' | paste -sd, | sed 's/,/, /g' || true)
  if [ -n "$unk" ]; then
    rm -f "$dir/train.bin"
    echo "error: the corpus in $dir has words the dictionary of $DATA lacks ($unk of its tokens <unk>;" \
      "log: $dir/preprocess.log): give its model the run's FILLER_SHARE or FILLER_WORDS=keys" >&2; exit 1
  fi
  echo "$settings" > "$dir/corpus.settings"
}
build_corpus "$DATA" "$FILLER_SHARE"
built=" $DATA "  # each corpus once, however many models share its filler share
for name in $MODELS; do  # the models with a filler share of their own
  data=$(data_of "$name")
  [[ $built == *" $data "* ]] && continue
  built+="$data "
  build_corpus "$data" "$(filler_share_of "$name")" "$DATA/dict.txt"
done

restarts_of() {  # SEED NAME: the number of its last restart (its discarded attempts are NAME.1 .. NAME.N), or 0
  local n last=0 attempt
  for attempt in "$OUT/seed$1/restarts/$2".*; do
    n=${attempt##*.}
    [ ! -d "$attempt" ] || ! [[ $n =~ ^[0-9]+$ ]] || [ "$n" -le "$last" ] || last=$n
  done
  echo "$last"
}
training_seed_of() { echo $(( $1 + RESTART_SEED_STEP * $2 )); }  # SEED RESTART: the seed restart RESTART trains under
train() {  # train SEED NAME [UPDATES]: identical settings; only the arch (position handling) differs
  local seed=$1 name=$2 own="EXTRA_TRAIN_ARGS_$2" own_layers="LAYERS_$2"
  local UPDATES=${3:-$(budget_of "$2")} LAYERS=${!own_layers:-$LAYERS}  # train_model reads UPDATES
  local restarts train_seed=$seed attempt=""
  restarts=$(restarts_of "$seed" "$name")
  [ "$restarts" = 0 ] || { train_seed=$(training_seed_of "$seed" "$restarts"); attempt=", restart $restarts: training seed $train_seed"; }
  # Each document is a whole line of the corpus (--sample-break-mode complete packs
  # whole documents into blocks of L tokens), so no record is cut from its question.
  lm_train_args "$name"
  # shellcheck disable=SC2086  # DEVICE_FLAGS and the EXTRA_TRAIN_ARGS: the words as typed
  train_model "$OUT/seed$seed/$name" "seed $seed $name" \
    "$(arch_of "$name"), L=$L, $LAYERS layers, $UPDATES updates, warm-up $WARMUP$attempt" "$(data_of "$name")" \
    "${LM_ARGS[@]}" --sample-break-mode complete --dropout 0.0 --seed "$train_seed" \
    --validate-interval-updates 500 --log-format simple --log-interval 50 \
    $DEVICE_FLAGS $EXTRA_TRAIN_ARGS ${!own:-}
}
CPU_FLAG=""; [ "$SCALE" = gpu ] || CPU_FLAG=--cpu
mapfile -t LINES_TEMPLATE < <(python examples/retrieval/corpus.py --layout "$LAYOUT" --template-args lines)
mapfile -t PASSKEY_TEMPLATE < <(python examples/retrieval/corpus.py --layout "$LAYOUT" --template-args passkey)
# evaluate TASK THREADS SEED OUTPUT_DIR LENGTHS METHODS CHECKPOINT_ARGS...: one alibi-retrieval run
# (lines in the corpus's layout; the passkey, one record in dictionary filler, in its words)
evaluate() {
  local task=$1 threads=$2 seed=$3 output=$4 lengths=$5 methods=$6
  shift 6
  if [ "$task" = lines ]; then set -- "$@" --task lines "${LINES_TEMPLATE[@]}"
  else set -- "$@" --task passkey --filler dictionary "${PASSKEY_TEMPLATE[@]}"; fi
  OMP_NUM_THREADS=$threads python -m fairseq_alibi.evaluation.retrieval "$DATA" "$@" --digits "$DIGITS" \
    --lengths "$lengths" --methods "$methods" --depths "$DEPTHS" --samples "$SAMPLES" --seed "$seed" \
    --output-dir "$output" $CPU_FLAG --no-progress
}

# The checks draw their prompts with the seed plus CHECK_SEED_OFFSET: the evaluation at the end (the
# seed's own prompts) is then on prompts the stopping rule never saw, as a test set after a validation set.
CHECK_SEED_OFFSET=1000
check_stage() {  # SEED NAME STAGE: the model at STAGE updates answers lines (and the passkey) at 1x
  local seed=$1 name=$2 stage=$3 dir="$OUT/seed$1/$2" checker="" status=0 row
  local prompts=$((seed + CHECK_SEED_OFFSET))
  local checks="$dir/checks/$stage" model=(--checkpoint "$name=$OUT/seed$1/$2/checkpoint_last.pt")
  # a stop ends the evaluation (the group's shell and its python) and this training's job, resumable
  trap '[ -z "$checker" ] || { pkill -TERM -P "$checker"; kill -TERM "$checker"; } 2>/dev/null || true; exit 130' \
    INT TERM HUP
  mkdir -p "$checks"
  {
    evaluate lines "$TRAIN_THREADS" "$prompts" "$checks/lines" 1x none "${model[@]}"
    [ "$PASSKEY" = 0 ] || evaluate passkey "$TRAIN_THREADS" "$prompts" "$checks/passkey" 1x none "${model[@]}"
  } > "$checks.log" 2>&1 &
  checker=$!
  wait "$checker" || status=$?
  trap - INT TERM HUP
  if [ "$status" != 0 ]; then
    echo "error: the check of seed $seed $name at $stage updates failed (exit $status):" \
      "$(grep '^error: ' "$checks.log" | tail -n 1 | cut -c8-) (log: $checks.log)" >&2
    return 1
  fi
  local results=("$checks/lines/results.json"); [ "$PASSKEY" = 0 ] || results+=("$checks/passkey/results.json")
  row=$(python examples/retrieval/stages.py record "$dir" "$stage" "${results[@]}") || return 1
  stamp "seed $seed $name: check at $stage updates: $(echo "$row" | awk -F'\t' '{print "lines " $2 "%" \
    ($3 == "-" ? "" : ", passkey " $3 "%")}') at 1x"
}

train_until() {  # SEED NAME: in stages of CHECK_EVERY to its budget; stop at the first check that reaches UNTIL
  local seed=$1 name=$2 dir="$OUT/seed$1/$2" stage current row status budget
  budget=$(budget_of "$name")
  current=$(last_saved "$dir")
  [ "$current" -le "$budget" ] || { train "$seed" "$name" "$budget"; return $?; }  # refused: trained past it
  # the multiples of CHECK_EVERY below the budget, the budget, and the count a finished training left the
  # model at (one trained before, or under another budget, is checked there before it trains on; one
  # interrupted mid-stage goes on to the stage)
  local finished
  finished=$(cat "$dir/trained.ok" 2>/dev/null) || true
  for stage in $({ [ "$current" = 0 ] || [ "$finished" != "$current" ] || echo "$current"
                   seq "$CHECK_EVERY" "$CHECK_EVERY" "$((budget - 1))"
                   echo "$budget"; } | sort -n -u); do
    [ "$stage" -ge "$current" ] || continue  # a stage the model is past (its check, if any, is history)
    # a check made of the model where it stands (not of one that stood there before it was replaced),
    # of every task asked (a check without the passkey does not stand for one with it)
    row=""
    [ "$stage" != "$current" ] || row=$(awk -F'\t' -v s="$stage" -v p="$PASSKEY" '$1 == s && !(p == 1 && $3 == "-")' \
      "$dir/checks.tsv" 2>/dev/null) || true
    if [ -z "$row" ]; then
      status=0; train "$seed" "$name" "$stage" || status=$?
      [ "$status" = 0 ] || return "$status"
      check_stage "$seed" "$name" "$stage" || { status=$?; return "$status"; }
      row=$(awk -F'\t' -v s="$stage" '$1 == s' "$dir/checks.tsv")
    fi
    current=$stage
    if echo "$row" | awk -F'\t' -v p="$UNTIL" '{exit !($2 >= p && ($3 == "-" || $3 >= p))}'; then
      stamp "seed $seed $name: retrieves at $stage updates (at least $UNTIL% of every task at 1x)"
      return 0
    fi
    if [ "$stage" = "$(restart_at_of "$name")" ] && echo "$row" | awk -F'\t' -v p="$RESTART_BELOW" '{exit !($2 < p)}'; then
      local next kept
      next=$(( $(restarts_of "$seed" "$name") + 1 )); kept="$OUT/seed$seed/restarts/$name.$next"
      if [ "$next" -le "$RESTARTS" ]; then  # the attempt moved whole, in one rename: a stop leaves one or the other
        mkdir -p "$OUT/seed$seed/restarts" && mv -T "$dir" "$kept" || {
          echo "error: seed $seed $name: cannot move the attempt to restart to $kept" >&2; return 1; }
        stamp "seed $seed $name: lines $(echo "$row" | cut -f2)% at $stage updates, below $RESTART_BELOW%: restart" \
          "$next of at most $RESTARTS, training seed $(training_seed_of "$seed" "$next") (the attempt kept in $kept)"
        train_until "$seed" "$name"
        return $?
      fi
      stamp "seed $seed $name: lines $(echo "$row" | cut -f2)% at $stage updates, below $RESTART_BELOW%, and its" \
        "RESTARTS=$RESTARTS restarts are spent: it trains on"
    fi
  done
  stamp "seed $seed $name: below $UNTIL% at its last check, $budget updates (its budget)"
}

# At most as many trainings at once as cores with PARALLEL=1 (one thread each), else one at a time.
TRAIN_STEP=2/3 FOLLOW="train_inner|valid on|num. shared model params|done training|Error|error" \
  run_trainings "$([ -n "$UNTIL" ] && echo train_until || echo train)" < <(jobs_of)
summaries=()
for seed in $SEEDS; do
  checkpoints=() names=()
  while read -r _ name; do
    checkpoints+=(--checkpoint "$name=$OUT/seed$seed/$name/checkpoint_last.pt") names+=("$name")
  done < <(jobs_of | awk -v seed="$seed" '$1 == seed')
  [ ${#checkpoints[@]} -gt 0 ] || continue
  stamp "3/3 retrieval, seed $seed: lines at $LENGTHS x {$METHODS} on {${names[*]}}, $DEPTHS depths x $SAMPLES samples -> $OUT/seed$seed/$EVAL"
  evaluate lines "$EVAL_THREADS" "$seed" "$OUT/seed$seed/$EVAL" "$LENGTHS" "$METHODS" "${checkpoints[@]}"
  summaries+=("seed$seed=$OUT/seed$seed/$EVAL/results.json")
  if [ "$PASSKEY" = 1 ]; then  # the lines task's own words as the passkey's texts: one record in filler
    stamp "3/3 passkey, seed $seed: one record in dictionary filler at 1x on {${names[*]}} -> $OUT/seed$seed/passkey"
    evaluate passkey "$EVAL_THREADS" "$seed" "$OUT/seed$seed/passkey" 1x none "${checkpoints[@]}"
  fi
done
[ -z "$UNTIL" ] || write_report "$OUT/stages.md" python examples/retrieval/stages.py report "$OUT" --until "$UNTIL" \
  --plot "$OUT/stages.png"
# Across seeds, a column per model at each length, then each model's accuracy by
# needle distance (tokens from the queried record to the end of the prompt).
write_report "$OUT/$SUMMARY.md" python examples/retrieval/summary.py "${summaries[@]}" --plot "$OUT/$SUMMARY.png"
stamp "done: per seed $OUT/seed*/$EVAL/results.md (plots accuracy.png, depth.png); across seeds $OUT/$SUMMARY.md, $OUT/$SUMMARY.png"
