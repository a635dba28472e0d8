"""Data recipes: the embedded corpus builder, the WikiText-103 script (offline
behaviour and checks) and the hydra configs of examples/language_model/."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path


import pytest

from conftest import cli_env, run_cli, tool

from fairseq_alibi import corpus

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "language_model"

WORDS = ("the value of the parser is returned to the caller when the stream ends and "
         "each line is read from the buffer before a new token is created").split()


def fake_stdlib(directory: Path, modules: int = 40) -> Path:
    """A directory of Python modules with docstrings and comments."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(modules):
        words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(60)]
        sentence = " ".join(words[:30]).capitalize() + ". " + " ".join(words[30:]) + f" number {i},000.5."
        source = textwrap.dedent(f'''\
            """Module {i}: {sentence}

            A well-known second paragraph of module {i}.
            """
            # {sentence}
            # continued comment for module {i}

            def f{i}():
                """{sentence}"""
                return {i}  # trailing comment {i}

            # Licensed to PSF under a Contributor Agreement.
            ''')
        sub = directory / ("pkg" if i % 2 else "") / f"mod{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(source)
    (directory / "test").mkdir(exist_ok=True)
    (directory / "test" / "test_x.py").write_text('"""Excluded test module."""\n')
    (directory / "broken.py").write_text("def (:\n")  # skipped, not fatal
    return directory


def test_wikitext_tokenization_conventions():
    tok = corpus.WikiTextTokenizer()
    assert tok("A well-known value of 1,000.5 (roughly) & more.") == (
        "A well @-@ known value of 1 @,@ 000 @.@ 5 ( roughly ) & more ."
    )
    assert tok("literal <unk> text") != "literal <unk> text"  # never the unknown word
    assert corpus.WikiTextTokenizer(lowercase=True)("The Cat") == "the cat"
    assert corpus.count_tokens(["a b c", "", "d"]) == 4 + 3


def test_help_topics_are_available():
    docs = corpus.topic_documents()
    assert len(docs) > 50
    assert sum(len(p.split()) for d in docs for p in d.paragraphs) > 40_000


def test_held_out_paragraphs_that_train_holds_are_dropped():
    shared = "Licensed to PSF under a Contributor Agreement ."
    splits = {
        "train": [("module:a", ["= a =", "alpha beta", shared])],
        "valid": [("module:b", ["= b =", shared, "gamma delta", "alpha beta gamma"]),
                  ("module:c", ["= a =", "alpha beta"])],  # a heading train also has stays
        "test": [("module:d", ["= d =", "epsilon"])],
    }
    train_before = [list(lines) for _, lines in splits["train"]]
    dropped = corpus.drop_train_overlap(splits)
    assert splits["valid"] == [("module:b", ["= b =", "gamma delta", "alpha beta gamma"]),
                               ("module:c", ["= a ="])]
    assert splits["test"] == [("module:d", ["= d =", "epsilon"])]
    assert [lines for _, lines in splits["train"]] == train_before
    assert dropped == {"valid": {"lines": 2, "tokens": corpus.count_tokens([shared, "alpha beta"])},
                       "test": {"lines": 0, "tokens": 0}}


def test_held_out_overlap_is_a_setting_and_keep_reads_older_manifests():
    drop, keep = corpus.CorpusConfig(), corpus.CorpusConfig(held_out_overlap="keep")
    assert drop.settings()["held_out_overlap"] == "drop"
    assert "held_out_overlap" not in keep.settings()  # what manifests before the option hold
    with pytest.raises(corpus.CorpusError, match="held_out_overlap is 'maybe'; choose from drop, keep"):
        corpus.prepare(corpus.CorpusConfig(destdir="/nonexistent", held_out_overlap="maybe"))


