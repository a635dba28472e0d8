"""No function of the package over :data:`MAX_LINES` lines (issue 78): a
reader new to the kernels reads each step whole.  Walks every module's AST,
nested functions and methods included; a function's lines run from its
``def`` (decorators excluded) to its last line, docstring included."""

import ast
from pathlib import Path

import fairseq_alibi

MAX_LINES = 80
PACKAGE = Path(fairseq_alibi.__file__).parent
#: Known to be over, each to be split by its owner: the test fails once one is not (then drop it here).
OVER: set = set()


def long_functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    yield f"{path.relative_to(PACKAGE).as_posix()}:{node.name}", lines


def test_no_function_is_over_80_lines():
    found = dict(long_functions())
    assert set(found) - OVER == set(), {name: found[name] for name in set(found) - OVER}
    assert OVER <= set(found), f"no longer over {MAX_LINES} lines, drop from OVER: {sorted(OVER - set(found))}"


def test_the_walk_finds_a_long_function(tmp_path, monkeypatch):
    """The check itself: a module with an 81-line function is reported."""
    (tmp_path / "long.py").write_text("def f():\n" + "    x = 1\n" * 80)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert dict(long_functions()) == {"long.py:f": 81}
