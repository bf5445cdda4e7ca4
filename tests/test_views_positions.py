"""Views of results by position (``positions="each"``: a ``pos`` dim with a (prompt, pos)
``token`` coord) and by span (``positions="spans"``: a ``span`` dim with a (prompt, span)
``span_text`` coord), on synthetic results."""

import json

import numpy as np
import pytest
from _helpers import make_result

import lenscape as lsc
from lenscape import aggregate
from lenscape.views.encoding import in_label_order
from lenscape.views.explorer import Explorer

TOKENS = np.array(
    [
        ["<s>", "When", " Alice", " and", " to"],
        ["<s>", "When", " Bob", " and", " to"],
        ["<s>", "When", " Alice", " and", ""],  # one token shorter: NaN past its end
    ]
)
SPANS = ["S1", "IO", "S2", "END", "other"]  # prompt order, not the alphabet
SPAN_TEXT = np.array(
    [
        ["Alice", "Peter", "Alice", " to", "When and went"],
        ["Bob", "Mary", "Bob", " to", "When and went"],
        ["Ann", "", "Ann", " to", "When went"],  # no IO span: NaN there
    ]
)


def each(dims=("prompt", "layer", "head", "pos")):
    shape = {"prompt": 3, "layer": 2, "head": 3, "component": 2, "pos": 5}
    values = np.random.default_rng(0).normal(size=[shape[d] for d in dims])
    values[(2, ..., 4) if dims[-1] == "pos" else 2] = np.nan
    coords = {"token": (("prompt", "pos"), TOKENS)}
    if "component" in dims:
        coords["component"] = ["attn", "mlp"]
    return make_result(values, dims, **coords).assign_attrs(positions="each")


def spans(order_attr=True):
    values = np.random.default_rng(1).normal(size=(3, 2, 5))
    values[2, :, 1] = np.nan
    da = make_result(
        values, ("prompt", "layer", "span"), span=SPANS, span_text=(("prompt", "span"), SPAN_TEXT)
    ).assign_attrs(positions="spans")
    return da.assign_attrs(span_order=json.dumps(SPANS)) if order_attr else da


def labels_of(spec, channel="x"):
    """The tick labels a chart's label expression maps its axis values to."""
    enc = spec["encoding"] if "encoding" in spec else spec["layer"][0]["encoding"]
    expr = enc[channel]["axis"]["labelExpr"]
    return json.loads(expr[: expr.index("][indexof(") + 1])


def test_schema_knows_span_after_pos():
    dims = lsc.schema.DIMS
    assert dims.index("span") == dims.index("pos") + 1
    assert "span" not in lsc.schema.INT_DIMS
    spans()  # validates: string labels on span


def test_mean_keeps_one_token_per_position_and_counts_the_mixed_ones():
    pooled = aggregate.mean(each(), "prompt")
    assert pooled["token"].dims == ("pos",)
    # the shorter prompt's "" past its end does not make position 4 mixed
    assert pooled["token"].values.tolist() == [
        "<s>",
        "When",
        "pos 2 (tokens differ)",
        " and",
        " to",
    ]
    assert pooled.attrs["mixed_positions"] == 1
    agreeing = each().where(each()["pos"] != 2)
    agreeing = agreeing.assign_coords(
        token=(("prompt", "pos"), np.where(TOKENS == " Bob", " Alice", TOKENS))
    )
    assert aggregate.mean(agreeing, "prompt").attrs["mixed_positions"] == 0


def test_heatmap_of_one_prompt_labels_pos_with_its_tokens():
    one = each().sel(prompt=1).mean("head")
    spec = lsc.heatmap(one, x="pos", y="layer").to_dict()
    assert labels_of(spec) == ["<s>", "When", " Bob", " and", " to"]
    assert not any("tokens" in line for line in spec["title"]["subtitle"])


def test_heatmap_of_a_mean_says_where_tokens_differ():
    pooled = aggregate.mean(each().mean("head"), "prompt")
    spec = lsc.heatmap(pooled, x="pos", y="layer").to_dict()
    assert labels_of(spec)[2] == "pos 2 (tokens differ)"
    (line,) = [s for s in spec["title"]["subtitle"] if "tokens differ" in s]
    assert "1 of 5 positions" in line and "mixes words" in line


def test_heatmap_of_prompts_side_by_side_labels_shared_tokens():
    da = each().mean("head")
    spec = lsc.heatmap(da, x="pos", y="layer", facet_col="prompt").to_dict()
    assert labels_of(spec["spec"])[2] == "pos 2 (tokens differ)"
    assert any("names the position only" in s for s in spec["title"]["subtitle"])


