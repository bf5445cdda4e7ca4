"""Positions and spans (``sweep/positions.py``, ``data/spans.py``): spans on prompts, the
checks before any pass, the numbers against TransformerLens's own by-position patching, and
what no position changes (padding, the store, refine="auto", the all-positions default).

Hand-hook references for every family are in ``test_family_matrix.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr

import lenscape as lsc
from lenscape.data import Prompt, find_span, from_records
from lenscape.sweep.backend import get_backend
from lenscape.sweep.inputs import tokenize

#: Largest difference allowed against TransformerLens, relative to the largest effect.
RTOL = 1e-4


@pytest.fixture(scope="module")
def ioi():
    return lsc.data.prompts("ioi")


@pytest.fixture(scope="module")
def mixed_lengths(ioi, tokenizer):
    """Three IOI pairs of at least two token lengths, from different templates."""
    chosen = [ioi[0], ioi[12], ioi[36]]
    assert len({len(tokenizer(p.text)["input_ids"]) for p in chosen}) > 1
    return lsc.data.PromptSet(chosen, name="ioi")


# ----------------------------------------------------------------------- spans on prompts


def test_spans_resolve_from_offsets_substrings_and_occurrences():
    text = "When Mary and John went to the store, John gave a book to"
    p = Prompt(text, " Mary", spans={"S2": ("John", 2), "IO": "Mary", "first": (0, 4)})
    assert p.spans == {"first": (0, 4), "IO": (5, 9), "S2": (38, 42)}  # in prompt order
    assert text[slice(*p.spans["S2"])] == "John" and p.spans["S2"][0] > text.index("John")
    assert find_span(text, " to", 2) == (text.rindex(" to"), len(text))
    records = from_records([{"text": text, "target": " Mary", "spans": {"IO": [5, 9]}}])
    assert records[0].spans == {"IO": (5, 9)}


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ({"IO": (5, 99)}, "outside it or is empty"),
        ({"IO": (5, 5)}, "outside it or is empty"),
        ({"IO": (-1, 3)}, "outside it or is empty"),
        ({"IO": "Peter"}, "occurs 0 time"),
        ({"IO": ("John", 3)}, "no occurrence 3"),
        ({"IO": ("John", 0)}, "counts from 1"),
        ({"IO": (0, 9), "S1": (5, 12)}, "overlap"),
        ({"other": (0, 4)}, "reserved"),
        ({"": (0, 4)}, "non-empty strings"),
        ({"IO": 3.5}, "must be"),
    ],
)
def test_bad_spans_are_refused_naming_the_fix(spans, message):
    with pytest.raises(ValueError, match=message):
        Prompt("When Mary and John went to the store, John gave a book to", " Mary", spans=spans)


def test_spans_must_be_a_mapping():
    with pytest.raises(TypeError, match="spans must map names"):
        Prompt("The capital of France is", " Paris", spans=[(0, 3)])


def test_corrupt_spans_need_the_same_names_and_a_corrupt_text():
    with pytest.raises(ValueError, match="give corrupt= and spans="):
        Prompt("a b c", " d", spans={"x": "a"}, corrupt_spans={"x": "a"})
    with pytest.raises(ValueError, match="same names"):
        Prompt("a b c", " d", corrupt="a b e", spans={"x": "a"}, corrupt_spans={"y": "a"})


def test_built_in_sets_carry_spans(ioi, factual):
    p = ioi[0]
    assert list(p.spans) == ["IO", "S1", "S2", "END"]
    assert p.text[slice(*p.spans["IO"])] == p.target.strip()
    assert p.text[slice(*p.spans["S2"])] == p.distractor.strip()
    assert p.corrupt[slice(*p.corrupt_spans["S2"])] == p.target.strip()
    assert list(factual[0].spans) == ["subject", "END"]
    assert factual[0].text[slice(*factual[0].spans["subject"])] == "France"
    math = lsc.data.task("math")[0]
    assert list(math.spans) == ["A", "B", "END"]


def test_span_token_positions_follow_character_overlap(tiny_llama, ioi):
    """A token belongs to a span when their characters overlap (" Peter" holds "Peter");
    tokens in no named span form "other"; the corrupt text's S2 sits at the same token."""
    tokens = tokenize(tiny_llama, ioi[:2], needs_corrupt=True, needs_distractor=True)
    assert tokens.span_names == ("IO", "S1", "S2", "END", "other")
    ids = tokens.clean_ids[0]
    pieces = tiny_llama.tokenizer.convert_ids_to_tokens(ids)
    held = tokens.spans[0]
    assert [pieces[pos] for pos in held["IO"]] == ["ĠPeter"]
    assert held["END"] == [len(ids) - 1]


