"""Console scripts: fairseq's own CLIs with the plugin preloaded.

Each is a few lines: hand the root logger back to the stock CLI, check what
fairseq would turn into a traceback, hand over, and report user-fixable errors
as one ``error:`` line (``errors.report_errors``).  ``alibi-sweep`` and
``alibi-convert-checkpoint`` and ``alibi-export-hf`` live with their tools
(``evaluation/``, ``fork.py``, ``export/``);
``alibi-user-dir`` in ``alibi_user_dir.py`` (it must not import fairseq).
"""

import importlib
import logging
import sys
from typing import List, Optional

from .errors import UserError, closest, report_errors

logger = logging.getLogger("fairseq_alibi")


def _flag(argv: List[str], *names: str) -> Optional[str]:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` in ``argv``."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def check_arch(argv: List[str]) -> None:
    """An unknown ``--arch`` names its closest matches (argparse would list all
    ~200); a stock ``transformer_lm*`` name warns that it is not ALiBi here."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    from .models import facts

    arch = _flag(argv, "--arch", "-a")
    if arch is None:
        return
    if arch not in ARCH_MODEL_REGISTRY:
        raise UserError(
            f"unknown --arch {arch!r}{closest(arch, ARCH_MODEL_REGISTRY) or ''}"
            " (`alibi-train --help` lists every architecture)"
        )
    if arch in facts.stock_archs(facts.STOCK_LM):
        twin = facts.twin_name(arch)
        logger.warning(
            "--arch %s is fairseq's stock model with sinusoidal positions, not ALiBi (in the 2021 "
            "ALiBi fork this name meant ALiBi); for ALiBi use --arch %s", arch, twin,
        )


def check_context_window(argv: List[str]) -> None:
    """``--context-window`` must leave tokens to score in each window."""
    context = _flag(argv, "--context-window")
    if context is None:
        return
    tokens = _flag(argv, "--tokens-per-sample") or "1024"  # the language_modeling default
    try:
        context_i, tokens_i = int(context), int(tokens)
    except ValueError:
        return  # argparse reports the bad number
    if not 0 <= context_i < tokens_i:
        raise UserError(
            f"--context-window {context} must be at least 0 and smaller than --tokens-per-sample "
            f"{tokens}: each window scores its last (tokens-per-sample - context-window) tokens; "
            f"for a stride S use --context-window {tokens_i} - S"
        )


def overrides_help() -> str:
    """The ALiBi ``--model-overrides`` keys, printed after argparse's help."""
    from .alibi import METHODS
    from .kernels import KERNEL_NAMES

    def choices(names):
        return "|".join(repr(n) for n in names)

    return (
        f"\nALiBi at evaluation: --model-overrides \"{{'alibi_interpolation': {choices(METHODS)}, "
        "'alibi_scale_factor': F (linear/ntk: 0 = dynamic; cap: F x L, 0 = L), 'alibi_train_length': L, "
        f"'alibi_attention': {choices(KERNEL_NAMES)}}}\" (docs/usage.md)\n"
    )


def training_help(argv: List[str]) -> None:
    """``--help`` with the model's options: stock fairseq prints help before it
    knows the architecture, so the ``--alibi-*`` flags never showed.  Defaults:
    ``--task language_modeling --arch transformer_lm_alibi``."""
    if not {"-h", "--help"} & set(argv):
        return
    from fairseq import options

    rest = [a for a in argv if a not in ("-h", "--help")]
    if _flag(rest, "--task") is None:
        rest += ["--task", "language_modeling"]
    if _flag(rest, "--arch", "-a") is None:
        rest += ["--arch", "transformer_lm_alibi"]
    parser = options.get_training_parser()
    options.parse_args_and_arch(parser, ["DATA", *rest], parse_known=True)
    parser.print_help()
    raise SystemExit(0)


def _run(module_name: str, *checks, with_overrides_help: bool = False) -> None:
    import fairseq_alibi  # noqa: F401  (patches fairseq, registers the models)

    # fairseq.tasks.text_to_speech calls logging.basicConfig on import, before
    # the stock CLI's own call: drop its handler so the CLI logs as it does stock
    # (timestamps, INFO, stdout).
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    with report_errors(interrupted=f"{sys.argv[0].rsplit('/', 1)[-1]} interrupted"):
        module = importlib.import_module(module_name)
        for check in checks:
            check(sys.argv[1:])
        try:
            module.cli_main()
        finally:
            if with_overrides_help and {"-h", "--help"} & set(sys.argv[1:]):
                sys.stdout.write(overrides_help())  # after argparse's help


def train():
    _run("fairseq_cli.train", training_help, check_arch)


def eval_lm():
    _run("fairseq_cli.eval_lm", check_context_window, with_overrides_help=True)


def generate():
    _run("fairseq_cli.generate", with_overrides_help=True)


def interactive():
    _run("fairseq_cli.interactive", with_overrides_help=True)


def hydra_train():
    _run("fairseq_cli.hydra_train")


def preprocess():
    _run("fairseq_cli.preprocess")


def export_hf():
    """``alibi-export-hf CHECKPOINT OUTPUT_DIR``: a fairseq ALiBi LM as a Hugging Face model."""
    from .export import main

    sys.exit(main())


def convert_checkpoint():
    """``alibi-convert-checkpoint IN OUT``: the fork's format -> this plugin's."""
    from .fork import main

    sys.exit(main())
