"""Crash safety: training killed with SIGKILL, or resumed from a checkpoint of
any epoch, ends exactly where an uninterrupted run ends, for every family of
position method; so does a recipe (compare.sh) interrupted by Ctrl-C in its
second epoch and run again.  A finished run's rerun changes nothing; a run
resumed with another model is refused; Ctrl-C says where a rerun resumes.

What makes fairseq's resume exact on CPU (measured: final weights bit-identical,
final validation loss equal):

* ``--save-interval-updates``: checkpoints mid-epoch record the data iterator
  position (``iterations_in_epoch``), so the resumed run skips exactly the
  batches already trained on; the epoch's shuffle is seeded by seed + epoch;
* the batches themselves are those of the uninterrupted run: fairseq groups the
  samples into batches once per process, ordered under seed + the epoch the
  process starts in, and keeps them for every later epoch, so a run resumed in
  epoch 2 or later built other batches than the run that went on (the patch
  ``patches.resume.batches_as_first_built`` builds them as at epoch 1);
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
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from conftest import REPO, cli_env, ctrl_c_restored, error_lines, free_port, recipe_bin, run_cli, tool

MAX_UPDATE = 32  # about 24 batches per epoch: the run crosses an epoch boundary
SAVE_EVERY = 8


def _train_args(data_bin, save_dir):
    return [
        str(data_bin), "--task", "language_modeling", "--arch", "transformer_lm_alibi",
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
    return [tool("alibi-train")] + _train_args(data_bin, save_dir)


def _torchrun(data_bin, save_dir, *script):
    """Two CPU processes under torchrun, no --distributed-backend (gloo is picked on CPU)."""
    return [
        tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
        *(script or [tool("alibi-train")]),
    ] + _train_args(data_bin, save_dir)


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
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env(), start_new_session=True
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


def _assert_same_final(resumed, reference, updates=MAX_UPDATE):
    assert _updates(resumed) == _updates(reference) == updates
    assert resumed["model"].keys() == reference["model"].keys()
    different = [k for k in reference["model"] if not torch.equal(resumed["model"][k], reference["model"][k])]
    assert not different, f"weights differ after resume: {different[:5]}"
    assert resumed["extra_state"]["val_loss"] == reference["extra_state"]["val_loss"]


@pytest.mark.slow
def test_sigkill_then_resume_is_exact(lm_data_bin, tmp_path):
    reference_dir, crashed_dir = str(tmp_path / "reference"), str(tmp_path / "crashed")
    run_cli(_single(lm_data_bin, reference_dir))

    last = _kill_after_first_checkpoint(_single(lm_data_bin, crashed_dir), crashed_dir)
    killed_at = _updates(_state(last))
    assert SAVE_EVERY <= killed_at < MAX_UPDATE, killed_at
    resumed = run_cli(_single(lm_data_bin, crashed_dir))
    assert f"Loaded checkpoint {last}" in resumed.output

    _assert_same_final(
        _state(os.path.join(crashed_dir, "checkpoint_last.pt")),
        _state(os.path.join(reference_dir, "checkpoint_last.pt")),
    )


@pytest.mark.slow
def test_torchrun_gloo_sigkill_then_resume(lm_data_bin, alibi_user_dir, tmp_path):
    """Two processes (torchrun), killed after the first checkpoint: the resumed
    run (alibi-train) finishes and ends where an uninterrupted two-process run of
    the stock fairseq-train with --user-dir does.  That reference run is really
    data-parallel: gloo chosen without being asked (nccl needs CUDA), world size
    2, each worker's batch of 8 aggregated to 16, one checkpoint."""
    reference_dir, crashed_dir = str(tmp_path / "reference"), str(tmp_path / "crashed")
    # torchrun's workers of the uninterrupted and the resumed runs are forks of the test's fork server
    # (recipe_bin's shims: ~4 s of imports each); those of the killed run are real processes, its descendants.
    shims = recipe_bin()
    reference = run_cli(_torchrun(lm_data_bin, reference_dir, os.path.join(shims, "fairseq-train"),
                                  "--user-dir", alibi_user_dir), timeout=400)
    assert "distributed init (rank 1)" in reference.output and "training on 2 devices" in reference.output
    train_line = [line for line in reference.output.splitlines() if "| train |" in line][-1]
    assert "bsz 16 " in train_line and f"num_updates {MAX_UPDATE} " in train_line, train_line
    state = _state(os.path.join(reference_dir, "checkpoint_last.pt"))
    assert state["cfg"]["distributed_training"]["distributed_world_size"] == 2
    assert state["cfg"]["distributed_training"]["distributed_backend"] == "gloo"
    assert "`broadcast_buffers` is deprecated" not in reference.output and "NCCL" not in reference.output

    last = _kill_after_first_checkpoint(_torchrun(lm_data_bin, crashed_dir), crashed_dir)
    assert SAVE_EVERY <= _updates(_state(last)) < MAX_UPDATE
    run_cli(_torchrun(lm_data_bin, crashed_dir, os.path.join(shims, "alibi-train")))
    _assert_same_final(
        _state(os.path.join(crashed_dir, "checkpoint_last.pt")),
        _state(os.path.join(reference_dir, "checkpoint_last.pt")),
    )


