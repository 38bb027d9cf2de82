"""The hot-path cases of ``routecore bench``: each builds one routecore call and its
Python twin on the same input, as zero-argument callables. A twin is the fastest
way a Python user would compute the same answer: NumPy where the call
vectorises (``route_many``), the same algorithm as routecore otherwise (VTC's
per-bucket totals, the prefix index), checked to give routecore's answers
(tests/test_bench.py). The pytest-benchmark suite in benches/ builds its inputs
from the same helpers.

Imports of optional packages (xxhash for the block-hash twin, grpcio and the
Envoy protos for the conversation) happen inside the case that needs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from routecore._core import (
    AdmissionController,
    BatchScheduler,
    Endpoint,
    Entitlement,
    Pool,
    PrefixCacheRouter,
    Quota,
    TokenBudgetRouter,
    VtcRouter,
    block_hashes,
    erlang_c,
)

Call = Callable[[], Any]

# --- token-budget routing -------------------------------------------------------------

#: (name, max_context, budget, queue_limit) of the two pools.
BUDGET_POOLS = [("short", 8192, 8192, None), ("long", 65536, 65536, None)]
_CALIBRATION = [("prose", 4500, 1000), ("code", 3500, 1000), ("cjk", 2000, 1000)]
CATEGORIES = [c for c, _, _ in _CALIBRATION]


def budget_router() -> TokenBudgetRouter:
    """routecore's router over ``BUDGET_POOLS``, calibrated on three categories."""
    r = TokenBudgetRouter([Pool(n, c, b, q) for n, c, b, q in BUDGET_POOLS])
    for cat, b, t in _CALIBRATION:
        r.feedback(b, cat, t)
    return r


def budget_twin():
    """The plain-Python router, calibrated the same way."""
    from routecore._baselines import budget

    r = budget.TokenBudgetRouter(BUDGET_POOLS)
    for cat, b, t in _CALIBRATION:
        r.calibrator.observe(cat, b, t)
    return r


def budget_workload(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt bytes, category index, max output tokens) of ``n`` requests."""
    rng = np.random.default_rng(seed)
    prompt_bytes = rng.integers(100, 60_000, n)
    categories = rng.integers(0, 3, n)
    max_out = rng.choice(np.array([256, 1024, 4096]), n)
    return prompt_bytes, categories, max_out


def route() -> tuple[Call, Call]:
    rc, py = budget_router(), budget_twin()
    return (lambda: rc.route(12_000, "prose", 1024)), (lambda: py.route(12_000, "prose", 1024))


def budget_numpy_twin(r: TokenBudgetRouter):
    """The NumPy router over ``BUDGET_POOLS`` with ``r``'s conservative ratios,
    indexed by ``r``'s category ids."""
    from routecore._baselines import budget

    cal = r.calibrator
    return budget.NumpyRouter(BUDGET_POOLS, [cal.conservative_ratio(c) for c in cal.categories])


def route_many(n: int = 10_000) -> tuple[Call, Call]:
    rc = budget_router()
    b, c, o = budget_workload(n)
    ids = np.array([rc.category_id(name) for name in CATEGORIES])[c]
    py = budget_numpy_twin(rc)
    return (lambda: rc.route_many(b, ids, o)), (lambda: py.route_many(b, ids, o))


# --- prefix-cache-aware routing -------------------------------------------------------

ENDPOINTS = [f"endpoint-{i}" for i in range(16)]
PROMPT_TOKENS = 8192
BLOCK = 16  # 512 blocks of the prompt


