"""Clustering and per-cluster block masks on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import lenscape as lsc
from lenscape import cluster
from lenscape.capture.masks import apply_mask, block_masks, masked_loss


@pytest.fixture(scope="module")
def mixed():
    return lsc.data.prompts("mixed")[::10]  # 32 texts, 4 of each kind


@pytest.fixture(scope="module")
def clusters(mixed):
    return cluster.kmeans(cluster.embed(mixed), 4, prompts=mixed)


def test_embed_and_kmeans(mixed, clusters):
    emb = cluster.embed(mixed)
    assert emb.shape == (32, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1, rtol=1e-5)
    assert clusters.labels.dims == ("prompt",) and "category" in clusters.labels.coords
    assert sorted(set(clusters.labels.values)) == [0, 1, 2, 3]
    np.testing.assert_array_equal(clusters.assign(emb), clusters.labels.values)


def test_kmeans_errors(mixed):
    emb = cluster.embed(mixed[:3])
    with pytest.raises(ValueError, match="k=5 clusters for 3 prompts"):
        cluster.kmeans(emb, 5)
    with pytest.raises(ValueError, match="left cluster"):
        cluster.kmeans(np.repeat(emb[:1], 4, axis=0), 2)


def test_masks_are_deterministic_and_shaped(tiny_llama, mixed, clusters):
    kw = dict(clusters=clusters, steps=3, target_sparsity=0.5, lr=0.5, progress=False)
    a, b = block_masks(tiny_llama, mixed, **kw), block_masks(tiny_llama, mixed, **kw)
    assert a["mask"].dims == ("cluster", "layer", "component")
    assert a["mask"].shape == (4, tiny_llama.spec.n_layers, 2) and a["mask"].dtype == bool
    np.testing.assert_array_equal(a["keep_prob"].values, b["keep_prob"].values)
    np.testing.assert_array_equal(a["mask"].sum(("layer", "component")).values, 3)  # 50% of 6
    c = block_masks(tiny_llama, mixed, **{**kw, "seed": 1})
    assert not np.array_equal(a["keep_prob"].values, c["keep_prob"].values)


def test_skipping_a_block_removes_exactly_its_output(tiny_model, mixed):
    spec = tiny_model.spec
    mask = np.ones((spec.n_layers, 2), dtype=bool)
    mask[1, 1] = False  # skip the MLP of layer 1
    da = xr.DataArray(mask, dims=("layer", "component"),
                      coords={"layer": np.arange(spec.n_layers), "component": ["attn", "mlp"]})
    ids = tiny_model.tokenizer(mixed[0].text, return_tensors="pt")
    with torch.no_grad(), apply_mask(tiny_model, da):
        masked = tiny_model.hf(**ids).logits
    module = (tiny_model.hf.transformer.h[1].mlp if spec.architecture == "gpt2"
              else tiny_model.hf.model.layers[1].mlp)
    handle = module.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    with torch.no_grad():
        zeroed = tiny_model.hf(**ids).logits
    handle.remove()
    torch.testing.assert_close(masked, zeroed)
    full = masked_loss(tiny_model, mixed[:4], torch.ones(1, spec.n_layers, 2))
    assert masked_loss(tiny_model, mixed[:4], da.values[None]).item() != pytest.approx(full.item())


def test_mask_errors(tiny_llama, mixed, clusters):
    with pytest.raises(ValueError, match=r"target_sparsity must lie in \(0, 1\)"):
        block_masks(tiny_llama, mixed, clusters=clusters, target_sparsity=1.0, progress=False)
    with pytest.raises(ValueError, match="pass the prompts that were clustered"):
        block_masks(tiny_llama, mixed[:5], clusters=clusters, progress=False)
    bad = xr.DataArray(np.ones((7, 2)), dims=("layer", "component"),
                       coords={"component": ["attn", "mlp"]})
    with pytest.raises(ValueError, match="needs 3 layers"):
        with apply_mask(tiny_llama, bad):
            pass
