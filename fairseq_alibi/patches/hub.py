"""The hub interface (``from_pretrained``): its local paths checked, its
configuration record kept for DEBUG."""

from __future__ import annotations

import logging
import os


def _hub_paths_problem(model_dir: str, checkpoint_file: str, data: str) -> str:
    """What is wrong with the local paths of a hub ``from_pretrained`` call, or ``""``."""
    import tarfile

    from ..errors import not_a_file

    if os.path.isfile(model_dir) and tarfile.is_tarfile(model_dir):
        return ""  # a model archive: fairseq unpacks it
    if not os.path.isdir(model_dir):
        what = "is a file: give the directory that holds it" if os.path.exists(model_dir) else "not found"
        return f"model directory {model_dir} {what} (from_pretrained(MODEL_DIR, CHECKPOINT_FILE, data_name_or_path=DATA))"
    for name in checkpoint_file.split(os.pathsep):
        if not os.path.isfile(os.path.join(model_dir, name)):
            return not_a_file(os.path.join(model_dir, name), "checkpoint file")
    if not os.path.isdir(data) and not (os.path.isfile(data) and tarfile.is_tarfile(data)):
        what = "is a file, not a directory" if os.path.exists(data) else "not found"
        return f"data directory {data} {what}: give the fairseq-preprocess output directory (with dict.txt)"
    return ""


def checked_hub_paths() -> None:
    """``from_pretrained(MODEL_DIR, CHECKPOINT_FILE, data_name_or_path=DATA)``
    with local paths: a missing or wrong-kind path is one ``UserError`` naming it.

    Kind: crash.  Stock: fairseq answers a TypeError about None, or tries to
    unpack a text file as an archive.  Names of fairseq's own hub models and
    URLs are left to fairseq."""
    from fairseq import hub_utils

    from ..errors import UserError

    stock = hub_utils.from_pretrained
    if getattr(stock, "_alibi_checked", False):
        return

    def from_pretrained(model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", archive_map=None,
                        **kwargs):
        names = archive_map or {}
        local = isinstance(model_name_or_path, str) and "://" not in model_name_or_path and model_name_or_path not in names
        if local and isinstance(data_name_or_path, str) and data_name_or_path not in names:
            data = data_name_or_path
            if data.startswith("."):  # fairseq: relative to the model directory
                data = os.path.join(model_name_or_path, data)
            problem = "://" not in data and _hub_paths_problem(model_name_or_path, str(checkpoint_file), data)
            if problem:
                raise UserError(problem)
        return stock(model_name_or_path, checkpoint_file, data_name_or_path, archive_map, **kwargs)

    from_pretrained._alibi_checked = True
    hub_utils.from_pretrained = from_pretrained


class _ConfigRecordAtDebug(logging.Filter):
    """Drops the configuration object ``from_pretrained`` logs at INFO unless DEBUG is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) or record.levelno != logging.INFO:
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_hub_config() -> None:
    """The configuration object ``from_pretrained`` logs is kept for DEBUG.

    Kind: quieting.  Stock: fairseq logs the whole config (a DictConfig or
    Namespace of hundreds of fields, not a message) at INFO on every load.
    Messages (strings) at INFO are still shown."""
    logger = logging.getLogger("fairseq.models.fairseq_model")
    if not any(isinstance(f, _ConfigRecordAtDebug) for f in logger.filters):
        logger.addFilter(_ConfigRecordAtDebug())
