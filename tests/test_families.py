"""A family lenscape has no layout for is refused with the way to add one.

What every known family computes is checked against hand computations in
``test_family_matrix.py`` (every method) and ``test_edge_families.py`` (edges).
"""

from __future__ import annotations

import pytest

from lenscape import models


def test_a_family_without_a_layout_says_how_to_add_one(tokenizer):
    import transformers

    config = transformers.FalconConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError, match=r"Unsupported architecture 'falcon'.*layout=lsc\.ArchLayout.*self-check"
    ):
        models.from_hf(hf, tokenizer)
