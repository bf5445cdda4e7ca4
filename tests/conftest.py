"""Shared fixtures: tiny seeded random models (Llama, Qwen3, GPT-2 shapes) and the bundled model.

Tiny models use ``tokenizer``: the bundled SmolLM2 tokenizer cut down to the words of the
built-in prompt sets (``_helpers.small_tokenizer``, about 1,600 tokens instead of 49,152),
so the prompt sets work on them unchanged and their embeddings and logits stay small.
``smol_tokenizer`` is the full one. Real-model fixtures are session-scoped and their tests
marked ``slow`` (still run in CI).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core (pytest-xdist): one thread each, here and in
    # the processes a test starts (notebook kernels, children killed mid-run).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)

TINY_ARCHITECTURES = ("llama", "qwen3", "gpt2")


@pytest.fixture(scope="session")
def tokenizer():
    """The small-vocabulary test tokenizer (same pieces as SmolLM2's on built-in texts)."""
    from _helpers import small_tokenizer

    return small_tokenizer()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The bundled SmolLM2 tokenizer, vocabulary 49,152."""
    from lenscape import models

    return models.tokenizer_for("smollm2-135m")


@pytest.fixture(scope="session", params=TINY_ARCHITECTURES)
def tiny_model(request, tokenizer):
    from lenscape import models

    return models.tiny(request.param, n_layers=3, seed=0, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def device():
    """Where tests marked ``device`` run: the device ``LENSCAPE_TEST_DEVICE`` names, else
    CUDA when it is available, else the CPU (``benchmarks/gpu_check.py`` runs them on a
    GPU)."""
    name = os.environ.get("LENSCAPE_TEST_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    return torch.device(name)


@pytest.fixture(scope="session")
def tiny_llama(tokenizer):
    from lenscape import models

    return models.tiny("llama", n_layers=3, seed=0, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def linear_tail_model(tokenizer):
    """A tiny GPT-2 whose last block and final norm are linear: the metric is linear in every
    activation of the last layer (its heads, attention block and MLP block)."""
    import transformers

    import lenscape as lsc

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="linear",
        initializer_range=0.3,
    )
    hf_model = transformers.GPT2LMHeadModel(config)
    hf_model.transformer.ln_f = torch.nn.Identity()
    hf_model.transformer.h[-1].ln_2 = torch.nn.Identity()
    return lsc.from_hf(
        hf_model,
        tokenizer,
        name="tiny-gpt2-linear-tail",
        device="cpu",
        dtype="float64",
        check=False,
    )


#: Bundled models loaded in this worker, by name (``bundled``).
_LOADED: dict = {}


def _bundled(name: str):
    """The bundled model ``name`` (float32, CPU), loaded once per worker: a load is 7-12 s."""
    import lenscape as lsc

    if name not in _LOADED:
        _LOADED[name] = lsc.load(name, device="cpu")
    return _LOADED[name]


@pytest.fixture(scope="session")
def bundled():
    """``bundled(name)``: a bundled model by name, shared with ``smol`` and every test of the
    worker that asks for the same name (lenscape's calls leave a model as they found it)."""
    return _bundled


@pytest.fixture(scope="session")
def smol():
    return _bundled("smollm2-135m")


@pytest.fixture(scope="session")
def smol64():
    """The bundled model in float64: exactness checks free of float32 reduction-order noise
    (batched vs single-prompt float32 runs differ by up to ~4e-5 in logit difference)."""
    import lenscape as lsc

    return lsc.load("smollm2-135m", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def factual():
    import lenscape as lsc

    return lsc.data.prompts("factual")


@pytest.fixture(scope="session")
def mixed():
    """32 texts of the mixed set, 4 of each kind (clustering and block masks)."""
    import lenscape as lsc

    return lsc.data.prompts("mixed")[::10]


@pytest.fixture(scope="session")
def clusters(mixed):
    """``mixed`` embedded with the bundled sentence encoder, in 4 k-means clusters."""
    from lenscape import cluster

    return cluster.kmeans(cluster.embed(mixed), 4, prompts=mixed)


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory):
    """Children forked from a warm server that imported torch, nnsight and lenscape once
    (``_warm.WarmPython``): processes of their own without ~10 s of imports each."""
    from pathlib import Path

    from _warm import WarmPython

    server = WarmPython(tmp_path_factory.mktemp("warm"), Path(__file__).parent)
    yield server
    server.close()


@pytest.fixture(scope="session")
def fresh_runs(warm_python):
    """``fresh_runs(code)`` runs ``code`` in two processes of their own (forked by
    ``warm_python``, with a fresh interpreter's random state), at this process's torch thread
    count (reductions split by thread), and returns the JSON each printed on its last line:
    for checks that a result does not depend on the process."""
    import json

    def run(code: str) -> list:
        threads = f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n"
        return [json.loads(warm_python.run(threads + code).splitlines()[-1]) for _ in range(2)]

    return run


def pytest_collection_modifyitems(items):
    """The tests marked ``slow`` (real models, notebooks, fresh processes) run first: with
    two workers stealing work, a minutes-long test started last would run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def no_pass(monkeypatch, tiny_llama):
    """Makes every forward pass of ``tiny_llama``'s nnsight backend fail: a check that must
    come before any pass fails its test otherwise."""
    from lenscape.sweep.backend import get_backend

    backend = get_backend(tiny_llama, "nnsight")

    def refuse(*args, **kwargs):
        raise AssertionError("a pass ran before the check")

    monkeypatch.setattr(type(backend), "run", refuse)
