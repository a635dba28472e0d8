"""Every text and data input checked before any output is written; outputs whole or not at all
(fairseq_alibi/inputs.py, preprocess.py, staging.py, and every reader that uses them)."""

from __future__ import annotations

import gzip
import os
import random
import re
import signal
import stat
import sys
from pathlib import Path

import pytest

from conftest import error_lines, run_cli, tool, train_args
from fairseq_alibi import inputs, splits, staging
from fairseq_alibi.errors import TextInputError

#: The invalid texts every reader is fed: (bytes, what its one error line says).
BAD_TEXTS = {
    "latin1": (b"one the caf\xe9 sees a tree .\n", "is not UTF-8 text: byte 0xe9 at byte offset 11 (line 1) cannot be decoded"),
    "utf16": ("one the cat sees a tree .\n".encode("utf-16"), "is UTF-16 text (it starts with a UTF-16 byte-order"),
    "nul": (b"one the cat sees a tree .\ntwo\x00 the cat\n", "holds a NUL byte at byte offset 29 (line 2)"),
    "empty": (b"", "is empty (0 bytes)"),
}
GOOD_TEXT = "".join(f"{n} the cat sees a tree .\n" for n in ("one", "two", "three")) * 4


def snapshot(directory: Path) -> dict:
    """Every file under ``directory`` (relative name -> bytes), hidden ones included."""
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_one_error(result, expected: str) -> None:
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1 and expected in lines[0], result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]


# ------------------------------------------------------------ the validator


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


TEXT_CASES = [
    # (name, how to make it, bom_ok, expected ("" = accepted))
    ("good", lambda p: p.write_text(GOOD_TEXT), False, ""),
    ("crlf", lambda p: p.write_bytes(b"one the cat\r\ntwo\r\n"), False, ""),
    ("crlf across a read", lambda p: p.write_bytes(b"a" * (inputs.CHUNK - 1) + b"\r\ntwo\r\n"), False, ""),
    # fairseq reads a lone \r as a line break: 3 sentences binarized from a file of 2 lines
    ("lone carriage return", lambda p: p.write_bytes(b"alpha beta\rgamma delta\nepsilon\n"), False,
     "carriage return not followed by a line feed at byte offset 10 (line 1)"),
    ("lone carriage return ending a read", lambda p: p.write_bytes(b"a" * (inputs.CHUNK - 1) + b"\rtwo\n"), False,
     f"carriage return not followed by a line feed at byte offset {inputs.CHUNK - 1} (line 1)"),
    ("utf8 bom inside", lambda p: p.write_bytes(b"one\n\xef\xbb\xbftwo\n"), True,
     "byte-order mark inside the text at byte offset 4 (line 2)"),
    ("utf8 multibyte", lambda p: p.write_text("caf\u00e9 \u20ac \U0001d11e\n"), False, ""),
    ("utf8 bom skipped", lambda p: p.write_bytes(b"\xef\xbb\xbfone the cat\n"), True, ""),
    ("utf8 bom kept", lambda p: p.write_bytes(b"\xef\xbb\xbfone the cat\n"), False, "starts with a UTF-8 byte-order"),
    ("utf16 le bom", lambda p: p.write_bytes(b"\xff\xfe" + "one".encode("utf-16-le")), False, "is UTF-16 text"),
    ("utf16 be bom", lambda p: p.write_bytes(b"\xfe\xff" + "one".encode("utf-16-be")), False, "is UTF-16 text"),
    ("utf32 bom", lambda p: p.write_bytes("one\n".encode("utf-32")), False, "is UTF-32 text"),
    ("utf16 without bom", lambda p: p.write_bytes("one\n".encode("utf-16-le")), False,
     "holds a NUL byte at byte offset 1 (line 1)"),
    ("cut character", lambda p: p.write_bytes(b"one\ncaf\xc3"), False,
     "it ends inside a character begun at byte offset 7 (line 2)"),
    ("lone continuation", lambda p: p.write_bytes(b"one\ntwo\n\x80"), False, "byte 0x80 at byte offset 8 (line 3)"),
    ("blank lines", lambda p: p.write_text("\n  \n\t\n"), False, "holds no text (only blank lines or spaces)"),
    ("directory", lambda p: p.mkdir(), False, "is a directory, not a text file"),
    ("missing", lambda p: None, False, "text file not found"),
    ("broken link", lambda p: p.symlink_to(p.parent / "gone"), False, "is a broken symbolic link"),
    ("fifo", _fifo, False, "is not a regular file"),
    ("gzip", lambda p: p.write_bytes(gzip.compress(b"one the cat\n")), False,
     "is gzip-compressed, not text: unpack it first (gunzip -k"),
] + [(f"bad {name}", lambda p, data=data: p.write_bytes(data), False, expected)
     for name, (data, expected) in BAD_TEXTS.items()]


