"""Property tests (hypothesis) of issue 24: no quiet wrong numbers at any public boundary.

1. Bad options: for every public function in ``lsc.__all__`` that takes options (and for
   the results it takes back in), a generated bad value in one argument either works or
   raises ``TypeError``/``ValueError`` whose message names that argument. Any other
   exception (AttributeError, KeyError, RuntimeError from torch ...) fails the property.
2. Storage: every result type round-trips identically through zarr and netCDF, both the
   real results of each method on a tiny model and generated results of every dim, dtype,
   label coord and attr type the schema allows.

Calls use a tiny random model and one or two prompts, and each function gets a few
examples (``derandomize``: the same ones on every run). Functions whose valid calls are
slow (``SLOW``) get fewer examples and the ``slow`` mark; the rest take about a minute.
"""

from __future__ import annotations

import inspect
import re
import string
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lenscape as lsc
from lenscape import schema

#: Arguments not fuzzed, and why: paths write files wherever a generated string points
#: (their checks are tested in test_store.py and test_to_store.py), callables and dask
#: clients are not values, and a model or prompts argument is the data, not an option.
NOT_FUZZED = {
    "store": "a path: writes a store",
    "out_dir": "a path: writes a checkpoint",
    "checkpoint": "a path: writes a fit's state (checked in test_fit.py)",
    "path": "a path",
    "client": "a dask client",
    "detail": "a callback",
    "run": "a callback",
    "options": "**options",
    "fit_options": "**fit_options",
}
#: Public names that take no options (classes of results, an error type, a switch).
NO_OPTIONS = {
    "ArchLayout",
    "LayoutCheckError",
    "LensModel",
    "ModelSpec",
    "enable_offline",
    "weight_grid",
}

#: Values a careless or hurried user passes: wrong types, NaN, infinities, zero and
#: negative counts, empty and odd containers, strings where numbers belong.
bad_values = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            -(10**6),
            0.0,
            -0.5,
            1.5,
            float("nan"),
            float("inf"),
            -float("inf"),
            "",
            "nan",
            "3",
            "all",
            [],
            [None],
            ["a", 1],
            (),
            {},
            {"a": 1},
            b"x",
            1j,
            object(),
            np.float64("nan"),
            np.array([1, 2]),
            torch.zeros(2),
            xr.DataArray([np.nan]),
            xr.Dataset(),
        ]
    ),
    st.text(alphabet=string.ascii_letters + " :-_", max_size=6),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(min_value=-(10**9), max_value=0),
)


@dataclass
class World:
    """Everything the calls need, built once: a tiny model, prompts and one result of each
    kind that is passed back in."""

    model: Any
    pairs: Any
    task: Any
    mixed: Any
    clusters: Any
    gating: xr.Dataset
    masks: xr.Dataset
    report: xr.Dataset
    scores: xr.DataArray
    edges: xr.DataArray
    curve: xr.Dataset
    folder: Any


