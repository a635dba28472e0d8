"""README.md and docs/*.md against the code.

* Every Python block runs, as a user would run it: in a fresh interpreter (a
  fork of the test's server, which has imported nothing of the plugin), in a
  directory where the paths the blocks name (``checkpoints/alibi``,
  ``data-bin/corpus``, ``outputs/hf/lm``, ...) are the suite's fixtures.  A
  block that cannot run here says so in the Markdown, in a line the reader
  sees right above it (``Not run by the tests: ...``, naming the GPU, hub or
  network it needs); its imports still run.
* The tables users read (methods, config fields and defaults, kernels,
  ``alibi_scaling`` forms, ``--help``, docstrings) are compared with the code's
  own tables: ``core.scaling.METHOD_TABLE``, ``core.kernels.KERNEL_NAMES``,
  ``models.config.ALIBI_FIELDS`` and the config dataclasses.  A method added
  to ``METHOD_TABLE`` fails here, naming each place that does not list it yet.
* Module names and file paths in the docs exist; README's demo table is in the
  format ``make demo`` prints and agrees with docs/extrapolation.md.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
import torch

from conftest import REPO, TRAIN_LENGTH, run_cli, tool
from fairseq_alibi.core.alibi import EXTENSIONS as ALIBI_SLOPE_METHODS
from fairseq_alibi.core.bias import AlibiBias
from fairseq_alibi.core.kernels import KERNEL_NAMES
from fairseq_alibi.core.positions import position
from fairseq_alibi.core.scaling import (
    DEFAULT_ALPHA, DISTANCE_METHODS, METHOD_SYNTAX, METHOD_TABLE, METHODS, SCALE_METHODS, Scaling,
)

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
L = 64


def doc(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def table(text: str, first_header: str) -> List[List[str]]:
    """The rows (lists of cells) of the Markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def ticked(cell: str) -> List[str]:
    return re.findall(r"`([^`]+)`", cell)


def words(cell: str) -> List[str]:
    """The ticked single lower-case words of a cell (method and kernel names), in order."""
    return [t for t in ticked(cell) if re.fullmatch(r"[a-z]+", t)]


def missing_methods(where: str, listed, expected=METHODS) -> str:
    """An assertion message that names what a doc lacks or has too many of."""
    lacking = [m for m in expected if m not in listed]
    extra = [m for m in listed if m not in expected]
    return f"{where}: lacks {lacking} (the code's tables have them), lists unknown {extra}"


# ------------------------------------------------------------------ code blocks
@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    code: str
    note: str  # the paragraph right above the block

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


