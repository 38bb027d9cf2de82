"""A mock of SGLang's prefill/decode disaggregation (SGLang cannot run on this
CPU machine): two HTTP servers, a prefill and a decode one, that speak the PD
protocol as its documents describe it (``tests/fixtures/sglang/pd.json``):
each request carries the client's body plus ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room``; the two requests of one client
request meet in their room (each waits for the other, as the decode engine
waits for the prefill engine's KV and the prefill engine for its decode
peer); the prefill server answers the prefill response, the decode server
the decode response. A request that does not have the documented fields, or
whose peer never comes, is answered 400 / 504, as a router's mistake would
make SGLang fail."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURE = json.loads((Path(__file__).parent / "fixtures/sglang/pd.json").read_text())
#: How long a request waits for its peer in the room.
MEET_S = 10.0


def check_request(body: Any) -> str | None:
    """Why ``body`` is not a documented PD request (None: it is)."""
    if not isinstance(body, dict):
        return "not a JSON object"
    for field, kind in FIXTURE["bootstrap_fields"].items():
        if field not in body:
            return f"{field} missing"
        v = body[field]
        ok = {
            "string": isinstance(v, str) and bool(v),
            "integer": isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63,
            "integer-or-null": v is None or (isinstance(v, int) and 0 < v < 65536),
        }[kind]
        if not ok:
            return f"{field}: expected {kind}, got {v!r}"
    return None


class Rooms:
    """The bootstrap rooms both mocks share: who arrived in which room."""

    def __init__(self, meet_s: float = MEET_S) -> None:
        self.meet_s = meet_s
        self.cond = threading.Condition()
        self.arrived: dict[tuple, set[str]] = {}

    def meet(self, role: str, key: tuple) -> bool:
        """``role`` arrived in room ``key``; True once the other role has too."""
        other = "decode" if role == "prefill" else "prefill"
        with self.cond:
            self.arrived.setdefault(key, set()).add(role)
            self.cond.notify_all()
            return self.cond.wait_for(lambda: other in self.arrived[key], timeout=self.meet_s)


class SglangServer:
    """One mock SGLang server in ``role`` (prefill or decode) on a free port."""

    def __init__(self, role: str, rooms: Rooms) -> None:
        self.role = role
        self.received: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                server.received.append({"headers": dict(self.headers), "body": body})
                why = check_request(body)
                if why is not None:
                    return self.answer(400, {"error": why})
                key = (body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"])
                if not rooms.meet(server.role, key):
                    return self.answer(504, {"error": "no peer in the bootstrap room"})
                self.answer(200, FIXTURE[f"{server.role}_response"])

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
