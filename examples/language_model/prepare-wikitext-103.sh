#!/usr/bin/env bash
# Download, verify and binarize WikiText-103 (word level, as in the ALiBi paper).
#
#   examples/language_model/prepare-wikitext-103.sh [DESTDIR]
#
# DESTDIR defaults to data-bin/wikitext-103.  Steps, each skipped when done:
#   1. get wiki.{train,valid,test}.tokens into examples/language_model/wikitext-103/:
#      from $WIKITEXT_DIR if set (a directory already holding the three files),
#      else from a local archive (wikitext-103-v1.zip or wikitext-103.tar.gz
#      next to this script), else by downloading from the mirrors in
#      $WIKITEXT_MIRRORS (space-separated URLs, tried in order);
#   2. verify the token counts (train 103,227,021, valid 217,646, test
#      245,569), counted as fairseq-preprocess counts them: whitespace-separated
#      words plus one end-of-line token per line (empty lines included);
#   3. alibi-preprocess --only-source into DESTDIR (inputs checked, splits written whole).
# Environment: PYTHON (default: python), WORKERS (default: nproc).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DEST=${1:-data-bin/wikitext-103}
PYTHON=${PYTHON:-python}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 1)}
RAW="$HERE/wikitext-103"
SPLITS="train valid test"
# Known homes of the archive, tried in order (the original S3 bucket first).
WIKITEXT_MIRRORS=${WIKITEXT_MIRRORS:-"https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip https://wikitext.smerity.com/wikitext-103-v1.zip https://dax-cdn.cdn.appdomain.cloud/dax-wikitext-103/1.0.1/wikitext-103.tar.gz"}
declare -A EXPECTED=([train]=103227021 [valid]=217646 [test]=245569)

die() { echo "prepare-wikitext-103: error: $*" >&2; exit 1; }
say() { echo "prepare-wikitext-103: $*"; }

have_raw() { for s in $SPLITS; do [ -s "$RAW/wiki.$s.tokens" ] || return 1; done; }

if [ -f "$DEST/.prepared" ] && [ -f "$DEST/dict.txt" ]; then
  say "already prepared in $DEST (remove $DEST/.prepared to redo)"
  exit 0
fi

# ---------------------------------------------------------------- 1. raw files
unpack() {  # unpack ARCHIVE: leaves the three files in $RAW
  local archive=$1 tmp
  tmp=$(mktemp -d)
  case "$archive" in
    *.zip) "$PYTHON" -m zipfile -e "$archive" "$tmp" || { rm -rf "$tmp"; return 1; } ;;
    *.tar.gz|*.tgz) tar -xzf "$archive" -C "$tmp" || { rm -rf "$tmp"; return 1; } ;;
    *) rm -rf "$tmp"; return 1 ;;
  esac
  mkdir -p "$RAW"
  for s in $SPLITS; do
    local found
    found=$(find "$tmp" -name "wiki.$s.tokens" | head -n 1)
    [ -n "$found" ] || { rm -rf "$tmp"; return 1; }
    mv "$found" "$RAW/wiki.$s.tokens"
  done
  rm -rf "$tmp"
}

download() {  # download URL FILE
  if command -v curl >/dev/null 2>&1; then
    curl -fsSL --connect-timeout 15 --retry 2 -o "$2" "$1"
  elif command -v wget >/dev/null 2>&1; then
    wget -q --timeout=15 --tries=2 -O "$2" "$1"
  else
    "$PYTHON" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$1" "$2"
  fi
}

if [ -n "${WIKITEXT_DIR:-}" ]; then
  [ -d "$WIKITEXT_DIR" ] || die "WIKITEXT_DIR=$WIKITEXT_DIR is not a directory"
  for s in $SPLITS; do
    [ -s "$WIKITEXT_DIR/wiki.$s.tokens" ] || die "WIKITEXT_DIR=$WIKITEXT_DIR has no wiki.$s.tokens (expected wiki.{train,valid,test}.tokens)"
  done
  mkdir -p "$RAW"
  for s in $SPLITS; do cp "$WIKITEXT_DIR/wiki.$s.tokens" "$RAW/"; done
elif ! have_raw; then
  got=""
  for archive in "$HERE/wikitext-103-v1.zip" "$HERE/wikitext-103.tar.gz"; do
    if [ -s "$archive" ]; then
      say "unpacking local $archive"
      unpack "$archive" && { got=$archive; break; }
      say "could not unpack $archive (corrupt or incomplete?)"
    fi
  done
  if [ -z "$got" ]; then
    tried=""
    for url in $WIKITEXT_MIRRORS; do
      name="$HERE/$(basename "$url")"
      say "downloading $url"
      if download "$url" "$name.part" && mv "$name.part" "$name" && unpack "$name"; then
        got=$url; break
      fi
      rm -f "$name.part"
      tried="$tried
  $url"
    done
    [ -n "$got" ] || die "could not download WikiText-103 from any mirror (offline?). Tried:$tried
Download wikitext-103-v1.zip yourself and put it at $HERE/wikitext-103-v1.zip,
or set WIKITEXT_DIR to a directory holding wiki.train.tokens, wiki.valid.tokens
and wiki.test.tokens, then run this script again."
  fi
fi
have_raw || die "missing wiki.{train,valid,test}.tokens in $RAW"

# ---------------------------------------------------------------- 2. verify
for s in $SPLITS; do
  n=$("$PYTHON" -c "
import sys
n = 0
with open(sys.argv[1], encoding='utf-8') as f:
    for line in f:
        n += len(line.split()) + 1
print(n)" "$RAW/wiki.$s.tokens")
  if [ "$n" != "${EXPECTED[$s]}" ]; then
    die "token count mismatch for wiki.$s.tokens: $n, expected ${EXPECTED[$s]} (words + one per line). Wrong version (raw vs tokenized) or a damaged file? Delete $RAW and retry."
  fi
  say "$s: $n tokens (ok)"
done

# ---------------------------------------------------------------- 3. binarize
mkdir -p "$DEST"
"$("$PYTHON" -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "alibi-preprocess"))')" --only-source \
  --trainpref "$RAW/wiki.train.tokens" --validpref "$RAW/wiki.valid.tokens" \
  --testpref "$RAW/wiki.test.tokens" --destdir "$DEST" --workers "$WORKERS"
touch "$DEST/.prepared"
say "done: $DEST (vocabulary $(wc -l < "$DEST/dict.txt") words + 4 specials)"
