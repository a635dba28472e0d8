"""Every change this plugin makes to fairseq 0.12, torch or NumPy, by concern.

:func:`apply` walks :data:`PATCHES` in order; ``fairseq_alibi.models`` (what
registers the models: the ``alibi-*`` console scripts and stock CLIs run with
``--user-dir`` import it) calls it once, never ``fairseq_alibi`` or
``fairseq_alibi.hf``.  It is idempotent.  Each patch is of one of five kinds
(:data:`KINDS`), and its docstring says which and what stock behaviour it
changes:

* **crash**: stock fairseq crashes (a traceback, an abort) or stops on an
  error that does not name the cause; patched, the run works or stops with
  one error line;
* **wrong result**: stock fairseq goes on silently and its result is wrong;
* **start-up**: stock fairseq gives the same result, later;
* **quieting**: stock fairseq prints output a user cannot act on;
* **safety**: stock fairseq runs code that a file or an option's text holds.

``startup.py``
    ``deferred_metric_imports`` (start-up): fairseq imports scikit-learn and
    SciPy for tasks this plugin never runs; they load on first use.  First:
    it works only before anything imports fairseq.
``no_eval.py``
    ``literal_options_only`` (safety): the options fairseq reads with
    ``eval`` (``character_filters``, the optimizers' betas, fconv's layer
    lists) read literals only, so a checkpoint's config or a YAML file never
    runs code.
``numpy_compat.py``
    ``restore_numpy_compat_long`` (crash): NumPy 2 removed ``np.compat.long``,
    which fairseq's ``TokenBlockDataset`` still reads.
``quiet.py``
    ``quiet_harmless_warnings`` (quieting): hydra and torch notices about
    fairseq's own calls (``FAIRSEQ_ALIBI_WARNINGS=1`` shows them).
``distributed.py``
    ``torchrun_on_cpu`` (wrong result): under torchrun without CUDA every
    worker would train alone; ``process_group_destroyed_after_training``
    (crash): a gloo group left to exit can abort a finished worker;
    ``cpu_ddp`` (crash): DDP of a CPU module without ``device_ids``;
    ``safe_broadcast`` (crash): the state a resuming run broadcasts is read by
    the safe loader (torch's default refuses its config).
``checkpoints.py``
    ``safe_checkpoint_loading`` (crash): every checkpoint read through
    ``safe_load.load`` (torch's default refuses fairseq's files; never code
    from a file); ``fork_checkpoints_refused`` (wrong result): the 2021 fork's
    unconverted files would run as sinusoidal models; ``non_checkpoints_refused``
    (crash): another PyTorch file is named, not a KeyError deep in fairseq;
    ``atomic_checkpoint_copies`` (crash): no truncated ``checkpoint_last.pt``;
    ``full_disk_checkpoints`` (crash): a full disk is one error, at once;
    ``checked_overrides`` (wrong result): model overrides fairseq would drop
    silently go through the checks :func:`apply` is given.
``data_files.py``
    ``checked_data_files`` (crash): a ``dict.txt`` or binarized split fairseq
    cannot read is one error naming the file; ``quiet_partial_dataset_cleanup``
    (quieting): a split whose opening was cut short (Ctrl-C) is collected
    without a second traceback.
``hub.py``
    ``checked_hub_paths`` (crash): ``from_pretrained``'s missing or
    wrong-kind local paths are named; ``quiet_hub_config`` (quieting): the
    whole config it logs is kept for DEBUG.
``build_errors.py``
    ``build_assertions`` (crash): fairseq's failed checks while building a
    model or task are one ``ModelOptionsError``.
``parsing.py``
    ``one_line_argument_errors`` (crash): an option fairseq's parsers cannot
    parse or do not take is one error line naming what it takes and where it
    belongs (``arguments.py``), not the whole usage.
``batching.py``
    ``loader_threads_stop_at_exit`` (crash): fairseq's loader thread killed in
    a torch operation at exit aborts a finished run;
    ``remainder_batches_kept`` (wrong result): ``fairseq-generate``,
    ``fairseq-validate`` and validation during training skip the last, short
    batch (fairseq issue 5036).
``resume.py``
    ``batches_as_first_built`` (wrong result): a run resumed in epoch 2 or
    later trains on the uninterrupted run's batches (fairseq keeps the
    batches of the epoch a process started in); ``guarded_stock_train``
    (wrong result): a stock ``fairseq-train --user-dir`` gets the guard below;
    ``resume_checked_at_load`` (wrong result): where no guarded ``main`` ran
    (stock ``fairseq-hydra-train``), fairseq's ``load_checkpoint`` runs its checks.

``eval_lm.py``
    ``guarded_stock_eval_lm`` (wrong result): a stock ``fairseq-eval-lm
    --user-dir`` gets the guard below.

Two changes are scoped, not applied by :func:`apply` (:data:`SCOPED`):
``eval_lm.py``'s ``guarded_eval_lm`` (wrong result), which ``alibi-eval-lm``
applies to ``fairseq_cli.eval_lm``: no perplexity printed from nothing scored,
from part of the split (blocks fairseq skipped), or from a loss that is not a
number; and ``resume.py``'s ``guarded_train`` (wrong result), which
``alibi-train`` applies to ``fairseq_cli.train``: a resumed run with another
model config is refused in one line, a finished run's rerun trains and writes
nothing and says so.

Nothing here imports ``fairseq_alibi.models``: what ``checked_overrides``
runs is passed in, ``apply(override_checks=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Tuple

from . import (
    batching, build_errors, checkpoints, data_files, distributed, eval_lm, hub, no_eval, numpy_compat, parsing, quiet,
    resume, startup,
)
from .checkpoints import OverrideCheck
from .eval_lm import guarded_eval_lm  # noqa: F401  (alibi-eval-lm's CLI imports it from here)
from .resume import guarded_train, interruption_note  # noqa: F401  (alibi-train's CLI imports them from here)
from .startup import deferred_metric_imports  # noqa: F401  (what imports fairseq first, the plugin's way)

CRASH = "crash"
WRONG_RESULT = "wrong result"
STARTUP = "start-up"
QUIETING = "quieting"
SAFETY = "safety"

#: Each kind of patch, and what stock fairseq does without one of that kind.
KINDS = {
    CRASH: "stock fairseq crashes (a traceback, an abort) or stops on an error that does not name "
           "the cause; patched, the run works or stops with one error line",
    WRONG_RESULT: "stock fairseq goes on silently and its result is wrong",
    STARTUP: "stock fairseq gives the same result, later",
    QUIETING: "stock fairseq prints output a user cannot act on",
    SAFETY: "stock fairseq runs code that a file or an option's text holds",
}


@dataclass(frozen=True)
class Patch:
    """One change to fairseq: the function that makes it (idempotent), its kind,
    and the keyword arguments of :func:`apply` it receives."""

    apply: Callable[..., None]
    kind: str
    takes: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.apply.__name__

    @property
    def concern(self) -> str:
        """The module of this package that holds it."""
        return self.apply.__module__.rsplit(".", 1)[-1]


#: What :func:`apply` runs, in this order.
PATCHES: Tuple[Patch, ...] = (
    Patch(startup.deferred_metric_imports, STARTUP),  # first: before anything imports fairseq
    Patch(no_eval.literal_options_only, SAFETY),
    Patch(numpy_compat.restore_numpy_compat_long, CRASH),
    Patch(quiet.quiet_harmless_warnings, QUIETING),
    Patch(distributed.torchrun_on_cpu, WRONG_RESULT),
    Patch(distributed.process_group_destroyed_after_training, CRASH),
    Patch(distributed.cpu_ddp, CRASH),
    Patch(distributed.safe_broadcast, CRASH),
    Patch(checkpoints.safe_checkpoint_loading, CRASH),
    Patch(checkpoints.fork_checkpoints_refused, WRONG_RESULT),
    Patch(checkpoints.non_checkpoints_refused, CRASH),
    Patch(checkpoints.atomic_checkpoint_copies, CRASH),
    Patch(checkpoints.full_disk_checkpoints, CRASH),
    Patch(checkpoints.checked_overrides, WRONG_RESULT, takes=("override_checks",)),
    Patch(data_files.checked_data_files, CRASH),
    Patch(data_files.quiet_partial_dataset_cleanup, QUIETING),
    Patch(hub.checked_hub_paths, CRASH),
    Patch(hub.quiet_hub_config, QUIETING),
    Patch(build_errors.build_assertions, CRASH),
    Patch(parsing.one_line_argument_errors, CRASH),
    Patch(batching.loader_threads_stop_at_exit, CRASH),
    Patch(batching.remainder_batches_kept, WRONG_RESULT),
    Patch(resume.batches_as_first_built, WRONG_RESULT),  # after batching's wrapper of the same method
    Patch(eval_lm.guarded_stock_eval_lm, WRONG_RESULT),
    Patch(resume.guarded_stock_train, WRONG_RESULT),
    Patch(resume.resume_checked_at_load, WRONG_RESULT),
)

#: Changes one command applies to one fairseq module itself (``patch.apply(module)``).
SCOPED: Tuple[Patch, ...] = (
    Patch(eval_lm.guarded_eval_lm, WRONG_RESULT),
    Patch(resume.guarded_train, WRONG_RESULT),
)


def apply(override_checks: Iterable[OverrideCheck] = ()) -> None:
    """Apply every patch of :data:`PATCHES`, in order (idempotent).

    ``override_checks``: what ``checked_overrides`` runs on a checkpoint's
    config and its model overrides before fairseq applies them
    (``check(overrides, cfg)``); a later call adds checks, never removes one."""
    given = {"override_checks": tuple(override_checks)}
    for patch in PATCHES:
        patch.apply(**{name: given[name] for name in patch.takes})
