"""Built-in prompt sets: clean/corrupt pairs with single-token targets.

A ``Prompt`` is one measurement unit: a ``text`` whose next token should be ``target``;
optionally a ``corrupt`` text of the same token length whose answer is ``distractor``
(the counterfactual used by activation/attribution patching and the logit difference).
A ``PromptSet`` is an immutable sequence of prompts with a name; its ``text`` and
``category`` become the labels on the ``prompt`` dim of every result. A prompt may name
``spans`` of its text (``spans``: "IO", "S2", "subject", "END" ...), which line prompts of
different lengths up by meaning for ``positions="spans"``; the built-in sets carry them.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, overload

from .. import _validate
from .corpus import mixed_items
from .spans import OTHER as OTHER
from .spans import SpanSpec as SpanSpec
from .spans import differing_words, end_span, resolve
from .spans import find_span as find_span
from .tables import load_table
from .tasks import TASKS


@dataclass(frozen=True)
class Prompt:
    """One clean/corrupt prompt pair.

    Attributes:
        text: the clean prompt, e.g. "The Eiffel Tower is in the city of".
        target: the expected next token, with its leading space, e.g. " Paris".
        corrupt: a counterfactual prompt of the same token length, or None.
        distractor: the corrupt prompt's answer (the logit-difference baseline), or None.
        category: a short label (e.g. "capital", "landmark").
        spans: named character ranges of ``text``, name -> (start, end) (end exclusive),
            in the order they start; given as offsets, a substring (its first occurrence)
            or (substring, occurrence counted from 1), e.g. ``{"IO": "Mary", "S2": ("John",
            2)}``. None: no spans. ``positions="spans"`` reads one cell per span; the name
            ``"other"`` is reserved for the tokens in none.
        corrupt_spans: the same names as ranges of ``corrupt``, when its words sit at other
            characters (they must cover the same token positions as the clean spans:
            patching reads both texts at the same positions). None: the clean spans'
            token positions.
    """

    text: str
    target: str
    corrupt: str | None = None
    distractor: str | None = None
    category: str = ""
    spans: dict[str, tuple[int, int]] | None = field(default=None, hash=False)
    corrupt_spans: dict[str, tuple[int, int]] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        """Refuse fields of the wrong type and empty texts, naming the field.

        Raises:
            TypeError: a field that is not a string (``corrupt``/``distractor``: or None).
            ValueError: an empty (or whitespace-only) ``text`` or ``corrupt``: there would be
                no position to read the target at.
        """
        for text_field in fields(self):
            if text_field.name in ("spans", "corrupt_spans"):
                continue
            value = getattr(self, text_field.name)
            optional = text_field.name in ("corrupt", "distractor")
            if not isinstance(value, str) and not (optional and value is None):
                kind = "a string or None" if optional else "a string"
                raise TypeError(
                    f"Prompt {text_field.name} must be {kind}, got {value!r} "
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
        self._resolve_spans()

    def _resolve_spans(self) -> None:
        """Turn ``spans`` and ``corrupt_spans`` into checked offsets (``spans.resolve``).

        Raises:
            TypeError, ValueError: as ``spans.resolve``; ``corrupt_spans`` without a corrupt
                text or without ``spans``, or naming other spans.
        """
        if self.spans is not None:
            object.__setattr__(self, "spans", resolve(self.spans, self.text))
        if self.corrupt_spans is None:
            return
        if self.corrupt is None or self.spans is None:
            raise ValueError(
                "corrupt_spans are ranges of the corrupt text for the clean text's spans; "
                "give corrupt= and spans= with them, or leave corrupt_spans=None."
            )
        ranges = resolve(self.corrupt_spans, self.corrupt, what="corrupt text")
        if set(ranges) != set(self.spans):
            raise ValueError(
                f"corrupt_spans name {sorted(ranges)} but spans name {sorted(self.spans)}; "
                "give the corrupt text's range of every clean span (same names)."
            )
        object.__setattr__(self, "corrupt_spans", ranges)


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

    def sample(self, n: int, *, seed: int = 0) -> PromptSet:
        """``n`` prompts with every category in proportion to its share (largest
        remainders), drawn within each category by a seeded shuffle, kept in this set's
        order. Take this, not a prefix, for a small subset of a task: the built-in tasks
        list their items kind by kind, so ``task("math")[:64]`` holds additions only.

        Args:
            n: how many prompts, 1 to ``len(self)``.
            seed: seeds the draw (``_validate.seed``: a whole number from 0, numpy
                integers too; the same seed gives the same sample, so None is refused).

        Raises:
            TypeError, ValueError: ``n`` not a whole number from 1 to ``len(self)``, or
                ``seed`` not a seed.
        """
        n = _validate.integer("n", n, low=1, high=len(self))
        seed = _validate.seed("seed", seed)
        by_category: dict[str, list[int]] = {}
        for index, prompt in enumerate(self._prompts):
            by_category.setdefault(prompt.category, []).append(index)
        exact = {cat: n * len(members) / len(self) for cat, members in by_category.items()}
        counts = {cat: int(share) for cat, share in exact.items()}
        by_remainder = sorted(exact, key=lambda cat: counts[cat] - exact[cat])
        for cat in by_remainder[: n - sum(counts.values())]:
            counts[cat] += 1
        rng = random.Random(seed)
        chosen = [i for cat, group in by_category.items() for i in rng.sample(group, counts[cat])]
        return PromptSet([self._prompts[i] for i in sorted(chosen)], name=self.name)

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
    optionally ``corrupt``, ``distractor``, ``category``, ``spans`` and ``corrupt_spans``
    (name -> (start, end) offsets, a substring, or [substring, occurrence]: ``Prompt``).

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


def as_prompt_set(prompts: Prompts, *, name: str = "prompts") -> PromptSet:
    """``prompts`` as a ``PromptSet``: a PromptSet as it is, or a list of Prompts or record
    dicts (``from_records``). What every method taking prompts with targets accepts.

    Args:
        name: the argument's name in error messages (``"validation"``, ``"task"`` ...).

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
            f"{name} must be prompts with targets, not plain strings: use "
            "lsc.data.prompts('factual') or lsc.data.from_records([{'text': ..., "
            "'target': ...}])."
        )
    if isinstance(prompts, (Prompt, dict)) or not isinstance(prompts, Iterable):
        raise TypeError(
            f"{name} must be a PromptSet or a list of Prompts or dicts, got one "
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


# Clean/corrupt pairs written for lenscape (prompt_tables/factual.json). Checked against the
# SmolLM2-135M tokenizer: targets and distractors are single tokens, clean and corrupt texts
# have equal token counts (tests/test_data.py), and the model prefers the right answer on
# both sides.
_FACTUAL_KEYS = ("text", "target", "corrupt", "distractor", "category")


def _factual_spans(text: str, corrupt: str) -> dict[str, Any]:
    """A factual pair's spans: ``subject``, the words its corrupt text swaps (ROME's
    subject), and ``END``, the last word, on both texts."""
    spans: dict[str, Any] = {}
    corrupt_spans: dict[str, Any] = {}
    subject = differing_words(text, corrupt)
    if subject is not None:
        spans["subject"], corrupt_spans["subject"] = subject
    for ranges, words in ((spans, text), (corrupt_spans, corrupt)):
        end = end_span(words)
        if subject is None or end[0] >= ranges["subject"][1]:
            ranges["END"] = end
    if set(spans) != set(corrupt_spans):
        return {"spans": spans}
    return {"spans": spans, "corrupt_spans": corrupt_spans}


def _factual() -> PromptSet:
    records = load_table("factual", keys=_FACTUAL_KEYS)
    return PromptSet(
        (
            Prompt(**record, **_factual_spans(record["text"], record["corrupt"]))
            for record in records
        ),
        "factual",
    )


# Indirect-object identification (IOI; Wang et al. 2022, arXiv 2211.00593): "When Mary and
# John went to the store, John gave a book to" -> " Mary". The corrupt text swaps the
# subject of the second clause to the other name ("..., Mary gave a book to" -> " John"),
# so clean and corrupt differ in one token and their answers are each other's distractor.
# Templates are the ones SmolLM2-135M answers right on both sides for every name pair
# tried (others, e.g. "Friends A and B found a key...", it gets wrong; tests/test_data.py).
# The templates and names (one token with a leading space in the SmolLM2 tokenizer) are in
# prompt_tables/ioi.json.


#: The spans of an IOI prompt, by the template field that fills them: the indirect object
#: (the answer), the first and the second mention of the subject; ``END`` is the last word.
IOI_SPANS = {"A": "IO", "B": "S1", "S": "S2"}


def _filled(template: str, values: dict[str, str]) -> tuple[str, dict[str, tuple[int, int]]]:
    """``template`` with its fields filled from ``values``, and the character range of each
    field's first filling, named by ``IOI_SPANS``, with ``END``."""
    text, spans = "", {}
    for literal, field_name, _, _ in string.Formatter().parse(template):
        text += literal
        if field_name is not None:
            name = IOI_SPANS[field_name]
            if name not in spans:
                spans[name] = (len(text), len(text) + len(values[field_name]))
            text += values[field_name]
    return text, {**spans, "END": end_span(text)}


def _ioi(pairs_per_template: int = 12, seed: int = 0) -> PromptSet:
    table = load_table("ioi", keys=("templates", "names"))
    rng = random.Random(seed)
    items = []
    for category, template in table["templates"].items():
        for _ in range(pairs_per_template):
            a, b = rng.sample(table["names"], 2)
            text, spans = _filled(template, {"A": a, "B": b, "S": b})
            corrupt, corrupt_spans = _filled(template, {"A": a, "B": b, "S": a})
            items.append(
                Prompt(
                    text,
                    f" {a}",
                    corrupt,
                    f" {b}",
                    category,
                    spans=spans,
                    corrupt_spans=corrupt_spans,
                )
            )
    return PromptSet(items, "ioi")


#: Words of ``prompts("repeated")`` per sequence (before the repeat) and sequences.
REPEATED_WORDS, REPEATED_PROMPTS = 25, 20


def _repeated(seed: int = 0) -> PromptSet:
    """Random word sequences read twice: an induction head predicts the second copy from
    the first. Words are drawn (seeded) from the built-in tables' lowercase words, the
    sequence's last word (the target) from the IOI names (one token with a leading space);
    the text stops one word before the end of the repeat. The corrupt text shuffles the
    repeat (no word at its place), so the first copy no longer predicts it, and lengths
    stay the same under any tokenizer; its distractor is another name."""
    corpus = load_table(
        "corpus", keys=("names", "places", "things", "facts", "funcs", "items", "tasks", "verbs")
    )
    lists = load_table("tasks", keys=("nouns", "verbs", "subjects", "adjectives", "pronouns"))
    entries = [corpus[k] for k in ("places", "things", "items", "verbs")]
    entries += [lists[k] for k in ("nouns", "verbs", "adjectives")]
    pool = sorted(
        {word for entry in entries for word in _words(entry) if word.isalpha() and word.islower()}
    )
    names = load_table("ioi", keys=("templates", "names"))["names"]
    rng = random.Random(seed)
    items = []
    for _ in range(REPEATED_PROMPTS):
        words = [*rng.sample(pool, REPEATED_WORDS - 1)]
        answer, other = rng.sample(names, 2)
        sequence = [*words, answer]
        shuffled = words[:]
        while any(a == b for a, b in zip(shuffled, words, strict=True)):
            rng.shuffle(shuffled)
        first = " ".join(sequence)
        text = f"{first} {' '.join(words)}"
        corrupt = f"{first} {' '.join(shuffled)}"
        repeat = len(first) + 1
        spans = {
            "first": (0, len(first)),
            "second": (repeat, text.rindex(" ")),
            "END": end_span(text),
        }
        corrupt_spans = {
            "first": (0, len(first)),
            "second": (repeat, corrupt.rindex(" ")),
            "END": end_span(corrupt),
        }
        items.append(
            Prompt(
                text,
                f" {answer}",
                corrupt,
                f" {other}",
                "repeated",
                spans=spans,
                corrupt_spans=corrupt_spans,
            )
        )
    return PromptSet(items, "repeated")


def _words(value: Any) -> list[str]:
    """Every word of a table entry (strings in nested lists and objects)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, dict):
        return [w for item in value.values() for w in _words(item)]
    return [w for item in value for w in _words(item)]


def _mixed() -> PromptSet:
    return PromptSet((Prompt(text, "", category=kind) for text, kind in mixed_items()), "mixed")


#: Built-in prompt sets by name; each maker returns a fresh ``PromptSet``.
PROMPT_SETS: dict[str, Callable[[], PromptSet]] = {
    "factual": _factual,
    "ioi": _ioi,
    "mixed": _mixed,
    "repeated": _repeated,
}


def prompts(name: str = "factual") -> PromptSet:
    """A built-in prompt set: ``"factual"`` (85 clean/corrupt factual-recall pairs),
    ``"ioi"`` (60 indirect-object pairs from 5 templates: clean answer = the indirect object,
    corrupt = the subject swapped, so its answer is the other name) or
    ``"repeated"`` (20 sequences of 25 random words read twice, the target the next word
    of the repeat, the corrupt text's repeat shuffled: induction heads) or
    ``"mixed"`` (320 short texts of 8 kinds: narrative, arithmetic, code, dialogue, facts,
    lists, instructions, to-dos; empty targets, for clustering and block masks)."""
    if name not in PROMPT_SETS:
        raise ValueError(
            f"Unknown prompt set {name!r}; available: {sorted(PROMPT_SETS)} "
            f"(tasks for head gating: lsc.data.task(...))."
        )
    return PROMPT_SETS[name]()


TASK_SPLITS = ("train", "validation", "all")


def _task_spans(text: str) -> dict[str, tuple[int, int]]:
    """A task item's spans: ``END``, its last word, and for arithmetic (a last line
    "c op d =") the operands ``A`` and ``B`` of that line."""
    line_start = text.rfind("\n") + 1
    operands = re.fullmatch(r"(\d+) \S (\d+) =", text[line_start:])
    if operands is None:
        return {"END": end_span(text)}
    return {
        "A": (line_start + operands.start(1), line_start + operands.end(1)),
        "B": (line_start + operands.start(2), line_start + operands.end(2)),
        "END": end_span(text),
    }


def task(
    name: str, *, split: str = "train", validation_fraction: float = 0.2, seed: int = 0
) -> PromptSet:
    """A built-in one-shot task: ``"math"`` (arithmetic) or ``"syntax"`` (plural, past
    tense, agreement, questions). Targets may span several tokens.

    Args:
        split: "train", "validation" or "all"; the split is a seeded shuffle.
        validation_fraction: share of items held out for validation.
        seed: seeds the shuffle (a whole number from 0, ``_validate.seed``).

    Raises:
        TypeError, ValueError: an unknown task or split, a ``validation_fraction``
            outside [0, 1], or ``seed`` not a seed.
    """
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; available: {sorted(TASKS)}.")
    if split not in TASK_SPLITS:
        raise ValueError(f"Unknown split {split!r}; choose one of {list(TASK_SPLITS)}.")
    fraction = _validate.number("validation_fraction", validation_fraction, low=0, high=1)
    seed = _validate.seed("seed", seed)
    items = [
        Prompt(text, target, category=category, spans=_task_spans(text))
        for text, target, category in TASKS[name]()
    ]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = round(fraction * len(items))
    chosen = {"train": order[n_val:], "validation": order[:n_val], "all": order}[split]
    return PromptSet([items[i] for i in sorted(chosen)], name=f"{name}:{split}")
