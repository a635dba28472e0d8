"""Shared, session-scoped fixtures for tests that run the real command-line tools.

Reusable by any test module:

* ``lm_data_bin``: a ``data-bin`` directory (train/valid/test + dict.txt) made by
  the real ``fairseq-preprocess`` from a small synthetic word-level corpus;
* ``alibi_checkpoint``: ``checkpoint_best.pt`` of a tiny ALiBi LM trained on it
  by stock ``fairseq-train --user-dir "$(alibi-user-dir)"``: 2 layers, d=48,
  **6 heads** (not a power of two), ``--tokens-per-sample 32``;
* ``alibi_user_dir``: what ``alibi-user-dir`` prints.

Helpers (``from conftest import run_cli, tool, ...``): ``tool`` finds a console
script next to the running Python, ``run_cli`` runs one with single-threaded
BLAS and fails the test with the output's tail if it exits non-zero.

The corpus: each line picks one subject and repeats it in 1-4 numbered clauses
(``one the cat sees a tree . two the cat likes the ball .``), so a model learns
it in a few dozen updates, and predicting a clause's subject or number needs
the earlier clauses: context matters, which evaluation tests can observe.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Optional

import pytest

BIN = Path(sys.executable).parent

TRAIN_LENGTH = 32  # --tokens-per-sample of the fixture checkpoint
HEADS = 6  # not a power of two: the interleaved slope sequence
EMBED_DIM = 48
LAYERS = 2
FIXTURE_UPDATES = 100

SUBJECTS = ("the cat", "a dog", "the bird", "my friend", "the teacher", "a child")
VERBS = ("sees", "likes", "chases", "finds", "follows", "watches")
OBJECTS = ("the ball", "a tree", "the house", "a river", "the garden", "some bread")
NUMBERS = ("one", "two", "three", "four")
SPLIT_LINES = {"train": 500, "valid": 60, "test": 60}


def tool(name: str) -> str:
    """Absolute path of a console script installed next to this Python."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"console script {name} not found in {BIN}; run `make install`")
    return str(path)


def cli_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FAIRSEQ_ALIBI_TRACEBACK", None)
    env.update(extra)
    return env


def run_cli(
    args: Iterable,
    *,
    stdin: Optional[str] = None,
    expect_ok: bool = True,
    timeout: float = 300,
    cwd=None,
) -> subprocess.CompletedProcess:
    """Run a command; ``result.output`` is stdout + stderr."""
    args = [str(a) for a in args]
    result = subprocess.run(
        args, input=stdin, capture_output=True, text=True, env=cli_env(), timeout=timeout, cwd=cwd
    )
    result.output = result.stdout + result.stderr
    if expect_ok and result.returncode != 0:
        pytest.fail(
            f"{' '.join(args[:3])} ... exited with {result.returncode}:\n{result.output[-4000:]}"
        )
    return result


def tiny_model_args(heads: int = HEADS, dim: int = EMBED_DIM) -> List[str]:
    """A tiny ALiBi LM; the io dims are given explicitly (fairseq's 512 default trap)."""
    return [
        "--arch", "transformer_lm_alibi", "--decoder-layers", str(LAYERS),
        "--decoder-embed-dim", str(dim), "--decoder-input-dim", str(dim),
        "--decoder-output-dim", str(dim), "--decoder-ffn-embed-dim", str(2 * dim),
        "--decoder-attention-heads", str(heads),
    ]


def train_args(data_bin, save_dir, max_update: int = 10, batch_size: int = 8) -> List[str]:
    """Everything after the training script's name, for a few CPU updates."""
    return [
        str(data_bin), "--task", "language_modeling", *tiny_model_args(),
        "--tokens-per-sample", str(TRAIN_LENGTH), "--sample-break-mode", "none",
        "--batch-size", str(batch_size), "--optimizer", "adam", "--lr", "0.01",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
        "--max-update", str(max_update), "--dropout", "0.0", "--seed", "1",
        "--cpu", "--num-workers", "0", "--save-dir", str(save_dir),
        "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "20",
    ]


def corpus_line(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    clauses = rng.randint(1, len(NUMBERS))
    return " ".join(
        f"{NUMBERS[i]} {subject} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ."
        for i in range(clauses)
    )


def write_corpus(directory: Path, seed: int = 0) -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, lines in SPLIT_LINES.items():
        text = "".join(corpus_line(rng) + "\n" for _ in range(lines))
        (directory / f"{split}.txt").write_text(text)
    return directory


@pytest.fixture(scope="session")
def alibi_user_dir() -> str:
    result = run_cli([tool("alibi-user-dir")])
    path = result.stdout.strip()
    assert os.path.isfile(os.path.join(path, "__init__.py")), path
    return path


@pytest.fixture(scope="session")
def lm_corpus(tmp_path_factory) -> Path:
    """Directory with {train,valid,test}.txt (raw, word-level)."""
    return write_corpus(tmp_path_factory.mktemp("lm_corpus"))


@pytest.fixture(scope="session")
def lm_data_bin(lm_corpus) -> Path:
    """Binarized corpus (``fairseq-preprocess --only-source``)."""
    dest = lm_corpus / "data-bin"
    run_cli([
        tool("fairseq-preprocess"), "--only-source",
        "--trainpref", lm_corpus / "train.txt", "--validpref", lm_corpus / "valid.txt",
        "--testpref", lm_corpus / "test.txt", "--destdir", dest, "--workers", "1",
    ])
    for name in ("dict.txt", "train.bin", "valid.bin", "test.bin"):
        assert (dest / name).exists(), name
    return dest


@pytest.fixture(scope="session")
def alibi_train_run(lm_data_bin, alibi_user_dir, tmp_path_factory):
    """(save_dir, CompletedProcess) of the fixture training run."""
    save_dir = tmp_path_factory.mktemp("alibi_checkpoint")
    result = run_cli([
        tool("fairseq-train"), *train_args(lm_data_bin, save_dir, max_update=FIXTURE_UPDATES),
        "--user-dir", alibi_user_dir,
    ])
    return save_dir, result


@pytest.fixture(scope="session")
def alibi_checkpoint(alibi_train_run) -> Path:
    """Path to checkpoint_best.pt of the tiny 6-head ALiBi LM (trained at 32 tokens)."""
    path = alibi_train_run[0] / "checkpoint_best.pt"
    assert path.exists()
    return path
