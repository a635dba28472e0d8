"""tests/tiers.py: which tests ``make test`` (``-m "not slow"``) runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

TABLES = '''
import pytest

@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("n", [10, 11, 12, 13])
def test_table(n):
    pass

@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("a", ["x", "y"])
@pytest.mark.parametrize("b", [1, 2])
def test_product(a, b):
    pass

@pytest.mark.slow
def test_end_to_end():
    pass

def test_unit():
    pass
'''


def run_collection(directory: Path, *marker_args: str) -> subprocess.CompletedProcess:
    """pytest's collection of ``directory`` with the tiers plugin alone (no conftest)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tiers", "-p", "no:cacheprovider", "--collect-only", "-q",
         *marker_args, str(directory)],
        capture_output=True, text=True, cwd=directory, env={"PYTHONPATH": str(TESTS), "PATH": ""})


def collect(directory: Path, *marker_args: str) -> list:
    """Node ids pytest collects from ``directory`` with the tiers plugin alone (no conftest)."""
    result = run_collection(directory, *marker_args)
    assert result.returncode in (0, 5), result.stdout + result.stderr
    return sorted(line.split("::", 1)[1] for line in result.stdout.splitlines() if "::" in line)


def test_the_fast_tier_keeps_the_first_cases_of_a_table_and_no_slow_test(tmp_path):
    (tmp_path / "test_sample.py").write_text(TABLES)
    fast = collect(tmp_path, "-m", "not slow")
    assert fast == ["test_product[1-x]", "test_table[10]", "test_table[11]", "test_unit"], fast
    slow = collect(tmp_path, "-m", "slow")
    assert len(slow) == 2 + 3 + 1 and not set(slow) & set(fast), slow


def test_a_table_that_keeps_no_case_is_refused_in_one_line(tmp_path):
    """``fast_cases(0)`` (or a non-integer) would silently move a whole table to the slow
    tier: the collection stops with pytest's usage error naming the test and the rule."""
    for bad in ("0", "'2'"):
        (tmp_path / "test_sample.py").write_text(TABLES.replace("fast_cases(2)", f"fast_cases({bad})"))
        result = run_collection(tmp_path)
        assert result.returncode == 4, result.stdout + result.stderr  # pytest's usage error
        assert f"test_sample.py::test_table[10]: fast_cases takes a positive integer, not {bad}" in result.stderr, \
            result.stderr
