"""``routecore._json``: strict JSON for every --json output."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routecore._json import dumps, strict


def test_non_finite_floats_become_null_with_their_reason():
    data = {"a": 1.5, "b": [math.inf, {"c": -math.inf, "d": math.nan}], "e": "x", "f": None}
    text = dumps(data)
    back = json.loads(text)
    assert back == {
        "a": 1.5,
        "b": [None, {"c": None, "d": None}],
        "e": "x",
        "f": None,
        "nulls": {
            "b/0": "+inf: unbounded (saturated at this load)",
            "b/1/c": "-inf: unbounded",
            "b/1/d": "NaN: undefined (nothing to measure)",
        },
    }
    assert "nulls" not in json.loads(dumps({"a": [1.0, 2]}))
    with pytest.raises(TypeError):
        dumps({"a": object()})  # anything else not JSON is an error


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(JSONISH)
def test_strict_keeps_every_finite_value_and_nulls_exactly_the_rest(data):
    clean, nulls = strict(data)
    json.dumps(clean, allow_nan=False)  # never raises

    def walk(x, y, path):
        if isinstance(x, float) and not math.isfinite(x):
            assert y is None and path in nulls
        elif isinstance(x, dict):
            for k in x:
                walk(x[k], y[k], f"{path}/{k}" if path else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, y[i], f"{path}/{i}" if path else str(i))
        else:
            assert x == y

    walk(data, clean, "")
