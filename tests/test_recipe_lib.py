"""``examples/lib.sh``, what every recipe shares: stopping its trainings (and
training each model on one corpus, last test).

A recipe is stopped by Ctrl-C (SIGINT to its process group), by SIGTERM or by
SIGHUP, and each training it runs must then stop at once, resumable.  A recipe
started with ``&`` from a script runs with SIGINT ignored, which neither it nor
the shells it starts can trap again, and neither does ``alibi-train`` (Python
leaves an ignored SIGINT ignored): there SIGTERM must still stop everything.
The trainers here are fakes that record the signal that reached them, so the
test takes seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

FAKE_TRAINER = """#!/usr/bin/env bash
# alibi-train's stand-in: says it saved update 5, then waits to be stopped and records how.
while [ $# -gt 0 ]; do [ "$1" != --save-dir ] || touch "$2/checkpoint_last.pt"; shift; done
echo "Saved checkpoint x (epoch 1 @ 5 updates"
if [ -n "${FINISH:-}" ]; then sleep 1.5; echo "progress: done"; sleep 0.5; exit 0; fi  # a training that ends
trap 'echo INT >> "$MARKS/$$.signal"; exit 130' INT    # a no-op where SIGINT was ignored on entry
trap 'echo TERM >> "$MARKS/$$.signal"; exit 143' TERM
touch "$MARKS/$$.started"
while :; do sleep 0.05; done
"""

DRIVER = """cd "$REPO"; RECIPE_TAG=stoptest; source examples/lib.sh
UPDATES=10 SAVE_EVERY=5 PARALLEL=1 TRAIN_STEP=1/1 FOLLOW=${FOLLOW:-}
training_threads; TRAIN_SLOTS=2
train() { train_model "$OUT/$1" "run $1" "fake"; }
run_trainings train < <(printf 'a\\nb\\n')
"""


def fake_recipe_env(tmp_path: Path, **extra: str) -> dict:
    """The driver's environment: the fake trainer first on its PATH, its marks
    in ``tmp_path/marks``, the trainings under ``tmp_path/out``."""
    fake_bin, marks = tmp_path / "bin", tmp_path / "marks"
    fake_bin.mkdir()
    marks.mkdir()
    (fake_bin / "alibi-train").write_text(FAKE_TRAINER)
    (fake_bin / "alibi-train").chmod(0o755)
    return dict(os.environ, REPO=str(REPO), OUT=str(tmp_path / "out"), VENV_BIN=str(fake_bin), MARKS=str(marks),
                **extra)


def start(tmp_path: Path, ignore_sigint: bool) -> tuple:
    env = fake_recipe_env(tmp_path)
    marks = Path(env["MARKS"])
    handler = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
    proc = subprocess.Popen(["bash", "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, handler))
    deadline = time.time() + 60
    while len(list(marks.glob("*.started"))) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the two fake trainings did not start within 60 s"
        time.sleep(0.02)
    return proc, marks


def finish(proc, marks: Path, status: int, signal_name: str):
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for started in marks.glob("*.started"):
            os.kill(int(started.name.split(".")[0]), signal.SIGKILL)
        pytest.fail(f"the recipe did not stop within 60 s of its {signal_name}: its trainings never stopped")
    assert proc.returncode == status, stdout + stderr
    received = sorted(p.read_text() for p in marks.glob("*.signal"))
    return stdout, stderr, received


STOPS = {  # how the recipe was started and stopped -> (exit status, the signal each trainer gets)
    "SIGTERM, started with & (SIGINT ignored)": (True, lambda pid: os.kill(pid, signal.SIGTERM), 143, "TERM"),
    "Ctrl-C (SIGINT to its process group)": (False, lambda pid: os.killpg(pid, signal.SIGINT), 130, "INT"),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lib.sh reads /proc (its recipes run on Linux)")
@pytest.mark.parametrize("how", STOPS)
def test_a_stopped_recipe_stops_each_trainer_once_and_says_where_it_resumes(tmp_path, how):
    """Each trainer gets one signal it acts on: SIGINT, alibi-train's own stop,
    after a Ctrl-C (the trainers run in sessions of their own, so it comes from
    their training's shell); SIGTERM where SIGINT is ignored (SIGINT would not
    reach it). Each says where it resumes from; the recipe ends with one line
    and the signal's exit status."""
    ignore_sigint, send, status, received_signal = STOPS[how]
    proc, marks = start(tmp_path, ignore_sigint)
    send(proc.pid)
    stdout, stderr, received = finish(proc, marks, status, how)
    assert received == [received_signal + "\n"] * 2
    for name in ("a", "b"):
        assert f"run {name}: stopped (exit {status}); it resumes from update 5" in stdout
    assert stderr.splitlines()[-1].startswith(
        f"stoptest interrupted (SIG{received_signal}): rerun the same command to resume")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lib.sh reads /proc (its recipes run on Linux)")
def test_followed_log_lines_are_shown_and_their_reader_ends_with_the_training(tmp_path):
    """FOLLOW shows the trainer's matching log lines, prefixed with the run's
    label, and the ``tail`` that reads its log ends with the training's shell
    (it watched its own pid once, and every training left one running)."""
    env = fake_recipe_env(tmp_path, FOLLOW="progress", FINISH="1")
    out = env["OUT"]
    run = subprocess.run(["bash", "-c", DRIVER], capture_output=True, text=True, env=env, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[run a] progress: done" in run.stdout and "[run b] progress: done" in run.stdout
    deadline = time.time() + 10
    while True:
        readers = subprocess.run(["pgrep", "-f", f"tail .*{out}"], capture_output=True, text=True).stdout.split()
        if not readers or time.time() > deadline:
            break
        time.sleep(0.2)
    for pid in readers:  # leave nothing behind, then fail
        os.kill(int(pid), signal.SIGKILL)
    assert not readers, "a tail of a finished training's log is still running"


def test_write_report_of_two_recipes_at_once_both_succeed(tmp_path):
    """``write_report``: two shells writing one report at once (two seeds'
    recipes of one OUT) both succeed and the file holds one of them whole; a
    failing command leaves the earlier report and no partial file."""
    report = tmp_path / "summary.md"
    script = ('cd "$REPO"; RECIPE_TAG=reporttest; source examples/lib.sh; '
              'write_report "$REPORT" bash -c "for i in \\$(seq 200); do echo $WHO \\$i; done; sleep 0.3"')
    env = dict(os.environ, REPO=str(REPO), REPORT=str(report))
    procs = [subprocess.Popen(["bash", "-c", script], env=dict(env, WHO=who), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    lines = report.read_text().splitlines()
    assert len(lines) == 200 and len({line.split()[0] for line in lines}) == 1
    failing = ('cd "$REPO"; RECIPE_TAG=reporttest; source examples/lib.sh; '
               'write_report "$REPORT" bash -c "echo half; exit 3"')
    assert subprocess.run(["bash", "-c", failing], env=env, capture_output=True).returncode != 0
    assert report.read_text().splitlines() == lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.md"]



def test_a_model_trained_past_the_updates_asked_is_refused_not_resumed(tmp_path):
    """A run folder whose model was trained for 20 updates, asked for 10: its trainer
    would stop at once and trained.ok would say 10 for a model at 20, so the
    recipe stops with one error line naming both counts, and no trainer starts."""
    env = fake_recipe_env(tmp_path)
    for name in ("a", "b"):
        run = tmp_path / "out" / name
        run.mkdir(parents=True)
        (run / "checkpoint_last.pt").write_bytes(b"")
        (run / "train.log").write_text("Saved checkpoint x (epoch 2 @ 20 updates, score 1.0)\n")
        (run / "trained.ok").write_text("20\n")
    result = subprocess.run(["bash", "-c", DRIVER], capture_output=True, text=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    expected = {f"error: run {name}: {tmp_path}/out/{name} holds a model trained for 20 updates, more than the 10 "
                "asked; give that count (UPDATES, or UPDATES_<model> in the retrieval recipe) or another OUT"
                for name in ("a", "b")}  # the two run at once: either may stop the recipe first
    assert result.stderr.splitlines() and set(result.stderr.splitlines()) <= expected, result.stderr
    assert not list((tmp_path / "marks").glob("*.started"))
    assert (tmp_path / "out" / "a" / "trained.ok").read_text() == "20\n"


def test_a_model_goes_on_only_on_the_corpus_it_was_trained_on(tmp_path):
    """train_model records the corpus a model trains on (DIR/data.path, its real
    path); a run folder recorded for another corpus is refused with one error
    line, whether it is finished (trained.ok) or to be resumed, and no trainer
    starts; the same corpus by another spelling trains."""
    env = fake_recipe_env(tmp_path, FINISH="1")
    driver = DRIVER.replace('"fake"; }', '"fake" "$DATA"; }')
    (tmp_path / "corpus").mkdir()
    first = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env=dict(env, DATA=str(tmp_path / "corpus")))
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "out" / "a" / "data.path").read_text() == f"{tmp_path}/corpus\n"
    (tmp_path / "out" / "b" / "trained.ok").unlink()  # b to be resumed, a finished
    again = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env=dict(env, DATA=str(tmp_path / "corpus" / ".." / "corpus")))
    assert again.returncode == 0 and "run a: already trained" in again.stdout, again.stdout + again.stderr
    logs = {name: (tmp_path / "out" / name / "train.log").read_text() for name in ("a", "b")}
    other = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env=dict(env, DATA=str(tmp_path / "other")))
    assert other.returncode == 1, other.stdout + other.stderr
    expected = {f"error: run {name}: {tmp_path}/out/{name} holds a model trained on {tmp_path}/corpus, not on "
                f"{tmp_path}/other; give another OUT, or remove {tmp_path}/out/{name} to train it again"
                for name in ("a", "b")}
    assert other.stderr.splitlines() and set(other.stderr.splitlines()) <= expected, other.stderr
    assert logs == {name: (tmp_path / "out" / name / "train.log").read_text() for name in ("a", "b")}  # no trainer ran


@pytest.mark.parametrize("code", [0, 1, 130])
def test_a_training_whose_end_wait_n_passed_over_is_still_counted_by_its_pid(tmp_path, code):
    """run_trainings takes each training's exit status by its pid. bash 5.2's
    ``wait -n`` can pass over a job that ended together with another (the test
    above failed one run in ten that way, "interrupted" after both trained):
    here a ``wait -n`` of the driver's own takes the job's end first, as that
    one did, and reap_trainings still takes that job's status (0, error 1, stopped 130)."""
    script = f"""cd "$REPO"; RECIPE_TAG=reaptest; source examples/lib.sh; TRAIN_SLOTS=2
    job() {{ [ "$1" = quick ] && return {code}; sleep 0.5; }}
    live=(); status=0
    job quick & live+=("$!"); job slow & live+=("$!")
    sleep 0.2; wait -n  # quick's end, taken before reap_trainings sees it
    while [ "${{#live[@]}}" -gt 0 ]; do reap_trainings; done
    echo "status $status"
    """
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, REPO=str(REPO)), stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["status", str(code)]


