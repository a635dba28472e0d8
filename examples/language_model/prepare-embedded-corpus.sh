#!/usr/bin/env bash
# Build the offline "embedded" corpus: CPython's own documentation (help topics,
# stdlib docstrings and comments), tokenized like WikiText-103, split by
# document and binarized with fairseq-preprocess.  Nothing is downloaded.
#
#   examples/language_model/prepare-embedded-corpus.sh [DESTDIR] [extra options]
#
# DESTDIR defaults to data-bin/embedded.  Extra options go to
# `python -m fairseq_alibi.corpus` (see its --help: --lowercase, --min-count,
# --valid-fraction, --test-fraction, --sources, --stdlib-dir, --force).
# Running it again with the same settings is a no-op.
set -euo pipefail
PYTHON=${PYTHON:-python}
DEST=${1:-data-bin/embedded}
[ $# -gt 0 ] && shift
exec "$PYTHON" -m fairseq_alibi.corpus --destdir "$DEST" "$@"
