"""Every integer argument of the extension: an int beyond 2^63 / 2^64, or
negative where the argument is unsigned, is a ValueError (as every bad argument
is), never the OverflowError of the int conversion; state is left unchanged.

`test_every_integer_parameter_is_covered` reads `_core.pyi` so that a new
integer parameter without a case here fails."""

import ast
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import routecore._core as core

WORKLOAD = core.Workload([100, 3000, 500, 9000] * 5, [50, 200, 100, 400] * 5)
PROFILE = core.Profile.llama3_70b_a100()
POOL = core.Quota("p", 100.0, 1 << 30, 4)
ENT = core.Entitlement("e", "t", "p", "elastic", 500.0, 10.0, 1 << 20, 2)
ENDPOINT = core.Endpoint("i", "m", 0.02, 1.0, 2.0, 8)


def budget_router():
    r = core.TokenBudgetRouter([core.Pool("short", 8192), core.Pool("long", 65536)])
    r.route(100, "prose", 10)  # one in flight on pool 0
    return r


def vtc():
    r = core.VtcRouter(["p0"])
    r.route("u", 10, 10)
    return r


def admission():
    return core.AdmissionController([POOL], [ENT])


def picker():
    p = core.EndpointPicker(["e0"], preset="vtc")
    p.pick(fairness_id="u", input_tokens=10, output_tokens=10, now=0.0)
    return p


def split_picker():
    """A picker with a prefill in flight on ``p`` (prefill/decode roles)."""
    p = core.EndpointPicker(["d", "p"], preset="least-request", roles={"p": "prefill"})
    p.pick_pair(now=0.0)
    return p


def scheduler():
    return core.BatchScheduler([ENDPOINT])


def flow_queue():
    q = core.FlowQueue()
    q.enqueue("spot", "t", "waiting", now=0.0)  # ticket 0
    return q


def autoscaler():
    pool = {"name": "p", "context": 4096, "max_endpoints": 4, "slo_ttft_s": 1.0}
    return core.Autoscaler({"pools": [pool]}, [PROFILE], now=0.0)


def plan():
    return core.plan(WORKLOAD, 10.0, 1.0, b_short=[4096], gammas=[1.0])


PROFILE_ARGS = {
    "name": "x",
    "layers": 80,
    "kv_heads": 8,
    "head_dim": 128,
    "dtype_bytes": 2.0,
    "gpu_memory_bytes": 80e9,
    "model_memory_bytes": 40e9,
    "w_s": 0.008,
    "h_s": 0.00065,
    "tensor_parallel": 4,
}
SIM_POOL_ARGS = {"name": "p", "endpoints": 1, "max_context": 4096, "max_num_seqs": 8}


def keyword(make, args, name):
    """A call of `make(**args)` with the value in keyword `name`."""
    return lambda v: make(**{**args, name: v})


def pair_keyword(make, args, name):
    """A call of `make(**args)` with the range `(value, value)` in keyword `name`."""
    return lambda v: make(**{**args, name: (v, v)})


# "Class.method.parameter" -> a call with the value in that parameter.
def _redis_config(window_entries, window_entries_per_quota, void_markers):
    return core.admission_redis_config(
        [POOL], [ENT], 60.0, 300.0, window_entries, window_entries_per_quota, void_markers
    )


