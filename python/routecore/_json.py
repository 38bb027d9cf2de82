"""Strict JSON for every ``--json`` output and the RouteCore API's Plan.

``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which no JSON
parser but Python's accepts. ``strict`` replaces each non-finite float by
None and says why at a top-level ``"nulls"`` key (``{"fleets/2/pools/0/
utilization_model": "+inf: unbounded (saturated at this load)"}``), and
``dumps`` writes the result with ``allow_nan=False``.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Why a float is not finite, by its kind: a model's +inf is a quantity that
#: has no steady state (a saturated resource); NaN is an empty sample.
REASONS = {
    "inf": "+inf: unbounded (saturated at this load)",
    "-inf": "-inf: unbounded",
    "nan": "NaN: undefined (nothing to measure)",
}


def strict(data: Any) -> tuple[Any, dict[str, str]]:
    """``data`` with every non-finite float replaced by None, and the
    replaced paths (keys and list indices joined by ``/``) with their reason."""
    nulls: dict[str, str] = {}

    def clean(x: Any, path: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            nulls[path] = REASONS[repr(x)]
            return None
        if isinstance(x, dict):
            return {k: clean(v, f"{path}/{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
        return x

    return clean(data, ""), nulls


def dumps(data: dict[str, Any], **kwargs: Any) -> str:
    """``data`` as strict JSON: non-finite floats are null, listed under
    ``"nulls"`` with their reason; anything else not JSON is an error."""
    clean, nulls = strict(data)
    if nulls:
        clean["nulls"] = nulls
    return json.dumps(clean, allow_nan=False, **kwargs)
