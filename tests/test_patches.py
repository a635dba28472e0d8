"""``fairseq_alibi.patches``: the registry :func:`patches.apply` walks, and each
patch tested through the stock behaviour it changes.

A patch that another test file already checks end to end (a console script,
a resumed torchrun run, the hub API) is listed in :data:`ELSEWHERE` with that
test; ``test_every_patch_is_tested`` holds the list and this file together."""

import ast
import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fairseq_alibi.models  # noqa: F401  (registers the models, applies the patches)
from fairseq_alibi import patches
from fairseq_alibi.models import config
from fairseq_alibi.patches import checkpoints, distributed, numpy_compat, quiet

TESTS = Path(__file__).resolve().parent

#: Patches whose stock behaviour a test in another file exercises, by that test.
ELSEWHERE = {
    "safe_checkpoint_loading": "test_safe_load.py::test_fairseq_loader_and_hub_refuse_payload",
    "fork_checkpoints_refused": "test_checkpoints.py::test_stock_cli_with_user_dir_refuses_fork_checkpoint",
    "non_checkpoints_refused": "test_user_errors.py::test_a_torch_file_that_is_not_a_fairseq_checkpoint_is_named",
    "full_disk_checkpoints": "test_user_errors.py::test_python_api_refuses_alike",
    "checked_overrides": "test_user_errors.py::test_bad_model_overrides_name_the_key",
    "checked_data_files": "test_user_errors.py::test_unreadable_data_files_are_named",
    "checked_hub_paths": "test_user_errors.py::test_hub_paths_are_named",
    "quiet_hub_config": "test_user_errors.py::test_the_hub_keeps_its_whole_config_for_debug",
    "build_assertions": "test_user_errors.py::test_options_fairseq_cannot_build_from_are_one_line",
    "one_line_argument_errors":
        "test_arguments.py::test_every_method_param_on_an_arch_without_it_names_the_archs_that_take_it",
    "remainder_batches_kept": "test_cli.py::test_only_the_trainers_batches_drop_a_short_last_batch",
    "process_group_destroyed_after_training":
        "test_resume.py::test_a_finished_distributed_run_destroys_its_process_group",
    "safe_broadcast": "test_resume.py::test_torchrun_gloo_sigkill_then_resume",
    "guarded_eval_lm": "test_user_errors.py::test_zero_evaluated_tokens_is_an_error",
    "guarded_stock_eval_lm": "test_trust.py::test_eval_lm_refuses_a_split_the_model_s_limit_cuts_then_its_remedy_scores_all",
    "batches_as_first_built":
        "test_resume.py::test_a_run_resumed_in_its_first_second_or_third_epoch_ends_as_the_uninterrupted_one",
    "guarded_train": "test_resume.py::test_a_finished_run_rerun_trains_and_writes_nothing_and_says_so",
    "guarded_stock_train": "test_resume.py::test_stock_fairseq_train_with_the_plugin_keeps_a_finished_run",
    "resume_checked_at_load": "test_resume.py::test_hydra_training_keeps_a_finished_run_and_refuses_another_model",
}


