"""The ``routecore.v1.RouteCore`` gRPC service (proto/routecore/v1/routecore.proto).

A thin wrapper over the Rust data plane (:class:`routecore.DataPlane`): Route
and Feedback use the same calibrator, leases and admission as Envoy's
ext_proc. Refusals that are decisions (unknown key, no endpoint, admission)
come back in ``RouteResponse.admission`` with the HTTP status a gateway would
answer; requests that cannot be routed at all (malformed body, bad fields,
too long for every pool, a count beyond ``MAX_TOKENS``) are
``INVALID_ARGUMENT``, and a Feedback for an unknown request id is
``NOT_FOUND``; a Feedback whose usage cannot be real still ends the request
(the usage is ignored and counted). A failure while routing follows
``server.failure_mode`` and never shows internal detail; any other
unexpected failure is ``INTERNAL`` with no detail. ``Plan`` runs the FleetOpt
planner (``routecore.plan``) off the event loop; bad, too deep or
out-of-range parameters are ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

import grpc

from routecore._core import DataPlane, Profile, Workload, plan
from routecore.server.gen import routecore_pb2 as pb
from routecore.server.gen import routecore_pb2_grpc as pb_grpc
from routecore.server.logs import log

#: The categories ``routecore.classify`` assigns (and the calibrator learns).
CATEGORIES = ("prose", "code", "cjk", "mixed")
#: Statuses that mean the request itself is bad (INVALID_ARGUMENT), not refused.
BAD_REQUEST = (400, 413)
#: More tokens than any request or response ever used.
MAX_TOKENS = 1 << 30
#: The longest ``params_json`` a Plan request may carry.
MAX_PARAMS_JSON = 1 << 20


def guarded(method):
    """An unexpected exception in ``method`` ends the RPC with INTERNAL and no
    detail (logged as ``rpc-failed``); the method's own aborts pass."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log(logging.ERROR, "rpc-failed", exc_info=True, method=method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    return wrapper


class RouteCoreService(pb_grpc.RouteCoreServicer):
    def __init__(self, plane: DataPlane, max_body_bytes: int) -> None:
        self.plane = plane
        self.max_body_bytes = max_body_bytes

    @guarded
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        key = request.api_key.encode()
        kind = request.WhichOneof("request")
        if kind == "body":
            if len(request.body) > self.max_body_bytes:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"body exceeds {self.max_body_bytes} bytes",
                )
            outcome = await asyncio.to_thread(
                self.plane.route_body, request.body, key, list(request.token_ids) or None
            )
        elif kind == "measured":
            m = request.measured
            if m.category not in CATEGORIES and not m.prompt_tokens:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"category must be one of {list(CATEGORIES)}, got {m.category!r}",
                )
            for name in ("prompt_bytes", "max_output_tokens", "prompt_tokens"):
                if getattr(m, name) > MAX_TOKENS:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"measured.{name} must be at most {MAX_TOKENS}",
                    )
            outcome = await asyncio.to_thread(
                self.plane.route_fields,
                m.prompt_bytes,
                m.category,
                m.max_output_tokens,
                m.prompt_tokens or None,
                key,
                list(request.token_ids) or None,
            )
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set body or measured")
        if not outcome["admitted"]:
            if outcome["status"] in BAD_REQUEST:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, outcome["message"])
            return pb.RouteResponse(
                admission=pb.Admission(
                    admitted=False,
                    status=outcome["status"],
                    reason=outcome["reason"],
                    retry_after_s=outcome["retry_after_s"],
                )
            )
        return pb.RouteResponse(
            request_id=outcome["request_id"],
            pool=outcome["pool"],
            endpoint=outcome["endpoint"],
            est_input_tokens=outcome["est_input_tokens"],
            est_output_tokens=outcome["est_output_tokens"],
            est_total_tokens=outcome["est_input_tokens"] + outcome["est_output_tokens"],
            spilled=outcome["spilled"],
            reason=outcome["reason"],
            admission=pb.Admission(admitted=True, status=200),
            compress_target_tokens=outcome["compress_target_tokens"],
            compressed_body=outcome["body"] or b"",
        )

    @guarded
    async def Feedback(self, request: pb.FeedbackRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        done = self.plane.finish(
            request.request_id, request.prompt_tokens or None, request.completion_tokens or None
        )
        if not done:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no request in flight with id {request.request_id!r}"
            )
        return pb.FeedbackResponse()

    @guarded
    async def Plan(self, request: pb.PlanRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if len(request.params_json) > MAX_PARAMS_JSON:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"plan: params_json exceeds {MAX_PARAMS_JSON} bytes",
            )
        try:
            result = await asyncio.to_thread(plan_json, request.params_json)
        except RecursionError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "plan: params_json nests too deep"
            )
        except OverflowError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan: number out of range: {e}")
        except (ValueError, KeyError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan: {e}")
        return pb.PlanResponse(plan_json=result)


#: Profiles a Plan request may name.
PROFILES = {
    "llama3-70b-a100": Profile.llama3_70b_a100,
    "qwen3-235b-mi300x": Profile.qwen3_235b_mi300x,
}
PLAN_OPTIONS = {
    "b_short",
    "gammas",
    "p_c",
    "p_c_by_category",
    "phi",
    "rho_max",
    "long_context",
    "prefill_quantile",
}


def plan_json(params_json: str) -> str:
    """Runs ``routecore.plan`` on a JSON object of its arguments; returns the plan as JSON.

    ``{"arrival_rate": req/s, "slo_ttft_s": s, "workload": "azure-2023" or
    {"input_tokens": [...], "output_tokens": [...]}, "profile": a name of
    PROFILES (default: the planner's), and any keyword option of plan}`` ->
    ``{"homogeneous", "pool_routing", "best"}``, each a candidate's fields or null.
    """
    params = json.loads(params_json or "{}")
    if not isinstance(params, dict):
        raise ValueError("params_json must be a JSON object")
    unknown = set(params) - PLAN_OPTIONS - {"arrival_rate", "slo_ttft_s", "workload", "profile"}
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)}")
    workload = params.pop("workload", "azure-2023")
    if workload == "azure-2023":
        workload = Workload.azure_2023()
    elif isinstance(workload, dict) and set(workload) == {"input_tokens", "output_tokens"}:
        workload = Workload(workload["input_tokens"], workload["output_tokens"])
    else:
        raise ValueError('workload must be "azure-2023" or {input_tokens, output_tokens}')
    profile = params.pop("profile", None)
    if profile is not None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}")
        profile = PROFILES[profile]()
    arrival_rate, slo = params.pop("arrival_rate", None), params.pop("slo_ttft_s", None)
    if arrival_rate is None or slo is None:
        raise ValueError("arrival_rate and slo_ttft_s are required")
    p = plan(workload, arrival_rate, slo, profile, **params)
    fleets = {"homogeneous": p.homogeneous, "pool_routing": p.pool_routing, "best": p.best}
    return json.dumps({k: c.as_dict() if c is not None else None for k, c in fleets.items()})
