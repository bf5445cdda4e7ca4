"""Per-cluster block masks, routing and the routed/global/random comparison on tiny models
(``fits/masks.py``); clustering itself is in test_cluster.py."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import asdict

import numpy as np
import pytest
import torch
import xarray as xr
from _helpers import TESTS

import lenscape as lsc
from lenscape import cluster
from lenscape.fits import masks as masks_module
from lenscape.fits import optim
from lenscape.fits.masks import apply_mask, block_masks, mask_comparison, masked_loss

FAST = dict(max_steps=3, window=3, lr=0.5, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def learned(tiny_llama, mixed, clusters):
    return block_masks(tiny_llama, mixed, clusters=clusters, target_sparsity=0.5, **FAST)


def test_masks_are_deterministic_and_shaped(tiny_llama, mixed, clusters, learned):
    again = block_masks(tiny_llama, mixed, clusters=clusters, target_sparsity=0.5, **FAST)
    assert learned["mask"].dims == ("cluster", "layer", "component")
    assert learned["mask"].shape == (4, tiny_llama.spec.n_layers, 2)
    assert learned["mask"].dtype == bool
    np.testing.assert_array_equal(learned["keep_prob"].values, again["keep_prob"].values)
    np.testing.assert_array_equal(learned["mask"].sum(("layer", "component")).values, 3)
    assert learned["steps"].dims == ("cluster",) and int(learned["steps"].max()) <= 3
    other = block_masks(
        tiny_llama, mixed, clusters=clusters, target_sparsity=0.5, **{**FAST, "seed": 1}
    )
    assert not np.array_equal(learned["keep_prob"].values, other["keep_prob"].values)


FRESH = f"import sys\nsys.path.insert(0, {TESTS!r})\n" + textwrap.dedent("""
    import json, sys, torch
    import lenscape as lsc
    from lenscape import cluster, models
    from _helpers import small_tokenizer
    model = models.tiny("llama", n_layers=3, seed=0, tokenizer=small_tokenizer())
    texts = lsc.data.prompts("mixed")[::10]
    clusters = cluster.kmeans(cluster.embed(texts), 4, prompts=texts)
    ds = lsc.block_masks(model, texts, clusters=clusters, target_sparsity=0.5, max_steps=3,
                         window=3, lr=0.5, batch_size=2, progress=False)
    print(json.dumps({"keep_prob": ds["keep_prob"].values.tolist(),
                      "mask": ds["mask"].values.tolist()}))
