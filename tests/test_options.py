"""Each shared option's default is written once (``sweep/options.DEFAULTS``), and every
public signature that takes a shared option shows that default."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lenscape as lsc
from lenscape.sweep import options, registry
from lenscape.sweep.options import DEFAULTS

SHARED = [f.name for f in dataclasses.fields(DEFAULTS)]
PACKAGE = Path(lsc.__file__).parent

#: (module, function, option): a default of the same name that means something else, kept.
OWN_MEANING = {
    # The fits' batch sizes are their protocol's (32 items per update in causal head gating,
    # texts per pass in the block-mask fit), not prompts per scoring pass, and never None.
    ("fits/gating.py", "task_loss", "batch_size"),
    ("fits/gating.py", "head_gating", "batch_size"),
    ("fits/gating.py", "gating_check", "batch_size"),
    ("fits/masks.py", "block_masks", "batch_size"),
    ("fits/masks.py", "masked_loss", "batch_size"),
    ("fits/masks.py", "mask_comparison", "batch_size"),
    ("fits/masks.py", "block_mask_estimate", "batch_size"),
    ("weights/maps.py", "weight_importance", "batch_size"),
    ("weights/finetune.py", "finetune", "batch_size"),
    # Sentences per pass of the sentence encoder.
    ("cluster.py", "embed", "batch_size"),
    # The backend a result names when no hook backend made it (weight maps read parameters).
    ("models/lens_model.py", "provenance", "backend"),
    # The rules apply to model.hf's own passes (which nnsight runs); "transformer_lens" adds
    # its bridge's. Below the options in the layers, so it cannot name DEFAULTS.
    ("sweep/relevance.py", "relevance_rules", "backend"),
    ("sweep/relevance.py", "check_covered", "backend"),
    ("sweep/relevance.py", "unsupported", "backend"),
    # A plan rebuilt from its data on a worker shows no bar of its own.
    ("sweep/plan.py", "build", "progress"),
    # None: the level the options give (batching for one level of a two-level method;
    # provenance of a result that has no level, such as edge scores).
    ("sweep/inputs.py", "batched", "level"),
    ("sweep/result.py", "provenance", "level"),
}


def _literal_defaults():
    """(file, function, option, literal) for every shared option given a literal default."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(
                zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True)
            )
            pairs += [
                (k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None
            ]
            for arg, default in pairs:
                if arg.arg in SHARED and isinstance(default, ast.Constant):
                    rel = path.relative_to(PACKAGE).as_posix()
                    yield rel, node.name, arg.arg, default.value


def test_shared_defaults_are_written_once():
    written = [d for d in _literal_defaults() if d[:3] not in OWN_MEANING]
    assert not written, (
        "shared options with a default written by hand (name it: "
        f"`= DEFAULTS.<option>` from lenscape.sweep.options): {written}"
    )


def _parameters():
    """(file, function, parameter) for every function parameter of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                for arg in a.posonlyargs + a.args + a.kwonlyargs:
                    yield rel, node.name, arg.arg


def test_the_exceptions_still_exist():
    """An entry of OWN_MEANING that no longer names a parameter is stale (its default may
    come from a declared table, as block_masks' batch_size from the mask fit's defaults)."""
    found = set(_parameters())
    assert found >= OWN_MEANING, OWN_MEANING - found


@pytest.mark.parametrize("name", sorted(lsc.__all__))
def test_public_signatures_show_the_shared_defaults(name):
    function = getattr(lsc, name)
    if not inspect.isfunction(function):
        return
    shown = inspect.signature(function)  # a registered method's whole signature
    function = inspect.unwrap(function)  # through torch.no_grad and functools.wraps
    module = Path(inspect.getfile(function)).relative_to(PACKAGE).as_posix()
    # a method may give a shared option its own default where the shared one means nothing
    declared = registry.METHODS[name].shared_defaults if name in registry.METHODS else {}
    for param in shown.parameters.values():
        own = (module, function.__name__, param.name) in OWN_MEANING
        if param.name in SHARED and not own and param.default is not inspect.Parameter.empty:
            expected = declared.get(param.name, getattr(DEFAULTS, param.name))
            assert param.default == expected, (name, param.name)


def test_choices_are_checked_once():
    with pytest.raises(ValueError, match="padding_side"):
        options.check_options({"padding_side": "middle"})
    with pytest.raises(TypeError, match="variants_per_pass"):
        options.check_options({"variants_per_pass": 2.5})


# ------------------------------------------------- every option checked before any pass


@contextlib.contextmanager
def _counted_passes(model: lsc.LensModel) -> Iterator[list[int]]:
    """Count the forward passes of ``model.hf`` (every backend's passes but
    TransformerLens's, which none of these calls uses) run inside the block."""
    count = [0]
    handle = model.hf.register_forward_pre_hook(
        lambda module, args: count.__setitem__(0, count[0] + 1)
    )
    try:
        yield count
    finally:
        handle.remove()


def _bad_values(name: str, default: Any) -> list[Any]:
    """Values no option ``name`` with this default takes: a bare object always; a
    made-up name for a choice; a negative count or NaN for a number; a bool where a count
    is asked; a count below 1 or a made-up rule set for the options whose default is None."""
    values: list[Any] = [object()]
    if isinstance(default, bool):
        return [*values, "yes"]
    if isinstance(default, str):
        return [*values, "bogus"]
    if isinstance(default, (int, float)):
        return [*values, -1, math.nan, True]
    return values + {"refine": [0, "bogus"], "steps": [0], "rules": ["bogus"]}.get(name, [])


@pytest.fixture(scope="module")
def calls(tiny_llama, factual, clusters):
    """Public function -> (positional arguments, valid keyword options), each call of which
    runs when its options are good; the options a test leaves alone are their defaults."""
    prompts = factual[:2]
    scores = lsc.edge_attribution(tiny_llama, prompts, progress=False)
    task = lsc.data.task("syntax")[:6]
    gating = lsc.head_gating(tiny_llama, task, seeds=1, max_steps=2, window=1, progress=False)
    texts = lsc.data.prompts("mixed")[::10]
    made = {name: ((tiny_llama, prompts), {}) for name in registry.METHODS}
    made.pop("_edge_variants")
    made["attention_pattern"] = ((tiny_llama, prompts), {"layer": 0})
    made["edge_patching"] = ((tiny_llama, prompts, lsc.circuit(scores, edges=5)), {})
    made["circuit_faithfulness"] = ((tiny_llama, prompts, scores), {})
    made["exact_cut"] = ((tiny_llama, prompts, lsc.circuit(scores, edges=5), scores), {})
    per_prompt = lsc.edge_attribution(tiny_llama, prompts, per_prompt=True, progress=False)
    made["consensus_faithfulness"] = ((tiny_llama, prompts, per_prompt), {"n_resamples": 4})
    made["head_gating"] = ((tiny_llama, task), {})
    made["gating_check"] = ((tiny_llama, gating, task), {})
    made["task_loss"] = ((tiny_llama, task), {})
    made["block_masks"] = ((tiny_llama, texts), {"clusters": clusters})
    made["block_mask_estimate"] = ((tiny_llama, texts), {"clusters": clusters})
    made["mask_comparison"] = ((tiny_llama, texts, texts), {"clusters": clusters})
    made["weight_importance"] = ((tiny_llama, prompts), {})
    made["finetune"] = ((tiny_llama, prompts), {})
    made["check"] = ((tiny_llama,), {})
    return made


def test_every_bad_option_is_refused_before_any_forward_pass(calls, tiny_llama):
    """For every public function that runs a model and every one of its options: each bad
    value raises a TypeError or ValueError naming the option, and no forward pass of the
    model has run by then (composites check all their parts' options first)."""
    slipped = []
    for name, (args, valid) in calls.items():
        parameters = inspect.signature(getattr(lsc, name)).parameters
        quiet = {"progress": False} if "progress" in parameters else {}
        for option, parameter in parameters.items():
            if parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
                continue
            for bad in _bad_values(option, parameter.default):
                with _counted_passes(tiny_llama) as passes:
                    try:
                        getattr(lsc, name)(*args, **{**quiet, **valid, option: bad})
                    except (TypeError, ValueError) as err:
                        if option not in str(err) or passes[0]:
                            slipped.append((name, option, bad, passes[0], str(err)[:150]))
                    else:
                        slipped.append((name, option, bad, passes[0], "accepted"))
    assert not slipped, "\n".join(map(str, slipped))


@pytest.mark.parametrize(
    "function, options, message",
    [
        ("activation_patching", dict(rules="bogus"), r"rules='bogus'"),
        ("activation_patching", dict(rules="secant"), r"rules='secant' chooses the relevance"),
        ("activation_patching", dict(estimator="relp", rules="secant"), r"without refine"),
        ("activation_patching", dict(estimator="ig", steps=4), r"without refine"),
        ("ablation", dict(refine=10**6), r"refine must be an integer from 1 to"),
        ("ablation", dict(refine="bogus"), r"refine must be a positive integer, 'auto'"),
        ("ablation", dict(tol=0.1), r"tol=0.1 choose\(s\) what refine='auto'"),
        ("activation_patching", dict(refine=3, top=5), r"top=5 choose\(s\)"),
        ("activation_patching", dict(refine="auto", tol=0), r"tol must be a finite number"),
        ("activation_patching", dict(refine="auto", tol=-1.0), r"tol must be a finite number"),
        ("activation_patching", dict(refine="auto", top=0), r"top must be a positive"),
        ("attribution_patching", dict(error=True, level="all"), r"error=True takes level="),
    ],
)
def test_options_that_clash_are_refused_before_any_pass(
    tiny_llama, factual, function, options, message
):
    with _counted_passes(tiny_llama) as passes, pytest.raises(ValueError, match=message):
        getattr(lsc, function)(tiny_llama, factual[:2], progress=False, **options)
    assert passes[0] == 0


@pytest.mark.parametrize("report", ["faithfulness", "edge_agreement"])
def test_a_report_refuses_relevance_rules_its_model_cannot_run_before_any_part(
    tokenizer, factual, report
):
    """A report whose estimators include RelP, on a family the rules do not support (the
    secant rules on routed experts), refuses before its first part runs (it used to after
    10 and 2 passes)."""
    mixtral = lsc.models.tiny("mixtral", tokenizer=tokenizer)
    with _counted_passes(mixtral) as passes, pytest.raises(ValueError, match=r"relp"):
        getattr(lsc, report)(mixtral, factual[:2], estimators=["relp:secant"], progress=False)
    assert passes[0] == 0
