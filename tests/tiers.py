"""The suite's two tiers: ``make test`` (CI, within 8 minutes on 2 cores) and ``make test-all``.

``make test`` runs ``-m "not slow"``. Two markers put a test in the slow tier:

* ``@pytest.mark.slow``: an end-to-end test of many seconds (a real training
  run, a recipe, a fresh process, ``torch.compile``, every method exported);
* ``@pytest.mark.fast_cases(k)`` on a table-driven (parametrized) test: its
  first ``k`` cases, in collection order, stay in the fast tier and the others
  become ``slow``. The fast tier samples the table; ``make test-all`` runs all
  of it.

The conftest imports this module's hook; ``tests/test_tiers.py`` checks it on
a file of its own.
"""

from __future__ import annotations

import pytest


def register_markers(config) -> None:
    config.addinivalue_line(
        "markers",
        "slow: an end-to-end test of many seconds on 2 cores (real training runs, recipes, fresh "
        "processes, torch.compile, every method exported); `make test` leaves these out to stay "
        "within 8 minutes, `make test-all` runs them (docs: README, 'Two commands')")
    config.addinivalue_line(
        "markers",
        "fast_cases(k): a table-driven test whose first k cases (in collection order) run in "
        "`make test` and whose other cases are `slow`")


def pytest_configure(config):
    register_markers(config)


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(config, items):
    """Give ``slow`` to the cases of a ``fast_cases(k)`` table after its first ``k``."""
    seen: dict = {}
    for item in items:
        marker = item.get_closest_marker("fast_cases")
        if marker is None:
            continue
        keep = marker.args[0] if marker.args else 1
        if not isinstance(keep, int) or keep < 1:
            raise pytest.UsageError(f"{item.nodeid}: fast_cases takes a positive integer, not {keep!r}")
        table = (item.path, item.originalname)
        seen[table] = seen.get(table, 0) + 1
        if seen[table] > keep:
            item.add_marker(pytest.mark.slow)
