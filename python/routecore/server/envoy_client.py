"""Envoy's side of an ext_proc conversation, in Python: what ``routecore client``
(without ``--load``) sends to check a server, and what the tests and benches
speak to the data plane. Load is driven from Rust (``routecore client --load``).

BUFFERED mode: request headers, then the whole body, then the response
headers and body, each message answered before the next is sent. The
*added latency* of a request is the time Envoy waits on the processor before
it can forward the request upstream: the headers and body round trips.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format


def http_headers(pairs: dict[str, str], end_of_stream: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=end_of_stream,
    )


def chat_body(text: str, max_tokens: int | None = 100, stream: bool = False) -> bytes:
    body: dict = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def usage_body(prompt_tokens: int, completion_tokens: int) -> bytes:
    return json.dumps(
        {
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        }
    ).encode()


def sse_chunks(prompt_tokens: int, completion_tokens: int, pieces: int = 3) -> list[bytes]:
    """A streamed chat response: ``pieces`` delta events, a usage event, [DONE]."""
    events = [{"choices": [{"delta": {"content": f"tok{i}"}}]} for i in range(pieces)] + [
        {
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        }
    ]
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    raw = text.encode()
    step = max(1, len(raw) // (pieces + 2))  # cut across event boundaries on purpose
    return [raw[i : i + step] for i in range(0, len(raw), step)]


def header_map(mutation: pb.HeaderMutation) -> dict[str, str]:
    """The headers a mutation sets (``raw_value`` as Envoy sends it, else ``value``)."""
    return {
        h.header.key: h.header.raw_value.decode() if h.header.raw_value else h.header.value
        for h in mutation.set_headers
    }


def is_timeout_override(resp: pb.ProcessingResponse) -> bool:
    """Whether ``resp`` only asks Envoy to wait longer for the answer
    (``override_message_timeout``, no answer of its own)."""
    return resp.WhichOneof("response") is None and resp.HasField("override_message_timeout")


@dataclass
class Conversation:
    """What the processor answered in one conversation."""

    responses: list[pb.ProcessingResponse] = field(default_factory=list)
    #: Seconds spent waiting on the processor before the request could go upstream.
    added_s: float = 0.0
    #: The message timeouts the processor asked for (``override_message_timeout``:
    #: the request waited in flow control's queue), in seconds.
    timeout_overrides: list[float] = field(default_factory=list)

    @property
    def immediate(self) -> pb.ImmediateResponse | None:
        for r in self.responses:
            if r.HasField("immediate_response"):
                return r.immediate_response
        return None

    @property
    def routing(self) -> pb.ProcessingResponse | None:
        """The answer that carries the routing headers."""
        for r in self.responses:
            kind = r.WhichOneof("response")
            if kind in ("request_headers", "request_body"):
                mutation = getattr(r, kind).response.header_mutation
                if any(
                    h.header.key == "x-gateway-destination-endpoint" for h in mutation.set_headers
                ):
                    return r
        return None

    def envoy_view(self) -> list[dict[str, Any]]:
        """Each answer as Envoy acts on it: the phase it answers, and either the
        ``CommonResponse`` (status, headers set and removed, a replaced body's
        size, ``clear_route_cache``) or the immediate HTTP response (status,
        headers, body), with the dynamic metadata when there is any."""
        out: list[dict[str, Any]] = []
        for r in self.responses:
            phase = r.WhichOneof("response")
            view: dict[str, Any] = {"phase": phase}
            if phase == "immediate_response":
                im = r.immediate_response
                view["http_status"] = im.status.code
                view["headers"] = header_map(im.headers)
                view["body"] = im.body.decode("utf-8", "replace")
                if im.details:
                    view["details"] = im.details
            else:
                common = getattr(r, phase).response
                view["status"] = pb.CommonResponse.ResponseStatus.Name(common.status)
                view["set_headers"] = header_map(common.header_mutation)
                if common.header_mutation.remove_headers:
                    view["remove_headers"] = list(common.header_mutation.remove_headers)
                kind = common.body_mutation.WhichOneof("mutation")
                if kind is not None:
                    m = common.body_mutation
                    body = m.body if kind == "body" else m.streamed_response.body
                    view["body_replaced_bytes"] = 0 if kind == "clear_body" else len(body)
                if common.clear_route_cache:
                    view["clear_route_cache"] = True
            if r.HasField("dynamic_metadata"):
                view["dynamic_metadata"] = json_format.MessageToDict(r.dynamic_metadata)
            out.append(view)
        return out

    @property
    def routing_headers(self) -> dict[str, str]:
        r = self.routing
        if r is None:
            return {}
        return header_map(getattr(r, r.WhichOneof("response")).response.header_mutation)

    @property
    def endpoints(self) -> list[str]:
        """The endpoints routed to, in order: the chosen one, then its fallbacks
        (``x-gateway-destination-endpoint``; empty when not routed)."""
        listed = self.routing_headers.get("x-gateway-destination-endpoint", "")
        return listed.split(",") if listed else []


async def buffered(
    stub: pb_grpc.ExternalProcessorStub,
    headers: dict[str, str],
    body: bytes | None,
    response_chunks: list[bytes] | None = None,
    response_headers: dict[str, str] | None = None,
) -> Conversation:
    """One BUFFERED-mode conversation, message by message as Envoy sends them."""
    conv = Conversation()
    call = stub.Process()

    async def exchange(req: pb.ProcessingRequest) -> bool:
        await call.write(req)
        resp = await call.read()
        # A timeout override is not the answer (Envoy restarts its timer and
        # keeps waiting for it).
        while resp is not grpc.aio.EOF and is_timeout_override(resp):
            conv.timeout_overrides.append(
                resp.override_message_timeout.ToTimedelta().total_seconds()
            )
            resp = await call.read()
        if resp is grpc.aio.EOF:
            return False
        conv.responses.append(resp)
        return not resp.HasField("immediate_response")

    start = time.perf_counter()
    ok = await exchange(pb.ProcessingRequest(request_headers=http_headers(headers, body is None)))
    if ok and body is not None:
        ok = await exchange(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
    conv.added_s = time.perf_counter() - start
    if ok and response_chunks is not None:
        rh = response_headers or {":status": "200", "content-type": "application/json"}
        ok = await exchange(pb.ProcessingRequest(response_headers=http_headers(rh)))
        for i, chunk in enumerate(response_chunks):
            last = i == len(response_chunks) - 1
            if not (
                ok
                and await exchange(
                    pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=last))
                )
            ):
                break
    await call.done_writing()
    call.cancel()
    return conv
