"""Each shared option's default is written once (``sweep/options.DEFAULTS``), and every
public signature that takes a shared option shows that default."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import lenscape as lsc
from lenscape.sweep import options
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
    for param in shown.parameters.values():
        own = (module, function.__name__, param.name) in OWN_MEANING
        if param.name in SHARED and not own and param.default is not inspect.Parameter.empty:
            assert param.default == getattr(DEFAULTS, param.name), (name, param.name)


def test_choices_are_checked_once():
    with pytest.raises(ValueError, match="padding_side"):
        options.check_options({"padding_side": "middle"})
    with pytest.raises(TypeError, match="variants_per_pass"):
        options.check_options({"variants_per_pass": 2.5})
