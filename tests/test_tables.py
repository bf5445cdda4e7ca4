"""The loader of the built-in prompt tables (data/tables.py; package data under
data/prompt_tables/)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest
import tomllib

import lenscape
from lenscape.data.tables import check_table, load_table

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("text", "target")


def test_every_table_ships_as_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = package_data["package-data"]["lenscape"]
    folder = Path(lenscape.__file__).parent
    tables = sorted(folder.glob("data/prompt_tables/*.json"))
    assert {t.stem for t in tables} == {"factual", "ioi", "tasks", "corpus"}
    for table in tables:
        assert any(fnmatch(str(table.relative_to(folder)), g) for g in globs), table


def test_factual_table_loads_as_records():
    records = load_table("factual", keys=("text", "target", "corrupt", "distractor", "category"))
    assert len(records) == 85 and records[0]["target"] == " Paris"


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ([{"text": "a", "target": "b"}, {"text": "a"}], r"factual\.json entry 1 must have"),
        ([{"target": "b", "text": "a"}], r"entry 0 must have the keys \['text', 'target'\]"),
        ([{"text": "a", "target": ""}], r"entry 0 holds ''; every entry must be a non-empty"),
        ([{"text": "a", "target": 3}], r"entry 0 holds 3"),
        ({"text": ["a", ["b", None]], "target": "c"}, r"entry top holds None"),
        ("not a table", r"entry top must have"),
    ],
)
def test_malformed_table_is_refused_naming_the_entry(table, match):
    with pytest.raises(ValueError, match=match):
        check_table(table, name="factual", keys=KEYS)


def test_wellformed_table_is_returned_as_is():
    table = {"text": ["a", ["b", "c"]], "target": {"x": "y"}}
    assert check_table(table, name="t", keys=KEYS) is table
