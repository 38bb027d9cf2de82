"""What a client can make the data plane hold is bounded by ``limits.*``
(issue 22, item 4): streams that never finish their body are answered 408
after ``body_timeout_s``, a connection opens at most
``max_streams_per_connection`` streams, at most ``max_connections``
connections are open, and every stream's buffers together stay within
``max_buffered_bytes``. The property test drives random stream counts and
body patterns at a server in its own process and checks its memory against
the bound the README states."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_fixtures import Spawned, base_config, wait_for, wait_settled

from routecore.server.envoy_client import buffered, chat_body, http_headers

KEY = {"x-api-key": "demo-key"}
Mode = processing_mode_pb2.ProcessingMode
#: Each channel its own connection (gRPC shares them between equal channels).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
KIB, MIB = 1 << 10, 1 << 20


def opening(mode: int = Mode.FULL_DUPLEX_STREAMED) -> pb.ProcessingRequest:
    """Request headers that do not end the stream, in body ``mode``."""
    return pb.ProcessingRequest(
        request_headers=http_headers(KEY),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode),
    )


def chunk(n: int, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * n, end_of_stream=end))


def status_of(answer: pb.ProcessingResponse) -> int:
    return answer.immediate_response.status.code


async def until(cond, what: str, timeout: float = 10.0) -> None:
    """Polls ``cond`` without holding the event loop the calls run on."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_stream_not_routed_within_the_body_timeout_is_408_and_freed(serve):
    s = serve(limits={"body_timeout_s": 0.5})

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            silent = stub.Process()  # opened, nothing sent
            slow = stub.Process()
            await slow.write(opening())
            await slow.write(chunk(50_000))
            await until(lambda: s.metric("buffered_bytes") >= 50_000, "the body held")
            for call in (silent, slow):
                answer = await asyncio.wait_for(call.read(), 10)
                assert status_of(answer) == 408
                assert await call.read() == grpc.aio.EOF  # the stream ended
                assert await call.code() == grpc.StatusCode.OK
            # A stream routed in time is not cut by the deadline afterwards.
            routed = await buffered(stub, KEY, chat_body("in time"))
            assert routed.routing is not None

    asyncio.run(go())
    # Streams end on the server a little after the client saw their end.
    wait_for(lambda: s.metric("buffered_bytes") == 0, what="every buffer given back")
    assert s.metric("faults", "client", "body_timeout_s") == 2
    assert s.metric("rejections", "none", "body-timeout") == 2
    wait_settled(s)


async def opened(stub) -> grpc.aio.StreamStreamCall | grpc.aio.AioRpcError:
    """A BUFFERED stream whose headers were answered, or the error it ended with."""
    call = stub.Process()
    try:
        await call.write(opening(Mode.BUFFERED))
        assert (await call.read()).HasField("request_headers")
    except grpc.aio.AioRpcError as e:
        return e
    return call


async def refused_at_open(stub) -> grpc.aio.AioRpcError:
    """The error a stream the server must refuse as it opens ends with, read
    without writing first: a write can lose the race with the refusal, and
    gRPC's client then reports its own INTERNAL instead of the server's
    status. A stream accepted instead fails here (nothing comes in 10 s)."""
    call = stub.Process()
    try:
        answer = await asyncio.wait_for(call.read(), 10)
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError(f"the stream was not refused: {answer}")


def test_a_connection_opens_at_most_its_streams(serve):
    s = serve(limits={"max_streams_per_connection": 4})

    async def go():
        async with grpc.aio.insecure_channel(s.target, options=OWN_CONNECTION) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            calls = [await opened(stub) for _ in range(4)]
            assert not any(isinstance(c, grpc.aio.AioRpcError) for c in calls)
            fifth = await refused_at_open(stub)
            assert fifth.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "streams open on this connection" in fifth.details()
            # Another connection has its own four.
            async with grpc.aio.insecure_channel(s.target, options=OWN_CONNECTION) as other:
                conv = await buffered(pb_grpc.ExternalProcessorStub(other), KEY, chat_body("hi"))
                assert conv.routing is not None
            assert s.metric("faults", "client", "max_streams_per_connection") == 1
            # A stream that ends gives its place back.
            calls[0].cancel()
            for _ in range(50):
                again = await opened(stub)
                if not isinstance(again, grpc.aio.AioRpcError):
                    break
                await asyncio.sleep(0.05)  # the cancel not yet seen by the server
            else:
                raise AssertionError("the cancelled stream's place never came back")
            for call in calls[1:] + [again]:
                call.cancel()

    asyncio.run(go())
    wait_settled(s)


def test_bodies_past_the_buffer_budget_are_503_and_the_budget_comes_back(serve):
    s = serve(limits={"max_body_bytes": 64 * KIB, "max_buffered_bytes": 256 * KIB})

    async def go():
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            held, refused = [], None
            for _ in range(8):
                call = stub.Process()
                await call.write(opening())
                await call.write(chunk(60 * KIB))
                held.append(call)
            # Each holds its 60 KiB body twice (the gRPC layer's copy and the
            # body's): two streams fit, the others are refused.
            answers = []
            for call in held:
                try:
                    answers.append(await asyncio.wait_for(call.read(), 0.5))
                except asyncio.TimeoutError:
                    answers.append(None)  # still receiving its body
            refused = [a for a in answers if a is not None]
            assert len(refused) >= 4 and all(status_of(a) == 503 for a in refused)
            imm = refused[0].immediate_response
            headers = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}
            assert headers["retry-after"] == b"1"
            assert s.metric("buffered_bytes") <= 256 * KIB
            for call in held:
                call.cancel()

    asyncio.run(go())
    wait_for(lambda: s.metric("buffered_bytes") == 0, what="the budget given back")
    assert s.metric("faults", "client", "max_buffered_bytes") >= 4
    assert s.metric("rejections", "none", "buffers-full") >= 4
    wait_settled(s)