def test_a_token_in_two_spans_or_a_span_without_tokens_is_refused(tiny_llama):
    # "Mary" is one token: a span on half of it and another on the other half share it.
    halves = Prompt(
        "When Mary went to",
        " the",
        corrupt="When John went to",
        distractor=" the",
        spans={"a": (5, 7), "b": (7, 9)},
    )
    with pytest.raises(ValueError, match="overlaps the spans"):
        lsc.attribution_patching(tiny_llama, [halves], positions="spans", progress=False)


def test_corrupt_spans_at_other_token_positions_are_refused(tiny_llama):
    shifted = Prompt(
        "When Mary and John went to",
        " the",
        corrupt="When Mary and went John to",
        distractor=" the",
        spans={"S": "John"},
        corrupt_spans={"S": "John"},
    )
    with pytest.raises(ValueError, match="same positions"):
        lsc.activation_patching(tiny_llama, [shifted], positions="spans", progress=False)


# -------------------------------------------------------------- checks before any pass


def test_spans_on_prompts_without_spans_are_refused_before_any_pass(tiny_llama, factual, no_pass):
    plain = [Prompt(p.text, p.target, p.corrupt, p.distractor) for p in factual[:2]]
    for method in (lsc.ablation, lsc.activation_patching, lsc.attribution_patching):
        with pytest.raises(ValueError, match="name no spans"):
            method(tiny_llama, plain, positions="spans", progress=False)


def test_resid_over_all_positions_and_unknown_positions_are_refused(tiny_llama, factual, no_pass):
    with pytest.raises(ValueError, match="whole clean run"):
        lsc.activation_patching(tiny_llama, factual[:2], level="resid", progress=False)
    with pytest.raises(ValueError, match="Unknown positions 'every'"):
        lsc.attribution_patching(tiny_llama, factual[:2], positions="every", progress=False)
    with pytest.raises(ValueError, match="Unknown positions"):
        lsc.ablation(tiny_llama, factual[:2], positions=None, progress=False)


# ---------------------------------------------------- what positions never change


def test_the_padding_side_and_batching_change_no_number(tiny_llama, mixed_lengths):
    for positions in ("each", "spans"):
        right = lsc.activation_patching(
            tiny_llama, mixed_lengths, positions=positions, progress=False
        )
        left = lsc.activation_patching(
            tiny_llama,
            mixed_lengths,
            positions=positions,
            padding_side="left",
            batch_size=2,
            progress=False,
        )
        xr.testing.assert_allclose(
            right.reset_coords(drop=True), left.reset_coords(drop=True), atol=1e-5
        )
        assert (
            right["token" if positions == "each" else "span_text"]
            == left["token" if positions == "each" else "span_text"]
        ).all()


def test_positions_past_a_prompt_s_end_are_nan_and_labelled_empty(tiny_llama, mixed_lengths):
    got = lsc.attribution_patching(tiny_llama, mixed_lengths, positions="each", progress=False)
    lengths = [len(tiny_llama.tokenizer(p.text)["input_ids"]) for p in mixed_lengths]
    for i, length in enumerate(lengths):
        row = got.isel(prompt=i)
        assert np.isnan(row.isel(pos=slice(length, None))).all()
        assert np.isfinite(row.isel(pos=slice(0, length))).all()
        assert (row["token"].values[length:] == "").all() and row["token"].values[0] != ""
    assert got.attrs["positions"] == "each"


def test_the_default_is_unchanged(tiny_llama, factual):
    explicit = lsc.activation_patching(tiny_llama, factual[:3], positions="all", progress=False)
    default = lsc.activation_patching(tiny_llama, factual[:3], progress=False)
    xr.testing.assert_identical(explicit, default)
    assert "positions" not in default.attrs


def test_every_estimator_adds_up_over_spans(tiny_llama, mixed_lengths):
    for estimator, extra in (("ig", {"steps": 3}), ("relp", {}), ("trapezoid", {})):
        whole = lsc.attribution_patching(
            tiny_llama, mixed_lengths, estimator=estimator, level="block", progress=False, **extra
        )
        spans = lsc.attribution_patching(
            tiny_llama,
            mixed_lengths,
            estimator=estimator,
            level="block",
            positions="spans",
            progress=False,
            **extra,
        )
        np.testing.assert_allclose(spans.sum("span").values, whole.values, atol=1e-5)


