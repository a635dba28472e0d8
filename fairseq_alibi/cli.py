"""Console scripts: fairseq's own CLIs with the plugin preloaded, and the
plugin's tools; every one reports user-fixable errors as one ``error:`` line
(``errors.report_errors``)."""

import importlib
import os
import sys

from .errors import report_errors


def _run(module_name: str) -> None:
    import fairseq_alibi  # noqa: F401  (patches fairseq, registers the models)

    with report_errors():
        importlib.import_module(module_name).cli_main()


def train():
    _run("fairseq_cli.train")


def eval_lm():
    _run("fairseq_cli.eval_lm")


def generate():
    _run("fairseq_cli.generate")


def interactive():
    _run("fairseq_cli.interactive")


def hydra_train():
    _run("fairseq_cli.hydra_train")


def preprocess():
    _run("fairseq_cli.preprocess")


def user_dir():
    """Print the path to pass to stock fairseq CLIs as ``--user-dir``."""
    sys.stdout.write(os.path.dirname(os.path.abspath(__file__)) + "\n")


def convert_checkpoint():
    """``alibi-convert-checkpoint IN OUT``: the fork's format -> this plugin's."""
    from .fork import main

    sys.exit(main())