def test_connections_past_the_cap_are_closed(serve):
    s = serve(limits={"max_connections": 2})

    async def go():
        channels = [grpc.aio.insecure_channel(s.target, options=OWN_CONNECTION) for _ in range(3)]
        try:
            for channel in channels[:2]:
                conv = await buffered(pb_grpc.ExternalProcessorStub(channel), KEY, chat_body("a"))
                assert conv.routing is not None
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await buffered(pb_grpc.ExternalProcessorStub(channels[2]), KEY, chat_body("b"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert s.metric("faults", "client", "max_connections") >= 1
            await channels[0].close()
            for _ in range(100):  # the first connection's close reaches the server
                async with grpc.aio.insecure_channel(s.target, options=OWN_CONNECTION) as fresh:
                    try:
                        conv = await buffered(pb_grpc.ExternalProcessorStub(fresh), KEY, b"{}")
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.05)
            else:
                raise AssertionError("no connection accepted after one closed")
            assert conv.responses
        finally:
            for channel in channels:
                await channel.close()

    asyncio.run(go())
    wait_settled(s)


# -- the bound, under random clients ----------------------------------------------------

#: The limits of the server under test.
LIMITS = {
    "max_body_bytes": 1 * MIB,
    "max_message_bytes": 2 * MIB,
    "max_buffered_bytes": 12 * MIB,
    "max_streams_per_connection": 48,
    "max_connections": 3,
    "body_timeout_s": 60,
}
#: The README's bound ("Failure behaviour"): RSS <= idle + max_buffered_bytes
#: + worker_threads * 2 * max_message_bytes
#: + max_connections * (PER_CONNECTION + max_streams_per_connection * PER_STREAM)
#: + routed streams * UNSENT (answers their client has not read).
PER_STREAM = 32 * KIB
PER_CONNECTION = 2 * MIB
UNSENT = 512 * KIB
WORKER_THREADS = 2  # server.worker_threads' default


def bound(limits: dict, routed: int) -> int:
    per_connection = PER_CONNECTION + limits["max_streams_per_connection"] * PER_STREAM
    return (
        limits["max_buffered_bytes"]
        + WORKER_THREADS * 2 * limits["max_message_bytes"]
        + limits["max_connections"] * per_connection
        + routed * UNSENT
    )


def rss(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * KIB
    raise AssertionError(f"no {field}")


def gauge(server: Spawned, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name}")


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """A server with small limits in its own process, warmed up; its idle RSS."""
    path = tmp_path_factory.mktemp("limits") / "routecore.yaml"
    server = Spawned(path, base_config(limits=LIMITS))

    async def warm():
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            for _ in range(20):
                await buffered(stub, KEY, chat_body("warm up " * 100))

    try:
        asyncio.run(warm())
        time.sleep(0.5)
        yield server, rss(server.proc.pid)
    finally:
        server.stop()


async def flood(target: str, connections: int, streams: int, body: list[int], mode: int, end: bool):
    """``connections`` connections (one more than the cap, at most), each
    opening ``streams`` streams that send ``body`` (chunk sizes), ending it
    when ``end``; returns the open calls and channels (to close after)."""
    channels = [
        grpc.aio.insecure_channel(
            target, options=[*OWN_CONNECTION, ("grpc.max_send_message_length", 4 * MIB)]
        )
        for _ in range(connections)
    ]
    calls = []

    async def one(stub):
        call = stub.Process()
        calls.append(call)
        try:
            await call.write(opening(mode))
            for i, n in enumerate(body):
                await call.write(chunk(n, end and i == len(body) - 1))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # refused (past a limit): the call is over

    await asyncio.gather(
        *(one(pb_grpc.ExternalProcessorStub(c)) for c in channels for _ in range(streams))
    )
    return channels, calls


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    connections=st.integers(1, LIMITS["max_connections"] + 1),
    streams=st.integers(1, LIMITS["max_streams_per_connection"] + 16),
    body=st.lists(st.integers(1, 400 * KIB), min_size=1, max_size=3),
    mode=st.sampled_from([Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED]),
    end=st.booleans(),
)
# The attack: every connection full of streams that buffer bodies and never end them.
@example(
    connections=LIMITS["max_connections"] + 1,
    streams=LIMITS["max_streams_per_connection"] + 16,
    body=[400 * KIB, 400 * KIB, 200 * KIB],
    mode=Mode.FULL_DUPLEX_STREAMED,
    end=False,
)
# Routed requests that keep their streams (and the gRPC layer's buffers) open.
@example(
    connections=2,
    streams=LIMITS["max_streams_per_connection"],
    body=[300 * KIB, 300 * KIB],
    mode=Mode.STREAMED,
    end=True,
)
def test_memory_stays_under_the_documented_bound(bounded, connections, streams, body, mode, end):
    server, idle = bounded

    async def go():
        channels, calls = await flood(server.target, connections, streams, body, mode, end)
        await asyncio.sleep(0.3)  # what was sent is received
        held = rss(server.proc.pid)
        routed = server.metric("routecore_in_flight")
        assert gauge(server, "routecore_buffered_bytes") <= LIMITS["max_buffered_bytes"]
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
        return held, routed

    held, routed = asyncio.run(go())
    limit = idle + bound(LIMITS, int(routed))
    assert held <= limit, f"RSS {held / MIB:.1f} MiB > {limit / MIB:.1f} MiB"
    assert rss(server.proc.pid, "VmHWM") <= limit
    wait_for(lambda: gauge(server, "routecore_buffered_bytes") == 0, what="buffers freed")
    server.wait_gauge_zero()