@pytest.mark.slow
def test_build_split_by_document_and_idempotent(tmp_path):
    stdlib = fake_stdlib(tmp_path / "lib")
    cfg = corpus.CorpusConfig(
        destdir=str(tmp_path / "bin"), sources=("docstrings", "comments"), stdlib_dir=str(stdlib),
        min_count=2, valid_fraction=0.1, test_fraction=0.1, workers=1,
    )
    manifest = corpus.prepare(cfg)
    dest = Path(cfg.destdir)
    for name in corpus.BINARY_FILES + (corpus.MANIFEST,):
        assert (dest / name).stat().st_size > 0, name
    raw = {s: (dest / "raw" / f"wiki.{s}.tokens").read_text().splitlines() for s in corpus.SPLITS}
    for split in corpus.SPLITS:
        assert manifest["splits"][split]["tokens"] == corpus.count_tokens(raw[split])
    # Every module ends with the same licence line: train holds it, so valid and test lose it.
    dropped = manifest["dropped_train_overlap"]
    licence = "Licensed to PSF under a Contributor Agreement ."
    assert licence in raw["train"] and licence not in raw["valid"] + raw["test"]
    in_train = set(raw["train"])
    for split in ("valid", "test"):
        assert dropped[split]["lines"] >= len(manifest["documents"][split])
        assert not [line for line in raw[split] if line in in_train and not line.startswith("= ")]
    total = sum(manifest["splits"][s]["tokens"] + dropped.get(s, {"tokens": 0})["tokens"] for s in corpus.SPLITS)
    assert manifest["splits"]["valid"]["tokens"] + dropped["valid"]["tokens"] >= 0.1 * total
    # Whole documents: each module in exactly one split (one heading line each); tests excluded.
    names = sum((manifest["documents"][s] for s in corpus.SPLITS), [])
    assert len(names) == len(set(names)) == 40
    assert not any("test_x" in n or "broken" in n for n in names)
    for split in corpus.SPLITS:
        headings = [l for l in raw[split] if l.startswith("= ") and l.endswith(" =")]
        assert len(headings) == len(manifest["documents"][split]) > 0
    assert "1 @,@ 000 @.@ 5" in "\n".join(raw["train"])
    # fairseq-preprocess agrees on the count (its log: "N sents, M tokens").
    log = (dest / "preprocess.log").read_text()
    assert f"{manifest['splits']['valid']['tokens']} tokens" in log

    # Same settings again: nothing is rebuilt.
    mtime = os.stat(dest / "train.bin").st_mtime_ns
    assert corpus.prepare(cfg) == manifest
    assert os.stat(dest / "train.bin").st_mtime_ns == mtime
    # Deterministic: a fresh build elsewhere gives the same text.
    cfg2 = corpus.CorpusConfig(**{**cfg.__dict__, "destdir": str(tmp_path / "bin2")})
    corpus.prepare(cfg2)
    for split in corpus.SPLITS:
        assert (tmp_path / "bin2" / "raw" / f"wiki.{split}.tokens").read_text() == "\n".join(raw[split]) + "\n"
    # Different content settings: refused, the corpus untouched; replaced with force.
    cfg3 = corpus.CorpusConfig(**{**cfg.__dict__, "lowercase": True})
    with pytest.raises(corpus.CorpusError, match="lowercase=False.*--as-built"):
        corpus.prepare(cfg3)
    assert os.stat(dest / "train.bin").st_mtime_ns == mtime
    corpus.prepare(cfg3, force=True)
    assert json.loads((dest / corpus.MANIFEST).read_text())["settings"]["lowercase"] is True
    # The corpus as built before the overlap was dropped: the same train, the licence line held out.
    keep = corpus.prepare(corpus.CorpusConfig(**{**cfg.__dict__, "destdir": str(tmp_path / "keep"),
                                                 "held_out_overlap": "keep"}))
    assert keep["dropped_train_overlap"] is None
    assert (tmp_path / "keep" / "raw" / "wiki.train.tokens").read_text() == "\n".join(raw["train"]) + "\n"
    assert (tmp_path / "keep" / "dict.txt").read_text() == (tmp_path / "bin2" / "dict.txt").read_text()
    for split in ("valid", "test"):
        assert keep["splits"][split]["tokens"] == manifest["splits"][split]["tokens"] + dropped[split]["tokens"]


