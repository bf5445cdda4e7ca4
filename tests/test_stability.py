"""Circuit stability (capture/edges/stability.py): inclusion frequencies over bootstrap
resamples of the prompts, the consensus circuit, and its faithfulness by exact patching.

The frequencies are checked where the answer is known: synthetic per-prompt scores on a
small graph (2 layers, 4 heads, 2 key/value heads) whose strongest edge is strong in every
prompt (in every resample's circuit: 1.0), whose two competing paths win in about half of
the resamples each (strictly between), and whose noise edges never enter (0.0).
"""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import lenscape as lsc
from lenscape import bootstrap
from lenscape.capture.edges import circuits, stability
from lenscape.capture.edges.graph import Graph

N_PROMPTS = 16
GRAPH = Graph(2, 4, 2)
#: embed -> logits: 10 in every prompt. Path X: 1.0 in every prompt. Path Y: 2.2 in half
#: of the prompts, 0 in the others (its resample mean, 2.2 x the share of those prompts drawn,
#: is above X's where at least half of the drawn prompts have it: in about 60% of resamples).
ALWAYS = ("embed", "logits")
PATH_X = (("embed", "L0.MLP"), ("L0.MLP", "logits"))
PATH_Y = (("embed", "L1.MLP"), ("L1.MLP", "logits"))


def _per_prompt(seed: int = 0) -> xr.DataArray:
    rng = np.random.default_rng(seed)
    values = rng.normal(scale=0.01, size=(N_PROMPTS, *GRAPH.shape))
    senders, receivers = GRAPH.sender_labels, GRAPH.receiver_labels

    def put(edge: tuple[str, str], value) -> None:
        values[:, senders.index(edge[0]), receivers.index(edge[1])] = value

    put(ALWAYS, 10.0)
    for edge in PATH_X:
        put(edge, 1.0)
    for edge in PATH_Y:
        put(edge, np.where(np.arange(N_PROMPTS) % 2 == 0, 2.2, 0.0))
    values[:, ~GRAPH.valid] = np.nan
    return xr.DataArray(
        values,
        dims=("prompt", "sender", "receiver"),
        coords={"prompt": np.arange(N_PROMPTS), **GRAPH.coords()},
        attrs={"method": "edge_attribution", "estimator": "eap", "model": "synthetic"},
    )


def _at(result: xr.DataArray, edge: tuple[str, str]) -> float:
    return float(result.sel(sender=edge[0], receiver=edge[1]))


def test_inclusion_frequency_where_the_answer_is_known():
    result = lsc.circuit_stability(_per_prompt(), edges=3, n_resamples=400, seed=0)
    assert result.dims == ("sender", "receiver") and result.dtype == np.float64
    assert _at(result, ALWAYS) == 1.0
    x, y = _at(result, PATH_X[0]), _at(result, PATH_Y[0])
    assert 0.2 < y < 0.8 and 0.2 < x < 0.8  # each path wins in some resamples, not all
    assert x == _at(result, PATH_X[1]) and y == _at(result, PATH_Y[1])  # a path goes whole
    assert x + y == 1.0  # one path or the other in every resample
    others = result.values[GRAPH.valid].copy()
    assert np.count_nonzero(others) == 5  # noise edges never enter
    assert np.isnan(result.values[~GRAPH.valid]).all()  # no such edge: NaN, never 0
    np.testing.assert_allclose(np.nansum(result.values), result.attrs["mean_edges"])
    assert result.attrs["method"] == "circuit_stability"
    assert {k: result.attrs[k] for k in ("n_resamples", "seed", "budget", "n_prompts")} == {
        "n_resamples": 400,
        "seed": 0,
        "budget": 3,
        "n_prompts": N_PROMPTS,
    }
    assert "400 resamples of the 16 prompts with replacement (seed 0)" in result.attrs["resampling"]
    assert result.attrs["model"] == "synthetic"  # provenance kept


@pytest.mark.filterwarnings("ignore:.*tie in .score.:UserWarning")  # a path's two edges tie
def test_the_frequency_is_the_share_of_resampled_circuits_lsc_circuit_picks():
    """Against a plain loop: each resample's mean scores, ``lsc.circuit`` of them, counted."""
    scores = _per_prompt(seed=3)
    result = lsc.circuit_stability(scores, edges=4, n_resamples=30, seed=7)
    drawn = bootstrap.draw(N_PROMPTS, n_resamples=30, seed=7)
    total = np.zeros(GRAPH.shape)
    for row in drawn:
        mean = scores.isel(prompt=row).mean("prompt").assign_attrs(scores.attrs)
        total += lsc.circuit(mean, edges=4).values
    np.testing.assert_allclose(result.values[GRAPH.valid], (total / 30)[GRAPH.valid])


def test_seeded_and_read_by_label():
    scores = _per_prompt()
    first = lsc.circuit_stability(scores, edges=3, n_resamples=50, seed=1)
    xr.testing.assert_identical(
        first, lsc.circuit_stability(scores, edges=3, n_resamples=50, seed=1)
    )
    other = lsc.circuit_stability(scores, edges=3, n_resamples=50, seed=2)
    assert not np.array_equal(first.values, other.values, equal_nan=True)
    moved = scores.sortby("prompt", ascending=False).sortby("receiver").transpose()
    again = lsc.circuit_stability(moved, edges=3, n_resamples=50, seed=1)
    assert again.dims == ("receiver", "sender")  # the order given, as lsc.circuit
    xr.testing.assert_identical(
        again.transpose(*first.dims).sortby("receiver"), first.sortby("receiver")
    )