def test_error_estimates_by_span_are_per_cell(tiny_llama, mixed_lengths):
    got = lsc.attribution_patching(
        tiny_llama, mixed_lengths, level="head", positions="spans", error=True, progress=False
    )
    assert got["error"].dims == got.dims and (got["error"].fillna(0) >= 0).all()
    assert np.isnan(got["error"].values).sum() == np.isnan(got.values).sum()


def test_refine_auto_by_position_measures_exactly_where_it_measures(tiny_llama, mixed_lengths):
    full = lsc.activation_patching(tiny_llama, mixed_lengths, positions="spans", progress=False)
    auto = lsc.activation_patching(
        tiny_llama, mixed_lengths, positions="spans", refine="auto", progress=False
    )
    measured = auto["measured"].values
    assert measured.any()
    np.testing.assert_allclose(auto.values[measured], full.values[measured], atol=1e-5)
    np.testing.assert_array_equal(np.isnan(auto.values), np.isnan(full.values))


def test_a_store_resumes_a_positional_run(tiny_llama, mixed_lengths, tmp_path):
    path = tmp_path / "pos.zarr"
    stored = lsc.ablation(
        tiny_llama, mixed_lengths, positions="each", store=path, batch_size=2, progress=False
    ).load()
    again = lsc.ablation(
        tiny_llama, mixed_lengths, positions="each", store=path, batch_size=2, progress=False
    )
    memory = lsc.ablation(tiny_llama, mixed_lengths, positions="each", progress=False)
    np.testing.assert_allclose(stored.values, memory.values, atol=1e-6)
    assert (again.load()["token"] == memory["token"]).all()


def test_faithfulness_compares_position_cells(tiny_llama, mixed_lengths):
    report = lsc.faithfulness(
        tiny_llama, mixed_lengths, estimators=("atp",), positions="spans", progress=False
    )
    assert "span" in report["exact_heads"].dims
    assert np.isfinite(report["pearson_cells"].values).all()


# ------------------------------------------- against TransformerLens's own functions


def _tl_reference(model, prompts, function):
    """``transformer_lens.patching.<function>`` on the model's TransformerBridge, per
    prompt (``reduce="none"``), minus the corrupt run's metric: the patching effect."""
    from transformer_lens import patching

    bridge = get_backend(model, "transformer_lens").bridge
    tok = model.tokenizer
    clean = torch.tensor([tok(p.text)["input_ids"] for p in prompts])
    corrupt = torch.tensor([tok(p.corrupt)["input_ids"] for p in prompts])
    target = torch.tensor(
        [tok(p.target, add_special_tokens=False)["input_ids"][0] for p in prompts]
    )
    other = torch.tensor(
        [tok(p.distractor, add_special_tokens=False)["input_ids"][0] for p in prompts]
    )
    rows = torch.arange(len(prompts))

    def metric(logits):
        return logits[rows, -1, target] - logits[rows, -1, other]

    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        base = metric(bridge(corrupt))
        got = getattr(patching, function)(bridge, corrupt, cache, metric, reduce="none")
    return got.values, base  # a PatchingResult: [*axes, batch]


def _one_length(ioi, tokenizer, n=3):
    by_length: dict[int, list] = {}
    for p in ioi:
        by_length.setdefault(len(tokenizer(p.text)["input_ids"]), []).append(p)
    return lsc.data.PromptSet(max(by_length.values(), key=len)[:n], name="ioi")


def test_equals_transformer_lens_by_position(tiny_llama, ioi, tokenizer):
    """``get_act_patch_resid_pre``, ``get_act_patch_block_every`` and
    ``get_act_patch_attn_head_out_by_pos`` (4 query heads on 2 KV heads: grouped-query
    attention kept grouped) equal lenscape's exact patching by position."""
    prompts = _one_length(ioi, tokenizer)
    resid = lsc.activation_patching(
        tiny_llama, prompts, level="resid", positions="each", progress=False
    )
    blocks = lsc.activation_patching(
        tiny_llama, prompts, level="block", positions="each", progress=False
    )
    heads = lsc.activation_patching(
        tiny_llama, prompts, level="head", positions="each", progress=False
    )
    every, base = _tl_reference(tiny_llama, prompts, "get_act_patch_block_every")
    heads_tl, _ = _tl_reference(tiny_llama, prompts, "get_act_patch_attn_head_out_by_pos")
    resid_tl, _ = _tl_reference(tiny_llama, prompts, "get_act_patch_resid_pre")
    _close_per_prompt(resid.values, resid_tl, base, "resid_pre")
    np.testing.assert_allclose(every_part(every, 0), resid_tl, atol=1e-6)
    for k, component in ((1, "attn"), (2, "mlp")):
        _close_per_prompt(
            blocks.sel(component=component).values, every_part(every, k), base, component
        )
    _close_per_prompt(
        heads.transpose("prompt", "layer", "pos", "head").values, heads_tl, base, "heads"
    )