def run_script(args, env=None, timeout=120):
    full_env = cli_env(PYTHON=str(Path(tool("alibi-sweep")).parent / "python"), **(env or {}))
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=full_env,
                            timeout=timeout, cwd=ROOT)
    result.output = result.stdout + result.stderr
    return result


def test_corpus_fails_clearly_on_missing_input(tmp_path):
    result = run_script([RECIPES / "prepare-embedded-corpus.sh", tmp_path / "bin",
                         "--stdlib-dir", tmp_path / "nowhere"])
    assert result.returncode == 1 and result.stderr.startswith("error: ")
    assert "standard library directory not found" in result.output and "Traceback" not in result.output
    (tmp_path / "empty").mkdir()
    result = run_script([RECIPES / "prepare-embedded-corpus.sh", tmp_path / "bin",
                         "--stdlib-dir", tmp_path / "empty", "--sources", "docstrings"])
    assert result.returncode == 1 and "no Python sources with documentation" in result.output
    result = run_script([RECIPES / "prepare-embedded-corpus.sh", tmp_path / "bin", "--sources", "novels"])
    assert result.returncode == 1 and "unknown corpus source" in result.output
    assert not (tmp_path / "bin" / corpus.MANIFEST).exists()


def test_wikitext_script_offline(tmp_path):
    script = RECIPES / "prepare-wikitext-103.sh"
    result = run_script([script, tmp_path / "wt"], env={"WIKITEXT_MIRRORS": "http://127.0.0.1:9/wikitext-103-v1.zip"})
    assert result.returncode != 0
    assert "could not download WikiText-103 from any mirror" in result.output
    assert "WIKITEXT_DIR" in result.output  # says what to do instead
    assert not (tmp_path / "wt").exists()


def test_wikitext_script_checks_its_input(tmp_path):
    script = RECIPES / "prepare-wikitext-103.sh"
    result = run_script([script, tmp_path / "wt"], env={"WIKITEXT_DIR": str(tmp_path / "none")})
    assert result.returncode != 0 and "is not a directory" in result.output
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "wiki.train.tokens").write_text(" = Title = \n some words here \n")
    result = run_script([script, tmp_path / "wt"], env={"WIKITEXT_DIR": str(raw)})
    assert result.returncode != 0 and "has no wiki.valid.tokens" in result.output
    (raw / "wiki.valid.tokens").write_text("a b\n")
    (raw / "wiki.test.tokens").write_text("a b\n")
    # The script copies into examples/language_model/wikitext-103; keep the
    # checkout clean by pointing it at a copy of the script.
    local = tmp_path / "recipe"
    local.mkdir()
    (local / script.name).write_text(script.read_text())
    result = run_script(["bash", local / script.name, tmp_path / "wt"], env={"WIKITEXT_DIR": str(raw)})
    assert result.returncode != 0
    assert "token count mismatch for wiki.train.tokens: 8, expected 103227021" in result.output


@pytest.mark.slow
def test_hydra_config_loads_and_trains(lm_data_bin, tmp_path):
    """The WikiText-103 config, shrunk by overrides, trains two updates on tiny data."""
    save = tmp_path / "ck"
    result = run_cli([
        tool("alibi-hydra-train"), "--config-dir", RECIPES / "config", "--config-name", "wikitext103_alibi_L64",
        f"task.data={lm_data_bin}", "common.cpu=true", "common.fp16=false", "optimization.max_update=2",
        "model.decoder_layers=1", "model.decoder_embed_dim=16", "model.decoder_input_dim=16",
        "model.decoder_output_dim=16", "model.decoder_ffn_embed_dim=32", "model.decoder_attention_heads=2",
        'model.adaptive_softmax_cutoff="10,20"', 'model.adaptive_input_cutoff="10,20"',
        "dataset.max_tokens=512", "dataset.num_workers=0", f"checkpoint.save_dir={save}",
    ], cwd=tmp_path)
    assert "done training" in result.output
    import torch

    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    model = state["cfg"]["model"]
    assert model["_name"] == "transformer_lm_alibi"
    assert model["alibi_train_length"] == 64 and state["cfg"]["task"]["tokens_per_sample"] == 64
    assert state["cfg"]["criterion"]["_name"] == "adaptive_loss"
    assert not any("embed_positions" in k for k in state["model"])
    assert not (tmp_path / "outputs").exists()  # hydra.run.dir is "."


