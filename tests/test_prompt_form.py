"""PromptForm (views/prompt_form.py): typed prompts are scored and shown, bad ones explained."""

import numpy as np
import pytest
from _helpers import ATTRS

from lenscape import schema
from lenscape.views.prompt_form import PromptForm

#: One prompt's scores over (layer 2, head 2).
SIGNED = np.random.default_rng(1).normal(size=(1, 2, 2))


def scored(record, scale=1.0):
    """What a capture call returns for one record: (prompt 1, layer 2, head 2), its text."""
    return schema.make(
        SIGNED * scale,
        dims=("prompt", "layer", "head"),
        coords={"text": [record["text"]]},
        attrs=ATTRS,
        n_layers=2,
    )


def test_prompt_form_scores_valid_prompts_and_explains_bad_ones():
    def run(record):
        if len(record["text"].split()) != len((record["corrupt"] or record["text"]).split()):
            raise ValueError("clean and corrupt differ in length; reword the corrupt text.")
        return scored(record, scale=len(record["text"]))

    form = PromptForm(
        run, example={"text": "a b c", "target": " d", "corrupt": "e f g", "distractor": " h"}
    )
    chart_widget, first = form.explorer._chart, form.explorer.chart
    assert form.fields["text"].value == "a b c" and form.fields["distractor"].value == " h"
    form.fields["corrupt"].value = "too short"
    assert form.submit() is False
    assert "differ in length" in form.message.value and form.explorer.chart is first
    form.fields["corrupt"].value = ""
    form.fields["text"].value = "one two three four"
    assert form.record()["corrupt"] is None
    assert form.submit() is False  # the metric needs the corrupt text: never "optional"
    assert "the corrupt box is empty, and the metric compares" in form.message.value
    form.needs_corrupt = False
    assert form.submit() is True and form.message.value == ""
    assert form.explorer._chart is chart_widget and form.explorer.chart is not first
    assert form.explorer.controls["prompt"].options[-1][0] == "0: one two three four"


def test_prompt_form_shows_the_targets_spaces_and_names_no_record_index():
    def run(record):
        if record["target"] != " d":
            raise ValueError(f"Prompt 0: target {record['target']!r} is not one token")
        return scored(record)

    form = PromptForm(
        run, example={"text": "a b c", "target": " d", "corrupt": "e f g", "distractor": " h"}
    )
    assert (
        "<code>␣d</code>" in form.target_shown.value and "no leading" not in form.target_shown.value
    )
    form.fields["target"].value = "d"
    assert "<code>d</code> (no leading space" in form.target_shown.value
    assert form.submit() is False
    assert form.message.value.startswith("<span style='color:#b00'>target &#x27;d&#x27; is not one")


def test_prompt_form_refuses_an_example_that_is_not_a_prompt():
    with pytest.raises(TypeError, match=r"example must be a Prompt .* got None"):
        PromptForm(scored, example=None)
    with pytest.raises(TypeError, match=r"example's boxes hold text or None, got \{'text': 5\}"):
        PromptForm(scored, example={"text": 5})