def test_heatmap_of_a_pos_map_that_lost_its_tokens_says_so():
    plain = each().mean("head").mean("prompt")  # xarray drops the (prompt, pos) coord
    assert "token" not in plain.coords
    spec = lsc.heatmap(plain, x="pos", y="layer").to_dict()
    assert any("token labels are lost" in s for s in spec["title"]["subtitle"])
    assert "labelExpr" not in json.dumps(spec["encoding"]["x"])


@pytest.mark.parametrize(
    "dims", [("prompt", "layer", "pos"), ("prompt", "layer", "component", "pos")]
)
def test_pos_maps_read_by_label(dims):
    da = aggregate.mean(each(dims), "prompt")
    if "component" in dims:
        da = da.sel(component="mlp")
    base = lsc.heatmap(da, x="pos", y="layer").to_dict()
    for variant in (
        da.isel(pos=[4, 2, 0, 1, 3]),
        da.transpose(*reversed(da.dims)),
        da.sortby("layer", ascending=False),
    ):
        assert lsc.heatmap(variant, x="pos", y="layer").to_dict() == base


def test_spans_keep_prompt_order_whatever_the_array_order():
    da = spans().mean("prompt")
    spec = lsc.heatmap(da, x="span", y="layer").to_dict()
    assert spec["encoding"]["x"]["sort"] == SPANS
    for variant in (da.sortby("span"), da.isel(span=[4, 3, 2, 1, 0]), da.transpose()):
        assert in_label_order(variant)["span"].values.tolist() == SPANS
        assert lsc.heatmap(variant, x="span", y="layer").to_dict() == spec


def test_spans_without_an_order_keep_the_coord_order_not_the_alphabet():
    da = spans(order_attr=False).mean("prompt")
    assert in_label_order(da)["span"].values.tolist() == SPANS
    assert sorted(SPANS) != SPANS


def test_a_bad_span_order_attr_is_named():
    da = spans().assign_attrs(span_order='"S1"')
    with pytest.raises(ValueError, match=r"span_order.*JSON list"):
        in_label_order(da)


def test_explorer_pools_prompts_and_keeps_token_labels():
    explorer = Explorer(each(), x="pos", y="layer")
    assert explorer.view.pick["prompt"] == "mean"
    assert labels_of(explorer.chart.to_dict())[2] == "pos 2 (tokens differ)"
    assert "tokens shared by the 3 prompts" in explorer.tokens.value
    explorer.controls["prompt"].value = "max"
    assert labels_of(explorer.chart.to_dict())[2] == "pos 2 (tokens differ)"


def test_explorer_steps_through_prompts_and_shows_their_tokens():
    explorer = Explorer(each(), x="pos", y="layer")
    explorer.step_prompt(1)
    assert explorer.view.pick["prompt"] == 0
    assert "Alice" in explorer.tokens.value and "Bob" not in explorer.tokens.value
    explorer.step_prompt(1)
    assert explorer.view.pick["prompt"] == 1
    assert "Bob" in explorer.tokens.value
    assert labels_of(explorer.chart.to_dict())[2] == " Bob"
    explorer.step_prompt(1)
    assert explorer.tokens.value.count("pos ") == 4  # the shorter prompt: 4 tokens
    explorer.step_prompt(1)
    assert explorer.view.pick["prompt"] == 0  # wraps round


def test_clicking_a_cell_highlights_its_token():
    explorer = Explorer(each(), x="pos", y="layer")
    explorer.step_prompt(1)
    explorer.show_cell({"pos": 2, "layer": 1})
    marked = [part for part in explorer.tokens.value.split("<span") if "data-marked" in part]
    assert len(marked) == 1 and "Alice" in marked[0] and 'title="pos 2"' in marked[0]
    explorer.step_prompt(1)  # the mark follows the prompt shown
    marked = [part for part in explorer.tokens.value.split("<span") if "data-marked" in part]
    assert len(marked) == 1 and "Bob" in marked[0]


def test_clicking_a_cell_highlights_its_span():
    explorer = Explorer(spans(), x="span", y="layer")
    explorer.controls["prompt"].value = 0
    explorer.show_cell({"span": "S2", "layer": 0})
    marked = [part for part in explorer.tokens.value.split("<span") if "data-marked" in part]
    assert len(marked) == 1 and "S2: Alice" in marked[0]
    assert explorer.chart.to_dict()["encoding"]["x"]["sort"] == SPANS
