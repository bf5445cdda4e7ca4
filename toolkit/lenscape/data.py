"""Built-in prompt sets: clean/corrupt pairs with single-token targets.

A ``Prompt`` is one measurement unit: a ``text`` whose next token should be ``target``;
optionally a ``corrupt`` text of the same token length whose answer is ``distractor``
(the counterfactual used by activation/attribution patching and the logit difference).
A ``PromptSet`` is an immutable sequence of prompts with a name; its ``text`` and
``category`` become the labels on the ``prompt`` dim of every result.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload


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