def test_the_consensus_circuit_keeps_the_edges_of_most_resamples():
    result = lsc.circuit_stability(_per_prompt(), edges=3, n_resamples=400, seed=0)
    every = lsc.consensus_circuit(result, share=1.0)
    assert every.dtype == bool and every.attrs["method"] == "circuit"
    assert every.attrs["n_edges"] == 1 and bool(every.sel(sender="embed", receiver="logits"))
    half = lsc.consensus_circuit(result, share=0.05)
    assert half.attrs["n_edges"] == 5  # both paths and the strong edge
    assert half.attrs["consensus_share"] == 0.05 and half.attrs["n_resamples"] == 400
    np.testing.assert_array_equal(circuits.on_paths(GRAPH, half.values), half.values)
    drawn = lsc.circuit_graph(_per_prompt().mean("prompt", keep_attrs=True), half).to_dict()
    title = drawn["title"]["text"]  # a long title wraps into lines
    assert "Consensus circuit of 5 edges" in " ".join([title] if isinstance(title, str) else title)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda s: lsc.circuit_stability(s, edges=3, n_resamples=0), ValueError, "n_resamples"),
        (
            lambda s: lsc.circuit_stability(s, edges=3, n_resamples=stability.MAX_RESAMPLES + 1),
            ValueError,
            "n_resamples must be an integer from 1 to 10000",
        ),
        (lambda s: lsc.circuit_stability(s, edges=3, n_resamples=2.5), TypeError, "n_resamples"),
        (lambda s: lsc.circuit_stability(s, edges=3, seed=-1), ValueError, "seed"),
        (lambda s: lsc.circuit_stability(s), ValueError, "exactly one edge budget"),
        (lambda s: lsc.circuit_stability(s.mean("prompt"), edges=3), ValueError, "per-prompt"),
        (lambda s: lsc.circuit_stability(s.isel(prompt=[0]), edges=3), ValueError, "at least 2"),
        (lambda s: lsc.circuit_stability(s.values, edges=3), TypeError, "scores must be"),
        (
            lambda s: lsc.circuit_stability(s.assign_attrs(method="circuit"), edges=3),
            ValueError,
            "scores",
        ),
        (lambda s: lsc.consensus_circuit(_stable(s), share=0), ValueError, "share"),
        (lambda s: lsc.consensus_circuit(_stable(s), share=1.5), ValueError, "share"),
        (lambda s: lsc.consensus_circuit(_stable(s), share="half"), TypeError, "share"),
        (lambda s: lsc.consensus_circuit(s.mean("prompt")), ValueError, "stability"),
        (
            lambda s: lsc.consensus_circuit(
                lsc.circuit(s.mean("prompt", keep_attrs=True), edges=3)
            ),
            ValueError,
            "stability",
        ),
    ],
)
def test_bad_input_is_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call(_per_prompt())


def _stable(scores: xr.DataArray) -> xr.DataArray:
    return lsc.circuit_stability(scores, edges=3, n_resamples=20)


def test_an_empty_consensus_is_refused_with_the_cause():
    result = lsc.circuit_stability(_per_prompt(), edges=3, n_resamples=400, seed=0)
    unreachable = result.where(result["receiver"] != "logits", 0.0).assign_attrs(result.attrs)
    with pytest.raises(ValueError, match="consensus circuit would be empty"):
        lsc.consensus_circuit(unreachable, share=0.5)


def test_consensus_circuits_are_patched_and_judged_exactly(tiny_llama):
    """The consensus circuit is a circuit ``edge_patching`` takes; its faithfulness at the
    whole budget (every edge in every resample) is the clean run's, 1."""
    prompts = lsc.data.prompts("ioi")[:4]
    scores = lsc.edge_attribution(tiny_llama, prompts, per_prompt=True, progress=False)
    result = lsc.circuit_stability(scores, fraction=0.2, n_resamples=20)
    consensus = lsc.consensus_circuit(result, share=0.5)
    patched = lsc.edge_patching(tiny_llama, prompts, consensus, progress=False)
    assert patched.sizes == {"prompt": 4} and patched.attrs["n_edges"] == consensus.attrs["n_edges"]
    curve = lsc.consensus_faithfulness(
        tiny_llama,
        prompts,
        scores,
        fractions=(0.2, 1.0),
        n_resamples=20,
        n_random=1,
        progress=False,
    )
    np.testing.assert_allclose(curve["faithfulness"].sel(budget=1.0), 1.0, rtol=1e-6)
    assert int(curve["n_edges"].sel(budget=0.2)) == consensus.attrs["n_edges"]
    assert curve.attrs["consensus_share"] == 0.5 and curve.attrs["n_resamples"] == 20
    assert np.isfinite(float(curve["cpr"])) and np.isfinite(float(curve["cmd"]))
    lsc.faithfulness_curve(curve).to_dict()
    with pytest.raises(ValueError, match="per-prompt"):
        lsc.consensus_faithfulness(tiny_llama, prompts, scores.mean("prompt"), progress=False)
    with pytest.raises(ValueError, match="n_resamples"):
        lsc.consensus_faithfulness(tiny_llama, prompts, scores, n_resamples=0, progress=False)