@pytest.fixture(scope="module")
def world(tiny_llama, factual, mixed, clusters, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved-tiny")
    tiny_llama.hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    task = lsc.data.task("syntax")[:4]
    edges = lsc.edge_attribution(tiny_llama, factual[:2], progress=False)
    return World(
        model=tiny_llama,
        pairs=factual[:2],
        task=task,
        mixed=mixed,
        clusters=clusters,
        gating=lsc.head_gating(
            tiny_llama, task, seeds=1, max_steps=2, window=1, batch_size=2, progress=False
        ),
        masks=lsc.block_masks(
            tiny_llama,
            mixed,
            clusters=clusters,
            max_steps=2,
            window=1,
            batch_size=1,
            progress=False,
        ),
        report=lsc.faithfulness(tiny_llama, factual[:2], estimators=["atp"], progress=False),
        scores=lsc.direct_logit_attribution(tiny_llama, factual[:2], progress=False),
        edges=edges,
        curve=lsc.circuit_faithfulness(
            tiny_llama, factual[:2], edges, fractions=(0.5,), n_random=1, progress=False
        ),
        folder=folder,
    )


def _fast_fit(**extra: Any) -> dict[str, Any]:
    return dict(max_steps=2, window=1, progress=False, **extra)


#: Per public function: its data arguments (built from the world) and option values that
#: keep a valid call cheap; ``fuzz`` adds the data arguments that are results passed back.
CALLS: dict[str, Any] = {
    "ablation": lambda w: ((w.model, w.pairs), dict(progress=False, level="block")),
    "activation_patching": lambda w: ((w.model, w.pairs), dict(progress=False, level="block")),
    "attribution_patching": lambda w: ((w.model, w.pairs), dict(progress=False)),
    "direct_logit_attribution": lambda w: ((w.model, w.pairs), dict(progress=False)),
    "capture_to": None,  # writes a store at a path: test_to_store.py
    "edge_attribution": lambda w: ((w.model, w.pairs), dict(progress=False)),
    "edge_patching": lambda w: (
        (w.model, w.pairs, lsc.circuit(w.edges, edges=2)),
        dict(progress=False),
    ),
    "edge_agreement": lambda w: (
        (w.model, w.pairs),
        dict(estimators=["eap"], n_top=2, n_random=2, progress=False),
    ),
    "circuit": lambda w: ((w.edges,), dict(edges=2)),
    "circuit_graph": lambda w: ((w.edges,), dict(edges=5)),
    "edge_heatmap": lambda w: ((w.edges,), dict()),
    "faithfulness_curve": lambda w: ((w.curve,), dict()),
    "circuit_faithfulness": lambda w: (
        (w.model, w.pairs, w.edges),
        dict(fractions=(0.5,), n_random=1, progress=False),
    ),
    "head_gating": lambda w: (
        (w.model, w.task),
        _fast_fit(seeds=1, batch_size=2),
    ),
    "gating_check": lambda w: ((w.model, w.gating, w.task), dict(n_random=20)),
    "task_loss": lambda w: ((w.model, w.task, None), dict()),
    "block_masks": lambda w: (
        (w.model, w.mixed),
        _fast_fit(clusters=w.clusters, batch_size=1),
    ),
    "block_mask_estimate": lambda w: ((w.model, w.mixed), dict(clusters=w.clusters)),
    "mask_comparison": lambda w: (
        (w.model, w.mixed, w.mixed[:8]),
        _fast_fit(clusters=w.clusters, sparsities=(0.5,), n_random=1),
    ),
    "masked_loss": lambda w: ((w.model, w.mixed[:2], w.masks["mask"]), dict()),
    "apply_mask": lambda w: ((w.model, w.masks["mask"].sel(cluster=0)), dict()),
    "attention_pattern": lambda w: ((w.model, "The cat sat"), dict(layer=0)),
    "logit_lens": lambda w: ((w.model, w.pairs[0]), dict()),
    "faithfulness": lambda w: ((w.model, w.pairs), dict(estimators=["atp"], progress=False)),
    "finetune": lambda w: ((w.model, ["The cat sat on the mat."]), dict(steps=1, progress=False)),
    "weight_importance": lambda w: ((w.model, ["The cat sat."]), dict(progress=False)),
    "weight_change": lambda w: ((w.model, w.model), dict()),
    "inspect_prompts": lambda w: ((w.model, w.pairs), dict()),
    "check": lambda w: ((w.model,), dict()),
    "load": lambda w: ((str(w.folder),), dict(device="cpu")),
    "from_hf": lambda w: ((w.model.hf, w.model.tokenizer), dict(device="cpu")),
    "heatmap": lambda w: ((w.scores.mean("prompt"),), dict(x="head", y="layer")),
    "agreement_chart": lambda w: ((w.report,), dict()),
    "export": None,  # writes a file at a path: test_offline.py
    "save": None,  # writes at a path: test_store.py and the round trips below
    "open": None,  # reads a path: test_store.py
    "recorded": lambda w: (("head_roles",), dict(task="math")),
    "Explorer": lambda w: ((w.scores,), dict()),
    "CircuitExplorer": lambda w: ((w.edges,), dict(edges=5)),
    "PromptForm": lambda w: ((lambda texts: w.scores,), dict(example=w.pairs[0])),
}
#: Data arguments that are results (or arrays) passed back in: fuzzed like options.
PASSED_BACK = {
    "gating_check": ["gating"],
    "task_loss": ["gates"],
    "masked_loss": ["masks"],
    "apply_mask": ["masks"],
    "circuit": ["scores"],
    "circuit_graph": ["scores", "circuit"],
    "edge_heatmap": ["scores"],
    "faithfulness_curve": ["result"],
    "edge_patching": ["circuit"],
    "circuit_faithfulness": ["scores"],
    "heatmap": ["da"],
    "agreement_chart": ["report"],
    "Explorer": ["data"],
    "CircuitExplorer": ["scores"],
}


def _public_functions() -> list[str]:
    names = []
    for name in lsc.__all__:
        obj = getattr(lsc, name)
        if name in NO_OPTIONS or inspect.ismodule(obj) or not callable(obj):
            continue
        names.append(name)
    return names


def _fuzzed_arguments(name: str) -> list[str]:
    params = inspect.signature(getattr(lsc, name)).parameters.values()
    options = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in NOT_FUZZED
    ]
    return options + PASSED_BACK.get(name, [])


