"""Optional dependencies, imported when a feature needs them.

routecore itself needs only NumPy. Plots need the ``plot`` extra (matplotlib)
and ``routecore serve`` the ``server`` extra (grpcio, xds-protos, PyYAML,
prometheus-client); without them the feature fails with ``MissingExtra``,
which names the extra and the command that installs its packages.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from types import ModuleType


class MissingExtra(ImportError):
    """A feature's optional dependency is not installed."""


def require(extra: str, *modules: str) -> list[ModuleType]:
    """Imports ``modules``; ``MissingExtra`` naming ``extra`` if one is missing."""
    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        packages = " ".join(f"'{r}'" for r in extra_requirements(extra))
        direct = f"pip install {packages}, or " if packages else ""
        raise MissingExtra(
            f"this needs the '{extra}' extra ({e.name} is not installed): "
            f"{direct}in routecore's clone pip install '.[{extra}]'"
        ) from e


def extra_requirements(extra: str) -> list[str]:
    """The requirements of ``extra`` as the installed routecore declares them
    (``grpcio>=1.85.1``, ...); empty when routecore's metadata is not found."""
    try:
        declared = metadata.requires("routecore") or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""\bextra\s*==\s*["']{re.escape(extra)}["']""")
    return [r.split(";", 1)[0].strip() for r in declared if marker.search(r.partition(";")[2])]


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    (matplotlib,) = require("plot", "matplotlib")
    matplotlib.use("Agg")
    return require("plot", "matplotlib.pyplot")[0]
