"""Attention patterns: both backends agree, GQA gives query heads, tokens label the axes."""

import json

import numpy as np
import pytest
import torch
from _helpers import answered_prompts, reference_correct

import lenscape as lsc
from lenscape import models
from lenscape.capture.attention import attention_pattern

TEXT = "The capital of France is the city of"


@pytest.fixture(scope="module")
def tiny_gqa(tokenizer):
    return models.tiny("llama", n_layers=2, seed=0, tokenizer=tokenizer)  # 4 heads, 2 KV heads


def test_pattern_dims_tokens_and_rows_that_sum_to_one(tiny_model):
    pattern = attention_pattern(tiny_model, TEXT, layer=1)
    ids = tiny_model.tokenizer(TEXT)["input_ids"]
    assert pattern.dims == ("head", "query_pos", "key_pos")
    assert pattern.shape == (tiny_model.spec.n_heads, len(ids), len(ids))
    assert "".join(pattern["key_token"].values.tolist()) == tiny_model.tokenizer.decode(ids)
    assert pattern["query_token"].dims == ("query_pos",) and int(pattern["layer"]) == 1
    np.testing.assert_allclose(pattern.sum("key_pos"), 1, atol=1e-5)
    upper = np.triu(np.ones((len(ids), len(ids)), bool), 1)
    assert (pattern.values[:, upper] == 0).all()  # causal: no looking ahead
    assert pattern.attrs["method"] == "attention_pattern" and pattern.attrs["text"] == TEXT


def test_backends_agree_and_match_the_hf_eager_weights(tiny_model):
    ours = attention_pattern(tiny_model, TEXT, layer=1)
    theirs = attention_pattern(tiny_model, TEXT, layer=1, backend="transformer_lens")
    np.testing.assert_allclose(ours.values, theirs.values, atol=1e-5)
    ids = torch.tensor([tiny_model.tokenizer(TEXT)["input_ids"]])
    hf = tiny_model.hf
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            expected = hf(ids, output_attentions=True).attentions[1][0]
    finally:
        hf.set_attn_implementation(previous)
    np.testing.assert_allclose(ours.values, expected.numpy(), atol=1e-6)
    assert hf.config._attn_implementation == previous  # eager only for the pass


def test_grouped_query_models_give_one_pattern_per_query_head(tiny_gqa):
    assert tiny_gqa.spec.n_kv_heads < tiny_gqa.spec.n_heads
    pattern = attention_pattern(tiny_gqa, TEXT, layer=0)
    assert pattern.sizes["head"] == tiny_gqa.spec.n_heads
    one = attention_pattern(tiny_gqa, lsc.data.Prompt(TEXT, " Paris"), layer=0, head=3)
    assert one.dims == ("query_pos", "key_pos") and int(one["head"]) == 3
    np.testing.assert_allclose(one.values, pattern.sel(head=3).values)
    assert attention_pattern(tiny_gqa, TEXT, layer=0, head=[1, 2]).sizes["head"] == 2


def test_the_heatmap_labels_ticks_with_tokens(tiny_gqa):
    pattern = attention_pattern(tiny_gqa, TEXT, layer=0, head=0)
    spec = lsc.heatmap(pattern, x="key_pos", y="query_pos").to_dict()
    json.dumps(spec, allow_nan=False)
    assert '" capital"' in spec["encoding"]["x"]["axis"]["labelExpr"]
    assert spec["encoding"]["y"]["title"] == "query_pos (query_token)"
    assert spec["encoding"]["color"]["scale"]["scheme"] == "viridis"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layer": 5}, r"layer=5 is not a layer.*0\.\.1"),
        ({"layer": 0, "head": 4}, r"head=4 is not a query head.*0\.\.3"),
        ({"layer": 0, "backend": "tl"}, "Unknown backend 'tl'"),
    ],
)
def test_bad_layers_heads_and_backends_are_named(tiny_gqa, kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention_pattern(tiny_gqa, TEXT, **kwargs)
    with pytest.raises(ValueError, match="non-empty string"):
        attention_pattern(tiny_gqa, "  ", layer=0)


def test_a_text_longer_than_the_context_is_refused(tiny_gqa):
    """The capture methods refuse it; rotary models would run past their trained positions."""
    limit = tiny_gqa.hf.config.max_position_embeddings
    long_text = " the" * (limit + 10)
    with pytest.raises(ValueError, match=rf"the text is \d+ tokens long, more than the {limit}"):
        attention_pattern(tiny_gqa, long_text, layer=0)


@pytest.mark.parametrize("kwargs", [{"layer": True}, {"layer": 0, "head": False}])
def test_booleans_are_not_layers_or_heads(tiny_gqa, kwargs):
    with pytest.raises(ValueError, match=r"(layer|head)=(True|False) is not a"):
        attention_pattern(tiny_gqa, TEXT, **kwargs)


def test_correct_is_measured_from_the_targets_not_made_up(tiny_llama, factual):
    """Issue 43: given prompts with targets, ``correct`` is the model's answer (its top
    token at the read position is the target), not True for every prompt."""
    prompts = answered_prompts(tiny_llama, factual[:4])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()
    pattern = attention_pattern(tiny_llama, list(prompts), layer=0, batch_size=3, progress=False)
    np.testing.assert_array_equal(pattern["correct"].values, expected)
    assert list(pattern["category"].values) == prompts.categories
    kept = lsc.aggregate.correct_only(pattern)
    assert kept.sizes["prompt"] == expected.sum()
    assert kept.attrs["correct_only"] == f"{expected.sum()} of 4 prompts the model gets right"


def test_texts_without_targets_record_no_correct_and_say_why(tiny_llama):
    pattern = attention_pattern(tiny_llama, [TEXT, "The cat sat"], layer=0, progress=False)
    assert "correct" not in pattern.coords
    assert "no target" in pattern.attrs["correct_note"]
    with pytest.raises(ValueError, match="no target"):
        lsc.aggregate.correct_only(pattern)
    mixed = [lsc.data.Prompt(TEXT, " Paris"), "The cat sat"]
    assert "correct" not in attention_pattern(tiny_llama, mixed, layer=0).coords