# ------------------------------------------------------------------ resume in any epoch, every family
#: One model of each family of position method (core/positions.py's kinds, and the logit method
#: SSMax): its --arch and the flags it adds; the first is the fast tier's.
FAMILIES = {
    "alibi": ("transformer_lm_alibi",),  # a static bias
    "t5bias": ("transformer_lm_t5bias",),  # learned biases
    "kerple": ("transformer_lm_kerple",),
    "fire": ("transformer_lm_fire",),
    "fox": ("transformer_lm_fox",),  # data-dependent
    "rotary": ("transformer_lm_rotary",),  # rotation
    "nope": ("transformer_lm_nope",),  # none
    "rnope": ("transformer_lm_rnope", "--rnope-window", "8"),  # hybrid
    "ssmax": ("transformer_lm_alibi", "--ssmax"),  # a logit method
}
EPOCH_UPDATES = 9  # batches of 32 blocks of 32 tokens in lm_data_bin's training split
FAMILY_UPDATES = 3 * EPOCH_UPDATES + 3  # into the fourth epoch


def _family_args(data_bin, save_dir, family, max_update=FAMILY_UPDATES):
    """A tiny model of ``family``, dropout on, a checkpoint every 4 updates (all kept) and at each
    epoch's end: its intermediate checkpoint_E_U.pt are the states a killed run resumes from."""
    arch, *extra = FAMILIES[family]
    return [
        tool("alibi-train"), str(data_bin), "--arch", arch, *extra, "--decoder-layers", "2",
        "--decoder-embed-dim", "16", "--decoder-input-dim", "16", "--decoder-output-dim", "16",
        "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--dropout", "0.1",
        "--attention-dropout", "0.1", "--tokens-per-sample", "32", "--sample-break-mode", "none",
        "--batch-size", "32", "--optimizer", "adam", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "5", "--max-update", str(max_update), "--save-interval-updates", "4", "--seed", "3",
        "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "100", "--save-dir", str(save_dir),
    ]