CASES = {
    "Calibrator.__new__.max_categories": lambda v: core.Calibrator(max_categories=v),
    "Calibrator.observe.prompt_bytes": lambda v: core.Calibrator().observe("prose", v, 10),
    "Calibrator.observe.prompt_tokens": lambda v: core.Calibrator().observe("prose", 10, v),
    "Calibrator.estimate_tokens.prompt_bytes": lambda v: core.Calibrator().estimate_tokens(
        v, "prose"
    ),
    "Pool.__new__.max_context": lambda v: core.Pool("a", v),
    "Pool.__new__.budget": lambda v: core.Pool("a", 100, budget=v),
    "Pool.__new__.queue_limit": lambda v: core.Pool("a", 100, queue_limit=v),
    "TokenBudgetRouter.route.prompt_bytes": lambda v: budget_router().route(v, "prose", 10),
    "TokenBudgetRouter.route.max_output_tokens": lambda v: budget_router().route(10, "prose", v),
    "TokenBudgetRouter.route_tokens.prompt_tokens": lambda v: budget_router().route_tokens(v, 1),
    "TokenBudgetRouter.route_tokens.max_output_tokens": lambda v: budget_router().route_tokens(
        1, v
    ),
    "TokenBudgetRouter.feedback.prompt_bytes": lambda v: budget_router().feedback(v, "prose", 1),
    "TokenBudgetRouter.feedback.prompt_tokens": lambda v: budget_router().feedback(1, "prose", v),
    "TokenBudgetRouter.complete.pool": lambda v: budget_router().complete(v),
    "TokenBudgetRouter.in_flight.pool": lambda v: budget_router().in_flight(v),
    "TokenBudgetRouter.set_in_flight.pool": lambda v: budget_router().set_in_flight(v, 1),
    "TokenBudgetRouter.set_in_flight.count": lambda v: budget_router().set_in_flight(0, v),
    "TokenBudgetRouter.route_request.default_max_tokens": lambda v: budget_router().route_request(
        b'{"messages": []}', default_max_tokens=v
    ),
    "parse_openai_request.default_max_tokens": lambda v: core.parse_openai_request(
        b'{"messages": []}', v
    ),
    "parse_openai_request.image_tokens": lambda v: core.parse_openai_request(
        b'{"messages": []}', image_tokens=v
    ),
    "parse_openai_request.audio_tokens": lambda v: core.parse_openai_request(
        b'{"messages": []}', audio_tokens=v
    ),
    "TokenBudgetRouter.route_request.image_tokens": lambda v: budget_router().route_request(
        b'{"messages": []}', image_tokens=v
    ),
    "TokenBudgetRouter.route_request.audio_tokens": lambda v: budget_router().route_request(
        b'{"messages": []}', audio_tokens=v
    ),
    "Endpoint.__new__.max_batch": lambda v: core.Endpoint("i", "m", 0.02, 1.0, 2.0, v),
    "Endpoint.latency.batch_size": lambda v: ENDPOINT.latency(10.0, 10.0, 0.0, v),
    "BatchScheduler.assign_one.in_tokens": lambda v: scheduler().assign_one(
        [0.5], [10.0], v, None, [0.0], [0]
    ),
    "KnnEstimator.__new__.k": lambda v: core.KnnEstimator(v),
    "assign_eval.requests": lambda v: core.assign_eval(requests=v),
    "assign_eval.seed": lambda v: core.assign_eval(requests=10, seed=v),
    "flow_eval.experiment": lambda v: core.flow_eval(v, "fcfs", scale=0.05),
    "flow_eval.seed": lambda v: core.flow_eval(1, "fcfs", scale=0.05, seed=v),
    "RateProfile.arrivals.seed": lambda v: core.RateProfile("step:1@0").arrivals(2.0, seed=v),
    "assign_eval.max_batch": lambda v: core.assign_eval(requests=10, max_batch=v),
    "block_hashes.block_size": lambda v: core.block_hashes(b"abcd", v),
    "block_hashes.seed": lambda v: core.block_hashes(b"abcd", 2, v),
    "block_hashes_many.block_size": lambda v: core.block_hashes_many(b"abcd", [0, 4], v),
    "block_hashes_many.seed": lambda v: core.block_hashes_many(b"abcd", [0, 4], 2, v),
    "PrefixIndex.__new__.capacity_blocks": lambda v: core.PrefixIndex(v),
    "PrefixCacheRouter.__new__.block_size": lambda v: core.PrefixCacheRouter(["a"], block_size=v),
    "PrefixCacheRouter.__new__.imbalance_abs_count": lambda v: core.PrefixCacheRouter(
        ["a"], imbalance_abs_count=v
    ),
    "PrefixCacheRouter.__new__.seed": lambda v: core.PrefixCacheRouter(["a"], seed=v),
    "VtcRouter.__new__.max_users": lambda v: core.VtcRouter(["a"], max_users=v),
    "EndpointPicker.__new__.seed": lambda v: core.EndpointPicker(["a"], seed=v),
    "EndpointPicker.pick.input_tokens": lambda v: picker().pick(input_tokens=v, now=0.0),
    "EndpointPicker.pick.output_tokens": lambda v: picker().pick(output_tokens=v, now=0.0),
    "EndpointPicker.pick_pair.input_tokens": lambda v: picker().pick_pair(input_tokens=v, now=0.0),
    "EndpointPicker.pick_pair.output_tokens": lambda v: picker().pick_pair(
        output_tokens=v, now=0.0
    ),
    "EndpointPicker.completed_prefill.input_tokens": lambda v: split_picker().completed_prefill(
        "p", v, now=1.0
    ),
    "EndpointPicker.rank.input_tokens": lambda v: picker().rank(input_tokens=v, now=0.0),
    "EndpointPicker.rank.output_tokens": lambda v: picker().rank(output_tokens=v, now=0.0),
    "EndpointPicker.started.input_tokens": lambda v: picker().started("e0", input_tokens=v),
    "EndpointPicker.started.output_tokens": lambda v: picker().started("e0", output_tokens=v),
    "EndpointPicker.completed.input_tokens": lambda v: picker().completed("e0", v, 1),
    "EndpointPicker.completed.output_tokens": lambda v: picker().completed("e0", 1, v),
    "EndpointPicker.completed.est_input_tokens": lambda v: picker().completed(
        "e0", 1, 1, fairness_id="u", est_input_tokens=v
    ),
    "EndpointPicker.completed.est_output_tokens": lambda v: picker().completed(
        "e0", 1, 1, fairness_id="u", est_output_tokens=v
    ),
    "VtcRouter.route.input_tokens": lambda v: vtc().route("u", v, 1),
    "VtcRouter.route.output_tokens": lambda v: vtc().route("u", 1, v),
    "VtcRouter.complete.est_input_tokens": lambda v: vtc().complete("p0", "u", v, 10, 10, 10),
    "VtcRouter.complete.est_output_tokens": lambda v: vtc().complete("p0", "u", 10, v, 10, 10),
    "VtcRouter.complete.input_tokens": lambda v: vtc().complete("p0", "u", 10, 10, v, 10),
    "VtcRouter.complete.output_tokens": lambda v: vtc().complete("p0", "u", 10, 10, 10, v),
    "Compressor.__new__.keep_first": lambda v: core.Compressor(keep_first=v),
    "Compressor.__new__.keep_last": lambda v: core.Compressor(keep_last=v),
    "Compressor.compress.token_budget": lambda v: core.Compressor().compress("A b. C d.", v),
    "Compressor.compress_request.token_budget": lambda v: core.Compressor().compress_request(
        b'{"messages": [{"role": "user", "content": "A b. C d."}]}', v
    ),
    "Workload.from_cdf.points": lambda v: core.Workload.from_cdf([(v, 1.0)]),
    "Workload.sample.n": lambda v: WORKLOAD.sample(v),
    "Workload.sample.seed": lambda v: WORKLOAD.sample(2, v),
    **{
        f"Profile.__new__.{name}": keyword(core.Profile, PROFILE_ARGS, name)
        for name in ("layers", "kv_heads", "head_dim", "tensor_parallel", "c_chunk", "h_ref_tokens")
    },
    "Profile.slots.max_context": lambda v: PROFILE.slots(v),
    "Profile.service.max_context": lambda v: PROFILE.service(WORKLOAD, v),
    "erlang_b.servers": lambda v: core.erlang_b(v, 1.0),
    "erlang_c.servers": lambda v: core.erlang_c(v, 0.5),
    "p99_wait.servers": lambda v: core.p99_wait(v, 1.0, 1.0, 0.5),
    "ErlangScan.__new__.servers": lambda v: core.ErlangScan(v, 1.0),
    "ErlangScan.advance.steps": lambda v: core.ErlangScan(1, 0.5).advance(v),
    "Plan.candidate.b_short": lambda v: plan().candidate(v, 1.0),
    "plan.b_short": lambda v: core.plan(WORKLOAD, 10.0, 1.0, b_short=[v], gammas=[1.0]),
    "plan.long_context": lambda v: core.plan(
        WORKLOAD, 10.0, 1.0, b_short=[4096], gammas=[1.0], long_context=v
    ),
    **{
        f"SimPool.__new__.{name}": keyword(core.SimPool, SIM_POOL_ARGS, name)
        for name in (
            "endpoints",
            "max_context",
            "max_num_seqs",
            "kv_blocks",
            "chunk",
            "gpus_per_endpoint",
            "budget",
        )
    },
    "simulate.seed": lambda v: core.simulate(
        [0.0], [100], [10], [core.SimPool("p", 1, 4096, 8)], seed=v
    ),
    "plan_disaggregated.context": lambda v: core.plan_disaggregated(WORKLOAD, 10.0, 1.0, context=v),
    **{
        f"simulate_disaggregated.{name}": lambda v, name=name: core.simulate_disaggregated(
            [0.0],
            [100],
            [10],
            core.SimPool("d", 1, 4096, 8),
            core.SimPool("p", 1, 4096, 8),
            **{name: v},
        )  # fmt: skip
        for name in ("threshold", "seed")
    },
    **{
        f"PrefixWorkload.__new__.{name}": keyword(core.PrefixWorkload, {"requests": 10}, name)
        for name in ("requests", "sessions", "system_prompts", "seed")
    },
    **{
        f"PrefixWorkload.__new__.{name}": pair_keyword(core.PrefixWorkload, {"requests": 10}, name)
        for name in ("turns", "system_tokens", "user_tokens", "output_tokens")
    },
    "Quota.__new__.kv_bytes": lambda v: core.Quota("p", 1.0, v, 1),
    "Quota.__new__.concurrency": lambda v: core.Quota("p", 1.0, 1, v),
    "Quota.__new__.kv_bytes_per_token": lambda v: core.Quota("p", 1.0, 1, 1, v),
    "Entitlement.__new__.kv_bytes": lambda v: core.Entitlement(
        "e", "t", "p", "elastic", 500.0, 10.0, v, 2
    ),
    "Entitlement.__new__.concurrency": lambda v: core.Entitlement(
        "e", "t", "p", "elastic", 500.0, 10.0, 1, v
    ),
    "Admission.__new__.status": lambda v: core.Admission(True, v, "ok"),
    "Admission.__new__.ticket": lambda v: core.Admission(True, 200, "ok", ticket=v),
    "AdmissionController.__new__.default_max_tokens": lambda v: core.AdmissionController(
        [POOL], [ENT], v
    ),
    "AdmissionController.admit.input_tokens": lambda v: admission().admit("e", v, 10, 0.0),
    "AdmissionController.admit.max_tokens": lambda v: admission().admit("e", 10, v, 0.0),
    "AdmissionController.complete.ticket": lambda v: _admitted_complete(1, 1, v),
    "AdmissionController.release.ticket": lambda v: _admitted_release(v),
    "DispatchSteps.acquire.max_output_tokens": lambda v: _acquired(max_output_tokens=v),
    "DispatchSteps.acquire.prompt_bytes": lambda v: _acquired(prompt_bytes=v),
    "DispatchSteps.acquire.input_tokens": lambda v: _acquired(input_tokens=v),
    **{
        f"DispatchSteps.release.{name}": lambda v, name=name: _released(**{name: v})
        for name in ("input_tokens", "max_output_tokens", "actual_input", "actual_output")
    },
    "FlowQueue.enqueue.bytes": lambda v: flow_queue().enqueue("spot", "t", None, bytes=v),
    "FlowQueue.cancel.ticket": lambda v: flow_queue().cancel(v),
    "Autoscaler.observe.prompt_tokens": lambda v: autoscaler().observe("p", v, 1, now=0.0),
    "Autoscaler.observe.output_tokens": lambda v: autoscaler().observe("p", 1, v, now=0.0),
    "AdmissionController.complete.actual_input": lambda v: _admitted_complete(v, 1),
    "AdmissionController.complete.actual_output": lambda v: _admitted_complete(1, v),
    "AdmissionController.set_capacity.kv_bytes": lambda v: admission().set_capacity(
        "p", kv_bytes=v
    ),
    "AdmissionController.set_capacity.concurrency": lambda v: admission().set_capacity(
        "p", concurrency=v
    ),
    "DataPlane.start.port": lambda v: _start(port=v),
    "DataPlane.start.metrics_port": lambda v: _start(metrics_port=v),
    "DataPlane.start.worker_threads": lambda v: _start(worker_threads=v),
    "DataPlane.start.log_level": lambda v: _start(log_level=v),
    "DataPlane.start.unix_socket_mode": lambda v: _start(unix_socket_mode=v),
    "DataPlane.set_log_level.level": lambda v: core.DataPlane.set_log_level(v),
    "DataPlane.route_fields.prompt_bytes": lambda v: _route(v, "prose", 10),
    "DataPlane.route_fields.max_output_tokens": lambda v: _route(10, "prose", v),
    "DataPlane.route_fields.prompt_tokens": lambda v: _route(10, "prose", 10, v),
    "DataPlane.route_fields.token_ids": lambda v: _route(10, "prose", 10, token_ids=[v]),
    "DataPlane.route_body.token_ids": lambda v: _settle(
        plane().route_body(b'{"prompt": "x", "max_tokens": 5}', token_ids=[v])
    ),
    "DataPlane.finish.prompt_tokens": lambda v: _finish(v, 1),
    "DataPlane.finish.completion_tokens": lambda v: _finish(1, v),
    "DataPlane.feedback.prompt_tokens": lambda v: _finish(v, 1, feedback=True),
    "DataPlane.feedback.completion_tokens": lambda v: _finish(1, v, feedback=True),
    "load.requests": lambda v: _load(requests=v),
    "load.concurrency": lambda v: _load(concurrency=v),
    "load.body_bytes": lambda v: _load(body_bytes=v),
    "load.server_pid": lambda v: _load(server_pid=v),
    "load.threads": lambda v: _load(threads=v),
    "KvEventIndex.__new__.block_size": lambda v: core.KvEventIndex(block_size=v),
    "KvEventIndex.__new__.capacity_blocks": lambda v: core.KvEventIndex(capacity_blocks=v),
    "KvEventIndex.__new__.seed": lambda v: core.KvEventIndex(seed=v),
    "KvEventIndex.__new__.max_message_bytes": lambda v: core.KvEventIndex(max_message_bytes=v),
    "KvEventIndex.__new__.max_batch_events": lambda v: core.KvEventIndex(max_batch_events=v),
    "KvEventIndex.__new__.max_batch_blocks": lambda v: core.KvEventIndex(max_batch_blocks=v),
    "admission_redis_config.max_window_entries": lambda v: _redis_config(v, 1, 1),
    "admission_redis_config.max_window_entries_per_quota": lambda v: _redis_config(1, v, 1),
    "admission_redis_config.max_void_markers": lambda v: _redis_config(1, 1, v),
}


