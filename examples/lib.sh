# shellcheck shell=bash
# What the example recipes share: sourced (never run) by examples/language_model/demo.sh,
# examples/positions/compare.sh, examples/retrieval/run.sh and examples/retrieval/frontier.sh,
# each of which sets RECIPE_TAG (its name in messages) and works from the repository:
#
#   cd "$(dirname "$0")/../.."; RECIPE_TAG=compare; source examples/lib.sh
#
# * the preamble: strict mode; the tools of VENV_BIN (default .venv/bin) first on PATH;
#   Ctrl-C (SIGINT), SIGTERM and SIGHUP stop every training at its last saved update and
#   end the recipe with one line saying so and how to resume (rerun the same command),
#   exit status 130 (143, 129);
# * stamp: a progress line, `[RECIPE_TAG SECONDSs] text`;
# * models, recipe_settings: the registries (fairseq_alibi/core/positions.py, through
#   examples/registry.py): which models exist, which have extension methods, which methods
#   of a list apply to the models of a run;
# * lm_train_args: the training flags the recipes' small LMs share;
# * training_threads: PARALLEL=1 trains with one thread per training and as many
#   trainings at once as cores (TRAIN_SLOTS), PARALLEL=0 one at a time with every core;
# * train_model: one alibi-train run into its own directory, resumable: a model whose
#   trained.ok records UPDATES is kept; any other resumes from its checkpoint_last.pt,
#   which is written every SAVE_EVERY updates (mid-epoch too) and at the end, so an
#   interruption loses at most SAVE_EVERY - 1 updates; the resumed run ends with the
#   weights an uninterrupted one ends with (tests/test_resume.py);
# * run_trainings: the scheduler, a training per line of its input, TRAIN_SLOTS at once;
#   the first that fails ends the recipe with exit status 1 and one `error:` line (the
#   run, the trainer's own reason, its log), the others stopped at their last saved update.

set -euo pipefail