@pytest.mark.parametrize("name,make,bom_ok,expected", TEXT_CASES, ids=[c[0] for c in TEXT_CASES])
def test_text_problem_by_class(name, make, bom_ok, expected, tmp_path):
    path = tmp_path / "text.txt"
    make(path)
    problem = inputs.text_problem(str(path), "text file", bom_ok=bom_ok)
    if not expected:
        assert problem == ""
        return
    assert problem.startswith(str(path)) or str(path) in problem, problem
    assert expected in problem, problem
    with pytest.raises(TextInputError, match="^--x: "):
        inputs.check_text(str(path), flag="--x")


def test_the_suggested_carriage_return_fix_keeps_the_lines(tmp_path):
    """The command a lone carriage return's message suggests, run as given on a
    file of \\r\\n line ends with one stray \\r, gives the lines Python reads in
    it (4), not one empty line after each \\r\\n (tr alone: 7)."""
    import shlex
    import subprocess

    path = tmp_path / "mixed.txt"
    path.write_bytes(b"a b\r\nc\rd\r\ne f\r\n")
    problem = inputs.text_problem(str(path))
    command = problem[problem.index("e.g. ") + len("e.g. "):problem.rindex(" (line ends")]
    subprocess.run(["bash", "-c", command], check=True, cwd=tmp_path)
    fixed = Path(shlex.split(command)[-1])
    fixed = fixed if fixed.is_absolute() else tmp_path / fixed
    assert fixed.read_bytes() == b"a b\nc\nd\ne f\n"
    assert inputs.text_problem(str(fixed)) == ""


#: Pieces of random byte strings: ASCII, newlines, characters of 2, 3 and 4 bytes, and faults.
PIECES = [b"a", b" ", b"\n", "\u00e9".encode(), "\u20ac".encode(), "\U0001d11e".encode(),
          b"\xe9", b"\xff", b"\x00", b"\xe2\x82", b"\xc3"]


def first_fault(data: bytes):
    """(byte offset, line) of the first fault, by Python's whole-string decoder and bytes.find."""
    faults = []
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        faults.append(exc.start)
    if b"\x00" in data:
        faults.append(data.index(b"\x00"))
    if not faults:
        return None
    at = min(faults)
    return at, data[:at].count(b"\n") + 1


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_fault_offsets_agree_with_a_whole_file_decode(chunk, tmp_path, monkeypatch):
    """Read in chunks of any size (a character cut between two), the offset and line
    named are those of the first fault of the whole file."""
    monkeypatch.setattr(inputs, "CHUNK", chunk)
    rng = random.Random(chunk)
    path = tmp_path / "t.txt"
    for _ in range(150):
        pieces = [rng.choice(PIECES[:6] if rng.random() < 0.6 else PIECES) for _ in range(rng.randint(1, 40))]
        data = b"x" + b"".join(pieces)
        path.write_bytes(data)
        problem = inputs.text_problem(str(path))
        fault = first_fault(data)
        if fault is None:
            assert problem == "", (data, problem)
        else:
            assert f"byte offset {fault[0]} (line {fault[1]})" in problem, (data, problem)


