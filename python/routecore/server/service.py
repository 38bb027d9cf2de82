"""The ``routecore.v1.RouteCore`` gRPC service (proto/routecore/v1/routecore.proto).

Refusals that are decisions (unknown key, no endpoint, admission) come back
in ``RouteResponse.admission`` with the HTTP status a gateway would answer;
requests that cannot be routed at all (malformed body, bad fields, too long
for every pool) are ``INVALID_ARGUMENT``, and a Feedback for an unknown
request id is ``NOT_FOUND``.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from routecore.server.engine import EngineHolder, Reject
from routecore.server.gen import routecore_pb2 as pb
from routecore.server.gen import routecore_pb2_grpc as pb_grpc

#: The categories ``routecore.classify`` assigns (and the calibrator learns).
CATEGORIES = ("prose", "code", "cjk", "mixed")
#: Statuses that mean the request itself is bad (INVALID_ARGUMENT), not refused.
BAD_REQUEST = (400, 413)


class RouteCoreService(pb_grpc.RouteCoreServicer):
    def __init__(self, holder: EngineHolder) -> None:
        self.holder = holder

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        engine = self.holder.engine
        start = time.perf_counter()
        outcome = engine.authenticate(request.api_key, time.time())
        if not isinstance(outcome, Reject):
            tenant, now = outcome, time.monotonic()
            kind = request.WhichOneof("request")
            if kind == "body":
                if len(request.body) > engine.config.limits.max_body_bytes:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"body exceeds {engine.config.limits.max_body_bytes} bytes",
                    )
                outcome = engine.route_body(request.body, tenant, now)
            elif kind == "measured":
                m = request.measured
                if m.category not in CATEGORIES and not m.prompt_tokens:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"category must be one of {list(CATEGORIES)}, got {m.category!r}",
                    )
                token_ids = (
                    np.array(request.token_ids, dtype=np.uint32) if request.token_ids else None
                )
                outcome = engine.route_fields(
                    m.prompt_bytes,
                    m.category,
                    m.max_output_tokens,
                    m.prompt_tokens or None,
                    tenant,
                    now,
                    token_ids,
                )
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set body or measured")
        engine.metrics.decision_seconds.observe(time.perf_counter() - start)
        if isinstance(outcome, Reject):
            if outcome.status in BAD_REQUEST:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, outcome.message)
            return pb.RouteResponse(
                admission=pb.Admission(
                    admitted=False,
                    status=outcome.status,
                    reason=outcome.reason,
                    retry_after_s=outcome.retry_after_s,
                )
            )
        return pb.RouteResponse(
            request_id=outcome.request_id,
            pool=outcome.pool,
            endpoint=outcome.endpoint,
            est_input_tokens=outcome.est_input_tokens,
            est_output_tokens=outcome.est_output_tokens,
            est_total_tokens=outcome.est_total_tokens,
            spilled=outcome.spilled,
            reason=outcome.reason,
            admission=pb.Admission(admitted=True, status=200),
            compress_target_tokens=outcome.compress_target_tokens,
            compressed_body=outcome.body or b"",
        )

    async def Feedback(self, request: pb.FeedbackRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        holder = self.holder
        for engine in (holder.engine, *holder.retired):
            lease = engine.lease(request.request_id)
            if lease is not None:
                engine.finish(
                    lease,
                    request.prompt_tokens or None,
                    request.completion_tokens or None,
                    time.monotonic(),
                )
                return pb.FeedbackResponse()
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"no request in flight with id {request.request_id!r}"
        )

    async def Plan(self, request: pb.PlanRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the planner is not part of this build")
