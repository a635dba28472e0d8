"""The files of a data directory (``fairseq-preprocess`` output), checked
where fairseq opens them."""

from __future__ import annotations

import os


def checked_data_files() -> None:
    """A data directory's ``dict.txt`` and binarized splits (``.idx``/``.bin``):
    a file fairseq cannot read (another format, another encoding, empty,
    truncated, half a split) is one ``DataError`` or ``TextInputError`` naming
    it; the checks are ``inputs.check_text`` and ``splits.split_problem``.

    Kind: crash.  Stock: a traceback from deep inside fairseq (a UnicodeDecodeError,
    a ValueError about a line, a struct error), or, for a truncated ``.bin``
    that is only read batch by batch, a crash in the middle of a run."""
    import struct

    from fairseq.data import Dictionary, indexed_dataset

    from ..errors import DataError
    from ..inputs import check_text
    from ..splits import split_problem

    stock_add, stock_make = Dictionary.add_from_file, indexed_dataset.make_dataset
    if getattr(stock_make, "_alibi_checked", False):
        return

    def add_from_file(self, f):
        if not isinstance(f, str):
            return stock_add(self, f)
        if os.path.isfile(f):  # a missing one, or a directory: describe() names it as a dictionary path
            check_text(f, "dictionary")
        try:
            return stock_add(self, f)
        except (ValueError, RuntimeError) as exc:
            raise DataError(f"{f} is not a fairseq dictionary ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                            "it holds one '<token> <count>' line per symbol, in UTF-8, as alibi-preprocess writes "
                            "dict.txt") from None

    def make_dataset(path, impl, *args, **kwargs):
        problem = split_problem(path) if impl != "raw" else ""
        if problem:
            raise DataError(problem)
        try:
            return stock_make(path, impl, *args, **kwargs)
        except (ValueError, AssertionError, KeyError, IndexError, struct.error) as exc:
            raise DataError(f"the binarized split {path} (.bin/.idx) cannot be read ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}); binarize it again with alibi-preprocess") from None

    make_dataset._alibi_checked = True
    Dictionary.add_from_file = add_from_file
    indexed_dataset.make_dataset = make_dataset


def quiet_partial_dataset_cleanup() -> None:
    """fairseq's memory-mapped dataset and its index close their file in
    ``__del__`` without asking whether ``__init__`` got as far as opening it:
    one cut short (Ctrl-C while a split is opened, a file that fails to open
    behind :func:`checked_data_files`' one-line error) is then collected with
    a second error.  Patched, the cleanup closes only what was opened.

    Kind: quieting.  Stock: after the interrupt or the one-line error, Python
    prints "Exception ignored in ... __del__" with a traceback ending in
    ``AttributeError: 'Index' object has no attribute '_bin_buffer_mmap'``."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    index = MMapIndexedDataset.Index
    if getattr(index.__del__, "_alibi_quiet", False):
        return
    stock_index_del, stock_dataset_del = index.__del__, MMapIndexedDataset.__del__

    def index_del(self):
        if "_bin_buffer_mmap" in self.__dict__:
            stock_index_del(self)

    def dataset_del(self):
        if "_bin_buffer_mmap" in self.__dict__ and "_index" in self.__dict__:
            stock_dataset_del(self)

    index_del._alibi_quiet = dataset_del._alibi_quiet = True
    index.__del__, MMapIndexedDataset.__del__ = index_del, dataset_del
