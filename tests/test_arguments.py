"""``fairseq_alibi.arguments``: every mistake on the command line is one
``error:`` line with exit status 1 that names the option, what it takes and
where it belongs, never argparse's usage with exit status 2.

The classes are walked in-process through the parsers the console scripts
parse with (fairseq's, switched by ``patches.parsing``; the plugin's tools'):
every parameter of every registered position method with text it cannot
parse, on an architecture without it, and given to an evaluation tool; every
console script with an unknown option.  A few real runs of the scripts check
the whole path (one line, exit status 1, no usage)."""

from __future__ import annotations

import re

import pytest

import fairseq_alibi.models  # noqa: F401  (registers the models, applies the patches)
from conftest import error_lines, run_cli, tool
from fairseq_alibi import arguments, facts
from fairseq_alibi.core.params import SETTING
from fairseq_alibi.core.positions import POSITIONS, params_of
from fairseq_alibi.core.scaling import METHOD_SYNTAX

PARAMS = params_of()
#: The fairseq parser of each fairseq console script (``options.get_<name>``), its default task.
FAIRSEQ_PARSERS = {"alibi-train": "get_training_parser", "alibi-eval-lm": "get_eval_lm_parser",
                   "alibi-generate": "get_generation_parser",
                   "alibi-interactive": "get_interactive_generation_parser",
                   "alibi-preprocess": "get_preprocessing_parser"}
#: What each tool needs before an option (its positionals; alibi-train's defaults, which its CLI adds), in-process.
POSITIONALS = {"alibi-train": ["DATA", "--task", "language_modeling"], "alibi-eval-lm": ["DATA", "--path", "X"],
               "alibi-generate": ["DATA", "--path", "X", "--task", "language_modeling"],
               "alibi-interactive": ["DATA", "--path", "X", "--task", "language_modeling"], "alibi-preprocess": [],
               "alibi-sweep": ["DATA"], "alibi-retrieval": ["DATA"], "alibi-export-hf": ["IN.pt", "OUT"],
               "alibi-convert-checkpoint": ["IN.pt", "OUT.pt"]}


def parse(tool_name: str, argv, monkeypatch, capsys) -> str:
    """Parse ``argv`` as console script ``tool_name`` does, in this process; the one
    ``error:`` line it ends with (exit status 1 asserted, nothing else printed)."""
    from fairseq import options

    monkeypatch.setattr("sys.argv", [tool_name, *argv])  # fairseq's parsers read sys.argv[0] (prog) and --user-dir
    with pytest.raises(SystemExit) as stopped:
        if tool_name in FAIRSEQ_PARSERS:
            parser = getattr(options, FAIRSEQ_PARSERS[tool_name])()
            assert isinstance(parser, arguments.OneLineParser)  # patches.parsing's switch
            if tool_name == "alibi-preprocess":
                parser.parse_args(argv)
            else:
                options.parse_args_and_arch(parser, argv)
        else:
            arguments.tool_parser(tool_name).parse_args(argv)
    out, err = capsys.readouterr()
    assert stopped.value.code == 1, err
    assert not out and err.count("\n") == 1 and err.startswith("error: "), err
    assert "usage:" not in err
    return err[len("error: "):].strip()


def unparsable(param) -> list:
    """Texts the param's flag cannot parse: not numbers; for an integer one, a fraction too."""
    return ["abc", "0.5", "nan"] if param.valid.kind is int else ["abc", "1,5"]


@pytest.mark.parametrize("method,param", PARAMS, ids=[f"{m}-{p.name}" for m, p in PARAMS])
def test_every_method_param_given_unparsable_text_says_what_it_takes(method, param, monkeypatch, capsys):
    """--fox-weight-delay nan, --fox-data-dependent 0.5, --rnope-window nan: 170 lines of usage, status 2."""
    for text in unparsable(param):
        line = parse("alibi-train", [*POSITIONALS["alibi-train"], "--arch", facts.position_model(method),
                                     param.flag, text], monkeypatch, capsys)
        assert line == f"{param.flag} {text} is not valid: it must be {param.valid.text} ({param.summary})"


def archs_without(name: str):
    """The stock LM and every registered method's LM whose method has no param ``name``."""
    return [facts.STOCK_LM] + [facts.position_model(m) for m, entry in POSITIONS.items()
                               if name not in {p.name for p in entry.params}]


