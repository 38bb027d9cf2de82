"""End to end through the real stack (tests/realstack.py): an OpenAI client's
requests (plain HTTP) to Envoy's listener, routecore choosing among real vLLM
engines on CPU, answers JSON and SSE. What each engine did is read from the
engine itself (its /metrics, its /tokenize) and from Envoy's access log
(the endpoint routecore chose and the one Envoy connected to).
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from envoy_proxy import Envoy, shipped_config
from realstack import KEYS, MAX_BODY_BYTES, SLOW_S, Stack, wait_scraped
from server_fixtures import Spawned, free_port, wait_for
from tiny_model import BOS, EOS, MODEL_NAME, TEMPLATE
from vllm_engine import BLOCK_SIZE, VllmEngine

import routecore

pytestmark = pytest.mark.realstack

WORDS = "the router token budget pool prefix cache engine model prompt queue tenant".split()


def prompt(seed: int, words: int = 160) -> str:
    """A prompt of about ``words`` tokens (several KV blocks), one per seed."""
    rng = np.random.default_rng(seed)
    return f"{seed}: " + " ".join(rng.choice(WORDS, size=words))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **extra}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    #: For a stream: each SSE event's data and when it arrived (monotonic s).
    events: list[tuple[float, str]] = field(default_factory=list)
    sent_at: float = 0.0

    def json(self) -> Any:
        return json.loads(self.body)


def send(
    url: str,
    body: dict[str, Any] | bytes,
    key: str | None = KEYS["demo"],
    test_id: str | None = None,
    timeout: float = 120,
    started: threading.Event | None = None,
) -> Answer:
    """POSTs ``body`` to ``url``'s /v1/chat/completions with the tenant's
    ``key``; a stream's events are read as they arrive (``started`` is set
    at the first)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["x-api-key"] = key
    if test_id is not None:
        headers["x-test-id"] = test_id
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        sent_at = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=data, headers=headers)
        r = conn.getresponse()
        answer = Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, b"", sent_at=sent_at)
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            answer.body = r.read()
            return answer
        chunks = []
        try:
            for line in iter(r.readline, b""):
                chunks.append(line)
                if line.startswith(b"data: "):
                    answer.events.append((time.monotonic(), line[6:].decode().strip()))
                    if started is not None:
                        started.set()
        except (http.client.IncompleteRead, ConnectionError):
            pass  # a cut stream: what arrived is kept
        answer.body = b"".join(chunks)
        return answer
    finally:
        conn.close()


def engine_counts(stack: Stack, name: str = "vllm:request_success_total") -> dict[str, float]:
    return {e.address: e.metric(name) for e in stack.engines if e.healthy()}


def known_blocks(replica: Spawned, endpoint: str) -> float:
    return replica.metric("routecore_kv_blocks", endpoint=endpoint)


def cache_on(stack: Stack, engine: VllmEngine, content: str) -> int:
    """Sends ``content`` to ``engine`` directly (not through Envoy) so its
    prefix cache holds it, and waits until every replica knows the new blocks
    (the engine's KV events); the number of full KV blocks of the prompt."""
    before = [known_blocks(r, engine.address) for r in stack.replicas]
    answer = send(engine.url, chat(content, max_tokens=1), key=None)
    assert answer.status == 200, answer.body
    blocks = answer.json()["usage"]["prompt_tokens"] // BLOCK_SIZE
    wait_for(
        lambda: all(
            known_blocks(r, engine.address) >= b + blocks for r, b in zip(stack.replicas, before)
        ),
        SLOW_S,
        f"{blocks} new blocks of {engine.address} known to every replica",
    )
    return blocks


def tokenizer(stack: Stack) -> routecore.Tokenizer:
    return routecore.Tokenizer(
        stack.model_dir / "tokenizer.json", TEMPLATE, bos_token=BOS, eos_token=EOS
    )


# -- the tokenizer --------------------------------------------------------------


