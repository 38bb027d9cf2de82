"""Optional dependencies, imported when a feature needs them.

``pip install routecore`` needs only NumPy. Plots need the ``plot`` extra
(matplotlib) and ``routecore serve`` the ``server`` extra (grpcio, xds-protos,
PyYAML, prometheus-client); without them the feature fails with
``MissingExtra``, which names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """A feature's optional dependency is not installed."""


def require(extra: str, *modules: str) -> list[ModuleType]:
    """Imports ``modules``; ``MissingExtra`` naming ``extra`` if one is missing."""
    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        raise MissingExtra(
            f"this needs the '{extra}' extra ({e.name} is not installed): "
            f"pip install 'routecore[{extra}]'"
        ) from e


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    (matplotlib,) = require("plot", "matplotlib")
    matplotlib.use("Agg")
    return require("plot", "matplotlib.pyplot")[0]
