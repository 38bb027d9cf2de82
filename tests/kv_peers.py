"""KV-event peers for the limit tests, and a subscriber whose memory is
measured from outside.

- :class:`Subscriber`: a child process holding a ``routecore.KvEventIndex``
  subscribed to one address; the parent reads its peak resident set
  (``VmHWM`` of ``/proc/<pid>/status``) above its idle baseline. A crash
  (the process aborted by a peer) ends the child, not the test run.
- :class:`HostilePublisher`: a ZeroMQ PUB peer written on a raw socket (the
  ZMTP 3 greeting and READY, then whatever frames a test scripts), so a test
  can announce a frame of 2^40 bytes without sending it, which no ZeroMQ
  library does.

Run as a script, it feeds one large batch through a real pyzmq PUB socket and
prints the payload size and the child's peak RSS above its idle baseline::

    .venv/bin/python tests/kv_peers.py --blocks 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

CHILD = """
import json, sys
import routecore
args = json.loads(sys.argv[1])
if args["log_level"] is not None:
    routecore.DataPlane.set_log_level(args["log_level"])
idx = routecore.KvEventIndex(**args["index"])
idx.subscribe("e0", args["zmq"], topic="kv", replay=args.get("replay"))
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "stats":
        print(json.dumps(idx.stats("e0")), flush=True)
    else:
        break
idx.close()
"""


def status_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (``VmHWM``, ``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Subscriber:
    """The child process: ``stats()`` asks its index, ``peak_mib()`` reads its
    peak RSS above the baseline taken when it started."""

    def __init__(
        self, zmq: str, replay: str | None = None, log_level: int | None = None, **index: Any
    ) -> None:
        """``log_level``: the child logs to stderr from this Python level on."""
        arg = json.dumps({"index": index, "zmq": zmq, "replay": replay, "log_level": log_level})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the subscriber process did not start")
        self.baseline_kib = status_kib(self.proc.pid, "VmRSS")

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write("stats\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the subscriber process died (status {self.proc.wait()})")
        return json.loads(line)

    def wait(self, what: str, cond: Callable[[dict[str, Any]], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not cond(s := self.stats()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {s}")
            time.sleep(0.02)

    def peak_mib(self) -> float:
        return (status_kib(self.proc.pid, "VmHWM") - self.baseline_kib) / 1024

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# -- a ZeroMQ PUB peer on a raw socket -------------------------------------------

#: ZMTP 3.0 greeting: signature, version 3.0, the NULL mechanism, as-server 0.
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def header(length: int, more: bool = False, command: bool = False) -> bytes:
    """A ZMTP frame header announcing ``length`` body bytes."""
    flags = int(more) | (int(command) << 2)
    if length > 255:
        return bytes([flags | 0b10]) + struct.pack(">Q", length)
    return bytes([flags, length])


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    return header(len(body), more, command) + body


def message(*frames: bytes) -> bytes:
    return b"".join(frame(f, more=i + 1 < len(frames)) for i, f in enumerate(frames))


READY = frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB", command=True)


class HostilePublisher:
    """A PUB peer on 127.0.0.1 speaking ZMTP by hand: on each connection it
    sends the greeting and READY and waits for the subscription; then
    :meth:`send` writes raw bytes to the subscriber connected now (the
    subscriber drops a connection whose frames break its limits and
    connects again: bytes sent meanwhile are lost, as on a real wire)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.zmq = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._current: socket.socket | None = None
        self._ready = threading.Condition()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.sendall(GREETING + READY)
            seen = b""
            # The subscriber's greeting, READY and SUBSCRIBE (a message
            # frame starting with 0x01) before anything is published to it.
            while b"\x01kv" not in seen[64:]:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                seen += chunk
            with self._ready:
                self._current = conn
                self._ready.notify_all()
            while conn.recv(4096):
                pass
        except OSError:
            pass
        with self._ready:
            if self._current is conn:
                self._current = None
        conn.close()

    def send(self, data: bytes, close: bool = False, timeout: float = 30) -> bool:
        """Writes ``data`` to the subscriber connected now (waiting for one),
        then closes that connection if ``close`` (a frame left unfinished
        would swallow what comes next); False when the connection broke."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._current is not None, timeout):
                raise AssertionError("no subscriber connected")
            conn = self._current
            if close:
                self._current = None
        assert conn is not None
        try:
            conn.sendall(data)
            return True
        except OSError:
            return False
        finally:
            if close:
                hang_up(conn)

    def close(self) -> None:
        self.listener.close()
        for c in self._open:
            hang_up(c)


def hang_up(conn: socket.socket) -> None:
    """Closes ``conn`` for real: a thread blocked in its ``recv`` keeps a
    plain ``close`` from sending FIN."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def batch_message(seq: int, payload: bytes, topic: bytes = b"kv") -> bytes:
    """One KV-event message ``(topic, seq, payload)`` on the wire."""
    return message(topic, seq.to_bytes(8, "big"), payload)


# -- a large batch ---------------------------------------------------------------


def big_batch(blocks: int, per_event: int = 1000, seed: int = 0) -> bytes:
    """One ``EventBatch`` of ``blocks`` block-size-1 blocks stored in events of
    ``per_event``, as vLLM 0.32 encodes it, engine hashes over the whole u64
    range."""
    from mock_kv_publisher import encode_batch, stored

    rng = random.Random(seed)
    events = []
    parent = None
    for start in range(0, blocks, per_event):
        n = min(per_event, blocks - start)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        tokens = [rng.randrange(1 << 16) for _ in range(n)]
        events.append(stored(hashes, parent, tokens, 1))
        parent = hashes[-1]
    return encode_batch(events)


def main() -> None:
    import zmq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--index", default="{}", help="KvEventIndex keyword arguments, JSON")
    a = p.parse_args()
    payload = big_batch(a.blocks)
    pub = zmq.Context.instance().socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", block_size=1, **json.loads(a.index))
    try:
        pub.recv()  # the subscription
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), payload])
        sub.wait("the batch", lambda s: s["batches"] > 0, timeout=300)
        s = sub.stats()
        print(
            f"blocks={a.blocks} payload_mb={len(payload) / 1e6:.1f} "
            f"peak_rss_above_idle_mib={sub.peak_mib():.0f} index_blocks={s['blocks']} "
            f"garbage={s['garbage']}"
        )
    finally:
        sub.close()
        pub.close(0)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    main()