#: A data plane for the DataPlane cases (started on first use, a free port).
_PLANE = []
SPEC = json.dumps(
    {
        "server": {"key_header": "x-api-key", "failure_mode": "closed", "default_pool": "p"},
        "limits": {
            "max_body_bytes": 1000,
            "max_message_bytes": 1 << 20,
            "request_timeout_s": 30.0,
            "default_max_tokens": 10,
            "image_tokens": 765,
            "audio_tokens": 750,
        },
        "router": {"policy": "least-request", "compress_band": None, "prefix_block_size": 16},
        "pools": [
            {
                "name": "p",
                "max_context": 8192,
                "budget": None,
                "queue_limit": None,
                "endpoints": ["127.0.0.1:1"],
            }
        ],
        "tenants": [],
        "admission": None,
    }
)


def plane():
    if not _PLANE:
        _PLANE.append(core.DataPlane.start(SPEC))
    return _PLANE[0]


def _start(**kwargs):
    core.DataPlane.start(SPEC, **kwargs).drain(0)


def _route(*args, **kwargs):
    """``route_fields`` on the plane; a refusal (a 400 for bad fields) as ValueError."""
    _settle(plane().route_fields(*args, **kwargs))


def _settle(routed):
    """Finishes a routed request; a refusal as ValueError."""
    if not routed["admitted"]:
        raise ValueError(routed["message"])
    plane().finish(routed["request_id"])


