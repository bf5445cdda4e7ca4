"""Named spans of a prompt: character ranges of its text that line prompts up by meaning.

A span is a name and a character range ``(start, end)`` of a prompt's text, end exclusive
("IO", "S2", "subject", "END" ...). Prompts of different token lengths are compared span by
span instead of token index by token index: position 7 of one IOI prompt may hold the
second subject and of another the verb, but the span "S2" is the second subject in both.

A span can be given as offsets, as a substring (its first occurrence) or as a substring and
the occurrence wanted, counted from 1 (``("John", 2)``: the second "John"); ``resolve``
turns any of these into offsets and checks them. Which *tokens* a span holds is decided
later, against a tokenizer (``lenscape.sweep.inputs``): a token belongs to a span when
their character ranges overlap, and tokens in no named span form the span ``OTHER``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

#: The span of the tokens in no named span (a prompt's BOS, the words between spans); the
#: name is reserved.
OTHER = "other"
#: What a span may be given as: offsets, a substring, or a substring and its occurrence.
SpanSpec = tuple[int, int] | str | tuple[str, int]
_EXAMPLE = "e.g. spans={'IO': (5, 9)}, {'IO': 'Mary'} or {'S2': ('John', 2)}"


def find_span(text: str, substring: str, occurrence: int = 1) -> tuple[int, int]:
    """The character range ``(start, end)`` of the ``occurrence``-th ``substring`` of
    ``text`` (counted from 1), end exclusive.

    Raises:
        ValueError: an empty substring, an occurrence below 1, or fewer occurrences in
            ``text`` than asked for.
    """
    if not isinstance(substring, str) or not substring:
        raise ValueError(f"A span's substring must be a non-empty string, got {substring!r}.")
    if isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 1:
        raise ValueError(
            f"A span's occurrence counts from 1 (the first {substring!r}), got {occurrence!r}."
        )
    starts = [m.start() for m in re.finditer(re.escape(substring), text)]
    if len(starts) < occurrence:
        raise ValueError(
            f"{substring!r} occurs {len(starts)} time(s) in {text!r}, so it has no occurrence "
            f"{occurrence}; name a substring of the text ({_EXAMPLE})."
        )
    return starts[occurrence - 1], starts[occurrence - 1] + len(substring)


def _offsets(name: str, spec: Any, text: str, what: str) -> tuple[int, int]:
    """One span given in any accepted form, as checked offsets into ``text``."""
    if isinstance(spec, str):
        return find_span(text, spec)
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        first, second = spec
        if isinstance(first, str) and isinstance(second, int) and not isinstance(second, bool):
            return find_span(text, first, second)
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in spec)
        if whole:
            start, end = int(first), int(second)
            if not 0 <= start < end <= len(text):
                raise ValueError(
                    f"Span {name!r} ({start}, {end}) of the {what} lies outside it or is empty: "
                    f"offsets need 0 <= start < end <= {len(text)} (end exclusive) for "
                    f"{text!r}."
                )
            return start, end
    raise ValueError(
        f"Span {name!r} of the {what} must be (start, end) offsets, a substring or "
        f"(substring, occurrence), got {spec!r}; {_EXAMPLE}."
    )


def resolve(spans: Any, text: str, *, what: str = "text") -> dict[str, tuple[int, int]]:
    """``spans`` (name -> ``SpanSpec``) as offsets into ``text``, in the order they start
    (prompt order).

    Raises:
        TypeError: ``spans`` that is not a mapping.
        ValueError: a name that is empty, not a string or the reserved ``OTHER``; a span
            outside the text, empty or not found; two spans that overlap.
    """
    if not isinstance(spans, Mapping):
        raise TypeError(
            f"spans must map names to character ranges of the {what}, got "
            f"{type(spans).__name__} {spans!r:.80}; {_EXAMPLE}."
        )
    resolved = {}
    for name, spec in spans.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"Span names must be non-empty strings, got {name!r}; {_EXAMPLE}.")
        if name == OTHER:
            raise ValueError(
                f"The span name {OTHER!r} is reserved for the tokens in no named span; "
                "choose another name."
            )
        resolved[name] = _offsets(name, spec, text, what)
    ordered = dict(sorted(resolved.items(), key=lambda item: item[1]))
    names = list(ordered)
    for before, after in itertools.pairwise(names):
        if ordered[after][0] < ordered[before][1]:
            raise ValueError(
                f"Spans {before!r} {ordered[before]} and {after!r} {ordered[after]} of the "
                f"{what} overlap ({text[ordered[after][0] : ordered[before][1]]!r} is in "
                "both); a character belongs to at most one span."
            )
    return ordered


def end_span(text: str) -> tuple[int, int]:
    """The range of ``text``'s last word (without the space before it): the ``END`` span,
    where a next-token prompt is read."""
    match = re.search(r"\S+\s*$", text)
    assert match is not None  # prompts are never empty (``Prompt`` refuses it)
    return match.start(), match.start() + len(match.group().rstrip())


def differing_words(text: str, other: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The words where two texts differ, as ranges of each: what lies between their
    longest common prefix and suffix of whole words (the subject of a factual pair whose
    corrupt text swaps it), or None when the texts hold the same words."""
    words, others = list(re.finditer(r"\S+", text)), list(re.finditer(r"\S+", other))
    head = 0
    while head < min(len(words), len(others)) and words[head][0] == others[head][0]:
        head += 1
    tail = 0
    while (
        tail < min(len(words), len(others)) - head and words[-1 - tail][0] == others[-1 - tail][0]
    ):
        tail += 1
    if head + tail >= min(len(words), len(others)):
        return None
    first = words[head].start(), words[len(words) - 1 - tail].end()
    second = others[head].start(), others[len(others) - 1 - tail].end()
    return first, second
