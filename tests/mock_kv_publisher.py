"""A mock vLLM engine for KV-event tests: an LRU cache of KV blocks that
publishes what it stores and evicts exactly as vLLM 0.32's
``ZmqEventPublisher`` does (``vllm/distributed/kv_events.py``; checked
against the captured ``tests/fixtures/vllm/`` by test_kv_events.py), on
127.0.0.1:

- a PUB socket sending ``(topic, seq, payload)``, ``seq`` 8 bytes big-endian,
  ``payload`` a msgpack ``EventBatch`` ``[ts, events, data_parallel_rank]``
  whose events are maps tagged by ``"type"`` (msgspec's tagged structs; the
  fields with a default left out), block hashes ints over the whole u64
  range (or, like ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, 32-byte
  strings);
- a ROUTER socket answering a request ``["", start_seq]`` with
  ``[identity, "", topic, seq, payload]`` per buffered batch from
  ``start_seq`` on, then ``[identity, "", "", -1, ""]``.

Faults on demand: a batch dropped on the PUB socket (kept for replay), a
batch sent twice, frames that are not a batch, events with unknown tags,
another block size, removals of blocks never stored, a restart (sequence
numbers from 0 again, empty cache), and a replay socket that stops
answering (``replay_paused``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from server_fixtures import wait_for

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def bind(sock: zmq.Socket, addr: str) -> str:
    """Binds ``sock`` to ``addr`` and returns the address bound. A port just
    released by a closed socket is free once libzmq's I/O thread has closed
    it: a few retries."""
    deadline = time.monotonic() + 5
    while True:
        try:
            sock.bind(addr)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def encode_batch(events: list[Any], ts: float | None = None, rank: int = 0) -> bytes:
    """An ``EventBatch`` as vLLM 0.32 encodes it: an array (msgspec's
    ``array_like``) around the events (maps)."""
    return msgpack.packb([time.time() if ts is None else ts, events, rank])


def stored(
    hashes: list[Any],
    parent: Any,
    token_ids: list[int],
    block_size: int,
    lora_name: str | None = None,
    medium: str | None = "GPU",
) -> dict[str, Any]:
    """A ``BlockStored`` event as vLLM 0.32 sends it (no extra keys per block,
    one full-attention KV cache group; ``lora_id`` given with ``lora_name``,
    as vLLM does)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None if lora_name is None else 1,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes: list[Any], medium: str | None = "GPU") -> dict[str, Any]:
    """A ``BlockRemoved`` event as vLLM 0.32 sends it (one per evicted block)."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


class MockKvPublisher:
    """One engine: ``serve(prompt)`` touches the prompt's full blocks in the
    LRU cache of ``capacity_blocks`` and publishes one batch of the blocks it
    evicted and stored. Engine block hashes are u64 ints (vLLM's default) or
    32-byte strings, from a salt of this engine: not routecore's hashes."""

    def __init__(
        self,
        block_size: int = 4,
        capacity_blocks: int = 64,
        topic: str = "kv",
        bytes_hashes: bool = False,
        buffer_steps: int = 1000,
    ) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.topic = topic.encode()
        self.bytes_hashes = bytes_hashes
        self.ctx = zmq.Context.instance()
        self._open()
        self.seq = 0
        self.salt = 0
        self.replay_requests: list[int] = []
        #: While set, replay requests are read and never answered (a hung engine).
        self.replay_paused = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        # engine hash -> the prompt prefix ending with that block (LRU first).
        self.cache: OrderedDict[Any, tuple[int, ...]] = OrderedDict()

    def _open(self, zmq_addr: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*") -> None:
        """Binds the sockets (any free ports, or the ones given) and starts
        the replay thread."""
        # An XPUB: a PUB to its subscribers that also hears their subscriptions
        # (see wait_subscribed).
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.subscriptions = 0
        self.zmq = bind(self.pub, zmq_addr)
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.replay = bind(self._router, replay)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    # -- the engine ---------------------------------------------------------
    def _hash(self, prefix: tuple[int, ...], lora: str | None) -> Any:
        h = hashlib.blake2b(repr((self.salt, lora, prefix)).encode(), digest_size=32).digest()
        # vLLM's int hashes: the digest's low 64 bits, the whole u64 range.
        return h if self.bytes_hashes else int.from_bytes(h, "big") & ((1 << 64) - 1)

    def serve(self, token_ids: list[int], lora: str | None = None, drop: bool = False) -> int:
        """Serves a prompt; returns the blocks it already held (its cache hit).
        ``drop``: the batch is buffered for replay but never sent."""
        bs = self.block_size
        events: list[Any] = []
        parent = None
        hits = 0
        new: list[tuple[Any, list[int]]] = []
        for end in range(bs, len(token_ids) + 1, bs):
            prefix = tuple(token_ids[:end])
            h = self._hash(prefix, lora)
            if h in self.cache and not new:
                self.cache.move_to_end(h)
                hits += 1
                parent = h
                continue
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                if len(self.cache) >= self.capacity_blocks:
                    old, _ = self.cache.popitem(last=False)
                    events.append(removed([old]))
                self.cache[h] = prefix
            new.append((h, list(prefix[-bs:])))
        if new:
            hashes = [h for h, _ in new]
            tokens = [t for _, block in new for t in block]
            events.append(stored(hashes, parent, tokens, bs, lora_name=lora))
        if events:
            self.publish(events, drop=drop)
        return hits

    def clear(self) -> None:
        """Frees every block (vLLM's reset_prefix_cache): ``AllBlocksCleared``."""
        self.cache.clear()
        self.publish([CLEARED])

    def restart(self, sockets: bool = False) -> None:
        """The engine restarts: empty cache, new hashes, sequence from 0;
        with ``sockets``, as a new process does, its sockets close and bind
        again on the same ports (its subscribers see the stream drop)."""
        if sockets:
            self.close()
            self._open(self.zmq, self.replay)
        with self._lock:
            self._buffer.clear()
        self.cache.clear()
        self.seq = 0
        self.salt += 1

    # -- the wire -----------------------------------------------------------
    def publish(self, events: list[Any], drop: bool = False) -> int:
        return self.publish_payload(encode_batch(events), drop=drop)

    def publish_payload(self, payload: bytes, drop: bool = False) -> int:
        """Sends ``payload`` as the next batch (any bytes: garbage too)."""
        seq = self.seq
        self.seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def resend_last(self) -> None:
        """Sends the last batch again (a duplicate)."""
        with self._lock:
            seq, payload = self._buffer[-1]
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def send_frames(self, frames: list[bytes]) -> None:
        """Sends raw frames (a malformed message)."""
        self.pub.send_multipart(frames)

    def wait_subscribed(self, count: int, timeout: float = 10.0) -> None:
        """Blocks until ``count`` subscriptions in all reached the socket. A
        ZeroMQ subscriber that is connected but whose subscription has not
        arrived yet misses what is published meanwhile (the slow joiner), and
        a test that publishes once and waits would wait forever."""
        deadline = time.monotonic() + timeout
        while self.subscriptions < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.subscriptions} of {count} subscriptions arrived")
            if self.pub.poll(int(left * 1000) + 1, zmq.POLLIN) and self.pub.recv()[:1] == b"\x01":
                self.subscriptions += 1

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3 or self.replay_paused:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start_seq]
            for s, p in batches:
                self._router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(0)
        self._router.close(0)


# -- a subscriber's view (a routecore.KvEventIndex) ---------------------------


def subscribe(idx: Any, name: str, p: MockKvPublisher, replay: bool = True) -> None:
    """Subscribes index ``idx`` to ``p`` as endpoint ``name``, until live."""
    idx.subscribe(name, p.zmq, topic="kv", replay=p.replay if replay else None)
    wait_for(lambda: idx.stats(name)["live"], what=f"{name} connected")
    p.wait_subscribed(p.subscriptions + 1)


def synced(idx: Any, name: str, p: MockKvPublisher) -> Callable[[], bool]:
    """True once the index applied every batch `p` published."""
    return lambda: idx.stats(name)["last_seq"] == p.seq - 1
