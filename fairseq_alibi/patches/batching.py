"""Batches: the last, short batch of a split kept, and fairseq's loader
thread stopped before the interpreter exits."""

from __future__ import annotations

import atexit
import contextlib
import functools
import queue
import threading
import time
import weakref

import numpy as np


def loader_threads_stop_at_exit() -> None:
    """fairseq's batch-loading thread (``BackgroundConsumer``) is stopped
    between two batches and joined at interpreter exit.

    Kind: crash.  Stock: the thread is a daemon that keeps collating batches
    (torch operations) after training stops; killed at interpreter shutdown in
    the middle of one, it aborts a finished run ("terminate called without an
    active exception", exit status -6)."""
    from fairseq.data import iterators

    if getattr(iterators.BackgroundConsumer, "stops_at_exit", False):
        return
    stock = iterators.BackgroundConsumer

    class BackgroundConsumer(stock):
        stops_at_exit = True
        live: "weakref.WeakSet" = weakref.WeakSet()

        def __init__(self, queue, source, max_len, cuda_device):
            super().__init__(queue, source, max_len, cuda_device)
            self.stopping = threading.Event()

            def until_stopped(items):
                for item in items:
                    if self.stopping.is_set():
                        return
                    yield item

            self._source = until_stopped(source)
            BackgroundConsumer.live.add(self)

    def stop_all(timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for thread in list(BackgroundConsumer.live):
            thread.stopping.set()
            while thread.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    while True:  # make room: a blocked put() returns, the loop sees the stop
                        thread._queue.get_nowait()
                thread.join(0.02)

    iterators.BackgroundConsumer = BackgroundConsumer
    atexit.register(stop_all)


_TRAINER = threading.local()  # depth: > 0 while fairseq's Trainer builds its training batches


def _in_trainer(stock):
    @functools.wraps(stock)
    def method(*args, **kwargs):
        _TRAINER.depth = getattr(_TRAINER, "depth", 0) + 1
        try:
            return stock(*args, **kwargs)
        finally:
            _TRAINER.depth -= 1

    return method


def remainder_batches_kept() -> None:
    """Every line of a split is generated or validated: except for the
    training batches of fairseq's ``Trainer``, the last batch of
    ``fairseq.data.data_utils.batch_by_size`` is kept whatever its size.

    Kind: wrong result.  Stock: fairseq 0.12 drops a last batch whose size is
    no multiple of ``--required-batch-size-multiple`` (default 8), so
    ``fairseq-generate`` and ``fairseq-validate`` silently skip up to
    ``--batch-size - 1`` lines (fairseq issue 5036), the validation loss of a
    training run is of part of the split, and a split of fewer samples than
    that multiple stops training with "The dataset is empty".  The batches
    are consecutive slices of ``indices``, so the dropped one is the tail.
    The training batches stay fairseq's, so the updates of a training run are
    the stock one's (validation reads the whole split, which changes nothing
    the optimizer sees unless the learning rate follows the validation loss,
    ``--lr-scheduler reduce_lr_on_plateau``, or ``--patience`` stops on it)."""
    from fairseq.data import data_utils
    from fairseq.trainer import Trainer

    stock = data_utils.batch_by_size
    if getattr(stock, "_alibi_keeps_remainder", False):
        return

    def batch_by_size(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                      required_batch_size_multiple=1, fixed_shapes=None):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batches = stock(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                        required_batch_size_multiple, fixed_shapes)
        kept = sum(len(batch) for batch in batches)
        if (fixed_shapes is None and kept < len(indices) and not getattr(_TRAINER, "depth", 0)
                and (kept == 0 or np.array_equal(np.concatenate(batches), indices[:kept]))):
            batches = list(batches) + [indices[kept:]]
        return batches

    batch_by_size._alibi_keeps_remainder = True
    data_utils.batch_by_size = batch_by_size
    Trainer.get_train_iterator = _in_trainer(Trainer.get_train_iterator)
