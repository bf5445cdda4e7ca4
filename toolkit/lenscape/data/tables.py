"""The one loader for the built-in prompt tables shipped as JSON in ``prompt_tables/``.

``factual.json`` (clean/corrupt factual pairs), ``ioi.json`` (IOI templates and names),
``tasks.json`` (word lists of the gating tasks) and ``corpus.json`` (word lists of the mixed
corpus) are package data; ``lenscape.data``, ``tasks`` and ``corpus`` build prompts from them.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any


@functools.cache
def load_table(name: str, *, keys: tuple[str, ...]) -> Any:
    """The table ``prompt_tables/<name>.json`` (a list of records or one object), checked
    by ``check_table``. Cached: callers must not mutate it."""
    path = resources.files("lenscape.data") / "prompt_tables" / f"{name}.json"
    return check_table(json.loads(path.read_text(encoding="utf-8")), name=name, keys=keys)


def check_table(table: Any, *, name: str, keys: tuple[str, ...]) -> Any:
    """``table`` itself once every record (or the one object) has exactly ``keys`` and every
    leaf is a non-empty string; else a ValueError naming the file and the entry."""
    for where, entry in enumerate(table) if isinstance(table, list) else [("top", table)]:
        if not isinstance(entry, dict) or tuple(entry) != keys:
            raise ValueError(
                f"prompt_tables/{name}.json entry {where} must have the keys {list(keys)} in "
                f"that order; got {entry!r:.200}."
            )
        _check_strings(entry, f"prompt_tables/{name}.json entry {where}")
    return table


def _check_strings(value: Any, where: str) -> None:
    """Every leaf of nested lists and objects is a non-empty string."""
    if isinstance(value, dict):
        value = [*value, *value.values()]
    if isinstance(value, list):
        for item in value:
            _check_strings(item, where)
    elif not isinstance(value, str) or not value:
        raise ValueError(f"{where} holds {value!r}; every entry must be a non-empty string.")
