"""An offline English corpus built from the documentation inside CPython itself.

Every CPython install carries a fair amount of English prose: the interactive
help text in ``pydoc_data.topics`` (the language reference, ~465K characters)
and the docstrings and comments of the standard library.  Together they give
about a million WikiText-style tokens, enough to train and compare small
language models without downloading anything.

Pipeline (``python -m fairseq_alibi.corpus``, or
``examples/language_model/prepare-embedded-corpus.sh``):

1. collect *documents*: one per help topic, one per stdlib module (its
   docstrings and comment blocks, in source order); ``test``/``tests``
   packages and ``site-packages`` are left out, since distributions often ship
   them separately or not at all;
2. tokenize word-level the way WikiText-103 is: Moses (sacremoses) with
   aggressive hyphen splitting (``well @-@ known``), no HTML escaping, and
   WikiText's number separators (``1 @,@ 000 @.@ 5``).  Case is kept, as in
   WikiText (``--lowercase`` to fold it);
3. split into train/valid/test *by document*: documents are ordered by a hash
   of their name (so the split does not depend on the order the filesystem
   lists them in), the first ones go to valid until it holds
   ``valid_fraction`` of all tokens, the next ones to test, the rest to train;
4. drop every paragraph of valid and test that train holds verbatim (the help
   topics repeat each other: ``try`` and ``compound`` share whole sections, and
   stdlib modules share licence and boilerplate comments; left in, a tenth of
   the valid split's tokens were text the model had trained on, which a held-out
   split must not hold, whichever way it moves the perplexity: on the demo's
   models it raised it, docs/extrapolation.md); ``--held-out-overlap keep`` builds
   the corpus as it was before 2026-12-02.  Train, and so the dictionary and any
   model trained on it, is the same either way;
5. close the vocabulary like WikiText: words seen fewer than ``min_count``
   times in train become ``<unk>`` in every split;
6. write ``wiki.{train,valid,test}.tokens`` and binarize them with
   ``alibi-preprocess --only-source`` (each split whole or not at all).

The result depends only on the Python version's stdlib (a different CPython
release gives a slightly different corpus); ``corpus.json`` next to the binary
data records the Python version, the settings and the token counts.  Running
again with the same settings and an intact output does nothing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
import tokenize
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import CorpusError, one_line, plural, report_errors
from .inputs import check_text

logger = logging.getLogger("fairseq_alibi.corpus")

SPLITS = ("train", "valid", "test")
SOURCES = ("topics", "docstrings", "comments")
HELD_OUT_OVERLAP = ("drop", "keep")
# Directories of the stdlib that are not documentation of the library itself,
# or that distributions commonly split off.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
UNK = "<unk>"
MANIFEST = "corpus.json"
BINARY_FILES = ("dict.txt",) + tuple(f"{s}.{ext}" for s in SPLITS for ext in ("bin", "idx"))


@dataclass
class Document:
    name: str  # stable identifier, e.g. "topic:assert" or "module:json/decoder.py"
    title: str
    paragraphs: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------- sources


def _paragraphs(text: str) -> List[str]:
    """Blank-line separated paragraphs, each with its whitespace collapsed."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(block.split())
        if block:
            out.append(block)
    return out


def topic_documents() -> List[Document]:
    """One document per help topic of ``pydoc_data.topics``."""
    try:
        from pydoc_data import topics
    except ImportError as exc:  # some minimal Python builds drop it
        raise CorpusError(
            "pydoc_data.topics is not available in this Python "
            f"({sys.executable}); use --sources docstrings,comments or a full CPython install"
        ) from exc
    docs = []
    for name in sorted(topics.topics):
        paras = _paragraphs(topics.topics[name])
        if paras:
            docs.append(Document(f"topic:{name}", name, paras))
    return docs


def _module_blocks(source: str, docstrings: bool, comments: bool) -> List[Tuple[int, str]]:
    """(line, text) of the docstrings and comment blocks of one source file."""
    blocks: List[Tuple[int, str]] = []
    if docstrings:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    line = node.body[0].lineno if node.body else 0
                    blocks.append((line, doc))
    if comments:
        current: List[str] = []
        start = last = -10
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            row = tok.start[0]
            if text.startswith("!") or "coding" in text and row <= 2:
                continue  # shebang / encoding line
            if row != last + 1 and current:
                blocks.append((start, " ".join(current)))
                current = []
            if not current:
                start = row
            if text:
                current.append(text)
            last = row
        if current:
            blocks.append((start, " ".join(current)))
    blocks.sort(key=lambda b: b[0])
    return blocks


