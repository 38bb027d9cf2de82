"""Profiles from TOML files.

TOML because Python reads it with the standard library (``tomllib``, 3.11+;
the ``tomli`` backport before), so a profile file needs no extra dependency,
and its typed numbers and ``[tables]`` fit a flat list of fields. A file holds
one profile: either the fields of ``routecore.Profile`` at the top level, or
``preset = "llama3_70b_a100"`` (or ``"qwen3_235b_mi300x"``) with fields that
override it::

    name = "llama3-70b-h100"
    preset = "llama3_70b_a100"
    w_s = 0.004
    h_s = 0.00032
    price_per_gpu_hour = 4.02
"""

from __future__ import annotations

import os
import sys
from os import PathLike
from typing import Any

from routecore._core import Profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib

PRESETS = {
    "llama3_70b_a100": Profile.llama3_70b_a100,
    "qwen3_235b_mi300x": Profile.qwen3_235b_mi300x,
}
#: The profile of the commands that take one (Llama-3-70B on A100-80GB).
DEFAULT_PRESET = "llama3_70b_a100"


def profile_from_dict(fields: dict[str, Any]) -> Profile:
    """A Profile from a mapping of its fields, optionally over a ``preset``."""
    fields = dict(fields)
    preset = fields.pop("preset", None)
    if preset is None:
        if "name" not in fields:
            raise ValueError("a profile needs a name (or a preset)")
        name = fields.pop("name")
        return Profile(name, **fields)
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    return PRESETS[preset]().replace(**fields)


def load_profile(path: str | PathLike[str]) -> Profile:
    """Reads a Profile from a TOML file (see the module docs for the format)."""
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from e
    try:
        return profile_from_dict(data)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from e


def resolve(spec: str | PathLike[str]) -> Profile:
    """A preset by name (``PRESETS``) or else a Profile read from a TOML file:
    what every ``--profile`` option accepts."""
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]()
    if not os.path.isfile(spec):
        raise ValueError(
            f"profile {str(spec)!r}: neither a preset ({', '.join(PRESETS)}) nor a TOML file"
        )
    return load_profile(spec)
