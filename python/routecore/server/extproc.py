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
- Failures: a routing failure follows ``server.failure_mode`` (open: the
  default pool, not put to admission again; closed: 503). Any other exception
  while handling a message releases the lease and answers a 503
  ImmediateResponse in the request phase, or lets the response pass unchanged
  in the response phase; the stream is never aborted with an internal error
  and no internal detail reaches the client.
- Protocol misuse: ``request_headers`` after any other message of the stream
  (e.g. twice) and ``response_headers`` twice end the stream with
  FAILED_PRECONDITION, after releasing what it holds.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable

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
#: The longest SSE line the usage reader keeps while it is unfinished; a longer
#: line (no usage event is that long) is skipped up to its end.
MAX_SSE_LINE = 64 * 1024

Mode = processing_mode_pb2.ProcessingMode
STREAMED = Mode.STREAMED
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED


def header(key: str, value: str | bytes) -> base_pb2.HeaderValueOption:
    raw = value.encode() if isinstance(value, str) else value
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=raw))


def header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


def header_bytes(h: base_pb2.HeaderValue) -> bytes:
    """The header's value as bytes, whichever field carries it (Envoy sends ``raw_value``)."""
    return h.raw_value if h.raw_value else h.value.encode()


class ProtocolError(Exception):
    """A message the ext_proc protocol does not allow at this point of the stream."""


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

    JSON bodies are accumulated (up to ``limit`` bytes) and parsed at the end.
    SSE bodies are scanned as they pass, in linear time: only the new bytes
    are searched for line ends and only the unfinished line is kept, up to
    :data:`MAX_SSE_LINE` bytes (a longer line is skipped to its end); the last
    ``data:`` event carrying usage wins.
    """

    def __init__(self, sse: bool, limit: int) -> None:
        self.sse = sse
        self.limit = limit
        self.buf = bytearray()
        self.skipping = False
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes, end: bool) -> None:
        if self.sse:
            start = 0
            while (i := chunk.find(b"\n", start)) >= 0:
                self._append(chunk, start, i)
                self._end_line()
                start = i + 1
            self._append(chunk, start, len(chunk))
            if end:
                self._end_line()
            return
        if len(self.buf) + len(chunk) > self.limit:
            self.buf.clear()  # too large to hold: usage is not learned from it
            self.limit = 0
            return
        self.buf += chunk
        if end:
            self._parse(bytes(self.buf))

    def _append(self, chunk: bytes, start: int, stop: int) -> None:
        if self.skipping or start == stop:
            return
        if len(self.buf) + stop - start > MAX_SSE_LINE:
            self.buf.clear()
            self.skipping = True
        else:
            self.buf += chunk[start:stop]

    def _end_line(self) -> None:
        line = bytes(self.buf)
        if not self.skipping and line.startswith(b"data:") and b'"usage"' in line:
            self._parse(line[5:])
        self.buf.clear()
        self.skipping = False

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
        #: Messages seen so far, and whether the response has begun.
        self.seen = 0
        self.responding = False
        #: A failure in the response phase: the rest of the stream passes unchanged.
        self.failed = False

    # One ProcessingRequest in, the responses it calls for out.
    async def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Answers one message; raises :class:`ProtocolError` for what the protocol
        does not allow. Any other failure is answered here (see the module doc)."""
        kind = req.WhichOneof("request")
        self.check_order(kind)
        if self.failed:
            return self.passthrough(req)
        try:
            return await self.dispatch(req, kind)
        except Exception:
            return self.fail(req, kind)

    def check_order(self, kind: str | None) -> None:
        self.seen += 1
        if kind == "request_headers" and self.seen > 1:
            raise ProtocolError("request_headers after other messages of the stream")
        if kind == "response_headers":
            if self.responding:
                raise ProtocolError("response_headers sent twice")
            self.responding = True
        elif kind in ("response_body", "response_trailers"):
            self.responding = True

    async def dispatch(
        self, req: pb.ProcessingRequest, kind: str | None
    ) -> list[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode or Mode.BUFFERED
            self.response_mode = req.protocol_config.response_body_mode
        if kind == "request_headers":
            return await self.on_request_headers(req.request_headers)
        if kind == "request_body":
            return await self.on_request_body(req.request_body.body, req.request_body.end_of_stream)
        if kind == "request_trailers":  # the body ended without end_of_stream
            out = [] if self.routed else await self.on_request_body(b"", True)
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

    def fail(self, req: pb.ProcessingRequest, kind: str | None) -> list[pb.ProcessingResponse]:
        """An unexpected failure: release, then refuse (request phase) or pass (response)."""
        mode = self.engine.config.server.failure_mode
        log(logging.ERROR, "stream-failed", exc_info=True, phase=kind, failure_mode=mode)
        self.close()
        try:
            self.engine.metrics.child(self.engine.metrics.failures, mode).inc()
        except Exception:
            log(logging.ERROR, "metrics-failed", exc_info=True)
        if self.responding:
            self.failed = True
            return self.passthrough(req)
        self.done = True
        return [immediate(Reject(503, "internal-error", "internal error"))]

    def passthrough(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answer that lets ``req`` pass unchanged."""
        kind = req.WhichOneof("request")
        if kind in ("request_body", "response_body"):
            body = getattr(req, kind)
            return self.pass_body(body.body, body.end_of_stream, request=kind == "request_body")
        if kind in ("request_headers", "response_headers"):
            return [pb.ProcessingResponse(**{kind: pb.HeadersResponse()})]
        if kind in ("request_trailers", "response_trailers"):
            return [pb.ProcessingResponse(**{kind: pb.TrailersResponse()})]
        return []

    async def decide(self, route: Callable[[], Awaitable[Lease | Reject]]) -> Lease | Reject:
        """:meth:`Engine.decide`, keeping the lease it hands out."""
        outcome = await self.engine.decide(self.tenant, route)
        if isinstance(outcome, Lease):
            self.lease = outcome
        return outcome

    async def on_request_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        key = None
        key_header = self.engine.config.server.key_header
        for h in headers.headers.headers:
            if h.key.lower() == key_header:
                key = header_bytes(h)
                break
        auth = self.engine.authenticate(key, time.time())
        if isinstance(auth, Reject):
            return self.refuse(auth)
        self.tenant, self.authenticated = auth, True
        if headers.end_of_stream:  # no body to route on: the default pool
            self.routed = True
            tenant = self.tenant
            outcome = await self.decide(lambda: self.engine.route_default(tenant, time.monotonic()))
            return self.answer(outcome, False)
        if self.request_mode == FULL_DUPLEX:
            return []
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def on_request_body(self, chunk: bytes, end: bool) -> list[pb.ProcessingResponse]:
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
            return await self.route_now()
        if self.request_mode == STREAMED:
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return []

    async def route_now(self) -> list[pb.ProcessingResponse]:
        self.routed = True
        engine = self.engine
        start = time.perf_counter()
        body, tenant = bytes(self.body), self.tenant
        outcome = await self.decide(lambda: engine.route_body(body, tenant, time.monotonic()))
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
        lease, self.lease = self.lease, None
        if lease is None:
            return
        usage = self.usage.usage if self.usage is not None else None
        prompt, completion = usage if usage is not None else (None, None)
        self.engine.finish(lease, prompt, completion, time.monotonic())

    def close(self) -> None:
        """The stream ended: a request still in flight is released without usage."""
        lease, self.lease = self.lease, None
        if lease is not None:
            self.engine.finish(lease, None, None, time.monotonic())


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
                try:
                    out = await conv.handle(req)
                except ProtocolError as e:
                    conv.close()
                    conv.engine.metrics.protocol_errors.inc()
                    log(logging.WARNING, "protocol-error", error=str(e))
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
                    return
                for resp in out:
                    await context.write(resp)
        finally:
            conv.close()
