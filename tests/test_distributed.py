"""Distributed capture on a dask LocalCluster of 2 worker processes: same numbers as one
process, one zarr store opened lazily, and a failing worker's error reaches the caller
while finished batches stay in the store."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import xarray as xr
from _helpers import answered_prompts, reference_correct, torch_threads

import lenscape as lsc
from lenscape import models, store
from lenscape.capture.patching import refine

distributed = pytest.importorskip("distributed", reason="needs the dask extra")


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as dask_client,
    ):
        yield dask_client


def test_tiny_model_on_two_workers_equals_one_process(client, tiny_llama, factual, tmp_path):
    prompts = factual[:20]
    for method, options in [
        (lsc.ablation, {"kind": "mean"}),
        (lsc.attribution_patching, {"level": "all"}),
    ]:
        expected = method(tiny_llama, prompts, batch_size=3, progress=False, **options)
        path = tmp_path / f"{method.__name__}.zarr"
        got = method(
            tiny_llama, prompts, batch_size=3, store=path, client=client, progress=False, **options
        )
        assert got.chunks is not None  # one lazily opened, dask-backed result
        xr.testing.assert_identical(got.compute(), expected)
    # both workers took part: each loaded the model through the plugin
    loaded = client.run(
        lambda: sorted(__import__("lenscape.sweep.distributed", fromlist=["_MODELS"])._MODELS)
    )
    assert len(loaded) == 2 and all(keys for keys in loaded.values())


@pytest.mark.slow
def test_bundled_model_on_two_workers_equals_one_process(client, smol, factual, tmp_path):
    prompts = factual[:8]  # two batches of four: as many as there are workers
    (threads,) = set(client.run(torch.get_num_threads).values())
    with torch_threads(threads):  # the workers' count: reductions split by thread
        expected = lsc.attribution_patching(smol, prompts, batch_size=4, progress=False)
    got = lsc.capture_to(
        tmp_path / "smol.zarr",
        "attribution_patching",
        smol,
        prompts,
        batch_size=4,
        client=client,
        progress=False,
    )
    xr.testing.assert_identical(got.compute(), expected)


def poisoned_tiny(token: int, tokenizer):
    """A tiny Llama whose embedding of ``token`` is NaN: prompts containing it fail."""
    model = models.tiny("llama", n_layers=2, tokenizer=tokenizer)
    with torch.no_grad():
        model.hf.model.embed_tokens.weight[token] = float("nan")
    model.recipe = functools.partial(poisoned_tiny, token, tokenizer)
    return model


def test_failing_worker_surfaces_its_error_and_keeps_finished_batches(
    client, tokenizer, factual, tmp_path
):
    prompts = factual[:12]
    ids = [set(tokenizer(p.text)["input_ids"]) for p in prompts]
    token = next(iter(ids[-1] - set().union(*ids[:-1])))  # only in the last prompt
    model = poisoned_tiny(token, tokenizer)
    path = tmp_path / "failing.zarr"
    with pytest.raises(
        RuntimeError,
        match=r"dask worker failed.*metric 'logit_diff' is not "
        r"finite \(NaN/inf\) for prompt\(s\) \[11\].*resume",
    ):
        lsc.ablation(model, prompts, batch_size=2, store=path, client=client, progress=False)
    done = store.progress(path)[1]
    assert not done[-2:].any() and done.any()
    healthy = models.tiny("llama", n_layers=2, tokenizer=tokenizer)
    expected = lsc.ablation(healthy, prompts, batch_size=2, progress=False)
    partial = lsc.open(path)
    np.testing.assert_array_equal(partial.values[done], expected.values[done])
    assert np.isnan(partial.values[~done]).all()


def test_model_without_recipe_is_refused(client, tiny_llama, factual, tmp_path):
    wrapped = models.from_hf(tiny_llama.hf, tiny_llama.tokenizer)
    with pytest.raises(ValueError, match="workers can load themselves"):
        lsc.ablation(wrapped, factual[:2], store=tmp_path / "r.zarr", client=client, progress=False)
    assert not (tmp_path / "r.zarr").exists()  # refused before anything was written


def test_correct_flags_written_by_workers(client, tiny_llama, factual, tmp_path):
    prompts = answered_prompts(tiny_llama, factual[:7])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()
    got = lsc.direct_logit_attribution(
        tiny_llama, prompts, batch_size=2, store=tmp_path / "d.zarr", client=client, progress=False
    )
    np.testing.assert_array_equal(got["correct"].values, expected)


def test_refined_run_ranks_once_on_the_client_and_workers_reuse_it(
    client, tiny_llama, factual, tmp_path, monkeypatch
):
    def count_ranking_passes():  # on each worker: wrap the ranking pass with a counter
        from lenscape.capture.patching import refine

        if not hasattr(refine, "ranking_passes"):
            rank = refine._refined_columns

            def counted(*args, **kwargs):
                refine.ranking_passes += 1
                return rank(*args, **kwargs)

            refine.ranking_passes = 0
            refine._refined_columns = counted
        return refine.ranking_passes

    on_client = []
    rank = refine._refined_columns
    monkeypatch.setattr(
        refine, "_refined_columns", lambda *a, **k: on_client.append(1) or rank(*a, **k)
    )
    before = sum(client.run(count_ranking_passes).values())
    prompts = factual[:12]
    options = {"batch_size": 3, "refine": 6}
    expected = lsc.ablation(tiny_llama, prompts, progress=False, **options)
    got = lsc.ablation(
        tiny_llama,
        prompts,
        **options,
        store=tmp_path / "refined.zarr",
        client=client,
        progress=False,
    )
    # The same components measured (NaN pattern), numbers to float32 rounding: the workers'
    # models ran no backward pass (the ranking), the client's did.
    xr.testing.assert_allclose(got.compute(), expected, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.isnan(got.values), np.isnan(expected.values))
    assert got.attrs == expected.attrs
    assert len(on_client) == 2  # one ranking pass per run: in memory, then the dask run
    assert sum(client.run(count_ranking_passes).values()) == before  # none on the workers


@pytest.mark.parametrize(
    "method, options",
    [
        ("edge_attribution", {"per_prompt": True}),
        ("logit_lens", {}),
        ("faithfulness", {}),
    ],
)
def test_newer_methods_on_two_workers_equal_one_process(
    client, tiny_llama, factual, tmp_path, method, options
):
    prompts = factual[:6]
    call = getattr(lsc, method)
    (threads,) = set(client.run(torch.get_num_threads).values())
    with torch_threads(threads):  # the workers' count: reductions split by thread
        expected = call(tiny_llama, prompts, batch_size=2, progress=False, **options)
    got = call(
        tiny_llama,
        prompts,
        batch_size=2,
        store=tmp_path / ("parts" if method == "faithfulness" else "r.zarr"),
        client=client,
        progress=False,
        **options,
    )
    if method == "faithfulness":  # timings differ; the numbers may not
        timing = ["seconds", "cost_vs_atp", "speedup_vs_exact"]
        got, expected = got.drop_vars(timing), expected.drop_vars(timing)
        got.attrs, expected.attrs = {}, {}
        xr.testing.assert_identical(got, expected)
    else:
        xr.testing.assert_identical(got.compute(), expected)