def test_a_model_goes_on_only_with_the_settings_it_was_trained_with(tmp_path):
    """train_model records what defines a model (DIR/train.record: the corpus's
    dict.txt checksum and the trainer's options, less --max-update, which a
    staged training raises, and the logging options); a finished or resumable
    run folder recorded with other settings is refused with one error line
    naming the first difference, and no trainer starts."""
    env = fake_recipe_env(tmp_path, FINISH="1")
    driver = DRIVER.replace('"fake"; }', '"fake" "$DATA" --seed "$SEED" --max-update "$UPDATES" --log-interval "$LOG"; }')
    driver = driver.replace("UPDATES=10 ", "UPDATES=${UPDATES:-10} ")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "dict.txt").write_text("the 5\n")

    def run(**settings):
        return subprocess.run(["bash", "-c", driver], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, env=dict(env, DATA=str(corpus), **settings))

    first = run(SEED="1", LOG="5")
    assert first.returncode == 0, first.stdout + first.stderr
    record = (tmp_path / "out" / "a" / "train.record").read_text().splitlines()
    assert record[1:] == ["--seed 1"] and record[0].startswith("dict.txt ")
    # More updates (a staged training's next stage) and another log interval: the same model goes on.
    more = run(SEED="1", LOG="7", UPDATES="20")
    assert more.returncode == 0 and "resuming" in more.stdout, more.stdout + more.stderr
    assert (tmp_path / "out" / "a" / "trained.ok").read_text() == "20\n"
    logs = {name: (tmp_path / "out" / name / "train.log").read_text() for name in ("a", "b")}
    seed = run(SEED="2", LOG="5", UPDATES="20")
    assert seed.returncode == 1, seed.stdout + seed.stderr
    expected = {f"error: run {name}: {tmp_path}/out/{name} holds a model trained with other settings (it was "
                f"trained with '--seed 1' where this run has '--seed 2'); give another OUT, or remove "
                f"{tmp_path}/out/{name} to train it again" for name in ("a", "b")}
    assert seed.stderr.splitlines() and set(seed.stderr.splitlines()) <= expected, seed.stderr
    # The corpus rebuilt in place with another vocabulary: refused too, by its dict.txt.
    (corpus / "dict.txt").write_text("the 5\ncat 3\n")
    rebuilt = run(SEED="1", LOG="5", UPDATES="20")
    assert rebuilt.returncode == 1 and "it was trained with 'dict.txt " in rebuilt.stderr, rebuilt.stderr
    assert logs == {name: (tmp_path / "out" / name / "train.log").read_text() for name in ("a", "b")}