def _load(**kwargs):
    """One conversation of the Rust load client against the plane."""
    core.load(f"127.0.0.1:{plane().port}", **{"requests": 1, **kwargs})


def _finish(prompt_tokens, completion_tokens, feedback=False):
    """Ends a request routed through the API with this usage: ``finish``, or
    ``feedback`` (the RouteCore API's, with a key: none is needed here)."""
    routed = plane().route_fields(10, "prose", 10)
    try:
        if feedback:
            plane().feedback(routed["request_id"], b"", prompt_tokens, completion_tokens)
        else:
            plane().finish(routed["request_id"], prompt_tokens, completion_tokens)
    finally:
        plane().finish(routed["request_id"])


def _admitted_release(ticket):
    """`release` on a controller with one request in flight."""
    c = admission()
    c.admit("e", 10, 10, 0.0)
    c.release(ticket, 1.0)


def _steps():
    """``Dispatcher``'s Rust steps over a router, a picker and admission."""
    picker = core.EndpointPicker(["e0"])
    return core.DispatchSteps(RuntimeError, budget_router(), picker, admission())


def _acquired(max_output_tokens=10, prompt_bytes=10, input_tokens=None, steps=None):
    """``DispatchSteps.acquire`` of a request of entitlement ``e``."""
    steps = steps or _steps()
    args = (max_output_tokens, prompt_bytes, "prose", input_tokens, "e", None, None, None, 0.0)
    return steps.acquire(*args)