VENV_BIN=${VENV_BIN:-.venv/bin}
case "$VENV_BIN" in /*) ;; *) VENV_BIN="$PWD/$VENV_BIN" ;; esac
export PATH="$VENV_BIN:$PATH"
RECIPE_TAG=${RECIPE_TAG:-$(basename "$0" .sh)}
RECIPE_START=$(date +%s)

stamp() { echo "[$RECIPE_TAG $(( $(date +%s) - RECIPE_START ))s] $*"; }

# ------------------------------------------------------------------ interruptions
interrupted() {  # SIGNAL STATUS: stop every training (each saves nothing more), say how to resume, exit
  trap '' INT TERM HUP
  stop_trainings
  echo "$RECIPE_TAG interrupted ($1): rerun the same command to resume (trained models are kept, each other" \
    "training resumes from its last saved update, finished evaluation cells are kept)" >&2
  exit "$2"
}
trap 'interrupted SIGINT 130' INT
trap 'interrupted SIGTERM 143' TERM
trap 'interrupted SIGHUP 129' HUP

stop_trainings() {  # every running training (train_model passes the stop on to its trainer once), then wait
  local job
  # SIGTERM, which train_model traps like SIGINT: a recipe started with `&` from a script runs
  # with SIGINT ignored, which no shell it starts can trap again (bash's rule for signals
  # ignored on entry), so SIGINT would not reach them.
  for job in $(jobs -p); do kill -TERM "$job" 2>/dev/null || true; done
  wait || true
}

stop_signal() {  # PID: INT, the stop alibi-train handles, or TERM where PID ignores SIGINT (see stop_trainings)
  local ignored
  ignored=$(awk '/^SigIgn:/ {print $2}' "/proc/$1/status" 2>/dev/null) || true
  if [ -n "$ignored" ] && (( 0x$ignored & 2 )); then echo TERM; else echo INT; fi
}

# ------------------------------------------------------------------ the registries
models() { python examples/registry.py models; }  # sinusoidal, then each position method
# recipe_settings MODELS_VARIABLE METHODS_VARIABLE DEFAULT_METHODS: the two settings checked
# (one error: line and exit 1 for a name that is not a model, a method that does not exist or, in a
# list given, one that applies to none of the models) and completed (every model where the first
# is empty; DEFAULT_METHODS less the methods that apply to none of them where the second is),
# and EXTENDED: the models that one of the extension methods kept, besides none, applies to.
# DEFAULT_EXTENSIONS: the recipes' default list, every method of the registry
# (fairseq_alibi/core/scaling.py): ALiBi's tails and cap at their defaults, the factor methods at 2 and
# dynamic (YaRN at 2 and 4), and logn, the one that applies to every position method.
DEFAULT_EXTENSIONS=none,cap,log,power,capnorm,ntk:2,ntk,linear:2,linear,yarn:2,yarn:4,logn
recipe_settings() {
  local settings
  settings=$(python examples/registry.py settings --models-variable "$1" --models "${!1:-}" \
    --methods-variable "$2" --methods "${!2:-}" --default-methods "$3")
  eval "$settings"
}
arch_of() { if [ "$1" = sinusoidal ]; then echo transformer_lm; else echo "transformer_lm_$1"; fi; }

# ------------------------------------------------------------------ training
# lm_train_args NAME: LM_ARGS, the alibi-train flags every recipe trains its small LMs with (model NAME's
# arch, pre-norm, tied embeddings, Adam with inverse-sqrt warm-up, UPDATES updates), from LAYERS, DIM, FFN,
# HEADS, L, MAX_TOKENS, LR, WARMUP and UPDATES. A recipe adds its own sample break mode, dropout, seed,
# logging and device. decoder-input/output-dim equal decoder-embed-dim, or fairseq adds 512-wide
# projections to the sinusoidal model.
lm_train_args() {
  LM_ARGS=(--task language_modeling --arch "$(arch_of "$1")" --decoder-layers "$LAYERS"
    --decoder-embed-dim "$DIM" --decoder-input-dim "$DIM" --decoder-output-dim "$DIM"
    --decoder-ffn-embed-dim "$FFN" --decoder-attention-heads "$HEADS"
    --decoder-normalize-before --share-decoder-input-output-embed
    --tokens-per-sample "$L" --max-tokens "$MAX_TOKENS"
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 --weight-decay 0.01
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-7
    --max-update "$UPDATES" --num-workers 0)
}

training_threads() {  # TRAIN_THREADS and TRAIN_SLOTS from PARALLEL (cores: nproc alone obeys OMP_NUM_THREADS)
  local cores
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  if [ "$PARALLEL" = 1 ]; then TRAIN_THREADS=${TRAIN_THREADS:-1}; TRAIN_SLOTS=$cores
  else TRAIN_THREADS=${TRAIN_THREADS:-$cores}; TRAIN_SLOTS=1; fi
}

last_saved() {  # DIR: the update count of the last checkpoint its train.log says was saved (0: none)
  local updates
  updates=$(grep -o 'Saved checkpoint [^ ]* (epoch [0-9]* @ [0-9]* updates' "$1/train.log" 2>/dev/null \
    | tail -n 1 | sed 's/.*@ //; s/ updates//') || true
  echo "${updates:-0}"
}

# training_record DATA ALIBI_TRAIN_ARGS...: what defines the model a training writes, a line each: the
# checksums of DATA's dict.txt and train.idx (the corpus may be rebuilt in place), then each option
# with its values, but DATA (data.path has it) and the options that only log or that a staged
# training raises (--max-update, --log-interval, --log-format).
training_record() {
  local data=$1 file arg line="" skip=""
  shift
  for file in dict.txt train.idx; do
    [ ! -f "$data/$file" ] || echo "$file $(sha1sum < "$data/$file" | cut -c1-40)"
  done
  for arg in "$@" --; do
    case $arg in
      --*) [ -z "$line" ] || [ -n "$skip" ] || printf '%s\n' "$line"
           line=$arg; skip=""
           case $arg in --max-update|--log-interval|--log-format|--max-update=*|--log-interval=*|--log-format=*) skip=1 ;; esac ;;
      *) line="$line $arg" ;;
    esac
  done
}

# first_difference FILE TEXT: where TEXT first differs from FILE's lines, for an error message
first_difference() {
  local -a was now
  local i
  mapfile -t was < "$1"
  mapfile -t now <<< "$2"
  for ((i = 0; i < ${#was[@]} || i < ${#now[@]}; i++)); do
    [ "${was[i]-}" = "${now[i]-}" ] && continue
    echo "it was trained with '${was[i]-(nothing more)}' where this run has '${now[i]-(nothing more)}'"
    return
  done
}

# train_model DIR LABEL DETAIL DATA ALIBI_TRAIN_ARGS...: train into DIR (train.log, checkpoints) on DATA,
# unless DIR/trained.ok records UPDATES (refused: a DIR whose model was trained past UPDATES, on
# another DATA, recorded in DIR/data.path, or with other settings, DIR/train.record). Reads UPDATES,
# SAVE_EVERY, TRAIN_THREADS, TRAIN_STEP (the recipe's step, e.g. 2/4) and FOLLOW (a pattern of log
# lines to show, prefixed with LABEL; empty: none). Returns 0 (trained), 1 (failed: one error: line
# on stderr) or 130 (stopped: resumable). Runs as a job of run_trainings (it sets the traps of its own shell).
train_model() {
  local dir=$1 label=$2 detail=$3 status=0 trainer="" sent="" resume="" data
  shift 3
  # A model goes on (or counts as trained) only on the corpus it was trained on: a resumed run on
  # another would report a model that no corpus describes. (A DIR from before the record: taken as is.)
  data=$([ $# = 0 ] || realpath -m -- "$1")
  if [ -n "$data" ] && [ -f "$dir/data.path" ] && [ "$(cat "$dir/data.path")" != "$data" ]; then
    echo "error: $label: $dir holds a model trained on $(cat "$dir/data.path"), not on $data; give another" \
      "OUT, or remove $dir to train it again" >&2
    return 1
  fi
  # Nor on other settings: DIR/train.record holds what defines the model (the corpus's dict.txt and
  # train.idx checksums, the trainer's arguments but those that only log or, raised by a staged
  # training, say where to stop); a DIR from before the record: taken as is.
  local record
  record=$([ $# = 0 ] || training_record "$@")
  if [ -n "$record" ] && [ -f "$dir/train.record" ] && [ "$(cat "$dir/train.record")" != "$record" ]; then
    echo "error: $label: $dir holds a model trained with other settings ($(first_difference "$dir/train.record" \
      "$record")); give another OUT, or remove $dir to train it again" >&2
    return 1
  fi
  # (an empty trained.ok is the mark of an earlier demo.sh, which recorded no count: kept as trained)
  if [ -f "$dir/trained.ok" ] && [ -f "$dir/checkpoint_last.pt" ] \
    && { [ "$(cat "$dir/trained.ok")" = "$UPDATES" ] || [ ! -s "$dir/trained.ok" ]; }; then
    stamp "$label: already trained ($dir/checkpoint_last.pt, $UPDATES updates)"
    return 0
  fi
  # A model trained past UPDATES is not "resumed" to fewer: its trainer would stop at once and
  # trained.ok would record a count the model is not at.
  if [ -f "$dir/checkpoint_last.pt" ] && [ "$(last_saved "$dir")" -gt "$UPDATES" ]; then
    echo "error: $label: $dir holds a model trained for $(last_saved "$dir") updates, more than the $UPDATES" \
      "asked; give that count (UPDATES, or UPDATES_<model> in the retrieval recipe) or another OUT" >&2
    return 1
  fi
  mkdir -p "$dir"
  [ -z "$data" ] || echo "$data" > "$dir/data.path"
  [ -z "$record" ] || printf '%s\n' "$record" > "$dir/train.record"
  touch "$dir/train.log"
  [ -f "$dir/checkpoint_last.pt" ] && resume=", resuming from update $(last_saved "$dir")"
  stamp "$TRAIN_STEP training $label ($detail$resume; log in $dir/train.log)"
  local from follower=""
  from=$(( $(wc -l < "$dir/train.log") + 1 ))  # the trainer's lines start after what the log holds now
  # The trainer runs in a session of its own, so a Ctrl-C reaches it once, from here (the
  # terminal's would reach it too): SIGINT makes alibi-train stop and exit 130, keeping the
  # checkpoints it saved (every SAVE_EVERY updates; --keep-interval-updates 1 keeps the last).
  trap '[ -n "$sent" ] || { sent=1; [ -z "$trainer" ] || kill -"$(stop_signal "$trainer")" "$trainer" 2>/dev/null || true; }' INT TERM HUP
  [ -z "$sent" ] || return 130  # stopped before its trainer started: nothing to stop
  # (In a subshell: a plain `command &` would start with SIGINT ignored, as bash starts them.)
  ( OMP_NUM_THREADS=$TRAIN_THREADS MKL_NUM_THREADS=$TRAIN_THREADS exec $(command -v setsid || true) alibi-train "$@" \
    --save-dir "$dir" --save-interval-updates "$SAVE_EVERY" --keep-interval-updates 1 --no-epoch-checkpoints ) \
    >> "$dir/train.log" 2>&1 &
  trainer=$!
  [ -z "$sent" ] || kill -"$(stop_signal "$trainer")" "$trainer" 2>/dev/null || true  # a stop while it started
  if [ -n "${FOLLOW:-}" ]; then  # the trainer's progress lines, prefixed, until this trainer ends: a follower
    # that outlived it (one per stage of a staged training) would print every later stage's lines again
    tail -n "+$from" -F --pid="$trainer" "$dir/train.log" 2>/dev/null \
      | grep --line-buffered -E "$FOLLOW" | sed -u "s/^/[$label] /" &
    follower=$!
  fi
  wait "$trainer" || true
  while kill -0 "$trainer" 2>/dev/null; do wait "$trainer" || true; done  # a wait cut short by the trap
  wait "$trainer" || status=$?  # the trainer's own exit status (bash keeps it)
  [ -z "$follower" ] || wait "$follower" 2>/dev/null || true  # its last lines shown before what follows
  case $status in
    0)
      echo "$UPDATES" > "$dir/trained.ok"
      local valid
      valid=$(grep -o "valid on 'valid' subset | loss [0-9.]*" "$dir/train.log" | tail -n 1 | grep -o '[0-9.]*$') || true
      stamp "$label: trained${valid:+ (valid loss $valid)}"
      return 0 ;;
    130|143|129)
      local saved
      saved=$(last_saved "$dir")
      if [ -f "$dir/checkpoint_last.pt" ] && [ "$saved" != 0 ]; then
        stamp "$label: stopped (exit $status); it resumes from update $saved ($dir/checkpoint_last.pt)"
      else
        stamp "$label: stopped (exit $status) before its first saved update; it starts again"
      fi
      return 130 ;;
    *)  # the trainer's own error line (alibi-train prints one), with where the rest is
      local reason
      reason=$(grep '^error: ' "$dir/train.log" | tail -n 1 | cut -c8-) || true
      if [ -z "$reason" ] && [ "$status" -gt 128 ]; then  # e.g. SIGKILL from the kernel when memory ran out
        reason="killed by SIG$(kill -l $((status - 128)) 2>/dev/null || echo $((status - 128)))"
      fi
      echo "error: training $label failed (exit $status): ${reason:-see its log} (log: $dir/train.log)" >&2
      return 1 ;;
  esac
}

# reap_trainings: run_trainings' wait for one of its jobs (the pids in its `live`) to end; takes
# the exit status of each that has ended, by its pid, the first non-zero into `status`. Not the
# status `wait -n` returns: bash 5.2's `wait -n` can pass over a job that ended together with the
# one it reports (it then returns 127, "nothing to wait for", or waits on for the next), where
# `wait PID` still gives the status bash kept for that pid.
reap_trainings() {
  local pid code lost=0 running=()
  wait -n 2>/dev/null || [ $? != 127 ] || lost=1  # 127: no job left to wait for (a pid kill -0 finds is not ours)
  for pid in "${live[@]}"; do
    if [ "$lost" = 0 ] && kill -0 "$pid" 2>/dev/null; then running+=("$pid"); continue; fi
    code=0
    wait "$pid" || code=$?
    [ "$status" != 0 ] || status=$code
  done
  live=("${running[@]}")
}

# run_trainings FUNCTION < lines: FUNCTION WORDS... for each line of WORDS, TRAIN_SLOTS at once.
# The first that fails (FUNCTION returned 1: it said why) stops the others and exits 1; one that
# was stopped (130) ends the recipe as interrupted.
run_trainings() {
  local fn=$1 status=0 words live=()
  while [ "$status" = 0 ] && read -r words; do
    while [ "$status" = 0 ] && [ "${#live[@]}" -ge "$TRAIN_SLOTS" ]; do reap_trainings; done
    [ "$status" = 0 ] || break
    # shellcheck disable=SC2086
    "$fn" $words & live+=("$!")
  done
  while [ "$status" = 0 ] && [ "${#live[@]}" -gt 0 ]; do reap_trainings; done
  case $status in
    0) return 0 ;;
    1) trap '' INT TERM HUP; stop_trainings; exit 1 ;;
    *) interrupted "a training was stopped" 130 ;;
  esac
}

# fresh_report FILE...: remove a previous run's report before this run makes its own, so a run
# that fails leaves no report of an earlier one looking current.
fresh_report() { rm -f "$@"; }

# write_report FILE COMMAND...: COMMAND's output shown and written to FILE whole or not at all.
# The partial file is this shell's own: two recipes of one OUT at once (one seed each) each
# write their report whole, the last one's kept, where a shared name had one move the other's away.
write_report() {
  local file=$1 partial="$1.partial.$BASHPID"
  shift
  "$@" > "$partial" || { rm -f "$partial"; return 1; }
  mv "$partial" "$file"
  cat "$file"
}
