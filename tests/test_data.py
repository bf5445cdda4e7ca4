"""Built-in prompt sets and tasks."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch

import lenscape as lsc
from lenscape.data import Prompt, from_records
from lenscape.sweep import metrics

PARIS = {"text": "The capital of France is the city of", "target": " Paris", "distractor": " Rome"}


def test_factual_set_shape(factual):
    assert len(factual) >= 40
    counts = collections.Counter(factual.categories)
    assert len(counts) >= 4 and min(counts.values()) >= 5
    assert len(set(factual.texts)) == len(factual)
    for p in factual:
        assert p.corrupt and p.distractor and p.target != p.distractor
        assert p.target.startswith(" ") and p.distractor.startswith(" ")


def _assert_pairs_tokenize_as_required(tokenizer, prompts):
    """Single-token targets and distractors; clean and corrupt texts of equal token length."""
    for i, p in enumerate(prompts):
        for answer in (p.target, p.distractor):
            assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) == 1, (i, answer)
        assert len(tokenizer(p.text)["input_ids"]) == len(tokenizer(p.corrupt)["input_ids"]), i


@pytest.mark.slow
def test_factual_pairs_tokenize_as_required(smol_tokenizer, factual):
    _assert_pairs_tokenize_as_required(smol_tokenizer, factual)


def test_the_test_tokenizer_splits_builtin_texts_as_the_bundled_one(tokenizer, factual):
    """The small tokenizer of the tiny test models (tests/_helpers.py) gives the same pieces
    as SmolLM2's own tokenizer (read by the tokenizers library, not rebuilt) on every
    built-in text, so the prompt sets keep their guarantees on tiny models."""
    import tokenizers
    from _helpers import corpus

    folder = lsc.models.bundled_folder(lsc.models.DEFAULT_MODEL)
    full = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = corpus()
    assert len(texts) > 3000
    for text, expected in zip(texts, full.encode_batch(texts), strict=True):
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
        assert pieces == expected.tokens, text
    assert len(tokenizer) < 2500  # the point of it: about 1,600 instead of 49,152
    _assert_pairs_tokenize_as_required(tokenizer, factual)
    _assert_pairs_tokenize_as_required(tokenizer, lsc.data.prompts("ioi"))
    other = "A quokka paid 5 € for zebra-striped socks 😀"  # words outside the prompt sets
    assert tokenizer.decode(tokenizer(other)["input_ids"]) == other


def test_prompt_set_slicing_and_records():
    ps = lsc.data.from_records(
        [{"text": "a", "target": " b"}, Prompt("c", " d", category="x")], name="mine"
    )
    assert ps.name == "mine" and ps[1:].texts == ["c"] and ps.categories == ["", "x"]
    with pytest.raises(ValueError, match="'text' and 'target'"):
        lsc.data.from_records([{"text": "a"}])
    with pytest.raises(ValueError, match="unknown keys"):
        lsc.data.from_records([{"text": "a", "target": " b", "answer": "c"}])


def test_sample_keeps_every_category_in_proportion():
    math = lsc.data.task("math")
    assert set(math[:64].categories) == {"addition"}  # why a prefix is not a sample
    picked = math.sample(64, seed=3)
    counts = collections.Counter(picked.categories)
    for category, total in collections.Counter(math.categories).items():
        assert abs(counts[category] - 64 * total / len(math)) < 1
    assert len(set(picked.texts)) == 64 and set(picked.texts) <= set(math.texts)
    order = {text: i for i, text in enumerate(math.texts)}
    assert [order[t] for t in picked.texts] == sorted(order[t] for t in picked.texts)
    assert picked.name == math.name and math.sample(64, seed=3).texts == picked.texts
    assert math.sample(64, seed=4).texts != picked.texts
    assert math.sample(len(math)).texts == math.texts
    for bad, error in ((0, ValueError), (len(math) + 1, ValueError), (6.0, TypeError)):
        with pytest.raises(error, match="n must be an integer from 1"):
            math.sample(bad)


@pytest.mark.parametrize("bad", [-1, True, None, 2.0, "3", 2**32])
def test_sample_and_task_seeds_follow_the_one_rule(bad):
    """Issue 43: ``seed=-1`` and ``seed=True`` drew seed 1's sample, ``seed=None`` a new one
    each call, ``seed=np.int64(3)`` failed in the standard library."""
    math = lsc.data.task("math")
    assert math.sample(8, seed=np.int64(3)).texts == math.sample(8, seed=3).texts
    assert lsc.data.task("math", seed=np.int64(3)).texts == lsc.data.task("math", seed=3).texts
    for call in (lambda: math.sample(8, seed=bad), lambda: lsc.data.task("math", seed=bad)):
        with pytest.raises((TypeError, ValueError), match=r"seed must be a whole number from 0"):
            call()
    with pytest.raises((TypeError, ValueError), match=r"seed must be a whole number from 0"):
        lsc.models.tiny("llama", n_layers=1, seed=bad, check=False)


def test_unknown_set_and_task():
    with pytest.raises(ValueError, match="Unknown prompt set 'poetry'; available"):
        lsc.data.prompts("poetry")
    with pytest.raises(ValueError, match="Unknown task"):
        lsc.data.task("chess")
    with pytest.raises(ValueError, match="Unknown split"):
        lsc.data.task("math", split="test")


@pytest.mark.parametrize(
    "name, kinds",
    [
        ("math", {"addition", "subtraction", "multiplication"}),
        ("syntax", {"plural", "past_tense", "agreement", "question"}),
    ],
)
def test_tasks_split_and_answers(name, kinds):
    train, val = lsc.data.task(name), lsc.data.task(name, split="validation")
    everything = lsc.data.task(name, split="all")
    assert len(everything) >= 300 and set(everything.categories) == kinds
    assert len(train) + len(val) == len(everything)
    assert not set(zip(train.texts, (p.target for p in train), strict=True)) & set(
        zip(val.texts, (p.target for p in val), strict=True)
    )
    for p in everything:
        assert p.target.strip() and p.target.startswith(" ")
    if name == "math":
        p = next(p for p in everything if p.category == "addition")
        a, b = p.text.splitlines()[-1].rstrip(" =").split(" + ")
        assert int(p.target) == int(a) + int(b)


def test_ioi_pairs_swap_the_subject():
    ioi = lsc.data.prompts("ioi")
    assert len(ioi) == 60 and len(set(ioi.categories)) == 5
    assert len(set(ioi.texts)) == len(ioi)
    for p in ioi:
        clean_words, corrupt_words = p.text.split(), p.corrupt.split()
        changed = [
            i for i, (a, b) in enumerate(zip(clean_words, corrupt_words, strict=True)) if a != b
        ]
        assert len(changed) == 1  # only the subject of the second clause
        assert p.target.strip() in p.text and p.distractor.strip() in p.text
        assert corrupt_words[changed[0]].rstrip(".,") == p.target.strip()
        assert clean_words[changed[0]].rstrip(".,") == p.distractor.strip()


@pytest.mark.slow
def test_ioi_pairs_tokenize_and_the_model_answers_both_sides(smol):
    ioi = lsc.data.prompts("ioi")
    tokenizer = smol.tokenizer
    for i, p in enumerate(ioi):
        for answer in (p.target, p.distractor):
            assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) == 1, (i, answer)
        assert len(tokenizer(p.text)["input_ids"]) == len(tokenizer(p.corrupt)["input_ids"]), i
    # Each pair's logit difference has the right sign on the clean side and flips on the
    # corrupt side for most prompts (the templates were chosen so it does for all tried). The
    # 120 texts run as one batch per token length (three lengths): no padding, so each row's
    # last-position logits are those of the text run alone.
    texts = [text for p in ioi for text in (p.text, p.corrupt)]
    by_length = collections.defaultdict(list)
    for j, text in enumerate(texts):
        by_length[len(tokenizer(text)["input_ids"])].append(j)
    last = [None] * len(texts)
    with torch.no_grad():
        for rows in by_length.values():
            ids = tokenizer([texts[j] for j in rows], return_tensors="pt")
            assert bool(ids["attention_mask"].all())  # equal lengths: nothing padded
            for j, logits in zip(rows, smol.hf(**ids).logits[:, -1], strict=True):
                last[j] = logits
    correct = 0
    for i, p in enumerate(ioi):
        target = torch.tensor([tokenizer(p.target, add_special_tokens=False)["input_ids"][0]])
        distractor = torch.tensor(
            [tokenizer(p.distractor, add_special_tokens=False)["input_ids"][0]]
        )
        diffs = [
            float(metrics.compute("logit_diff", last[2 * i + side][None], target, distractor))
            for side in (0, 1)  # clean, corrupt
        ]
        correct += diffs[0] > 0 and diffs[1] < 0
    assert correct >= 57, correct


def test_empty_text_is_refused():
    with pytest.raises(ValueError, match="Prompt text '' is empty"):
        Prompt("", " Paris")
    with pytest.raises(ValueError, match="Prompt text '  ' is empty"):
        Prompt("  ", " Paris")
    with pytest.raises(ValueError, match=r"Prompt corrupt '' is empty.*corrupt=None"):
        Prompt("The capital of France is", " Paris", corrupt="")


@pytest.mark.parametrize(
    "field, value",
    [("text", 7), ("target", 5), ("target", None), ("corrupt", 1.0), ("category", None)],
)
def test_field_of_wrong_type_names_the_field(field, value):
    with pytest.raises(TypeError, match=f"Prompt {field} must be a string"):
        Prompt(**{**PARIS, field: value})
    with pytest.raises(TypeError, match=f"Record 0: Prompt {field} must be a string"):
        from_records([{**PARIS, field: value}])


@pytest.mark.parametrize("records", [PARIS, Prompt(**PARIS), "The capital", None])
def test_from_records_wants_a_list(records):
    with pytest.raises(TypeError, match=r"records must be a list of Prompts or dicts.*\[record\]"):
        from_records(records)


# sha256 of the JSON-dumped records of each built-in set, computed from the tables as code
# before they moved to prompt_tables/*.json: the move must not change a single prompt.
FROZEN = {
    ("prompts", "factual"): "4b50b4622d794b3530534c7c8df7bb91522797dcc67348f2740e0583cfb1e7a0",
    ("prompts", "ioi"): "6c604f8b1c4f91cf45e963f30670e8842cd0da1bbcc02013a02bbf3215145fe6",
    ("prompts", "mixed"): "5d5c4842e681ca363ede26981a52a90de9e24fd1fd116bb7a4ac3e6ebfac6c32",
    ("math", "train"): "6fa694c58c722f38fd32528a00dda60b8308a95729f57f4c999df81b1eb8bba2",
    ("math", "validation"): "e20f1af76c90ed3828fc09d5dc99d29d087be77ae1a302c13b9bb2d72e6899d2",
    ("math", "all"): "0d7cd4cf14aefd05192d474ca0de022bf0628fe84764cf197306bfcada02e34f",
    ("syntax", "train"): "a5e6c05fc43ddce5bfd3eb118bfd9678c20ba7927280c7d613ce1a64ee9e92a3",
    ("syntax", "validation"): "784a5a522715191adcc16458a075ce642408612a8fc68de64e9bbb6f74faf263",
    ("syntax", "all"): "f6362c014597ef089eb7a56ee648d9f78543b14b9e506af4fff674711fbbd7cf",
}


@pytest.mark.parametrize(("kind", "name"), list(FROZEN))
def test_builtin_sets_are_the_same_prompts_as_before_the_tables_moved(kind, name):
    prompt_set = lsc.data.prompts(name) if kind == "prompts" else lsc.data.task(kind, split=name)
    # The spans added since (test_built_in_spans_hold_tokens_of_the_bundled_tokenizer) are
    # not part of what must not change.
    records = [
        {k: v for k, v in dataclasses.asdict(p).items() if k not in ("spans", "corrupt_spans")}
        for p in prompt_set
    ]
    assert hashlib.sha256(json.dumps(records).encode()).hexdigest() == FROZEN[kind, name]


@pytest.mark.parametrize("name", ["factual", "ioi", "math", "syntax", "repeated"])
def test_built_in_spans_hold_tokens_of_the_bundled_tokenizer(smol_tokenizer, name):
    """Every span of every built-in prompt holds at least one token of SmolLM2's own
    tokenizer, no token sits in two spans, and a corrupt text's spans sit at the clean
    text's token positions (``positions.span_positions`` raises otherwise)."""
    from lenscape.sweep.positions import span_positions

    prompts = lsc.data.task(name) if name in ("math", "syntax") else lsc.data.prompts(name)
    for i, p in enumerate(prompts):
        clean = smol_tokenizer(p.text)["input_ids"]
        corrupt = None if p.corrupt is None else smol_tokenizer(p.corrupt)["input_ids"]
        held = span_positions(smol_tokenizer, p, i, clean, corrupt)
        assert held is not None and list(held) == list(p.spans)
        assert held["END"][-1] == len(clean) - 1, (i, p.text)  # the last word, read last


def test_repeated_sequences_read_twice_and_their_corrupt_repeat_is_shuffled(smol_tokenizer):
    prompts = lsc.data.prompts("repeated")
    assert len(prompts) == 20 and prompts[0].text == lsc.data.prompts("repeated")[0].text
    for p in prompts:
        words = p.text.split()
        first, second = words[:25], words[25:]
        assert second == first[:24] and p.target == " " + first[24]
        shuffled = p.corrupt.split()[25:]
        assert sorted(shuffled) == sorted(second) and all(
            a != b for a, b in zip(shuffled, second, strict=True)
        )
    _assert_pairs_tokenize_as_required(smol_tokenizer, prompts)