def every_part(every, k):
    """Part ``k`` (resid_pre, attn_out, mlp_out) of ``get_act_patch_block_every``'s
    per-example result [3, layer, pos, batch]."""
    return every[k]


def _close_per_prompt(ours, theirs, base, what):
    theirs = np.moveaxis(np.asarray(theirs.detach().cpu(), dtype=float), -1, 0)  # batch first
    if base is not None:
        theirs = theirs - base.detach().numpy().reshape(-1, *[1] * (theirs.ndim - 1))
    scale = np.abs(theirs).max()
    assert scale > 0, what
    assert np.abs(ours - theirs).max() <= RTOL * scale, f"{what}: {np.abs(ours - theirs).max()}"


def test_span_maps_keep_the_prompt_order_through_a_sortby(tiny_llama, mixed_lengths):
    got = lsc.attribution_patching(tiny_llama, mixed_lengths, positions="spans", progress=False)
    assert json.loads(got.attrs["span_order"]) == list(got["span"].values)
    pooled = lsc.aggregate.mean(got).sel(bound="mean")
    shuffled = pooled.sortby("span")  # alphabetical: END first
    spec = lsc.heatmap(shuffled, x="head", y="layer", facet_col="span").to_dict()
    assert json.dumps(spec).find('"IO"') < json.dumps(spec).find('"END"')


# ------------------------------------------------- passes that skip the unchanged prefix


@pytest.mark.parametrize("family", lsc.models.TINY_ARCHITECTURES)
def test_suffix_passes_equal_whole_passes(family, tokenizer, mixed_lengths, monkeypatch):
    """By position, an exact pass runs only the columns from its first edited one, with the
    earlier keys and values from the unedited run: the same numbers as whole passes, left
    padded and batched, for patching and for mean ablation (a replacement with no pos dim).
    Where a sliding window is shorter than the prompts (tiny gemma3_text's is 4 tokens) the
    prefix's cache lacks columns, and every pass runs whole."""
    from lenscape.sweep import backend

    model = lsc.models.tiny(family, n_layers=3, seed=0, tokenizer=tokenizer)
    suffix_cuts = []
    whole_run = backend.NNsightBackend.run

    def counting_run(self, batch, **kwargs):
        if kwargs.get("past") is not None:
            suffix_cuts.append(kwargs["past"][0])
        return whole_run(self, batch, **kwargs)

    monkeypatch.setattr(backend.NNsightBackend, "run", counting_run)
    calls = [
        (lsc.activation_patching, dict(level="head", positions="each", variants_per_pass=1)),
        (lsc.activation_patching, dict(level="resid", positions="spans")),
        (lsc.ablation, dict(level="block", positions="each", kind="mean", variants_per_pass=1)),
    ]
    results = []
    for method, options in calls:
        common = dict(padding_side="left", batch_size=2, progress=False, **options)
        results.append(method(model, mixed_lengths, **common))
    window = getattr(model.hf.config, "sliding_window", None)
    longest = max(len(tokenizer(p.text)["input_ids"]) for p in mixed_lengths)
    sliding = "sliding_attention" in (getattr(model.hf.config, "layer_types", None) or [])
    short_window = sliding and window is not None and window <= longest
    if short_window:
        assert suffix_cuts == []
    else:
        assert suffix_cuts and min(suffix_cuts) > 0
    monkeypatch.setattr(backend.NNsightBackend, "runs_suffix", False)
    for (method, options), fast in zip(calls, results, strict=True):
        common = dict(padding_side="left", batch_size=2, progress=False, **options)
        whole = method(model, mixed_lengths, **common)
        scale = float(np.nanmax(np.abs(whole.values)))
        np.testing.assert_array_equal(np.isnan(fast.values), np.isnan(whole.values))
        # float32 rounding of the metric (order 1), not of the effects
        np.testing.assert_allclose(fast.values, whole.values, atol=max(1e-6, 1e-4 * scale), rtol=0)
