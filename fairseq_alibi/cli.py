"""Console scripts: fairseq's own CLIs with the plugin preloaded."""

import os
import sys

import fairseq_alibi


def _run(module_name: str) -> None:
    import importlib

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
    sys.stdout.write(os.path.dirname(os.path.abspath(fairseq_alibi.__file__)) + "\n")
