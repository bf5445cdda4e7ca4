"""Plans as data: a built plan pickles and runs in another process without its pre-pass."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
import xarray as xr

from lenscape.capture import patching
from lenscape.sweep.inputs import tokenize
from lenscape.sweep.options import Options
from lenscape.sweep.plan import Call, PlanData, run_in_memory

# Runs in another process (forked by the warm server, which never saw the plan): rebuild the
# plan from its pickled data on a model loaded from its recipe, with the pre-pass functions
# and the tokenizer made to fail (the plan carries its tokens), and pickle the result back.
FRESH_PROCESS = """
import pickle, sys
import cloudpickle
from lenscape.capture.patching import ablation, refine
from lenscape.sweep.plan import run_in_memory

def redone(*args, **kwargs):
    raise AssertionError("the pre-pass ran again")

ablation._site_means = refine._refined_columns = refine._auto_refinement = redone
folder = sys.argv[1]
data = pickle.loads(open(f"{folder}/plan.pkl", "rb").read())
model = cloudpickle.loads(open(f"{folder}/recipe.pkl", "rb").read())()

class NoTokenising:
    def __init__(self, tokenizer):
        self.pad_token_id = tokenizer.pad_token_id

    def __call__(self, *args, **kwargs):
        raise AssertionError("the prompts were tokenised again")

model.tokenizer = NoTokenising(model.tokenizer)
result = run_in_memory(data.build(model), progress=False)
open(f"{folder}/result.pkl", "wb").write(pickle.dumps(result))
"""


@pytest.mark.parametrize(
    ("planner", "options", "prepass"),
    [
        (
            patching.plan_ablation,
            {"kind": "mean", "variants_per_pass": None, "refine": 7},
            {"means", "columns"},
        ),
        (
            patching.plan_activation_patching,
            {"variants_per_pass": 4, "refine": 5, "estimator": "ig", "steps": 2, "rules": None},
            {"columns"},
        ),
        (
            patching.plan_activation_patching,
            {
                "variants_per_pass": None,
                "refine": "auto",
                "tol": None,
                "top": 3,
                "estimator": "atp",
                "steps": None,
                "rules": None,
            },
            {"auto"},
        ),
    ],
)
def test_plan_pickles_and_runs_in_another_process(
    tiny_llama, factual, tmp_path, planner, options, prepass, warm_python
):
    name = {
        patching.plan_ablation: "ablation",
        patching.plan_activation_patching: "activation_patching",
    }[planner]
    checked = Options.of(
        name,
        dict(
            level="head", metric="logit_diff", batch_size=3, backend="nnsight", padding_side="right"
        )
        | options,
    )
    tokens = tokenize(tiny_llama, factual[:7], needs_corrupt=True, needs_distractor=True)
    plan = planner(Call(tiny_llama, tokens, checked))
    expected = run_in_memory(plan, progress=False)
    data = PlanData.of(planner, checked, plan)
    assert set(data.prepass) == prepass
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(data))
    (tmp_path / "recipe.pkl").write_bytes(cloudpickle.dumps(tiny_llama.recipe))
    warm_python.run(FRESH_PROCESS, str(tmp_path))
    got = pickle.loads((tmp_path / "result.pkl").read_bytes())
    # Same coords, attrs (but whether lsc.check ran on that process's copy of the model)
    # and NaN pattern; numbers to float32 rounding (a fresh process may sum in another order).
    xr.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert {**got.attrs, "layout_checked": None} == {**expected.attrs, "layout_checked": None}
    np.testing.assert_array_equal(np.isnan(got.values), np.isnan(expected.values))
    if options["refine"] == "auto":  # the estimates and the cells came with the plan
        np.testing.assert_array_equal(got["measured"].values, expected["measured"].values)
        assert 0 < expected["measured"].values.sum() < expected.size
        return
    measured = ~np.isnan(expected.values).all(axis=0)
    assert measured.sum() == options["refine"]  # the refined columns came with the plan
