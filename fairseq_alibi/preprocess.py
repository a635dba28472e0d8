"""``alibi-preprocess``: fairseq-preprocess with its inputs checked first and its outputs staged.

Stock fairseq-preprocess created ``--destdir``, wrote its log and the
dictionary, and only then met a text it could not read (a Latin-1 file is a
``ValueError: negative seek position -1`` from inside its file chunker),
leaving ``valid.bin`` without ``valid.idx`` behind.  Here:

1. every text it would read (each split's file per language, ``--srcdict``,
   ``--tgtdict``, ``--alignfile``, alignment files) passes ``inputs.check_text``,
   and ``--destdir`` is checked (a directory, writable, no dictionary that a new
   one would overwrite), before anything is written;
2. fairseq writes into a fresh hidden directory in ``--destdir`` (beside it
   while there is none: ``staging.staged_files``), and only a finished run's
   files are moved into it (its ``preprocess.log`` appended to the one there): an interrupted,
   refused or failed run leaves every split whole or untouched.

``alibi-preprocess`` (``cli.preprocess``) applies :func:`guard`; scripts run
that console script (``console_script`` finds it beside the interpreter).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Iterator, List, Optional, Tuple

from .errors import UserError
from .inputs import check_text
from .staging import staged_files

LOG = "preprocess.log"


def _file_name(prefix: str, lang: Optional[str]) -> str:
    """fairseq's name for a split's text in one language (``train`` + ``.de``)."""
    return prefix if lang is None else f"{prefix}.{lang}"


def _prefixes(args) -> List[Tuple[str, str]]:
    """(flag, prefix) of every split fairseq reads: train (also for its dictionary),
    and, unless ``--dict-only``, each comma-separated valid and test prefix."""
    prefixes = [("--trainpref", args.trainpref)] if args.trainpref else []
    if not args.dict_only:
        for flag, given in (("--validpref", args.validpref), ("--testpref", args.testpref)):
            prefixes += [(flag, prefix) for prefix in (given.split(",") if given else [])]
    return prefixes


def text_inputs(args) -> List[Tuple[str, str, str]]:
    """(flag, path, what) of every text fairseq-preprocess would read with ``args``."""
    langs = [args.source_lang] + ([] if args.only_source else [args.target_lang])
    found = [(flag, _file_name(prefix, lang), "text file") for flag, prefix in _prefixes(args) for lang in langs]
    found += [(flag, path, "dictionary") for flag, path in (("--srcdict", args.srcdict), ("--tgtdict", args.tgtdict))
              if path]
    if args.alignfile:
        found.append(("--alignfile", args.alignfile, "alignment file"))
    if args.align_suffix and not args.dict_only:  # read where it exists, as fairseq does
        aligned = (f"{prefix}.{args.align_suffix}" for _, prefix in _prefixes(args))
        found += [("--align-suffix", path, "alignment file") for path in aligned if os.path.exists(path)]
    return list(dict((path, (flag, path, what)) for flag, path, what in found).values())


def _dictionaries_written(args) -> List[Tuple[str, Optional[str]]]:
    """(the dictionary path in ``--destdir``, the dictionary given for it) of each language."""
    def path(lang):
        return os.path.join(args.destdir, "dict.txt" if lang is None else f"dict.{lang}.txt")

    written = [(path(args.source_lang), args.srcdict)]
    if not args.only_source:
        written.append((path(args.target_lang), args.tgtdict))
    return written


def check_destdir(args) -> None:
    """``--destdir`` can take this run's files: a directory (or none yet), writable, and
    without a dictionary that building a new one would replace (fairseq refused that
    with a FileExistsError, after writing its log)."""
    destdir = args.destdir
    first = os.path.abspath(destdir)
    while not os.path.lexists(first):
        first = os.path.dirname(first)
    if not os.path.isdir(first):
        raise UserError(f"--destdir {destdir}: {first} is a file, not a directory; choose another --destdir")
    if not os.access(first, os.W_OK | os.X_OK):  # where the stage and then the files go
        raise UserError(f"--destdir {destdir}: {first} is not writable; choose another --destdir")
    for (written, given), flag in zip(_dictionaries_written(args), ("--srcdict", "--tgtdict")):
        if not os.path.exists(written):
            continue
        if given is None:
            raise UserError(
                f"--destdir {destdir} already holds {written}, which a new dictionary would replace (its splits "
                f"were binarized with it): to binarize more splits with it give {flag} {written}; to start "
                "over remove it, or choose another --destdir"
            )
        if _binarized_splits(destdir) and _symbols(given) != _symbols(written):
            raise UserError(
                f"{flag} {given} is not the dictionary of the splits in --destdir {destdir} ({written}: the ids "
                f"differ); replaced, it would misread them: give {flag} {written}, or choose another --destdir"
            )


def _binarized_splits(destdir: str) -> List[str]:
    """The ``.bin`` files ``destdir`` holds (the splits its dictionaries were used for)."""
    return sorted(name for name in os.listdir(destdir) if name.endswith(".bin")) if os.path.isdir(destdir) else []


def _symbols(path: str) -> List[str]:
    """A dictionary file's symbols in order (a symbol's id is its place; counts and flags aside)."""
    with open(path, encoding="utf-8") as handle:
        return [line.split(" ", 1)[0] for line in handle.read().splitlines() if line.strip()]


def check_dictionary_sources(args) -> None:
    """Each dictionary fairseq builds needs ``--trainpref``, unless one is given
    (fairseq asserts it, a traceback)."""
    if args.trainpref:
        return
    needed = [("--srcdict", args.srcdict or (args.joined_dictionary and args.tgtdict))]
    if not args.only_source and not args.joined_dictionary:
        needed.append(("--tgtdict", args.tgtdict))
    missing = [flag for flag, given in needed if not given]
    if missing:
        raise UserError(f"no --trainpref to build the dictionary from: give --trainpref, or {' and '.join(missing)} "
                        "with the dictionary to binarize with")


class _NamedAsGiven(logging.Filter):
    """Log records that name the staging directory name ``--destdir`` instead."""

    def __init__(self, stage: str, destdir: str):
        super().__init__()
        self.stage, self.destdir = stage, destdir

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.stage in message:
            record.msg, record.args = message.replace(self.stage, self.destdir), ()
        return True


@contextlib.contextmanager
def _logged_as_destdir(stage: str, destdir: str) -> Iterator[None]:
    """fairseq's log says ``--destdir`` where it wrote the stage; its log file
    handler into the stage is closed afterwards."""
    logger = logging.getLogger("fairseq_cli.preprocess")
    named = _NamedAsGiven(stage, destdir)
    logger.addFilter(named)
    try:
        yield
    finally:
        logger.removeFilter(named)
        for handler in [h for h in logger.handlers if getattr(h, "baseFilename", "").startswith(stage)]:
            logger.removeHandler(handler)
            handler.close()


def _append_log(staged: str, target: str) -> bool:
    """``preprocess.log`` is appended to (as fairseq does), every other file replaced."""
    if os.path.basename(staged) != LOG:
        return False
    with open(staged, "rb") as source, open(target, "ab") as log:
        shutil.copyfileobj(source, log)
    return True


def staged(stock_main):
    """fairseq-preprocess's ``main(args)``, checked first and writing through a stage."""
    def main(args):
        for flag, path, what in text_inputs(args):
            check_text(path, what, flag=flag)
        check_dictionary_sources(args)
        check_destdir(args)
        destdir = args.destdir
        with staged_files(destdir, merge=_append_log) as stage:
            args.destdir = stage
            try:
                with _logged_as_destdir(stage, destdir):
                    stock_main(args)
            finally:
                args.destdir = destdir

    return main


def guard(module) -> None:
    """Applied by ``alibi-preprocess`` to ``fairseq_cli.preprocess`` (its ``cli_main`` calls ``main``)."""
    if not getattr(module.main, "_alibi_staged", False):
        module.main = staged(module.main)
        module.main._alibi_staged = True

