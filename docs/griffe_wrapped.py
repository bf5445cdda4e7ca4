"""A griffe extension for the reference (mkdocs.yml, mkdocstrings ``extensions:``): document
a ``functools.wraps`` wrapper as Python shows it, not the function it wraps.

griffe unwraps a wrapped function before reading it, so a registered method
(``lenscape.sweep.registry.method``) would show the function it wraps: a signature ending
in ``**shared`` and an ``Args:`` section without the shared options. The wrapper carries the
whole signature (``__signature__``) and the completed docstring (``__doc__``); this
extension puts both back, so the reference shows what ``help(lsc.ablation)`` shows.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe


def _default(parameter: inspect.Parameter) -> str | None:
    if parameter.default is inspect.Parameter.empty:
        return None
    return getattr(parameter.default, "__name__", None) or repr(parameter.default)


def _annotation(parameter: inspect.Parameter) -> str | None:
    if parameter.annotation is inspect.Parameter.empty:
        return None
    value = parameter.annotation
    return value if isinstance(value, str) else inspect.formatannotation(value)


class RuntimeWrappers(griffe.Extension):
    """Read a wrapped function's signature and docstring from the wrapper itself."""

    def on_function_instance(self, *, node: Any, func: griffe.Function, **kwargs: Any) -> None:
        """Replace the unwrapped function's docstring and parameters by the wrapper's."""
        parent = getattr(getattr(node, "parent", None), "obj", None)
        runtime = getattr(parent, getattr(node, "name", ""), None)
        if runtime is None or not hasattr(runtime, "__wrapped__"):
            return
        doc = inspect.getdoc(runtime)
        if doc:
            old = func.docstring
            func.docstring = griffe.Docstring(
                doc,
                parent=func,
                lineno=old.lineno if old else None,
                parser=old.parser if old else None,
                parser_options=old.parser_options if old else None,
            )
        func.parameters = griffe.Parameters(
            *[
                griffe.Parameter(
                    p.name,
                    annotation=_annotation(p),
                    kind=griffe.ParameterKind[p.kind.name.lower()],
                    default=_default(p),
                )
                for p in inspect.signature(runtime).parameters.values()
            ]
        )
