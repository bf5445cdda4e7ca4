"""One registry of methods (``sweep/registry.py``): a method is added in one file, and the
public API, ``capture_to`` and the docs' list all come from the registry."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lenscape as lsc
from lenscape import capture
from lenscape.sweep import registry
from lenscape.sweep.options import DESCRIPTIONS

TOY = textwrap.dedent('''
    """A toy method: the clean logit of the target, per prompt."""

    from typing import Any

    import torch

    from ..sweep.backend import get_backend
    from ..sweep.plan import Plan, Scores, top_is_target
    from ..sweep.inputs import batched
    from ..sweep.registry import method, run
    from ..sweep.result import prompt_coords, provenance
    from .. import schema


    def plan_toy(call):
        model, options = call.model, call.options
        inputs = batched(model, call.tokens, options)

        def score(batch, step):
            with torch.no_grad():
                logits = get_backend(model, options.backend).run(batch.clean).logits
            step()
            rows = torch.arange(len(batch.index))
            return Scores(logits[rows, batch.target][:, None], top_is_target(logits, batch.target))

        def finish(values, correct, index):
            return schema.make(
                values[:, 0], dims=("prompt",), coords=prompt_coords(inputs, index, correct),
                attrs={"long_name": "target logit", "units": "logits",
                       **provenance(inputs, "toy")},
            )

        return Plan(inputs, 1, score, finish, desc="toy")


    @method(plan_toy)
    def toy(model, prompts, **shared) -> Any:
        """The clean logit of each prompt's target."""
        return run(toy, locals())
''')

USE_TOY = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    import lenscape as lsc
    from lenscape import models
    from _helpers import small_tokenizer
    model = models.tiny("llama", n_layers=2, seed=0, tokenizer=small_tokenizer())
    prompts = lsc.data.prompts("factual")[:3]
    logits = lsc.toy(model, prompts, progress=False)
    stored = lsc.capture_to(sys.argv[1], "toy", model, prompts, batch_size=2, progress=False)
    assert abs(stored.compute() - logits).max() < 1e-4 and "toy" in lsc.__all__
    assert "batch_size: prompts per forward pass" in lsc.toy.__doc__
    print("toy ok")
""")


def test_a_method_is_added_by_one_file(tmp_path):
    """A copy of the package with one new file, capture/toy.py: the method is public, streams
    by name and has its shared options described, with no other file touched."""
    package = Path(lsc.__file__).parent
    copy = tmp_path / "toolkit" / "lenscape"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "capture" / "toy.py").write_text(TOY)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "toolkit"), "OMP_NUM_THREADS": "1"}
    helpers = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", USE_TOY, str(tmp_path / "toy.zarr"), helpers],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "toy ok" in done.stdout


def test_every_public_capture_function_is_registered():
    """What lenscape exports from lenscape.capture is the registry's public methods, plus
    ``capture_to``, ``circuit``, ``circuit_stability`` and ``consensus_circuit`` (which run
    no method)."""
    exported = {
        name
        for name in lsc.__all__
        if getattr(getattr(lsc, name), "__module__", "").startswith("lenscape.capture")
    }
    public = {name for name, spec in registry.METHODS.items() if spec.public}
    assert exported == public | {"capture_to", "circuit", "circuit_stability", "consensus_circuit"}
    for name in public:
        assert getattr(lsc, name) is registry.METHODS[name].function


def test_every_method_states_its_options_once_in_its_signature():
    """Options are keyword-only parameters; every shared one the signature takes is
    described in the docstring (from ``DESCRIPTIONS``), in signature order."""
    for spec in registry.METHODS.values():
        parameters = list(inspect.signature(spec.function).parameters)
        assert parameters[:2] == ["model", "prompts"], spec.name
        doc = inspect.getdoc(spec.function) or ""
        args = doc.split("\nArgs:\n")[1].split("\n\n")[0]
        named = [line.split(":")[0].strip() for line in args.splitlines() if line[4] != " "]
        described = [n.strip() for entry in named for n in entry.split(",")]
        for name in parameters:
            if name in DESCRIPTIONS:
                assert name in described, (spec.name, name)
        order = [parameters.index(n) for n in described if n in parameters]
        assert order == sorted(order), spec.name


def test_shared_options_are_declared_once_not_in_each_signature(tiny_llama):
    """A method's own code declares only its own options; the shared ones (and where it
    runs) come from one table (``options.DEFAULTS``/``DESCRIPTIONS``) into its signature."""
    shared = set(DESCRIPTIONS) - {"model", "prompts"}
    for spec in registry.METHODS.values():
        own = inspect.signature(inspect.unwrap(spec.function)).parameters
        assert not shared & set(own), (spec.name, sorted(shared & set(own)))
        shown = inspect.signature(spec.function).parameters
        assert {"store", "client", "progress"} <= set(shown), spec.name
    with pytest.raises(TypeError, match="unexpected keyword argument 'levle'"):
        lsc.ablation(tiny_llama, lsc.data.prompts("factual")[:1], levle="block")


def test_streaming_methods_can_be_named_to_capture_to():
    streamable = {n for n, s in registry.METHODS.items() if s.planner and not s.streams}
    assert {"ablation", "edge_attribution", "logit_lens", "inspect_prompts"} <= streamable
    with pytest.raises(ValueError, match="capture_to cannot stream 'faithfulness'"):
        lsc.capture_to("x.zarr", "faithfulness", None, [])


def test_listing_names_every_method_once():
    rows = registry.listing()
    assert [row["method"] for row in rows] == list(registry.METHODS)
    assert {row["store="] for row in rows} == {
        "one .zarr store",
        "a folder: one .zarr store per part",
    }
    assert capture.__all__ == sorted(capture.__all__)


def test_a_second_method_of_the_same_name_is_refused():
    def ablation(model, prompts, *, progress=True):
        """Another."""

    with pytest.raises(ValueError, match="Two methods are named 'ablation'"):
        registry.method(None)(ablation)