def _epoch_of(path):
    return _state(path)["extra_state"]["train_iterator"]["epoch"]


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_resumed_in_its_first_second_or_third_epoch_ends_as_the_uninterrupted_one(
        lm_data_bin, tmp_path, family):
    """The state a run killed in epoch 1, 2 or 3 resumes from (a mid-epoch checkpoint copied as
    checkpoint_last.pt: the file fairseq writes and copies is the same), and the one at the end of
    epoch 1, resumed: bit-identical final weights and the same validation loss.  Stock fairseq
    was exact from epoch 1 alone: a resumed process grouped the samples into other batches."""
    reference = tmp_path / "reference"
    run_cli(_family_args(lm_data_bin, reference, family))
    saved = {}
    for path in sorted(reference.glob("checkpoint_*_*.pt"), key=lambda p: _updates(_state(p))):
        saved.setdefault(_epoch_of(path), path)  # each epoch's first mid-epoch checkpoint
    starts = [saved[epoch] for epoch in (1, 2, 3)] + [reference / "checkpoint1.pt"]
    assert [_epoch_of(p) for p in starts] == [1, 2, 3, 2], starts  # checkpoint1.pt: epoch 2 starts
    final = _state(reference / "checkpoint_last.pt")
    for start in starts:
        resumed = tmp_path / f"from_{start.stem}"
        resumed.mkdir()
        shutil.copyfile(start, resumed / "checkpoint_last.pt")
        result = run_cli(_family_args(lm_data_bin, resumed, family))
        assert f"Loaded checkpoint {resumed / 'checkpoint_last.pt'}" in result.output
        _assert_same_final(_state(resumed / "checkpoint_last.pt"), final, FAMILY_UPDATES)


def _bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("limit", ["--max-update", "--max-epoch"])
def test_a_finished_run_rerun_trains_and_writes_nothing_and_says_so(lm_data_bin, tmp_path, limit):
    """Stock fairseq loaded the model at --max-update, trained one more update and overwrote
    checkpoint_last.pt and checkpoint_best.pt (each rerun one more); at --max-epoch it said nothing."""
    save = tmp_path / "run"
    args = _family_args(lm_data_bin, save, "alibi", max_update=6)
    if limit == "--max-epoch":
        args[args.index("--max-update"):args.index("--max-update") + 2] = ["--max-epoch", "1"]
    run_cli(args)
    before = _bytes(save)
    updates = _updates(_state(save / "checkpoint_last.pt"))
    again = run_cli(args)
    assert _bytes(save) == before
    said = [line for line in again.output.splitlines() if "already finished" in line]
    where = " (--max-update 6)" if limit == "--max-update" else ", the end of epoch 1 (--max-epoch 1)"
    assert said == [f"the run in {save} is already finished at update {updates}{where}: nothing trained, nothing "
                    f"written; to train it further give a higher {limit}"], said
    assert "Loaded checkpoint" not in again.output and "num_updates" not in again.output


@pytest.mark.slow  # two fresh processes: the fork server has the plugin loaded already
def test_stock_fairseq_train_with_the_plugin_keeps_a_finished_run(lm_data_bin, alibi_user_dir, tmp_path):
    """fairseq-train --user-dir gets alibi-train's guard (patches.resume.guarded_stock_train)."""
    save = tmp_path / "run"
    args = _family_args(lm_data_bin, save, "alibi", max_update=4)
    args[0] = tool("fairseq-train")
    args += ["--task", "language_modeling", "--user-dir", alibi_user_dir]
    run_cli(args, fresh=True)
    before = _bytes(save)
    again = run_cli(args, fresh=True)
    assert _bytes(save) == before and f"the run in {save} is already finished at update 4" in again.output


@pytest.mark.slow
@pytest.mark.parametrize("script", ["alibi-hydra-train", "fairseq-hydra-train"])
def test_hydra_training_keeps_a_finished_run_and_refuses_another_model(lm_data_bin, alibi_user_dir, tmp_path, script):
    """fairseq's Hydra entry point imports the training main under another name (pre_main): guarded too."""
    from test_cli import write_hydra_config

    config_dir = write_hydra_config(tmp_path, lm_data_bin, alibi_user_dir)
    args = [tool(script), "--config-dir", config_dir, "--config-name", "tiny_lm", f"hydra.run.dir={tmp_path / 'h'}"]
    run_cli(args)
    save = tmp_path / "ckpt"
    before = _bytes(save)
    again = run_cli(args)
    assert _bytes(save) == before and f"the run in {save} is already finished at update 6" in again.output
    other = run_cli(args + ["model.decoder_layers=3", "optimization.max_update=8"], expect_ok=False)
    assert other.returncode == 1 and "this command gives --decoder-layers 3 (the checkpoint: --decoder-layers 2)" \
        in other.output and _bytes(save) == before, other.output[-3000:]


