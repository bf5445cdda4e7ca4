"""Direct logit attribution (``capture/logit.py``): it adds up to the logit difference; it
refuses metrics that are not linear in the logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import answered_prompts, reference_correct

import lenscape as lsc


def test_dla_adds_up_to_the_logit_difference(tiny_llama, factual):
    """Blocks' DLA + the embedding's own direct term == logit difference (frozen final norm)."""
    model, prompts = tiny_llama, factual[:4]
    blocks = lsc.direct_logit_attribution(model, prompts, level="block", progress=False)
    heads = lsc.direct_logit_attribution(model, prompts, level="head", progress=False)
    np.testing.assert_allclose(
        heads.sum("head").values, blocks.sel(component="attn").values, atol=1e-4
    )
    hf, final = model.hf, model.hf.model.norm
    for i, p in enumerate(prompts):
        ids = torch.tensor([model.tokenizer(p.text)["input_ids"]])
        seen = {}

        def keep(module, args, seen=seen):
            seen["resid"] = args[0][0, -1].clone()

        handle = final.register_forward_pre_hook(keep)
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        handle.remove()
        embedding = out.hidden_states[0][0, -1]
        t = model.tokenizer(p.target, add_special_tokens=False)["input_ids"][0]
        d = model.tokenizer(p.distractor, add_special_tokens=False)["input_ids"][0]
        direction = hf.lm_head.weight[t] - hf.lm_head.weight[d]
        scale = torch.rsqrt(seen["resid"].pow(2).mean() + final.variance_epsilon)
        embed_term = float((embedding * scale * final.weight * direction).sum())
        logits = out.logits[0, -1]
        assert float(blocks[i].sum()) + embed_term == pytest.approx(
            float(logits[t] - logits[d]), abs=1e-4
        )


def test_dla_rejects_nonlinear_metrics(tiny_llama, factual):
    with pytest.raises(ValueError, match="direct_logit_attribution supports metric"):
        lsc.direct_logit_attribution(tiny_llama, factual[:1], metric="logprob", progress=False)


@pytest.mark.parametrize("backend", ["nnsight", "transformer_lens"])
def test_dla_records_whether_the_model_answers_each_prompt(tiny_llama, factual, backend):
    prompts = answered_prompts(tiny_llama, factual[:7])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()
    dla = lsc.direct_logit_attribution(
        tiny_llama, prompts, batch_size=3, backend=backend, progress=False
    )
    np.testing.assert_array_equal(dla["correct"].values, expected)
