"""Console scripts: fairseq's own CLIs with the plugin preloaded."""

import os
import sys

import fairseq_alibi


def _run(module_name: str) -> None:
    import importlib

    with report_errors():
        importlib.import_module(module_name).cli_main()


# Errors a user can fix (bad ALiBi config values, bad or missing files,
# unsafe or unconverted checkpoints, a checkpoint of another model family) are
# printed as one `error: ...` line on stderr with exit status 1 instead of a
# traceback;
# fairseq_alibi.checkpoints.describe_error decides which.
# FAIRSEQ_ALIBI_TRACEBACK=1 shows the traceback as well.
class report_errors:
    """Context manager for console scripts: known errors -> one line, exit 1."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not isinstance(exc, Exception):
            return False
        from .checkpoints import describe_error
        from .models.transformer_lm import AlibiConfigError

        if isinstance(exc, AlibiConfigError):  # names the field and the allowed values
            message = " ".join(str(exc).split())
        else:
            message = describe_error(exc)
        if message is None:
            return False
        if os.environ.get("FAIRSEQ_ALIBI_TRACEBACK"):
            import traceback

            traceback.print_exception(exc_type, exc, tb)
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        raise SystemExit(1)


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


def convert_checkpoint():
    """``alibi-convert-checkpoint IN OUT``: the fork's format -> this plugin's."""
    from .checkpoints import main

    sys.exit(main())
