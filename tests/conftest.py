"""Shared, session-scoped fixtures for tests that run the real command-line tools.

Reusable by any test module:

* ``lm_data_bin``: a ``data-bin`` directory (train/valid/test + dict.txt) made by
  the real ``fairseq-preprocess`` from a small synthetic word-level corpus;
* ``alibi_checkpoint``: ``checkpoint_best.pt`` of a tiny ALiBi LM trained on it
  by stock ``fairseq-train --user-dir "$(alibi-user-dir)"``: 2 layers, d=48,
  **6 heads** (not a power of two), ``--tokens-per-sample 32``;
* ``sinusoidal_checkpoint``: a stock ``transformer_lm`` with the same settings;
* ``alibi_user_dir``: what ``alibi-user-dir`` prints.

Helpers (``from conftest import run_cli, tool, ...``), the only copies in the
suite (``scripts/collect_errors.py`` imports them too): ``tool`` finds a console
script next to the running Python, ``run_cli`` runs one with single-threaded
BLAS and fails the test with the output's tail if it exits non-zero,
``preprocess`` binarizes a corpus, ``parse_eval`` reads an eval-lm result,
``free_port`` gives torchrun a port, ``error_lines`` the ``error:`` lines of
a run, ``wilson_by_hand`` Wilson's interval from its formula, and the bias
forms name ``alibi.alibi_bias`` per mode.

The corpus: each line picks one subject and repeats it in 1-4 numbered clauses
(``one the cat sees a tree . two the cat likes the ball .``), so a model learns
it in a few dozen updates, and predicting a clause's subject or number needs
the earlier clauses: context matters, which evaluation tests can observe.
"""

from __future__ import annotations

import atexit
import copy
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

import pytest
import torch

import forkserver
import tiers
from tiers import pytest_collection_modifyitems  # noqa: F401 (a hook: pytest finds it by name)
from fairseq_alibi.core import alibi

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

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
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run a command; ``result.output`` is stdout + stderr.  Console scripts and
    ``python -c|-m|script`` run as forks of a process that has imported torch
    and fairseq (``forkserver.py``) unless ``fresh`` (a test of what a run
    imports) or ``FAIRSEQ_ALIBI_TEST_FORKS=0``."""
    args = [str(a) for a in args]
    if not fresh and os.environ.get("FAIRSEQ_ALIBI_TEST_FORKS", "1") != "0" and forkserver.routed(args):
        result = _fork_server().run(args, cli_env(), cwd, stdin, timeout, _FORK_SCRATCH)
    else:
        result = subprocess.run(
            args, input=stdin, capture_output=True, text=True, env=cli_env(), timeout=timeout, cwd=cwd
        )
    result.output = result.stdout + result.stderr
    if expect_ok and result.returncode != 0:
        pytest.fail(
            f"{' '.join(args[:3])} ... exited with {result.returncode}:\n{result.output[-4000:]}"
        )
    return result


_FORK_SERVER: List = []
_FORK_SCRATCH = tempfile.mkdtemp(prefix="forkserver-")


def _fork_server() -> "forkserver.ForkServer":
    """This test process's fork server, started on first use, stopped at exit."""
    if not _FORK_SERVER:
        _FORK_SERVER.append(forkserver.ForkServer(cli_env(), os.path.join(_FORK_SCRATCH, "server.sock")))
        atexit.register(_FORK_SERVER[0].close)
        atexit.register(shutil.rmtree, _FORK_SCRATCH, True)
    return _FORK_SERVER[0]


def recipe_bin() -> str:
    """``VENV_BIN`` for an example recipe run by a test: shims that run its tools
    (``alibi-*``, ``python`` with a script, ``-c`` or ``-m``) as forks of this
    worker's fork server (forkserver.write_shims; each saves ~3 s of imports),
    or the real ``BIN`` with ``FAIRSEQ_ALIBI_TEST_FORKS=0``."""
    if os.environ.get("FAIRSEQ_ALIBI_TEST_FORKS", "1") == "0":
        return str(BIN)
    server = _fork_server()
    deadline = time.time() + 300
    while not os.path.exists(server.socket_path):  # bound once the server has imported torch and fairseq
        assert time.time() < deadline and server.process.poll() is None, "the fork server did not start"
        time.sleep(0.05)
    return forkserver.write_shims(os.path.join(_FORK_SCRATCH, "bin"), str(BIN), server.socket_path)


