"""Built-in prompt sets and tasks."""

from __future__ import annotations

import collections

import pytest

import lenscape as lsc
from lenscape.data import Prompt


def test_factual_set_shape(factual):
    assert len(factual) >= 40
    counts = collections.Counter(factual.categories)
    assert len(counts) >= 4 and min(counts.values()) >= 5
    assert len(set(factual.texts)) == len(factual)
    for p in factual:
        assert p.corrupt and p.distractor and p.target != p.distractor
        assert p.target.startswith(" ") and p.distractor.startswith(" ")


@pytest.mark.slow
def test_factual_pairs_tokenize_as_required(tokenizer, factual):
    for i, p in enumerate(factual):
        for answer in (p.target, p.distractor):
            assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) == 1, (i, answer)
        assert len(tokenizer(p.text)["input_ids"]) == len(tokenizer(p.corrupt)["input_ids"]), i


def test_prompt_set_slicing_and_records():
    ps = lsc.data.from_records([{"text": "a", "target": " b"}, Prompt("c", " d", category="x")],
                               name="mine")
    assert ps.name == "mine" and ps[1:].texts == ["c"] and ps.categories == ["", "x"]
    with pytest.raises(ValueError, match="'text' and 'target'"):
        lsc.data.from_records([{"text": "a"}])
    with pytest.raises(ValueError, match="unknown keys"):
        lsc.data.from_records([{"text": "a", "target": " b", "answer": "c"}])


def test_unknown_set_and_task():
    with pytest.raises(ValueError, match="Unknown prompt set 'poetry'; available"):
        lsc.data.prompts("poetry")
    with pytest.raises(ValueError, match="Unknown task"):
        lsc.data.task("chess")
    with pytest.raises(ValueError, match="Unknown split"):
        lsc.data.task("math", split="test")


@pytest.mark.parametrize("name, kinds", [("math", {"addition", "subtraction", "multiplication"}),
                                         ("syntax", {"plural", "past_tense", "agreement",
                                                     "question"})])
def test_tasks_split_and_answers(name, kinds):
    train, val = lsc.data.task(name), lsc.data.task(name, split="validation")
    everything = lsc.data.task(name, split="all")
    assert len(everything) >= 300 and set(everything.categories) == kinds
    assert len(train) + len(val) == len(everything)
    assert not set(zip(train.texts, (p.target for p in train))) & set(
        zip(val.texts, (p.target for p in val)))
    for p in everything:
        assert p.target.strip() and p.target.startswith(" ")
    if name == "math":
        p = next(p for p in everything if p.category == "addition")
        a, b = p.text.splitlines()[-1].rstrip(" =").split(" + ")
        assert int(p.target) == int(a) + int(b)
