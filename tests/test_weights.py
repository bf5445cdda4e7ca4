"""Weight importance and change maps, and the weight grid across models
(``weights/maps.py``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import xarray as xr

import lenscape as lsc
from lenscape import models


def test_change_with_itself_is_zero_and_one_perturbation_shows(tiny_model):
    same = lsc.weight_change(tiny_model, tiny_model)
    assert float(np.nansum(np.abs(same["per_layer"].values))) == 0
    assert float(np.nansum(np.abs(same["model_level"].values))) == 0
    other = copy.copy(tiny_model)
    other.hf = copy.deepcopy(tiny_model.hf)
    path = other.spec.layout.weights["up_proj"]
    with torch.no_grad():
        other.hf.get_parameter(f"{other.spec.layout.layers}.1.{path}").add_(0.05)
    for kind in ("relative", "fraction_changed"):
        change = lsc.weight_change(tiny_model, other, kind=kind)["per_layer"]
        nonzero = np.argwhere(np.nan_to_num(change.values) != 0)
        assert nonzero.tolist() == [[1, list(change["component"].values).index("up_proj")]]


def test_relative_change_of_a_tensor_that_was_all_zero(tiny_llama):
    base = copy.copy(tiny_llama)
    base.hf = copy.deepcopy(tiny_llama.hf)
    path = base.spec.layout.weights["up_proj"]
    weight = base.hf.get_parameter(f"{base.spec.layout.layers}.1.{path}")
    with torch.no_grad():
        weight.zero_()
    unchanged = lsc.weight_change(base, base)
    assert float(unchanged["per_layer"].sel(layer=1, component="up_proj")) == 0
    assert "undefined" not in unchanged["per_layer"].attrs
    tuned = copy.copy(base)
    tuned.hf = copy.deepcopy(base.hf)
    with torch.no_grad():
        tuned.hf.get_parameter(f"{base.spec.layout.layers}.1.{path}").add_(0.1)
    change = lsc.weight_change(base, tuned)
    assert np.isnan(float(change["per_layer"].sel(layer=1, component="up_proj")))
    assert "layer 1 up_proj" in change["per_layer"].attrs["undefined"]
    assert not np.isinf(change["per_layer"].values).any()
    fraction = lsc.weight_change(base, tuned, kind="fraction_changed")
    assert float(fraction["per_layer"].sel(layer=1, component="up_proj")) == 1.0


def test_gpt2_qkv_split(tokenizer):
    base = models.tiny("gpt2", tokenizer=tokenizer)
    other = copy.copy(base)
    other.hf = copy.deepcopy(base.hf)
    with torch.no_grad():  # perturb only the k columns of the fused c_attn
        other.hf.transformer.h[0].attn.c_attn.weight[:, 64:128] += 0.1
    change = lsc.weight_change(base, other)["per_layer"].sel(layer=0)
    assert float(change.sel(component="k_proj")) > 0
    assert float(change.sel(component="q_proj")) == 0 == float(change.sel(component="v_proj"))


def test_importance_matches_hand_autograd(tiny_llama, factual):
    prompts = factual[:3]
    hf, tok = tiny_llama.hf, tiny_llama.tokenizer
    weight = hf.model.layers[1].mlp.down_proj.weight
    weight.requires_grad_(True)
    batch = tok([p.text + p.target for p in prompts], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    (grad,) = torch.autograd.grad(hf(**batch, labels=labels).loss, [weight])
    weight.requires_grad_(False)
    entries = (weight * grad).abs()
    kw = dict(batch_size=3, progress=False)
    cell = dict(layer=1, component="down_proj")
    total = lsc.weight_importance(tiny_llama, prompts, **kw)  # default: sum over entries
    assert total.attrs["aggregation"] == "sum"
    assert float(total["per_layer"].sel(cell)) == pytest.approx(float(entries.sum()), rel=1e-4)
    mean = lsc.weight_importance(tiny_llama, prompts, aggregation="mean", **kw)
    assert float(mean["per_layer"].sel(cell)) == pytest.approx(float(entries.mean()), rel=1e-4)
    assert not any(p.requires_grad for p in hf.parameters())  # frozen again
    share = lsc.weight_importance(tiny_llama, prompts, aggregation="share", **kw)
    whole = sum(float(np.nansum(total[v].values)) for v in total.data_vars)
    assert float(share["per_layer"].sel(cell)) == pytest.approx(
        float(entries.sum()) / whole, rel=1e-4
    )
    fisher = lsc.weight_importance(tiny_llama, prompts, kind="fisher", aggregation="mean", **kw)
    assert float(fisher["per_layer"].sel(cell)) == pytest.approx(
        float(grad.pow(2).mean()), rel=1e-4
    )
    normed = lsc.weight_importance(tiny_llama, prompts, normalize=True, **kw)
    values = np.concatenate([normed[v].values.ravel() for v in normed.data_vars])
    assert np.nanmin(values) == 0 and np.nanmax(values) == 1


def test_sum_and_mean_rank_tensors_differently(tiny_llama, factual):
    """The per-entry mean favours small tensors: a norm weight ranks higher under the mean
    than under the sum, relative to the largest MLP matrix."""
    kw = dict(batch_size=3, progress=False)
    ranks = {}
    for aggregation in ("sum", "mean"):
        cells = lsc.weight_importance(tiny_llama, factual[:3], aggregation=aggregation, **kw)[
            "per_layer"
        ].sel(layer=1)
        ranks[aggregation] = float(
            cells.sel(component="input_layernorm") / cells.sel(component="down_proj")
        )
    assert ranks["mean"] > 10 * ranks["sum"]


def _data_rows(spec: dict) -> int:
    """Number of inline data rows in a chart spec (Altair gathers them under ``datasets``)."""
    return sum(len(rows) for rows in spec.get("datasets", {}).values())


def test_weight_grid_draws_only_what_each_model_has(tokenizer, factual):
    maps = {
        name: lsc.weight_importance(
            models.tiny(arch, n_layers=n, tokenizer=tokenizer), factual[:2], progress=False
        )
        for name, arch, n in (("llama", "llama", 3), ("qwen3", "qwen3", 2))
    }
    grid = lsc.weight_grid(maps)
    assert grid.dims == ("model", "layer", "component") and grid.sizes["layer"] == 3
    assert list(grid["component"].values)[-1] == "lm_head"
    drawn = grid["drawn"].notnull()
    for name in maps:
        values = grid.sel(model=name).where(drawn.sel(model=name))
        assert float(values.min()) == 0 and float(values.max()) == 1
    assert not bool(drawn.sel(model="llama", component="q_norm").any())  # llama has none
    assert bool(drawn.sel(model="qwen3", component="q_norm", layer=[0, 1]).all())
    assert not bool(drawn.sel(model="qwen3", layer=2).any())  # past the shallower model
    lm_head = drawn.sel(component="lm_head")
    assert lm_head.sel(model="llama").values.tolist() == [False, False, True]
    chart = lsc.heatmap(grid, x="component", y="layer", facet_col="model", independent=True)
    assert _data_rows(chart.to_dict()) == int(drawn.sum())
    with pytest.raises(ValueError, match="No weight maps"):
        lsc.weight_grid({})
    # Read by label: a sortby or transpose of a map draws the same grid.
    moved = {
        **maps,
        "llama": maps["llama"].sortby("layer", ascending=False).transpose("component", "layer"),
    }
    xr.testing.assert_identical(lsc.weight_grid(moved), grid)
    with pytest.raises(ValueError, match=r"maps\['llama'\] is a result of 'head_gating'"):
        lsc.weight_grid({**maps, "llama": maps["llama"].assign_attrs(method="head_gating")})
    with pytest.raises(ValueError, match=r"maps\['qwen3'\]'s 'layer' labels do not match"):
        lsc.weight_grid({**maps, "qwen3": maps["qwen3"].assign_coords(layer=[0, 5])})
    with pytest.raises(TypeError, match=r"maps must be a dict \{model name: weight map\}"):
        lsc.weight_grid([maps["llama"]])


def test_tied_embeddings_reported_once(tokenizer):
    """A tiny Llama whose unembedding is its embedding (as in SmolLM2): the shared matrix is
    reported once, under ``embed``; ``lm_head`` is NaN (not computed), never a second 0."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    tied = models.from_hf(transformers.LlamaForCausalLM(config), tokenizer, device="cpu")
    assert tied.hf.lm_head.weight is tied.hf.model.embed_tokens.weight
    same = lsc.weight_change(tied, tied)
    assert same.attrs["tied_embeddings"]
    assert np.isnan(float(same["model_level"].sel(component="lm_head")))
    assert float(same["model_level"].sel(component="embed")) == 0
    other = copy.copy(tied)
    other.hf = copy.deepcopy(tied.hf)
    with torch.no_grad():
        other.hf.model.embed_tokens.weight.add_(0.01)
    changed = lsc.weight_change(tied, other)["model_level"]
    assert float(changed.sel(component="embed")) > 0
    assert np.isnan(float(changed.sel(component="lm_head")))


def test_errors(tiny_llama, tokenizer, factual):
    with pytest.raises(ValueError, match="Unknown importance kind"):
        lsc.weight_importance(tiny_llama, factual[:1], kind="taylor", progress=False)
    with pytest.raises(ValueError, match="Unknown aggregation"):
        lsc.weight_importance(tiny_llama, factual[:1], aggregation="max", progress=False)
    with pytest.raises(ValueError, match="prompt list is empty"):
        lsc.weight_importance(tiny_llama, [], progress=False)
    with pytest.raises(ValueError, match="Unknown change kind"):
        lsc.weight_change(tiny_llama, tiny_llama, kind="cosine")
    with pytest.raises(ValueError, match="tol must be a finite number > 0"):
        lsc.weight_change(tiny_llama, tiny_llama, kind="fraction_changed", tol=0)
    with pytest.raises(ValueError, match="differ in architecture"):
        lsc.weight_change(tiny_llama, models.tiny("gpt2", tokenizer=tokenizer))
    wider = models.tiny("llama", n_layers=3, tokenizer=tokenizer)
    wider.hf.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(256, 64))
    with pytest.raises(ValueError, match="Tensor shapes differ at layer 0 up_proj"):
        lsc.weight_change(tiny_llama, wider)
