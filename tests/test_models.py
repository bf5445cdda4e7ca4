"""Model loading, specs and the clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import lenscape as lsc
from lenscape import models


@pytest.mark.parametrize("arch, heads, kv", [("llama", 4, 2), ("qwen3", 4, 2), ("mistral", 4, 2),
                                             ("qwen2", 4, 2), ("gpt2", 4, 4)])
def test_tiny_specs(tokenizer, arch, heads, kv):
    model = models.tiny(arch, n_layers=2, tokenizer=tokenizer)
    spec = model.spec
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads) == (2, heads, kv)
    assert spec.n_heads * spec.d_head == model.module(spec.layout.o_proj, 0).weight.shape[
        0 if arch == "gpt2" else 1]
    for component, path in spec.layout.weights.items():
        assert component in lsc.schema.COMPONENTS
        model.hf.get_parameter(f"{spec.layout.layers}.0.{path}")


def test_tiny_is_seeded(tokenizer):
    a = models.tiny("llama", seed=3, tokenizer=tokenizer).hf.lm_head.weight
    b = models.tiny("llama", seed=3, tokenizer=tokenizer).hf.lm_head.weight
    c = models.tiny("llama", seed=4, tokenizer=tokenizer).hf.lm_head.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_load_local_folder(tmp_path, tokenizer, factual):
    model = models.tiny("qwen3", tokenizer=tokenizer)
    model.hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again = lsc.load(str(tmp_path), device="cpu")
    assert again.spec == model.spec
    np.testing.assert_allclose(
        lsc.ablation(again, factual[:2], progress=False).values,
        lsc.ablation(model, factual[:2], progress=False).values, atol=1e-6)


def test_unknown_bundled_name_is_a_lookup_error():
    with pytest.raises(LookupError, match="Bundled models"):
        models.bundled_folder("gpt-17")


def test_missing_hf_id_offline():
    with pytest.raises(LookupError, match="never downloads weights"):
        lsc.load("no-such-org/no-such-model", device="cpu")


def test_missing_local_folder():
    with pytest.raises(LookupError, match="No model folder"):
        lsc.load("./does/not/exist", device="cpu")


def test_unsupported_architecture(tokenizer):
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    hf = transformers.BertForMaskedLM(config)
    with pytest.raises(ValueError, match="Unsupported architecture 'bert'.*gpt2.*llama"):
        models.from_hf(hf, tokenizer)


def test_encoder_name_is_refused_as_causal_lm():
    with pytest.raises(ValueError, match="sentence encoder"):
        lsc.load("minilm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu(tiny_llama):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        models.resolve_device("cuda")


def test_bad_dtype():
    with pytest.raises(ValueError, match="Unknown dtype"):
        models._resolve_dtype("float17")


@pytest.mark.slow
def test_bundled_model_spec_and_answer(smol):
    spec = smol.spec
    assert (spec.architecture, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.d_head,
            spec.d_model) == ("llama", 30, 9, 3, 64, 576)
    assert spec.tied_embeddings
    ids = smol.tokenizer("The capital of France is the city of", return_tensors="pt")
    with torch.no_grad():
        top = smol.hf(**ids).logits[0, -1].argmax()
    assert smol.tokenizer.decode(top).strip() == "Paris"
