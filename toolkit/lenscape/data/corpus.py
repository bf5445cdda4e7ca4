"""The built-in mixed corpus: short texts of clearly different kinds, from templates.

Used to cluster inputs and learn per-cluster block masks. Items are plain ``(text, kind)``
pairs; ``lenscape.data.prompts("mixed")`` makes them ``Prompt``s with the kind as category
and an empty target (the loss is next-token NLL over the whole text).
"""

from __future__ import annotations

import random

from .tables import load_table

_CORPUS_KEYS = ("names", "places", "things", "facts", "funcs", "items", "tasks", "verbs")
_NAMES, _PLACES, _THINGS, _FACTS, _FUNCS, _ITEMS, _TASKS, _VERBS = load_table(
    "corpus", keys=_CORPUS_KEYS
).values()


def _narrative(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    return (
        f"{a} walked to {rng.choice(_PLACES)} and found {rng.choice(_THINGS)}. "
        f"{b} asked what it was, but {a} only smiled."
    )


def _arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    return f"Compute: {a} + {b} = {a + b}, then {a + b} * {c} = {(a + b) * c}."


def _code(rng: random.Random) -> str:
    name, body = rng.choice(_FUNCS)
    n = rng.randint(1, 9)
    return f"def {name}(a, b):\n    return {body}\n\nprint({name}({n}, {n + rng.randint(1, 5)}))"


def _dialogue(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    thing = rng.choice(_THINGS)
    place = rng.choice(_PLACES)
    return f"{a}: Have you seen {thing}?\n{b}: Yes, I left it near {place}.\n{a}: Thanks!"


def _fact(rng: random.Random) -> str:
    (s1, p1), (s2, p2) = rng.sample(_FACTS, 2)
    return f"{s1} {p1}. {s2} {p2}."


def _shopping_list(rng: random.Random) -> str:
    items = rng.sample(_ITEMS, rng.randint(3, 5))
    return "Shopping list:\n" + "\n".join(f"- {rng.randint(1, 4)} {item}" for item in items)


def _instructions(rng: random.Random) -> str:
    steps = rng.sample(_VERBS, 3)
    return " ".join(f"{i}. {verb} {rest}." for i, (verb, rest) in enumerate(steps, start=1))


def _todo(rng: random.Random) -> str:
    tasks = rng.sample(_TASKS, 3)
    return f"To do on {rng.choice(['Monday', 'Friday', 'Sunday'])}: " + ", ".join(tasks) + "."


KINDS = {
    "narrative": _narrative,
    "arithmetic": _arithmetic,
    "code": _code,
    "dialogue": _dialogue,
    "fact": _fact,
    "list": _shopping_list,
    "instructions": _instructions,
    "todo": _todo,
}


def mixed_items(n_per_kind: int = 40, seed: int = 0) -> list[tuple[str, str]]:
    """``n_per_kind`` distinct ``(text, kind)`` pairs of each kind in ``KINDS`` (320 by
    default)."""
    rng = random.Random(seed)
    items = []
    for kind, make in KINDS.items():
        texts: dict[str, None] = {}
        while len(texts) < n_per_kind:
            texts.setdefault(make(rng))
        items += [(text, kind) for text in texts]
    return items
