"""Snapshots of every class that has them: corrupted or truncated bytes are a
ValueError, whatever was damaged (never KeyError, OverflowError or a panic),
and bytes that still restore give an object that can be snapshotted again."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routecore._core as core


def calibrator():
    c = core.Calibrator()
    c.observe("prose", 4000, 1000)
    c.observe("code", 3000, 1000)
    return c


def prefix_index():
    ix = core.PrefixIndex(64, ttl_s=30.0)
    ix.record(np.arange(1, 6, dtype=np.uint64), "endpoint-a", 1.0)
    ix.record(np.arange(3, 9, dtype=np.uint64), "endpoint-b", 2.0)
    ix.remove_endpoint("endpoint-a")
    ix.record(np.arange(20, 22, dtype=np.uint64), "endpoint-c", 3.0)
    return ix


def prefix_router():
    r = core.PrefixCacheRouter(["a", "b", "c"], block_size=4)
    r.route(np.arange(40, dtype=np.uint32), now=1.0)
    r.route(np.arange(20, dtype=np.uint32), running=[3, 0, 1], now=2.0)
    return r


def vtc_router():
    r = core.VtcRouter(["p0", "p1"], max_users=10)
    r.route("alice", 100, 200, now=1.0)
    r.route("bob", 50, 20, now=40.0)
    r.complete("p0", "alice", 100, 200, 120, 150, now=41.0)
    return r


def endpoint_picker():
    p = core.EndpointPicker(["a", "b", "c"], seed=4)
    p.set_state("b", waiting=2, running=3, kv_usage=0.4, adapters=["lora-x"])
    p.set_state("c", healthy=False)
    p.pick(np.arange(40, dtype=np.uint32), now=1.0)
    p.pick(np.arange(20, dtype=np.uint32), now=2.0)
    return p


def admission():
    pools = [
        core.TokenPool("pool-a", 200.0, 1 << 30, 8),
        core.TokenPool("pool-b", 50.0, 1 << 28, 2),
    ]
    ents = [
        core.Entitlement("copilot", "acme", "pool-a", "guaranteed", 500.0, 100.0, 1 << 20, 4),
        core.Entitlement("batch", "acme", "pool-b", "spot", 30_000.0, 20.0, 1 << 20, 2),
    ]
    c = core.AdmissionController(pools, ents)
    t = c.admit("copilot", 100, 50, 1.0).ticket
    c.admit("batch", 10, 10, 1.5)
    c.complete(t, 100, 40, 0.2, 2.0)
    c.admit("copilot", 30, 20, 3.0)
    return c


def scheduler():
    return core.BatchScheduler(
        [
            core.Instance("i0", "small", 0.02, 0.1, 0.2, 8),
            core.Instance("i1", "big", 0.05, 1.0, 2.0, 4),
        ]
    )


def knn():
    k = core.KnnEstimator(k=2)
    k.fit(
        np.array([[1, 0], [0, 2], [1, 1]], dtype=np.float32),
        [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
        [[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]],
    )
    return k


def erlang_scan():
    s = core.ErlangScan(4, 2.5)
    s.advance(3)
    return s


MAKERS = {
    "Calibrator": calibrator,
    "PrefixIndex": prefix_index,
    "PrefixCacheRouter": prefix_router,
    "VtcRouter": vtc_router,
    "EndpointPicker": endpoint_picker,
    "AdmissionController": admission,
    "BatchScheduler": scheduler,
    "KnnEstimator": knn,
    "ErlangScan": erlang_scan,
}
SNAPSHOTS = {name: make().to_bytes() for name, make in MAKERS.items()}


def test_every_class_with_snapshots_is_covered():
    with_snapshots = {
        name
        for name in dir(core)
        if isinstance(getattr(core, name), type) and hasattr(getattr(core, name), "from_bytes")
    }
    assert with_snapshots == set(MAKERS)


def restore(name, data):
    """`from_bytes`; ValueError is the only error allowed."""
    try:
        obj = getattr(core, name).from_bytes(data)
    except ValueError:
        return
    assert isinstance(obj.to_bytes(), bytes)


@st.composite
def damaged(draw):
    name = draw(st.sampled_from(sorted(SNAPSHOTS)))
    data = bytearray(SNAPSHOTS[name])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["truncate", "set", "flip", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "truncate":
            del data[at:]
        elif op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete" and data:
            del data[at : at + draw(st.integers(1, 9))]
    return name, bytes(data)


@settings(max_examples=600, deadline=None)
@given(damaged())
def test_damaged_snapshots_are_value_errors(case):
    restore(*case)


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_every_truncation_and_every_byte_set_to_ff_or_00_is_a_value_error(name):
    data = SNAPSHOTS[name]
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            getattr(core, name).from_bytes(data[:cut])
    for i in range(len(data)):
        for b in (0x00, 0xFF, data[i] ^ 0x01):
            restore(name, data[:i] + bytes([b]) + data[i + 1 :])


def test_an_admission_snapshot_naming_an_unknown_pool_is_a_value_error():
    data = SNAPSHOTS["AdmissionController"]
    # The first entitlement's pool (after its name and tenant) renamed.
    at = data.index(b"pool-a", data.index(b"copilot"))
    bad = data[:at] + b"pool-x" + data[at + 6 :]
    with pytest.raises(ValueError, match="invalid snapshot"):
        core.AdmissionController.from_bytes(bad)
