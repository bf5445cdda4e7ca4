"""Streaming capture into zarr: same result as in memory, resume after a real SIGKILL,
refusal of foreign stores and unwritable paths."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xarray as xr
from _helpers import answered_prompts, reference_correct, small_tokenizer, torch_threads

import lenscape as lsc
from lenscape import store


@pytest.mark.parametrize(
    "method, options",
    [
        ("ablation", {"kind": "zero"}),
        ("ablation", {"kind": "mean", "level": "block"}),
        ("activation_patching", {}),
        ("attribution_patching", {"level": "all"}),
        ("direct_logit_attribution", {}),
    ],
)
def test_streamed_equals_in_memory(tiny_llama, factual, tmp_path, method, options):
    prompts = factual[:7]  # 3 batches of 3, the last one short
    fn = getattr(lsc, method)
    expected = fn(tiny_llama, prompts, batch_size=3, progress=False, **options)
    streamed = fn(
        tiny_llama, prompts, batch_size=3, store=tmp_path / "r.zarr", progress=False, **options
    )
    assert streamed.chunks is not None  # lazily opened, dask-backed
    xr.testing.assert_identical(streamed.compute(), expected)
    # lsc.capture_to is the same thing, by function or by name
    again = lsc.capture_to(
        tmp_path / "r2.zarr", fn, tiny_llama, prompts, batch_size=3, progress=False, **options
    )
    xr.testing.assert_identical(again.compute(), expected)


def test_resume_skips_finished_batches_and_keeps_them(tiny_llama, factual, tmp_path, monkeypatch):
    from lenscape.sweep import streaming

    path, prompts = tmp_path / "r.zarr", factual[:8]
    written = []
    real_write = streaming.write_batch

    def failing_write(plan, number, *args, **kwargs):
        if number == 2:
            raise KeyboardInterrupt  # the user stops the run during batch 2
        written.append(number)
        return real_write(plan, number, *args, **kwargs)

    monkeypatch.setattr(streaming, "write_batch", failing_write)
    with pytest.raises(KeyboardInterrupt):
        lsc.capture_to(path, "ablation", tiny_llama, prompts, batch_size=2, progress=False)
    partial = lsc.open(path)  # not computed yet: NaN, never 0
    assert np.isfinite(partial.values[:4]).all() and np.isnan(partial.values[4:]).all()
    written.clear()
    monkeypatch.setattr(
        streaming, "write_batch", lambda *a, **k: (written.append(a[1]), real_write(*a, **k))
    )
    result = lsc.capture_to(path, "ablation", tiny_llama, prompts, progress=False)
    assert written == [2, 3]  # batch size taken from the store; batches 0 and 1 kept
    xr.testing.assert_identical(
        result.compute(), lsc.ablation(tiny_llama, prompts, batch_size=2, progress=False)
    )


def test_store_made_by_another_capture_is_refused(tiny_llama, factual, tmp_path, tokenizer):
    path = tmp_path / "r.zarr"
    lsc.capture_to(path, "ablation", tiny_llama, factual[:4], batch_size=2, progress=False)
    other_model = lsc.models.tiny("qwen3", n_layers=2, tokenizer=tokenizer)
    cases = [
        (dict(method="activation_patching"), "method: store 'ablation', now 'activation_patching'"),
        (dict(model=other_model), "model: store 'tiny-llama', now 'tiny-qwen3'"),
        (dict(prompts=factual[1:5]), "prompts_sha256"),
        (dict(metric="logprob"), "metric: store 'logit_diff', now 'logprob'"),
        (dict(batch_size=4), "resume it with batch_size=2"),
    ]
    for change, message in cases:
        args = dict(method="ablation", model=tiny_llama, prompts=factual[:4], batch_size=2)
        args.update(change)
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            lsc.capture_to(
                path,
                args.pop("method"),
                args.pop("model"),
                args.pop("prompts"),
                progress=False,
                **args,
            )
    # overwrite=True starts over with the new settings
    fresh = lsc.capture_to(
        path,
        "ablation",
        tiny_llama,
        factual[:4],
        metric="logprob",
        batch_size=2,
        overwrite=True,
        progress=False,
    )
    assert fresh.attrs["metric"] == "logprob"


def test_a_store_is_resumed_only_by_the_model_that_made_it(tokenizer, factual, tmp_path):
    """Same name and layout but other weights, a bfloat16 copy, or the same model edited
    through ``param.data``: each is refused naming what differs, never handed the stored
    scores; the model that made the store resumes it."""
    path = tmp_path / "r.zarr"
    args = dict(batch_size=2, progress=False)
    made = lsc.ablation(
        lsc.models.tiny("llama", tokenizer=tokenizer), factual[:4], store=path, **args
    )
    other = lsc.models.tiny("llama", seed=1, tokenizer=tokenizer)
    assert other.name == made.attrs["model"]
    with pytest.raises(ValueError, match=r"holds a different capture.*weights_sha256: store"):
        lsc.ablation(other, factual[:4], store=path, **args)
    cast = lsc.models.tiny("llama", tokenizer=tokenizer)
    cast.hf.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype: store 'float32', now 'bfloat16'"):
        lsc.ablation(cast, factual[:4], store=path, **args)
    edited = lsc.models.tiny("llama", tokenizer=tokenizer)
    edited.hf.model.layers[0].mlp.up_proj.weight.data[0] += 1
    with pytest.raises(ValueError, match=r"weights_sha256: store"):
        lsc.ablation(edited, factual[:4], store=path, **args)
    again = lsc.ablation(
        lsc.models.tiny("llama", tokenizer=tokenizer), factual[:4], store=path, **args
    )
    xr.testing.assert_identical(again.load(), made.load())


def test_unusable_store_paths(tiny_llama, factual, tmp_path):
    def capture(path):
        return lsc.capture_to(path, "ablation", tiny_llama, factual[:2], progress=False)

    with pytest.raises(ValueError, match="does not exist"):
        capture(tmp_path / "missing" / "r.zarr")
    with pytest.raises(ValueError, match=r"ending in '\.zarr'"):
        capture(tmp_path / "r.nc")
    (tmp_path / "file.zarr").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        capture(tmp_path / "file.zarr")
    (tmp_path / "junk.zarr").mkdir()
    with pytest.raises(ValueError, match="not a lenscape capture store"):
        capture(tmp_path / "junk.zarr")


def _make_read_only(folder) -> bool:
    """chmod 555, and for root (which ignores modes) the immutable attribute."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        return subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    return True