def prompt(seed: int = 0, n: int = PROMPT_TOKENS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


def prefix_warmed(router_cls):
    """A router that has seen 16 prompts sharing a 4,096-token system prompt, and
    the next prompt (the same system prompt, a new question)."""
    r = router_cls(ENDPOINTS, block_size=BLOCK)
    system = prompt(1, PROMPT_TOKENS // 2)
    for k in range(16):
        r.route(np.concatenate([system, prompt(100 + k, PROMPT_TOKENS // 2)]))
    return r, np.concatenate([system, prompt(999, PROMPT_TOKENS // 2)])


def block_hash() -> tuple[Call, Call]:
    from routecore._baselines import prefix

    p = prompt()
    return (lambda: block_hashes(p, BLOCK)), (lambda: prefix.block_hashes(p, BLOCK))


def prefix_pick() -> tuple[Call, Call]:
    from routecore._baselines import prefix

    (rc, p), (py, _) = prefix_warmed(PrefixCacheRouter), prefix_warmed(prefix.PrefixCacheRouter)
    return (lambda: rc.route(p)), (lambda: py.route(p))


# --- VTC fairness routing -------------------------------------------------------------

USERS = [f"user-{i}" for i in range(1000)]


def vtc_warmed(router_cls, users: list[str] = USERS):
    """A router with ``users`` active in the window."""
    r = router_cls(ENDPOINTS)
    for k, u in enumerate(users):
        r.route(u, 100 + k, 50, now=1.0)
    return r


def vtc_route_next(r, users: list[str] = USERS) -> Call:
    """Routes the next user of ``users`` (round robin) at a fixed clock."""
    cycle = itertools.cycle(users)
    return lambda: r.route(next(cycle), 500, 200, now=2.0)


def vtc() -> tuple[Call, Call]:
    from routecore._baselines import vtc as twin

    return vtc_route_next(vtc_warmed(VtcRouter)), vtc_route_next(vtc_warmed(twin.VtcRouter))


# --- admission --------------------------------------------------------------------------

#: (tokens_per_s, kv_bytes, concurrency) of the one pool.
_POOL = (240.0, 2**34, 16)
ADMISSION_QUOTAS = [Quota("p", *_POOL)]
#: (name, tenant, pool, class, slo_ms, tokens_per_s, kv_bytes, concurrency) of two tenants.
_ENTITLEMENTS = [
    ("copilot", "dev", "p", "elastic", 500.0, 75.0, 2**30, 5),
    ("synth", "data", "p", "elastic", 30_000.0, 75.0, 2**30, 5),
]
ENTITLEMENTS = [Entitlement(*e) for e in _ENTITLEMENTS]


def admission_twin():
    """The plain-Python controller with the same pool and entitlements."""
    from routecore._baselines import admission

    ents = [admission.Entitlement(e[0], *e[3:]) for e in _ENTITLEMENTS]
    return admission.AdmissionController(_POOL[2], _POOL[0], ents)


def admit_complete_pair(admit, complete) -> Call:
    """One admit + complete at an advancing explicit clock; returns the ticket."""
    clock = itertools.count()

    def run():
        now = next(clock) * 1e-3
        ticket = admit("copilot", 64, 64, now)
        complete(ticket, 64, 64, 0.5, now)
        return ticket

    return run


def admission() -> tuple[Call, Call]:
    ctl, py = AdmissionController(ADMISSION_QUOTAS, ENTITLEMENTS), admission_twin()
    return (
        admit_complete_pair(lambda *a: ctl.admit(*a).ticket, ctl.complete),
        admit_complete_pair(lambda *a: py.admit(*a)[3], py.complete),
    )


# --- batched assignment -----------------------------------------------------------------

#: RouteBalance's fleet (Table 1): model, TPOT, price in/out per Mtok, endpoints.
FLEET = [
    ("qwen2.5-3b", 0.0102, 0.06, 0.06, 3),
    ("qwen2.5-7b", 0.0196, 0.07, 0.07, 5),
    ("qwen2.5-14b", 0.0139, 0.15, 0.15, 3),
    ("qwen2.5-72b", 0.0416, 0.38, 0.40, 2),
]
ASSIGN_BATCH, MAX_BATCH = 256, 16


def endpoints() -> list[Endpoint]:
    return [
        Endpoint(f"{m}-{k}", m, tpot, p_in, p_out, MAX_BATCH)
        for m, tpot, p_in, p_out, n in FLEET
        for k in range(n)
    ]


def assign_batch(seed: int = 0):
    """(quality, out_len, in_tokens, budget, pending, batch) of one batch."""
    rng = np.random.default_rng(seed)
    n, b = sum(f[4] for f in FLEET), ASSIGN_BATCH
    return (
        rng.uniform(0, 1, (b, 4)),
        rng.integers(16, 1024, (b, 4)).astype(np.float64),
        rng.integers(8, 4096, b),
        np.where(rng.uniform(size=b) < 0.2, rng.uniform(1e-5, 4e-4, b), np.inf),
        rng.integers(0, 8000, n).astype(np.float64),
        rng.integers(0, MAX_BATCH + 1, n),
    )


def assign_twin(s: BatchScheduler, fleet: list[Endpoint]):
    """The plain-Python scheduler of ``s``'s fleet and weights."""
    from routecore._baselines import assign

    plain = [
        (
            s.model_of[i],
            f.tpot_s,
            f.price_in_per_mtok,
            f.price_out_per_mtok,
            f.max_batch,
            f.prefill_s_per_token,
        )
        for i, f in enumerate(fleet)
    ]
    return assign.BatchScheduler(plain, s.weights)


def assign() -> tuple[Call, Call]:
    fleet = endpoints()
    s = BatchScheduler(fleet, weights="balanced")
    py = assign_twin(s, fleet)
    args = assign_batch()
    rows = [a.tolist() for a in args]
    return (lambda: s.assign(*args)), (lambda: py.assign(*rows))


# --- queueing ---------------------------------------------------------------------------


def erlang() -> tuple[Call, Call]:
    from routecore._baselines import planner

    c, a = 32_768, 0.85 * 32_768
    return (lambda: erlang_c(c, a)), (lambda: planner.erlang_c(c, a))


# --- one ext_proc conversation ----------------------------------------------------------

SHORT = ["127.0.0.1:8001", "127.0.0.1:8002"]
LONG = ["127.0.0.1:8011"]
#: Nothing listens at the endpoints: they are not scraped, so none is ever
#: marked unhealthy (a failed scrape would turn routing into 503s). The
#: endpoint is picked as the twin picks it: least request, first on ties, no
#: fallbacks offered.
SERVER_CONFIG: dict[str, Any] = {
    "scrape": {"enabled": False},
    "router": {"policy": "least-request", "fallbacks": 0},
    "pools": [
        {"name": "short", "max_context": 8192, "endpoints": SHORT},
        {"name": "long", "max_context": 65536, "endpoints": LONG},
    ],
    "tenants": [{"name": "demo", "api_keys": ["demo-key"]}],
}


def conversation_messages(text_bytes: int) -> list:
    """Envoy's four messages: headers with the key, a chat body of about
    ``text_bytes``, response headers, a response body with usage."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from routecore.server.envoy_client import chat_body, http_headers, usage_body

    body = chat_body("Summarise this. " * (text_bytes // 16), 200)
    return [
        pb.ProcessingRequest(request_headers=http_headers({"x-api-key": "demo-key"})),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=http_headers({":status": "200"})),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(body=usage_body(300, 50), end_of_stream=True)
        ),
    ]


@contextmanager
def routecore_processor(autoscale: bool = False) -> Iterator[str]:
    """routecore's data plane on a free loopback port, in this process: its
    target. ``autoscale``: with both pools scaled (docs/autoscale.md)."""
    from routecore._core import DataPlane
    from routecore.config import parse_config

    config = dict(SERVER_CONFIG)
    if autoscale:
        pools = [
            {"name": p["name"], "max_endpoints": 100, "slo_ttft_s": 2.0} for p in config["pools"]
        ]
        config["autoscale"] = {"pools": pools}
    plane = DataPlane.start(parse_config(config).spec_json(), worker_threads=1)
    try:
        yield f"127.0.0.1:{plane.port}"
    finally:
        plane.drain(0)


@contextmanager
def python_processor() -> Iterator[str]:
    """The plain-Python processor served by grpcio in this process: its target."""
    from routecore._baselines import server

    pools = [(p["name"], p["max_context"], p["max_context"], None) for p in SERVER_CONFIG["pools"]]
    p = server.Processor(pools, {"short": SHORT, "long": LONG}, {"demo-key": "demo"})
    grpc_server, port = server.serve(p)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        grpc_server.stop(0)


@contextmanager
def conversation_client(target: str, text_bytes: int = 1000) -> Iterator[Call]:
    """A call holding one whole conversation with ``target`` (synchronous grpcio)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    msgs = conversation_messages(text_bytes)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        yield lambda: list(stub.Process(iter(msgs)))


# --- the table --------------------------------------------------------------------------


@contextmanager
def conversation() -> Iterator[tuple[Call, Call]]:
    with ExitStack() as stack:
        rc = stack.enter_context(conversation_client(stack.enter_context(routecore_processor())))
        py = stack.enter_context(conversation_client(stack.enter_context(python_processor())))
        yield rc, py


@dataclass(frozen=True)
class Case:
    name: str
    #: What the call does, in a few words.
    what: str
    #: Builds (routecore call, plain-Python call), as is or as a context that
    #: holds what they need (the conversation's two servers).
    build: Callable[[], Any]
    #: The extra and the optional packages the case needs, if any.
    needs: tuple[str, tuple[str, ...]] = ("", ())

    @contextmanager
    def calls(self) -> Iterator[tuple[Call, Call]]:
        built = self.build()
        if isinstance(built, tuple):
            yield built
        else:
            with built as pair:
                yield pair


CASES = [
    Case("route", "TokenBudgetRouter.route, one request", route),
    Case("route_many", "TokenBudgetRouter.route_many, 10,000 requests", route_many),
    Case(
        "block_hashes", "block_hashes, 8,192 tokens, block 16", block_hash, ("bench", ("xxhash",))
    ),
    Case(
        "prefix_pick",
        "PrefixCacheRouter.route, 16 endpoints, 512-block prompt",
        prefix_pick,
        ("bench", ("xxhash",)),
    ),
    Case("vtc", "VtcRouter.route, 16 endpoints, 1,000 active users", vtc),
    Case("admission", "AdmissionController admit + complete", admission),
    Case("assign", "BatchScheduler.assign, 256 requests x 13 endpoints", assign),
    Case("erlang_c", "erlang_c, c = 32,768, rho = 0.85", erlang),
    Case(
        "ext_proc_conversation",
        "one ext_proc conversation, loopback gRPC in process, 1 KB prompt",
        conversation,
        ("server", ("grpc", "envoy")),
    ),
]