def code_blocks(path: Path) -> List[Block]:
    """Every fenced block, also those indented in a list item (dedented)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```"))
        above = i
        while above > 0 and not lines[above - 1].strip():
            above -= 1
        start = above
        while start > 0 and lines[start - 1].strip() and not lines[start - 1].lstrip().startswith("```"):
            start -= 1
        code = "".join(line[indent:] + "\n" for line in lines[i + 1:end])
        blocks.append(Block(path, i + 1, lines[i].strip()[3:].strip(), code,
                            " ".join(line.strip() for line in lines[start:above])))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOC_FILES for block in code_blocks(path)]
PYTHON_BLOCKS = [block for block in BLOCKS if block.lang in ("python", "py")]
NOT_RUN = re.compile(r"\*?Not run by the tests: (.+)")
#: What may keep a block from running here (files a block needs come from the fixtures below):
#: a GPU, the hub, the network; or the block reproduces an upstream failure at a minute of compilation.
UNAVAILABLE = ("GPU", "CUDA", "hub", "network", "reproduces a torch failure")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, alibi_checkpoint, lm_data_bin) -> Path:
    """A directory holding, under the names the blocks use, the suite's fixture
    checkpoint, its data directory and its export."""
    root = tmp_path_factory.mktemp("docs_workspace")
    links = {"checkpoints/alibi": alibi_checkpoint.parent, "checkpoints/mylm": alibi_checkpoint.parent,
             "data-bin/corpus": lm_data_bin, "data-bin/mycorpus": lm_data_bin}
    for name, target in links.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target, target_is_directory=True)
    (root / "outputs/hf").mkdir(parents=True)
    run_cli([tool("alibi-export-hf"), alibi_checkpoint, root / "outputs/hf/lm"])
    return root


def test_the_docs_have_python_blocks_and_mark_few():
    assert len(PYTHON_BLOCKS) >= 5, [b.name for b in PYTHON_BLOCKS]
    assert sum(bool(NOT_RUN.search(b.note)) for b in PYTHON_BLOCKS) <= 3


def _one_per_page_fast(blocks):
    """The first Python block of each page runs in ``make test``; the others are ``slow``."""
    seen = set()
    for block in blocks:
        marks = () if block.path not in seen else (pytest.mark.slow,)
        seen.add(block.path)
        yield pytest.param(block, marks=marks, id=block.name)


@pytest.mark.parametrize("block", list(_one_per_page_fast(PYTHON_BLOCKS)))
def test_every_python_block_runs(block, workspace):
    marked = NOT_RUN.search(block.note)
    if marked:
        reason = marked.group(1)
        assert any(word in reason for word in UNAVAILABLE), (
            f"{block.name} is marked not run ({reason!r}): only a GPU, the hub, the network or an upstream "
            "failure's reproduction may keep a block from running; give it files through the workspace fixture")
        tree = ast.parse(block.code)
        imports = ast.Module([node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))], [])
        exec(compile(imports, block.name, "exec"), {})  # the names it uses exist
        return
    run_cli([sys.executable, "-c", block.code], cwd=workspace, timeout=600)


def test_python_code_is_in_python_blocks():
    """A block of Python tagged otherwise would escape the test above."""
    for block in BLOCKS:
        if block.lang in ("python", "py"):
            continue
        first = next((line for line in block.code.splitlines() if line.strip()), "")
        assert not re.match(r"(import \w|from [\w.]+ import )", first), f"{block.name}: tag it ```python"


def test_importing_the_package_alone_imports_nothing_heavy_and_registers_nothing(alibi_checkpoint, lm_data_bin):
    """docs/training.md, "Python": ``import fairseq_alibi`` alone imports neither
    fairseq nor torch, so fairseq's loaders do not know the models (its error
    is the ``KeyError`` the docs quote); ``import fairseq_alibi.models`` is
    what the blocks above import."""
    code = "import sys, fairseq_alibi; print(sorted({'fairseq', 'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    load = ("import fairseq_alibi\nfrom fairseq import checkpoint_utils\n"
            f"checkpoint_utils.load_model_ensemble_and_task([{str(alibi_checkpoint)!r}])")
    result = run_cli([sys.executable, "-c", load], expect_ok=False)
    assert result.returncode != 0 and "KeyError: \"'_name'\"" in result.output
    assert "`KeyError: \"'_name'\"`" in doc("docs/training.md")


# ------------------------------------------------------------------ config tables
def lm_fields() -> dict:
    """The decoder's ALiBi config fields (encoders' own: docs/bidirectional.md)."""
    from fairseq_alibi.models.config import ALIBI_FIELDS
    from fairseq_alibi.models.transformer_lm import AlibiLanguageModelConfig

    return {f.name: f for f in dataclasses.fields(AlibiLanguageModelConfig) if f.name in ALIBI_FIELDS}


def default_shown(name: str, default) -> List[str]:
    """How a field's default reads in a table: one ticked value, or (no single
    value) the texts its cell must hold."""
    if name == "alibi_tail_alpha":  # None: the method's own
        return [f"`{method}` {value:g}" for method, value in DEFAULT_ALPHA.items()]
    if name == "position_scaling":  # "": the older names decide
        return ["empty"]
    if isinstance(default, str) and default.startswith("${"):  # an interpolation: task.tokens_per_sample
        return [default[2:-1].split(".")[-1]]
    return [f"`{default:g}`" if isinstance(default, float) else f"`{default}`"]


def single(shown: List[str]) -> bool:
    return len(shown) == 1 and re.fullmatch(r"`[^`]+`", shown[0]) is not None


def check_field_row(where: str, name: str, cells: str) -> None:
    """What a config table says of ``name``: every method, the two kinds of
    factor, every kernel, as the code's tables have them."""
    if name == "alibi_interpolation":
        assert words(cells) == list(METHODS), missing_methods(where, words(cells))
    if name == "alibi_scale_factor":
        groups = [g.split("/") for g in re.findall(r"((?:`[a-z]+`/)+`[a-z]+`):", cells)]
        assert [[ticked(m)[0] for m in g] for g in groups] == [list(SCALE_METHODS), list(DISTANCE_METHODS)], where
    if name == "alibi_attention":
        assert set(words(cells)) == set(KERNEL_NAMES), where


