"""Resuming a training run: the batches of every epoch as the uninterrupted
run had them."""

from __future__ import annotations

import logging

logger = logging.getLogger("fairseq_alibi")


def _batches_kept_across_epochs(trainer, dataset, disable_iterator_cache: bool) -> bool:
    """Whether fairseq builds the training batches of ``dataset`` once and keeps
    them for every later epoch (stock ``FairseqTask.get_batch_iterator`` caching
    its iterator, the batches not rebuilt per epoch): then only the first
    iterator a process builds decides them."""
    from fairseq.tasks import FairseqTask

    task = trainer.task
    if type(task).get_batch_iterator is not FairseqTask.get_batch_iterator:
        return False  # a task that batches its own way (translation_multi_simple_epoch)
    if disable_iterator_cache or getattr(trainer.cfg.dataset, "update_epoch_batch_itr", False):
        return False
    if getattr(getattr(task, "cfg", None), "rebuild_batches", False):
        return False  # batches rebuilt every epoch, from that epoch's seed: the same after a resume
    return bool(task.can_reuse_epoch_itr(dataset))


def batches_as_first_built() -> None:
    """A run resumed in epoch 2 or later trains on the batches the
    uninterrupted run trained on: the training iterator a resumed process
    builds for epoch E is built as the one of epoch 1 (its samples ordered
    with seed + 1), then set to epoch E.

    Kind: wrong result.  Stock: ``FairseqTask.get_batch_iterator`` orders the
    samples under ``numpy_seed(seed + epoch)`` and groups them into batches
    once, when a process first builds the iterator, and keeps those batches
    for every later epoch (each epoch only shuffles their order, seeded by
    seed + epoch).  The uninterrupted run builds them at epoch 1; a run
    resumed from a checkpoint of epoch E builds them at epoch E, so from
    there on it trains on other batches (other samples together, another
    order) and ends with other weights, silently; a resume from epoch 1 was
    exact.  Datasets whose batches fairseq rebuilds every epoch (sharded
    data, ``--update-epoch-batch-itr``, a task's ``rebuild_batches``) are
    left as they are: there the resumed run already rebuilds them."""
    from fairseq.trainer import Trainer

    stock = Trainer.get_train_iterator
    if getattr(stock, "_alibi_first_built", False):
        return

    def get_train_iterator(self, epoch, combine=True, load_dataset=True, data_selector=None, shard_batch_itr=True,
                           disable_iterator_cache=False):
        if epoch == 1:
            return stock(self, epoch, combine, load_dataset, data_selector, shard_batch_itr, disable_iterator_cache)
        if load_dataset:  # stock's own loading, of the epoch asked
            logger.info("loading train data for epoch %s", epoch)
            self.task.load_dataset(self.cfg.dataset.train_subset, epoch=epoch, combine=combine,
                                   data_selector=data_selector, tpu=self.tpu)
        dataset = self.task.dataset(self.cfg.dataset.train_subset)
        if dataset in self.task.dataset_to_epoch_iter or not _batches_kept_across_epochs(
                self, dataset, disable_iterator_cache):
            return stock(self, epoch, combine, False, data_selector, shard_batch_itr, disable_iterator_cache)
        iterator = stock(self, 1, combine, False, data_selector, shard_batch_itr, disable_iterator_cache)
        iterator.epoch = epoch  # as the uninterrupted run's iterator is once it reaches this epoch
        return iterator

    get_train_iterator._alibi_first_built = True
    Trainer.get_train_iterator = get_train_iterator


# ------------------------------------------------------------------ what a resumed run may change
#: Model options a resumed run may give other values than the checkpoint's: each changes how the
#: model trains or runs from here on, never what the model is (its architecture, the shapes of its
#: weights, the initial values they started from, the function a forward pass computes).  The
#: dropouts and layer drop are regularisers of training alone (fairseq lets a resumed run change
#: them, as it does --lr); activation checkpointing, offloading and FSDP wrapping trade memory for
#: time; the attention kernel computes the same attention.  Every other field of the model's
#: config (the architecture, every shape, every position method's parameters, SETTING, SHAPE or
#: LEARNED, SSMax, the training length the model records, a context extension it trains with) must
#: keep the checkpoint's value: stock fairseq builds the new model from the new options, so a shape
#: fails to load (a traceback), and an initial value or a setting goes into every later checkpoint
#: and export although the weights were trained from the old one.  Options outside the model's
#: config (--lr, --max-update, --seed, logging, the data options) are fairseq's to take.
CHANGEABLE_ON_RESUME = frozenset({
    "dropout", "attention_dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout",
    "pooler_dropout", "decoder_layerdrop", "encoder_layerdrop",
    "checkpoint_activations", "offload_activations", "min_params_to_wrap", "alibi_attention", "tpu",
})