CONVERSATIONS = [
    [{"role": "user", "content": "hello the router"}],
    [
        {"role": "system", "content": "You route tokens.\n\tBe brief."},
        {"role": "user", "content": "数据 路由 模型: which pool?"},
        {"role": "assistant", "content": "the short one  "},
        {"role": "user", "content": "def f(x):\n    return x == 42 -> {z} // é ü 😀"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_routecore_tokenizer_reproduces_the_engines_prompt_ids(stack: Stack, messages) -> None:
    engine = stack.engines[0]
    with_ids = send(
        engine.url,
        {**chat("", max_tokens=1), "messages": messages, "return_token_ids": True},
        key=None,
    )
    assert with_ids.status == 200, with_ids.body
    expected = with_ids.json()["prompt_token_ids"]
    assert tokenizer(stack).encode_chat(messages).tolist() == expected
    assert with_ids.json()["usage"]["prompt_tokens"] == len(expected)


# -- routing ----------------------------------------------------------------------


def test_each_request_reaches_the_endpoint_routecore_chose(stack: Stack) -> None:
    assert stack.envoy is not None
    before = engine_counts(stack)
    ids = [f"route-{uuid.uuid4()}" for _ in range(9)]
    for i, test_id in enumerate(ids):
        answer = send(stack.url, chat(prompt(100 + i, 20), max_tokens=4), test_id=test_id)
        assert answer.status == 200, answer.body
        assert answer.json()["usage"]["completion_tokens"] == 4
    entries = [stack.envoy.entry(i) for i in ids]
    for e in entries:
        # routecore named one endpoint (then its fallbacks); Envoy went there.
        assert e["upstream"] == e["chosen"].split(",")[0], e
        assert e["status"] == 200
    # Each engine's own count of finished requests agrees.
    after = engine_counts(stack)
    served = {a: after[a] - before[a] for a in after}
    chosen = {a: sum(e["upstream"] == a for e in entries) for a in after}
    assert served == chosen
    # With the engines idle and the queue scorer, more than one was used.
    assert sum(1 for n in chosen.values() if n) >= 2, chosen


def test_a_prompt_cached_on_an_engine_is_routed_there(stack: Stack) -> None:
    assert stack.envoy is not None
    for target in stack.engines:
        content = prompt(int(time.time() * 1000) % 100_000)
        blocks = cache_on(stack, target, content)
        assert blocks >= 4
        hits = engine_counts(stack, "vllm:prefix_cache_hits_total")
        test_id = f"cached-{uuid.uuid4()}"
        answer = send(stack.url, chat(content, max_tokens=2), test_id=test_id)
        assert answer.status == 200, answer.body
        assert stack.envoy.entry(test_id)["upstream"] == target.address
        after = engine_counts(stack, "vllm:prefix_cache_hits_total")
        # vLLM's own count: the cached blocks were hit on that engine, none elsewhere.
        assert after[target.address] - hits[target.address] >= blocks * BLOCK_SIZE
        assert all(after[a] == hits[a] for a in after if a != target.address)


# -- answers --------------------------------------------------------------------


def test_json_answer_arrives_whole_and_its_usage_is_learned(stack: Stack) -> None:
    content = "数据 路由 模型 数据 路由 模型 数据"
    assert routecore.classify(content) == "cjk"
    answer = send(stack.url, chat(content, max_tokens=5))
    assert answer.status == 200, answer.body
    body = answer.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The replica that routed it learned bytes per token from the engine's usage
    # (the first observation of a category is taken as it is).
    ratio = len(content.encode()) / usage["prompt_tokens"]
    learned = [r.metric("routecore_calibration_ratio", category="cjk") for r in stack.replicas]
    assert sorted(learned) == pytest.approx([0.0, ratio])


def test_sse_arrives_intact_as_it_is_generated(stack: Stack) -> None:
    content = "def route(x):\n    return pool[x] if x in pool else None\n"
    assert routecore.classify(content) == "code"
    n = 1500
    body = chat(
        content,
        max_tokens=n,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
    )
    answer = send(stack.url, body)
    assert answer.status == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    data = [d for _, d in answer.events]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert len({e["id"] for e in events}) == 1
    *chunks, last = events
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # Every generated token once, in chunks (vLLM joins tokens when the
    # reader lags), the last chunk with the finish reason.
    tokens = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert len(tokens) == n
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish == [None] * (len(chunks) - 1) + ["length"]
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == n
    # Not buffered: the first event came long before the last.
    times = [t for t, _ in answer.events]
    assert times[0] - answer.sent_at < 0.5 * (times[-1] - answer.sent_at)
    # The usage event was learned from.
    ratio = len(content.encode()) / usage["prompt_tokens"]
    learned = [r.metric("routecore_calibration_ratio", category="code") for r in stack.replicas]
    assert sorted(learned) == pytest.approx([0.0, ratio])


# -- refusals -------------------------------------------------------------------


def test_refusals_through_envoy(stack: Stack) -> None:
    before = engine_counts(stack)
    body = chat("hello the router", max_tokens=4)
    for key, status in ((None, 401), ("not-a-key", 401), (KEYS["old"], 403)):
        answer = send(stack.url, body, key=key)
        assert answer.status == status, answer.body
        assert answer.json()["error"]["code"] == status
    big = chat("x " * MAX_BODY_BYTES, max_tokens=4)
    answer = send(stack.url, big)
    assert answer.status == 413
    assert answer.json()["error"]["type"] == "body-too-large"
    assert engine_counts(stack) == before  # nothing reached an engine


def test_over_concurrency_is_429_with_retry_after(stack: Stack) -> None:
    # The tight tenant may hold one request at a time.
    long = chat("hello the router", max_tokens=1900, ignore_eos=True, stream=True)
    holding: list[Answer] = []
    streaming = threading.Event()
    t = threading.Thread(
        target=lambda: holding.append(send(stack.url, long, KEYS["tight"], started=streaming))
    )
    t.start()
    try:
        # Held from its first token (an engine's /metrics can miss a stream
        # of a few seconds).
        assert streaming.wait(SLOW_S) and not holding, f"the held stream: {holding}"
        answer = send(stack.url, chat("hello", max_tokens=2), KEYS["tight"])
        assert answer.status == 429, answer.body
        assert float(answer.headers["retry-after"]) > 0
        assert answer.json()["error"]["code"] == 429
    finally:
        t.join(timeout=120)
    assert holding[0].status == 200
    # The slot is free again once the stream ended.
    wait_for(
        lambda: send(stack.url, chat("hello", max_tokens=2), KEYS["tight"]).status == 200, SLOW_S
    )


def without_key_removal(config: dict) -> dict:
    """An Envoy configuration whose routes keep the tenant's key (no
    ``request_headers_to_remove``): only routecore may remove it."""
    config = copy.deepcopy(config)
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for h in manager["route_config"]["virtual_hosts"] for r in h["routes"]]
    assert all(r.pop("request_headers_to_remove") == ["x-api-key"] for r in routes)
    return config


def forwarded_key(stack: Stack, envoy: Envoy) -> tuple[str | None, str | None]:
    """Sends a request through ``envoy`` (answered 200); the ``x-api-key``
    of Envoy's access log and the one the engine that served it received
    (None: none)."""
    test_id = f"key-{uuid.uuid4()}"
    answer = send(envoy.url, chat("hello", max_tokens=2), test_id=test_id)
    assert answer.status == 200, answer.body
    entry = envoy.entry(test_id)
    (received,) = [
        h for h in stack.engine(entry["upstream"]).received() if h.get("x-test-id") == test_id
    ]
    return entry["key"], received.get("x-api-key")


def test_the_tenant_key_never_reaches_an_engine(stack: Stack, envoy: Callable[..., Envoy]) -> None:
    engines = [e.address for e in stack.engines]
    replicas = [r.target for r in stack.replicas]
    assert stack.envoy is not None
    # The shipped file: Envoy's route and routecore both remove it.
    assert forwarded_key(stack, stack.envoy) == (None, None)
    # routecore alone (its ext_proc header mutation).
    shipped = shipped_config("envoy.yaml", free_port(), replicas, engines)
    alone = envoy(without_key_removal(shipped), access_log=True)
    assert forwarded_key(stack, alone) == (None, None)
    # Without routecore (fail-open, routecore unreachable) Envoy's route alone
    # removes it; and nothing else would: the key reached the engine, and the
    # access log and the engine show it (so the checks above can fail).
    dead = [f"127.0.0.1:{free_port()}"]
    fail_open = shipped_config("envoy-fail-open.yaml", free_port(), dead, engines)
    assert forwarded_key(stack, envoy(fail_open, access_log=True)) == (None, None)
    fail_open = shipped_config("envoy-fail-open.yaml", free_port(), dead, engines)
    leaky = envoy(without_key_removal(fail_open), access_log=True)
    assert forwarded_key(stack, leaky) == (KEYS["demo"], KEYS["demo"])


# -- failures -------------------------------------------------------------------


def test_routecore_killed_fails_closed_and_recovers_on_restart(stack: Stack) -> None:
    before = engine_counts(stack)
    for r in stack.replicas:
        r.proc.send_signal(signal.SIGKILL)
        r.proc.wait(timeout=10)
    # examples/envoy.yaml: failure_mode_allow false, so no request reaches an
    # engine unrouted (README, "Failure behaviour").
    for _ in range(3):
        answer = send(stack.url, chat("hello", max_tokens=2))
        assert answer.status >= 500
    assert engine_counts(stack) == before
    for i in range(len(stack.replicas)):
        stack.restart_replica(i)
    wait_for(lambda: send(stack.url, chat("hello", max_tokens=2)).status == 200, 30)


def test_a_late_replica_learns_the_engines_caches_by_replay(stack: Stack) -> None:
    target = stack.engines[0]
    cache_on(stack, target, prompt(10_000))
    known = min(known_blocks(r, target.address) for r in stack.replicas)
    late = Spawned(stack.workdir / "late.yaml", stack.config)
    try:
        # What the running replicas learned live, the late one learns by replay.
        wait_for(lambda: known_blocks(late, target.address) >= known, SLOW_S, "replayed blocks")
    finally:
        late.stop()


def test_a_rolling_restart_of_the_replicas_cuts_no_stream(stack: Stack) -> None:
    stop = threading.Event()
    answers: list[Answer] = []

    def client(seed: int) -> None:
        while not stop.is_set():
            body = chat(prompt(seed, 20), max_tokens=1000, ignore_eos=True, stream=True)
            answers.append(send(stack.url, body))

    clients = [threading.Thread(target=client, args=(s,)) for s in (1, 2)]
    for c in clients:
        c.start()
    try:
        for i, r in enumerate(list(stack.replicas)):
            # A stream is open through the replica when it is told to stop.
            wait_for(lambda r=r: r.metric("routecore_in_flight") > 0, 120, "a stream on it")
            os.kill(r.proc.pid, signal.SIGTERM)
            # It drains (at most limits.request_timeout_s), then exits.
            assert r.proc.wait(timeout=stack.config["limits"]["request_timeout_s"] + 30) == 0
            stack.start_replica(i, (r.port, r.metrics_port, r.api_port))
        # The restarted replicas route streams too (each ends before the join).
        for r in stack.replicas:
            wait_for(lambda r=r: r.metric("routecore_decisions_total") > 0, 120, "routed")
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=120)
    assert answers
    cut = [a for a in answers if a.status != 200 or not a.events or a.events[-1][1] != "[DONE]"]
    assert not cut, f"{len(cut)} of {len(answers)} streams failed or were cut"


# The tests below kill engines: last, so the engines are restarted at most once.


def test_a_killed_engine_stops_being_chosen(stack: Stack) -> None:
    assert stack.envoy is not None
    victim = stack.engines[-1]
    content = prompt(7_000)
    cache_on(stack, victim, content)
    # A stream routed to it (its cache) is cut when it dies mid-answer.
    long = chat(content, max_tokens=1500, ignore_eos=True, stream=True)
    result: list[Answer] = []
    streaming = threading.Event()
    t = threading.Thread(
        target=lambda: result.append(send(stack.url, long, test_id="cut", started=streaming))
    )
    t.start()
    # Killed at the stream's first token (an engine's /metrics can miss a
    # stream of a few seconds: the tiny model writes 1,500 tokens in about 3 s).
    assert streaming.wait(SLOW_S) and not result, f"no stream: {result}"
    victim.kill()
    t.join(timeout=60)
    assert stack.envoy.entry("cut")["upstream"] == victim.address
    assert "[DONE]" not in [d for _, d in result[0].events]
    for r in stack.replicas:
        wait_for(
            lambda r=r: r.metric("routecore_endpoint_healthy", endpoint=victim.address) == 0,
            SLOW_S,
            "the dead engine marked unhealthy",
        )
        r.wait_gauge_zero(SLOW_S)  # the cut stream released what it held
    ids = [f"after-kill-{uuid.uuid4()}" for _ in range(6)]
    for i, test_id in enumerate(ids):
        # Its cached prompt too: the dead engine is never chosen.
        text = content if i == 0 else prompt(7_100 + i, 20)
        assert send(stack.url, chat(text, max_tokens=2), test_id=test_id).status == 200
    assert all(stack.envoy.entry(i)["upstream"] != victim.address for i in ids)


@pytest.fixture
def stack_as_left(_real_stack: Stack) -> Stack:
    """The stack with the engines earlier tests killed left dead (a restart
    costs a minute or two); replicas running."""
    _real_stack.revive(engines=False)
    return _real_stack


def test_a_request_to_a_just_killed_engine_is_retried_and_counted_where_served(
    stack_as_left: Stack, envoy: Callable[..., Envoy]
) -> None:
    """routecore learns an engine is gone from its failed scrapes (the
    stack's replicas after 3, 0.75 s): a request routed in between goes to
    the dead engine first. So that this happens every time, a replica of its
    own that does not scrape (its endpoints stay healthy) routes here, behind
    an Envoy of its own."""
    stack = stack_as_left
    alive = [e.address for e in stack.engines if e.proc is not None and e.proc.poll() is None]
    assert len(alive) >= 2
    config = copy.deepcopy(stack.config)
    config["scrape"] = {"enabled": False}
    config["pools"][0]["endpoints"] = alive
    kv = config["kv_events"]["endpoints"]
    config["kv_events"]["endpoints"] = {a: kv[a] for a in alive}
    replica = Spawned(stack.workdir / "no-scrape.yaml", config)
    try:
        gw = envoy(shipped_config("envoy.yaml", free_port(), [replica.target], alive), True)
        # The replica routes the prompt twice to one engine (the second time
        # once the engine's KV events told it what the first left cached) and
        # remembers where (its prefix index, which it keeps scoring when an
        # engine's KV-event stream drops).
        content = prompt(8_000)
        first = send(gw.url, chat(content, max_tokens=1), test_id="first")
        assert first.status == 200, first.body
        victim = stack.engine(gw.entry("first")["upstream"])
        blocks = first.json()["usage"]["prompt_tokens"] // BLOCK_SIZE
        wait_for(lambda: known_blocks(replica, victim.address) >= blocks, SLOW_S, "KV events")
        assert send(gw.url, chat(content, max_tokens=1), test_id="second").status == 200
        assert gw.entry("second")["upstream"] == victim.address
        victim.kill()
        # It chooses the dead engine again; Envoy retries on the next endpoint
        # of the list.
        long = chat(content, max_tokens=1800, ignore_eos=True, stream=True)
        result: list[Answer] = []
        t = threading.Thread(target=lambda: result.append(send(gw.url, long, test_id="retried")))
        t.start()

        def in_flight() -> dict[str, float]:
            return {a: replica.metric("routecore_in_flight", endpoint=a) for a in alive}

        # Counted on the chosen endpoint until the response's headers name the
        # one that served: from then on, while it streams, that one holds it.
        counted: dict[str, float] = {}
        try:
            deadline = time.monotonic() + 30
            while not counted and t.is_alive() and time.monotonic() < deadline:
                now = in_flight()
                counted = now if sum(now.values()) == 1 and not now[victim.address] else {}
                time.sleep(0.01)
        finally:
            t.join(timeout=120)
        entry = gw.entry("retried")
        assert entry["chosen"].split(",")[0] == victim.address
        assert entry["upstream"] != victim.address
        assert entry["attempts"] == 2
        assert result[0].status == 200 and result[0].events[-1][1] == "[DONE]"
        assert counted.get(entry["upstream"]) == 1, counted
        replica.wait_gauge_zero(10)  # released once, where it was counted
    finally:
        replica.stop()


# -- flow control ---------------------------------------------------------------


def test_a_burst_over_capacity_is_served_for_the_guaranteed_tenant_while_spot_waits_or_is_shed(
    stack: Stack, envoy: Callable[..., Envoy]
) -> None:
    """A replica with flow control (one request per engine at a time: the
    concurrency detector) behind its own Envoy, whose message timeout (0.5 s)
    is shorter than the waits: routecore extends it while a request waits
    (override_message_timeout, up to the shipped max_message_timeout). A
    burst three times the fleet's capacity: every guaranteed request is
    served (no 429), spot ones wait or are shed (429 with Retry-After at
    their band's TTL), and every count returns to zero."""
    config = copy.deepcopy(stack.config)
    config["admission"] = {
        "backend": "memory",
        "quotas": [{"name": "fleet", "tokens_per_s": 1e6, "kv_bytes": 10**12, "concurrency": 64}],
        "entitlements": [
            {
                "name": f"{tenant}-std",
                "tenant": tenant,
                "quota": "fleet",
                "service_class": cls,
                "slo_target_ms": 5000.0,
                "tokens_per_s": 1e6,
                "kv_bytes": 10**12,
                "concurrency": 32,
            }
            for tenant, cls in (("demo", "guaranteed"), ("tight", "spot"))
        ],
    }
    config["flow_control"] = {
        "ttl_s": 60,
        "bands": [{"name": "guaranteed", "share": 1000}, {"name": "spot", "ttl_s": 0.5}],
        "saturation": {"detector": "concurrency", "max_in_flight": 1},
    }
    replica = Spawned(stack.workdir / "routecore-flow.yaml", config)
    try:
        engines = [e.address for e in stack.engines if e.healthy()]
        wait_scraped(replica, engines)
        proxy = shipped_config("envoy.yaml", free_port(), [replica.target], engines)
        (listener,) = proxy["static_resources"]["listeners"]
        http_filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        (ext_proc,) = [f for f in http_filters if f["name"] == "envoy.filters.http.ext_proc"]
        assert ext_proc["typed_config"]["max_message_timeout"] == "61s"
        ext_proc["typed_config"]["message_timeout"] = "0.5s"
        url = envoy(proxy).url
        n = 3 * len(engines)
        body = chat("tell the router a story", max_tokens=64, ignore_eos=True)
        answers: dict[str, list[Answer]] = {"demo": [], "tight": []}

        def one(tenant: str) -> None:
            answers[tenant].append(send(url, body, KEYS[tenant]))

        threads = [
            threading.Thread(target=one, args=(tenant,))
            for _ in range(n)
            for tenant in ("demo", "tight")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        gold = [a.status for a in answers["demo"]]
        assert gold == [200] * n, [a.body for a in answers["demo"] if a.status != 200]
        spot = answers["tight"]
        assert {a.status for a in spot} <= {200, 429}
        for a in spot:
            if a.status == 429:
                assert a.json()["error"]["type"] == "saturated"
                assert float(a.headers["retry-after"]) >= 1
        # Guaranteed requests waited past Envoy's own message timeout, and
        # were served: routecore extended it.
        count = replica.metric("routecore_flow_wait_seconds_count", band="guaranteed")
        quick = replica.metric("routecore_flow_wait_seconds_bucket", band="guaranteed", le="0.5")
        assert count > quick, "no guaranteed request waited longer than 0.5 s"

        def settled() -> bool:
            return (
                replica.metric("routecore_flow_queue_requests") == 0
                and replica.metric("routecore_flow_queue_bytes") == 0
                and replica.metric("routecore_in_flight") == 0
            )

        wait_for(settled, SLOW_S, "every count back to zero")
        left = replica.metric("routecore_flow_outcomes_total", outcome="dispatched")
        shed = sum(a.status == 429 for a in spot)
        expired = replica.metric("routecore_flow_outcomes_total", outcome="expired")
        assert expired == shed
        assert left + expired <= 2 * n
    finally:
        log = replica.stop()
    assert "release-failed" not in log
