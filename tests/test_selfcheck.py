"""The layout self-check: small residuals on correct layouts, a named failure on wrong ones."""

from __future__ import annotations

import dataclasses

import pytest

import lenscape as lsc
from lenscape import models


@pytest.fixture(scope="module")
def tiny_gemma2(tokenizer):
    return models.tiny("gemma2", tokenizer=tokenizer)


def rewired(model, **changes):
    """The same HF model wrapped with a deliberately changed layout, checked on wrap."""
    layout = dataclasses.replace(model.spec.layout, **changes)
    return models.from_hf(model.hf, model.tokenizer, name=model.name, layout=layout)


def test_check_returns_small_residuals(tiny_model):
    result = lsc.check(tiny_model)
    n_layers = tiny_model.spec.n_layers
    assert result["heads"].dims == ("layer",) and result.sizes["layer"] == n_layers
    assert result.attrs["passed"] and result.attrs["tolerance"] == 1e-4
    for name in ("heads", "residual", "logits"):
        assert float(result[name].max()) < 1e-5, name


@pytest.mark.parametrize(
    "changes, identity, where",
    [
        ({"o_proj": "self_attn.q_proj"}, "heads", "at layer 0"),
        ({"mlp_out": "post_attention_layernorm"}, "residual", "at layer 0"),
        ({"unembed": "model.embed_tokens"}, "logits", "at the output"),
        ({"layer_norm": True}, "logits", "at the output"),
    ],
)
def test_check_catches_a_wrong_layout(tiny_llama, changes, identity, where):
    with pytest.raises(lsc.LayoutCheckError, match=f"'{identity}'.* is off by .*{where}"):
        rewired(tiny_llama, **changes)


def test_check_catches_a_missing_norm_offset(tiny_gemma2):
    # Gemma's RMSNorm multiplies by (1 + weight); without the offset the post-attention
    # norm, and with it the per-head outputs, come out wrong.
    with pytest.raises(lsc.LayoutCheckError, match=r"'heads'.*layer 0"):
        rewired(tiny_gemma2, norm_offset=0.0)
    # Read as Llama, Gemma's block outputs miss their sandwich norms.
    with pytest.raises(lsc.LayoutCheckError, match=r"'residual'.*layer 0"):
        models.from_hf(tiny_gemma2.hf, tiny_gemma2.tokenizer, layout="llama")


def test_check_names_a_module_that_does_not_exist(tiny_llama):
    with pytest.raises(lsc.LayoutCheckError, match=r"'model\.layers\.0\.self_attn\.out_proj'"):
        rewired(tiny_llama, o_proj="self_attn.out_proj")


def test_check_without_strict_returns_the_failure(tiny_llama):
    wrong = dataclasses.replace(tiny_llama.spec.layout, mlp_out="post_attention_layernorm")
    model = models.from_hf(tiny_llama.hf, tiny_llama.tokenizer, layout=wrong, check=False)
    result = lsc.check(model, strict=False)
    assert not result.attrs["passed"]
    assert float(result["residual"].min()) > 1e-2 and float(result["heads"].max()) < 1e-5


def test_check_in_bfloat16(tokenizer):
    model = models.tiny("llama", tokenizer=tokenizer, check=False)
    low = models.from_hf(model.hf, tokenizer, dtype="bfloat16")
    result = lsc.check(low)
    assert result.attrs["dtype"] == "bfloat16" and result.attrs["tolerance"] == 5e-2