def _released(**counts):
    """``DispatchSteps.release`` of an acquired request with these counts."""
    steps = _steps()
    _, decision, admitted, endpoint, prefill = _acquired(steps=steps)
    args = {"input_tokens": 3, "max_output_tokens": 10, "actual_input": 1, "actual_output": 1}
    args.update(counts)
    steps.release(decision, admitted, endpoint, prefill, None, *args.values(), 0.1, 1.0)


def _admitted_complete(actual_input, actual_output, ticket=None):
    """`complete` on a controller with one request in flight (its ticket by
    default)."""
    c = admission()
    admitted = c.admit("e", 10, 10, 0.0).ticket
    ticket = admitted if ticket is None else ticket
    before = c.to_bytes()
    try:
        c.complete(ticket, actual_input, actual_output, 0.1, 1.0)
    except ValueError:
        assert c.to_bytes() == before  # refused: the ticket is still in flight
        raise


def integer_parameters():
    """Every parameter annotated with an int (not an array, not a callback)
    in the stub, as "Class.method.parameter"."""
    tree = ast.parse((Path(core.__file__).parent / "_core.pyi").read_text())
    out = set()

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{node.name}.")
            elif isinstance(node, ast.FunctionDef) and (
                node.name == "__new__" or not node.name.startswith("_")
            ):
                for a in node.args.args + node.args.kwonlyargs:
                    ann = ast.unparse(a.annotation) if a.annotation else ""
                    if re.search(r"\bint\b", ann) and not any(x in ann for x in ("Callable", "np")):
                        out.add(f"{prefix}{node.name}.{a.arg}")

    visit(tree.body, "")
    return out