def test_readme_config_table_is_the_code_s():
    rows = {ticked(row[0])[0]: row for row in table(doc("README.md"), "field (CLI flag / `--model-overrides` key)")}
    fields = lm_fields()
    assert sorted(rows) == sorted(fields)
    for name, (_, default, meaning) in rows.items():
        shown = default_shown(name, fields[name].default)
        assert default == shown[0] if single(shown) else all(text in default for text in shown), (name, default)
        check_field_row(f"README's configuration table, {name}", name, meaning)


def test_usage_config_table_is_the_code_s():
    rows = {ticked(row[0])[0]: row for row in table(doc("docs/training.md"), "field (`--flag`)")}
    fields = lm_fields()
    assert sorted(rows) == sorted(fields)
    for name, (field_cell, values, meaning) in rows.items():
        assert ticked(field_cell)[1] == "--" + name.replace("_", "-")
        shown = default_shown(name, fields[name].default)
        if single(shown):
            assert f"{shown[0]} (default" in values, (name, values)
        else:
            row = f"{values} {meaning}"
            assert all(text in row or text in row.replace("--", "").replace("-", "_") for text in shown), name
        check_field_row(f"docs/training.md's configuration table, {name}", name, values)


def test_sample_error_is_what_the_code_prints():
    import argparse

    from fairseq_alibi.errors import ConfigError
    from fairseq_alibi.models.config import build_bias

    shown = re.search(r"```\n(error: alibi_interpolation='cubic'[^\n]*)\n```", doc("docs/training.md")).group(1)
    with pytest.raises(ConfigError) as error:
        build_bias(argparse.Namespace(alibi_interpolation="cubic"), 4)
    assert shown == f"error: {error.value}"


# ------------------------------------------------------------------ methods, kernels, forms
def test_methods_table_covers_every_method_in_every_spelling():
    rows = table(doc("docs/evaluating.md"), "method")
    listed = [ticked(row[0])[0] for row in rows]
    assert listed == list(METHODS), missing_methods("docs/evaluating.md's methods table", listed)
    for row in rows:
        method = ticked(row[0])[0]
        items = [t for t in ticked(row[2]) if ":" in t or t == method]
        overrides = [ast.literal_eval(t) for t in ticked(row[3]) if t.startswith("{")]
        hf_dicts = [json.loads(t.replace(": L}", f": {L}}}")) for t in ticked(row[4]) if t.startswith("{")] or [None]
        assert items and overrides and hf_dicts
        specs = ([Scaling.parse(t, L) for t in items]
                 + [Scaling.from_config(dict(o, alibi_train_length=L)) for o in overrides]
                 + [Scaling.from_hf(d, L) for d in hf_dicts])
        assert {s.method for s in specs} == {method}, row
        keywords = ticked(row[5])[0]
        args = ast.literal_eval(f"[{keywords.split(', alpha=')[0]}]")
        alpha = float(keywords.split("alpha=")[1]) if "alpha=" in keywords else None
        assert Scaling(*args, train_length=L, alpha=alpha).method == method


def test_export_alibi_scaling_table_covers_every_method():
    """docs/export.md: each row's ``alibi_scaling`` forms and ``--alibi-scaling``
    spellings (F, N, A filled in) are read by the code as that row's method."""
    fill = {"F": "2", "N": str(L), "A": "0.5"}
    listed = set()
    for row in table(doc("docs/export.md"), "`alibi_scaling`"):
        forms = [json.loads(re.sub(r"\b[FNA]\b", lambda m: fill[m.group()], t)) for t in ticked(row[0])
                 if t.startswith("{")] + ([None] if "`null`" in row[0] else [])
        spellings = [re.sub(r"\b[FA]\b", lambda m: fill[m.group()], t) for t in ticked(row[2])
                     if re.fullmatch(r"[a-z]+(:[FA0-9.]+)*", t)]
        methods = {Scaling.from_hf(f, L).method for f in forms} | {Scaling.parse(s, L).method for s in spellings}
        assert len(methods) == 1 and forms and spellings, row
        listed |= methods
    alibi = set(position("alibi").extensions)  # exported models are ALiBi
    assert listed == alibi, missing_methods("docs/export.md's alibi_scaling table", sorted(listed), alibi)


