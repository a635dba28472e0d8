"""Console scripts: fairseq's own CLIs with the plugin preloaded.

Each is a few lines: hand the root logger back to the stock CLI, check what
fairseq would turn into a traceback, hand over, and report user-fixable errors
as one ``error:`` line (``errors.report_errors``).  ``alibi-sweep`` and
``alibi-convert-checkpoint`` and ``alibi-export-hf`` live with their tools
(``evaluation/``, ``fork.py``, ``export/``);
``alibi-user-dir`` in ``alibi_user_dir.py`` (it must not import fairseq).
"""

import ast
import importlib
import logging
import os
import sys
from typing import List

from .arguments import flag_value
from .errors import UserError, closest, report_errors

logger = logging.getLogger("fairseq_alibi")


def check_training_method(argv: List[str]) -> None:
    """A context-extension method given to training is trained with and stored in
    the checkpoint, which every later evaluation then uses: said, once."""
    from .core.scaling import METHODS

    for flag in ("--position-scaling", "--alibi-interpolation"):
        method = flag_value(argv, flag)
        name = (method or "").partition(":")[0].strip().lower()
        if name in METHODS and name != "none":  # an unknown name is the model build's one error line
            logger.warning(
                "%s %s is a method for evaluating past the training length: the model trains with it and the "
                "checkpoint stores it, so every later evaluation uses it unless overridden; to train the plain "
                "model leave it out and choose a method when evaluating (--model-overrides, alibi-sweep "
                "--methods)", flag, method,
            )
            return


def check_training_kernel(argv: List[str]) -> None:
    """``--alibi-attention flex`` cannot train without CUDA: refused in one line at
    once, not after fairseq has loaded the data and compiled a validation pass."""
    if flag_value(argv, "--alibi-attention") != "flex":
        return
    import torch

    if "--cpu" in argv or not torch.cuda.is_available():
        from .core.flex import cannot_train_on

        raise UserError(cannot_train_on("cpu"))


def check_training_criterion(argv: List[str]) -> None:
    """``--criterion adaptive_loss`` (an adaptive softmax's, the paper's WikiText-103
    models) runs only under fairseq's own ``--ddp-backend legacy_ddp``, also on one
    CPU: fairseq raised that after loading the data, with a traceback."""
    backend = flag_value(argv, "--ddp-backend")
    if flag_value(argv, "--criterion") == "adaptive_loss" and backend not in ("legacy_ddp", "no_c10d"):
        raise UserError(f"--criterion adaptive_loss needs --ddp-backend legacy_ddp (fairseq's adaptive loss does not "
                        f"run under PyTorch's DistributedDataParallel, --ddp-backend "
                        f"{backend or 'pytorch_ddp, the default'}); add --ddp-backend legacy_ddp")