def _composed(arch, *flags):
    from fairseq.dataclass.initialize import add_defaults

    from conftest import fairseq_config

    cfg = fairseq_config(["DATA", "--task", "language_modeling", "--arch", arch, "--tokens-per-sample", "32",
                          "--max-tokens", "64", *flags])
    add_defaults(cfg)
    return cfg


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if value != 0 else 1
    if isinstance(value, str):
        return value + "x"
    return 1 if value is None else None


def test_every_model_field_but_the_changeable_ones_is_refused_on_resume():
    """Every field of every registered method's model config (the architecture, fairseq's shapes,
    each method's parameters, SETTING, SHAPE or LEARNED, --ssmax, the training length) changed
    alone is named as the first difference; the fields a resumed run may change are not; a
    field the checkpoint predates counts as its default."""
    from omegaconf import OmegaConf, open_dict

    import fairseq_alibi.models  # noqa: F401  (registers the models)
    from fairseq_alibi.core.positions import POSITIONS
    from fairseq_alibi.patches.resume import CHANGEABLE_ON_RESUME, model_difference

    for name, entry in POSITIONS.items():
        cfg = _composed(f"transformer_lm_{name}")
        trained = OmegaConf.create({"model": OmegaConf.to_container(cfg.model, resolve=True)})
        assert model_difference(trained, cfg) is None, name
        fields = [key for key in cfg.model if key != "_name"]
        assert {p.name for p in entry.params} <= set(fields) and "ssmax" in fields, name
        for key in fields:
            changed = OmegaConf.create({"model": OmegaConf.to_container(cfg.model, resolve=True)})
            changed.model[key] = _other_value(changed.model[key])
            difference = model_difference(changed, cfg)
            if key in CHANGEABLE_ON_RESUME:
                assert difference is None, (name, key)
            else:
                assert difference is not None and f"--{key.replace('_', '-')}" in difference, (name, key, difference)
        other = OmegaConf.create({"model": {**OmegaConf.to_container(cfg.model, resolve=True), "_name": "x"}})
        assert model_difference(other, cfg).startswith(f"--arch transformer_lm_{name} (the checkpoint: --arch x)")
    cfg = _composed("transformer_lm_alibi", "--ssmax")
    older = OmegaConf.to_container(cfg.model, resolve=True)
    del older["ssmax"]  # a checkpoint from before the field: trained without SSMax
    assert model_difference(OmegaConf.create({"model": older}), cfg) == "--ssmax (the checkpoint: no --ssmax)"
    with open_dict(cfg):
        cfg.model.ssmax = False
    assert model_difference(OmegaConf.create({"model": older}), cfg) is None