def test_hf_docs_and_docstrings_name_every_method():
    from fairseq_alibi.core import configuration_alibi
    from fairseq_alibi.hf import apply_alibi_scaling

    alibi = list(ALIBI_SLOPE_METHODS)  # the hooks patch ALiBi's bias: its slope and distance methods (not logn)
    sentence = re.search(r"`method` is ([^.]*)\.", doc("docs/hf.md")).group(1)
    assert words(sentence) == alibi, missing_methods("docs/hf.md, apply_alibi_scaling", words(sentence), alibi)
    for where, text in (("core/configuration_alibi.py's docstring", configuration_alibi.__doc__),
                        ("hf.apply_alibi_scaling's docstring", apply_alibi_scaling.__doc__)):
        named = [m for m in METHODS if re.search(rf"[`\"]{m}[`\"]", text)]
        assert named == alibi, missing_methods(where, named, alibi)


def test_performance_kernel_table_is_the_registry():
    names = [ticked(row[0])[0] for row in table(doc("docs/performance.md"), "kernel")]
    assert sorted(names) == sorted(KERNEL_NAMES)


def test_factor_one_claim_of_evaluating_md():
    """docs/evaluating.md: ``linear``/``ntk`` at factor 1 are the plain model; the
    distance methods at factor 1 change nothing up to L and the bias past it."""
    assert "`linear` or `ntk` with factor 1, reproduce the plain model" in " ".join(doc("docs/evaluating.md").split())
    T = 3 * TRAIN_LENGTH

    def dense(scaling):
        return AlibiBias(6, "causal", scaling).dense(T, T, torch.float64, "cpu")

    plain = dense(Scaling())
    for info in METHOD_TABLE:
        if info.name not in position("alibi").extensions:
            continue
        at_one = dense(Scaling(info.name, 1.0, TRAIN_LENGTH))
        within = slice(0, TRAIN_LENGTH)  # queries whose every key is within L
        assert torch.equal(at_one[..., within, :], plain[..., within, :]), info.name
        changed = not torch.allclose(at_one, plain)
        assert changed == (info.kind == "distance"), info.name


# ------------------------------------------------------------------ --help and names
def unwrapped(text: str) -> str:
    """``text`` without whitespace: argparse wraps help at spaces and after hyphens."""
    return "".join(text.split())


def help_text(*argv) -> str:
    return unwrapped(run_cli([tool(argv[0]), *argv[1:], "--help"]).stdout)


def help_strings(call: ast.Call):
    """The ``--help`` texts a call declares: its ``help=`` keyword, and the
    text of a config field (``models.config.option(default, help)``); the
    literal parts of an f-string (its ``{...}`` left out)."""
    texts = [k.value for k in call.keywords if k.arg == "help"]
    if isinstance(call.func, ast.Name) and call.func.id == "option" and len(call.args) == 2:
        texts.append(call.args[1])
    for text in texts:
        if isinstance(text, ast.JoinedStr):
            yield "".join(part.value for part in text.values if isinstance(part, ast.Constant))
        elif isinstance(text, ast.Constant) and isinstance(text.value, str):
            yield text.value