""")


@pytest.mark.slow
def test_two_fresh_processes_give_identical_masks(learned, fresh_runs):
    runs = fresh_runs(FRESH)
    assert runs[0] == runs[1]
    np.testing.assert_array_equal(
        np.array(runs[0]["keep_prob"], dtype=np.float32), learned["keep_prob"].values
    )


def test_sparsities_train_together(tiny_llama, mixed, clusters):
    both = block_masks(tiny_llama, mixed, clusters=clusters, target_sparsity=[1 / 6, 0.5], **FAST)
    assert both["mask"].dims == ("target_sparsity", "cluster", "layer", "component")
    kept = both["mask"].sum(("layer", "component"))
    np.testing.assert_array_equal(kept.sel(target_sparsity=0.5).values, 3)
    np.testing.assert_array_equal(kept.sel(target_sparsity=1 / 6).values, 5)


def test_tolerance_stops_the_fit(tiny_llama, mixed, clusters):
    loose = block_masks(tiny_llama, mixed, clusters=clusters, **{**FAST, "max_steps": 9}, tol=1.0)
    assert loose.attrs["converged"] == 1
    np.testing.assert_array_equal(loose["steps"].values, 3)


def test_kl_to_the_unmasked_model(tiny_llama, mixed, clusters):
    items = masks_module._encode(tiny_llama, mixed[:3])
    spec = tiny_llama.spec
    current = {"scale": torch.ones(3, spec.n_layers, 2)}
    with masks_module._scaled_blocks(tiny_llama, lambda: current["scale"]):
        same = masks_module._row_loss(tiny_llama, items, current, loss="kl")
        current["scale"] = torch.zeros(3, spec.n_layers, 2)
        skipped = masks_module._row_loss(tiny_llama, items, current, loss="kl")
    torch.testing.assert_close(same, torch.zeros(3), atol=1e-5, rtol=0)
    assert (skipped > 1e-4).all()  # a random tiny model predicts near-uniformly
    kl = block_masks(tiny_llama, mixed, clusters=clusters, loss="kl", **FAST)
    assert kl.attrs["loss"] == "kl" and kl["mask"].shape == (4, spec.n_layers, 2)


def test_skipping_a_block_removes_exactly_its_output(tiny_model, mixed):
    spec = tiny_model.spec
    mask = np.ones((spec.n_layers, 2), dtype=bool)
    mask[1, 1] = False  # skip the MLP of layer 1
    da = xr.DataArray(
        mask,
        dims=("layer", "component"),
        coords={"layer": np.arange(spec.n_layers), "component": ["attn", "mlp"]},
    )
    ids = tiny_model.tokenizer(mixed[0].text, return_tensors="pt")
    with torch.no_grad(), apply_mask(tiny_model, da):
        masked = tiny_model.hf(**ids).logits
    module = (
        tiny_model.hf.transformer.h[1].mlp
        if spec.architecture == "gpt2"
        else tiny_model.hf.model.layers[1].mlp
    )
    handle = module.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    with torch.no_grad():
        zeroed = tiny_model.hf(**ids).logits
    handle.remove()
    torch.testing.assert_close(masked, zeroed)
    full = masked_loss(tiny_model, mixed[:4], torch.ones(1, spec.n_layers, 2))
    assert masked_loss(tiny_model, mixed[:4], da.values[None]).item() != pytest.approx(full.item())


def test_routing_runs_each_input_with_its_clusters_mask(tiny_llama, mixed, clusters, learned):
    texts = [mixed[i].text for i in (0, 9, 18, 27)]
    routes = clusters.route(texts)
    batch = tiny_llama.tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad(), apply_mask(tiny_llama, learned, clusters=clusters):
        routed = tiny_llama.hf(**batch).logits
    for row, c in enumerate(routes):
        with torch.no_grad(), apply_mask(tiny_llama, learned["mask"].sel(cluster=int(c))):
            alone = tiny_llama.hf(**batch).logits[row]
        torch.testing.assert_close(routed[row], alone, atol=1e-5, rtol=1e-5)
    assert len(set(routes.tolist())) > 1  # the batch really mixes clusters


def _nll_with_blocks_zeroed(model, text, mask=None) -> float:
    """HF's mean next-token loss of ``text`` (a Llama) with every block whose ``mask``
    (layer, component) entry is False zeroed by a forward hook: the residual passes it by."""

    def zero(module, args, out):
        return (torch.zeros_like(out[0]), *out[1:]) if isinstance(out, tuple) else 0 * out

    handles = []
    if mask is not None:
        for layer in mask["layer"].values:
            for component in mask["component"].values:
                if not bool(mask.sel(layer=layer, component=component)):
                    block = model.hf.model.layers[int(layer)]
                    module = block.self_attn if component == "attn" else block.mlp
                    handles.append(module.register_forward_hook(zero))
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    try:
        with torch.no_grad():
            return float(model.hf(input_ids=ids, labels=ids).loss)
    finally:
        for handle in handles:
            handle.remove()


def test_comparison_on_held_out_texts(tiny_llama, mixed):
    train, held_out = cluster.split(mixed, held_out=0.25)
    clusters = cluster.kmeans(cluster.embed(train), 3, prompts=train)
    result = mask_comparison(
        tiny_llama,
        train,
        held_out,
        clusters=clusters,
        sparsities=[1 / 6, 0.5],
        n_random=2,
        max_steps=2,
        window=2,
        train_batch_size=2,
        progress=False,
    )
    assert result["ppl_ratio"].dims == ("strategy", "target_sparsity")
    assert list(result["strategy"].values) == ["routed", "global", "random"]
    assert result["routed_mask"].attrs["model"] == tiny_llama.name
    fitted_with = {name: result.attrs[f"fit_{name}"] for name in asdict(masks_module.FIT_DEFAULTS)}
    assert fitted_with == {
        **asdict(masks_module.FIT_DEFAULTS),
        "max_steps": 2,
        "window": 2,
        "batch_size": 2,
    }
    assert (result["ppl_ratio"] > 0).all()
    assert int(result["n_held_out"].sum()) == len(held_out)
    kept = result["routed_mask"].sum(("layer", "component"))
    np.testing.assert_array_equal(kept.sel(target_sparsity=0.5).values, 3)
    # the routed ratio, recomputed from HF's own loss with the skipped blocks zeroed by hooks
    routes = clusters.route(held_out)
    masks = result["routed_mask"].sel(target_sparsity=0.5)
    routed = [
        _nll_with_blocks_zeroed(tiny_llama, held_out[i].text, masks.sel(cluster=int(c)))
        for i, c in enumerate(routes)
    ]
    unmasked = [_nll_with_blocks_zeroed(tiny_llama, p.text) for p in held_out]
    assert result.attrs["loss_unmasked"] == pytest.approx(np.mean(unmasked), rel=1e-4)
    assert float(result["ppl_ratio"].sel(strategy="routed", target_sparsity=0.5)) == pytest.approx(
        np.exp(np.mean(routed) - np.mean(unmasked)), rel=1e-4
    )


def test_bad_inputs_name_the_fix(tiny_llama, tokenizer, mixed, clusters, learned):
    with pytest.raises(ValueError, match=r"target_sparsity must lie in \(0, 1\)"):
        block_masks(tiny_llama, mixed, clusters=clusters, target_sparsity=1.0, progress=False)
    with pytest.raises(ValueError, match=r"^sparsities must lie in \(0, 1\)"):
        mask_comparison(tiny_llama, mixed, mixed[:8], clusters=clusters, sparsities=[0.3, 0])
    with pytest.raises(ValueError, match="pass the prompts that were clustered"):
        block_masks(tiny_llama, mixed[:5], clusters=clusters, progress=False)
    with pytest.raises(ValueError, match="held-out texts for 4 clusters"):
        mask_comparison(tiny_llama, mixed, mixed[:3], clusters=clusters)
    no_centroids = cluster.Clustering(clusters.labels, np.zeros((0, 384), np.float32))
    with pytest.raises(ValueError, match="Clustering with centroids"):
        block_masks(tiny_llama, mixed, clusters=no_centroids, progress=False)
    with (
        pytest.raises(ValueError, match="Clustering with centroids"),
        apply_mask(tiny_llama, learned, clusters=clusters.labels),
    ):
        pass
    foreign = learned["mask"].sel(cluster=0).assign_attrs(model="smollm2-135m")
    with (
        pytest.raises(ValueError, match=r"model 'smollm2-135m' \(the result\) vs 'tiny-llama'"),
        apply_mask(tiny_llama, foreign),
    ):
        pass
    deeper = lsc.models.tiny("llama", n_layers=4, seed=0, tokenizer=tokenizer)
    deeper.name = tiny_llama.name
    with (
        pytest.raises(ValueError, match=r"layout_fingerprint 'llama/L3/.* vs 'llama/L4/"),
        apply_mask(deeper, learned["mask"].sel(cluster=0)),
    ):
        pass
    with pytest.raises(ValueError, match="Pick one cluster"), apply_mask(tiny_llama, learned):
        pass


# ----------------------------------------------- options and results checked up front (issue 24)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_steps": 0}, ValueError, r"max_steps must be an integer from 1 to 10000, got 0"),
        ({"max_steps": 10**9}, ValueError, r"max_steps must be an integer from 1 to 10000"),
        ({"window": 2.0}, TypeError, r"window must be a positive integer, got 2\.0"),
        ({"batch_size": 0}, ValueError, r"batch_size must be an integer from 1 to 1024, got 0"),
        ({"target_sparsity": [0.1] * 21}, ValueError, r"at most MAX_SPARSITIES=20 different"),
        ({"target_sparsity": [0.1, 0.1]}, ValueError, r"sparsities, each once .*got 2"),
        ({"lr": float("nan")}, ValueError, r"lr must be a finite number > 0, got nan"),
        ({"penalty": -1.0}, ValueError, r"penalty must be a finite number >= 0"),
        ({"tol": "0.1"}, TypeError, r"tol must be a number >= 0, got '0\.1'"),
        ({"seed": -1}, ValueError, r"seed must be a whole number from 0 to 4294967295, got -1"),
        ({"progress": 1}, TypeError, r"progress must be True or False, got 1"),
    ],
)
def test_block_mask_options_are_checked_before_the_fit(
    tiny_llama, mixed, clusters, kwargs, error, message
):
    with pytest.raises(error, match=message):
        block_masks(tiny_llama, mixed, clusters=clusters, **{**FAST, **kwargs})


def test_block_masks_shows_the_fit_defaults_declared_once():
    """The mask fit's defaults are FIT_DEFAULTS: block_masks' signature names them (help()
    shows the values) and mask_comparison fits with them (above)."""
    parameters = inspect.signature(block_masks).parameters
    for name, default in asdict(masks_module.FIT_DEFAULTS).items():
        assert parameters[name].default == default, name


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"n_random": 0}, ValueError, r"n_random must be an integer from 1 to 100, got 0"),
        ({"n_random": 10**9}, ValueError, r"n_random must be an integer from 1 to 100, got"),
        ({"train_batch_size": 0}, ValueError, r"train_batch_size must be an integer from 1"),
        ({"max_step": 3}, TypeError, r"unknown fit option\(s\) \['max_step'\]"),
        ({"loss": "mse"}, ValueError, r"Unknown loss 'mse'"),
    ],
)
def test_comparison_options_are_checked_before_the_fit(
    tiny_llama, mixed, clusters, kwargs, error, message
):
    with pytest.raises(error, match=message):
        mask_comparison(tiny_llama, mixed, mixed[:8], clusters=clusters, progress=False, **kwargs)


def test_masks_passed_back_must_be_binary_finite_and_from_this_model(
    tiny_llama, mixed, learned, tokenizer
):
    probabilities = learned["keep_prob"].sel(cluster=0)
    with pytest.raises(ValueError, match=r"masks must be a binary mask.*probabilities"):
        masked_loss(tiny_llama, mixed[:2], probabilities)
    with (
        pytest.raises(ValueError, match=r"binary mask.*result\['keep_prob'\]"),
        apply_mask(tiny_llama, probabilities),
    ):
        pass
    holed = learned["mask"].sel(cluster=0).astype(float).where(lambda m: m["layer"] > 0)
    with pytest.raises(ValueError, match=r"masks holds 2 NaN or infinite value"):
        masked_loss(tiny_llama, mixed[:2], holed)
    with pytest.raises(TypeError, match=r"masks must be an xarray.DataArray.*result\['mask'\]"):
        masked_loss(tiny_llama, mixed[:2], learned)
    with (
        pytest.raises(TypeError, match=r"masks must be an xarray.DataArray or Dataset"),
        apply_mask(tiny_llama, torch.ones(tiny_llama.spec.n_layers, 2)),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"masks lacks the variable\(s\) \['mask'\]"),
        apply_mask(tiny_llama, learned[["keep_prob"]]),
    ):
        pass
    with pytest.raises(ValueError, match=r"masks must have shape \(sets, 3, 2\)"):
        masked_loss(tiny_llama, mixed[:2], torch.ones(2, 2, 3))
    n = tiny_llama.spec.n_layers
    lookalike = lsc.models.tiny("qwen3", n_layers=n, tokenizer=tokenizer)
    lookalike.name = tiny_llama.name  # same name and shape, another layout
    with (
        pytest.raises(ValueError, match=rf"layout_fingerprint 'llama/L{n}/.* vs 'qwen3/L{n}/"),
        apply_mask(lookalike, learned["mask"].sel(cluster=0)),
    ):
        pass
    with pytest.raises(ValueError, match=rf"layout_fingerprint 'llama/L{n}/.* vs 'qwen3/L{n}/"):
        masked_loss(lookalike, mixed[:2], learned["mask"])
    gates = learned["mask"].assign_attrs(method="head_gating")
    with pytest.raises(ValueError, match=r"masks is a result of 'head_gating', not of lsc.block"):
        masked_loss(tiny_llama, mixed[:2], gates)


def _logits(model, text: str) -> torch.Tensor:
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model.hf(input_ids=ids).logits


def test_masks_are_read_by_label(tiny_llama, mixed, clusters, learned):
    """A sortby or transpose of the masks (or of the clustering's labels) changes no
    answer; labels that are not the model's are refused by name."""
    masks = learned["mask"]
    shuffled = masks.sortby("component", ascending=False).sortby("layer", ascending=False)
    shuffled = shuffled.transpose("component", "cluster", "layer")
    torch.testing.assert_close(
        masked_loss(tiny_llama, mixed[:2], shuffled), masked_loss(tiny_llama, mixed[:2], masks)
    )
    one = masks.sel(cluster=1)
    with apply_mask(tiny_llama, one):
        expected = _logits(tiny_llama, mixed[0].text)
    with apply_mask(tiny_llama, shuffled.sel(cluster=1)):
        torch.testing.assert_close(_logits(tiny_llama, mixed[0].text), expected)
    with apply_mask(tiny_llama, masks, clusters=clusters):
        routed = _logits(tiny_llama, mixed[0].text)
    with apply_mask(tiny_llama, shuffled.sortby("cluster", ascending=False), clusters=clusters):
        torch.testing.assert_close(_logits(tiny_llama, mixed[0].text), routed)
    with pytest.raises(ValueError, match=r"masks's 'component' labels do not match .*\['mlp'\]"):
        masked_loss(tiny_llama, mixed[:2], masks.sel(component=["attn"]))
    with (
        pytest.raises(ValueError, match=r"masks's 'cluster' labels do not match .*unknown \[9\]"),
        apply_mask(tiny_llama, masks.assign_coords(cluster=[0, 1, 2, 9]), clusters=clusters),
    ):
        pass
    reversed_labels = clusters.labels.sortby("prompt", ascending=False)
    moved = cluster.Clustering(reversed_labels, clusters.centroids)
    estimate = lsc.block_mask_estimate(tiny_llama, mixed, clusters=clusters, progress=False)
    again = lsc.block_mask_estimate(tiny_llama, mixed, clusters=moved, progress=False)
    xr.testing.assert_identical(again, estimate)


def test_routing_with_the_masked_model_as_encoder_is_refused(tiny_llama, learned, clusters):
    """Routing would embed every input with the masked model, whose passes route again."""
    own = cluster.Clustering(clusters.labels, clusters.centroids, encoder=tiny_llama)
    with (
        pytest.raises(ValueError, match=r"clusters\.encoder is model"),
        apply_mask(tiny_llama, learned, clusters=own),
    ):
        pass


def test_estimate_is_the_first_order_cost_of_skipping_each_block(tiny_llama, mixed, clusters):
    estimate = lsc.block_mask_estimate(
        tiny_llama, mixed, clusters=clusters, target_sparsity=[0.25, 0.5], progress=False
    )
    cost = estimate["removal_cost"].isel(target_sparsity=0)
    assert cost.dims == ("cluster", "layer", "component")
    n_layers = tiny_llama.spec.n_layers
    cluster = 1
    texts = masks_module._encode(tiny_llama, mixed)
    members = np.flatnonzero(clusters.labels.values == cluster)
    rows = [texts[i] for i in members]
    eps = 1e-3
    for layer, component in [(0, 0), (n_layers - 1, 1)]:
        soft = torch.ones(len(rows), n_layers, 2)
        soft[:, layer, component] = 1 - eps
        nudged = masks_module._losses_per_row(tiny_llama, rows, soft, 8).mean()
        intact = masks_module._losses_per_row(tiny_llama, rows, torch.ones_like(soft), 8).mean()
        expected = float(nudged - intact) / eps
        got = float(cost.sel(cluster=cluster).values[layer, component])
        assert got == pytest.approx(expected, rel=2e-2, abs=1e-3)
    for i, sparsity in enumerate([0.25, 0.5]):
        kept = estimate["mask"].isel(target_sparsity=i)
        assert (kept.sum(("layer", "component")) == round((1 - sparsity) * 2 * n_layers)).all()
        lowest_kept = cost.where(kept).min(("layer", "component"))
        highest_skipped = cost.where(~kept).max(("layer", "component"))
        assert (lowest_kept >= highest_skipped).all()


def test_an_interrupted_fit_continues_from_its_checkpoint(
    tiny_llama, mixed, clusters, learned, tmp_path, monkeypatch
):
    """Killed after its state was kept (at update 3 of 5, window 3) and started again, the
    fit gives the masks of an uninterrupted fit, gate noise and minibatches included."""
    options = {**FAST, "max_steps": 5}
    whole = block_masks(tiny_llama, mixed, clusters=clusters, target_sparsity=0.5, **options)
    passes, row_loss = [0], masks_module._row_loss

    def killed_at_update_4(*args, **kwargs):
        passes[0] += 1
        if passes[0] > 3 * 1:  # one pass per update here (8 rows fit in a pass)
            raise KeyboardInterrupt
        return row_loss(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(masks_module, "_row_loss", killed_at_update_4)
        with pytest.raises(KeyboardInterrupt):
            block_masks(
                tiny_llama,
                mixed,
                clusters=clusters,
                target_sparsity=0.5,
                checkpoint=tmp_path,
                **options,
            )
    resumed = block_masks(
        tiny_llama, mixed, clusters=clusters, target_sparsity=0.5, checkpoint=tmp_path, **options
    )
    xr.testing.assert_identical(resumed["keep_prob"], whole["keep_prob"])
    xr.testing.assert_identical(resumed["mask"], whole["mask"])


def test_a_checkpoint_of_other_weights_is_refused(tiny_llama, mixed, clusters, tokenizer, tmp_path):
    """Same name and layout, other weights: the fit is not continued (nor returned)."""
    fit = dict(clusters=clusters, target_sparsity=0.5, checkpoint=tmp_path, **FAST)
    block_masks(tiny_llama, mixed, **fit)
    other = lsc.models.tiny("llama", n_layers=3, seed=1, tokenizer=tokenizer)
    assert (other.name, other.spec) == (tiny_llama.name, tiny_llama.spec)
    with pytest.raises(
        ValueError,
        match=rf"block_masks\.pt \(weights: written for '{tiny_llama.weights_fingerprint[:12]}…', "
        rf"this fit has '{other.weights_fingerprint[:12]}…'\)\. To start this fit, pass a new "
        "checkpoint folder",
    ):
        block_masks(other, mixed, **fit)


# ------------------------------------------------------------ a wall-time budget (issue 43)


def _timed_passes(monkeypatch):
    """Each masked training pass takes 1 s on a fake ``optim.clock`` (one per update here)."""
    now = [0.0]
    row_loss = masks_module._row_loss

    def timed(*args, **kwargs):
        now[0] += 1.0
        return row_loss(*args, **kwargs)

    monkeypatch.setattr(optim, "clock", lambda: now[0])
    monkeypatch.setattr(masks_module, "_row_loss", timed)


def test_a_time_budget_stops_the_mask_fit_and_a_rerun_continues_it(
    tiny_llama, mixed, clusters, tmp_path, monkeypatch
):
    """2.5 s of 1-s updates: two updates, every set still moving and said so; called again
    with the same checkpoint and a larger budget, the fit continues to the masks of a fit
    never stopped (gate noise and minibatches included)."""
    options = dict(clusters=clusters, target_sparsity=0.5, **{**FAST, "max_steps": 5})
    whole = block_masks(tiny_llama, mixed, **options)
    with monkeypatch.context() as patch:
        _timed_passes(patch)
        with pytest.warns(optim.TimeBudgetWarning, match=r"The block-mask fit stopped at its"):
            stopped = block_masks(
                tiny_llama, mixed, checkpoint=tmp_path, time_budget=2.5, **options
            )
        assert stopped.attrs["stopped"] == "time budget" and stopped.attrs["converged"] == 0
        np.testing.assert_array_equal(stopped["steps"].values, 2)
        assert "after 2 of at most 5 updates" in stopped.attrs["longer_run"]
        assert "4 of 4 mask sets still moving" in stopped.attrs["longer_run"]
        resumed = block_masks(tiny_llama, mixed, checkpoint=tmp_path, time_budget=60, **options)
    np.testing.assert_array_equal(resumed["keep_prob"].values, whole["keep_prob"].values)
    np.testing.assert_array_equal(resumed["mask"].values, whole["mask"].values)
    assert resumed.attrs["stopped"] == whole.attrs["stopped"] == "max_steps"
    assert (resumed.attrs["time_budget"], resumed.attrs["longer_run"]) == (60.0, "")


def test_the_comparison_takes_a_time_budget(tiny_llama, mixed, monkeypatch):
    train, held_out = cluster.split(mixed, held_out=0.25)
    clusters = cluster.kmeans(cluster.embed(train), 3, prompts=train)
    _timed_passes(monkeypatch)
    with pytest.warns(optim.TimeBudgetWarning):
        result = mask_comparison(
            tiny_llama,
            train,
            held_out,
            clusters=clusters,
            sparsities=[0.5],
            n_random=1,
            max_steps=4,
            window=2,
            train_batch_size=2,
            time_budget=1.5,
            progress=False,
        )
    assert (result.attrs["steps"], result.attrs["stopped"]) == (1, "time budget")
    assert result.attrs["time_budget"] == 1.5 and result.attrs["converged"] == 0


@pytest.mark.parametrize("budget, error", [(-1, ValueError), (False, TypeError)])
def test_a_time_budget_is_checked_before_the_fit(
    tiny_llama, mixed, clusters, monkeypatch, budget, error
):
    monkeypatch.setattr(masks_module, "_encode", None)  # any pass, even encoding, would fail
    with pytest.raises(error, match="time_budget must be"):
        block_masks(tiny_llama, mixed, clusters=clusters, time_budget=budget, **FAST)
    with pytest.raises(error, match="time_budget must be"):
        mask_comparison(tiny_llama, mixed, mixed[:8], clusters=clusters, time_budget=budget)
