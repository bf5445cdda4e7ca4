"""Templated one-shot tasks for head gating: arithmetic and English syntax.

Each item is one solved example followed by a query; the target is the query's answer
(possibly several tokens). Items are generated deterministically from word lists and
number ranges written for this project. Items are plain ``(text, target, category)``
tuples; ``lenscape.data.task`` is the public entry and makes them ``Prompt``s.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from .tables import load_table

#: One task item: (text, target, category).
Item = tuple[str, str, str]

#: Word lists (prompt_tables/tasks.json): nouns singular -> plural, verbs base -> (third
#: person singular, past), subjects (singular, plural), adjectives, pronouns (capitalised, lower).
_NOUNS, _VERBS, _SUBJECTS, _ADJECTIVES, _PRONOUNS = load_table(
    "tasks", keys=("nouns", "verbs", "subjects", "adjectives", "pronouns")
).values()


def _unique(make: Callable[[], Item], n: int) -> list[Item]:
    """``n`` distinct items from ``make()`` (a seeded generator), so no item is both a
    training and a validation item."""
    seen: dict[Item, None] = {}
    while len(seen) < n:
        seen.setdefault(make())
    return list(seen)


def _worked_example(draw: Callable[[], tuple[int, int]], op: str, solve, kind: str) -> Item:
    """One solved ``a op b`` example, then a query; operands from ``draw()``."""
    (a, b), (c, d) = draw(), draw()
    return f"{a} {op} {b} = {solve(a, b)}\n{c} {op} {d} =", f" {solve(c, d)}", kind


def math_items(n_per_kind: int = 120, seed: int = 0) -> list[Item]:
    """Addition, subtraction and multiplication with one worked example."""
    rng = random.Random(seed)
    kinds = {
        "addition": (lambda: (rng.randint(10, 59), rng.randint(10, 39)), "+", lambda a, b: a + b),
        "subtraction": (
            lambda: (rng.randint(40, 99), rng.randint(10, 39)),
            "-",
            lambda a, b: a - b,
        ),
        "multiplication": (
            lambda: (rng.randint(2, 9), rng.randint(2, 12)),
            "*",
            lambda a, b: a * b,
        ),
    }
    items = []
    for kind, (draw, op, solve) in kinds.items():
        items += _unique(functools.partial(_worked_example, draw, op, solve, kind), n_per_kind)
    return items


def syntax_items(n_per_kind: int = 100, seed: int = 0) -> list[Item]:
    """Plural forms, past tense, subject-verb agreement and yes/no question formation."""
    rng = random.Random(seed)
    nouns, verbs = list(_NOUNS.items()), list(_VERBS.items())

    def plural() -> Item:
        (s1, p1), (s2, p2) = rng.sample(nouns, 2)
        return f"one {s1}, two {p1}\none {s2}, two", f" {p2}", "plural"

    def past_tense() -> Item:
        (v1, (_, past1)), (v2, (_, past2)) = rng.sample(verbs, 2)
        return (
            f"Today I {v1}. Yesterday I {past1}.\nToday I {v2}. Yesterday I",
            f" {past2}",
            "past_tense",
        )

    def agreement() -> Item:
        (v1, (third1, _)), (v2, (third2, _)) = rng.sample(verbs, 2)
        (sing1, plur1), (sing2, plur2) = rng.sample(_SUBJECTS, 2)
        example = f"{sing1} {third1}. {plur1} {v1}.\n"
        if rng.random() < 0.5:
            return f"{example}{plur2} {v2}. {sing2}", f" {third2}", "agreement"
        return f"{example}{sing2} {third2}. {plur2}", f" {v2}", "agreement"

    def question() -> Item:
        (p1, q1), (p2, q2) = rng.sample(_PRONOUNS, 2)
        a1, a2 = rng.sample(_ADJECTIVES, 2)
        return (
            f"{p1} is {a1}. Question: Is {q1} {a1}?\n{p2} is {a2}. Question:",
            f" Is {q2} {a2}?",
            "question",
        )

    return [
        item
        for make in (plural, past_tense, agreement, question)
        for item in _unique(make, n_per_kind)
    ]


#: Task generators by name; each returns its items in a fixed order.
TASKS: dict[str, Callable[[], list[Item]]] = {"math": math_items, "syntax": syntax_items}