def test_read_only_location(tiny_llama, factual, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    lsc.capture_to(folder / "done.zarr", "ablation", tiny_llama, factual[:2], progress=False)
    if not _make_read_only(folder) or not _make_read_only(folder / "done.zarr"):
        pytest.fail("could not make a read-only folder (chattr +i failed)")
    try:
        with pytest.raises(ValueError, match="read-only"):
            lsc.capture_to(folder / "new.zarr", "ablation", tiny_llama, factual[:2], progress=False)
        with pytest.raises(ValueError, match="read-only"):
            lsc.capture_to(
                folder / "done.zarr", "ablation", tiny_llama, factual[:2], progress=False
            )
    finally:
        for path in (folder / "done.zarr", folder):
            if os.geteuid() == 0:
                subprocess.run(["chattr", "-i", str(path)], capture_output=True)
            path.chmod(0o755)


CHILD = textwrap.dedent("""
    import sys
    import torch
    import lenscape as lsc
    torch.set_num_threads(int(sys.argv[2]))  # the parent's: reductions split by thread
    prompts = lsc.data.prompts("factual")[:4]
    model = lsc.load("smollm2-135m", device="cpu")
    lsc.capture_to(sys.argv[1], "activation_patching", model, prompts, level="block",
                   batch_size=2, progress=False)
""")


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_equals_uninterrupted(smol, factual, tmp_path, warm_python):
    # blocks, not heads: what is checked is the store, at 60 exact passes a batch, not 270;
    # two batches of two: killed after the first, the second is the one resumed
    prompts, path = factual[:4], tmp_path / "killed.zarr"
    child = warm_python.popen(CHILD, str(path), str(torch.get_num_threads()))
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and child.poll() is None:
            if path.exists():
                try:
                    if store.progress(path)[1].sum() >= 2:
                        break
                except ValueError:  # layout still being written
                    pass
            time.sleep(0.05)
        assert child.poll() is None, "the child finished or died before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    done = store.progress(path)[1]
    assert 2 <= done.sum() < len(prompts), f"killed with {done.sum()} prompts done"
    resumed = lsc.capture_to(
        path, "activation_patching", smol, prompts, level="block", batch_size=2, progress=False
    ).compute()
    uninterrupted = lsc.capture_to(
        tmp_path / "whole.zarr",
        "activation_patching",
        smol,
        prompts,
        level="block",
        batch_size=2,
        progress=False,
    ).compute()
    xr.testing.assert_identical(resumed, uninterrupted)
    assert np.isfinite(resumed.values).all()
    assert not list(path.rglob("*.partial"))


@pytest.mark.parametrize(
    "method, options",
    [("direct_logit_attribution", {}), ("attribution_patching", {"level": "all"})],
)
def test_correct_flags_are_streamed_batch_by_batch_and_resumed(
    tiny_llama, factual, tmp_path, monkeypatch, method, options
):
    from lenscape.sweep import streaming

    prompts = answered_prompts(tiny_llama, factual[:8])
    expected = reference_correct(tiny_llama, prompts)
    assert expected.any() and not expected.all()
    path, fn, real_write = tmp_path / "r.zarr", getattr(lsc, method), streaming.write_batch

    def failing_write(plan, number, *args, **kwargs):
        if number == 2:
            raise KeyboardInterrupt  # stopped after two batches of two
        return real_write(plan, number, *args, **kwargs)

    monkeypatch.setattr(streaming, "write_batch", failing_write)
    with pytest.raises(KeyboardInterrupt):
        fn(tiny_llama, prompts, batch_size=2, store=path, progress=False, **options)
    partial = lsc.open(path)
    np.testing.assert_array_equal(partial["correct"].values[:4], expected[:4])
    monkeypatch.setattr(streaming, "write_batch", real_write)
    resumed = fn(tiny_llama, prompts, batch_size=2, store=path, progress=False, **options)
    np.testing.assert_array_equal(resumed["correct"].values, expected)
    in_memory = fn(tiny_llama, prompts, batch_size=2, progress=False, **options)
    xr.testing.assert_identical(resumed.compute(), in_memory)


# ---------------------------------------------------------- every method on one core

#: The methods that joined the plan core, with options, and how to read their result.
NEWER = [
    ("edge_attribution", {"per_prompt": True}),
    ("logit_lens", {}),
    ("attention_pattern", {"layer": 1}),
]


@pytest.mark.parametrize("method, options", NEWER)
def test_newer_methods_stream_and_equal_in_memory(tiny_llama, factual, tmp_path, method, options):
    prompts = factual[:7]  # 3 batches of 3, the last one short
    fn = getattr(lsc, method)
    expected = fn(tiny_llama, prompts, batch_size=3, progress=False, **options)
    streamed = fn(
        tiny_llama, prompts, batch_size=3, store=tmp_path / "r.zarr", progress=False, **options
    )
    assert streamed.chunks is not None  # lazily opened, dask-backed
    xr.testing.assert_identical(streamed.compute(), expected)
    again = lsc.capture_to(
        tmp_path / "r2.zarr", method, tiny_llama, prompts, batch_size=3, progress=False, **options
    )
    xr.testing.assert_identical(again.compute(), expected)


def test_prompt_inspection_streams(tiny_llama, factual, tmp_path):
    expected = lsc.inspect_prompts(tiny_llama, factual[:5], batch_size=2, progress=False)
    streamed = lsc.inspect_prompts(
        tiny_llama, factual[:5], batch_size=2, store=tmp_path / "i.zarr", progress=False
    )
    xr.testing.assert_identical(streamed.data, expected.data)


def test_edge_mean_from_a_store_equals_the_mean_in_memory(tiny_llama, factual, tmp_path):
    expected = lsc.edge_attribution(tiny_llama, factual[:5], batch_size=2, progress=False)
    streamed = lsc.edge_attribution(
        tiny_llama, factual[:5], batch_size=2, store=tmp_path / "e.zarr", progress=False
    )
    assert streamed.dims == ("sender", "receiver") and streamed.dtype == np.float64
    xr.testing.assert_identical(streamed, expected)
    # the store keeps the per-prompt scores, with the model's own answers
    assert lsc.open(tmp_path / "e.zarr").dims == ("prompt", "sender", "receiver")


KILLED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    import torch
    torch.set_num_threads(1)
    import lenscape as lsc
    from lenscape import models
    from lenscape.sweep import streaming
    from _helpers import small_tokenizer

    write = streaming.write_batch

    def slow_write(*args, **kwargs):  # a batch every 0.2 s: time to be killed mid-run
        write(*args, **kwargs)
        time.sleep(0.2)

    if sys.argv[2] == "slow":  # the run to be killed; the others write at full speed
        streaming.write_batch = slow_write
    model = models.tiny("llama", n_layers=3, seed=0, tokenizer=small_tokenizer())
    prompts = lsc.data.prompts("factual")[:6]
    {call}
""")

#: method -> the call the child makes (and the parent repeats), into ``sys.argv[1]``.
KILLED_CALLS = {
    "edge_attribution": "lsc.edge_attribution(model, prompts, batch_size=1, per_prompt=True, "
    "store=sys.argv[1], progress=False)",
    "logit_lens": "lsc.logit_lens(model, prompts, batch_size=1, store=sys.argv[1], progress=False)",
    "faithfulness": "lsc.faithfulness(model, prompts, batch_size=1, store=sys.argv[1], "
    "progress=False)",
}


def _kill_when(child, ready) -> None:
    """SIGKILL ``child`` as soon as ``ready()`` is true (fail if it ends first)."""
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.poll() is None and not ready():
            time.sleep(0.02)
        assert child.poll() is None, "the child finished or died before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()


def _done(path) -> int:
    try:
        return int(store.progress(path)[1].sum())
    except ValueError:  # no store yet, or its layout is still being written
        return 0


def _stored(path) -> dict[str, xr.Dataset | xr.DataArray]:
    """What a store holds (under "") or every part store of a composite method's folder (by
    name)."""
    if path.suffix == ".zarr":
        return {"": store.open_result(path)}
    return {p.name: store.open_result(p) for p in sorted(path.glob("*.zarr"))}


@pytest.mark.parametrize("method", ["edge_attribution", "logit_lens", "faithfulness"])
def test_newer_methods_resume_after_sigkill_to_identical_numbers(tmp_path, method, warm_python):
    """A run killed mid-store and run again in another process (so nothing but the store
    carries over) ends with the store an uninterrupted run of the same call writes (made
    here, at the child's one torch thread)."""
    from pathlib import Path

    path = tmp_path / ("parts" if method == "faithfulness" else "killed.zarr")
    # faithfulness keeps its parts in a folder: kill it inside its second part
    watched = path / "exact_block.zarr" if method == "faithfulness" else path
    code = KILLED.replace("{call}", KILLED_CALLS[method])
    helpers = str(Path(__file__).parent)
    child = warm_python.popen(code, str(path), "slow", helpers)
    _kill_when(child, lambda: _done(watched) >= 2)
    assert 2 <= _done(watched) < 6
    warm_python.run(code, str(path), "", helpers)
    whole = tmp_path / ("whole" if method == "faithfulness" else "whole.zarr")
    uninterrupted_call = {
        "lsc": lsc,
        "model": lsc.models.tiny("llama", n_layers=3, seed=0, tokenizer=small_tokenizer()),
        "prompts": lsc.data.prompts("factual")[:6],
        "sys": SimpleNamespace(argv=[None, str(whole)]),
    }
    with torch_threads(1):
        exec(KILLED_CALLS[method], uninterrupted_call)  # the child's call, word for word
    resumed, uninterrupted = _stored(path), _stored(whole)
    assert list(resumed) == list(uninterrupted) and resumed
    for name, result in resumed.items():
        xr.testing.assert_identical(result, uninterrupted[name])
        assert not np.isnan(result.to_array() if isinstance(result, xr.Dataset) else result).all()
    assert not list(path.rglob("*.partial"))
