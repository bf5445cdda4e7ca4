"""Fine-tuning a copy: the original stays, runs are deterministic, options are checked."""

from __future__ import annotations

import pytest
import torch

import lenscape as lsc


@pytest.mark.parametrize(
    "option, value, error",
    [
        ("steps", 0, ValueError),
        ("steps", 2.0, TypeError),
        ("steps", 10**9, ValueError),  # above MAX_STEPS: hours, said before the run
        ("batch_size", "4", TypeError),
        ("lr", "1e-4", TypeError),
        ("lr", -1.0, ValueError),
    ],
)
def test_finetune_options(tiny_llama, option, value, error):
    with pytest.raises(error, match=f"{option} must be an? "):
        lsc.finetune(
            tiny_llama, ["The capital of France is Paris."], progress=False, **{option: value}
        )


def test_finetune_text_longer_than_the_context(tiny_llama):
    texts = ["The capital of France is Paris.", "and so on " * 300]
    with pytest.raises(ValueError, match=r"Prompt 1: the text \+ target is \d+ tokens long"):
        lsc.finetune(tiny_llama, texts, steps=1, progress=False)


def test_finetune_copies_and_is_deterministic(tiny_llama, factual, tmp_path):
    before = tiny_llama.hf.lm_head.weight.clone()
    a = lsc.finetune(
        tiny_llama, factual[:8], steps=2, batch_size=2, lr=1e-3, progress=False, out_dir=tmp_path
    )
    b = lsc.finetune(tiny_llama, factual[:8], steps=2, batch_size=2, lr=1e-3, progress=False)
    assert torch.equal(tiny_llama.hf.lm_head.weight, before)
    assert torch.equal(a.hf.lm_head.weight, b.hf.lm_head.weight)
    assert float(lsc.weight_change(tiny_llama, a)["per_layer"].max()) > 0
    assert lsc.load(str(tmp_path), device="cpu").spec == tiny_llama.spec
