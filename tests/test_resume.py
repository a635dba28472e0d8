"""Crash safety: training killed with SIGKILL and resumed from checkpoint_last.pt
ends exactly where an uninterrupted run ends.

What makes fairseq's resume exact on CPU (measured: final weights bit-identical,
final validation loss equal):

* ``--save-interval-updates``: checkpoints mid-epoch record the data iterator
  position (``iterations_in_epoch``), so the resumed run skips exactly the
  batches already trained on; the epoch's shuffle is seeded by seed + epoch;
* fairseq reseeds torch with ``seed + num_updates`` before every update, so
  dropout (including attention dropout inside SDPA) repeats after a restart;
* Adam moments, the learning-rate schedule and the update count are all in
  ``checkpoint_last.pt``;
* ``--num-workers 0`` and ``--sample-break-mode none`` keep batching
  independent of worker timing.
* the plugin makes the copy to ``checkpoint_last.pt`` atomic, so a kill during
  the copy cannot leave a truncated file (fairseq itself uses a plain copy).
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

BIN = os.path.dirname(sys.executable)
MAX_UPDATE = 24  # 21 batches per epoch: the run crosses an epoch boundary
SAVE_EVERY = 8


def _tool(name):
    return os.path.join(BIN, name)


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_data")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    for split, lines in (("train", 400), ("valid", 40)):
        with open(root / f"{split}.txt", "w") as handle:
            for _ in range(lines):
                handle.write(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "\n")
    dest = root / "bin"
    subprocess.run(
        [_tool("alibi-preprocess"), "--only-source", "--trainpref", str(root / "train.txt"),
         "--validpref", str(root / "valid.txt"), "--destdir", str(dest), "--workers", "1"],
        check=True, capture_output=True, env=_env(),
    )
    return str(dest)


def _train_args(data_bin, save_dir):
    return [
        data_bin, "--task", "language_modeling", "--arch", "transformer_lm_alibi",
        "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "4", "--dropout", "0.1", "--attention-dropout", "0.1",
        "--tokens-per-sample", "32", "--sample-break-mode", "none", "--batch-size", "8",
        "--optimizer", "adam", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "5", "--max-update", str(MAX_UPDATE),
        "--save-interval-updates", str(SAVE_EVERY), "--no-epoch-checkpoints",
        "--seed", "3", "--cpu", "--num-workers", "0", "--no-progress-bar",
        "--log-interval", "100", "--save-dir", save_dir,
    ]


def _single(data_bin, save_dir):
    return [_tool("alibi-train")] + _train_args(data_bin, save_dir)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(data_bin, save_dir):
    return [
        _tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(_free_port()),
        _tool("alibi-train"),
    ] + _train_args(data_bin, save_dir) + ["--distributed-backend", "gloo"]


def _run(cmd):
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _descendants(pid):
    """Process ids below ``pid`` (torchrun starts its workers in their own sessions)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid):
    """SIGKILL ``pid`` and every process it started, like a machine losing power."""
    for victim in reversed(_descendants(pid)):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(pid, signal.SIGKILL)


def _kill_after_first_checkpoint(cmd, save_dir):
    """Start ``cmd``; SIGKILL it and its children once checkpoint_last.pt exists."""
    last = os.path.join(save_dir, "checkpoint_last.pt")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), start_new_session=True
    )
    deadline = time.time() + 240
    try:
        while not os.path.exists(last):
            if proc.poll() is not None:
                pytest.fail("training ended before its first checkpoint: " + proc.stderr.read().decode()[-2000:])
            if time.time() > deadline:
                pytest.fail("no checkpoint_last.pt within 240 s")
            time.sleep(0.005)
        survivors = _descendants(proc.pid)
        _kill_tree(proc.pid)
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    for pid in survivors:  # make sure nothing keeps writing to save_dir
        for _ in range(500):
            if not _alive(pid):
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"process {pid} survived SIGKILL")
    return last


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _updates(state):
    return state["optimizer_history"][-1]["num_updates"]


def _assert_same_final(resumed, reference):
    assert _updates(resumed) == _updates(reference) == MAX_UPDATE
    assert resumed["model"].keys() == reference["model"].keys()
    different = [k for k in reference["model"] if not torch.equal(resumed["model"][k], reference["model"][k])]
    assert not different, f"weights differ after resume: {different[:5]}"
    assert resumed["extra_state"]["val_loss"] == reference["extra_state"]["val_loss"]


def test_sigkill_then_resume_is_exact(data_bin, tmp_path):
    reference_dir, crashed_dir = str(tmp_path / "reference"), str(tmp_path / "crashed")
    _run(_single(data_bin, reference_dir))

    last = _kill_after_first_checkpoint(_single(data_bin, crashed_dir), crashed_dir)
    killed_at = _updates(_state(last))
    assert SAVE_EVERY <= killed_at < MAX_UPDATE, killed_at
    resumed = _run(_single(data_bin, crashed_dir))
    assert f"Loaded checkpoint {last}" in resumed.stdout + resumed.stderr

    _assert_same_final(
        _state(os.path.join(crashed_dir, "checkpoint_last.pt")),
        _state(os.path.join(reference_dir, "checkpoint_last.pt")),
    )


def test_torchrun_gloo_sigkill_then_resume(data_bin, tmp_path):
    """Two processes (torchrun, gloo): killed after the first checkpoint, the
    resumed run finishes and ends where an uninterrupted two-process run does."""
    reference_dir, crashed_dir = str(tmp_path / "reference"), str(tmp_path / "crashed")
    _run(_torchrun(data_bin, reference_dir))
    last = _kill_after_first_checkpoint(_torchrun(data_bin, crashed_dir), crashed_dir)
    assert SAVE_EVERY <= _updates(_state(last)) < MAX_UPDATE
    _run(_torchrun(data_bin, crashed_dir))
    _assert_same_final(
        _state(os.path.join(crashed_dir, "checkpoint_last.pt")),
        _state(os.path.join(reference_dir, "checkpoint_last.pt")),
    )