# ------------------------------------------------------------------ the registry
def patch_functions():
    """Every function of the package's modules whose docstring declares a kind."""
    found = {}
    for info in pkgutil.iter_modules(patches.__path__):
        module = importlib.import_module(f"{patches.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isfunction(obj) and obj.__module__ == module.__name__ and "Kind: " in (obj.__doc__ or ""):
                found[name] = obj
    return found


def test_apply_runs_the_registry_and_nothing_else_in_order():
    """What apply calls, traced: exactly the registry's functions, in its order."""
    called = []

    def profile(frame, event, arg):
        caller = frame.f_back
        if event == "call" and caller is not None and caller.f_code is patches.apply.__code__ \
                and not frame.f_code.co_name.startswith("<"):  # a comprehension is a frame of its own
            called.append(frame.f_code)

    sys.setprofile(profile)
    try:
        patches.apply()
    finally:
        sys.setprofile(None)
    assert called == [patch.apply.__code__ for patch in patches.PATCHES]
    assert patches.PATCHES[0].apply is patches.startup.deferred_metric_imports  # before anything imports fairseq


def test_every_patch_is_registered_with_the_kind_its_docstring_says():
    registered = {patch.name: patch for patch in patches.PATCHES + patches.SCOPED}
    assert len(registered) == len(patches.PATCHES) + len(patches.SCOPED)
    assert set(patch_functions()) == set(registered)
    for name, patch in registered.items():
        assert patch.kind in patches.KINDS, name
        doc = " ".join(patch.apply.__doc__.split())
        assert f"Kind: {patch.kind}. Stock" in doc, name  # the kind, then what stock fairseq does


def test_the_package_docstring_lists_every_patch_under_its_module():
    doc = " ".join(patches.__doc__.split())
    for kind, meaning in patches.KINDS.items():
        assert f"**{kind}**: {meaning}" in doc
    parts = re.split(r"``(\w+)\.py``", doc)  # [before, module, its text, module, its text, ...]
    sections = {}
    for module, text in zip(parts[1::2], parts[2::2]):
        sections[module] = sections.get(module, "") + text
    for patch in patches.PATCHES + patches.SCOPED:
        assert f"``{patch.name}`` ({patch.kind})" in sections.get(patch.concern, ""), patch.name


def test_the_patches_import_nothing_from_models():
    """The override checks are passed in: nothing under patches/ imports models/."""
    for path in Path(patches.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{'.' * node.level}{node.module or ''}"] + [
                    f"{'.' * node.level}{node.module + '.' if node.module else ''}{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not [n for n in names if re.match(r"(\.\.|fairseq_alibi\.)models\b", n)], (path.name, names)


def test_apply_is_idempotent_and_keeps_the_checks_it_was_given():
    from fairseq import checkpoint_utils, models
    from fairseq.data import data_utils, iterators
    from fairseq.distributed import utils as dist_utils
    from fairseq.trainer import Trainer

    def installed():
        return [Trainer.get_train_iterator, checkpoint_utils.torch, checkpoint_utils.PathManager,
                checkpoint_utils.overwrite_args_by_name, checkpoint_utils.torch_persistent_save, models.build_model, data_utils.batch_by_size,
                iterators.BackgroundConsumer, dist_utils.infer_init_method, dist_utils.distributed_main,
                dist_utils.torch, list(checkpoint_utils.torch.inspectors),
                list(checkpoint_utils.overwrite_args_by_name.override_checks)]

    before = installed()
    assert before[-1] == [config.adopt_new_fields, config.check_override_keys]
    patches.apply()
    patches.apply(override_checks=[config.check_override_keys])
    after = installed()
    assert all(a is b for a, b in zip(after[:-2], before[:-2])) and after[-2:] == before[-2:]


def test_every_patch_is_tested():
    """Each patch has a test here named after it, or one in ELSEWHERE that exists."""
    here = {name for name in globals() if name.startswith("test_")}
    for patch in patches.PATCHES + patches.SCOPED:
        if patch.name in ELSEWHERE:
            filename, test = ELSEWHERE[patch.name].split("::")
            assert re.search(rf"^def {test}\(", (TESTS / filename).read_text(), re.M), ELSEWHERE[patch.name]
        else:
            assert [name for name in here if patch.name in name], patch.name


# ------------------------------------------------------------------ the patches tested here
@pytest.mark.slow
def test_deferred_metric_imports_load_sklearn_and_scipy_on_first_use():
    """Importing the plugin loads neither scikit-learn nor SciPy's statistics,
    and fairseq's names from them still compute what the real functions compute
    (loading them on first use)."""
    import json

    code = (
        "import sys, json, fairseq_alibi.models\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy'))\n"
        "from fairseq.criterions import sentence_prediction as sp\n"
        "from fairseq.tasks import audio_classification as ac\n"
        "import sklearn.metrics, scipy.stats\n"
        "print(json.dumps({'loaded': loaded,\n"
        "  'f1': [sp.f1_score([0, 1, 1, 0], [0, 1, 0, 0]), sklearn.metrics.f1_score([0, 1, 1, 0], [0, 1, 0, 0])],\n"
        "  'mcc': [sp._matthews_corrcoef([0, 1, 1, 0], [0, 1, 0, 0]),\n"
        "          sklearn.metrics.matthews_corrcoef([0, 1, 1, 0], [0, 1, 0, 0])],\n"
        "  'pearson': [float(sp.pearsonr([1, 2, 3], [1, 2, 4])[0]), float(scipy.stats.pearsonr([1, 2, 3], [1, 2, 4])[0])],\n"
        "  'spearman': [float(sp.spearmanr([1, 2, 3], [3, 1, 2])[0]), float(scipy.stats.spearmanr([1, 2, 3], [3, 1, 2])[0])],\n"
        "  'roc_curve_is_real': ac.sklearn_metrics.roc_curve is sklearn.metrics.roc_curve,\n"
        "  'real_modules': [sys.modules['sklearn'].__file__ is not None, sys.modules['scipy'].__file__ is not None]}))\n"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    for name in ("f1", "mcc", "pearson", "spearman"):
        deferred, real = out[name]
        assert deferred == real, (name, deferred, real)
    assert out["f1"][0] == pytest.approx(2 / 3)
    assert out["roc_curve_is_real"] and out["real_modules"] == [True, True]


@pytest.mark.slow
def test_loader_threads_stop_at_exit_so_a_finished_run_exits_with_status_0():
    """A run that stops consuming batches while fairseq's loader thread is busy
    with torch operations exits with status 0, and no loader thread is alive
    when the interpreter finalizes (a daemon killed in a torch op aborts the
    process: "terminate called without an active exception")."""
    code = (
        "import atexit, threading\n"
        "alive = []\n"
        "atexit.register(lambda: print('alive at exit:', sum(type(t).__name__ == 'BackgroundConsumer'\n"
        "                                                  and t.is_alive() for t in threading.enumerate())))\n"
        "import torch, fairseq_alibi.models\n"
        "from fairseq.data import iterators\n"
        "def batches():\n"
        "    while True:\n"
        "        yield torch.randn(64, 64) @ torch.randn(64, 64)  # torch work in the loader thread\n"
        "class Source:\n"
        "    def __len__(self): return 10 ** 6\n"
        "    def __iter__(self): return batches()\n"
        "it = iterators.BufferedIterator(2, Source())\n"
        "print('first batch', tuple(next(it).shape))\n"
    )
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.splitlines()[-2:] == ["first batch (64, 64)", "alive at exit: 0"], result.stdout


def test_restore_numpy_compat_long_lets_eos_blocks_build(monkeypatch):
    """fairseq's TokenBlockDataset in ``eos`` mode reads ``np.compat.long``: without
    it (NumPy 2) it fails; restored, each block is one sentence."""
    from fairseq.data import TokenBlockDataset

    sentences = [torch.tensor([5, 6, 2]), torch.tensor([7, 2]), torch.tensor([8, 9, 10, 2])]

    def blocks():
        dataset = TokenBlockDataset(sentences, [len(s) for s in sentences], block_size=None, pad=1, eos=2,
                                    break_mode="eos")
        return [dataset[i].tolist() for i in range(len(dataset))]

    monkeypatch.delattr(np, "compat", raising=False)  # NumPy 2, as stock fairseq meets it
    with pytest.raises(AttributeError, match="compat"):
        blocks()
    numpy_compat.restore_numpy_compat_long()
    assert np.compat.long is np.int64
    assert blocks() == [s.tolist() for s in sentences]


def test_quiet_harmless_warnings_filters_only_the_listed_ones(monkeypatch):
    hydra = "The version_base parameter is not specified. Please specify a compatability version level"

    def shown(*messages):
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()  # stock: every warning shown
            warnings.simplefilter("always")
            quiet.quiet_harmless_warnings()
            for message in messages:
                warnings.warn(message, UserWarning)
        return [str(w.message) for w in caught]

    assert shown(hydra, "a warning of this plugin") == ["a warning of this plugin"]
    monkeypatch.setenv("FAIRSEQ_ALIBI_WARNINGS", "1")
    assert shown(hydra, "a warning of this plugin") == [hydra, "a warning of this plugin"]


TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}


def test_torchrun_on_cpu_makes_the_workers_one_run(monkeypatch):
    """torchrun's environment, no GPU: stock fairseq leaves world size 1 (each
    worker trains alone); patched, the config is torchrun's, with gloo."""
    from fairseq.dataclass.configs import DistributedTrainingConfig
    from fairseq.distributed import utils as dist_utils
    from omegaconf import OmegaConf

    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(distributed.atexit, "register", lambda *a: None)  # no group to destroy in this test

    def inferred(infer):
        cfg = OmegaConf.create({"common": {"tpu": False},  # distributed_training.tpu interpolates common.tpu
                                "distributed_training": DistributedTrainingConfig(distributed_world_size=1)})
        cfg = cfg.distributed_training
        infer(cfg)
        return (cfg.distributed_init_method, cfg.distributed_world_size, cfg.distributed_rank, cfg.device_id,
                cfg.distributed_backend, cfg.distributed_no_spawn)

    patched = dist_utils.infer_init_method
    assert inferred(patched.__wrapped__) == (None, 1, 0, 0, "nccl", False)  # stock: a run of its own
    assert inferred(patched) == ("env://", 2, 1, 1, "gloo", True)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one worker: fairseq's own inference
    assert inferred(patched) == inferred(patched.__wrapped__)


def test_cpu_ddp_wraps_a_cpu_module_that_stock_ddp_refuses(tmp_path):
    import torch.distributed as dist
    from fairseq.models import distributed_fairseq_model as dfm

    module = torch.nn.Linear(3, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        stock = dfm.DistributedDataParallel.__bases__[0]
        with pytest.raises(ValueError, match="device_ids"):
            stock(module, device_ids=[0], output_device=0)  # what fairseq passes
        wrapped = dfm.DistributedDataParallel(module, device_ids=[0], output_device=0)
        x = torch.randn(4, 3)
        torch.testing.assert_close(wrapped(x), module(x), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_atomic_checkpoint_copies_leave_the_old_file_whole_when_a_copy_dies(tmp_path, monkeypatch):
    """A copy that dies half-way (a killed run): stock fairseq's PathManager.copy
    leaves a truncated checkpoint_last.pt; patched, the old file stays whole."""
    from fairseq import checkpoint_utils

    source = tmp_path / "checkpoint8.pt"
    source.write_bytes(b"new checkpoint " * 100)
    real_copy = shutil.copyfile

    def dies_half_way(src, dst, **kwargs):
        with open(src, "rb") as f, open(dst, "wb") as out:
            out.write(f.read()[:700])
        raise KeyboardInterrupt  # the run killed in the middle of the copy

    copies = {"stock": checkpoint_utils.PathManager._path_manager, "patched": checkpoint_utils.PathManager}
    assert isinstance(copies["patched"], checkpoints.AtomicCopyPathManager)
    left = {}
    for name, manager in copies.items():
        target = tmp_path / f"{name}_last.pt"
        target.write_bytes(b"old checkpoint " * 100)
        monkeypatch.setattr(shutil, "copyfile", dies_half_way)
        with pytest.raises(KeyboardInterrupt):
            manager.copy(str(source), str(target), overwrite=True)
        monkeypatch.setattr(shutil, "copyfile", real_copy)
        left[name] = target.read_bytes()
    assert left["stock"] == (b"new checkpoint " * 100)[:700]
    assert left["patched"] == b"old checkpoint " * 100
    assert checkpoint_utils.PathManager.copy(str(source), str(tmp_path / "patched_last.pt"), overwrite=True)
    assert (tmp_path / "patched_last.pt").read_bytes() == source.read_bytes()


def test_checked_overrides_runs_the_checks_it_is_given_once_per_config():
    """The checks apply() is given run once, on the whole config (fairseq
    recurses into each section through the same name), before the overrides
    apply; given again, a check is not added twice."""
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    seen = []

    def record(overrides, cfg):
        seen.append((dict(overrides), sorted(cfg)))

    cfg = OmegaConf.create({"model": {"dropout": 0.1}, "task": {"tokens_per_sample": 8}})
    installed = checkpoint_utils.overwrite_args_by_name
    assert installed.override_checks == [config.adopt_new_fields, config.check_override_keys]
    patches.apply(override_checks=[record])
    patches.apply(override_checks=[record])
    try:
        checkpoint_utils.overwrite_args_by_name(cfg, {"dropout": 0.0})
    finally:
        installed.override_checks.remove(record)
    assert seen == [({"dropout": 0.0}, ["model", "task"])]
    assert cfg.model.dropout == 0.0


def test_quiet_partial_dataset_cleanup_closes_only_what_was_opened(tmp_path):
    """A memory-mapped index or dataset whose ``__init__`` never ran (cut short)
    is collected without an error; a whole one still closes its file."""
    import gc
    import warnings

    import numpy as np
    from fairseq.data import indexed_dataset

    patches.apply()
    index_type = indexed_dataset.MMapIndexedDataset.Index
    for partial in (object.__new__(index_type), object.__new__(indexed_dataset.MMapIndexedDataset)):
        partial.__del__()  # stock: AttributeError
    builder = indexed_dataset.MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    builder.add_item(torch.tensor([1, 2, 3], dtype=torch.int32))
    builder.finalize(str(tmp_path / "d.idx"))
    dataset = indexed_dataset.MMapIndexedDataset(str(tmp_path / "d"))
    mmap = dataset._bin_buffer_mmap._mmap
    assert len(dataset) == 1 and dataset.sizes.tolist() == [3]  # (an item read holds the buffer open)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del dataset
        gc.collect()
    assert mmap.closed


def test_literal_options_only_reads_literals_and_runs_no_code():
    """fairseq's eval of an option's text reads literals (and +, -, * of them, as
    fconv's defaults are written) and refuses anything else, names and calls first."""
    from fairseq.models import fconv, transformer_lm
    from fairseq.optim import adam

    from fairseq_alibi.errors import ConfigError
    from fairseq_alibi.patches.no_eval import literal_expression

    assert transformer_lm.eval is adam.eval is fconv.eval is literal_expression
    assert literal_expression("(0.9, 0.98)") == (0.9, 0.98)
    assert literal_expression("[(512, 3)] * 2 + [(256, 3)]") == [(512, 3), (512, 3), (256, 3)]
    assert literal_expression("1e-8") == 1e-8 and literal_expression(b"(1, 2)") == (1, 2)
    with pytest.raises(TypeError):  # as eval, which fairseq's eval_bool reads as "use the default"
        literal_expression(True)
    from fairseq import utils
    assert utils.eval_bool(True, default=False) is False and utils.eval_bool("True") is True  # stock semantics
    assert utils.eval_str_list("20000,60000", type=int) == [20000, 60000]
    import argparse
    import builtins

    from fairseq.models import fconv_lm
    for arch in (fconv_lm.base_lm_architecture, fconv_lm.fconv_lm_dauphin_wikitext103):
        args = argparse.Namespace()
        arch(args)  # fairseq's own defaults, expressions such as "[(850, 6)] * 3 + ...": read as eval reads them
        assert literal_expression(args.decoder_layers) == builtins.eval(args.decoder_layers), arch.__name__
    for text in ("__import__('os').system('true')", "open('x')", "[1] * 10 ** 9", "[1] * 100000",
                 "().__class__", "lambda: 0"):
        with pytest.raises(ConfigError, match="is not a Python literal"):
            literal_expression(text)


@pytest.mark.slow
def test_a_checkpoint_whose_config_holds_code_runs_none_of_it(sinusoidal_checkpoint, lm_data_bin, tmp_path):
    """A stock transformer_lm's config with character embeddings and code in
    character_filters (plain strings: the safe unpickler lets them through; stock
    fairseq eval()s them while building the model) is one error line, and the
    code never runs; the same text in a YAML config and in --adam-betas."""
    from conftest import error_lines, run_cli, tool

    marker = tmp_path / "MARK"
    code = f"__import__('os').system('touch {marker}') or [(1, 4)]"
    state = torch.load(sinusoidal_checkpoint, weights_only=False)
    state["cfg"]["model"]["character_embeddings"] = True
    state["cfg"]["model"]["character_filters"] = code
    torch.save(state, tmp_path / "hostile.pt")
    result = run_cli([tool("alibi-eval-lm"), lm_data_bin, "--path", tmp_path / "hostile.pt", "--cpu"],
                     expect_ok=False)
    assert result.returncode == 1 and not marker.exists(), result.output[-2000:]
    assert len(error_lines(result)) == 1 and "is not a Python literal" in error_lines(result)[0], result.output
    from conftest import train_args
    betas = run_cli([tool("alibi-train"), *train_args(lm_data_bin, tmp_path / "ckpt", max_update=1),
                     "--adam-betas", f"__import__('os').system('touch {marker}') or (0.9, 0.98)"], expect_ok=False)
    assert betas.returncode == 1 and not marker.exists(), betas.output[-2000:]
    assert "is not a Python literal" in error_lines(betas)[0]