def check_arch(argv: List[str]) -> None:
    """An unknown ``--arch`` names its closest matches (argparse would list all
    ~200); a stock ``transformer_lm*`` name warns that it is not ALiBi here."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    from . import facts

    arch = flag_value(argv, "--arch", "-a")
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
    context = flag_value(argv, "--context-window")
    if context is None:
        return
    tokens = flag_value(argv, "--tokens-per-sample") or "1024"  # the language_modeling default
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


def check_training_blocks(argv: List[str]) -> None:
    """``language_modeling`` with ``--sample-break-mode none`` trains on blocks of
    ``--tokens-per-sample`` tokens; fairseq drops every sample longer than
    ``--max-tokens`` and then crashes (IndexError) or trains on the last short block."""
    task, mode = flag_value(argv, "--task"), flag_value(argv, "--sample-break-mode") or "none"
    max_tokens, tokens = flag_value(argv, "--max-tokens"), flag_value(argv, "--tokens-per-sample") or "1024"
    if max_tokens is None and flag_value(argv, "--batch-size") is None and flag_value(argv, "--max-sentences") is None:
        # stock fairseq: an AssertionError traceback ("Must specify batch size ...")
        raise UserError("no batch size: give --max-tokens N (tokens per batch, at least one sample's "
                        f"--tokens-per-sample {tokens}) or --batch-size N (samples per batch)")
    if task != "language_modeling" or mode != "none" or max_tokens is None:
        return
    try:
        too_small = int(max_tokens) < int(tokens)
    except ValueError:
        return  # argparse reports the bad number
    if too_small:
        raise UserError(
            f"--max-tokens {max_tokens} is smaller than one training sample (--tokens-per-sample {tokens}): "
            f"fairseq would drop every sample longer than --max-tokens; give --max-tokens {tokens} or more, "
            "or --batch-size N"
        )


#: fairseq-eval-lm's batch limit when no --max-tokens is given (fairseq_cli/eval_lm.py).
EVAL_LM_MAX_TOKENS = 36000


def eval_lm_batches(argv: List[str]) -> List[str]:
    """``argv`` with the batch limit made explicit where the user gave no ``--max-tokens``:
    fairseq-eval-lm then limits batches to 36000 tokens, so a block longer than that
    was refused, with ``--batch-size N`` alone too (docs/evaluating.md: use it alone).
    The limit becomes ``max(36000, N x --tokens-per-sample)`` (N = 1 without
    ``--batch-size``): the stock limit wherever it held a block, never one that refuses it."""
    if flag_value(argv, "--max-tokens") is not None:
        return argv
    try:
        blocks = int(flag_value(argv, "--batch-size", "--max-sentences") or 1)
        tokens = int(flag_value(argv, "--tokens-per-sample") or 1024)  # the language_modeling default
    except ValueError:
        return argv  # argparse reports the bad number
    limit = min(max(EVAL_LM_MAX_TOKENS, blocks * tokens), 2**31 - 1)
    return argv if limit == EVAL_LM_MAX_TOKENS else argv + ["--max-tokens", str(limit)]


def training_defaults(argv: List[str]) -> List[str]:
    """``alibi-train``'s defaults, as its ``--help`` shows them: ``--task language_modeling``
    (stock fairseq-train's is translation, which rejects ``--tokens-per-sample``) and, for
    that task, ``--arch transformer_lm_alibi`` (fairseq raised a bare RuntimeError without
    an ``--arch``); another task needs its ``--arch``."""
    task = flag_value(argv, "--task")
    if task is None:
        argv = argv + ["--task", "language_modeling"]
    if flag_value(argv, "--arch", "-a") is None:
        if task not in (None, "language_modeling"):
            raise UserError(f"--task {task} needs an --arch (`alibi-train --task {task} --help` lists them)")
        argv = argv + ["--arch", "transformer_lm_alibi"]
    return argv


def check_model_overrides(argv: List[str]) -> None:
    """``--model-overrides`` must be a dict literal (fairseq ``eval``s the string:
    anything else is a SyntaxError or runs as code); its plugin values are
    checked by type where the checkpoint is loaded (``models.config``)."""
    text = flag_value(argv, "--model-overrides")
    if text is None:
        return
    example = "--model-overrides \"{'position_scaling': 'ntk:2'}\""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise UserError(f"--model-overrides {text!r} is not a Python dict literal; write e.g. {example}") from None
    if not isinstance(value, dict):
        raise UserError(f"--model-overrides must be a dict, got {type(value).__name__} {text!r}; write e.g. {example}")


def check_numeric_flags(argv: List[str]) -> None:
    """Every integer flag of ``options.INTEGER_OPTIONS`` and real flag of
    ``options.REAL_OPTIONS`` given (``--tokens-per-sample`` for
    ``tokens_per_sample``) is in its range: fairseq checks none of them (0
    tokens per sample is a ZeroDivisionError, 2**31 an OverflowError, seed -1 a
    numpy ValueError, dropout NaN no dropout at all)."""
    from .options import INTEGER_OPTIONS, REAL_OPTIONS, integer_problem, real_problem

    for table, parse, problem_of in ((INTEGER_OPTIONS, int, integer_problem), (REAL_OPTIONS, float, real_problem)):
        for key in table:
            flag = "--" + key.replace("_", "-")
            text = flag_value(argv, flag)
            if text is None:
                continue
            try:
                value = parse(text)
            except ValueError:
                continue  # argparse reports a value that is not a number
            problem = problem_of(key, value)
            if problem:
                raise UserError(f"{flag} {text} is not valid: it {problem}")


def check_checkpoint_flags(argv: List[str]) -> None:
    """``--restore-file`` (other than fairseq's default, ``checkpoint_last.pt`` in
    ``--save-dir``) and ``--finetune-from-model`` name checkpoint files that
    exist.  Stock fairseq trained from scratch, exit status 0, when a named
    ``--restore-file`` was missing or a directory (it reads the path as given,
    not under ``--save-dir``), and raised a ValueError traceback for a missing
    ``--finetune-from-model``."""
    from .errors import checkpoint_files

    for flag in ("--restore-file", "--finetune-from-model"):
        path = flag_value(argv, flag)
        if path is None or (flag == "--restore-file" and path == "checkpoint_last.pt"):
            continue
        if os.path.isdir(path):
            raise UserError(f"{flag}: {checkpoint_files(path)}")
        if not os.path.isfile(path):
            hint = (" (read as given, from the current directory: not under --save-dir)"
                    if flag == "--restore-file" and os.sep not in path else "")
            raise UserError(f"{flag}: checkpoint file not found: {path}{hint}; give the path of a checkpoint "
                            "file" + (", or leave the flag out to resume from --save-dir's checkpoint_last.pt"
                                      if flag == "--restore-file" else ""))


def check_model_path(argv: List[str]) -> None:
    """The evaluation and generation scripts need ``--path CHECKPOINT``: fairseq
    met its absence as an AttributeError on None."""
    if flag_value(argv, "--path") is None and not {"-h", "--help"} & set(argv):
        raise UserError("--path CHECKPOINT is required: the checkpoint file to load (e.g. "
                        "--path checkpoints/checkpoint_best.pt, which fairseq-train writes)")


def check_sampling(argv: List[str]) -> None:
    """``--sampling`` draws one sequence per beam and fairseq asserts ``--nbest``
    equal to ``--beam`` (5 and 1 by default): say which to give."""
    if "--sampling" not in argv:
        return
    beam, nbest = flag_value(argv, "--beam") or "5", flag_value(argv, "--nbest") or "1"
    if beam != nbest:
        raise UserError(f"--sampling draws one sequence per beam, so --nbest ({nbest}) must equal --beam ({beam}); "
                        "give --beam 1 for one sampled sequence per input (or --nbest equal to --beam)")


def check_position_flags(argv: List[str]) -> None:
    """Every position method's flag given (``--fire-hidden``, ``--rotary-base``)
    takes a value its ``core.params.Param`` allows, checked before fairseq loads
    data or builds anything (the model build checks the config again, for
    Hydra and the hub API).  With an ``--arch``, its method's flags alone: another
    method's is argparse's one line, which names the architectures that take it
    (``arguments.py``), not a range it could never have."""
    from . import facts
    from .core.positions import params_of

    arch = flag_value(argv, "--arch", "-a")
    method = facts.position_of(facts.model_family(arch)) if arch is not None else None
    for name, param in params_of():
        if arch is not None and name != method:
            continue
        text = flag_value(argv, param.flag)
        if text is None:
            continue
        try:
            value = int(text) if param.valid.kind is int else float(text)
        except ValueError:
            continue  # argparse reports a value that is not a number
        problem = param.problem(value)
        if problem:
            raise UserError(f"{param.flag} {text} is not valid: it {problem}")


def overrides_help() -> str:
    """The ``--model-overrides`` keys, printed after argparse's help: each ALiBi
    config field with its own ``--help`` text (``models.config.field_help``), then
    each position method's from the registry (``arguments.position_keys_help``)."""
    import textwrap

    from .arguments import position_keys_help
    from .models.config import WEIGHT_FLAGS, field_help
    from .models.transformer_lm import AlibiLanguageModelConfig

    lines = ["", "Position methods at evaluation: --model-overrides \"{'position_scaling': 'ntk:2'}\" (or, the older "
             "names, \"{'alibi_interpolation': 'ntk', 'alibi_scale_factor': 2}\") takes these keys "
             "(docs/evaluating.md):"]
    for name, text in field_help(AlibiLanguageModelConfig).items():
        lines.append(textwrap.fill(f"{name}: {text}", width=100, initial_indent="  ", subsequent_indent="      "))
    lines += ["Each position method's own keys (another method's are refused):",
              position_keys_help(tuple(WEIGHT_FLAGS))]
    return "\n".join(lines) + "\n"


def training_help(argv: List[str]) -> None:
    """``--help`` with the model's options: stock fairseq prints help before it
    knows the architecture, so the ``--alibi-*`` flags never showed.  Defaults:
    ``--task language_modeling --arch transformer_lm_alibi``."""
    if not {"-h", "--help"} & set(argv):
        return
    from fairseq import options

    rest = [a for a in argv if a not in ("-h", "--help")]
    if flag_value(rest, "--task") is None:
        rest += ["--task", "language_modeling"]
    if flag_value(rest, "--arch", "-a") is None:
        rest += ["--arch", "transformer_lm_alibi"]
    parser = options.get_training_parser()
    options.parse_args_and_arch(parser, ["DATA", *rest], parse_known=True)
    parser.print_help()
    raise SystemExit(0)


class _Interrupted:
    """The line a Ctrl-C prints: ``<script> interrupted``, then ``note()`` if it says something
    (``alibi-train``: where a rerun resumes)."""

    def __init__(self, note=None):
        self.text, self.note = f"{sys.argv[0].rsplit('/', 1)[-1]} interrupted", note

    def __str__(self):
        said = self.note() if self.note is not None else None
        return f"{self.text}: {said}" if said else self.text

    def __format__(self, spec):  # report_errors writes it in an f-string
        return format(str(self), spec)


def _run(module_name: str, *checks, with_overrides_help: bool = False, guard=None, defaults=None,
         interruption_note=None) -> None:
    interrupted = _Interrupted(interruption_note)
    with report_errors(interrupted=interrupted):  # numbers and overrides first: before fairseq loads
        for check in (check_numeric_flags, check_model_overrides, check_sampling):
            check(sys.argv[1:])
    import fairseq_alibi.models  # noqa: F401  (patches fairseq, registers the models)

    # fairseq.tasks.text_to_speech calls logging.basicConfig on import, before
    # the stock CLI's own call: drop its handler so the CLI logs as it does stock
    # (timestamps, INFO, stdout).
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    with report_errors(interrupted=interrupted):
        module = importlib.import_module(module_name)
        if defaults is not None and not {"-h", "--help"} & set(sys.argv[1:]):
            sys.argv[1:] = defaults(sys.argv[1:])
        for check in checks:
            check(sys.argv[1:])
        if guard is not None:
            guard(module)
        try:
            module.cli_main()
        finally:
            if with_overrides_help and {"-h", "--help"} & set(sys.argv[1:]):
                sys.stdout.write(overrides_help())  # after argparse's help


def checked_training_data(module) -> None:
    """``alibi-train``'s data directories are checked before fairseq's ``main`` creates
    ``--save-dir`` (or a ``--log-file``): their dictionaries UTF-8 text, the training
    and validation splits whole (``inputs.data_dir_problem``)."""
    from .inputs import data_dir_problem

    stock = module.main

    def main(cfg, *args, **kwargs):
        task, dataset = getattr(cfg, "task", cfg), getattr(cfg, "dataset", cfg)
        data = getattr(task, "data", None)
        valid = str(getattr(dataset, "valid_subset", "valid")).split(",")
        subsets = [getattr(dataset, "train_subset", "train"), *valid]
        for directory in (data.split(":") if isinstance(data, str) else []):
            problem = data_dir_problem(directory, subsets)
            if problem:
                raise UserError(problem)
        return stock(cfg, *args, **kwargs)

    module.main = main


def _resume_guard(module) -> None:
    """The checkpoint a training run resumes from read first (``patches.resume.guarded_train``)."""
    from .patches import guarded_train

    guarded_train(module)


def _interruption_note():
    from .patches import interruption_note

    return interruption_note()


def train():
    def guard(module):
        _resume_guard(module)  # the resumed run's checkpoint read, after the data directories were checked
        checked_training_data(module)

    _run("fairseq_cli.train", training_help, check_arch, check_position_flags, check_training_blocks,
         check_training_method, check_training_kernel, check_checkpoint_flags, check_training_criterion, guard=guard,
         defaults=training_defaults, interruption_note=_interruption_note)


def eval_lm():
    def guard(module):
        from .patches import guarded_eval_lm  # after the checks that need no fairseq

        guarded_eval_lm(module)

    _run("fairseq_cli.eval_lm", check_model_path, check_context_window, with_overrides_help=True, guard=guard,
         defaults=eval_lm_batches)


def generate():
    _run("fairseq_cli.generate", check_model_path, with_overrides_help=True)


def check_input_file(argv: List[str]) -> None:
    """``alibi-interactive --input FILE`` is UTF-8 text (fairseq met another
    encoding as a UnicodeDecodeError traceback, after the model had loaded)."""
    from .inputs import check_text

    path = flag_value(argv, "--input")
    if path not in (None, "-"):
        check_text(path, "input file", flag="--input")


def interactive():
    _run("fairseq_cli.interactive", check_model_path, check_input_file, with_overrides_help=True)


HYDRA_HELP = """usage: alibi-hydra-train --config-dir DIR --config-name NAME [KEY=VALUE ...]

fairseq-hydra-train with the ALiBi plugin loaded: trains from a YAML config
(examples/language_model/config/ has the paper's), each KEY=VALUE overriding
one field (model.alibi_scale_factor=2; +KEY=VALUE for a key the YAML lacks).

Hydra writes a copy of the composed config (.hydra/) and hydra_train.log into
its run directory: the working directory with fairseq's configs
(hydra.run.dir=.), or hydra.run.dir=DIR.  Checkpoints go to
checkpoint.save_dir.

--help-all prints Hydra's own help, listing every config group (slow: about
10 s, Hydra copies fairseq's whole config store once per group).
Details: docs/training.md, "With Hydra".
"""


def check_hydra_config(argv: List[str]) -> None:
    """``--config-dir`` is a directory and ``--config-name`` a YAML in it (or in
    fairseq's own configs): Hydra would otherwise run fairseq's default config
    and fail on a setting the user never saw ("Must specify batch size")."""
    import fairseq

    directory, name = flag_value(argv, "--config-dir", "-cd"), flag_value(argv, "--config-name", "-cn")
    if directory is not None and not os.path.isdir(directory):
        what = "is a file, not a directory" if os.path.exists(directory) else "not found"
        raise UserError(f"--config-dir {directory} {what}: give the directory of your YAML configs "
                        "(e.g. examples/language_model/config)")
    if name is None:
        return
    dirs = ([directory] if directory else []) + [os.path.join(os.path.dirname(fairseq.__file__), "config")]
    config = next((os.path.join(d, name + ext) for d in dirs for ext in (".yaml", ".yml", "")
                   if os.path.isfile(os.path.join(d, name + ext))), None)
    if config is None:
        found = sorted(n.rsplit(".", 1)[0] for n in os.listdir(dirs[0]) if n.endswith((".yaml", ".yml")))
        raise UserError(f"--config-name {name}: no {name}.yaml in {dirs[0]}"
                        + (closest(name, found) or f"; configs there: {', '.join(found[:12]) or 'none'}"))
    from .inputs import check_text

    check_text(config, "Hydra config", flag="--config-name")


def one_line_hydra_errors() -> None:
    """Hydra's own parser (``--config-dir``, ``--config-name``, overrides) errs in
    one line too, as fairseq's do (``arguments.OneLineParser``); fairseq's first
    look at the options (for ``--config-name``, its errors swallowed) reads the
    options it knows, so that the mistake is reported once, by Hydra's parse."""
    from hydra._internal import utils

    from .arguments import one_line_errors

    stock = utils.get_args_parser

    def get_args_parser():
        return one_line_errors(stock())

    def get_args(args=None):
        return stock().parse_known_args(args)[0]

    importlib.import_module("hydra.main").get_args_parser = get_args_parser  # (hydra.main is also a function)
    utils.get_args = get_args


def hydra_train():
    argv = sys.argv[1:]
    if {"-h", "--help"} & set(argv):
        sys.stdout.write(HYDRA_HELP)
        raise SystemExit(0)
    if "--help-all" in argv:
        sys.argv = [a if a != "--help-all" else "--help" for a in sys.argv]
    else:
        # Hydra prints an error raised in the job as its own traceback and exits; with this it
        # re-raises, so a user-fixable one is one ``error:`` line as in every script (bugs keep theirs)
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
        run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
        sys.stderr.write("alibi-hydra-train: Hydra writes .hydra/ (the composed config) and hydra_train.log "
                         f"into {run_dir or 'its run directory (the working directory with fairseq configs)'}\n")
    one_line_hydra_errors()
    _run("fairseq_cli.hydra_train", check_hydra_config, guard=_resume_guard, interruption_note=_interruption_note)


def preprocess():
    from .preprocess import guard

    _run("fairseq_cli.preprocess", guard=guard)


def export_hf():
    """``alibi-export-hf CHECKPOINT OUTPUT_DIR``: a fairseq ALiBi LM as a Hugging Face model."""
    from .export import main

    sys.exit(main())


def convert_checkpoint():
    """``alibi-convert-checkpoint IN OUT``: the fork's format -> this plugin's."""
    from .fork import main

    sys.exit(main())