def test_every_integer_parameter_is_covered():
    assert integer_parameters() - set(CASES) == set()
    assert set(CASES) - integer_parameters() == set()


UNSIGNED_64 = {
    "Endpoint.latency.batch_size",
    "KvEventIndex.__new__.seed",
    "TokenBudgetRouter.route_request.default_max_tokens",
    "parse_openai_request.default_max_tokens",
    "Calibrator.__new__.max_categories",
    "assign_eval.requests",
    "assign_eval.seed",
    "flow_eval.seed",
    "RateProfile.arrivals.seed",
    "block_hashes.seed",
    "block_hashes_many.seed",
    "PrefixCacheRouter.__new__.seed",
    "EndpointPicker.__new__.seed",
    "EndpointPicker.pick.input_tokens",
    "EndpointPicker.pick.output_tokens",
    "EndpointPicker.pick_pair.input_tokens",
    "EndpointPicker.pick_pair.output_tokens",
    "EndpointPicker.completed_prefill.input_tokens",
    "EndpointPicker.rank.input_tokens",
    "EndpointPicker.rank.output_tokens",
    "EndpointPicker.started.input_tokens",
    "EndpointPicker.started.output_tokens",
    "EndpointPicker.completed.input_tokens",
    "EndpointPicker.completed.output_tokens",
    "EndpointPicker.completed.est_input_tokens",
    "EndpointPicker.completed.est_output_tokens",
    "Workload.sample.n",
    "Workload.sample.seed",
    "Profile.__new__.c_chunk",
    "Profile.__new__.h_ref_tokens",
    "Profile.slots.max_context",
    "Profile.service.max_context",
    "erlang_b.servers",
    "erlang_c.servers",
    "p99_wait.servers",
    "ErlangScan.__new__.servers",
    "ErlangScan.advance.steps",
    "Plan.candidate.b_short",
    "plan.b_short",
    "plan.long_context",
    "simulate.seed",
    "plan_disaggregated.context",
    "simulate_disaggregated.threshold",
    "simulate_disaggregated.seed",
    "PrefixWorkload.__new__.seed",
    "Admission.__new__.ticket",
    "AdmissionController.complete.ticket",
    "AdmissionController.release.ticket",
    "FlowQueue.cancel.ticket",
    "Autoscaler.observe.prompt_tokens",
    "Autoscaler.observe.output_tokens",
    "DataPlane.route_fields.prompt_bytes",
    "DataPlane.route_fields.max_output_tokens",
    "DataPlane.route_fields.prompt_tokens",
    "DataPlane.route_fields.token_ids",
    "DataPlane.route_body.token_ids",
    "load.requests",
    "admission_redis_config.max_window_entries",
    "admission_redis_config.max_window_entries_per_quota",
    "admission_redis_config.max_void_markers",
    "DataPlane.finish.prompt_tokens",
    "DataPlane.finish.completion_tokens",
    "DataPlane.feedback.prompt_tokens",
    "DataPlane.feedback.completion_tokens",
}


