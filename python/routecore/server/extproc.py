"""Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor``, on the xds-protos stubs.

One gRPC stream is one HTTP request. Following the conventions of the Gateway
API Inference Extension's endpoint picker:

- Request headers: the tenant's API key is read from the key header (401 /
  403 as an ImmediateResponse when unknown or expired). In BUFFERED and
  STREAMED body modes the headers are answered at once; in
  FULL_DUPLEX_STREAMED the answer waits for the whole body, so that it can
  carry the routing headers.
- Request body: chunks are accumulated up to ``limits.max_body_bytes`` (413
  above). The body is parsed in Rust and routed (pool by token budget,
  endpoint inside it). The answer sets ``x-gateway-destination-endpoint:
  ip:port`` and ``x-routecore-pool`` with ``clear_route_cache``, and the
  ``envoy.lb`` dynamic metadata ``{x-gateway-destination-endpoint: ip:port}``.
  In STREAMED mode every chunk but the last is answered empty and the last
  carries the routing; in FULL_DUPLEX_STREAMED the headers answer comes first,
  then the body is sent back as ``streamed_response`` chunks.
- Refusals (malformed body 400, context too long 400, oversize 413, no
  endpoint 503, an internal failure under ``failure_mode: closed`` 503) are an
  ImmediateResponse with a JSON error body.
- Response: ``usage.prompt_tokens`` / ``completion_tokens`` are read from a
  JSON body or from the SSE chunk that carries ``usage`` in a streamed one;
  at the end of the response the lease is finished (calibrator fed, in-flight
  released). A stream that closes before that releases the lease without
  usage; one that stays open past ``limits.request_timeout_s`` is reaped.
"""

from __future__ import annotations

import json
import logging
import math
import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from routecore.server.engine import Engine, EngineHolder, Lease, Reject
from routecore.server.logs import log

DESTINATION_HEADER = "x-gateway-destination-endpoint"
POOL_HEADER = "x-routecore-pool"
LB_NAMESPACE = "envoy.lb"
#: Size of the streamed_response chunks a rewritten body is sent back in (as the GIE does).
BODY_CHUNK = 62_000

Mode = processing_mode_pb2.ProcessingMode
STREAMED = Mode.STREAMED
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED


def header(key: str, value: str | bytes) -> base_pb2.HeaderValueOption:
    raw = value.encode() if isinstance(value, str) else value
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=raw))


def header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


def error_body(status: int, reason: str, message: str) -> bytes:
    """An OpenAI-style JSON error body."""
    return json.dumps({"error": {"message": message, "type": reason, "code": status}}).encode()


def immediate(rej: Reject) -> pb.ProcessingResponse:
    headers = [header("content-type", "application/json")]
    if rej.retry_after_s > 0:
        headers.append(header("retry-after", str(math.ceil(rej.retry_after_s))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=rej.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=error_body(rej.status, rej.reason, rej.message),
            details=rej.reason,
        )
    )


def routing_mutation(lease: Lease) -> pb.HeaderMutation:
    headers = [header(DESTINATION_HEADER, lease.endpoint), header(POOL_HEADER, lease.pool)]
    if lease.body is not None:
        headers.append(header("content-length", str(len(lease.body))))
    return pb.HeaderMutation(set_headers=headers)


def lb_metadata(lease: Lease) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = lease.endpoint
    return md


def usage_of(obj: object) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a response object's ``usage``."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if not isinstance(p, int) or not isinstance(c, int) or isinstance(p, bool) or p < 0 or c < 0:
        return None
    return p, c


class UsageReader:
    """Finds ``usage`` in a response body given chunk by chunk.

    JSON bodies are accumulated (up to ``limit`` bytes) and parsed at the end;
    SSE bodies are scanned line by line as they pass, keeping only the
    unfinished line, and the last ``data:`` event carrying usage wins.
    """

    def __init__(self, sse: bool, limit: int) -> None:
        self.sse = sse
        self.limit = limit
        self.buf = bytearray()
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes, end: bool) -> None:
        if len(self.buf) + len(chunk) > self.limit:
            self.buf.clear()  # too large to hold: usage is not learned from it
            self.limit = 0
            return
        self.buf += chunk
        if self.sse:
            *lines, rest = bytes(self.buf).split(b"\n")
            self.buf = bytearray(rest)
            if end:
                lines.append(rest)
            for line in lines:
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._parse(line[5:])
        elif end:
            self._parse(bytes(self.buf))

    def _parse(self, data: bytes) -> None:
        try:
            found = usage_of(json.loads(data))
        except ValueError:
            return
        if found is not None:
            self.usage = found