def error_lines(result: subprocess.CompletedProcess) -> List[str]:
    """The ``error:`` lines of a run (a user-facing failure has exactly one)."""
    return [line for line in result.output.splitlines() if line.startswith("error:")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LOSS_RE = re.compile(r"Loss \(base 2\): (\S+), Perplexity: (\S+)")
TOKENS_RE = re.compile(r"Evaluated ([\d,]+) tokens")


@dataclass(frozen=True)
class EvalResult:
    loss: float
    ppl: float
    tokens: int
    text: str  # the loss line, exactly as printed


def parse_eval(output: str) -> EvalResult:
    """The last result ``fairseq-eval-lm`` printed."""
    losses = LOSS_RE.findall(output)
    tokens = TOKENS_RE.findall(output)
    assert losses and tokens, output[-3000:]
    loss, ppl = losses[-1]
    line = f"Loss (base 2): {loss}, Perplexity: {ppl}"
    return EvalResult(float(loss), float(ppl), int(tokens[-1].replace(",", "")), line)


def preprocess(raw_dir: Path, dest: Path, splits=("train", "valid", "test")) -> Path:
    """``fairseq-preprocess --only-source`` of ``raw_dir/{split}.txt``."""
    prefs = []
    for split in splits:
        prefs += [f"--{split}pref", raw_dir / f"{split}.txt"]
    run_cli([tool("fairseq-preprocess"), "--only-source", *prefs, "--destdir", dest, "--workers", "1"])
    for split in splits:
        assert (dest / f"{split}.bin").exists(), split
    return dest


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


def fairseq_config(argv: Iterable):
    """fairseq-train's config (an omegaconf ``cfg``) for ``argv``, a fresh copy each call.

    Composing it runs hydra (about 0.8 s); the suite builds a few dozen models
    from the same arguments, so each distinct ``argv`` is composed once per
    worker.  Errors are raised on every call (a failed compose is not cached)."""
    return copy.deepcopy(_composed_config(tuple(str(a) for a in argv)))


@functools.lru_cache(maxsize=None)
def _composed_config(argv: tuple):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    return convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), list(argv)))


def wilson_by_hand(k: int, n: int):
    """The 95 % Wilson score interval of ``k`` successes in ``n``, written out from its formula."""
    import math

    z = 1.959963984540054
    p = k / n
    centre = (p + z ** 2 / (2 * n)) / (1 + z ** 2 / n)
    half = z / (1 + z ** 2 / n) * math.sqrt(p * (1 - p) / n + z ** 2 / (4 * n ** 2))
    return centre - half, centre + half


# ---------------------------------------------------------------- bias forms
# Thin names over ``alibi.alibi_bias`` for the three fixed modes, and the
# fork's ``+m*j`` form (test-only: kept to pin its fp16 defect).