def _section(model) -> dict:
    """A model config section as a plain dict of resolved values."""
    from argparse import Namespace

    from omegaconf import DictConfig, OmegaConf
    from omegaconf.nodes import AnyNode

    if isinstance(model, AnyNode):
        model = model._value()
    if isinstance(model, DictConfig):
        return OmegaConf.to_container(model, resolve=True)
    if isinstance(model, Namespace):
        return dict(vars(model))
    return dict(model or {})


def _model_fields(arch, namespace: bool):
    """(the fields of ``arch``'s model config, in order, {field: default} of those with one): its
    dataclass's, or for an argparse model (a Namespace config, which holds every option of the
    run) the options its ``add_args`` declares."""
    import argparse
    import dataclasses

    from fairseq.models import ARCH_MODEL_REGISTRY

    cls = ARCH_MODEL_REGISTRY.get(arch)
    config = getattr(cls, "__dataclass", None) if cls is not None else None
    if config is not None and not namespace:
        defaults = {}
        for f in dataclasses.fields(config):
            if f.default is not dataclasses.MISSING and not (isinstance(f.default, str) and "${" in f.default):
                defaults[f.name] = f.default
        return None, defaults
    if cls is None or not hasattr(cls, "add_args"):
        return [], {}
    parser = argparse.ArgumentParser(add_help=False)
    cls.add_args(parser)
    return [a.dest for a in parser._actions if a.dest != "help"], {}


def _flag_text(key: str, value) -> str:
    if key == "_name":
        return f"--arch {value}"
    if isinstance(value, bool):
        return f"--{key.replace('_', '-')}" if value else f"no --{key.replace('_', '-')}"
    return f"--{key.replace('_', '-')} {value}"


def model_difference(trained_cfg, cfg) -> "str | None":
    """The first field of the model config in which ``cfg`` (a run about to
    resume) differs from ``trained_cfg`` (its checkpoint's), outside
    :data:`CHANGEABLE_ON_RESUME`, as ``"--flag NEW (the checkpoint: --flag OLD)"``; None
    if the model is the same.  A field the checkpoint predates counts as its default."""
    from argparse import Namespace

    from omegaconf.nodes import AnyNode

    new_model, old_model = cfg.model, getattr(trained_cfg, "model", None)
    if old_model is None:
        return None
    raw = new_model._value() if isinstance(new_model, AnyNode) else new_model
    new, old = _section(new_model), _section(old_model)
    new_arch = new.get("_name") or new.get("arch")
    old_arch = old.get("_name") or old.get("arch")
    if new_arch != old_arch:
        return f"{_flag_text('_name', new_arch)} (the checkpoint: {_flag_text('_name', old_arch)})"
    keys, defaults = _model_fields(new_arch, isinstance(raw, Namespace))
    for key in (keys if keys is not None else list(new)):
        if key in ("_name", "arch") or key in CHANGEABLE_ON_RESUME or key not in new:
            continue
        if key not in old and key not in defaults:
            continue  # a field the checkpoint's code did not have, and no default to read it as
        was = old[key] if key in old else defaults[key]
        if new[key] != was:
            return f"{_flag_text(key, new[key])} (the checkpoint: {_flag_text(key, was)})"
    return None


# ------------------------------------------------------------------ the run a training command resumes
def _source(cfg):
    """The checkpoint ``fairseq_cli.train`` would resume from, as ``checkpoint_utils.load_checkpoint``
    finds it (the save directory's ``checkpoint_last.pt``, or ``--restore-file``), or None: none
    there, a first launch from ``--finetune-from-model``/``--continue-once`` (a new run from weights),
    ``--reset-optimizer`` (the update count starts again), or FSDP's sharded files."""
    import os

    ckpt = cfg.checkpoint
    if ckpt.reset_optimizer or (cfg.distributed_training.ddp_backend == "fully_sharded"
                                and cfg.distributed_training.use_sharded_state):
        return None
    suffix = ckpt.checkpoint_suffix or ""
    if ckpt.restore_file == "checkpoint_last.pt":
        path = os.path.join(ckpt.save_dir, f"checkpoint_last{suffix}.pt")
    else:
        path = ckpt.restore_file.replace(".pt", suffix + ".pt") if suffix else ckpt.restore_file
    return path if os.path.isfile(path) else None