def stdlib_documents(
    stdlib_dir: Optional[str] = None, docstrings: bool = True, comments: bool = True
) -> List[Document]:
    """One document per stdlib module with any docstring or comment text."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise CorpusError(f"standard library directory not found: {root}")
    docs, skipped = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = os.path.join(dirpath, filename)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                with tokenize.open(path) as f:  # the encoding its coding line declares (PEP 263), UTF-8 without
                    source = f.read()
                blocks = _module_blocks(source, docstrings, comments)
            except (SyntaxError, UnicodeDecodeError, tokenize.TokenError, ValueError):
                skipped += 1  # e.g. deliberately broken files: not documentation
                continue
            paras = [p for _, text in blocks for p in _paragraphs(text)]
            if paras:
                docs.append(Document(f"module:{rel}", rel[:-3].replace("/", "."), paras))
    if not docs:
        raise CorpusError(f"no Python sources with documentation found under {root}")
    if skipped:
        logger.info("%d .py files under %s skipped: not Python, or not in the encoding they declare", skipped, root)
    return docs


def collect_documents(sources: Sequence[str], stdlib_dir: Optional[str] = None) -> List[Document]:
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise CorpusError(f"unknown corpus {plural(len(bad or sources), 'source')} {bad or sources!r}; choose from "
                          f"{', '.join(SOURCES)}")
    docs = []
    if "topics" in sources:
        docs += topic_documents()
    if "docstrings" in sources or "comments" in sources:
        docs += stdlib_documents(stdlib_dir, "docstrings" in sources, "comments" in sources)
    return docs


# --------------------------------------------------------------------------- tokenization

_NUMBER_SEPARATOR = re.compile(r"(?<=\d)([,.])(?=\d)")


class WikiTextTokenizer:
    """Moses tokenization with WikiText-103's conventions."""

    def __init__(self, lowercase: bool = False):
        from sacremoses import MosesTokenizer

        self.moses = MosesTokenizer(lang="en")
        self.lowercase = lowercase

    def __call__(self, text: str) -> str:
        text = self.moses.tokenize(text, aggressive_dash_splits=True, escape=False, return_str=True)
        text = _NUMBER_SEPARATOR.sub(r" @\1@ ", text)
        # A literal "<unk>" in the source must not collide with the unknown word.
        text = text.replace(UNK, "< unk >")
        text = " ".join(text.split())
        return text.lower() if self.lowercase else text


def tokenize_document(doc: Document, tokenizer: WikiTextTokenizer) -> List[str]:
    """WikiText layout: a ``= title =`` heading line, then one line per paragraph."""
    lines = [f"= {tokenizer(doc.title)} ="]
    lines += [t for t in (tokenizer(p) for p in doc.paragraphs) if t]
    return lines


# --------------------------------------------------------------------------- split