class Conversation:
    """The state of one ext_proc stream (one HTTP request and its response)."""

    def __init__(self, holder: EngineHolder) -> None:
        self.engine: Engine = holder.engine  # pinned: a reload does not move this request
        self.limits = self.engine.config.limits
        self.request_mode = Mode.BUFFERED
        self.response_mode = Mode.NONE
        self.tenant = None
        self.authenticated = False
        self.body = bytearray()
        self.lease: Lease | None = None
        self.routed = False
        self.usage: UsageReader | None = None
        self.done = False

    # One ProcessingRequest in, the responses it calls for out.
    def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode or Mode.BUFFERED
            self.response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self.on_request_headers(req.request_headers)
        if kind == "request_body":
            return self.on_request_body(req.request_body.body, req.request_body.end_of_stream)
        if kind == "request_trailers":  # the body ended without end_of_stream
            out = [] if self.routed else self.on_request_body(b"", True)
            if self.done:
                return out
            return out + [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self.on_response_headers(req.response_headers)
        if kind == "response_body":
            return self.on_response_body(req.response_body.body, req.response_body.end_of_stream)
        if kind == "response_trailers":
            self.finish()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def on_request_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        key = None
        key_header = self.engine.config.server.key_header
        for h in headers.headers.headers:
            if h.key.lower() == key_header:
                key = header_value(h)
                break
        auth = self.engine.authenticate(key, time.time())
        if isinstance(auth, Reject):
            return self.refuse(auth)
        self.tenant, self.authenticated = auth, True
        if headers.end_of_stream:  # no body to route on: the default pool
            self.routed = True
            return self.answer(self.engine.route_default(self.tenant, time.monotonic()), False)
        if self.request_mode == FULL_DUPLEX:
            return []
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    def on_request_body(self, chunk: bytes, end: bool) -> list[pb.ProcessingResponse]:
        if self.routed:  # chunks after routing pass through (duplex: echoed back)
            return self.pass_body(chunk, end, request=True)
        if not self.authenticated:  # Envoy skipped the headers: there is no key to check
            auth = self.engine.authenticate(None, time.time())
            if isinstance(auth, Reject):
                return self.refuse(auth)
            self.authenticated = True
        if len(self.body) + len(chunk) > self.limits.max_body_bytes:
            return self.refuse(
                self.engine.refuse(
                    self.tenant,
                    413,
                    "body-too-large",
                    f"request body exceeds {self.limits.max_body_bytes} bytes",
                )
            )
        self.body += chunk
        if end or self.request_mode not in (STREAMED, FULL_DUPLEX):
            return self.route_now()
        if self.request_mode == STREAMED:
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return []

    def route_now(self) -> list[pb.ProcessingResponse]:
        self.routed = True
        engine = self.engine
        start = time.perf_counter()
        try:
            outcome = engine.route_body(bytes(self.body), self.tenant, time.monotonic())
        except Exception:
            mode = engine.config.server.failure_mode
            engine.metrics.child(engine.metrics.failures, mode).inc()
            log(logging.ERROR, "route-failed", exc_info=True, failure_mode=mode)
            if mode == "open":
                outcome = engine.route_default(self.tenant, time.monotonic())
            else:
                outcome = engine.refuse(self.tenant, 503, "internal-error", "routing failed")
        engine.metrics.decision_seconds.observe(time.perf_counter() - start)
        return self.answer(outcome, True)

    def answer(self, outcome: Lease | Reject, has_body: bool) -> list[pb.ProcessingResponse]:
        if isinstance(outcome, Reject):
            return self.refuse(outcome)
        self.lease = lease = outcome
        tenant = self.tenant.name if self.tenant is not None else None
        log(
            logging.DEBUG,
            "routed",
            request_id=lease.request_id,
            tenant=tenant,
            pool=lease.pool,
            endpoint=lease.endpoint,
            reason=lease.reason,
        )
        common = pb.CommonResponse(header_mutation=routing_mutation(lease), clear_route_cache=True)
        md = lb_metadata(lease)
        if not has_body:
            return [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=md
                )
            ]
        body = lease.body if lease.body is not None else bytes(self.body)
        self.body = bytearray()
        if self.request_mode == FULL_DUPLEX:
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=md
                )
            ]
            for i in range(0, max(len(body), 1), BODY_CHUNK):
                last = i + BODY_CHUNK >= len(body)
                out.append(self.streamed(body[i : i + BODY_CHUNK], last, request=True))
            return out
        if lease.body is not None:
            common.body_mutation.body = lease.body
        return [
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=md
            )
        ]

    def refuse(self, rej: Reject) -> list[pb.ProcessingResponse]:
        log(
            logging.INFO,
            "refused",
            status=rej.status,
            reason=rej.reason,
            tenant=self.tenant.name if self.tenant is not None else None,
        )
        self.done = True
        return [immediate(rej)]

    @staticmethod
    def streamed(chunk: bytes, end: bool, request: bool) -> pb.ProcessingResponse:
        body = pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end)
                )
            )
        )
        if request:
            return pb.ProcessingResponse(request_body=body)
        return pb.ProcessingResponse(response_body=body)

    def pass_body(self, chunk: bytes, end: bool, request: bool) -> list[pb.ProcessingResponse]:
        mode = self.request_mode if request else self.response_mode
        if mode == FULL_DUPLEX:
            return [self.streamed(chunk, end, request)]
        if request:
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def on_response_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        sse = any(
            h.key.lower() == "content-type" and "text/event-stream" in header_value(h)
            for h in headers.headers.headers
        )
        self.usage = UsageReader(sse, self.limits.max_body_bytes)
        if headers.end_of_stream:
            self.finish()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def on_response_body(self, chunk: bytes, end: bool) -> list[pb.ProcessingResponse]:
        if self.usage is None:
            self.usage = UsageReader(False, self.limits.max_body_bytes)
        self.usage.feed(chunk, end)
        if end:
            self.finish()
        return self.pass_body(chunk, end, request=False)

    def finish(self) -> None:
        """Releases the lease, learning from the usage if the response carried it."""
        if self.lease is None:
            return
        usage = self.usage.usage if self.usage is not None else None
        prompt, completion = usage if usage is not None else (None, None)
        self.engine.finish(self.lease, prompt, completion, time.monotonic())
        self.lease = None

    def close(self) -> None:
        """The stream ended: a request still in flight is released without usage."""
        if self.lease is not None:
            self.engine.finish(self.lease, None, None, time.monotonic())
            self.lease = None


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, holder: EngineHolder) -> None:
        self.holder = holder

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        # context.read / context.write: cheaper than an async generator per stream.
        conv = Conversation(self.holder)
        try:
            while not conv.done:
                req = await context.read()
                if req is grpc.aio.EOF:
                    break
                for resp in conv.handle(req):
                    await context.write(resp)
        finally:
            conv.close()