def test_every_help_string_formats_as_written():
    """argparse formats each help text with ``%`` (fairseq's config fields
    too): a bare ``%`` (``"90% of"``) prints ``ascii()`` of the action's
    attributes in ``--help``, or fails it.  Every help text in the
    repository's Python files (scripts, examples, benchmarks, the package)
    has only ``%%`` and ``%(name)s``."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    escaped = re.compile(r"%%|%\(\w+\)[sdrfg]")  # what argparse formats as written
    wrong, seen = [], 0
    for name in files:
        for call in ast.walk(ast.parse((REPO / name).read_text(encoding="utf-8"))):
            for text in help_strings(call) if isinstance(call, ast.Call) else ():
                seen += 1
                if "%" in escaped.sub("", text):
                    wrong.append(f"{name}:{call.lineno}: {text!r}")
    assert seen > 150 and not wrong, wrong  # 170 when written


def test_eval_lm_help_lists_every_override_key_with_its_values():
    from fairseq_alibi.models.config import ALIBI_FIELDS

    text = run_cli([tool("alibi-eval-lm"), "--help"]).stdout.split("Position methods at evaluation")[1]
    assert re.findall(r"^  ((?:alibi|position)_\w+): ", text, re.M) == list(ALIBI_FIELDS)
    flat = " ".join(text.split())
    assert " | ".join(METHODS) in flat and " | ".join(KERNEL_NAMES) in flat
    assert all(f"{m} {a:g}" in flat for m, a in DEFAULT_ALPHA.items())


def test_train_and_sweep_help_come_from_the_method_table():
    train = help_text("alibi-train")
    for info in METHOD_TABLE[1:]:
        assert unwrapped(f"{info.name}: {info.summary}") in train, info.name
    assert unwrapped(METHOD_SYNTAX) in help_text("alibi-sweep")


def dotted_names(text: str) -> List[str]:
    return sorted(set(re.findall(r"`(fairseq_alibi(?:\.\w+)+)", text)))


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_module_names_and_paths_in_the_docs_exist():
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for name in dotted_names(text):
            assert resolves(name), f"{path.name}: {name}"
        for file, attr in re.findall(r"\b(fairseq_alibi/[\w/]+\.py)(?:::(\w+))?", text):
            assert (REPO / file).is_file(), f"{path.name}: {file}"
            if attr:
                assert resolves(file[:-3].replace("/", ".") + "." + attr), f"{path.name}: {file}::{attr}"


def test_readme_layout_names_every_module():
    layout = next(b.code for b in BLOCKS if b.path.name == "README.md" and b.code.startswith("fairseq_alibi/"))
    for line in layout.splitlines():
        entry = line.split()[0].rstrip(",") if line.strip() and not line.startswith(" ") else None
        if entry:
            assert (REPO / entry).exists(), entry
    package = REPO / "fairseq_alibi"
    modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
    modules += [p for p in (package / "core").glob("*.py") if p.name != "__init__.py"]
    packages = [p for p in package.iterdir() if (p / "__init__.py").is_file()]
    for path in modules + packages:
        assert path.name in layout, f"README's layout does not name {path.relative_to(REPO)}"


# ------------------------------------------------------------------ the demo table
DEMO = REPO / "examples" / "language_model" / "demo.sh"


def demo_table() -> dict:
    """README's demo table: {model: {length: the cell as printed}}."""
    rows = table(doc("README.md"), "evaluation length")
    header = next(line for line in doc("README.md").splitlines() if line.startswith("| evaluation length |"))
    lengths = [int(cell.split()[0]) for cell in header.strip("|").split("|")[1:]]
    return {row[0]: dict(zip(lengths, row[1:])) for row in rows}


def test_readme_demo_table_is_in_the_demos_format_and_agrees_with_extrapolation_md(tmp_path):
    """The lengths are the demo's ``L x LENGTHS``; the demo's own summary (the
    Python at the end of demo.sh, fed these numbers as a results.json) prints
    exactly the 1x and 8x cells; docs/extrapolation.md's full table has the
    same rows."""
    script = DEMO.read_text()
    train_length = int(re.search(r"^L=\$\{L:-(\d+)\}", script, re.M).group(1))
    ratios = [float(r[:-1]) for r in re.search(r"^LENGTHS=\$\{LENGTHS:-([\dx,]+)\}", script, re.M).group(1).split(",")]
    shown = demo_table()
    assert {name.lower() for name in shown} == {"alibi", "sinusoidal"}
    for values in shown.values():
        assert list(values) == [int(train_length * r) for r in ratios]
    assert all(re.fullmatch(r"\d+\.\d\d", cell) for values in shown.values() for cell in values.values())
    cells = [dict(checkpoint=name.lower(), label="none", mode="nonoverlapping", length_ratio=length / train_length,
                  ppl=float(ppl)) for name, values in shown.items() for length, ppl in values.items()]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"cells": cells}))
    summary = re.search(r"<<'EOF'\n(.*?)\nEOF", script, re.S).group(1)
    printed = subprocess.run([sys.executable, "-", str(results)], input=summary, capture_output=True, text=True,
                             check=True).stdout
    for name, values in shown.items():
        one, eight = values[train_length], values[8 * train_length]
        line = next(line.strip() for line in printed.splitlines() if line.strip().startswith(name.lower() + ":"))
        assert line.startswith(f"{name.lower()}: ppl {one} at 1x, {eight} at 8x (ratio "), printed
        assert f"`{line}`" in doc("README.md"), f"README quotes the demo's line {line!r}"
    full = {row[0]: [cell.strip("*") for cell in row[1:]]
            for row in table(doc("docs/extrapolation.md"), "model / method")}
    assert full["**ALiBi** (none)"] == list(shown["ALiBi"].values())
    assert full["**sinusoidal**"] == list(shown["sinusoidal"].values())