def _doc_key(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()


def count_tokens(lines: Iterable[str]) -> int:
    """Tokens as WikiText counts them: whitespace-separated words plus one per line end."""
    return sum(len(line.split()) + 1 for line in lines)


def split_documents(
    docs: Sequence[Tuple[str, List[str]]], valid_fraction: float, test_fraction: float
) -> Dict[str, List[Tuple[str, List[str]]]]:
    """Assign whole documents to splits (deterministic; see the module docstring)."""
    if not (0 < valid_fraction < 1 and 0 < test_fraction < 1 and valid_fraction + test_fraction < 1):
        raise CorpusError("valid and test fractions must be in (0, 1) and sum to less than 1")
    total = sum(count_tokens(lines) for _, lines in docs)
    targets = {"valid": valid_fraction * total, "test": test_fraction * total}
    splits: Dict[str, List[Tuple[str, List[str]]]] = {s: [] for s in SPLITS}
    filled = {"valid": 0, "test": 0}
    for name, lines in sorted(docs, key=lambda d: _doc_key(d[0])):
        for split in ("valid", "test"):
            if filled[split] < targets[split]:
                break
        else:
            split = "train"
        splits[split].append((name, lines))
        if split != "train":
            filled[split] += count_tokens(lines)
    for split in SPLITS:
        if not splits[split]:
            raise CorpusError(f"the {split} split is empty: too few documents for these fractions")
    # Within a split, keep a readable order (by document name).
    for split in SPLITS:
        splits[split].sort(key=lambda d: d[0])
    return splits


def drop_train_overlap(splits: Dict[str, List[Tuple[str, List[str]]]]) -> Dict[str, Dict[str, int]]:
    """Remove, in place, the paragraphs of valid and test that occur verbatim in train.

    A document's ``= title =`` heading stays (it keeps the WikiText layout, and
    titles are the documents' own).  Returns, per held-out split, the lines and
    tokens dropped (tokens counted as ``count_tokens`` counts them)."""
    in_train = {line for _, lines in splits["train"] for line in lines}
    dropped = {}
    for split in ("valid", "test"):
        lines_dropped = tokens_dropped = 0
        for i, (name, lines) in enumerate(splits[split]):
            kept, removed = [], []
            for k, line in enumerate(lines):
                (removed if k > 0 and line in in_train else kept).append(line)
            lines_dropped += len(removed)
            tokens_dropped += count_tokens(removed)
            splits[split][i] = (name, kept)
        dropped[split] = {"lines": lines_dropped, "tokens": tokens_dropped}
    return dropped


def close_vocabulary(splits: Dict[str, List[Tuple[str, List[str]]]], min_count: int) -> int:
    """Replace words seen fewer than ``min_count`` times in train by ``<unk>``, in place.

    Returns the resulting vocabulary size (``<unk>`` included)."""
    counts = collections.Counter(
        w for _, lines in splits["train"] for line in lines for w in line.split()
    )
    vocab = {w for w, c in counts.items() if c >= min_count}
    for split in SPLITS:
        for i, (name, lines) in enumerate(splits[split]):
            new = [" ".join(w if w in vocab else UNK for w in line.split()) for line in lines]
            splits[split][i] = (name, new)
    return len(vocab | {UNK})


# --------------------------------------------------------------------------- driver


@dataclass
class CorpusConfig:
    destdir: str = "data-bin/embedded"
    rawdir: Optional[str] = None  # default: <destdir>/raw
    sources: Tuple[str, ...] = SOURCES
    stdlib_dir: Optional[str] = None
    lowercase: bool = False
    min_count: int = 3
    valid_fraction: float = 0.05
    test_fraction: float = 0.05
    held_out_overlap: str = "drop"
    workers: int = 2

    def settings(self) -> dict:
        """What determines the corpus content (the manifest is compared on this)."""
        d = asdict(self)
        d["sources"] = list(self.sources)
        d["stdlib_dir"] = os.path.abspath(self.stdlib_dir or sysconfig.get_paths()["stdlib"])
        d["python"] = sys.version.split()[0]
        for key in ("destdir", "rawdir", "workers"):
            d.pop(key)
        if self.held_out_overlap == "keep":
            d.pop("held_out_overlap")  # a manifest written before the option was this corpus
        return d


def _raw_path(rawdir: str, split: str) -> str:
    return os.path.join(rawdir, f"wiki.{split}.tokens")


def is_prepared(cfg: CorpusConfig) -> bool:
    manifest = os.path.join(cfg.destdir, MANIFEST)
    if not os.path.isfile(manifest):
        return False
    if not all(os.path.isfile(os.path.join(cfg.destdir, f)) for f in BINARY_FILES):
        return False
    try:
        with open(manifest, encoding="utf-8") as f:
            return json.load(f).get("settings") == cfg.settings()
    except (OSError, ValueError):
        return False


def binarize(rawdir: str, destdir: str, workers: int = 1) -> None:
    """``alibi-preprocess --only-source`` on the three raw splits: each checked as
    text first, the binaries written whole or not at all (the console script beside this
    interpreter: ``fairseq_alibi.preprocess``)."""
    for split in SPLITS:
        check_text(_raw_path(rawdir, split), f"tokenized {split} split")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "alibi-preprocess"), "--only-source",
        "--trainpref", _raw_path(rawdir, "train"),
        "--validpref", _raw_path(rawdir, "valid"),
        "--testpref", _raw_path(rawdir, "test"),
        "--destdir", destdir, "--workers", str(max(1, workers)),
    ]
    logger.info("binarizing: %s", " ".join(cmd))
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        said = [line[len("error: "):] for line in result.stdout.splitlines() if line.startswith("error: ")]
        raise CorpusError(f"binarizing failed (alibi-preprocess exit status {result.returncode}): "
                          + (said[-1] if said else one_line(result.stdout[-2000:])))


