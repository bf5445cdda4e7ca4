"""Built-in prompt sets: clean/corrupt pairs with single-token targets.

A ``Prompt`` is one measurement unit: a ``text`` whose next token should be ``target``;
optionally a ``corrupt`` text of the same token length whose answer is ``distractor``
(the counterfactual used by activation/attribution patching and the logit difference).
A ``PromptSet`` is an immutable sequence of prompts with a name; its ``text`` and
``category`` become the labels on the ``prompt`` dim of every result.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, overload

from ._corpus import mixed_items
from ._tasks import TASKS


@dataclass(frozen=True)
class Prompt:
    """One clean/corrupt prompt pair.

    Attributes:
        text: the clean prompt, e.g. "The Eiffel Tower is in the city of".
        target: the expected next token, with its leading space, e.g. " Paris".
        corrupt: a counterfactual prompt of the same token length, or None.
        distractor: the corrupt prompt's answer (the logit-difference baseline), or None.
        category: a short label (e.g. "capital", "landmark").
    """

    text: str
    target: str
    corrupt: str | None = None
    distractor: str | None = None
    category: str = ""

    def __post_init__(self) -> None:
        """Refuse fields of the wrong type and empty texts, naming the field.

        Raises:
            TypeError: a field that is not a string (``corrupt``/``distractor``: or None).
            ValueError: an empty (or whitespace-only) ``text`` or ``corrupt``: there would be
                no position to read the target at.
        """
        for field in fields(self):
            value = getattr(self, field.name)
            optional = field.name in ("corrupt", "distractor")
            if not isinstance(value, str) and not (optional and value is None):
                kind = "a string or None" if optional else "a string"
                raise TypeError(
                    f"Prompt {field.name} must be {kind}, got {value!r} "
                    f"({type(value).__name__}); e.g. Prompt(text='The capital of "
                    "France is', target=' Paris')."
                )
        for name in ("text", "corrupt"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                none = " (or corrupt=None for no counterfactual)" if name == "corrupt" else ""
                raise ValueError(
                    f"Prompt {name} {value!r} is empty; give the words the model "
                    f"reads before the target{none}."
                )


class PromptSet(Sequence[Prompt]):
    """An immutable, named sequence of ``Prompt``s."""

    def __init__(self, prompts: Iterable[Prompt], name: str = "custom"):
        self._prompts = tuple(prompts)
        self.name = name

    @overload
    def __getitem__(self, index: int) -> Prompt: ...
    @overload
    def __getitem__(self, index: slice) -> PromptSet: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return PromptSet(self._prompts[index], name=self.name)
        return self._prompts[index]

    def __len__(self) -> int:
        return len(self._prompts)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self._prompts)

    def __repr__(self) -> str:
        cats = sorted({p.category for p in self._prompts})
        return f"PromptSet({self.name!r}, {len(self)} prompts, categories={cats})"

    @property
    def texts(self) -> list[str]:
        return [p.text for p in self._prompts]

    @property
    def categories(self) -> list[str]:
        return [p.category for p in self._prompts]


#: What lenscape's methods accept as prompts: a ``PromptSet``, or ``Prompt``s or dicts with
#: their fields (``as_prompt_set`` turns any of them into a ``PromptSet``).
Prompts = PromptSet | Iterable[Prompt | dict[str, Any]]


def from_records(records: Iterable[Prompt | dict[str, Any]], name: str = "custom") -> PromptSet:
    """Build a ``PromptSet`` from ``Prompt``s or dicts with keys ``text``, ``target`` and
    optionally ``corrupt``, ``distractor``, ``category``.

    Raises:
        TypeError: ``records`` is one record (or a string) instead of a list of them, or a
            record's field has the wrong type.
        ValueError: a record lacks ``text``/``target``, has unknown keys or an empty text.
    """
    if isinstance(records, (dict, Prompt, str)) or not isinstance(records, Iterable):
        raise TypeError(
            f"records must be a list of Prompts or dicts, got one "
            f"{type(records).__name__} ({records!r}); wrap a single record in a "
            "list: [record]."
        )
    allowed = {f.name for f in fields(Prompt)}
    prompts = []
    for i, record in enumerate(records):
        if isinstance(record, Prompt):
            prompts.append(record)
            continue
        if not isinstance(record, dict) or not {"text", "target"} <= set(record):
            raise ValueError(
                f"Record {i} must be a Prompt or a dict with 'text' and 'target' "
                f"keys, got {record!r}."
            )
        unknown = set(record) - allowed
        if unknown:
            raise ValueError(
                f"Record {i} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}."
            )
        try:
            prompts.append(Prompt(**record))
        except (TypeError, ValueError) as err:
            raise type(err)(f"Record {i}: {err}") from None
    return PromptSet(prompts, name=name)


def as_prompt_set(prompts: Prompts) -> PromptSet:
    """``prompts`` as a ``PromptSet``: a PromptSet as it is, or a list of Prompts or record
    dicts (``from_records``). What every method taking prompts with targets accepts.

    Raises:
        TypeError: one Prompt or dict instead of a list, or something that is not a list.
        ValueError: plain strings (no targets), or a bad record (``from_records``).
    """
    if isinstance(prompts, PromptSet):
        return prompts
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], str)
    ):
        raise ValueError(
            "Capture needs prompts with targets, not plain strings: use "
            "lsc.data.prompts('factual') or lsc.data.from_records([{'text': ..., "
            "'target': ...}])."
        )
    if isinstance(prompts, (Prompt, dict)) or not isinstance(prompts, Iterable):
        raise TypeError(
            f"prompts must be a PromptSet or a list of Prompts or dicts, got one "
            f"{type(prompts).__name__}; wrap a single prompt in a list: [prompt], "
            "or use lsc.data.prompts('factual')."
        )
    return from_records(list(prompts))


def as_texts(prompts: Iterable[Prompt | str], *, with_target: bool = False) -> list[str]:
    """Plain texts of ``prompts`` (a ``PromptSet``, Prompts or strings), for methods that read
    whole texts: a Prompt's ``text`` (followed by its ``target`` with ``with_target``), a
    string as it is."""
    return [
        p if isinstance(p, str) else p.text + p.target if with_target else p.text for p in prompts
    ]


# Clean/corrupt pairs written for lenscape. Checked against the SmolLM2-135M tokenizer:
# targets and distractors are single tokens, clean and corrupt texts have equal token
# counts (tests/test_data.py), and the model prefers the right answer on both sides.
_FACTUAL: list[tuple[str, str, str, str, str]] = [
    (
        "The capital of France is the city of",
        " Paris",
        "The capital of Italy is the city of",
        " Rome",
        "capital",
    ),
    (
        "The capital of Italy is the city of",
        " Rome",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Germany is the city of",
        " Berlin",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Spain is the city of",
        " Madrid",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Japan is the city of",
        " Tokyo",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Russia is the city of",
        " Moscow",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of England is the city of",
        " London",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Egypt is the city of",
        " Cairo",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Greece is the city of",
        " Athens",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Ireland is the city of",
        " Dublin",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Austria is the city of",
        " Vienna",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Portugal is the city of",
        " Lisbon",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Poland is the city of",
        " Warsaw",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Norway is the city of",
        " Oslo",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Sweden is the city of",
        " Stockholm",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Kenya is the city of",
        " Nairobi",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Canada is the city of",
        " Ottawa",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of China is the city of",
        " Beijing",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Cuba is the city of",
        " Havana",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Peru is the city of",
        " Lima",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Belgium is the city of",
        " Brussels",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Hungary is the city of",
        " Budapest",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Denmark is the city of",
        " Copenhagen",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The capital of Finland is the city of",
        " Helsinki",
        "The capital of France is the city of",
        " Paris",
        "capital",
    ),
    (
        "The Eiffel Tower is located in the city of",
        " Paris",
        "The Colosseum is located in the city of",
        " Rome",
        "landmark",
    ),
    (
        "The Colosseum is located in the city of",
        " Rome",
        "The Eiffel Tower is located in the city of",
        " Paris",
        "landmark",
    ),
    (
        "The Big Ben is located in the city of",
        " London",
        "The Kremlin is located in the city of",
        " Moscow",
        "landmark",
    ),
    (
        "The Kremlin is located in the city of",
        " Moscow",
        "The Big Ben is located in the city of",
        " London",
        "landmark",
    ),
    (
        "The Brandenburg Gate is located in the city of",
        " Berlin",
        "The Eiffel Tower is located in the city of",
        " Paris",
        "landmark",
    ),
    (
        "The Statue of Liberty is located in the city of",
        " New",
        "The Eiffel Tower is located in the city of",
        " Paris",
        "landmark",
    ),
    (
        "The Acropolis is located in the city of",
        " Athens",
        "The Big Ben is located in the city of",
        " London",
        "landmark",
    ),
    (
        "The Golden Gate Bridge is located in the city of",
        " San",
        "The Eiffel Tower is located in the city of",
        " Paris",
        "landmark",
    ),
    (
        "The Louvre is located in the city of",
        " Paris",
        "The Big Ben is located in the city of",
        " London",
        "landmark",
    ),
    (
        "The Tower Bridge is located in the city of",
        " London",
        "The Kremlin is located in the city of",
        " Moscow",
        "landmark",
    ),
    (
        "The Prado Museum is located in the city of",
        " Madrid",
        "The Eiffel Tower is located in the city of",
        " Paris",
        "landmark",
    ),
    (
        "The Grand Canal is located in the city of",
        " Venice",
        "The Big Ben is located in the city of",
        " London",
        "landmark",
    ),
    (
        "The Forbidden City is located in the city of",
        " Beijing",
        "The Eiffel Tower is located in the city of",
        " Paris",
        "landmark",
    ),
    (
        "The Opera House is located in the city of",
        " Sydney",
        "The Big Ben is located in the city of",
        " London",
        "landmark",
    ),
    (
        "In France, most people speak",
        " French",
        "In Germany, most people speak",
        " German",
        "language",
    ),
    (
        "In Germany, most people speak",
        " German",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Italy, most people speak",
        " Italian",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Spain, most people speak",
        " Spanish",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Japan, most people speak",
        " Japanese",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Russia, most people speak",
        " Russian",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In China, most people speak",
        " Chinese",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Brazil, most people speak",
        " Portuguese",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Greece, most people speak",
        " Greek",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Poland, most people speak",
        " Polish",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Sweden, most people speak",
        " Swedish",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Turkey, most people speak",
        " Turkish",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Mexico, most people speak",
        " Spanish",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Portugal, most people speak",
        " Portuguese",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Egypt, most people speak",
        " Arabic",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Korea, most people speak",
        " Korean",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "In Finland, most people speak",
        " Finnish",
        "In France, most people speak",
        " French",
        "language",
    ),
    (
        "The currency used in England is the",
        " pound",
        "The currency used in Germany is the",
        " euro",
        "currency",
    ),
    (
        "The currency used in Germany is the",
        " euro",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in America is the",
        " dollar",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in Switzerland is the",
        " franc",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in Korea is the",
        " won",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in Brazil is the",
        " real",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in France is the",
        " euro",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in Canada is the",
        " dollar",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The currency used in Italy is the",
        " euro",
        "The currency used in England is the",
        " pound",
        "currency",
    ),
    (
        "The chemical symbol Fe stands for",
        " iron",
        "The chemical symbol Au stands for",
        " gold",
        "element",
    ),
    (
        "The chemical symbol Au stands for",
        " gold",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol Ag stands for",
        " silver",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol Cu stands for",
        " copper",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol Pb stands for",
        " lead",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol Na stands for",
        " sodium",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol He stands for",
        " helium",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol O stands for",
        " oxygen",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol H stands for",
        " hydrogen",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol C stands for",
        " carbon",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol N stands for",
        " nitrogen",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol K stands for",
        " potassium",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol Ca stands for",
        " calcium",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The chemical symbol Zn stands for",
        " zinc",
        "The chemical symbol Fe stands for",
        " iron",
        "element",
    ),
    (
        "The Windows operating system was made by the company",
        " Microsoft",
        "The Pixel phone was made by the company",
        " Google",
        "maker",
    ),
    (
        "The PlayStation was made by the company",
        " Sony",
        "The Model S was made by the company",
        " Tesla",
        "maker",
    ),
    (
        "The Model S was made by the company",
        " Tesla",
        "The PlayStation was made by the company",
        " Sony",
        "maker",
    ),
    (
        "The Galaxy phone was made by the company",
        " Samsung",
        "The PlayStation was made by the company",
        " Sony",
        "maker",
    ),
    (
        "The Mustang was made by the company",
        " Ford",
        "The PlayStation was made by the company",
        " Sony",
        "maker",
    ),
    (
        "The Corolla was made by the company",
        " Toyota",
        "The PlayStation was made by the company",
        " Sony",
        "maker",
    ),
    (
        "The Pixel phone was made by the company",
        " Google",
        "The Windows operating system was made by the company",
        " Microsoft",
        "maker",
    ),
]


def _factual() -> PromptSet:
    return PromptSet(
        (
            Prompt(text, target, corrupt, distractor, category)
            for text, target, corrupt, distractor, category in _FACTUAL
        ),
        "factual",
    )


# Indirect-object identification (IOI; Wang et al. 2022, arXiv 2211.00593): "When Mary and
# John went to the store, John gave a book to" -> " Mary". The corrupt text swaps the
# subject of the second clause to the other name ("..., Mary gave a book to" -> " John"),
# so clean and corrupt differ in one token and their answers are each other's distractor.
# Templates are the ones SmolLM2-135M answers right on both sides for every name pair
# tried (others, e.g. "Friends A and B found a key...", it gets wrong; tests/test_data.py).
_IOI_TEMPLATES: dict[str, str] = {
    "store": "When {A} and {B} went to the store, {S} gave a book to",
    "park": "When {A} and {B} went to the park, {S} gave a ball to",
    "market": "After {A} and {B} went to the market, {S} handed a bag to",
    "cafe": "Then, {A} and {B} had lunch at the cafe. {S} gave a drink to",
    "museum": "Yesterday {A} and {B} visited the museum, and {S} gave a ticket to",
}
#: Names that are one token with a leading space in the SmolLM2 tokenizer.
_IOI_NAMES = (
    "Mary",
    "John",
    "Tom",
    "James",
    "Anna",
    "Sarah",
    "David",
    "Emma",
    "Paul",
    "Kate",
    "Mark",
    "Lisa",
    "Peter",
    "Alice",
    "Jack",
    "Laura",
    "Michael",
    "Susan",
    "Daniel",
    "Rachel",
)


def _ioi(pairs_per_template: int = 12, seed: int = 0) -> PromptSet:
    rng = random.Random(seed)
    items = []
    for category, template in _IOI_TEMPLATES.items():
        for _ in range(pairs_per_template):
            a, b = rng.sample(_IOI_NAMES, 2)
            items.append(
                Prompt(
                    template.format(A=a, B=b, S=b),
                    f" {a}",
                    template.format(A=a, B=b, S=a),
                    f" {b}",
                    category,
                )
            )
    return PromptSet(items, "ioi")


def _mixed() -> PromptSet:
    return PromptSet((Prompt(text, "", category=kind) for text, kind in mixed_items()), "mixed")


#: Built-in prompt sets by name; each maker returns a fresh ``PromptSet``.
PROMPT_SETS: dict[str, Callable[[], PromptSet]] = {
    "factual": _factual,
    "ioi": _ioi,
    "mixed": _mixed,
}


def prompts(name: str = "factual") -> PromptSet:
    """A built-in prompt set: ``"factual"`` (85 clean/corrupt factual-recall pairs),
    ``"ioi"`` (60 indirect-object pairs from 5 templates: clean answer = the indirect object,
    corrupt = the subject swapped, so its answer is the other name) or
    ``"mixed"`` (320 short texts of 8 kinds: narrative, arithmetic, code, dialogue, facts,
    lists, instructions, to-dos; empty targets, for clustering and block masks)."""
    if name not in PROMPT_SETS:
        raise ValueError(
            f"Unknown prompt set {name!r}; available: {sorted(PROMPT_SETS)} "
            f"(tasks for head gating: lsc.data.task(...))."
        )
    return PROMPT_SETS[name]()


TASK_SPLITS = ("train", "validation", "all")


def task(
    name: str, *, split: str = "train", validation_fraction: float = 0.2, seed: int = 0
) -> PromptSet:
    """A built-in one-shot task: ``"math"`` (arithmetic) or ``"syntax"`` (plural, past
    tense, agreement, questions). Targets may span several tokens.

    Args:
        split: "train", "validation" or "all"; the split is a seeded shuffle.
        validation_fraction: share of items held out for validation.
        seed: seeds the shuffle.
    """
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; available: {sorted(TASKS)}.")
    if split not in TASK_SPLITS:
        raise ValueError(f"Unknown split {split!r}; choose one of {list(TASK_SPLITS)}.")
    items = [Prompt(text, target, category=category) for text, target, category in TASKS[name]()]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = round(validation_fraction * len(items))
    chosen = {"train": order[n_val:], "validation": order[:n_val], "all": order}[split]
    return PromptSet([items[i] for i in sorted(chosen)], name=f"{name}:{split}")
