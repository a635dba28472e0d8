"""Mistakes on the command line: argparse's errors as one ``error:`` line.

argparse met an option it could not parse, or did not know, by printing the
whole usage (100-170 lines for fairseq's parsers) and exiting with status 2;
the one line it ended with named the option but not what it takes, nor where
it belongs.  Every console script's parser is a :class:`OneLineParser` (the
plugin's own tools build theirs with it, ``patches.parsing`` switches fairseq's
to it): its :meth:`~OneLineParser.error` prints one ``error:`` line and exits
with status 1, as every other user error of this package (``errors.py``).
:func:`explain` writes that line:

* a value the option cannot parse (``--fox-weight-delay nan``): what the option
  takes, from its declaration where there is one (``core.params.Param`` for
  the position methods' options, ``options.py``'s tables for fairseq's
  numbers), else from its argparse type or choices;
* an option this command does not take: where it belongs, from the registries
  that own options (:func:`owners`): another architecture's (``--arch``),
  task's, optimizer's, ...; a model option given to an evaluation tool, which
  sets it with ``--model-overrides`` (or, for one fixed by training, says so);
  an option of another console script (:data:`TOOLS`); else the closest names.

:func:`position_keys_help` lists, from the same registry, the position
methods' ``--model-overrides`` keys an evaluation may set (``alibi-eval-lm
--help``, ``alibi-sweep --help``), and the ones training fixes.

Importing this module imports neither torch nor fairseq: the plugin's tools
build their parsers with it before either loads; the explanations load them.
Nor does it import the modules above it (the tools, the models): they import
it, so what an explanation reads from them is named (:data:`TOOLS`,
:data:`PLUGIN`) and imported when an error is explained (:func:`upstairs`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import textwrap
from typing import Dict, List, Optional, Tuple

from .errors import closest, one_line

#: The console scripts whose options an unknown option is looked up in (in this
#: order), each with the function that builds its parser, named as setup.py names
#: an entry point (:func:`upstairs`): fairseq's (given the language-modeling
#: task's options, the task of these scripts) and the plugin's tools'.
#: ``alibi-hydra-train`` takes Hydra's ``KEY=VALUE`` overrides and
#: ``alibi-user-dir`` nothing.
TOOLS = {
    "alibi-train": "fairseq.options:get_training_parser",
    "alibi-eval-lm": "fairseq.options:get_eval_lm_parser",
    "alibi-generate": "fairseq.options:get_generation_parser",
    "alibi-interactive": "fairseq.options:get_interactive_generation_parser",
    "alibi-preprocess": "fairseq.options:get_preprocessing_parser",
    "alibi-sweep": ".evaluation.perplexity:get_parser",
    "alibi-retrieval": ".evaluation.retrieval:get_parser",
    "alibi-export-hf": ".export:parser",
    "alibi-convert-checkpoint": ".fork:parser",
}

#: The plugin's ``--user-dir`` entry (:func:`upstairs`): it applies the patches
#: (before fairseq's first import) and registers the plugin's models in
#: fairseq's registries, which :func:`owners` reads; its config module holds the
#: model keys an evaluation may or may not override.
PLUGIN = ".models"
MODEL_CONFIG = ".models.config"

#: fairseq's options that choose a registered class, which adds options of its
#: own once chosen (``--arch`` a model, by its name; ``--optimizer`` ``adam``'s
#: ``--adam-betas``): where :func:`owners` looks for an option's owner.
SELECTORS = ("--arch", "--task", "--criterion", "--optimizer", "--lr-scheduler", "--tokenizer", "--bpe", "--scoring")

#: Where an evaluation tool takes a model option.
OVERRIDES_FLAG = "--model-overrides"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one ``error:`` line on stderr and
    exit status 1 (:func:`explain`), never the usage; ``--help`` is argparse's."""

    def parse_known_args(self, args=None, namespace=None):
        self._alibi_argv = list(sys.argv[1:] if args is None else args)  # what explain() reads
        return super().parse_known_args(args, namespace)

    def error(self, message):
        try:
            line = explain(self, message, getattr(self, "_alibi_argv", sys.argv[1:]))
        except Exception:  # never lose the user's mistake to a fault in the explanation
            line = f"{one_line(message)} (`{self.prog} --help` lists the options)"
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        raise SystemExit(1)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (built by another library, fairseq) made a :class:`OneLineParser`."""
    if type(parser) is argparse.ArgumentParser:
        parser.__class__ = OneLineParser
    return parser


def flag_value(argv: List[str], *names: str) -> Optional[str]:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` in ``argv``."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def upstairs(target: str):
    """``module:attribute`` (or a module), imported now: what an explanation reads
    from the modules above this one (:data:`TOOLS`, :data:`PLUGIN`,
    :data:`MODEL_CONFIG`), named and not imported, since they import this module
    (the tools build their parsers with it, the plugin's entry switches
    fairseq's to it).  Only an error's explanation calls it, in every console
    script alike, stock or the plugin's."""
    module, _, attribute = target.partition(":")
    loaded = importlib.import_module(module, __package__)
    return getattr(loaded, attribute) if attribute else loaded


# ------------------------------------------------------------------ what an option takes


def _action(parser: argparse.ArgumentParser, flag: str) -> Optional[argparse.Action]:
    return parser._option_string_actions.get(flag)


def _param(flag: str, argv: Optional[List[str]] = None):
    """The ``core.params.Param`` whose training flag is ``flag`` (of the method of
    ``argv``'s ``--arch`` where several methods declare it: ``--rotary-base``), or None."""
    from .core.positions import params_of

    found = [(method, param) for method, param in params_of() if param.flag == flag]
    if len(found) > 1 and argv:
        from . import facts

        method = facts.position_of(facts.model_family(flag_value(argv, "--arch", "-a")))
        found = [(m, p) for m, p in found if m == method] or found
    return found[0][1] if found else None


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def takes(flag: str, action: Optional[argparse.Action] = None, argv: Optional[List[str]] = None) -> str:
    """What option ``flag`` takes, as a noun phrase (``an integer in [0, 1] (...)``)."""
    from .core.scaling import METHOD_SYNTAX, SPELLING_KEY
    from .options import INTEGER_OPTIONS, REAL_OPTIONS, integer_problem, real_problem

    key = _key(flag) if action is None or not action.option_strings else _key(action.option_strings[0])
    param = _param(flag, argv)
    if param is not None:
        return f"{param.valid.text} ({param.summary})"
    if key == SPELLING_KEY or (action is not None and action.dest == SPELLING_KEY):
        return f"a context-extension method, one of {METHOD_SYNTAX}"
    if key in INTEGER_OPTIONS:
        return integer_problem(key, "").replace("takes ", "", 1)
    if key in REAL_OPTIONS:
        return real_problem(key, "").replace("takes ", "", 1)
    if action is None:
        return "a value"
    if action.nargs == 0:
        text = _help_text(action)
        return "no value: it is a switch" + (f" ({text})" if text else "")
    if action.choices is not None:
        choices = [str(c) for c in action.choices]
        return "one of " + ", ".join(choices[:16]) + (f" ({len(choices) - 16} more)" if len(choices) > 16 else "")
    kind = {int: "an integer", float: "a number"}.get(action.type)
    if kind is None and getattr(action.type, "__name__", "") == "eval_bool":
        kind = "True or False"
    what = kind or (f"{action.metavar}" if isinstance(action.metavar, str) else "a value")
    text = _help_text(action)
    return f"{what} ({text})" if text else what


def _help_text(action: argparse.Action, width: int = 120) -> str:
    """An option's ``--help`` text, shortened to ``width`` characters at a word."""
    text = action.help if isinstance(action.help, str) and action.help != argparse.SUPPRESS else ""
    text = one_line(text.replace("%(default)s", str(action.default)).replace("%%", "%"))
    return textwrap.shorten(text, width, placeholder=" ...") if text else ""


def _value_problem(flag: str, value: str, action: Optional[argparse.Action], argv: List[str]) -> str:
    """``must be ...`` / ``takes ...``: why option ``flag`` cannot take ``value``."""
    param = _param(flag, argv)
    if param is not None:
        return param.problem(value)  # a string is never a value it takes
    return "takes " + takes(flag, action)


# ------------------------------------------------------------------ where an option belongs


def _registries():
    """``(selector, {name: class})`` of each fairseq registry whose choice adds
    options, the plugin's models registered."""
    upstairs(PLUGIN)
    from fairseq.models import MODEL_REGISTRY
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_REGISTRY

    return [("--arch", MODEL_REGISTRY), ("--task", TASK_REGISTRY)] + [
        ("--" + name.replace("_", "-"), registry["registry"]) for name, registry in REGISTRIES.items()]


@functools.lru_cache(maxsize=None)
def _options_of(selector: str, name: str) -> Dict[str, argparse.Action]:
    """``{option: action}`` that class ``name`` of ``selector`` adds once chosen."""
    from fairseq.dataclass.utils import gen_parser_from_dataclass

    cls = dict(_registries())[selector][name]
    parser = argparse.ArgumentParser(add_help=False)
    try:
        if hasattr(cls, "add_args"):
            cls.add_args(parser)
        elif hasattr(cls, "__dataclass"):
            gen_parser_from_dataclass(parser, cls.__dataclass())
    except Exception:  # a class whose options cannot be listed here: it owns none we name
        return {}
    return dict(parser._option_string_actions)


@functools.lru_cache(maxsize=None)
def owners() -> Dict[str, List[Tuple[str, str]]]:
    """``{option: [(selector, name), ...]}``: every option that a registered
    class adds once chosen (``("--arch", "transformer_lm_fox")`` for
    ``--fox-init-slopes``), over fairseq's registries and this plugin's models."""
    found: Dict[str, List[Tuple[str, str]]] = {}
    for selector, table in _registries():
        for name in table:
            for option in _options_of(selector, name):
                found.setdefault(option, []).append((selector, name))
    return found


def tool_parser(tool: str) -> argparse.ArgumentParser:
    """The parser of console script ``tool`` (:data:`TOOLS`), as it stands before
    an architecture is chosen (fairseq's with the language-modeling task's options)."""
    if TOOLS[tool].startswith("."):  # one of the plugin's tools
        return upstairs(TOOLS[tool])()
    upstairs(PLUGIN)  # first: fairseq's parsers patched, their --arch choices the plugin's models too
    from fairseq.tasks import TASK_REGISTRY

    parser = upstairs(TOOLS[tool])(default_task="language_modeling")
    if tool != "alibi-preprocess":
        TASK_REGISTRY["language_modeling"].add_args(parser)
    return parser


@functools.lru_cache(maxsize=None)
def tool_options() -> Dict[str, Dict[str, argparse.Action]]:
    """``{tool: {option: action}}`` of every console script of :data:`TOOLS`."""
    return {tool: dict(tool_parser(tool)._option_string_actions) for tool in TOOLS}


def _tool_name(prog: str) -> str:
    """``fairseq-train`` -> ``alibi-train``: the console script of the same options."""
    return "alibi-" + prog[len("fairseq-"):] if prog.startswith("fairseq-") else prog


def _names(selector: str, names: List[str], most: int = 8) -> str:
    """``--arch a, b and 36 more``: the plugin's own LMs (one per position method)
    first and every one of them, then fairseq's others up to ``most`` names in all."""
    from . import facts
    from .core.positions import POSITIONS

    ours = {facts.position_model(name) for name in POSITIONS} if selector == "--arch" else set()
    shown = [n for n in names if n in ours]
    shown += [n for n in names if n not in ours][:max(0, most - len(shown))]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return f"{selector} {', '.join(shown)}{more}"


def _suggested(selector: str, names: List[str], given: Optional[str]) -> str:
    """The choice to suggest of ``names``: for a stock architecture, its ALiBi
    twin where that takes the option (``transformer_lm_wiki103`` ->
    ``transformer_lm_wiki103_alibi``), else the first."""
    if selector == "--arch" and given:
        from . import facts

        if facts.model_family(facts.twin_name(given)) in names:
            return facts.twin_name(given)
    return names[0]


def _given(parser: argparse.ArgumentParser, argv: List[str], selector: str) -> Optional[str]:
    value = flag_value(argv, selector, *(("-a",) if selector == "--arch" else ()))
    if value is None:
        action = _action(parser, selector)
        value = action.default if action is not None and isinstance(action.default, str) else None
    return value


def _literal(value: Optional[str], action: Optional[argparse.Action], flag: str) -> str:
    """``value`` as it is written in a ``--model-overrides`` dict: a number as
    a number, a switch as True, anything else as a string."""
    if action is not None and action.nargs == 0:
        return "True"
    if value is None:
        return "VALUE"
    param = _param(flag)
    kinds = (param.valid.kind,) if param is not None else (int, float)
    for kind in kinds:
        try:
            return repr(kind(value))
        except ValueError:
            continue
    return repr(value)


def _hydra_section(key: str, found: List[Tuple[str, str]]) -> str:
    """The section of fairseq's Hydra config that holds option ``key``: the
    chosen class's (``model``, ``task``, ...) or the one of ``FairseqConfig``
    whose dataclass has the field; ``SECTION`` where none does."""
    import dataclasses

    from fairseq.dataclass.configs import FairseqConfig

    if found:
        return found[0][0][2:].replace("-", "_").replace("arch", "model")
    for section in dataclasses.fields(FairseqConfig):
        default = section.default_factory() if callable(section.default_factory) else section.default
        if dataclasses.is_dataclass(default) and key in {f.name for f in dataclasses.fields(default)}:
            return section.name
    return "SECTION"


def evaluation_override(prog: str, flag: str, value: Optional[str], action: Optional[argparse.Action]) -> str:
    """A model option given to an evaluation tool: set with ``--model-overrides``
    where an evaluation may change it (:func:`evaluation_keys`), else fixed by training."""
    from .core.params import ROLES, SHAPE

    key = _key(flag)
    param = _param(flag)
    what = takes(flag, action)
    if key in evaluation_keys():
        example = f"{OVERRIDES_FLAG} \"{{'{key}': {_literal(value, action, flag)}}}\""
        return (f"{prog} takes no {flag}: it is a model option, which an evaluation sets with {example} "
                f"({key} takes {what}; `{_tool_name(prog)} --help` lists the keys)")
    if param is not None:
        why = f": {ROLES[param.role]}"
    elif key in upstairs(f"{MODEL_CONFIG}:SHAPE_OPTIONS") or key in upstairs(f"{MODEL_CONFIG}:WEIGHT_FLAGS"):
        why = f": {ROLES[SHAPE]}"
    else:
        why = ""
    return (f"{prog} takes no {flag}: it is a model option set in training (alibi-train; {key} takes {what}){why}; "
            f"an evaluation keeps the checkpoint's value ({OVERRIDES_FLAG} takes the keys `{prog} --help` lists)")


def unknown_option(parser: argparse.ArgumentParser, flag: str, value: Optional[str], argv: List[str]) -> str:
    """Why ``parser``'s command does not take option ``flag``, and where it belongs."""
    from .core.scaling import CONFIG_KEYS, METHOD_SYNTAX, SPELLING_KEY

    prog = parser.prog
    found = owners().get(flag, [])
    tools = {tool: options[flag] for tool, options in tool_options().items()
             if flag in options and tool != _tool_name(prog)}
    action = next((_options_of(s, n).get(flag) for s, n in found[:1]), None) or next(iter(tools.values()), None)
    models = [name for selector, name in found if selector == "--arch"]
    if parser.description == "Hydra":  # alibi-hydra-train: Hydra's own parser
        section = _hydra_section(_key(flag), found)
        return (f"{prog} takes no {flag}: it takes the config's fields as KEY=VALUE overrides, here "
                f"{section}.{_key(flag)}={value or 'VALUE'} (+{section}.{_key(flag)}=... where the YAML lacks the key; "
                f"it takes {takes(flag, action)})")
    if models and _action(parser, OVERRIDES_FLAG) is not None:
        return evaluation_override(prog, flag, value, action)
    if flag in ("--arch", "-a") and _action(parser, OVERRIDES_FLAG) is not None:
        return (f"{prog} takes no {flag}: the checkpoint (--path) holds the architecture it was trained with "
                f"(alibi-train's --arch); its options an evaluation may change go in {OVERRIDES_FLAG} "
                f"(`{_tool_name(prog)} --help` lists the keys)")
    key = _key(flag)
    if _action(parser, "--methods") is not None and key in (SPELLING_KEY,) + tuple(CONFIG_KEYS.values()):
        return (f"{prog} takes no {flag}: it evaluates each model under the context-extension methods of --methods "
                f"(comma-separated, each one of {METHOD_SYNTAX}), e.g. --methods none,{value or 'ntk:2'}")
    for selector in SELECTORS:
        names = [name for s, name in found if s == selector]
        chooser = _action(parser, selector)
        if names and chooser is not None and chooser.choices is not None:  # fairseq's (retrieval's --task is its own)
            given = _given(parser, argv, selector)
            here = f"{selector} {given}" if given else f"no {selector}"
            return (f"{flag} is an option of {_names(selector, names)}, not of {here} (it takes "
                    f"{takes(flag, action)}); give it with {selector} {_suggested(selector, names, given)}, "
                    "or leave it out")
    if models:
        later = (f"; alibi-eval-lm {OVERRIDES_FLAG} \"{{'{key}': {_literal(value, action, flag)}}}\" evaluates a "
                 "trained model with another value" if key in evaluation_keys() else "")
        return (f"{prog} takes no {flag}: it is a model option of {_names('--arch', models)} (set by alibi-train; "
                f"it takes {takes(flag, action)}){later}")
    if tools:
        return (f"{prog} takes no {flag}: it is an option of {', '.join(tools)} (it takes {takes(flag, action)}); "
                f"`{prog} --help` lists {prog}'s options")
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    return f"{prog} has no option {flag}{closest(flag, known) or ''} (`{prog} --help` lists its options)"


def explain(parser: argparse.ArgumentParser, message: str, argv: List[str]) -> str:
    """The one line for argparse's error ``message`` about ``argv``."""
    prog = parser.prog
    match = re.match(r"argument ([^:/ ]+)(?:/\S+)?: invalid (?:\S+ )?value: '(.*)'$", message, re.S)
    if match:
        flag, value = match.groups()
        return f"{flag} {value} is not valid: it {_value_problem(flag, value, _action(parser, flag), argv)}"
    match = re.match(r"argument ([^:/ ]+)(?:/\S+)?: invalid choice: '(.*)' \(choose from .*\)$", message, re.S)
    if match:
        flag, value = match.groups()
        action = _action(parser, flag)
        near = closest(value, [str(c) for c in action.choices]) if action is not None and action.choices else ""
        return f"{flag} {value} is not valid: it takes {takes(flag, action)}{near}"
    match = re.match(r"argument ([^:/ ]+)(?:/\S+)?: (expected .* arguments?)$", message)
    if match:
        flag, expected = match.groups()
        return f"{flag} needs a value ({expected}): it takes {takes(flag, _action(parser, flag))}"
    match = re.match(r"argument ([^:/ ]+)(?:/\S+)?: ignored explicit argument '(.*)'$", message)
    if match:
        flag, value = match.groups()
        return f"{flag} takes no value ({flag}={value} was given): it is a switch, given alone"
    match = re.match(r"unrecognized arguments: (.*)$", message, re.S)
    if match:
        rest = match.group(1).split(" ")
        start = next((i for i, word in enumerate(rest) if word.startswith("-") and len(word) > 1), None)
        if start is None:
            return (f"{prog} does not take the argument {rest[0]!r} (an extra value: is an option's value split "
                    f"by a space or a quote?); `{prog} --help` shows the usage")
        flag, _, value = rest[start].partition("=")
        if not value and start + 1 < len(rest) and not rest[start + 1].startswith("--"):
            value = rest[start + 1]
        return unknown_option(parser, flag, value or None, argv)
    match = re.match(r"the following arguments are required: (.*)$", message)
    if match:
        names = match.group(1).split(", ")
        helps = [_help_text(a, 80) for a in parser._actions if a.dest in names or a.metavar in names]
        what = "; ".join(f"{n}: {h}" for n, h in zip(names, helps) if h)
        return (f"{prog} needs {', '.join(n.upper() for n in names)}" + (f" ({what})" if what else "")
                + f"; `{prog} --help` shows the usage")
    return f"{one_line(message)} (`{prog} --help` lists the options)"


# ------------------------------------------------------------------ --help: the evaluation keys


def evaluation_keys() -> Tuple[str, ...]:
    """The ``--model-overrides`` keys an evaluation may set on a trained model:
    the plugin's ALiBi fields (the context extension, ``position_scaling`` and
    its older names, and the kernel) and every position method's ``setting``
    parameters (``core.params``: read at every forward pass)."""
    return upstairs(f"{MODEL_CONFIG}:ALIBI_FIELDS") + tuple(dict.fromkeys(name for name, _ in _per_pass()))


def _per_pass():
    """``(param name, position method)`` of every ``setting`` parameter of the registry."""
    from .core.params import SETTING
    from .core.positions import params_of

    return [(param.name, method) for method, param in params_of() if param.role == SETTING]


def position_keys_help(fixed_flags: Tuple[str, ...] = (), width: int = 100) -> str:
    """For ``--help``: the position methods' ``--model-overrides`` keys, from the
    registry (``core.positions``): each method's per-pass parameters (what each
    takes), then the ones training fixes (with the model's ``fixed_flags``,
    ``models.config.WEIGHT_FLAGS``: ``ssmax``)."""
    from .core.params import SETTING
    from .core.positions import POSITIONS

    def fill(text):
        return textwrap.fill(text, width=width, initial_indent="  ", subsequent_indent="      ")

    lines = [fill(f"{param.name} ({name}): {param.help}") for name, entry in POSITIONS.items()
             for param in entry.params if param.role == SETTING]
    fixed = [f"{p.name} ({name})" for name, entry in POSITIONS.items() for p in entry.params if p.role != SETTING]
    lines.append(fill("fixed by training, so an evaluation keeps the checkpoint's value (an override is refused): "
                      + ", ".join(fixed + list(fixed_flags))))
    return "\n".join(lines)