def test_every_public_function_is_covered():
    """A new public function must be added to CALLS (None, with the reason, where it is
    not fuzzed here), so every public signature is fuzzed."""
    missing = sorted(set(_public_functions()) - set(CALLS))
    assert not missing, f"add {missing} to CALLS in tests/test_properties.py"
    assert not set(CALLS) - set(_public_functions()), "CALLS names a removed function"


def _call(name: str, world: World, argument: str, value: Any) -> Any:
    function = getattr(lsc, name)
    args, kwargs = CALLS[name](world)
    names = list(inspect.signature(function).parameters)
    if argument in names[: len(args)]:
        args = tuple(value if names[i] == argument else a for i, a in enumerate(args))
    else:
        kwargs = {**kwargs, argument: value}
    result = function(*args, **kwargs)
    if name == "apply_mask":  # a context manager: enter it once
        with result:
            pass
    return result


#: Functions whose valid calls take more than a few seconds over all examples.
SLOW = {
    "CircuitExplorer",
    "Explorer",
    "PromptForm",
    "block_mask_estimate",
    "edge_patching",
    "agreement_chart",
    "check",
    "circuit_faithfulness",
    "circuit_graph",
    "edge_agreement",
    "finetune",
    "head_gating",
    "weight_importance",
}
#: Known gaps, in modules this issue's owner does not own: each still fails the property
#: (strict: the mark must go once the module is fixed). Found on 2026-11-24.
KNOWN_GAPS = {}


def _param(name: str) -> Any:
    marks = [pytest.mark.slow] if name in SLOW else []
    if name in KNOWN_GAPS:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name]))
    return pytest.param(name, marks=marks, id=name)


FUZZED = [_param(name) for name in _public_functions() if CALLS.get(name) is not None]