@pytest.mark.parametrize("method,param", PARAMS, ids=[f"{m}-{p.name}" for m, p in PARAMS])
def test_every_method_param_on_an_arch_without_it_names_the_archs_that_take_it(method, param, monkeypatch, capsys):
    """--fox-init-slopes on --arch transformer_lm_alibi: the usage, status 2, not a word of FoX."""
    owners = [facts.position_model(m) for m, p in PARAMS if p.name == param.name]
    for arch in archs_without(param.name):
        line = parse("alibi-train", [*POSITIONALS["alibi-train"], "--arch", arch, param.flag, str(param.default)],
                     monkeypatch, capsys)
        assert line.startswith(f"{param.flag} is an option of --arch {', '.join(owners)}, not of --arch {arch} "), line
        assert param.valid.text in line and f"give it with --arch {owners[0]}" in line


def test_a_range_is_checked_on_its_own_arch_only(monkeypatch, capsys):
    """alibi-train's check of the flags' ranges (before fairseq loads) takes the --arch's method's flags alone:
    --fox-init-slopes 70 on ALiBi said it must be at most 64, never that ALiBi takes no such option."""
    from fairseq_alibi import cli
    from fairseq_alibi.errors import UserError

    for method, param in PARAMS:
        high = param.valid.high
        text = str(int(high) + 1) if param.valid.kind is int else repr(high * 2)
        with pytest.raises(UserError, match=f"{param.flag} {text} is not valid: it must be "):
            cli.check_position_flags(["--arch", facts.position_model(method), param.flag, text])
        for arch in archs_without(param.name):
            cli.check_position_flags(["--arch", arch, param.flag, text])  # argparse's line names the arch
        line = parse("alibi-train", [*POSITIONALS["alibi-train"], "--arch", facts.ALIBI_LM, param.flag, text],
                     monkeypatch, capsys)
        assert line.startswith(f"{param.flag} is an option of --arch "), line


def test_ssmax_on_the_stock_models_names_the_plugin_s_models_and_the_twin(monkeypatch, capsys):
    """--ssmax takes every registered method's LM (the logit options apply to all), never fairseq's own."""
    for arch in facts.stock_archs(facts.STOCK_LM):
        line = parse("alibi-train", [*POSITIONALS["alibi-train"], "--arch", arch, "--ssmax"], monkeypatch, capsys)
        models = ", ".join(facts.position_model(name) for name in POSITIONS)
        assert line.startswith(f"--ssmax is an option of --arch {models}, not of --arch {arch} "), line
        assert f"give it with --arch {facts.twin_name(arch)}," in line and "it is a switch" in line


def test_a_long_list_of_archs_names_every_one_of_the_plugin_s_lms_and_counts_the_rest(monkeypatch, capsys):
    """--decoder-layers (46 archs) named fairseq's first 8 (nonautoregressive_transformer, ...), and --ssmax
    8 of the plugin's 10 LMs: the plugin's come whole and first, fairseq's fill up to 8 names, the rest counted."""
    ours = [facts.position_model(name) for name in POSITIONS]
    line = parse("alibi-sweep", [*POSITIONALS["alibi-sweep"], "--decoder-layers", "3"], monkeypatch, capsys)
    assert re.search(rf"model option of --arch {', '.join(ours)} and \d+ more \(", line), line


@pytest.mark.parametrize("tool_name", ["alibi-eval-lm", "alibi-generate", "alibi-interactive"])
def test_a_model_option_given_to_an_evaluation_tool_says_how_to_override_it(tool_name, monkeypatch, capsys):
    """Every registered param and the context extension: a per-pass one is set with
    --model-overrides (the dict written out), one fixed by training is said to be."""
    cases = [(param.flag, str(param.default), param.name, param.role == SETTING) for _, param in PARAMS]
    cases += [("--position-scaling", "logn", "position_scaling", True), ("--ssmax", None, "ssmax", False),
              ("--alibi-interpolation", "ntk", "alibi_interpolation", True),
              ("--decoder-layers", "3", "decoder_layers", False)]
    for flag, value, key, settable in cases:  # (the --arch these tools read is the checkpoint's)
        line = parse(tool_name, [*POSITIONALS[tool_name], flag, *([value] if value else [])], monkeypatch, capsys)
        assert line.startswith(f"{tool_name} takes no {flag}: it is a model option"), line
        if settable:
            literal = repr(value) if key in ("position_scaling", "alibi_interpolation") else value
            assert f"--model-overrides \"{{'{key}': {literal}}}\"" in line, line
        else:
            assert "an evaluation keeps the checkpoint's value" in line and "{'" not in line, line
    line = parse(tool_name, [*POSITIONALS[tool_name], "--position-scaling", "logn"], monkeypatch, capsys)
    assert METHOD_SYNTAX in line  # the spellings position_scaling takes
    line = parse(tool_name, [*POSITIONALS[tool_name], "--arch", "transformer_lm_fox"], monkeypatch, capsys)
    assert line.startswith(f"{tool_name} takes no --arch: the checkpoint (--path) holds the architecture"), line


