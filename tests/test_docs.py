"""docs/usage.md against the code's own tables: the config fields, the
methods in every spelling, and the sample error text as the code prints it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from fairseq_alibi.core import alibi
from fairseq_alibi.core.scaling import DEFAULT_ALPHA, METHODS, Scaling
from fairseq_alibi.core.kernels import KERNEL_NAMES

USAGE = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text(encoding="utf-8")
L = 64


def table(first_header: str):
    """The rows (lists of cells) of the Markdown table whose header starts with ``first_header``."""
    lines = USAGE.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def ticked(cell: str):
    return re.findall(r"`([^`]+)`", cell)


def test_config_table_lists_every_field_and_value():
    from fairseq_alibi.models.config import ALIBI_FIELDS

    rows = {ticked(row[0])[0]: row for row in table("field (`--flag`)")}
    shared = [f for f in ALIBI_FIELDS if f != "alibi_bidirectional"]  # the encoders' own field: docs/bidirectional.md
    assert sorted(rows) == sorted(shared)
    for name, row in rows.items():
        assert ticked(row[0])[1] == "--" + name.replace("_", "-")
    assert ticked(rows["alibi_interpolation"][1]) == list(METHODS)
    assert set(ticked(rows["alibi_attention"][1])) == set(KERNEL_NAMES)
    assert all(f"`{m}` {a:g}" in rows["alibi_tail_alpha"][1] for m, a in DEFAULT_ALPHA.items())


def test_sample_error_is_what_the_code_prints():
    import argparse

    from fairseq_alibi.errors import ConfigError
    from fairseq_alibi.models.config import build_bias

    shown = re.search(r"```\n(error: alibi_interpolation='cubic'[^\n]*)\n```", USAGE).group(1)
    with pytest.raises(ConfigError) as error:
        build_bias(argparse.Namespace(alibi_interpolation="cubic"), 4)
    assert shown == f"error: {error.value}"


def test_methods_table_covers_every_method_in_every_spelling():
    rows = table("method")
    assert [ticked(row[0])[0] for row in rows] == list(METHODS)
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