@pytest.mark.parametrize("name", FUZZED)
def test_bad_values_work_or_are_refused_by_name(world, name):
    arguments = _fuzzed_arguments(name)
    if not arguments:
        pytest.skip(f"{name} takes no options")

    @settings(
        max_examples=6 if name in SLOW else 12,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(argument=st.sampled_from(arguments), value=bad_values)
    def check(argument: str, value: Any) -> None:
        try:
            _call(name, world, argument, value)
        except (TypeError, ValueError) as err:
            assert re.search(rf"\b{re.escape(argument)}\b", str(err)), (
                f"{name}({argument}={value!r}) raised {type(err).__name__} without naming "
                f"{argument!r}: {err}"
            )

    check()


# --------------------------------------------------------------------- storage round trips


@pytest.fixture(scope="module")
def real_results(world):
    """One result of each kind a method returns, on the tiny model."""
    model, pairs = world.model, world.pairs
    return {
        "ablation": lsc.ablation(model, pairs, level="block", progress=False),
        "attribution_all": lsc.attribution_patching(model, pairs, level="all", progress=False),
        "direct_logit_attribution": world.scores,
        "edge_attribution": world.edges,
        "head_gating": world.gating,
        "gating_check": lsc.gating_check(model, world.gating, world.task, n_random=20),
        "block_masks": world.masks,
        "faithfulness": world.report,
        "attention_pattern": lsc.attention_pattern(model, "The cat sat", layer=0),
        "logit_lens": lsc.logit_lens(model, pairs[0]),
        "weight_importance": lsc.weight_importance(model, ["The cat sat."], progress=False),
        "check": lsc.check(model),
    }


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_every_result_type_round_trips(real_results, tmp_path, suffix):
    for kind, result in real_results.items():
        back = lsc.open(lsc.save(result, tmp_path / f"{kind}{suffix}"))
        xr.testing.assert_identical(back, result)
        _assert_same_attr_types(back, result)


def _assert_same_attr_types(a: xr.DataArray | xr.Dataset, b: xr.DataArray | xr.Dataset) -> None:
    names = a.variables if isinstance(a, xr.Dataset) else a.coords
    pairs = [(a.attrs, b.attrs)] + [(a[v].attrs, b[v].attrs) for v in names]
    for left, right in pairs:
        assert {k: type(v) for k, v in left.items()} == {k: type(v) for k, v in right.items()}


attr_values = st.one_of(
    st.text(alphabet=string.printable + "éü→", max_size=8),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.booleans(),
)
attr_names = st.sampled_from(
    ["dtype", "model", "units", "long_name", "flag", "lambda_", "n_seeds", "layout_checked"]
)


@st.composite
def results(draw: st.DrawFn) -> xr.DataArray | xr.Dataset:
    """A schema-valid result: dims in canonical order, sizes 1-3, float (with NaN), bool or
    int values, component and prompt labels, scalar attrs of every allowed type."""
    dims = draw(
        st.lists(st.sampled_from(schema.DIMS[1:8]), min_size=1, max_size=3, unique=True).map(
            schema.ordered_dims
        )
    )
    sizes = [
        draw(st.integers(1, min(3, len(schema.BLOCK_COMPONENTS) if d == "component" else 3)))
        for d in dims
    ]
    coords: dict[str, Any] = {}
    if "component" in dims:
        coords["component"] = list(schema.BLOCK_COMPONENTS[: sizes[dims.index("component")]])
    if "prompt" in dims:
        n = sizes[dims.index("prompt")]
        coords["text"] = draw(st.lists(st.text(max_size=6), min_size=n, max_size=n))
        coords["category"] = draw(
            st.lists(st.sampled_from(["capital", "Été", ""]), min_size=n, max_size=n)
        )
    attrs = {
        **dict.fromkeys(schema.PROVENANCE_ATTRS, "x"),
        **draw(st.dictionaries(attr_names, attr_values, max_size=4)),
    }

    def values() -> np.ndarray:
        dtype = draw(st.sampled_from([np.float32, np.float64, np.bool_, np.int64]))
        size = int(np.prod(sizes))
        if dtype is np.bool_:
            flat = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        elif dtype is np.int64:
            flat = draw(st.lists(st.integers(-(2**40), 2**40), min_size=size, max_size=size))
        else:
            flat = draw(
                st.lists(
                    st.floats(allow_nan=True, allow_infinity=False, width=32),
                    min_size=size,
                    max_size=size,
                )
            )
        return np.asarray(flat, dtype=dtype).reshape(sizes)

    first = schema.make(values(), dims=dims, coords=coords, attrs=attrs)
    if draw(st.booleans()):
        return first.rename(draw(st.sampled_from([None, "scores", "mask"])))
    second = schema.make(values(), dims=dims, coords=coords, attrs=attrs)
    return xr.Dataset(
        {"mask": first, "keep_prob": second},
        attrs=draw(st.dictionaries(attr_names, attr_values, max_size=3)),
    )


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(result=results(), suffix=st.sampled_from([".zarr", ".nc"]))
def test_generated_results_round_trip_identically(tmp_path_factory, result, suffix):
    path = tmp_path_factory.mktemp("round-trip") / f"r{suffix}"
    back = lsc.open(lsc.save(result, path))
    xr.testing.assert_identical(back, result)
    _assert_same_attr_types(back, result)
    assert type(back) is type(result)