def _finished(cfg, state):
    """(where the run of checkpoint ``state`` stopped, the option that would train it further) if
    it has nothing left to train under ``cfg``, else None."""
    updates = state["optimizer_history"][-1]["num_updates"] if state.get("optimizer_history") else 0
    max_update, max_epoch = cfg.optimization.max_update or 0, cfg.optimization.max_epoch or 0
    if max_update > 0 and updates >= max_update:
        return f"at update {updates} (--max-update {max_update})", "a higher --max-update"
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    if max_epoch > 0 and not cfg.checkpoint.reset_dataloader and iterator.get("epoch", 1) > max_epoch:
        return (f"at update {updates}, the end of epoch {iterator['epoch'] - 1} (--max-epoch {max_epoch})",
                "a higher --max-epoch")
    return None


#: The run being trained: its config (checked, and for :func:`interruption_note`) and the checkpoint it
#: resumed from.
_RUNNING: dict = {}


def saved_update(path) -> "int | None":
    """The update count of checkpoint ``path``, read without loading its tensors (None: unreadable)."""
    import torch

    from ..safe_load import SAFE_GLOBALS

    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(state["optimizer_history"][-1]["num_updates"])
    except Exception:  # noqa: BLE001  (a note on the way out: nothing to say rather than a second error)
        return None


def interruption_note() -> "str | None":
    """Where a rerun of the interrupted training command resumes: the last saved update and its
    file (what the trainer reached past it is trained again), or that it starts again."""
    import os

    cfg = _RUNNING.get("cfg")
    if cfg is None:
        return None
    ckpt = cfg.checkpoint
    if ckpt.no_save or ckpt.no_last_checkpoints:
        flag = "--no-save" if ckpt.no_save else "--no-last-checkpoints"
        return f"no checkpoint_last.pt is saved with {flag}: a rerun of the same command starts from the beginning"
    last = os.path.join(ckpt.save_dir, f"checkpoint_last{ckpt.checkpoint_suffix or ''}.pt")
    updates = saved_update(last) if os.path.isfile(last) else None
    at = f"update {updates}" if updates is not None else "its last saved update"
    if ckpt.restore_file != "checkpoint_last.pt":  # fairseq loads --restore-file at every start
        again = f"a rerun of the same command starts again from --restore-file {ckpt.restore_file}"
        return f"{again}; to resume from {at} give --restore-file {last}" if os.path.isfile(last) else again
    if os.path.isfile(last):
        return f"a rerun of the same command resumes from {at} ({last}); updates after it are trained again"
    return "no checkpoint saved yet: a rerun of the same command starts from the beginning"


def _check_resume(cfg) -> bool:
    """The checks of :func:`guarded_train` on the run of ``cfg``, once per config object (the
    guarded ``main`` hands its own to the trainer): True if the run is finished (said, on the
    first rank), a ``UserError`` if it resumes another model."""
    import copy

    from fairseq import checkpoint_utils
    from fairseq.dataclass.initialize import add_defaults
    from fairseq.distributed import utils as distributed_utils

    from ..errors import UserError

    if _RUNNING.get("cfg") is cfg:
        return False
    source = _source(cfg)
    _RUNNING.update(cfg=cfg, source=source)
    if source is None:
        return False
    state = checkpoint_utils.load_checkpoint_to_cpu(source)
    full = copy.deepcopy(cfg)
    add_defaults(full)
    last = cfg.checkpoint.restore_file == "checkpoint_last.pt"
    where = f"--save-dir {cfg.checkpoint.save_dir}" if last else f"--restore-file {source}"
    difference = model_difference(state.get("cfg"), full)
    if difference:
        raise UserError(f"{where} holds a run of another model: this command gives {difference}; a resumed "
                        "run keeps the model it started with (architecture, shapes, initial values, position "
                        "settings); give a new --save-dir to train this model, or the checkpoint's options "
                        "to resume it")
    for section in ("optimizer", "criterion"):  # fairseq's trainer asserts both, after building everything
        trained = getattr(state.get("cfg"), section, None)
        old = _section(trained).get("_name") if trained is not None else None
        new = _section(full[section]).get("_name")
        if old and new and old != new:
            raise UserError(f"{where} holds a run trained with --{section} {old}: this command gives --{section} "
                            f"{new}; a resumed run keeps its optimizer state, which fairseq takes only with the same "
                            "--optimizer and --criterion; give --reset-optimizer to start from the checkpoint's "
                            "weights with a new optimizer (the update count starts again at 0), or a new --save-dir")
    finished = _finished(cfg, state)
    if finished and distributed_utils.is_master(cfg.distributed_training):
        run = f"the run in {cfg.checkpoint.save_dir}" if last else f"the run of {source}"
        print(f"{run} is already finished {finished[0]}: nothing trained, nothing written; to train it "
              f"further give {finished[1]}", flush=True)
    return bool(finished)