def test_another_corpus_in_destdir_is_refused_before_anything_is_read(tmp_path):
    """The fast half of the next test: a manifest of another package's corpus
    in DESTDIR, and the builder's defaults asked for: refused naming the
    setting, and ``as_built`` takes the recorded settings instead."""
    dest = tmp_path / "bin"
    dest.mkdir()
    recorded = corpus.CorpusConfig(destdir=str(dest), stdlib_dir=str(tmp_path / "numpy"),
                                   sources=("docstrings",)).settings()
    (dest / corpus.MANIFEST).write_text(json.dumps({"settings": recorded}))
    with pytest.raises(corpus.CorpusError, match="sources=.*--as-built.*--force"):
        corpus.prepare(corpus.CorpusConfig(destdir=str(dest)))
    again = corpus.as_built(corpus.CorpusConfig(destdir=str(dest), held_out_overlap="keep"))
    assert (again.stdlib_dir, again.sources, again.held_out_overlap) == (str(tmp_path / "numpy"), ("docstrings",),
                                                                         "keep")
    corpus.check_replaces_nothing_else(corpus.CorpusConfig(destdir=str(dest), stdlib_dir=str(tmp_path / "numpy"),
                                                           sources=("docstrings",), held_out_overlap="keep"))


@pytest.mark.slow
def test_a_recipe_keeps_the_corpus_its_data_holds(tmp_path, capsys):
    """A recipe's DATA built from another package's sources (``--stdlib-dir``)
    stays that corpus: the recipes call the builder with ``--as-built``, which
    takes the recorded sources and directory and changes only the held-out
    overlap; without it, a build of other sources over it is refused in one
    line (it rebuilt CPython's corpus over it, and every number after described
    another corpus than the one the user built)."""
    stdlib = fake_stdlib(tmp_path / "otherpkg")
    dest = tmp_path / "bin"
    base = ["--destdir", str(dest), "--min-count", "2", "--valid-fraction", "0.1", "--test-fraction", "0.1",
            "--workers", "1"]
    assert corpus.main(base + ["--sources", "docstrings,comments", "--stdlib-dir", str(stdlib)]) == 0
    built = json.loads((dest / corpus.MANIFEST).read_text())
    mtime = os.stat(dest / "train.bin").st_mtime_ns

    # What compare.sh and demo.sh run on their DATA: nothing rebuilt.
    assert corpus.main(["--destdir", str(dest), "--as-built", "--held-out-overlap", "drop"]) == 0
    assert os.stat(dest / "train.bin").st_mtime_ns == mtime
    # Another overlap: rebuilt from the same package, not from CPython's documentation.
    assert corpus.main(["--destdir", str(dest), "--as-built", "--held-out-overlap", "keep"]) == 0
    kept = json.loads((dest / corpus.MANIFEST).read_text())
    assert kept["settings"]["stdlib_dir"] == built["settings"]["stdlib_dir"] == str(stdlib)
    assert kept["documents"] == built["documents"] and kept["dropped_train_overlap"] is None
    # The builder's defaults over it, without --as-built: one error line, nothing replaced.
    mtime = os.stat(dest / "train.bin").st_mtime_ns
    with pytest.raises(SystemExit) as stopped:
        corpus.main(["--destdir", str(dest)])
    assert stopped.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--as-built" in err[0], err
    assert os.stat(dest / "train.bin").st_mtime_ns == mtime


def test_the_recipes_build_their_data_as_built():
    for recipe in (ROOT / "examples" / "positions" / "compare.sh", RECIPES / "demo.sh"):
        calls = [line for line in recipe.read_text().splitlines() if "fairseq_alibi.corpus" in line]
        assert calls and all("--as-built" in line for line in calls), recipe
