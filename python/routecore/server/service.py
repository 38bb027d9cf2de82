"""The ``routecore.v1.RouteCore`` gRPC service (proto/routecore/v1/routecore.proto).

A thin wrapper over the Rust data plane (:class:`routecore.DataPlane`): Route
and Feedback use the same calibrator, leases and admission as Envoy's
ext_proc, and every call goes through the same front door (the key, the body
limit, ``server.failure_mode``, the decision's timing; ``rust/serve/front.rs``):
this module only translates messages.

Every call authenticates as Envoy's requests do: the tenant's API key in the
call's metadata under ``server.key_header`` (``x-api-key``), or in the
message's ``api_key`` field (Route, Feedback). A Feedback ends only a request
its caller's tenant routed through Route (never an Envoy stream's), by an id
of at most 64 bytes that is never echoed. Refusals of Route that are
decisions (unknown or expired key, no endpoint, admission, a failure under
``failure_mode: closed``) come back in ``RouteResponse.admission`` with the
HTTP status a gateway would answer; requests that are bad themselves (the
refusal's ``bad_request``: malformed body, bad fields, too long for every
pool, over ``limits.max_body_bytes``, an id too long) are
``INVALID_ARGUMENT``. Feedback and Plan answer a refused key with
``UNAUTHENTICATED`` (401) or ``PERMISSION_DENIED`` (403 expired), and a
Feedback for a request that is not its caller's in flight with
``NOT_FOUND``; a Feedback whose usage cannot be real still ends the request
(the usage is ignored and counted). Any other unexpected failure is
``INTERNAL`` with no detail. ``Plan`` runs the FleetOpt planner
(``routecore.plan``) off the event loop; bad, too deep or out-of-range
parameters are ``INVALID_ARGUMENT``. ``Autoscale`` answers each scaled
pool's desired endpoint count from the data plane's last sizing step
(``FAILED_PRECONDITION`` when the configuration has no ``autoscale``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

import grpc

from routecore._core import DataPlane, Plan, Workload, plan
from routecore._json import dumps
from routecore.planning import plan_json
from routecore.profiles import PRESETS
from routecore.server.gen import routecore_pb2 as pb
from routecore.server.gen import routecore_pb2_grpc as pb_grpc
from routecore.server.logs import log

#: The longest ``params_json`` a Plan request may carry.
MAX_PARAMS_JSON = 1 << 20

#: The gRPC status of a refusal by its HTTP status (Feedback, Plan).
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
}


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
    def __init__(self, plane: DataPlane, key_header: str = "x-api-key") -> None:
        self.plane = plane
        self.key_header = key_header

    def api_key(self, context: grpc.aio.ServicerContext, field: str = "") -> bytes:
        """The caller's API key: the metadata's key header, else ``field``
        (b"" when neither: a call without a key)."""
        for name, value in context.invocation_metadata() or ():
            if name == self.key_header:
                return value if isinstance(value, bytes) else value.encode()
        return field.encode()

    async def refuse(self, context: grpc.aio.ServicerContext, refusal: dict) -> None:
        """Ends the call with the refusal's gRPC status and message."""
        code = STATUS_CODES.get(refusal["status"], grpc.StatusCode.INTERNAL)
        await context.abort(code, refusal["message"])

    @guarded
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        key = self.api_key(context, request.api_key)
        kind = request.WhichOneof("request")
        if kind == "body":
            outcome = await asyncio.to_thread(
                self.plane.route_body, request.body, key, list(request.token_ids) or None
            )
        elif kind == "measured":
            m = request.measured
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
            if outcome["bad_request"]:
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
            prefill_endpoint=outcome["prefill_endpoint"] or "",
        )

    @guarded
    async def Feedback(self, request: pb.FeedbackRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        done = self.plane.feedback(
            request.request_id,
            self.api_key(context, request.api_key),
            request.prompt_tokens or None,
            request.completion_tokens or None,
        )
        if not done["done"]:
            await self.refuse(context, done)
        return pb.FeedbackResponse()

    @guarded
    async def Plan(self, request: pb.PlanRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        caller = self.plane.authenticate(self.api_key(context))
        if not caller["authenticated"]:
            await self.refuse(context, caller)
        if len(request.params_json) > MAX_PARAMS_JSON:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"plan: params_json exceeds {MAX_PARAMS_JSON} bytes",
            )
        try:
            result = await asyncio.to_thread(plan_from_params, request.params_json)
        except RecursionError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "plan: params_json nests too deep"
            )
        except OverflowError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan: number out of range: {e}")
        except (ValueError, KeyError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan: {e}")
        return pb.PlanResponse(plan_json=dumps(plan_json(result)))

    @guarded
    async def Autoscale(self, request: pb.AutoscaleRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        caller = self.plane.authenticate(self.api_key(context))
        if not caller["authenticated"]:
            await self.refuse(context, caller)
        pools = self.plane.autoscale()
        if pools is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "autoscale: off (no autoscale section)"
            )
        return pb.AutoscaleResponse(
            pools=[
                pb.PoolAutoscale(
                    pool=d["pool"],
                    desired_endpoints=d["endpoints"],
                    target_endpoints=d["target"],
                    model_endpoints=d["model_endpoints"],
                    reason=d["reason"],
                    binding=d["binding"],
                    rate=d["rate"],
                    observed_rate=d["observed_rate"],
                    queued_rate=d["queued_rate"],
                    promised_rate=d["promised_rate"],
                    prompt_tokens_p50=d["prompt_p50"],
                    prompt_tokens_p99=d["prompt_p99"],
                    output_tokens_p50=d["output_p50"],
                    output_tokens_p99=d["output_p99"],
                    explanation=d["explanation"],
                )
                for d in pools
            ]
        )


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


def plan_from_params(params_json: str) -> Plan:
    """Runs ``routecore.plan`` on a JSON object of its arguments.

    ``{"arrival_rate": req/s, "slo_ttft_s": s, "workload": "azure-2023" or
    {"input_tokens": [...], "output_tokens": [...]}, "profile": a preset name
    of ``routecore.profiles.PRESETS`` (default: the planner's), and any keyword
    option of plan}``; the answer is ``routecore.planning.plan_json`` of it.
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
        if profile not in PRESETS:
            raise ValueError(f"profile must be one of {sorted(PRESETS)}")
        profile = PRESETS[profile]()
    arrival_rate, slo = params.pop("arrival_rate", None), params.pop("slo_ttft_s", None)
    if arrival_rate is None or slo is None:
        raise ValueError("arrival_rate and slo_ttft_s are required")
    return plan(workload, arrival_rate, slo, profile, **params)