#: Settings a rebuild may change in place without a word: the held-out overlap (the recipes set it) and
#: the Python that read the sources.  Another source, directory, case or split is another corpus.
REBUILT_IN_PLACE = ("held_out_overlap", "python")


def recorded_settings(destdir: str) -> Optional[dict]:
    """The settings of the corpus built in ``destdir`` (its manifest's), or None."""
    try:
        with open(os.path.join(destdir, MANIFEST), encoding="utf-8") as f:
            settings = json.load(f).get("settings")
    except (OSError, ValueError):
        return None
    return settings if isinstance(settings, dict) else None


def as_built(cfg: CorpusConfig) -> CorpusConfig:
    """``cfg`` with the content settings of the corpus already in its
    ``destdir`` (its sources, directory, case, count and split fractions),
    keeping ``cfg``'s held-out overlap: what a recipe rebuilds when it asks
    for another overlap, so that a corpus of another package's docstrings
    stays that package's (``--as-built``)."""
    recorded = recorded_settings(cfg.destdir)
    if recorded is None:
        return cfg
    kept = {key: recorded[key] for key in ("stdlib_dir", "lowercase", "min_count", "valid_fraction",
                                           "test_fraction") if key in recorded}
    if "sources" in recorded:
        kept["sources"] = tuple(recorded["sources"])
    return replace(cfg, **kept)


def check_replaces_nothing_else(cfg: CorpusConfig) -> None:
    """A ``CorpusError`` if ``cfg.destdir`` holds a corpus built with other
    content settings than ``cfg``'s (beyond :data:`REBUILT_IN_PLACE`): a
    rebuild would replace, say, a corpus of NumPy's docstrings with CPython's
    under the same name, and every number after it would describe another
    corpus than the one the user built there."""
    recorded = recorded_settings(cfg.destdir)
    if recorded is None:
        return
    wanted = cfg.settings()
    for key in sorted(set(recorded) | set(wanted)):
        if key in REBUILT_IN_PLACE or recorded.get(key) == wanted.get(key):
            continue
        raise CorpusError(
            f"{cfg.destdir} holds a corpus built with {key}={recorded.get(key)!r}, and this command asks for "
            f"{key}={wanted.get(key)!r}: rebuilding would replace that corpus with another under the same name; "
            "give --as-built to keep its settings (a recipe's DATA), another --destdir, or --force to replace it")


