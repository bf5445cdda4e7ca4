"""The installed lenscape's version, read without importing anything heavy: ``lenscape
--version`` shows it, and every result carries it (``schema.make``'s ``lenscape_version``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """lenscape's version from its installed metadata; ``"0+unknown"`` from a source tree
    that was never installed."""
    try:
        return version("lenscape")
    except PackageNotFoundError:
        return "0+unknown"
