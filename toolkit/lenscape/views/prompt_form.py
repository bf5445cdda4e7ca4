"""PromptForm: type your own clean/corrupt prompt and see it scored in an Explorer.

Text boxes hold one record (the dict ``lsc.data.from_records`` takes); a ``run`` callback
scores it (e.g. with ``lsc.attribution_patching``) and the form's ``Explorer`` redraws the
same chart in place. Whatever ``run`` rejects is shown under the boxes as a message, and the
previous chart stays.
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as widgets

from lenscape import _validate

from .explorer import Data, Explorer
from .offline import display_with_image, with_image

#: Text boxes of ``PromptForm``: record key -> (label, placeholder).
PROMPT_FIELDS = {
    "text": ("clean", "The Eiffel Tower is located in the city of"),
    "target": ("target", " Paris"),
    "corrupt": ("corrupt", "same token length: The Colosseum is located in the city of"),
    "distractor": ("distractor", " Rome"),
}


def _example_record(example: Any) -> Mapping[str, Any]:
    """``PromptForm``'s ``example`` as a record: a dict of ``PROMPT_FIELDS`` keys to strings
    (or None), or a ``Prompt``, read as one.

    Raises:
        TypeError: neither a dict nor a ``Prompt``, or a box's value that is not text.
    """
    is_prompt = dataclasses.is_dataclass(example) and not isinstance(example, type)
    if not (isinstance(example, Mapping) or is_prompt):
        raise TypeError(
            f"example must be a Prompt (e.g. lsc.data.prompts('factual')[0]) or a record "
            f"such as {{'text': ..., 'target': ...}}, got {example!r} ({type(example).__name__})."
        )
    record = example if isinstance(example, Mapping) else dataclasses.asdict(example)
    odd = {k: v for k, v in record.items() if k in PROMPT_FIELDS and not isinstance(v, str | None)}
    if odd:
        raise TypeError(f"example's boxes hold text or None, got {odd}.")
    return record


class PromptForm:
    """Your own prompt: text boxes for a clean/corrupt pair, scored and shown in an Explorer.

    ``run`` receives a record (the dict ``lsc.data.from_records`` takes) and returns the
    result to show, e.g. ``lambda r: lsc.attribution_patching(model, [r], level="head")``.
    Whatever it rejects (a target that is not one token, clean and corrupt texts of
    different token lengths ...) is shown as a message under the boxes, and the previous
    chart stays; a valid prompt redraws the same chart in place.

    Args:
        run: record -> DataArray or Dataset (the capture call).
        example: the record scored first (a ``Prompt`` or a dict); it fills the boxes.
        needs_corrupt: the metric compares clean with corrupt (``logit_diff``, the default
            of the capture methods): an empty corrupt or distractor box is refused with
            that reason before ``run`` is called. False makes both optional.
        **options: passed to the ``Explorer`` (``x``, ``y``, ``detail`` ...).

    Attributes:
        fields: ``Text`` widget per record key (``text``, ``target``, ``corrupt``,
            ``distractor``).
        explorer: the Explorer showing the latest valid prompt's result.
        widget: the boxes, the run button, the message and the Explorer.
    """

    def __init__(
        self,
        run: Callable[[dict[str, str | None]], Data],
        *,
        example: Any,
        needs_corrupt: bool = True,
        **options: Any,
    ) -> None:
        self.run, self.needs_corrupt = run, _validate.flag("needs_corrupt", needs_corrupt)
        record = _example_record(example)
        self.fields = {
            key: widgets.Text(
                value=record.get(key) or "",
                description=label,
                placeholder=hint,
                continuous_update=False,
                layout={"width": "420px" if key in ("text", "corrupt") else "200px"},
            )
            for key, (label, hint) in PROMPT_FIELDS.items()
        }
        self.button = widgets.Button(
            description="run", icon="play", tooltip="score this prompt and redraw the chart"
        )
        self.message = widgets.HTML()
        self.target_shown = widgets.HTML()  # the target as typed: a leading space is visible
        self.fields["target"].observe(lambda _: self._show_target(), names="value")
        self._show_target()
        self.explorer = Explorer(run(self.record()), **options)
        f = self.fields
        self.widget = widgets.VBox(
            [
                widgets.HBox([f["text"], f["target"], self.target_shown]),
                widgets.HBox([f["corrupt"], f["distractor"]]),
                widgets.HBox([self.button, self.message], layout={"align_items": "center"}),
                self.explorer.widget,
            ]
        )
        self.button.on_click(lambda _: self.submit())

    def record(self) -> dict[str, str | None]:
        """The boxes as a prompt record; empty corrupt/distractor boxes are None."""
        values = {key: box.value for key, box in self.fields.items()}
        return {
            key: value if value or key in ("text", "target") else None
            for key, value in values.items()
        }

    def submit(self) -> bool:
        """Score the boxes' prompt and show it; on bad input show why and keep the chart.

        Returns:
            Whether the prompt was valid and is now shown.
        """
        record = self.record()
        missing = [k for k in ("corrupt", "distractor") if self.needs_corrupt and not record[k]]
        try:
            if missing:
                raise ValueError(
                    f"the {' and '.join(missing)} box{'es are' if len(missing) > 1 else ' is'} "
                    "empty, and the metric compares the clean prompt with the corrupt one: "
                    "fill in a corrupt prompt of the same token length and its answer."
                )
            result = self.run(record)
        except (ValueError, TypeError) as err:
            # one prompt: "Prompt 0:" / "Record 0:" would name an index the form never shows
            text = re.sub(r"^(Record|Prompt) 0: ", "", str(err))
            self.message.value = f"<span style='color:#b00'>{html.escape(text)}</span>"
            return False
        self.message.value = ""
        self.explorer.update(result)
        return True

    def _show_target(self) -> None:
        """Show the target with its spaces visible (a next word starts with one)."""
        target = self.fields["target"].value
        visible = html.escape(target.replace(" ", "␣"))
        hint = "" if target.startswith(" ") else " (no leading space: a next word has one)"
        self.target_shown.value = f"<small>target as typed: <code>{visible}</code>{hint}</small>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return with_image(self.widget._repr_mimebundle_(**kwargs), self.explorer.chart)

    def _ipython_display_(self) -> None:
        display_with_image(self.widget, self.explorer.chart)
