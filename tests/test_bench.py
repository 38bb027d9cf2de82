"""``routecore bench``: every hot path beside its plain-Python twin, from the
installed package. Timings are printed, never asserted."""

from __future__ import annotations

import json

import pytest

from routecore._baselines.cases import CASES
from routecore.cli import main

NAMES = [
    "route",
    "route_many",
    "block_hashes",
    "prefix_pick",
    "vtc",
    "admission",
    "assign",
    "erlang_c",
    "ext_proc_conversation",
]


def test_fast_json_has_every_case_with_positive_ratios(capsys):
    assert [c.name for c in CASES] == NAMES
    assert main(["bench", "--seconds", "0.01", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["results"]
    assert [r["name"] for r in out["results"]] == NAMES
    for r in out["results"]:
        print(r["name"], round(r["routecore_ns"]), round(r["python_ns"]), round(r["ratio"], 2))
        assert {"name", "routecore_ns", "python_ns", "ratio"} <= set(r)
        assert 0 < r["routecore_min_ns"] <= r["routecore_ns"]
        assert 0 < r["python_min_ns"] <= r["python_ns"]
        assert r["ratio"] == pytest.approx(r["python_ns"] / r["routecore_ns"])
        assert r["ratio"] > 0


def test_table_for_chosen_cases(capsys):
    assert main(["bench", "--seconds", "0.01", "--only", "route", "--only", "erlang_c"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "case" and "min / median" in lines[0]
    assert [x.split()[0] for x in lines[2:4]] == ["route", "erlang_c"]
    assert lines[2].endswith("x") and lines[-1].startswith("ratio: Python-twin median")


@pytest.mark.parametrize("bad", [["--seconds", "0"], ["--seconds", "nan"], ["--only", "nope"]])
def test_bad_options_exit_2(bad, capsys):
    assert main(["bench", *bad]) == 2
    assert capsys.readouterr().err.startswith("routecore bench: error: ")


def test_each_twin_computes_what_routecore_computes():
    """The plain-Python twins are references of the same calls, not stand-ins."""
    by_name = {c.name: c for c in CASES}
    with by_name["block_hashes"].calls() as (rc, py):
        assert rc().tolist() == py()
    with by_name["erlang_c"].calls() as (rc, py):
        assert rc() == pytest.approx(py(), rel=1e-12)
    with by_name["route"].calls() as (rc, py):
        assert rc().pool == "short" and py() == 0
    with by_name["assign"].calls() as (rc, py):
        assert rc().tolist() == py()
    with by_name["route_many"].calls() as (rc, py):
        assert rc().tolist() == py().tolist()
    with by_name["vtc"].calls() as (rc, py):
        assert [rc() for _ in range(2000)] == [py() for _ in range(2000)]
    with by_name["prefix_pick"].calls() as (rc, py):
        assert [rc() for _ in range(3)] == [py() for _ in range(3)]


def test_each_stateful_twin_answers_as_routecore_call_after_call():
    """The admission pair (every pair admitted on both sides; the twin's
    decisions are checked on random traffic in benches/bench_admission.py) and
    the whole ext_proc conversation: the same protobuf answers (pool, endpoint,
    metadata) for each message of each conversation."""
    by_name = {c.name: c for c in CASES}
    with by_name["admission"].calls() as (rc, py):
        assert all(rc() is not None and py() is not None for _ in range(500))
    with by_name["ext_proc_conversation"].calls() as (rc, py):
        for _ in range(5):
            answers = rc()
            assert answers == py()
            assert answers[1].request_body.response.header_mutation.set_headers
