#!/usr/bin/env bash
# Fetch one of the ALiBi paper's WikiText-103 models and convert it for this plugin.
#
#   checkpoints/download.sh L [DESTDIR]
#
# L is the training length: 64, 128, 256, 512, 1024, 1536, 2048 or 3072.
# DESTDIR defaults to the directory of this script.  Writes
#   DESTDIR/alibi_wt103_L{L}.fork.pt   the file as published (the fork's format)
#   DESTDIR/alibi_wt103_L{L}.pt        converted by alibi-convert-checkpoint
# A finished download is not fetched again; a partial one is kept as .part and
# resumed when the download tool can.  Environment: ALIBI_CHECKPOINT_URL
# overrides the base address (a mirror or a local directory, file://...).
set -euo pipefail

LENGTHS="64 128 256 512 1024 1536 2048 3072"
BASE_URL=${ALIBI_CHECKPOINT_URL:-https://dl.fbaipublicfiles.com/train_short_test_long/wt103}
HERE="$(cd "$(dirname "$0")" && pwd)"

die() { echo "download.sh: error: $1" >&2; exit "${2:-1}"; }
usage() { echo "usage: download.sh L [DESTDIR]   (L one of: $LENGTHS)" >&2; exit 2; }

[ $# -ge 1 ] && [ $# -le 2 ] || usage
L=$1
case " $LENGTHS " in
  *" $L "*) ;;
  *) die "no published model for training length '$L'; choose one of: $LENGTHS" 2 ;;
esac
DEST=${2:-$HERE}
mkdir -p "$DEST"

NAME="alibi_wt103_L${L}"
URL="$BASE_URL/$NAME.pt"
RAW="$DEST/$NAME.fork.pt"
OUT="$DEST/$NAME.pt"

if [ ! -s "$RAW" ]; then
  echo "download.sh: fetching $URL"
  if command -v curl >/dev/null 2>&1; then
    fetch() { curl -fsSL --retry 2 --connect-timeout 20 -C - -o "$RAW.part" "$URL"; }
  elif command -v wget >/dev/null 2>&1; then
    fetch() { wget -c -T 20 -O "$RAW.part" "$URL"; }
  else
    die "neither curl nor wget is installed"
  fi
  if ! fetch; then
    [ -s "$RAW.part" ] || rm -f "$RAW.part"
    die "could not download $URL (offline, blocked, or the file moved?). Fetch it by other means, save it as $RAW and run this script again, or set ALIBI_CHECKPOINT_URL to a mirror."
  fi
  mv "$RAW.part" "$RAW"
else
  echo "download.sh: using $RAW (already downloaded)"
fi

CONVERT=$(command -v alibi-convert-checkpoint || true)
if [ -z "$CONVERT" ] && [ -x "$HERE/../.venv/bin/alibi-convert-checkpoint" ]; then
  CONVERT="$HERE/../.venv/bin/alibi-convert-checkpoint"
fi
[ -n "$CONVERT" ] || die "alibi-convert-checkpoint not found: install the plugin (make install) or activate its virtualenv"

"$CONVERT" "$RAW" "$OUT" --force  # $OUT is ours: derived from $RAW again on a re-run
echo "download.sh: ready: $OUT"
