"""An exact cut (capture/edges/cut.py): the edges at a circuit's boundary decided by exact
single-edge patching, on a tiny Llama."""

from __future__ import annotations

import numpy as np
import pytest

import lenscape as lsc
from lenscape.capture.edges import cut as cut_module
from lenscape.capture.edges.graph import Graph
from lenscape.capture.edges.patching import _edge_variants

IOI = lsc.data.prompts("ioi")


@pytest.fixture(scope="module")
def checked(tiny_llama):
    prompts = IOI[:4]
    scores = lsc.edge_attribution(tiny_llama, prompts, progress=False)
    circuit = lsc.circuit(scores, edges=20)
    cut = lsc.exact_cut(tiny_llama, prompts, circuit, scores, edges=5, progress=False)
    return prompts, scores, circuit, cut


def test_the_edges_at_the_cut_are_measured_and_kept_by_their_exact_effect(tiny_llama, checked):
    prompts, scores, circuit, cut = checked
    graph = Graph.of(tiny_llama)
    assert cut.dtype == bool and cut.dims == circuit.dims
    assert list(cut["receiver"].values) == list(circuit["receiver"].values)
    effect = cut["exact_effect"].values
    measured = np.isfinite(effect)
    assert measured.sum() == 10 == cut.attrs["cut_measured"]
    magnitude = np.abs(np.nan_to_num(scores.values))
    kept = circuit.values
    inside = measured & kept
    outside = measured & ~kept & graph.valid
    assert inside.sum() == 5 and outside.sum() == 5
    assert magnitude[inside].max() <= magnitude[kept & ~measured].min()  # the weakest kept
    assert magnitude[outside].min() >= magnitude[~kept & ~measured & graph.valid].max()
    strongest = np.sort(np.abs(effect[measured]))[::-1][:5]
    assert np.all(np.abs(effect[cut.values & measured]) >= strongest[-1])  # kept by |exact|
    assert not (cut.values & ~kept & ~measured).any()  # nothing unmeasured comes in
    flat = np.flatnonzero(measured.ravel())[0]
    alone = _edge_variants(
        tiny_llama, prompts, variants=(("only", (int(flat),)),), base="corrupt", progress=False
    )
    direct = float((alone["patched"].isel(variant=0) - alone["base"]).mean("prompt"))
    np.testing.assert_allclose(effect.ravel()[flat], direct, rtol=1e-5, atol=1e-7)
    assert cut.attrs["n_edges"] == int(cut.sum())
    assert 0 <= cut.attrs["cut_swapped"] <= 5


def test_an_exact_cut_is_a_circuit_the_other_functions_take(tiny_llama, checked):
    prompts, scores, _, cut = checked
    patched = lsc.edge_patching(tiny_llama, prompts, cut, progress=False)
    assert patched.attrs["n_edges"] == cut.attrs["n_edges"]
    spec = lsc.circuit_graph(scores, cut).to_dict()
    rules = next(layer for layer in spec["layer"] if layer.get("mark", {}).get("type") == "rule")
    shown = [row["exact"] for row in rules["data"]["values"]]
    assert any(value != "not measured (lsc.edge_agreement)" for value in shown)
    assert any("at the cut measured by exact edge patching" in n for n in spec["title"]["subtitle"])
    moved = cut.sortby("receiver").transpose()
    assert lsc.circuit_graph(scores, moved).to_dict() == spec  # read by label


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"edges": 0}, ValueError, "edges must be an integer from 1"),
        ({"edges": cut_module.MAX_CUT + 1}, ValueError, "edges must be an integer from 1 to 1000"),
        ({"edges": 2.5}, TypeError, "edges"),
    ],
)
def test_bad_options_are_refused_before_any_pass(tiny_llama, checked, options, error, match):
    prompts, scores, circuit, _ = checked
    with pytest.raises(error, match=match):
        lsc.exact_cut(tiny_llama, prompts, circuit, scores, progress=False, **options)


def test_the_wrong_kind_of_input_is_refused(tiny_llama, checked):
    prompts, scores, circuit, _ = checked
    with pytest.raises(ValueError, match=r"circuit must be the result of lsc\.circuit"):
        lsc.exact_cut(tiny_llama, prompts, scores, scores, progress=False)
    with pytest.raises(ValueError, match=r"scores must be the result of lsc\.edge_attribution"):
        lsc.exact_cut(tiny_llama, prompts, circuit, circuit, progress=False)
    everything = lsc.circuit(scores, fraction=1.0)
    with pytest.raises(ValueError, match="no cut"):
        lsc.exact_cut(tiny_llama, prompts, everything, scores, progress=False)