def out_of_range(name):
    # 2^63 fits a u64 argument (it may still be refused by the core's check).
    return (2**64, 2**100, -1) if name in UNSIGNED_64 else (2**63, 2**64, -(2**63) - 1, -1)


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, v) for name in sorted(CASES) for v in out_of_range(name)],
)
def test_out_of_range_integers_are_value_errors(name, value):
    with pytest.raises(ValueError) as e:
        CASES[name](value)
    assert not isinstance(e.value, OverflowError)


def test_the_argument_is_named_and_numpy_integers_are_checked_too():
    with pytest.raises(ValueError, match=r"out of range: .* \(got 9223372036854775808\)") as e:
        core.Calibrator().observe("prose", 2**63, 1)
    assert any("prompt_bytes" in note for note in getattr(e.value, "__notes__", []))
    with pytest.raises(ValueError):
        core.Pool("a", np.uint64(2**64 - 1))
    with pytest.raises(ValueError):
        core.block_hashes(b"abcd", 2, np.int64(-1))
    # Arrays: negative or too large values into unsigned or int64 arrays.
    r = core.VtcRouter(["p0"])
    for bad in ([2**63], [2**64], np.array([2**64 - 1], dtype=np.uint64), [-1]):
        with pytest.raises(ValueError):
            r.route_many(["u"], bad, [1])
    with pytest.raises(ValueError):
        core.block_hashes(np.array([-1, 2**40]), 1)
    assert r.users == 0


# An in-range value for each case (1 unless listed): the call succeeds, so the
# ValueError above is the value's doing.
VALID = {
    "Calibrator.observe.prompt_bytes": 10,
    "Pool.__new__.budget": 50,
    "Pool.__new__.max_context": 100,
    "TokenBudgetRouter.complete.pool": 0,
    "Endpoint.__new__.max_batch": 4,
    "BatchScheduler.assign_one.in_tokens": 10,
    "block_hashes.block_size": 2,
    "block_hashes_many.block_size": 2,
    "Compressor.compress.token_budget": 100,
    "Compressor.compress_request.token_budget": 100,
    "Workload.from_cdf.points": 100,
    "Profile.__new__.c_chunk": 512,
    "Profile.__new__.h_ref_tokens": 512,
    "Profile.__new__.layers": 80,
    "Profile.__new__.kv_heads": 8,
    "Profile.__new__.head_dim": 128,
    "Profile.slots.max_context": 4096,
    "Profile.service.max_context": 16384,
    "Plan.candidate.b_short": 4096,
    "plan.b_short": 4096,
    "plan.long_context": 65536,
    "plan_disaggregated.context": 65536,
    "SimPool.__new__.max_context": 4096,
    "SimPool.__new__.kv_blocks": 10_000,
    "SimPool.__new__.chunk": 512,
    "SimPool.__new__.budget": 4096,
    "Admission.__new__.status": 200,
    "AdmissionController.__new__.default_max_tokens": 100,
    "AdmissionController.complete.ticket": admission().admit("e", 10, 10, 0.0).ticket,
    "AdmissionController.release.ticket": admission().admit("e", 10, 10, 0.0).ticket,
    "FlowQueue.cancel.ticket": 0,
    "DataPlane.start.port": 0,
    "DataPlane.start.metrics_port": 0,
    "DataPlane.start.log_level": 30,
    "DataPlane.start.unix_socket_mode": 0o600,
    "KvEventIndex.__new__.max_message_bytes": 1 << 20,
    "DataPlane.set_log_level.level": 30,
    "load.server_pid": os.getpid(),
    "load.body_bytes": 100,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_accepts_an_in_range_value(name):
    CASES[name](VALID.get(name, 1))