def test_positions_table_is_the_registry():
    """docs/positions.md's table of position methods: every registry entry with its
    kind, arch, the extension methods that apply and its parameters with their defaults."""
    from fairseq_alibi.core.positions import POSITIONS

    rows = {ticked(row[0])[0]: row for row in table(doc("docs/positions.md"), "method")}
    assert list(rows) == ["sinusoidal", *POSITIONS]
    for name, entry in POSITIONS.items():
        _, arch, kind, extensions, params = rows[name]
        assert ticked(arch)[0] == f"transformer_lm_{name}" and kind.strip() == entry.kind, name
        assert ticked(extensions) == list(entry.extensions), name
        shown = re.findall(r"`(\w+)` \(([^):]+)", params)
        assert [(p, float(d)) for p, d in shown] == [(p.name, float(p.default)) for p in entry.params], name


# ------------------------------------------------------------------ lists of methods
def test_lists_of_position_methods_are_the_registry():
    """Every list of position or extension methods the README, the docs and the examples'
    READMEs show in prose, against the registries: a method added to
    ``core/positions.py`` (or ``core/scaling.py``) fails here, naming the place."""
    from fairseq_alibi.core.positions import POSITIONS

    layout = " ".join(next(b.code for b in BLOCKS if b.path.name == "README.md"
                           and b.code.startswith("fairseq_alibi/")).split())
    listed = re.search(r"positions\.py the registry of position methods \(([^)]*)\)", layout).group(1).split(", ")
    assert listed == list(POSITIONS), missing_methods("README's layout, positions.py", listed, list(POSITIONS))
    listed = re.search(r"\(METHOD_TABLE: ([^)]*)\)", layout).group(1).split(", ")
    assert listed == list(METHODS), missing_methods("README's layout, scaling.py", listed)
    performance = " ".join(doc("docs/performance.md").split())
    listed = re.search(r"measures every position method \(([^;]*);", performance).group(1).split(", ")
    models = ["sinusoidal", *POSITIONS]
    assert listed == models, missing_methods("docs/performance.md, positions_cost.py", listed, models)
    listed = re.search(r"\(`([a-z0-9 ]+)`, each trained as", doc("examples/retrieval/README.md")).group(1).split()
    assert listed == list(POSITIONS), missing_methods("examples/retrieval/README.md", listed, list(POSITIONS))
    retrieval = " ".join(doc("docs/retrieval.md").split())
    applies = re.search(r"\(ALiBi: all but `(\w+)`; RoPE: ((?:`\w+`, )*`\w+`); RNoPE: RoPE's; stick-breaking, which has no softmax to scale: `none` only; the others", retrieval)
    assert [m for m in METHODS if m not in position("alibi").extensions] == [applies.group(1)]
    assert ticked(applies.group(2)) == list(position("rotary").extensions)
    assert position("rnope").extensions == position("rotary").extensions, "docs/retrieval.md: RNoPE takes RoPE's"
    assert position("stickbreaking").extensions == ("none",), "docs/retrieval.md: stick-breaking takes `none` only"
    others = [name for name, entry in POSITIONS.items() if name not in ("alibi", "rotary", "rnope", "stickbreaking")]
    assert all(POSITIONS[name].extensions == ("none", "logn") for name in others), \
        "docs/retrieval.md says every other position method has `none` and `logn`"


