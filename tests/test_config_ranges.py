"""The serve config's numbers are checked by one table (routecore.config.RANGES):
every number of every section is refused just outside the range the table
gives it, with the table's words and the key's path."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from routecore.config import COUNT, FINITE, RANGES, ConfigError, parse_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "routecore.yaml"


def _base() -> dict[str, Any]:
    """The example file with every section the table names present."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    endpoint = raw["pools"][0]["endpoints"][0]
    raw["kv_events"] = {"endpoints": {endpoint: {"zmq": "tcp://127.0.0.1:5557"}}}
    raw["pools"][0]["disaggregation"] = {"decider": "never"}
    raw["admission"]["redis"] = {}
    return raw


#: Each section of the table: where it sits in the file and the path its errors name.
SECTIONS = {
    "server": (lambda r: r["server"], "server"),
    "limits": (lambda r: r["limits"], "limits"),
    "router": (lambda r: r["router"], "router"),
    "router.saturation": (lambda r: r["router"]["saturation"], "router.saturation"),
    "router.objectives": (lambda r: r["router"]["objectives"], "router.objectives"),
    "scrape": (lambda r: r["scrape"], "scrape"),
    "admission": (lambda r: r["admission"], "admission"),
    "admission.redis": (lambda r: r["admission"]["redis"], "admission.redis"),
    "pools": (lambda r: r["pools"][0], "pools[0]"),
    "pools.disaggregation": (lambda r: r["pools"][0]["disaggregation"], "pools[0].disaggregation"),
    "tenants": (lambda r: r["tenants"][0], "tenants[0]"),
    "kv_events": (lambda r: r["kv_events"], "kv_events"),
    "flow_control.saturation": (
        lambda r: r["flow_control"]["saturation"],
        "flow_control.saturation",
    ),
    "autoscale": (lambda r: r["autoscale"], "autoscale"),
    "autoscale.pools": (lambda r: r["autoscale"]["pools"][0], "autoscale.pools[0]"),
}


def _outside(rule: Any) -> list[Any]:
    """Values just outside the rule's range, and of the wrong type."""
    if rule is COUNT:
        return [-1, 1.5, True]
    if rule is FINITE:
        return [math.inf, math.nan, True, "1"]
    if rule.as_float:
        return [rule.lo - abs(rule.lo) * 1e-6 - 1e-9, rule.hi * 1.000001 + 1e-9, True, "1"]
    return [rule.lo - 1, rule.hi + 1, 1.5, True, "1"]


CASES = [
    (section, key, rule, value)
    for section, rules in RANGES.items()
    for key, rule in rules.items()
    for value in _outside(rule)
]


def test_every_section_of_the_table_is_tried():
    assert set(RANGES) == set(SECTIONS)
    parse_config(_base())  # the base file is valid


@pytest.mark.parametrize(("section", "key", "rule", "value"), CASES)
def test_a_number_outside_its_range_is_refused_with_the_tables_words(section, key, rule, value):
    raw = _base()
    at, where = SECTIONS[section]
    key = "interactive" if key == "*" else key
    at(raw)[key] = value
    with pytest.raises(ConfigError) as e:
        parse_config(copy.deepcopy(raw))
    assert str(e.value) == f"{where}.{key}: expected {rule.expected}, got {value!r}"


@pytest.mark.parametrize("section", ["limits", "scrape", "kv_events", "server"])
def test_a_number_at_its_bounds_is_taken_as_given(section):
    """Each bound of a section without cross-checks is accepted and lands in
    the Config as given (a Num as a float)."""
    for key, rule in RANGES[section].items():
        if section == "limits" and key in {"max_body_bytes", "max_buffered_bytes"}:
            continue  # max_buffered_bytes >= max_body_bytes, checked apart
        for bound in (rule.lo, rule.hi):
            raw = _base()
            SECTIONS[section][0](raw)[key] = bound
            got = getattr(getattr(parse_config(raw), section), key)
            assert got == bound and type(got) is (float if rule.as_float else int)
