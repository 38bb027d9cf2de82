"""A mock vLLM engine for the tests: an aiohttp server on 127.0.0.1.

It serves what routecore reads from a real engine:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: an OpenAI answer
  with ``usage`` (JSON, or SSE when ``stream`` is true, with a usage event when
  ``stream_options.include_usage`` is set), field for field as vLLM 0.32
  answers (:func:`answer`, :func:`chunks`; tests/fixtures/vllm/); a ``model``
  it does not serve is a 404 as vLLM answers it.
- ``GET /health``: 200 while serving.
- ``GET /metrics``: the page vLLM 0.32 serves, line for line
  (``tests/fixtures/vllm/metrics.txt``: its HELP texts, labels and
  Content-Type, no ``vllm:gpu_cache_usage_perc``, ``vllm:lora_requests_info``
  only when the engine serves adapters), the ``name[]`` query ignored as vLLM
  ignores it, with the values of the engine's load: a request runs for
  ``service_s`` seconds in one of ``max_num_seqs`` slots, others wait; KV use
  is the running requests' tokens over ``kv_capacity_tokens``.

Bad metrics pages for the scraper's tests: :attr:`MockEngine.metrics_mode` is
``"ok"``, ``"garbage"`` (not the exposition format), ``"huge"`` (``huge_bytes``
of comments), ``"slow"`` (answers after ``slow_s``) or ``"error"`` (500);
:attr:`MockEngine.queue_series` adds lines to a good page's queue
(``vllm:num_requests_waiting``) group: more data-parallel ranks, or a hostile
engine's. :meth:`MockEngine.set_load` pins the reported queue and KV use.

:attr:`MockEngine.token_s` spaces the events of a streamed answer (a long
SSE stream); :attr:`MockEngine.requests` records the headers of every
completion request received (what reached the engine through a gateway).

Another helper can attach to the engine's request stream: every request served
calls each of :attr:`MockEngine.listeners` with a :class:`Served` (prompt text,
token ids when given, the model), e.g. a KV-event publisher.

Tests are synchronous: :class:`MockEngine` runs its server on its own event
loop thread; ``start()`` / ``stop()`` (kill) / ``start()`` again (restart on
the same port).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.utils import floatToGoString

#: The vLLM release whose answers the mock gives (tests/fixtures/vllm/).
FINGERPRINT = "vllm-0.32.0-mock"
#: vLLM's metric names (v1 engine; ``gpu_cache_usage_perc`` is the older KV
#: name routecore also asks for, absent from vLLM 0.32's page).
WAITING = "vllm:num_requests_waiting"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
METRICS_MODES = ("ok", "garbage", "huge", "slow", "error")
#: vLLM 0.32's pages (see tests/fixtures/vllm/README.md, and render_metrics.py for the LoRA one).
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm"
#: What vLLM's ``/metrics`` answers with (prometheus_client's latest text format).
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
#: The model name on the captured page.
FIXTURE_MODEL = "tiny-llama"


def _lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines(keepends=True)


#: The captured page (no LoRA), as lines.
PAGE = _lines("metrics.txt")
#: With LoRA on: the LoRA gauge as vLLM writes it (``metrics_lora.txt``,
#: rendered by vLLM's own metric classes) where vLLM writes it, before
#: ``vllm:cache_config_info``.
_AT = next(i for i, line in enumerate(PAGE) if line.startswith("# HELP vllm:cache_config_info"))
PAGE_LORA = (
    PAGE[:_AT] + [line for line in _lines("metrics_lora.txt") if LORA_INFO in line] + PAGE[_AT:]
)


@dataclass(frozen=True)
class Served:
    """One request the engine served (what a listener receives)."""

    model: str
    prompt: str
    token_ids: tuple[int, ...] | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class MockEngine:
    """One mock vLLM endpoint (see the module doc)."""

    model: str = "m"
    port: int = 0
    max_num_seqs: int = 4
    service_s: float = 0.05
    kv_capacity_tokens: int = 4096
    adapters: tuple[str, ...] = ()
    metrics_mode: str = "ok"
    huge_bytes: int = 4 << 20
    slow_s: float = 2.0
    #: Written after the queue's sample, in its group (more data-parallel
    #: ranks, or a hostile engine's lines).
    queue_series: str = ""
    listeners: list[Callable[[Served], None]] = field(default_factory=list)
    #: Counts by path (``/metrics``: how often it was scraped).
    hits: dict[str, int] = field(default_factory=dict)
    #: The ``name[]`` filters of the last metrics request.
    last_filter: list[str] = field(default_factory=list)
    #: Seconds between two SSE events of a streamed answer (a long stream).
    token_s: float = 0.0
    #: The headers of every completion request received, in order (lower-case names).
    requests: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self.pinned: dict[str, float] = {}
        self._slots: asyncio.Semaphore | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        model = f'model_name="{self.model}"'
        self._pages = {
            lora: ([line.replace(f'model_name="{FIXTURE_MODEL}"', model) for line in page], slots)
            for lora, page, slots in (
                (False, PAGE, _slots(PAGE)),
                (True, PAGE_LORA, _slots(PAGE_LORA)),
            )
        }

    # -- lifecycle -------------------------------------------------------------

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> MockEngine:
        """Serves on 127.0.0.1 (the same port again after a stop)."""
        self._call(self._start())
        return self

    def stop(self) -> None:
        """Kills the server (connections dropped, the port closed)."""
        self._call(self._stop())

    def close(self) -> None:
        """Stops for good (the loop thread too)."""
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        if self._runner is not None:
            return
        self._slots = asyncio.Semaphore(self.max_num_seqs)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.running = self.waiting = self.kv_tokens = 0

    # -- load ------------------------------------------------------------------

    def set_load(
        self, waiting: float | None = None, running: float | None = None, kv: float | None = None
    ) -> None:
        """Pins the reported queue, running count and KV use (None: follow the load)."""
        for name, value in ((WAITING, waiting), (RUNNING, running), (KV_USAGE, kv)):
            if value is None:
                self.pinned.pop(name, None)
            else:
                self.pinned[name] = value

    def _value(self, name: str) -> float:
        if name in self.pinned:
            return self.pinned[name]
        if name == WAITING:
            return float(self.waiting)
        if name == RUNNING:
            return float(self.running)
        return min(1.0, self.kv_tokens / self.kv_capacity_tokens)

    # -- handlers --------------------------------------------------------------

    def _hit(self, path: str) -> None:
        self.hits[path] = self.hits.get(path, 0) + 1

    async def _health(self, request: web.Request) -> web.Response:
        self._hit("/health")
        return web.Response(text="")

    async def _metrics(self, request: web.Request) -> web.Response:
        self._hit("/metrics")
        self.last_filter = request.query.getall("name[]", [])
        mode = self.metrics_mode
        if mode == "error":
            return web.Response(status=500, text="engine error")
        if mode == "slow":
            await asyncio.sleep(self.slow_s)
        if mode == "garbage":
            return web.Response(text="<html>\x00\x01 not { prometheus ]]] 1 2 3\n" * 50)
        if mode == "huge":
            line = "# " + "x" * 1000 + "\n"
            return web.Response(text=line * (self.huge_bytes // len(line)))
        body = self.metrics_page().encode()
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE})

    def metrics_page(self) -> str:
        """The page as vLLM 0.32 writes it, with this engine's values."""
        waiting = self._value(WAITING)
        values = {
            WAITING: waiting,
            RUNNING: self._value(RUNNING),
            KV_USAGE: self._value(KV_USAGE),
            # Every waiting request waits for capacity (none deferred).
            f"{WAITING_BY_REASON}:capacity": waiting,
            f"{WAITING_BY_REASON}:deferred": 0.0,
        }
        page, slots = self._pages[bool(self.adapters)]
        lines = list(page)
        for i, what in slots.items():
            head = lines[i].rsplit(" ", 1)[0]
            if what == LORA_INFO:
                running = ",".join(self.adapters)
                head = (
                    f'{LORA_INFO}{{max_lora="4",running_lora_adapters="{running}",'
                    'waiting_lora_adapters=""}'
                )
                lines[i] = f"{head} {floatToGoString(time.time())}\n"
            elif what in values:
                lines[i] = f"{head} {floatToGoString(values[what])}\n"
            if what == WAITING:
                lines[i] += self.queue_series
        return "".join(lines)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self._hit(request.path)
        self.requests.append({k.lower(): v for k, v in request.headers.items()})
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "invalid JSON body")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        model = body.get("model", self.model)
        if model != self.model and model not in self.adapters:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        prompt, ids = _prompt(body, chat)
        prompt_tokens = len(ids) if ids is not None else max(1, len(prompt) // 4)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        completion_tokens = max(1, min(int(max_tokens), 16))
        assert self._slots is not None
        self.waiting += 1
        async with self._slots:
            self.waiting -= 1
            self.running += 1
            self.kv_tokens += prompt_tokens + completion_tokens
            try:
                await asyncio.sleep(self.service_s)
            finally:
                self.running -= 1
                self.kv_tokens -= prompt_tokens + completion_tokens
        served = Served(model, prompt, ids, prompt_tokens, completion_tokens)
        for listener in self.listeners:
            listener(served)
        usage = (prompt_tokens, completion_tokens)
        texts = ["ok "] * completion_tokens
        if not body.get("stream"):
            return web.Response(body=_json(answer(chat, model, texts, usage)), content_type=JSON)
        resp = web.StreamResponse(headers={"content-type": SSE})
        await resp.prepare(request)
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        for i, event in enumerate(chunks(chat, model, texts, usage if include_usage else None)):
            if i and self.token_s:
                await asyncio.sleep(self.token_s)
            await resp.write(b"data: " + _json(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _slots(page: list[str]) -> dict[int, str]:
    """The lines of ``page`` whose value the engine sets, by what they report."""
    read = (WAITING, WAITING_BY_REASON, RUNNING, KV_USAGE, LORA_INFO)
    slots = {}
    for i, line in enumerate(page):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line.startswith("#") or name not in read:
            continue
        reason = re.search(r'reason="([^"]*)"', line) if name == WAITING_BY_REASON else None
        slots[i] = f"{name}:{reason.group(1)}" if reason else name
    return slots


# -- vLLM's answers, as tests/fixtures/vllm/ has them (tests/test_mock_engine.py) --

#: vLLM's Content-Types of a JSON answer and of a stream.
JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"


def _json(value: Any) -> bytes:
    """JSON as vLLM writes it (no spaces, UTF-8 as is)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _head(chat: bool, model: str, chunk: bool) -> dict[str, Any]:
    """The fields every answer and chunk starts with."""
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
        "object": f"{kind}.chunk" if chunk and chat else kind,
        "created": int(time.time()),
        "model": model,
    }


def _usage(usage: tuple[int, int]) -> dict[str, int]:
    prompt, completion = usage
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def answer(chat: bool, model: str, texts: list[str], usage: tuple[int, int]) -> dict[str, Any]:
    """A JSON answer (``stream`` false) of ``texts`` (one a token), finished by
    length; ``usage`` is (prompt, completion) tokens."""
    done = {"logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}
    if chat:
        message = {"role": "assistant", "content": "".join(texts)}
        message.update(
            dict.fromkeys(("refusal", "annotations", "audio", "function_call", "reasoning"))
        )
        choice = {"index": 0, "message": message, **done, "routed_experts": None}
    else:
        choice = {"index": 0, "text": "".join(texts), **done}
        choice.update(dict.fromkeys(("prompt_logprobs", "prompt_token_ids", "routed_experts")))
    details = dict.fromkeys(("prompt_tokens_details", "completion_tokens_details"))
    tail = ("prompt_logprobs", "prompt_token_ids", "prompt_text") if chat else ()
    return {
        **_head(chat, model, chunk=False),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": {**_usage(usage), **details},
        **dict.fromkeys((*tail, "kv_transfer_params", "ec_transfer_params", "metrics")),
    }


def chunks(
    chat: bool, model: str, texts: list[str], usage: tuple[int, int] | None
) -> list[dict[str, Any]]:
    """The events of a stream of ``texts`` (one chunk a token, the last with
    the finish reason), the usage event when ``usage`` is given (the request's
    ``stream_options.include_usage``); ``[DONE]`` is not an event."""
    head = _head(chat, model, chunk=True)
    events = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        role.update(logprobs=None, finish_reason=None)
        events.append({**head, "choices": [role], "prompt_token_ids": None, "prompt_text": None})
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        choice: dict[str, Any] = {"index": 0}
        choice.update({"delta": {"content": text}} if chat else {"text": text})
        choice.update(logprobs=None, finish_reason="length" if last else None)
        if last or not chat:
            choice["stop_reason"] = None
        if not chat:
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        events.append({**head, "choices": [choice]})
    if usage is not None:
        events.append({**head, "choices": [], "usage": _usage(usage)})
    events[-1]["system_fingerprint"] = FINGERPRINT  # the last event carries it
    return events


def _prompt(body: dict, chat: bool) -> tuple[str, tuple[int, ...] | None]:
    """The prompt's text (messages in order) and its token ids when given."""
    if chat:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts), None
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "", tuple(prompt)
    return (prompt if isinstance(prompt, str) else json.dumps(prompt)), None


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "code": status}, status=status
    )