def ctrl_c_restored() -> None:
    """A ``preexec_fn`` for a run that a test stops with Ctrl-C (SIGINT to its
    process group): SIGINT's default, as at a terminal.  A suite started in
    the background of a shell (``make test &``) inherits SIGINT ignored, and a
    shell cannot trap a signal ignored on entry."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def count_sdpa_pairs(monkeypatch) -> List[int]:
    """A list that gets the (query, key) pairs of every later SDPA call
    (batch x heads x queries x keys each): what a kernel scores."""
    scored: List[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query, key, value, **kwargs):
        scored.append(query.size(0) * query.size(1) * query.size(2) * key.size(2))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return scored


def causal_bias(slopes, q_len, k_len, dtype=torch.float32, device=None, q_start=None):
    """``[H, q_len, k_len]``: ``-m (i - j)`` for ``j <= i``, ``-inf`` above."""
    return alibi.alibi_bias(slopes, q_len, k_len, alibi.head_directions("causal", slopes.numel()),
                            q_start, dtype, device)


def symmetric_bias(slopes, q_len, k_len, dtype=torch.float32, device=None, q_start=None):
    return alibi.alibi_bias(slopes, q_len, k_len, alibi.head_directions("symmetric", slopes.numel()),
                            q_start, dtype, device)


def split_bias(slopes, q_len, k_len, dtype=torch.float32, device=None, q_start=None,
               masked_value=float("-inf")):
    return alibi.alibi_bias(slopes, q_len, k_len, alibi.split_directions(slopes.numel()),
                            q_start, dtype, device, masked_value)


def fork_causal_bias(slopes, length, dtype=torch.float32):
    """The 2021 fork's ``+m * j`` bias (key position only), ``-inf`` above the
    diagonal: equal to the causal bias under softmax in exact arithmetic, not
    in fp16."""
    key_pos = torch.arange(length, dtype=torch.float32)
    bias = (slopes.float()[:, None, None] * key_pos).expand(-1, length, -1).to(dtype)
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)
    return bias.masked_fill(upper, float("-inf"))


# ---------------------------------------------------------------- hostile and fork files
FORK_MAX_TOKENS = 9216  # the fork README's --max-tokens
FIELDS_NEWER_THAN_THE_FORK = ("decoder_xformers_att_config",)


class Payload:
    """Unpickles as ``open(path, "w")``: creates a file (a hostile checkpoint's code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def same_bits(a, b) -> bool:
    """The same dtype, shape and bytes: NaN equals itself.  fairseq's
    ``_float_tensor`` marker buffers (``safe_load.MARKER_BUFFERS``) hold one
    uninitialized float, now and then NaN, which ``torch.equal`` calls unequal
    to itself; a converted checkpoint must carry it bit for bit all the same."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


def fork_layout(alibi_state: dict, train_length: int, stock_arch: str = "transformer_lm_wiki103") -> dict:
    """An ALiBi checkpoint of this plugin rewritten the way the 2021 fork saved its
    models (REFERENCE.md, read from the fork's trainer and checkpoint_utils):
    ``args: None``; ``cfg`` a plain dict of *resolved* values, without the
    sections and fields fairseq 0.12 added later (``ema``, ``scale_*``,
    ``decoder_xformers_att_config``); the stock arch name with positions on in
    the config, ``tokens_per_sample = max_target_positions = L`` and the
    fork-only ``max_tokens``; a persistent ``embed_positions._float_tensor``."""
    import copy
    import collections

    state = copy.deepcopy(alibi_state)
    cfg = state["cfg"]
    assert isinstance(cfg, dict)  # fairseq 0.12 saves a plain dict too
    cfg.pop("ema", None)
    model = cfg["model"]
    assert model["_name"].endswith("_alibi"), model["_name"]
    for name in [k for k in model if k.startswith(("alibi_", "scale_")) or k in FIELDS_NEWER_THAN_THE_FORK]:
        del model[name]
    model.update(
        _name=stock_arch, no_token_positional_embeddings=False, tokens_per_sample=train_length,
        max_target_positions=train_length, add_bos_token=False, tpu=False, max_tokens=FORK_MAX_TOKENS,
    )
    weights = collections.OrderedDict(state["model"])
    weights["decoder.embed_positions._float_tensor"] = torch.FloatTensor(1).zero_()
    state["model"] = weights
    state["args"] = None
    return state


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


def pytest_configure(config):
    # One inductor cache per xdist worker: two workers compiling the same kernel into the shared
    # /tmp/torchinductor_<user> raced, and one loaded the other's half-written .so ("file too short").
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{worker}")
    # flex on a CPU without AVX-512 is refused to users (core/flex.py); the suite runs it there to exercise
    # the compile machinery, its comparisons with the reference being the check
    os.environ.setdefault("FAIRSEQ_ALIBI_CPU_FLEX", "1")
    tiers.register_markers(config)  # slow and fast_cases(k): tests/tiers.py


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
    return preprocess(lm_corpus, lm_corpus / "data-bin")


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


@pytest.fixture(scope="session")
def sinusoidal_checkpoint(lm_data_bin, tmp_path_factory) -> Path:
    """A stock sinusoidal ``transformer_lm`` with the fixture's settings, trained
    at 32 tokens (20 updates): the baseline and a genuine stock checkpoint."""
    save_dir = tmp_path_factory.mktemp("sinusoidal")
    args = train_args(lm_data_bin, save_dir, max_update=20)
    args[args.index("transformer_lm_alibi")] = "transformer_lm"
    run_cli([tool("alibi-train"), *args])
    path = save_dir / "checkpoint_last.pt"
    assert path.exists()
    return path