@pytest.mark.parametrize("tool_name", arguments.TOOLS)
def test_every_tool_names_an_unknown_option_and_where_a_known_one_belongs(tool_name, monkeypatch, capsys):
    given = POSITIONALS[tool_name] + (["--arch", facts.ALIBI_LM] if tool_name == "alibi-train" else [])
    line = parse(tool_name, [*given, "--no-such-option", "1"], monkeypatch, capsys)
    assert line.startswith(f"{tool_name} has no option --no-such-option") and f"`{tool_name} --help`" in line
    # an option of another tool names that tool (and what it takes)
    elsewhere = {"alibi-sweep": ("--context-window", "alibi-eval-lm"), "alibi-retrieval": ("--stride", "alibi-sweep"),
                 "alibi-export-hf": ("--model-overrides", "alibi-eval-lm"),
                 "alibi-convert-checkpoint": ("--lengths", "alibi-sweep")}
    flag, owner = elsewhere.get(tool_name, ("--lengths", "alibi-sweep"))
    line = parse(tool_name, [*given, flag, "3"], monkeypatch, capsys)
    assert line.startswith(f"{tool_name} takes no {flag}: it is an option of ") and owner in line, line
    assert "it takes " in line


@pytest.mark.parametrize("tool_name", ["alibi-sweep", "alibi-retrieval"])
def test_the_sweep_and_retrieval_take_context_extension_through_methods(tool_name, monkeypatch, capsys):
    line = parse(tool_name, ["DATA", "--position-scaling", "yarn:2"], monkeypatch, capsys)
    assert line.startswith(f"{tool_name} takes no --position-scaling") and "e.g. --methods none,yarn:2" in line


@pytest.mark.parametrize("tool_name", [t for t in arguments.TOOLS if t != "alibi-preprocess"])
def test_a_typed_option_of_each_tool_given_text_says_what_it_takes(tool_name, monkeypatch, capsys):
    flag, takes = {"alibi-sweep": ("--stride", "an integer"), "alibi-retrieval": ("--depths", "an integer"),
                   "alibi-export-hf": ("--format", "one of auto, custom"),
                   "alibi-convert-checkpoint": ("--train-length", "an integer")}.get(
        tool_name, ("--tokens-per-sample", "a positive integer (at most 2147483647)"))
    given = POSITIONALS[tool_name] + (["--arch", facts.ALIBI_LM] if tool_name == "alibi-train" else [])
    line = parse(tool_name, [*given, flag, "abc"], monkeypatch, capsys)
    assert line.startswith(f"{flag} abc is not valid: it takes {takes}"), line


def test_a_missing_value_and_a_missing_positional_are_one_line(monkeypatch, capsys):
    line = parse("alibi-eval-lm", ["DATA", "--path", "X", "--context-window"], monkeypatch, capsys)
    assert line == "--context-window needs a value (expected one argument): it takes an integer >= 0 (at most " \
                   "2147483647)"
    line = parse("alibi-export-hf", ["IN.pt"], monkeypatch, capsys)
    assert line.startswith("alibi-export-hf needs OUTPUT_DIR (output_dir: the directory to write")