# ------------------------------------------------------------ every text reader


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A tiny corpus binarized by stock fairseq-preprocess (its dict.txt, train and valid)."""
    root = tmp_path_factory.mktemp("small")
    (root / "train.txt").write_text(GOOD_TEXT)
    run_cli([tool("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt", "--validpref",
             root / "train.txt", "--destdir", root / "data", "--workers", "1"])
    return root


def _with_bad_dict(small_data, tmp_path, bad):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        os.link(small_data / "data" / name, data / name)
    (data / "dict.txt").write_bytes(bad)
    return data


#: Every console script that reads a text: (id, argv; BAD is the invalid text, BADDICT a data
#: directory whose dict.txt is it, DICT and GOOD valid inputs, OUT what must not appear).
READERS = [
    ("preprocess --validpref", ["alibi-preprocess", "--only-source", "--validpref", "BAD", "--srcdict", "DICT",
                                "--destdir", "OUT"]),
    ("preprocess --trainpref", ["alibi-preprocess", "--only-source", "--trainpref", "BAD", "--destdir", "OUT"]),
    ("preprocess --srcdict", ["alibi-preprocess", "--only-source", "--validpref", "GOOD", "--srcdict", "BAD",
                              "--destdir", "OUT"]),
    ("sweep --hf text", ["alibi-sweep", "BAD", "--hf", "m=MISSING", "--cpu", "--no-progress", "-o", "OUT"]),
    ("sweep dict.txt", ["alibi-sweep", "BADDICT", "-c", "m=MISSING", "--cpu", "--no-progress", "-o", "OUT"]),
    ("retrieval --task", ["alibi-retrieval", "DATA", "-c", "m=MISSING", "--task", "BAD", "--cpu", "--no-progress",
                          "-o", "OUT"]),
    ("train dict.txt", ["alibi-train", *train_args("BADDICT", "OUT", max_update=1)]),
    ("interactive --input", ["alibi-interactive", "DATA", "--path", "MISSING", "--input", "BAD"]),
    ("hydra config", ["alibi-hydra-train", "--config-dir", "BADDIR", "--config-name", "bad"]),
]


@pytest.mark.parametrize("kind", list(BAD_TEXTS))
@pytest.mark.parametrize("reader,argv", READERS, ids=[r[0] for r in READERS])
@pytest.mark.slow
def test_every_text_reader_refuses_invalid_text(reader, argv, kind, small_data, tmp_path):
    """One ``error:`` line naming the file and what is wrong, exit 1, nothing written."""
    data, expected = BAD_TEXTS[kind]
    bad = tmp_path / ("bad.yaml" if reader == "hydra config" else "bad.txt")
    bad.write_bytes(data)
    (tmp_path / "good.txt").write_text(GOOD_TEXT)
    named = {"BAD": bad, "GOOD": tmp_path / "good.txt", "DICT": small_data / "data" / "dict.txt",
             "DATA": small_data / "data", "OUT": tmp_path / "out", "MISSING": tmp_path / "missing",
             "BADDIR": tmp_path}
    if "BADDICT" in argv:
        named["BADDICT"] = _with_bad_dict(small_data, tmp_path, data)
        bad = named["BADDICT"] / "dict.txt"
    argv = [str(named.get(a, a)) for a in argv]
    argv = [a.replace("m=MISSING", f"m={tmp_path / 'missing'}") for a in argv]
    before, names = snapshot(tmp_path), sorted(os.listdir(tmp_path))
    result = run_cli([tool(argv[0]), *argv[1:]], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, expected)
    assert str(bad) in error_lines(result)[0]
    assert snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == names


def test_python_readers_refuse_invalid_text(tmp_path):
    """The readers without a console script of their own: fairseq's Dictionary (patched),
    the corpus builder's binarize, the export's GPT-2 files, an HF model's config.json."""
    import fairseq_alibi.models  # noqa: F401  (the patches)
    from fairseq.data import Dictionary

    from fairseq_alibi import corpus, hf
    from fairseq_alibi.export.tokenizer import read_gpt2_files

    data, expected = BAD_TEXTS["latin1"]
    bad = tmp_path / "dict.txt"
    bad.write_bytes(data)
    with pytest.raises(TextInputError, match=re.escape(expected)):
        Dictionary.load(str(bad))
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in corpus.SPLITS:
        (raw / f"wiki.{split}.tokens").write_bytes(data if split == "valid" else GOOD_TEXT.encode())
    with pytest.raises(TextInputError, match="wiki.valid.tokens is not UTF-8"):
        corpus.binarize(str(raw), str(tmp_path / "bin"))
    assert not (tmp_path / "bin").exists()
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\na b\n")
    with pytest.raises(TextInputError, match="dict.txt is not UTF-8"):
        read_gpt2_files(str(bad), str(tmp_path / "vocab.bpe"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes("{}".encode("utf-16"))
    with pytest.raises(TextInputError, match="config.json is UTF-16 text"):
        hf.load_hf_model(str(model))


# ------------------------------------------------------------ alibi-preprocess writes whole splits


@pytest.mark.slow
def test_preprocess_writes_what_stock_fairseq_writes(small_data, tmp_path):
    """Staged, the outputs are byte for byte stock fairseq-preprocess's (its run in small_data),
    the log names --destdir (not the stage) and is appended to, and no stage is left."""
    out = tmp_path / "data"
    argv = [tool("alibi-preprocess"), "--only-source", "--trainpref", small_data / "train.txt", "--validpref",
            small_data / "train.txt", "--destdir", out, "--workers", "1"]
    run_cli(argv, cwd=tmp_path)
    stock = snapshot(small_data / "data")
    ours = snapshot(out)
    assert set(ours) == set(stock)
    assert all(ours[name] == stock[name] for name in stock if name != "preprocess.log")
    log = ours["preprocess.log"].decode()
    assert f"destdir='{out}'" in log and ".tmp" not in log
    run_cli([tool("alibi-preprocess"), "--only-source", "--testpref", small_data / "train.txt", "--srcdict",
             out / "dict.txt", "--destdir", out, "--workers", "1"], cwd=tmp_path)
    again = snapshot(out)
    assert again["test.bin"] == stock["valid.bin"] and again["preprocess.log"].startswith(ours["preprocess.log"])
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_preprocess_refuses_an_output_it_cannot_write_whole(small_data, tmp_path):
    """A dictionary a new one would replace (fairseq: FileExistsError after writing its log),
    a --destdir that is a file: one line, nothing written."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "dict.txt").write_text("the 3\n")
    (tmp_path / "file").write_text("x\n")
    before = snapshot(tmp_path)
    for destdir, expected in ((out, "already holds"), (tmp_path / "file" / "sub", "is a file, not a directory")):
        result = run_cli([tool("alibi-preprocess"), "--only-source", "--trainpref", small_data / "train.txt",
                          "--destdir", destdir], expect_ok=False, cwd=tmp_path)
        assert_one_error(result, expected)
    assert snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["data", "file"]


INTERRUPT = """
import os, signal, sys
from fairseq.data import indexed_dataset

how, after = sys.argv[1], int(sys.argv[2])
builder = indexed_dataset.MMapIndexedDatasetBuilder
stock = {"add_item": builder.add_item, "finalize": builder.finalize}
calls = [0]


def interrupting(name):
    def method(self, *args):
        calls[0] += 1
        if calls[0] == after:
            if how == "signal":
                # Ctrl-C (Python's handler runs before raise_signal returns)
                signal.raise_signal(signal.SIGINT)
            else:
                raise KeyboardInterrupt
        return stock[name](self, *args)
    return method


# a suite started in the background of a shell (make test &) inherits SIGINT ignored; Ctrl-C at a
# terminal reaches a tool with Python's own handler, so give the tool that one
signal.signal(signal.SIGINT, signal.default_int_handler)
setattr(builder, sys.argv[3], interrupting(sys.argv[3]))
sys.argv = ["alibi-preprocess", *sys.argv[4:]]
from fairseq_alibi.cli import preprocess
preprocess()
"""

INTERRUPTIONS = [  # (how, after which call, of which writer method)
    ("raise", 5, "add_item"),  # in the middle of train.bin
    ("signal", 18, "add_item"),  # in the middle of valid.bin (12 lines each), train complete in the stage
    ("raise", 2, "finalize"),  # valid.idx about to be written
]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("earlier", [False, True], ids=["new folder", "folder with splits"])
@pytest.mark.parametrize("how,after,method", INTERRUPTIONS)
def test_interrupted_preprocess_leaves_no_half_split(how, after, method, earlier, small_data, tmp_path):
    """Ctrl-C while fairseq writes a split: exit 130, --destdir as it was (absent, or its
    earlier splits byte for byte), no stage left beside it."""
    out = tmp_path / "data"
    if earlier:
        run_cli([tool("alibi-preprocess"), "--only-source", "--trainpref", small_data / "train.txt",
                 "--validpref", small_data / "train.txt", "--destdir", out, "--workers", "1"], cwd=tmp_path)
    before = snapshot(out)
    dictionary = ["--srcdict", out / "dict.txt"] if earlier else []
    result = run_cli([sys.executable, "-c", INTERRUPT, how, after, method, "--only-source", "--trainpref",
                      small_data / "train.txt", "--validpref", small_data / "train.txt", *dictionary,
                      "--destdir", out, "--workers", "1"], expect_ok=False, cwd=tmp_path)
    assert result.returncode == 130 and "alibi-preprocess interrupted" in result.output, result.output[-3000:]
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == (["data"] if earlier else [])


def test_preprocess_keeps_a_folders_dictionary_and_needs_one(small_data, tmp_path):
    """A --srcdict other than the dictionary of the splits --destdir holds is refused
    (it replaced dict.txt, and the old splits then read as other words: an
    IndexError in training); the same one by another path binarizes; with no
    --trainpref and no dictionary, one error line (fairseq's assertion)."""
    out = tmp_path / "data"
    run_cli([tool("alibi-preprocess"), "--only-source", "--trainpref", small_data / "train.txt",
             "--destdir", out, "--workers", "1"], cwd=tmp_path)
    before = snapshot(out)
    other = tmp_path / "other.txt"
    other.write_text("".join(f"w{i} 1\n" for i in range(5)), encoding="utf-8")
    result = run_cli([tool("alibi-preprocess"), "--only-source", "--srcdict", other, "--validpref",
                      small_data / "train.txt", "--destdir", out, "--workers", "1"], expect_ok=False, cwd=tmp_path)
    assert result.returncode == 1 and error_lines(result) == [
        f"error: --srcdict {other} is not the dictionary of the splits in --destdir {out} ({out}/dict.txt: the ids "
        f"differ); replaced, it would misread them: give --srcdict {out}/dict.txt, or choose another --destdir"]
    assert snapshot(out) == before
    copy = tmp_path / "copy.txt"
    copy.write_bytes((out / "dict.txt").read_bytes())
    run_cli([tool("alibi-preprocess"), "--only-source", "--srcdict", copy, "--validpref", small_data / "train.txt",
             "--destdir", out, "--workers", "1"], cwd=tmp_path)
    assert (out / "valid.bin").exists() and (out / "dict.txt").read_bytes() == before["dict.txt"]
    alone = run_cli([tool("alibi-preprocess"), "--only-source", "--validpref", small_data / "train.txt",
                     "--destdir", tmp_path / "new", "--workers", "1"], expect_ok=False, cwd=tmp_path)
    assert alone.returncode == 1 and error_lines(alone) == [
        "error: no --trainpref to build the dictionary from: give --trainpref, or --srcdict with the dictionary "
        "to binarize with"], alone.output[-2000:]
    assert not (tmp_path / "new").exists()


def test_renames_wait_for_ctrl_c(tmp_path, monkeypatch):
    """Ctrl-C during the renames that publish a run is delivered after the last one
    (delivered at once, it would leave a.bin without a.idx)."""
    dest = tmp_path / "dest"
    real_replace = os.replace

    def replace_then_ctrl_c(src, dst):
        real_replace(src, dst)
        signal.raise_signal(signal.SIGINT)

    # Python's own handler, as at a terminal: a suite started in the background of a shell
    # (make test &) inherits SIGINT ignored, and held then re-raised it would still be ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with staging.staged_files(str(dest)) as stage:
                for name in ("a.bin", "a.idx"):
                    Path(stage, name).write_text(name)
                monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert snapshot(dest) == {"a.bin": b"a.bin", "a.idx": b"a.idx"}
    assert sorted(os.listdir(tmp_path)) == ["dest"]


def test_published_files_keep_plain_modes(tmp_path):
    """Files published from a stage have the modes a plain write gives (mkdtemp's 0700 is the stage's only)."""
    with staging.staged_files(str(tmp_path / "d")) as stage:
        Path(stage, "f").write_text("x")
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert stat.S_IMODE(os.stat(tmp_path / "d" / "f").st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


# ------------------------------------------------------------ a half split, as every reader reports it


def _split_files(source: Path, tmp_path: Path) -> Path:
    """A copy of the data directory ``source`` (to damage)."""
    data = tmp_path / "data"
    data.mkdir()
    for name in os.listdir(source):
        if name != "preprocess.log":
            (data / name).write_bytes((source / name).read_bytes())
    return data


def bin_only(data):
    (data / "valid.idx").unlink()


def idx_only(data):
    (data / "valid.bin").unlink()


def truncated_bin(data):
    os.truncate(data / "valid.bin", os.path.getsize(data / "valid.bin") // 2)


def cut_idx(data):
    os.truncate(data / "valid.idx", 30)


HALVES = [(bin_only, "valid.bin without valid.idx"), (idx_only, "valid.idx without valid.bin"),
          (truncated_bin, "valid.bin has"), (cut_idx, "valid.idx is cut short")]


@pytest.mark.parametrize("make,detail", HALVES, ids=[h[0].__name__ for h in HALVES])
def test_split_problem_by_class(make, detail, small_data, tmp_path):
    data = _split_files(small_data / "data", tmp_path)
    assert splits.split_problem(str(data / "valid")) == ""
    assert splits.split_problem(str(data / "missing")) == ""
    make(data)
    problem = splits.split_problem(str(data / "valid"))
    assert problem.startswith(f"{data} holds a half split 'valid' ({detail}"), problem
    assert problem.endswith("): an interrupted alibi-preprocess? run it again"), problem
    assert splits.split_problem(str(data / "train")) == ""


HALF_READERS = [
    ("alibi-eval-lm", ["DATA", "--path", "CK", "--gen-subset", "valid", "--cpu"]),
    ("alibi-train", train_args("DATA", "SAVE", max_update=1)),
    ("alibi-sweep", ["DATA", "-c", "m=CK", "--lengths", "1x", "--methods", "none", "--cpu", "--no-progress",
                     "-o", "SAVE"]),
    ("alibi-sweep", ["DATA", "--hf", "m=CK", "--cpu", "--no-progress", "-o", "SAVE"]),
]


@pytest.mark.parametrize("make,detail", HALVES, ids=[h[0].__name__ for h in HALVES])
@pytest.mark.parametrize("script,argv", HALF_READERS, ids=["eval-lm", "train", "sweep", "sweep --hf"])
@pytest.mark.slow
def test_half_split_is_reported_by_every_reader(script, argv, make, detail, lm_data_bin, alibi_checkpoint, tmp_path):
    """The issue's case: valid.bin without valid.idx was 'split not found ... splits there: valid'."""
    data = _split_files(lm_data_bin, tmp_path)
    make(data)
    named = {"DATA": str(data), "CK": str(alibi_checkpoint), "SAVE": str(tmp_path / "out")}
    argv = [named.get(a, a).replace("m=CK", f"m={alibi_checkpoint}") for a in argv]
    result = run_cli([tool(script), *argv], expect_ok=False, cwd=tmp_path)
    assert_one_error(result, f"{data} holds a half split 'valid' ({detail}")
    assert not (tmp_path / "out").exists()


def test_training_doc_quotes_the_half_split_error(tmp_path, monkeypatch):
    """docs/training.md's sample line is what the readers print for the issue's folder."""
    usage = " ".join((Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text().split())
    shown = re.search(r"`(error: [^`]*holds a half split[^`]*)`", usage).group(1)
    monkeypatch.chdir(tmp_path)
    Path("data-bin/latin").mkdir(parents=True)
    Path("data-bin/latin/valid.bin").write_bytes(b"\0" * 8)
    assert shown == f"error: {splits.split_problem('data-bin/latin/valid')}"