def test_core_docstring_names_every_module_of_the_folder():
    """core/__init__.py's list of modules is the folder's listing."""
    import fairseq_alibi.core as core

    named = {name for head in re.findall(r"^\* (.*?): ", core.__doc__, re.M) for name in re.findall(r"``(\w+)``", head)}
    modules = {p.stem for p in (REPO / "fairseq_alibi" / "core").glob("*.py") if p.stem != "__init__"}
    assert named == modules, (f"core/__init__.py's docstring lacks {sorted(modules - named)}, "
                              f"names no module {sorted(named - modules)}")


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives a Markdown file's headings: lower case, every
    character but letters, digits, spaces, hyphens and underscores dropped,
    spaces turned to hyphens, a repeated heading numbered ``-1``, ``-2``, ...
    (fenced code is no heading)."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} +(.+?) *#* *$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


RESULT_FILES = sorted((REPO / "docs" / "results").glob("*.md"))
LINKED_FILES = [*DOC_FILES, *RESULT_FILES, *sorted((REPO / "examples").glob("*/README.md")),
                REPO / "checkpoints" / "README.md"]


def test_every_relative_link_reaches_its_file_and_heading():
    """A link between the docs (``[text](other.md#heading)``, ``(#heading)``)
    names a file that exists and, where it names a heading, one the file has: a
    renamed heading would leave its links pointing at the top of the page."""
    broken = []
    for path in LINKED_FILES:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)} -> {target}"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text(encoding="utf-8")):
                broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)


def test_heading_anchors_follow_githubs_rule():
    """The rule on the headings this repository writes: backticks, brackets,
    apostrophes, commas and '=' dropped, a space per hyphen kept."""
    text = "# At L = 2048 (a size), with T5's `band` path\n```\n# not a heading\n```\n## Same\n## Same\n"
    assert heading_anchors(text) == {"at-l--2048-a-size-with-t5s-band-path", "same", "same-1"}



