"""``capture_to`` (``capture/to_store.py``): which methods and options it takes, checked
before the store is touched. What streaming does with the store is in test_streaming.py."""

from __future__ import annotations

import pytest

import lenscape as lsc


def test_what_cannot_be_streamed_is_named(tiny_llama, factual, tmp_path):
    with pytest.raises(ValueError, match="cannot stream 'head_gating'"):
        lsc.capture_to(tmp_path / "g.zarr", lsc.head_gating, tiny_llama, factual[:2])
    with pytest.raises(ValueError, match=r"ablation has no option\(s\) \['levle'\]"):
        lsc.capture_to(tmp_path / "o.zarr", "ablation", tiny_llama, factual[:2], levle="block")
    with pytest.raises(ValueError, match="pass store="):
        lsc.ablation(tiny_llama, factual[:2], client=object(), progress=False)
    assert not list(tmp_path.iterdir())


def test_capture_to_checks_options_before_the_store(tiny_llama, factual, tmp_path):
    with pytest.raises(TypeError, match="variants_per_pass must be a positive integer"):
        lsc.capture_to(
            tmp_path / "r.zarr",
            "ablation",
            tiny_llama,
            factual[:2],
            variants_per_pass=1.5,
            progress=False,
        )
    with pytest.raises(TypeError, match="store must be a file path"):
        lsc.capture_to(3, "ablation", tiny_llama, factual[:2], progress=False)
    assert not list(tmp_path.iterdir())
