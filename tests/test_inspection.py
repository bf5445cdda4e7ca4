"""Prompt inspector: per-prompt answers, probabilities and metrics, as a Dataset and a table."""

import numpy as np
import pytest
import torch
from _helpers import answered_prompts, reference_correct

import lenscape as lsc
from lenscape.sweep import metrics


@pytest.fixture(scope="module")
def prompts():
    return lsc.data.prompts("factual")[:3]


def test_inspect_tabulates_top_tokens_and_metrics(tiny_llama, prompts):
    report = lsc.inspect_prompts(tiny_llama, prompts, top_k=4)
    ds = report.data
    assert dict(ds.sizes) == {"prompt": 3, "rank": 4}
    assert ds["text"].values.tolist() == prompts.texts
    assert ds["target"].values[0] == " Paris" and ds["distractor"].values[0] == " Rome"
    tok = tiny_llama.tokenizer
    ids = tok(prompts[0].text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = tiny_llama.hf(ids).logits[0, -1]
    probs = torch.softmax(logits, -1)
    top = probs.topk(4)
    assert ds["clean_token"].values[0].tolist() == [tok.decode([i]) for i in top.indices]
    np.testing.assert_allclose(ds["clean_prob"].values[0], top.values.numpy(), rtol=1e-4)
    target, distractor = tok(" Paris")["input_ids"][0], tok(" Rome")["input_ids"][0]
    assert float(ds["target_prob"][0]) == pytest.approx(float(probs[target]), rel=1e-4)
    assert float(ds["clean_metric"][0]) == pytest.approx(
        float(logits[target] - logits[distractor]), abs=1e-4
    )
    assert (np.diff(ds["corrupt_prob"].values, axis=1) <= 0).all()
    assert ds.attrs["metric"] == "logit_diff" and ds.attrs["units"] == metrics.UNITS["logit_diff"]


def test_inspect_shows_as_a_compact_table(tiny_llama, prompts):
    report = lsc.inspect_prompts(tiny_llama, prompts)
    table = report._repr_html_()
    assert table.startswith("<table") and table.count("<tr") == 1 + len(prompts)
    assert "The capital of France is the city of <b>→  Paris</b>" in table
    frame = report.to_dataframe()
    assert list(frame.index) == [0, 1, 2] and frame["clean_top"][0].count(",") == 4
    assert "Paris" in repr(report)


def test_prompts_without_corrupt_texts_show_the_clean_side_only(tiny_llama):
    report = lsc.inspect_prompts(
        tiny_llama, [{"text": "The capital of France is", "target": " Paris"}], metric="logprob"
    )
    assert "corrupt_token" not in report.data and "corrupt" not in report.to_dataframe()
    assert float(report.data["clean_metric"][0]) == pytest.approx(
        np.log(float(report.data["target_prob"][0])), abs=1e-4
    )


def test_bad_options_are_named(tiny_llama, prompts):
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        lsc.inspect_prompts(tiny_llama, prompts, top_k=0)
    with pytest.raises(ValueError, match="Unknown metric"):
        lsc.inspect_prompts(tiny_llama, prompts, metric="accuracy")


def test_inspect_flags_the_prompts_the_model_gets_wrong(tiny_llama):
    prompts = answered_prompts(tiny_llama, lsc.data.prompts("factual")[:5])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()
    report = lsc.inspect_prompts(tiny_llama, prompts)
    np.testing.assert_array_equal(report.data["correct"].values, expected)
    top_is_target = report.data["clean_token"].values[:, 0] == report.data["target"].values
    np.testing.assert_array_equal(report.data["correct"].values, top_is_target)
    table = report._repr_html_()
    assert f"right on {expected.sum()} of 5 prompts" in table
    assert table.count("✗ wrong") == (~expected).sum() and table.count("✓ right") == expected.sum()
    assert report.to_dataframe()["correct"].tolist() == expected.tolist()