# ------------------------------------------------------------------ the guide
#: The guide's pages: README and docs/*.md, less the generated error list and the kernels' architecture page.
GUIDE = [path for path in DOC_FILES if path.name not in ("errors.md", "architecture.md")]
#: The longest a guide page may be, in lines.
GUIDE_LINES = 400
@pytest.mark.parametrize("path", GUIDE, ids=lambda p: p.name)
def test_guide_page_is_within_its_length(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= GUIDE_LINES, f"{path.name}: {lines} lines (at most {GUIDE_LINES}: move measurements to docs/results/)"


@pytest.mark.parametrize("path", [p for p in GUIDE if p.name != "README.md"], ids=lambda p: p.name)
def test_guide_page_opens_with_what_it_answers_and_its_contents(path):
    """A summary, then a contents list whose entries are the page's own ``##`` headings, in order."""
    text = path.read_text(encoding="utf-8")
    head = text.split("\n## ", 1)[0]
    assert "**What this page answers:**" in head, f"{path.name}: no summary before its first section"
    listed = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)", head.split("Contents:", 1)[-1], re.M)
    assert "Contents:" in head and listed, f"{path.name}: no contents list before its first section"
    sections = []
    fenced = False
    for line in text.splitlines():
        fenced = fenced != line.startswith("```")
        match = None if fenced else re.match(r"## +(.+?) *$", line)
        if match:
            sections.append(re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-"))
    assert listed == sections, f"{path.name}: the contents list {listed} is not the sections {sections}"


PROJECT_HISTORY = re.compile(r"(?<!fairseq )\bissues? \d+|the issue does not name|the issue's own")


@pytest.mark.parametrize("path", GUIDE, ids=lambda p: p.name)
def test_guide_page_speaks_to_users_not_of_the_project_s_issues(path):
    found = [line for line in path.read_text(encoding="utf-8").splitlines() if PROJECT_HISTORY.search(line)]
    assert not found, f"{path.name}: {found}"


def test_every_results_file_has_its_header_and_is_listed():
    """docs/results/: date (or the run's own heading), machine, corpus, command, status; the index lists each."""
    index = (REPO / "docs" / "results" / "README.md").read_text(encoding="utf-8")
    for path in RESULT_FILES:
        if path.name == "README.md":
            continue
        head = path.read_text(encoding="utf-8").split("\n\n", 2)[1]
        for field in ("Date", "[Mm]achine", "Corpus", "Command", "Status"):
            assert re.search(rf"\*\*(Date, )?{field}\b", head), f"{path.name}: no {field} in its header"
        assert f"]({path.name})" in index, f"docs/results/README.md does not list {path.name}"


def test_readme_method_table_names_every_method_of_the_registry():
    """README's "which method for what": a row for every position method, the stock
    model and the two logit scalings, each citing a results file or a guide page."""
    from fairseq_alibi.core.positions import POSITIONS

    rows = table(doc("README.md"), "method")
    names = [ticked(row[0])[0] for row in rows]
    expected = ["sinusoidal", *POSITIONS, "ssmax", "logn"]
    assert sorted(names) == sorted(expected), missing_methods("README's method table", names, expected)
    for row in rows:
        assert len(row) == 6 and all(cell.strip() for cell in row), row[0]
        assert re.search(r"\]\(docs/(results/)?[\w.-]+\.md", row[3]), f"{row[0]}: its evidence cites no file"


def test_evaluating_lists_the_per_pass_parameters_of_the_registry():
    """docs/evaluating.md's list of position parameters computed at every pass is the
    registry's ``setting`` parameters, each once."""
    from fairseq_alibi.core.params import SETTING
    from fairseq_alibi.core.positions import params_of

    text = " ".join(doc("docs/evaluating.md").split())
    listed = ticked(re.search(r"computed at every pass \(([^)]*)\)", text).group(1))
    settings = list(dict.fromkeys(p.name for _, p in params_of() if p.role == SETTING))
    assert listed == settings, missing_methods("docs/evaluating.md, per-pass parameters", listed, settings)


def _tools() -> set:
    """What a command line of the docs may start with: the console scripts setup.py
    declares, and the shell's own and standard tools."""
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    scripts = set(re.findall(r'"([\w-]+) = [\w.]+:\w+"', setup))
    shell = set("""cd for do done if then else fi while export cp mv ls cat echo mkdir rm ln head tail grep sed
        awk wc tar curl wget source . python python3 pip torchrun git diff sort uniq xargs tee env time seq
        test [ true false printf unset set trap wait sleep kill bash sh nproc du df find chmod touch jq
        lm_eval huggingface-cli nvidia-smi which fairseq-train fairseq-eval-lm fairseq-generate
        fairseq-interactive fairseq-preprocess fairseq-hydra-train pytest make OMP_NUM_THREADS""".split())
    return scripts | shell


def _command_lines(code: str):
    """Each command of a shell block: continuation lines joined, comments and
    ``VAR=value`` prefixes dropped, the words after ``;``, ``&&``, ``|`` and ``do`` too."""
    joined = re.sub(r"\\\n\s*", " ", code)
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in re.split(r"\s*(?:;|&&|\|\|)\s*|\s\|\s", line):
            try:
                words = shlex.split(part)
            except ValueError:  # an unclosed quote of a line cut by the split
                words = part.split()
            while words and (re.match(r"[A-Za-z_]\w*=", words[0]) or words[0] in ("do", "then", "else", "time")):
                words.pop(0)
            if words:
                yield words


def test_every_command_block_names_a_tool_that_exists():
    """In README and the docs' shell blocks, each command is a console script of
    setup.py, a standard tool, a script of the repository (it exists) or a
    ``make`` target of the Makefile; ``python FILE.py`` names a file that exists."""
    tools = _tools()
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), re.M))
    wrong = []
    for block in BLOCKS:
        if block.lang not in ("bash", "sh", "shell"):
            continue
        for words in _command_lines(block.code):
            first = words[0].strip("\"'()")
            if first in ("done", "fi", "else", "}", "{", ")", "(") or first.startswith("-") or not first:
                continue
            if first == "make":
                goals = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
                wrong += [f"{block.name}: make {g}" for g in goals if g not in targets]
            elif first in ("python", "python3") and len(words) > 1 and words[1].endswith(".py"):
                if not (REPO / words[1]).is_file():
                    wrong.append(f"{block.name}: python {words[1]}")
            elif "/" in first:
                if first.startswith(("examples/", "scripts/", "benchmarks/", "checkpoints/", ".venv/")):
                    if not first.startswith(".venv/") and not (REPO / first).exists():
                        wrong.append(f"{block.name}: {first}")
            elif first not in tools:
                wrong.append(f"{block.name}: {first}")
    assert not wrong, "commands that name no tool of this repository or the shell:\n" + "\n".join(wrong)
