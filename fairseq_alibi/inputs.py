"""Every text and data input, checked by class before anything is written.

* :func:`check_text`: one validator for every text a tool reads (a corpus
  split given to ``alibi-preprocess``, a dictionary, ``alibi-sweep --hf``'s
  text, a ``--task`` JSONL file, ``alibi-interactive --input``, a Hydra
  config, GPT-2's BPE files): a regular file, not empty, no NUL byte, UTF-8
  throughout; what is wrong is named with its byte offset and line, and the
  command that fixes it.  fairseq reads text with ``encoding="utf-8"`` and
  failed on anything else deep inside (a traceback, ``negative seek position
  -1``), after it had written half a dataset.
* :func:`data_dir_problem`: a data directory's dictionaries and splits
  (``splits.split_problem`` says what a half split is).
"""

from __future__ import annotations

import codecs
import os
import shlex
import stat
from typing import Optional, Tuple

from .errors import TextInputError, _not_a_directory
from .splits import split_problem

#: Bytes read at a time: a corpus of gigabytes is checked in constant memory.
CHUNK = 1 << 20
#: Byte-order marks of encodings that are not UTF-8, longest first (UTF-32 LE starts like UTF-16 LE).
FOREIGN_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
#: How compressed files start (none of them is how a text starts), and the command that unpacks each.
COMPRESSED = ((b"\x1f\x8b", "gzip-compressed", "gunzip -k"), (b"PK\x03\x04", "a zip archive", "unzip"),
              (b"\xfd7zXZ\x00", "xz-compressed", "unxz -k"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"))


def _converted_name(path: str) -> str:
    """``latin/valid.txt`` -> ``latin/valid.utf8.txt``: where a conversion command writes."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.utf8{ext}"


def _iconv(path: str, encoding: str) -> str:
    return f"iconv -f {encoding} -t utf-8 {shlex.quote(path)} > {shlex.quote(_converted_name(path))}"


def _a(what: str) -> str:
    """``what`` with its indefinite article (an input file, a text file)."""
    return ("an " if what[:1].lower() in "aeiou" else "a ") + what


def _kind_problem(path: str, what: str) -> str:
    """Why ``path`` is not a readable regular file, or ``""``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"{path} is a broken symbolic link (its target {os.readlink(path)} does not exist)"
        return f"{what} not found: {path}"
    except NotADirectoryError:
        return _not_a_directory(path)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if stat.S_ISDIR(mode):
        return f"{path} is a directory, not {_a(what)}: give the file itself"
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file (a device, a pipe, ...): give {_a(what)}"
    if not os.access(path, os.R_OK):
        return f"cannot read {path}: permission denied (check its permissions)"
    return ""


def _start_problem(path: str, what: str, head: bytes, bom_ok: bool) -> str:
    """An empty file, or a byte-order mark that says another encoding (or, where
    the reader would keep it as part of the first word, UTF-8's)."""
    if not head:
        return f"{path} is empty (0 bytes): give a non-empty {what}"
    for magic, kind, command in COMPRESSED:
        if head.startswith(magic):
            return f"{path} is {kind}, not text: unpack it first ({command} {shlex.quote(path)})"
    for bom, encoding in FOREIGN_BOMS:
        if head.startswith(bom):
            return (f"{path} is {encoding.upper()} text (it starts with a {encoding.upper()} byte-order mark), not "
                    f"UTF-8: convert it, e.g. {_iconv(path, encoding)}")
    if head.startswith(codecs.BOM_UTF8) and not bom_ok:
        return (f"{path} starts with a UTF-8 byte-order mark, which its reader takes as text (fairseq: part of the "
                f"first word): remove it, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' {shlex.quote(path)}")
    return ""


def _where(offset: int, line: int) -> str:
    return f"byte offset {offset} (line {line})"


def _nul_message(path: str, where: str) -> str:
    return (f"{path} holds a NUL byte at {where}: binary data, or UTF-16/UTF-32 text without a byte-order mark? "
            f"give UTF-8 text (e.g. {_iconv(path, 'utf-16')})")


def _decode_message(path: str, where: str, exc: UnicodeDecodeError, final: bool) -> str:
    if final:
        fault = f"it ends inside a character begun at {where}"
    else:
        fault = f"byte 0x{exc.object[exc.start]:02x} at {where} cannot be decoded ({exc.reason})"
    return f"{path} is not UTF-8 text: {fault}; convert it to UTF-8, e.g. from Latin-1: {_iconv(path, 'latin1')}"


def _lone_carriage_return(chunk: bytes, cr_before: bool) -> Optional[int]:
    """The offset in ``chunk`` of a ``\\r`` not followed by ``\\n`` (-1: the last
    chunk's final one, ``cr_before``), or None.  Python's text mode, which
    fairseq reads with, takes a lone ``\\r`` as a line break (universal newlines)."""
    if cr_before and not chunk.startswith(b"\n"):
        return -1
    at = chunk.find(b"\r")
    while at >= 0:
        if at + 1 < len(chunk) and chunk[at + 1:at + 2] != b"\n":
            return at
        at = chunk.find(b"\r", at + 1)
    return None


def _content_problem(path: str, handle) -> Tuple[str, bool]:
    """(what is wrong in the bytes of ``handle``, the first fault first; whether
    any of it is text, not whitespace)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset, lines, text_seen, cr_before = 0, 1, False, False
    while True:
        chunk = handle.read(CHUNK)
        pending = len(decoder.getstate()[0])  # bytes of a character the last chunk cut (no newline among them)
        nul = chunk.find(b"\0")
        try:
            text = decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as exc:
            at = exc.start - pending  # in ``chunk``; negative: in the cut character
            if nul < 0 or at < nul:
                where = _where(offset + at, lines + chunk.count(b"\n", 0, max(at, 0)))
                return _decode_message(path, where, exc, final=not chunk), text_seen
            text = ""
        if nul >= 0:
            return _nul_message(path, _where(offset + nul, lines + chunk.count(b"\n", 0, nul))), text_seen
        lone = _lone_carriage_return(chunk, cr_before)
        if lone is not None:
            where = _where(offset + lone, lines + chunk.count(b"\n", 0, max(lone, 0)))
            return (f"{path} holds a carriage return not followed by a line feed at {where}: fairseq reads it as a "
                    "line break, so its lines would not be the file's; end lines with \\n (or \\r\\n), e.g. "
                    f"sed 's/\\r$//' {shlex.quote(path)} | tr '\\r' '\\n' > {shlex.quote(_converted_name(path))} "
                    "(line ends \\r\\n become \\n, the lone \\r line breaks)"), text_seen
        mark = chunk.find(codecs.BOM_UTF8, 1 if offset == 0 else 0)
        if mark >= 0:
            where = _where(offset + mark, lines + chunk.count(b"\n", 0, mark))
            return (f"{path} holds a UTF-8 byte-order mark inside the text at {where} (files joined with cat?): "
                    "fairseq reads it as part of a word; remove it, e.g. sed -i 's/\\xEF\\xBB\\xBF//g' "
                    f"{shlex.quote(path)}"), text_seen
        cr_before = chunk.endswith(b"\r")
        text_seen = text_seen or bool(text.replace("\ufeff", "").strip())
        if not chunk:
            return "", text_seen
        offset += len(chunk)
        lines += chunk.count(b"\n")


def text_problem(path: str, what: str = "text file", bom_ok: bool = False) -> str:
    """What makes ``path`` unusable as UTF-8 text, or ``""``.  ``bom_ok``: the
    reader skips a UTF-8 byte-order mark (it opens with ``utf-8-sig``)."""
    problem = _kind_problem(path, what)
    if problem:
        return problem
    try:
        with open(path, "rb") as handle:
            problem = _start_problem(path, what, handle.read(8), bom_ok)
            if problem:
                return problem
            handle.seek(0)
            problem, text_seen = _content_problem(path, handle)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if not problem and not text_seen:
        return f"{path} holds no text (only blank lines or spaces): give a {what} with text"
    return problem


def check_text(path: str, what: str = "text file", bom_ok: bool = False, flag: Optional[str] = None) -> None:
    """Raise :class:`TextInputError` if ``path`` is not usable UTF-8 text (``flag``:
    the option that named it, said first)."""
    problem = text_problem(path, what, bom_ok)
    if problem:
        raise TextInputError(f"{flag}: {problem}" if flag else problem)


# ------------------------------------------------------------ binarized splits


def data_dir_problem(directory: str, subsets) -> str:
    """The first problem of a data directory: a dictionary (``dict*.txt``) that is
    not UTF-8 text, or a split named after one of ``subsets`` (``train``,
    ``train1``, ``valid.de-en.de``) that is half there; ``""`` if none (a missing
    directory is fairseq's to name)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return ""
    for name in names:
        if name.startswith("dict") and name.endswith(".txt"):
            problem = text_problem(os.path.join(directory, name), "dictionary")
            if problem:
                return problem
    prefixes = sorted({name[:-4] for name in names if name.endswith((".bin", ".idx"))
                       and name.startswith(tuple(s for s in subsets if s))})
    for prefix in prefixes:
        problem = split_problem(os.path.join(directory, prefix))
        if problem:
            return problem
    return ""