def guarded_train(module) -> None:
    """Applied to ``fairseq_cli.train`` (passed as ``module``) by ``alibi-train``,
    to ``fairseq_cli.hydra_train`` (its ``pre_main``, the training ``main`` it
    imported) by ``alibi-hydra-train``, and by :func:`guarded_stock_train` when a
    stock ``fairseq-train --user-dir`` loaded the plugin.  Before anything is
    built, the checkpoint the run would resume from (``checkpoint_last.pt`` of
    ``--save-dir``, or ``--restore-file``; none with ``--reset-optimizer``,
    which starts the update count again) is read: a model config other than
    the one it was trained with (:func:`model_difference`), or another
    ``--optimizer`` or ``--criterion``, is refused in one line naming the first
    difference; a run with nothing left to train (its updates at
    ``--max-update``, or its epochs past ``--max-epoch``) trains nothing, writes
    nothing and says so in one line, exit status 0.  Idempotent.

    Kind: wrong result.  Stock: rerunning a finished command loads the model
    at --max-update, trains one more update and overwrites
    ``checkpoint_last.pt`` and ``checkpoint_best.pt`` (each rerun one more);
    a resumed run builds its model from the new options, so another
    architecture, shape or ``--ssmax`` is a 30-line traceback from the
    state-dict or optimizer load (another optimizer or criterion: an
    AssertionError's), and another initial value (``--fox-init-slopes``) or
    setting is recorded in every later checkpoint and export although the
    weights were trained from the old one."""
    name = "pre_main" if hasattr(module, "pre_main") else "main"
    stock_main = getattr(module, name)
    if getattr(stock_main, "_alibi_resume_checked", False):
        return

    def main(cfg, *args, **kwargs):
        import argparse

        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        if isinstance(cfg, argparse.Namespace):
            cfg = convert_namespace_to_omegaconf(cfg)
        if _check_resume(cfg):
            return None
        return stock_main(cfg, *args, **kwargs)

    main._alibi_resume_checked = True
    setattr(module, name, main)


def guarded_stock_train() -> None:
    """A stock ``fairseq-train --user-dir`` imports the plugin while parsing its
    options, its ``fairseq_cli.train`` module already loaded (``fairseq-hydra-train``
    with ``common.user_dir``: ``fairseq_cli.hydra_train``): it gets
    :func:`guarded_train` too.

    Kind: wrong result.  Stock: a finished run's rerun trains one more update
    and overwrites its checkpoints; a resumed run with other model options is
    a traceback or records values the weights never started from."""
    import sys

    for name in ("fairseq_cli.train", "fairseq_cli.hydra_train"):
        module = sys.modules.get(name)
        if module is not None and (hasattr(module, "pre_main") or hasattr(module, "main")):
            guarded_train(module)


def resume_checked_at_load() -> None:
    """fairseq's ``checkpoint_utils.load_checkpoint`` runs :func:`guarded_train`'s
    checks on the trainer's config where no guarded ``main`` ran them first (a
    stock ``fairseq-hydra-train`` imports the plugin inside its training
    ``main``, too late to guard it; a script of one's own): a run of another
    model is refused before its state is loaded, and a finished run stops
    there (exit status 0), before it trains or writes.

    Kind: wrong result.  Stock: as :func:`guarded_train` says."""
    from fairseq import checkpoint_utils

    stock = checkpoint_utils.load_checkpoint
    if getattr(stock, "_alibi_resume_checked", False):
        return

    def load_checkpoint(cfg, trainer, **passthrough_args):
        if _check_resume(trainer.cfg):
            raise SystemExit(0)
        return stock(cfg, trainer, **passthrough_args)

    load_checkpoint._alibi_resume_checked = True
    checkpoint_utils.load_checkpoint = load_checkpoint
