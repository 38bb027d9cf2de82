"""One ext_proc conversation handled in plain Python: the same steps as
routecore's ``Conversation`` (key lookup, body parse with ``json``, token-budget
pool with the plain-Python router of ``baselines.budget``, least-request
endpoint, the same protobuf answers, usage read back into the calibrator),
written the way a Python processor would."""

from __future__ import annotations

import hashlib
import hmac
import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from benches.baselines.budget import TokenBudgetRouter
from routecore.server.engine import Lease
from routecore.server.extproc import lb_metadata, routing_mutation


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
                    h.raw_value for h in req.request_headers.headers.headers if h.key == "x-api-key"
                )
                digest = hashlib.sha256(key).digest()
                assert any(hmac.compare_digest(digest, d) for d in self.keys)
                out.append(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
            elif kind == "request_body":
                body = json.loads(req.request_body.body)
                text = "".join(m["content"] for m in body["messages"])
                prompt_bytes = len(text.encode())
                pool = self.names[self.router.route(prompt_bytes, "prose", body["max_tokens"])]
                load = self.load[pool]
                endpoint = min(load, key=load.__getitem__)
                load[endpoint] += 1
                route = (pool, endpoint, prompt_bytes)
                lease = Lease(
                    "1",
                    pool,
                    endpoint,
                    None,
                    None,
                    prompt_bytes,
                    "prose",
                    False,
                    "budget",
                    0.0,
                    0.0,
                )
                common = pb.CommonResponse(
                    header_mutation=routing_mutation(lease), clear_route_cache=True
                )
                out.append(
                    pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=common),
                        dynamic_metadata=lb_metadata(lease),
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
