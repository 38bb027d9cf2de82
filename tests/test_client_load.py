"""The Rust ext_proc load client (``routecore._core.load``, ``routecore client --load``)
against ``routecore serve`` in its own process: bounded, loopback only. Speed is
reported, never asserted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy")

from server_fixtures import Spawned, example_without_engines, free_port  # noqa: E402

from routecore import cli  # noqa: E402
from routecore._core import load  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, int]]:
    example = example_without_engines(tmp_path_factory.mktemp("load"))
    s = Spawned(example, None, "--log-level", "warning")
    yield s.target, s.proc.pid
    s.stop()


def test_closed_loop_routes_every_conversation_and_reads_server_counters(server):
    target, pid = server
    # Enough conversations that the server's CPU spans many of the kernel's
    # 10 ms clock ticks: 300 took 17 ms once and read as 0 ticks.
    report = load(target, requests=3000, concurrency=8, body_bytes=4096, server_pid=pid)
    print(report)
    assert (report["requests"], report["refused"], report["errors"]) == (3000, 0, 0)
    assert report["statuses"] == {"OK": 3000} and report["refusals"] == {}
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    assert report["server_cpu_ms"] > 0 and report["server_context_switches"] > 0
    assert report["client_cpu_ms"] >= 0


@pytest.mark.slow
def test_a_paced_run_of_3000_routes_every_conversation(server):
    target, pid = server
    report = load(target, requests=3000, concurrency=32, rate=500.0, server_pid=pid)
    print(report)
    assert (report["requests"], report["refused"], report["errors"]) == (3000, 0, 0)
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    assert report["server_cpu_ms"] > 0


def test_paced_run_starts_conversations_on_schedule(server):
    target, _ = server
    report = load(target, requests=50, concurrency=4, rate=250.0)
    # The last of 50 starts at 49 / 250 s: pacing cannot finish sooner.
    assert report["seconds"] >= 49 / 250
    assert (report["requests"], report["errors"]) == (50, 0)
    assert report["server_cpu_ms"] is None


def test_a_wrong_key_is_refused_not_an_error(server):
    target, _ = server
    report = load(target, requests=20, concurrency=2, api_key="wrong")
    assert (report["refused"], report["errors"]) == (20, 0)
    assert report["statuses"] == {"OK": 20} and report["refusals"] == {"401": 20}


def test_duration_bounds_the_run(server):
    target, _ = server
    report = load(target, requests=10**9, concurrency=2, rate=100.0, duration_s=0.3)
    assert 0 < report["requests"] <= 40


def test_cli_prints_one_json_report(server, capsys):
    target, _ = server
    argv = ["client", "--load", "--target", target, "--requests", "40", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 40 and report["errors"] == 0


@pytest.mark.parametrize(
    "bad",
    [
        ["--rate", "-1"],
        ["--rate", "nan"],
        ["--concurrency", "0"],
        ["--concurrency", "1000000"],
        ["--requests", "-5"],
        ["--body-bytes", "x"],
        ["--body-bytes", str(1 << 40)],
        ["--server-pid", "0"],
        ["--threads", "0"],
        ["--duration", "inf"],
        ["--timeout", "0"],
        ["--response-delay", "-1"],
        ["--target", "nohost"],
        ["--target", "h:70000"],
    ],
)
def test_cli_refuses_bad_options_in_one_line(bad, capsys):
    assert cli.main(["client", "--load", "--target", "127.0.0.1:1", *bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("routecore client: error: ")
    assert bad[0] in err


def test_unreachable_target_is_one_error_line(capsys):
    port = free_port()
    assert cli.main(["client", "--load", "--target", f"127.0.0.1:{port}", "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("routecore client: error: cannot connect") and "\n" == err[-1]


def test_load_checks_its_arguments():
    with pytest.raises(ValueError):
        load("127.0.0.1:1", requests=0)
    with pytest.raises(ValueError):
        load("127.0.0.1:1", rate=float("nan"))
    with pytest.raises(ValueError):
        load("127.0.0.1:1", threads=0)
    with pytest.raises(ValueError):
        load("127.0.0.1:1", timeout_s=0.0)
    with pytest.raises(ValueError):
        load("127.0.0.1:1", response_delay_s=float("nan"))