@pytest.mark.slow
def test_a_run_resumed_with_another_model_is_refused_in_one_line(lm_data_bin, tmp_path):
    """Another --fox-init-slopes (stock: recorded in the checkpoint and the export although the gates
    started at 0), --fox-data-dependent, --ssmax or --arch (stock: a 30-line traceback), --optimizer or
    --criterion (stock: an AssertionError traceback): one error line naming the difference, exit 1,
    the checkpoint untouched; another --dropout resumes."""
    save = tmp_path / "run"
    run_cli(_family_args(lm_data_bin, save, "fox", max_update=6))
    before = _bytes(save)
    for flags, said in ((["--fox-init-slopes", "1"], "--fox-init-slopes 1.0 (the checkpoint: --fox-init-slopes 0.0)"),
                        (["--fox-data-dependent", "0"],
                         "--fox-data-dependent 0 (the checkpoint: --fox-data-dependent 1)"),
                        (["--ssmax"], "--ssmax (the checkpoint: no --ssmax)")):
        result = run_cli(_family_args(lm_data_bin, save, "fox", max_update=8) + flags, expect_ok=False)
        assert result.returncode == 1 and error_lines(result) == [
            f"error: --save-dir {save} holds a run of another model: this command gives {said}; a resumed run keeps "
            "the model it started with (architecture, shapes, initial values, position settings); give a new "
            "--save-dir to train this model, or the checkpoint's options to resume it"], result.output[-3000:]
        assert "Traceback" not in result.output and _bytes(save) == before
    for flags, section, old, new in ((["--optimizer", "sgd"], "optimizer", "adam", "sgd"),
                                     (["--criterion", "label_smoothed_cross_entropy"], "criterion", "cross_entropy",
                                      "label_smoothed_cross_entropy")):
        result = run_cli(_family_args(lm_data_bin, save, "fox", max_update=8) + flags, expect_ok=False)
        assert result.returncode == 1 and error_lines(result) == [
            f"error: --save-dir {save} holds a run trained with --{section} {old}: this command gives --{section} "
            f"{new}; a resumed run keeps its optimizer state, which fairseq takes only with the same --optimizer and "
            "--criterion; give --reset-optimizer to start from the checkpoint's weights with a new optimizer (the "
            "update count starts again at 0), or a new --save-dir"], result.output[-3000:]  # stock: a traceback
    args = _family_args(lm_data_bin, save, "alibi", max_update=8)
    result = run_cli(args, expect_ok=False)
    assert result.returncode == 1 and "this command gives --arch transformer_lm_alibi (the checkpoint: --arch " \
        "transformer_lm_fox)" in error_lines(result)[0]
    run_cli(_family_args(lm_data_bin, save, "fox", max_update=8) + ["--dropout", "0.3"])
    assert _updates(_state(save / "checkpoint_last.pt")) == 8


@pytest.mark.slow
def test_ctrl_c_names_the_update_a_rerun_resumes_from(lm_data_bin, tmp_path):
    """Stock: "alibi-train interrupted", with no word of the update the rerun starts from."""
    save = tmp_path / "run"
    proc = subprocess.Popen(_family_args(lm_data_bin, save, "alibi", max_update=100000), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), start_new_session=True,
                            preexec_fn=ctrl_c_restored)
    last = save / "checkpoint_last.pt"
    deadline = time.time() + 240
    while not last.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.splitlines()[-1] == (
        f"alibi-train interrupted: a rerun of the same command resumes from update {_updates(_state(last))} "
        f"({last}); updates after it are trained again")


def test_the_interruption_note_says_what_a_rerun_of_the_same_command_loads(tmp_path, monkeypatch):
    """Each way fairseq picks the file a rerun starts from: the save directory's checkpoint_last.pt
    (the update it holds), nothing saved yet, --restore-file (loaded at every start), no last
    checkpoint written."""
    from omegaconf import OmegaConf

    from fairseq_alibi.patches import resume

    last = tmp_path / "checkpoint_last.pt"

    def note(**checkpoint):
        fields = dict(save_dir=str(tmp_path), checkpoint_suffix="", restore_file="checkpoint_last.pt",
                      no_save=False, no_last_checkpoints=False)
        monkeypatch.setitem(resume._RUNNING, "cfg", OmegaConf.create({"checkpoint": {**fields, **checkpoint}}))
        return resume.interruption_note()

    assert note() == "no checkpoint saved yet: a rerun of the same command starts from the beginning"
    torch.save({"model": {}, "optimizer_history": [{"num_updates": 114}]}, last)
    assert note() == (f"a rerun of the same command resumes from update 114 ({last}); updates after it are "
                      "trained again")
    assert note(restore_file="/m/base.pt") == ("a rerun of the same command starts again from --restore-file "
                                               f"/m/base.pt; to resume from update 114 give --restore-file {last}")
    assert note(no_last_checkpoints=True) == ("no checkpoint_last.pt is saved with --no-last-checkpoints: a rerun "
                                              "of the same command starts from the beginning")


