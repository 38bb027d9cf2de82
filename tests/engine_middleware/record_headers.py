"""An ASGI middleware the tests' vLLM engines load (``--middleware
record_headers.RecordHeaders``, vllm_engine.py): it appends the headers of
each POST, as the engine received them, to the file named by
``RECORD_HEADERS_TO``, one JSON line (a list of [name, value]) per request.
So a test sees what reached the engine, whatever Envoy's logs say.

It runs in the engine's own Python (.venv-engine), standard library only.
"""

from __future__ import annotations

import json
import os


class RecordHeaders:
    def __init__(self, app) -> None:
        self.app = app
        self.path = os.environ["RECORD_HEADERS_TO"]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]]
            with open(self.path, "a") as f:
                f.write(json.dumps(headers) + "\n")
        await self.app(scope, receive, send)
