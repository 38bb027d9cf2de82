"""One ext_proc conversation handled in plain Python and served by grpcio: the
same steps as routecore's data plane (key lookup, body parse with ``json``,
token-budget pool with the plain-Python router of ``baselines.budget``,
least-request endpoint, the same protobuf answers, usage read back into the
calibrator), written the way a Python processor would."""

from __future__ import annotations

import hashlib
import hmac
import json
from concurrent import futures

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from routecore._baselines.budget import TokenBudgetRouter

#: The tenant's key header, removed before the request leaves for an engine.
KEY_HEADER = "x-api-key"
#: What every answer removes: the key and llm-d's sidecar header (a client's
#: is never trusted: docs/disaggregation.md).
REMOVED = [KEY_HEADER, "x-prefiller-host-port"]


def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def routing_mutation(pool: str, endpoint: str) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            header("x-gateway-destination-endpoint", endpoint),
            header("x-routecore-pool", pool),
        ],
        remove_headers=REMOVED,
    )


def lb_metadata(endpoint: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"
    ].string_value = endpoint
    return md


class Processor:
    def __init__(self, pools, endpoints, keys):
        self.router = TokenBudgetRouter(pools)
        self.names = [p[0] for p in pools]
        self.load = {name: dict.fromkeys(endpoints[name], 0) for name in self.names}
        self.keys = {hashlib.sha256(k.encode()).digest(): t for k, t in keys.items()}

    def conversation(self, messages):
        out, route = [], None
        for req in messages:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                key = next(
                    h.raw_value for h in req.request_headers.headers.headers if h.key == KEY_HEADER
                )
                digest = hashlib.sha256(key).digest()
                assert any(hmac.compare_digest(digest, d) for d in self.keys)
                strip = pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=REMOVED))
                out.append(
                    pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=strip))
                )
            elif kind == "request_body":
                body = json.loads(req.request_body.body)
                text = "".join(m["content"] for m in body["messages"])
                prompt_bytes = len(text.encode())
                pool = self.names[self.router.route(prompt_bytes, "prose", body["max_tokens"])]
                load = self.load[pool]
                endpoint = min(load, key=load.__getitem__)
                load[endpoint] += 1
                route = (pool, endpoint, prompt_bytes)
                common = pb.CommonResponse(
                    header_mutation=routing_mutation(pool, endpoint), clear_route_cache=True
                )
                out.append(
                    pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=common),
                        dynamic_metadata=lb_metadata(endpoint),
                    )
                )
            elif kind == "response_headers":
                out.append(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
            elif kind == "response_body":
                usage = json.loads(req.response_body.body)["usage"]
                pool, endpoint, prompt_bytes = route
                self.router.in_flight[self.names.index(pool)] -= 1
                self.load[pool][endpoint] -= 1
                self.router.calibrator.observe("prose", prompt_bytes, usage["prompt_tokens"])
                out.append(pb.ProcessingResponse(response_body=pb.BodyResponse()))
        return out


class Servicer(pb_grpc.ExternalProcessorServicer):
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    def Process(self, request_iterator, context):  # noqa: N802
        yield from self.processor.conversation(list(request_iterator))


def serve(processor: Processor) -> tuple[grpc.Server, int]:
    """Serves ``processor`` on a free port of 127.0.0.1 (grpcio, one thread)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_ExternalProcessorServicer_to_server(Servicer(processor), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port