def test_a_finished_distributed_run_destroys_its_process_group(tmp_path, monkeypatch):
    """After fairseq's distributed_main (training, then a barrier of all ranks)
    the process group is gone: fairseq never destroys it, and one left to
    interpreter exit can abort a finished worker (patches.py)."""
    import torch.distributed as dist
    from fairseq.distributed import utils as dist_utils
    from omegaconf import OmegaConf

    import fairseq_alibi.models  # noqa: F401  (applies patches.py)

    def init(cfg):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        return 0

    monkeypatch.setattr(dist_utils, "distributed_init", init)
    cfg = OmegaConf.create({"distributed_training": {"device_id": 0, "distributed_rank": 0},
                            "common": {"cpu": True, "tpu": False}})
    during = []
    dist_utils.distributed_main(0, lambda c: during.append(dist.is_initialized()), cfg, {})
    assert during == [True] and not dist.is_initialized()


# The recipe's run is stopped by a Ctrl-C sent once it has saved a checkpoint in its second epoch (about
# 38 updates each): with MAX_UPDATE's 32 a tiny model's remaining updates took less time than a loaded
# machine took to deliver it (the run ended first and the test failed), so the recipe trains longer
# (about five epochs): the stop lands well before its end.
RECIPE_UPDATES = 6 * MAX_UPDATE
RECIPE_SETTINGS = dict(SEEDS="1", POSITIONS="alibi", L="16", LAYERS="1", DIM="16", FFN="32", HEADS="2",
                       UPDATES=str(RECIPE_UPDATES), SAVE_EVERY=str(SAVE_EVERY), MAX_TOKENS="256", WARMUP="4",
                       LENGTHS="1x", EXTENSIONS="none")


def _compare(data_bin, out, **popen):
    env = cli_env(DATA=str(data_bin), OUT=str(out), VENV_BIN=recipe_bin(), **RECIPE_SETTINGS)
    return subprocess.Popen(["bash", str(REPO / "examples/positions/compare.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, stdin=subprocess.DEVNULL, **popen)


@pytest.mark.slow
def test_a_recipe_interrupted_in_its_second_epoch_resumes_from_its_last_saved_update(lm_data_bin, tmp_path):
    """compare.sh saves every SAVE_EVERY updates, mid-epoch too; Ctrl-C (SIGINT to the recipe's
    process group, as a terminal sends it) after a save in the second epoch stops the
    training there, says so and how to resume, exit 130; the same command then resumes from
    that update and ends with the weights of an uninterrupted run (stock fairseq built the
    resumed epoch's batches anew, so only a first-epoch stop resumed exactly)."""
    reference = _compare(lm_data_bin, tmp_path / "reference")
    stdout, stderr = reference.communicate(timeout=600)
    assert reference.returncode == 0, stdout[-2000:] + stderr[-2000:]

    out = tmp_path / "interrupted"
    last = out / "seed1" / "alibi" / "checkpoint_last.pt"
    proc = _compare(lm_data_bin, out, start_new_session=True, preexec_fn=ctrl_c_restored)
    log = last.parent / "train.log"
    deadline = time.time() + 300
    while not (log.exists() and "(epoch 2 @" in log.read_text()):  # a save of the second epoch
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint of the second epoch within 300 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    saved = _updates(_state(last))
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert SAVE_EVERY <= saved < RECIPE_UPDATES, saved
    assert f"seed 1 alibi: stopped (exit 130); it resumes from update {saved} ({last})" in stdout
    assert stderr.splitlines()[-1] == (
        "compare interrupted (SIGINT): rerun the same command to resume (trained models are kept, each other "
        "training resumes from its last saved update, finished evaluation cells are kept)")
    assert not (out / "seed1" / "alibi" / "trained.ok").exists() and not (out / "positions.md").exists()
    assert "error:" not in stderr

    again = _compare(lm_data_bin, out)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert f"resuming from update {saved};" in stdout
    loaded = re.search(rf"Loaded checkpoint {re.escape(str(last))} \(epoch (\d+) @ {saved} updates\)", log.read_text())
    assert loaded and int(loaded.group(1)) >= 2, log.read_text()[-3000:]
    _assert_same_final(_state(last), _state(tmp_path / "reference" / "seed1" / "alibi" / "checkpoint_last.pt"),
                       RECIPE_UPDATES)
    assert (out / "positions.md").read_text() == (tmp_path / "reference" / "positions.md").read_text()