def prepare(cfg: CorpusConfig, force: bool = False) -> dict:
    """Build (or find already built) the corpus; returns the manifest."""
    if cfg.held_out_overlap not in HELD_OUT_OVERLAP:
        raise CorpusError(f"held_out_overlap is {cfg.held_out_overlap!r}; choose from {', '.join(HELD_OUT_OVERLAP)}")
    manifest_path = os.path.join(cfg.destdir, MANIFEST)
    if not force:
        check_replaces_nothing_else(cfg)
    if not force and is_prepared(cfg):
        logger.info("corpus already prepared in %s (delete it or pass --force to rebuild)", cfg.destdir)
        with open(manifest_path, encoding="utf-8") as f:
            return json.load(f)
    rawdir = cfg.rawdir or os.path.join(cfg.destdir, "raw")
    docs = collect_documents(cfg.sources, cfg.stdlib_dir)
    logger.info("tokenizing %d documents", len(docs))
    tokenizer = WikiTextTokenizer(lowercase=cfg.lowercase)
    tokenized = [(d.name, tokenize_document(d, tokenizer)) for d in docs]
    splits = split_documents(tokenized, cfg.valid_fraction, cfg.test_fraction)
    dropped = drop_train_overlap(splits) if cfg.held_out_overlap == "drop" else None
    if dropped:
        logger.info("held-out paragraphs also in train, dropped: %s", ", ".join(
            f"{s} {d['lines']} lines, {d['tokens']} tokens" for s, d in dropped.items()))
    vocab_size = close_vocabulary(splits, cfg.min_count)

    os.makedirs(rawdir, exist_ok=True)  # only now: every input was read
    stats = {}
    for split in SPLITS:
        lines = [line for _, doc_lines in splits[split] for line in doc_lines]
        tmp = _raw_path(rawdir, split) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, _raw_path(rawdir, split))
        stats[split] = {
            "documents": len(splits[split]),
            "lines": len(lines),
            "tokens": count_tokens(lines),
            "unk": sum(line.split().count(UNK) for line in lines),
        }
        logger.info("%s: %d documents, %d tokens", split, stats[split]["documents"], stats[split]["tokens"])

    # A rebuild replaces the old binaries (fairseq-preprocess will not
    # overwrite a dict.txt); the manifest goes first, so an interrupted
    # rebuild is never mistaken for a finished one.
    for name in (MANIFEST,) + BINARY_FILES:
        if os.path.exists(os.path.join(cfg.destdir, name)):
            os.remove(os.path.join(cfg.destdir, name))
    binarize(rawdir, cfg.destdir, cfg.workers)
    manifest = {
        "settings": cfg.settings(),
        "splits": stats,
        "vocabulary": vocab_size,
        "dropped_train_overlap": dropped,
        "documents": {s: [name for name, _ in splits[s]] for s in SPLITS},
    }
    with open(manifest_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    os.replace(manifest_path + ".tmp", manifest_path)
    return manifest


def get_parser() -> argparse.ArgumentParser:
    from .arguments import OneLineParser

    p = OneLineParser(
        prog="python -m fairseq_alibi.corpus",
        description="Build an offline WikiText-style corpus from CPython's own documentation "
        "and binarize it for fairseq.",
    )
    p.add_argument("--destdir", default=CorpusConfig.destdir, help="binarized output (default: %(default)s)")
    p.add_argument("--rawdir", default=None, help="tokenized text output (default: DESTDIR/raw)")
    p.add_argument("--sources", default=",".join(SOURCES),
                   help=f"comma-separated subset of {','.join(SOURCES)} (default: all)")
    p.add_argument("--stdlib-dir", default=None, help="standard library to read (default: this Python's)")
    p.add_argument("--lowercase", action="store_true", help="fold case (WikiText keeps it; default: keep)")
    p.add_argument("--min-count", type=int, default=CorpusConfig.min_count,
                   help="train count below which a word becomes <unk> (default: %(default)s)")
    p.add_argument("--valid-fraction", type=float, default=CorpusConfig.valid_fraction)
    p.add_argument("--test-fraction", type=float, default=CorpusConfig.test_fraction)
    p.add_argument("--held-out-overlap", choices=HELD_OUT_OVERLAP, default=CorpusConfig.held_out_overlap,
                   help="a valid or test paragraph that train holds verbatim: drop it (default), or keep "
                   "it (the corpus as built before 2026-12-02, for the numbers measured on it)")
    p.add_argument("--workers", type=int, default=CorpusConfig.workers, help="fairseq-preprocess workers")
    p.add_argument("--force", action="store_true", help="rebuild even if an identical corpus exists, or "
                   "replace a corpus built in DESTDIR with other settings")
    p.add_argument("--as-built", action="store_true", help="take the sources, directory, case, count and "
                   "split fractions of the corpus already in DESTDIR (if any), so that only --held-out-overlap "
                   "can change it: what the recipes run on their DATA")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stdout, force=True)
    args = get_parser().parse_args(argv)
    cfg = CorpusConfig(
        destdir=args.destdir, rawdir=args.rawdir,
        sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
        stdlib_dir=args.stdlib_dir, lowercase=args.lowercase, min_count=args.min_count,
        valid_fraction=args.valid_fraction, test_fraction=args.test_fraction,
        held_out_overlap=args.held_out_overlap, workers=args.workers,
    )
    if args.as_built:
        cfg = as_built(cfg)
    with report_errors():
        manifest = prepare(cfg, force=args.force)
    splits = manifest["splits"]
    print(
        f"corpus in {cfg.destdir}: vocabulary {manifest['vocabulary']:,}; "
        + ", ".join(f"{s} {splits[s]['tokens']:,} tokens ({splits[s]['documents']} docs)" for s in SPLITS)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
