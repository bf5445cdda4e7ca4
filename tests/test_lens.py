"""Logit lens: the last layer is the model's own softmax, both backends agree, earlier
layers match a plain-hook reference, and bad input is refused with the fix."""

import numpy as np
import pytest
import torch
from _helpers import answered_prompts, reference_correct

import lenscape as lsc
from lenscape import models
from lenscape.capture.lens import logit_lens

TEXT = "The capital of France is the city of"


def hf_probs(model, text):
    """(pos, vocab) softmax of the HF model's own logits over the whole text."""
    ids = torch.tensor([model.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return torch.softmax(model.hf(ids).logits[0].float(), -1)


@pytest.fixture(scope="module")
def tiny_gemma(tokenizer):
    """Gemma 2 shape: (1 + w) norms, post-attention norms, final logit soft-capping."""
    return models.tiny("gemma2", n_layers=2, seed=0, tokenizer=tokenizer)


@pytest.mark.parametrize("backend", ["nnsight", "transformer_lens"])
def test_last_layer_is_the_models_own_softmax(tiny_model, backend):
    lens = logit_lens(tiny_model, lsc.data.Prompt(TEXT, " Paris"), backend=backend)
    probs = hf_probs(tiny_model, TEXT)
    target = tiny_model.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    assert lens.name == "target_prob" and lens.dims == ("layer", "pos")
    assert lens.sizes == {"layer": tiny_model.spec.n_layers, "pos": probs.shape[0]}
    np.testing.assert_allclose(lens.isel(layer=-1).values, probs[:, target].numpy(), atol=1e-4)
    last = lens.isel(layer=-1)
    expected_rank = (probs > probs[:, target, None]).sum(-1).numpy()
    np.testing.assert_array_equal(last["target_rank"].values, expected_rank)
    top = [tiny_model.tokenizer.decode([i]) for i in probs.argmax(-1).tolist()]
    assert last["top_token"].values.tolist() == top


def test_gemma_norms_and_softcapping_are_read_like_the_model(tiny_gemma):
    assert tiny_gemma.hf.config.final_logit_softcapping
    lens = logit_lens(tiny_gemma, TEXT, target=" Paris")
    probs = hf_probs(tiny_gemma, TEXT)
    target = tiny_gemma.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    np.testing.assert_allclose(lens.isel(layer=-1).values, probs[:, target].numpy(), atol=1e-4)


def test_backends_agree_at_every_layer(tiny_model):
    ours = logit_lens(tiny_model, TEXT, target=" Paris")
    theirs = logit_lens(tiny_model, TEXT, target=" Paris", backend="transformer_lens")
    np.testing.assert_allclose(ours.values, theirs.values, atol=1e-5)
    np.testing.assert_array_equal(ours["top_token"].values, theirs["top_token"].values)


def test_earlier_layers_read_each_blocks_output_through_the_final_norm(tiny_llama):
    ids = torch.tensor([tiny_llama.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        hidden = tiny_llama.hf(ids, output_hidden_states=True).hidden_states
        # hidden_states[l + 1] is the output of block l (the last one after the final norm)
        first = tiny_llama.hf.lm_head(tiny_llama.hf.model.norm(hidden[1][0]))
    target = tiny_llama.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    lens = logit_lens(tiny_llama, TEXT, target=" Paris")
    expected = torch.softmax(first.float(), -1)[:, target].numpy()
    np.testing.assert_allclose(lens.sel(layer=0).values, expected, atol=1e-5)
    assert not np.allclose(lens.sel(layer=0).values, lens.isel(layer=-1).values)


def test_labels_top_tokens_and_provenance(tiny_llama):
    record = {"text": TEXT, "target": " Paris"}
    lens = logit_lens(tiny_llama, record)
    ids = tiny_llama.tokenizer(TEXT)["input_ids"]
    assert "".join(lens["token"].values.tolist()) == tiny_llama.tokenizer.decode(ids)
    assert lens["target_rank"].dtype.kind == "i" and (lens["target_rank"] >= 0).all()
    cell = lens.isel(layer=1, pos=-1)
    parts = str(cell["top_tokens"].values).split(" | ")
    assert len(parts) == 5 and parts[0].startswith(repr(str(cell["top_token"].values)))
    shown = [float(part.rsplit(" ", 1)[1]) for part in parts]
    assert shown == sorted(shown, reverse=True)
    if int(cell["target_rank"]) == 0:
        assert abs(shown[0] - float(cell)) < 0.006
    assert lens.attrs["method"] == "logit_lens" and lens.attrs["target"] == " Paris"
    assert lens.attrs["target_source"] == "given" and lens.attrs["units"] == "probability"
    assert lens["depth"].values[-1] == 1.0
    lsc.schema.validate(lens)


def test_plain_text_follows_the_models_own_answer(tiny_llama):
    lens = logit_lens(tiny_llama, TEXT)
    assert lens.attrs["target_source"] == "model's top prediction"
    assert int(lens.isel(layer=-1, pos=-1)["target_rank"]) == 0
    assert lens.attrs["target"] == str(lens.isel(layer=-1, pos=-1)["top_token"].values)


def test_correct_is_recorded_only_where_the_prompts_have_targets(tiny_llama, factual):
    """Issue 43: a text without a target is followed by the model's own prediction, so
    whether the model answers it right is unknown: no ``correct`` coord (``correct_note``
    says why), never True by construction; with targets it is the model's answer."""
    lens = logit_lens(tiny_llama, [TEXT, "The cat sat"], progress=False)
    assert "correct" not in lens.coords and "no target" in lens.attrs["correct_note"]
    with pytest.raises(ValueError, match="no target"):
        lsc.aggregate.correct_only(lens)
    prompts = answered_prompts(tiny_llama, factual[:4])
    given = logit_lens(tiny_llama, prompts, progress=False)
    np.testing.assert_array_equal(given["correct"].values, reference_correct(tiny_llama, prompts))
    assert "correct_note" not in given.attrs


@pytest.mark.parametrize(
    ("prompt", "target", "error", "match"),
    [
        ("   ", None, ValueError, "is empty; give the words"),
        (TEXT, " Paris France", ValueError, "single tokens"),
        (TEXT, "", ValueError, "target '' is empty"),
        (TEXT, 3, TypeError, "target must be a string"),
        (3, None, TypeError, "or a list of them"),
        ([3], None, ValueError, "Record 0"),
        ({"text": TEXT}, None, ValueError, "text"),
    ],
)
def test_bad_input_names_the_fix(tiny_llama, prompt, target, error, match):
    with pytest.raises(error, match=match):
        logit_lens(tiny_llama, prompt, target=target)


def test_a_list_of_prompts_gives_each_its_own_positions(tiny_llama):
    """Several prompts: (prompt, layer, pos), each from position 0 and NaN past its end,
    equal to the one-prompt lens of each (whatever else shares its batch)."""
    texts = [TEXT, "The capital of Italy is", "Rome"]
    many = logit_lens(tiny_llama, texts, target=" Paris", batch_size=2, progress=False)
    assert many.dims == ("prompt", "layer", "pos") and list(many["text"].values) == texts
    for i, text in enumerate(texts):
        one = logit_lens(tiny_llama, text, target=" Paris", progress=False)
        got = many.isel(prompt=i, pos=slice(0, one.sizes["pos"]))
        np.testing.assert_allclose(got.values, one.values, atol=1e-5)
        np.testing.assert_array_equal(got["top_token"].values, one["top_token"].values)
        assert np.isnan(many.isel(prompt=i, pos=slice(one.sizes["pos"], None))).all()
        rest = many["target_rank"].isel(prompt=i, pos=slice(one.sizes["pos"], None))
        assert (rest == -1).all()


def test_text_longer_than_the_context_is_refused(tiny_llama):
    limit = tiny_llama.hf.config.max_position_embeddings
    with pytest.raises(ValueError, match="shorten it"):
        logit_lens(tiny_llama, " the" * (limit + 1), target=" Paris")


def test_unknown_backend_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="choose one of"):
        logit_lens(tiny_llama, TEXT, backend="torch")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["nnsight", "transformer_lens"])
def test_bundled_model_last_layer_and_its_answer(smol, backend):
    text = "The Eiffel Tower is in the city of"
    lens = logit_lens(smol, text, target=" Paris", backend=backend)
    probs = hf_probs(smol, text)
    target = smol.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    np.testing.assert_allclose(lens.isel(layer=-1).values, probs[:, target].numpy(), atol=1e-4)
    answer = lens.isel(layer=-1, pos=-1)
    assert str(answer["top_token"].values) == " Paris" and int(answer["target_rank"]) == 0
    # the answer forms inside the model: early layers do not rank it first yet
    assert int(lens.isel(layer=0, pos=-1)["target_rank"]) > 0