def test_help_lists_every_key_an_evaluation_may_set_from_the_registry():
    """alibi-eval-lm --help listed no position-method key; the sweep's neither."""
    from fairseq_alibi.cli import overrides_help
    from fairseq_alibi.evaluation.perplexity import get_parser

    sweep, eval_lm = (" ".join(text.split()) for text in (get_parser().format_help(), overrides_help()))
    for _, param in PARAMS:
        for text in (sweep, eval_lm):
            if param.role == SETTING:
                assert f"{param.name} (" in text.split("fixed by training")[0] and param.help in text
            else:  # listed as fixed, never as a key to set
                assert f"{param.name} (" in text.split("fixed by training")[1]
    assert "position_scaling" in eval_lm and "ssmax" in eval_lm.split("fixed by training")[1]


# ------------------------------------------------------------------ where arguments.py stands
BELOW = ("errors", "options", "facts", "core")  # the modules arguments.py may import


def test_arguments_imports_no_module_above_it():
    """The tools build their parsers with arguments.py and the plugin's entry switches fairseq's to it:
    it imported cli (_flag), the tools' parser factories and the models, a loop of 14 files."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(arguments.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:  # from .X import ..., from . import X
            names = [node.module] if node.module else [a.name for a in node.names]
            assert node.level == 1 and {n.split(".")[0] for n in names} <= set(BELOW), (node.lineno, names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert not [n for n in names if n.split(".")[0] == "fairseq_alibi"], (node.lineno, names)


def test_every_console_script_that_takes_options_is_named_with_its_parser():
    """TOOLS names each parser factory by text (importing the tools would be a loop): every console
    script of setup.py but the two that take no options is there, and each name resolves to its parser."""
    from pathlib import Path

    setup = (Path(arguments.__file__).parents[1] / "setup.py").read_text(encoding="utf-8")
    scripts = re.findall(r'"(alibi-[\w-]+) = ', setup)
    assert sorted(arguments.TOOLS) == sorted(set(scripts) - {"alibi-hydra-train", "alibi-user-dir"})
    for tool_name, target in arguments.TOOLS.items():
        assert callable(arguments.upstairs(target)), target
        assert isinstance(arguments.tool_parser(tool_name), arguments.OneLineParser), tool_name
    for name in ("ALIBI_FIELDS", "SHAPE_OPTIONS", "WEIGHT_FLAGS"):
        assert arguments.upstairs(f"{arguments.MODEL_CONFIG}:{name}")


# ------------------------------------------------------------------ the scripts themselves
SCRIPT_CASES = [
    ("alibi-train", ["DATA", "--arch", "transformer_lm_alibi", "--fox-init-slopes", "1", "--max-tokens", "2048"],
     "--fox-init-slopes is an option of --arch transformer_lm_fox, not of --arch transformer_lm_alibi"),
    ("alibi-eval-lm", ["DATA", "--path", "X", "--position-scaling", "logn"],
     "--model-overrides \"{'position_scaling': 'logn'}\""),
    ("alibi-sweep", ["DATA", "-c", "X", "--bogus"], "alibi-sweep has no option --bogus"),
    ("alibi-retrieval", ["DATA", "-c", "X", "--bogus"], "alibi-retrieval has no option --bogus"),
    ("alibi-export-hf", ["X.pt", "OUT", "--bogus"], "alibi-export-hf has no option --bogus"),
    ("alibi-convert-checkpoint", ["X.pt", "Y.pt", "--bogus"], "alibi-convert-checkpoint has no option --bogus"),
    ("alibi-preprocess", ["--only-source", "--bogus"], "alibi-preprocess has no option --bogus"),
    ("alibi-generate", ["DATA", "--path", "X", "--bogus"], "alibi-generate has no option --bogus"),
    ("alibi-interactive", ["DATA", "--path", "X", "--bogus"], "alibi-interactive has no option --bogus"),
    ("alibi-hydra-train", ["--max-tokens", "5"], "it takes the config's fields as KEY=VALUE overrides, here "
                                                 "dataset.max_tokens=VALUE"),
    ("alibi-user-dir", ["--bogus"], "alibi-user-dir takes no arguments"),
]


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("script,args,expected", SCRIPT_CASES, ids=[c[0] for c in SCRIPT_CASES])
def test_each_console_script_reports_an_option_mistake_in_one_line(script, args, expected, tmp_path):
    result = run_cli([tool(script), *args], expect_ok=False, cwd=tmp_path)
    lines = error_lines(result)
    assert result.returncode == 1 and "usage:" not in result.output and "Traceback" not in result.output, \
        result.output[-3000:]
    assert len(lines) == 1 and expected in lines[0], result.output[-3000:]
