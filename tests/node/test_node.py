"""The node cache (kvtier.node): engines sharing blocks through one node,
namespaces, leases released when an engine dies, who may attach, hostile
frames, and an engine that outlives its node.

The node runs in a thread of the test (in-process cases) or as
``kvtier node`` in a child process (kill cases); engines are NodeManagers,
in this process or in a child that is SIGKILLed."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.errors import InvalidArgument
from kvtier.node import client_link as node_link
from kvtier.node import protocol as P
from kvtier.node import quarantine
from kvtier.node import state as node_state
from kvtier.node.client import NodeManager
from kvtier.node.connection import NodeError, NodeUnavailable, node_status
from kvtier.node.server import NodeConfig, NodeServer
from kvtier.options.tiers import DiskOptions, HostOptions, RemoteOptions
from kvtier.pool import HostPool
from kvtier.scheduler.specs import HostSpec
from kvtier.tiers.base import LookupResult

BLOCK = 4096
NS_A = "a1" * 16
NS_B = "b2" * 16


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def content(i: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(BLOCK, dtype=np.uint32) * 2654435761 + i * 97 + salt) >> 7).astype(np.uint8)


def _remove_pools(name: str) -> None:
    for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
        f.unlink()


class Node:
    """A node in a thread of this process, stopped and its pools removed at exit."""

    def __init__(self, tmp: Path, blocks: int = 64, **kw: object) -> None:
        self.name = str(kw.pop("name", "")) or f"t{os.getpid()}-{random.randrange(1 << 30)}"
        self.path = str(tmp / "node.sock")
        self.config = NodeConfig(
            host=HostOptions(bytes=blocks * BLOCK * int(kw.get("max_classes", 1))),  # type: ignore[call-overload]
            socket_path=self.path,
            name=self.name,
            **kw,  # type: ignore[arg-type]
        )
        self.shared = self.config.shared_index
        self.server = NodeServer(self.config)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def engine(self, ns: str = NS_A, engine: str = "e", payload: int = BLOCK) -> NodeManager:
        return NodeManager(self.path, ns, payload, engine=engine)

    def status(self) -> dict:
        return node_status(self.path)

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)


@pytest.fixture(params=[False, True], ids=["rpc", "shared"])
def node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    """A node whose engines ask it everything (rpc) or look up and load
    its HITs in its shared index (shared)."""
    n = Node(tmp_path, shared_index=request.param)
    yield n
    n.stop()
    _remove_pools(n.name)


def store(m: NodeManager, pool: HostPool, ids: list[int], salt: int = 0) -> list[bytes]:
    keys = [key(i) for i in ids]
    out = m.prepare_store(keys)
    assert out is not None and out.keys_to_store == keys
    for i, s in zip(ids, out.store_spec.slots.tolist()):
        pool.view(s)[:] = content(i, salt)
    m.complete_store(keys)
    m.on_schedule_end()
    return keys


def test_engine_b_loads_what_engine_a_stored_byte_for_byte(node: Node) -> None:
    a, b = node.engine(engine="a"), node.engine(engine="b")
    pool = a.attach_pool()
    assert a.pool == b.pool
    keys = store(a, pool, list(range(8)))
    assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 8
    spec = b.prepare_load(keys)
    for i, s in zip(range(8), spec.slots.tolist()):
        assert np.array_equal(pool.view(s), content(i))
    b.complete_load(keys)
    b.on_schedule_end()
    ev = a.take_events()
    assert [e.keys for e in ev if not e.removed] == [keys]
    b.take_events()  # the gauges are as of the last step end answered (posted: taken here)
    assert (len(b.host), b.host.capacity) == (8, 64)  # the shim's usage gauge
    st = node.status()
    assert st["classes"][str(BLOCK)]["occupancy"]["blocks"] == 8
    assert st["classes"][str(BLOCK)]["occupancy"]["pinned"] == 0
    assert {e["engine"] for e in st["engines"]} == {"a", "b"}
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize(("node_spin_us", "engine_spin_s"), [(0, 0.0), (0, 1e-3), (5000, 0.0)])
def test_with_and_without_polling_for_replies_the_bytes_are_the_same(
    tmp_path: Path, node_spin_us: int, engine_spin_s: float
) -> None:
    """The node's and the engines' polling (spin_us, spin_s) change only
    when each side sleeps: every combination serves the same bytes."""
    n = Node(tmp_path, spin_us=node_spin_us)
    try:
        a = NodeManager(n.path, NS_A, BLOCK, engine="a", spin_s=engine_spin_s)
        b = NodeManager(n.path, NS_A, BLOCK, engine="b", spin_s=engine_spin_s)
        pool = a.attach_pool()
        keys = store(a, pool, list(range(8)))
        assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 8
        spec = b.prepare_load(keys)
        assert all(np.array_equal(pool.view(s), content(i)) for i, s in enumerate(spec.slots))
        b.complete_load(keys)
        b.on_schedule_end()
        assert n.status()["classes"][str(BLOCK)]["occupancy"]["pinned"] == 0
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


@pytest.mark.parametrize(("flag", "value"), [("--spin-us", "-1"), ("--adopt-grace-s", "-0.5")])
def test_node_refuses_a_negative_spin_or_grace(tmp_path: Path, flag: str, value: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "node", "--socket", str(tmp_path / "s.sock"),
         "--host-bytes", "1MiB", flag, value],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and f"{flag} must be >= 0, got {value}" in r.stderr


def test_a_scan_is_one_round_trip(node: Node) -> None:
    a = node.engine()
    pool = a.attach_pool()
    keys = store(a, pool, list(range(16)))
    b = NodeManager(node.path, NS_A, BLOCK, key_order=lambda k, ctx: keys[keys.index(k) + 1 :])
    before = b.client_stats.round_trips
    assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 16
    # Through the shared index, none: the HITs are found and pinned there.
    assert b.client_stats.round_trips - before == (0 if node.shared else 1)


def test_a_scan_lists_the_following_keys_only_when_they_may_be_asked(node: Node) -> None:
    a = node.engine()
    pool = a.attach_pool()
    keys = store(a, pool, list(range(4)))
    asked: list[bytes] = []

    def following(k: bytes, ctx: object) -> list[bytes]:
        asked.append(k)
        return keys[keys.index(k) + 1 :] if k in keys else []

    b = NodeManager(node.path, NS_A, BLOCK, key_order=following)
    # A first key that misses: through the shared index, its followers are
    # never needed (the node has no lower tiers here to ask them of).
    assert b.lookup(key(999)) is LookupResult.MISS
    assert asked == ([] if node.shared else [key(999)])
    assert b.lookup(keys[0]) is LookupResult.HIT
    assert asked[-1] == keys[0] and sorted(b._answers) == sorted(keys[1:])
    assert [b.lookup(k) for k in keys[1:]] == [LookupResult.HIT] * 3
    assert asked[-1] == keys[0]  # answered from that one scan


def test_a_load_in_the_step_of_its_lookup_waits_for_no_reply(node: Node) -> None:
    a = node.engine(engine="a")
    pool = a.attach_pool()
    keys = store(a, pool, [1, 2])
    b = NodeManager(node.path, NS_A, BLOCK, key_order=lambda k, ctx: keys[keys.index(k) + 1 :])
    assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 2
    trips = b.client_stats.round_trips
    spec = b.prepare_load(keys)
    assert b.client_stats.round_trips == trips
    assert [
        np.array_equal(pool.view(s), content(i)) for i, s in zip([1, 2], spec.slots.tolist())
    ] == [True, True]
    b.on_schedule_end()  # the lookup pins go; the load's stay until complete_load
    occ = node.status()["classes"][str(BLOCK)]["occupancy"]
    assert occ["pinned"] == 2
    b.complete_load(keys)
    b.on_schedule_end()
    assert node.status()["classes"][str(BLOCK)]["occupancy"]["pinned"] == 0
    # A claim on a load the engine's lookups did not pin closes its connection.
    c = node.engine(engine="c")
    with pytest.raises(NodeError, match="did not pin"):
        c._client.call(P.Op.LOAD_PINNED, [keys[0]], None)


def test_only_engines_that_take_kv_events_get_them(node: Node) -> None:
    a = node.engine(engine="a")
    quiet = NodeManager(node.path, NS_A, BLOCK, engine="quiet", events=False)
    cls = node.server.classes[BLOCK]
    keys = store(quiet, a.attach_pool(), [1, 2])
    a.on_schedule_end()
    quiet.on_schedule_end()
    assert [e.keys for e in a.take_events() if not e.removed] == [keys]
    assert quiet.take_events() == []
    a.shutdown()  # the last engine that takes events: the node makes none now
    deadline = time.monotonic() + 5
    while cls.manager.options.events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store(quiet, quiet.attach_pool(), [3])
    assert cls.manager._core.events == []
    quiet.shutdown()


def test_two_models_never_share_a_key(node: Node) -> None:
    """The same key bytes from two namespaces: two blocks, each engine its own."""
    a, b = node.engine(NS_A), node.engine(NS_B)
    pool = a.attach_pool()
    store(a, pool, [1, 2], salt=0)
    assert b.lookup(key(1)) is LookupResult.MISS
    store(b, pool, [1, 2], salt=5)
    la, lb = a.prepare_load([key(1)]), b.prepare_load([key(1)])
    assert la.slots[0] != lb.slots[0]
    assert np.array_equal(pool.view(int(la.slots[0])), content(1, 0))
    assert np.array_equal(pool.view(int(lb.slots[0])), content(1, 5))
    a.complete_load([key(1)])
    b.complete_load([key(1)])
    # b's events name only b's blocks
    b.on_schedule_end()
    assert all(k in (key(1), key(2)) for e in b.take_events() for k in e.keys)


def test_block_sizes_share_one_region_divided_by_use(tmp_path: Path) -> None:
    """Two block sizes in one region (16 chunks of 32 KiB): the first takes
    all of it while alone; the second then takes chunks from it as its
    regret (stores of blocks it had to evict) says it needs them, evicting
    (and announcing) the first's least recently used blocks, never a block
    in use, and the bytes of neither are ever overwritten by the other."""
    n = Node(tmp_path, max_classes=2)  # 512 KiB: 128 blocks of 4 KiB
    try:
        a = n.engine(NS_A, payload=BLOCK)
        b = n.engine(NS_B, payload=2 * BLOCK)
        assert a.pool["pool"] == b.pool["pool"]
        assert (a.pool["slot_bytes"], b.pool["slot_bytes"]) == (BLOCK, 2 * BLOCK)
        with pytest.raises(InvalidArgument, match="max-classes"):
            n.engine(NS_B, payload=3 * BLOCK)
        pa, pb = a.attach_pool(), b.attach_pool()
        a_keys = store(a, pa, list(range(128)))
        occ = n.status()["classes"]
        assert (occ[str(BLOCK)]["occupancy"]["chunks"], occ[str(BLOCK)]["occupancy"]["blocks"]) == (
            16,
            128,
        )
        # Every block of a pinned by its lookups: b can have no room.
        assert [a.lookup(k) for k in a_keys] == [LookupResult.HIT] * 128
        assert b.prepare_store([key(1000)]) is None
        a.on_schedule_end()
        # b comes back to 16 blocks of 8 KiB (4 chunks' worth), a to none
        # of its own: b's stores of blocks it had to evict are its regret,
        # and it takes a's chunks (its least recently used blocks first).
        for _ in range(4):
            for r in range(4):
                ids = list(range(1000 + 4 * r, 1004 + 4 * r))
                out = b.prepare_store([key(i) for i in ids])
                assert out is not None
                for i, slot in zip(ids, out.store_spec.slots.tolist()):
                    pb.view(slot)[:] = np.concatenate([content(i, 7), content(i, 8)])
                b.complete_store(out.keys_to_store)
                b.on_schedule_end()
        a.on_schedule_end()
        occ = n.status()
        ca, cb = (
            occ["classes"][str(BLOCK)]["occupancy"],
            occ["classes"][str(2 * BLOCK)]["occupancy"],
        )
        assert (cb["chunks"], cb["blocks"]) == (4, 16)
        assert (ca["chunks"], ca["blocks"]) == (12, 96)
        assert occ["region"]["reassigned"] == 4
        # a's oldest blocks went, announced; every byte left is its own.
        gone = [k for e in a.take_events() if e.removed for k in e.keys]
        assert sorted(gone) == sorted(a_keys[:32])
        assert [a.lookup(k) for k in a_keys[32:]] == [LookupResult.HIT] * 96
        spec = a.prepare_load(a_keys[32:])
        for i, s in zip(range(32, 128), spec.slots.tolist()):
            assert np.array_equal(pa.view(s), content(i))
        a.complete_load(a_keys[32:])
        a.on_schedule_end()
        b_keys = [key(i) for i in range(1000, 1016)]
        assert [b.lookup(k) for k in b_keys] == [LookupResult.HIT] * 16
        spec = b.prepare_load(b_keys)
        for i, s in zip(range(1000, 1016), spec.slots.tolist()):
            assert np.array_equal(pb.view(s), np.concatenate([content(i, 7), content(i, 8)]))
        b.complete_load(b_keys)
        b.on_schedule_end()
    finally:
        n.stop()
        _remove_pools(n.name)


def _store_waiting(m: NodeManager, pool: HostPool, ids: list[int]) -> None:
    """Stores ``ids`` (a slot of a disk node has a disk record's trailer
    after the block), asking again while every host slot is still
    cascading (prepare_store None: vLLM skips such a store)."""
    keys = [key(i) for i in ids]
    deadline = time.monotonic() + 30
    while (out := m.prepare_store(keys)) is None:
        assert time.monotonic() < deadline, "no host slot for 30 s"
        m.on_schedule_end()
        time.sleep(0.01)
    assert out.keys_to_store == keys
    for i, s in zip(ids, out.store_spec.slots.tolist()):
        pool.view(s)[:BLOCK] = content(i)
    m.complete_store(keys)
    m.on_schedule_end()


def _load_each(m: NodeManager, pool: HostPool, ids: list[int]) -> list[int]:
    """The ids whose block ``m`` loads with its own bytes, one at a time:
    a block on a lower tier is HIT_PENDING while the node promotes it, then
    a HIT; RETRY while a remote tier's index is still being read."""
    good = []
    for i in ids:
        k = key(i)
        deadline = time.monotonic() + 30
        while (r := m.lookup(k)) in _LATER and time.monotonic() < deadline:
            m.on_schedule_end()
            time.sleep(0.001)
        if r is LookupResult.HIT:
            slot = int(m.prepare_load([k]).slots[0])
            if np.array_equal(pool.view(slot)[:BLOCK], content(i)):
                good.append(i)
            m.complete_load([k])
        m.on_schedule_end()
    return good


_LATER = (LookupResult.HIT_PENDING, LookupResult.RETRY)


@pytest.mark.parametrize("shared", [False, True], ids=["rpc", "shared"])
@pytest.mark.parametrize("lower", ["disk", "remote"])
def test_the_nodes_lower_tier_promotes_its_blocks_and_outlives_the_node(
    tmp_path: Path, shared: bool, lower: str, request: pytest.FixtureRequest
) -> None:
    """The node's own disk or Redis tier: 64 blocks through a host tier of
    16 slots cascade to it, and another engine loads each of them, byte for
    byte, the evicted ones promoted back; a node started again over the same
    tier (its host tier empty) serves them all again from there."""
    kw: dict[str, Any] = {"shared_index": shared}
    if lower == "disk":  # 32 x 4 KiB of host: 16 slots of a block and a disk record's trailer
        kw.update(blocks=32, chunk_bytes=32768, disk=DiskOptions(str(tmp_path / "disk"), 64 << 20))
    else:
        redis = request.getfixturevalue("redis_standalone")
        redis.cli("FLUSHALL")
        kw.update(blocks=16, chunk_bytes=16384, remote=RemoteOptions(redis.url))
    ids = list(range(64))
    n = Node(tmp_path, **kw)
    try:
        a = n.engine(engine="a")
        pool = a.attach_pool()
        for g in range(0, 64, 8):
            _store_waiting(a, pool, ids[g : g + 8])
        deadline = time.monotonic() + 30
        while n.status()["classes"][str(BLOCK)]["tiers"][lower]["stores"] < 64:
            assert time.monotonic() < deadline, "the blocks never all reached the lower tier"
            time.sleep(0.01)
        b = n.engine(engine="b")
        assert _load_each(b, pool, ids) == ids
        cls = n.status()["classes"][str(BLOCK)]
        assert cls["occupancy"]["capacity"] == 16 and cls["stats"]["promotions"] >= 64 - 16
        a.shutdown()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)
    n = Node(tmp_path, **kw)  # the same tier: its blocks found again
    try:
        c = n.engine(engine="c")
        pool = c.attach_pool()
        if lower == "disk":
            assert n.status()["classes"][str(BLOCK)]["tiers"]["disk"]["recovered"] == 64
        assert _load_each(c, pool, ids) == ids
        c.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def _loaded_slot(m: NodeManager, k: bytes) -> int:
    """The slot ``m`` loads ``k`` from (a lookup, a load, its step's end and
    the load's end: its block evictable again)."""
    assert m.lookup(k) is LookupResult.HIT
    slot = int(m.prepare_load([k]).slots[0])
    m.on_schedule_end()
    m.complete_load([k])
    return slot


def test_a_failed_load_drops_only_its_own_namespaces_blocks(node: Node) -> None:
    """A worker's failed load (vLLM reports it after the load's end) drops
    the blocks in the slots it names, so that the next lookup misses rather
    than loading the same bytes again; but only blocks of the engine's own
    namespace. A slot named late (its block evicted since and the slot given
    to another model's block) or wrongly leaves another model's block as it
    was: one engine's fault never costs another model its blocks."""
    a = node.engine(NS_A, engine="a")
    b = node.engine(NS_B, engine="b")
    pool = a.attach_pool()
    store(a, pool, [1])
    store(b, pool, [2], salt=3)
    theirs, ours = _loaded_slot(a, key(1)), _loaded_slot(b, key(2))
    b.load_failed(HostSpec(np.asarray([theirs, ours], np.int64)))
    b.status()  # a round trip: the node has taken b's LOAD_FAILED in by now
    assert b.lookup(key(2)) is LookupResult.MISS  # its own: dropped
    assert _loaded_slot(a, key(1)) == theirs  # another model's: kept, its bytes too
    assert np.array_equal(pool.view(theirs), content(1))
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("shared", [False, True], ids=["rpc", "shared"])
def test_a_node_that_adopts_a_region_stores_nothing_in_it_for_its_grace(
    tmp_path: Path, shared: bool
) -> None:
    """A node started over the region a dead node left (the engines' workers
    still map it) hands none of it out for its adopt grace: a copy that an
    engine prepared against the dead node may still land in any slot, or
    read one. Stores are refused meanwhile (None: vLLM skips them), and
    served after; the new node's index starts empty."""
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    first = Node(tmp_path / "1", shared_index=shared)
    try:
        a = first.engine(engine="a")
        store(a, a.attach_pool(), [1])
        a.shutdown()
    finally:
        first.stop()  # its region stays, as a dead node's does
    t0 = time.monotonic()  # (the grace counts from the node's start, after this)
    second = Node(tmp_path / "2", name=first.name, shared_index=shared, adopt_grace_s=2.0)
    try:
        b = second.engine(engine="b")
        pool = b.attach_pool()
        assert b.lookup(key(1)) is LookupResult.MISS
        assert b.prepare_store([key(2)]) is None
        assert time.monotonic() < t0 + 2.0, "too slow to see the grace"
        b.on_schedule_end()
        time.sleep(max(0.0, t0 + 2.2 - time.monotonic()))
        b.on_schedule_end()
        deadline = time.monotonic() + 10
        while (out := b.prepare_store([key(3)])) is None:  # the next step end's top-up
            assert time.monotonic() < deadline, "stores still refused 10 s after the grace"
            b.on_schedule_end()
            time.sleep(0.01)
        for s in out.store_spec.slots.tolist():
            pool.view(s)[:] = content(3)
        b.complete_store([key(3)])
        b.on_schedule_end()
        c = second.engine(engine="c")
        assert _loaded_slot(c, key(3)) >= 0
        b.shutdown()
        c.shutdown()
    finally:
        second.stop()
        _remove_pools(first.name)


def test_lookup_hits_stay_pinned_until_the_step_ends(node: Node) -> None:
    """Another engine's offers cannot evict a block between this engine's
    lookup and its load: a full node refuses rather than evict it."""
    a, b = node.engine(engine="a"), node.engine(engine="b")
    pool = a.attach_pool()
    store(a, pool, list(range(64)))  # the node is full
    assert b.lookup(key(0)) is LookupResult.HIT
    out = a.prepare_store([key(i) for i in range(100, 164)])
    # With the shared index, a's reservation holds 64 // 32 slots besides.
    room = 63 - (2 if node.shared else 0)
    assert out is not None and key(0) not in out.evicted_keys and len(out.keys_to_store) == room
    spec = b.prepare_load([key(0)])
    assert np.array_equal(pool.view(int(spec.slots[0])), content(0))
    b.complete_load([key(0)])
    b.on_schedule_end()
    a.complete_store(out.keys_to_store, success=False)


_CHILD = """
import os, sys, time
from kvtier.node.client import NodeManager
from kvtier.pool import HostPool
from kvtier.scheduler.specs import HostSpec
import numpy as np
m = NodeManager(sys.argv[1], sys.argv[2], int(sys.argv[3]), engine="doomed")
pool = m.attach_pool()
k = lambda i: i.to_bytes(32, "big") + bytes(4)
done = [k(i) for i in range(4)]
out = m.prepare_store(done)
m.complete_store(done); m.on_schedule_end()
assert m.lookup(k(0)).name == "HIT"       # a lookup pin
m.prepare_load([k(1), k(2)])               # load pins
half = [k(i) for i in range(10, 14)]
out = m.prepare_store(half)                # writes never completed
for s in out.store_spec.slots.tolist():
    pool.view(s)[: 100] = 7                # half written
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_engine_releases_its_leases_at_once(node: Node) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, node.path, NS_A, str(BLOCK)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        st = node.status()
        (e,) = st["engines"]
        # The lookup's pin is in the shared index when there is one.
        want = {"scan_pins": 1, "load_pins": 2, "writes": 4}
        if node.shared:  # every pin in the shared index: 1 lookup's, 2 loads'
            want.update(scan_pins=0, load_pins=0, shared_slots=3)
        assert e["leases"] == want
        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        child.wait()
        while node.status()["engines"]:
            assert time.monotonic() - t0 < 1.0, "leases still held 1 s after the engine died"
            time.sleep(0.01)
    finally:
        child.kill()
    occ = node.status()["classes"][str(BLOCK)]["occupancy"]
    assert (occ["blocks"], occ["pinned"], occ["writing"]) == (4, 0, 0)
    b = node.engine(engine="b")
    assert [b.lookup(key(i)) for i in range(10, 14)] == [LookupResult.MISS] * 4
    assert [b.lookup(key(i)) for i in range(4)] == [LookupResult.HIT] * 4


def test_a_dead_engines_unfinished_slots_wait_out_their_grace(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its copies may still land after its connection closed (a vLLM
    worker outlives its scheduler): the slots of its unfinished stores and
    of its reservation go to no other engine until the grace has passed."""
    monkeypatch.setattr(quarantine, "GRACE_S", 0.5)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, node.path, NS_A, str(BLOCK)], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        child.send_signal(signal.SIGKILL)
        child.wait()
        while node.status()["engines"]:
            time.sleep(0.01)
    finally:
        child.kill()
    q = node.server.classes[BLOCK].quarantine
    held = q.held()
    # Its 4 half-written slots, and in the shared mode its reservation
    # (a 32nd of the 64 slots here).
    assert len(held) == (4 + min(node_state.RESERVE, 64 // 32) if node.shared else 4), held
    st = node.status()["classes"][str(BLOCK)]
    assert st["quarantined"] == st["occupancy"]["held"] == len(held)
    b = node.engine(engine="b")
    used: set[int] = set()
    for i in range(100, 400, 4):  # many times what is free: every free slot, evicted and reused
        keys = [key(j) for j in range(i, i + 4)]
        out = b.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        used.update(out.store_spec.slots.tolist())
        b.complete_store(keys)
        b.on_schedule_end()
    # Every other slot went to b's stores, but the 2 b holds in reserve now.
    assert not used & held and len(used) == 64 - len(held) - (2 if node.shared else 0)
    deadline = time.monotonic() + 5  # the grace, then the node's once-a-second tick
    while node.status()["classes"][str(BLOCK)]["occupancy"]["held"]:
        assert time.monotonic() < deadline, "held past the grace"
        time.sleep(0.05)
    assert q.slots == 0 and not q.held()
    b.shutdown()


_WORKER = """
import sys, time
from kvtier.node.connection import pool_info
pool_info(sys.argv[1], int(sys.argv[2]), engine=sys.argv[3])
print("mapped", flush=True)
time.sleep(600)
"""


def test_a_dead_engines_slots_stay_held_while_its_workers_live(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that named its engine when it asked for the pool (vLLM's
    workers do) may still write after its scheduler died, however long it
    is stuck: the dead engine's unfinished slots stay held past the grace
    until that worker has exited; another engine's worker holds nothing."""
    monkeypatch.setattr(quarantine, "GRACE_S", 0.2)
    procs = []
    try:
        for engine in ("doomed", "other"):
            w = subprocess.Popen(
                [sys.executable, "-c", _WORKER, node.path, str(BLOCK), engine],
                stdout=subprocess.PIPE,
            )
            procs.append(w)
            assert w.stdout is not None and w.stdout.readline().strip() == b"mapped"
        assert node.status()["writers"] == 2
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, node.path, NS_A, str(BLOCK)], stdout=subprocess.PIPE
        )
        procs.append(child)
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        child.send_signal(signal.SIGKILL)
        child.wait()
        while node.status()["engines"]:
            time.sleep(0.01)
        q = node.server.classes[BLOCK].quarantine
        held = len(q.held())
        assert held >= 4
        time.sleep(1.5)  # the grace and the node's once-a-second tick, past both
        st = node.status()["classes"][str(BLOCK)]
        assert st["quarantined"] == st["occupancy"]["held"] == held
        assert q.waiting() == held
        procs[0].kill()  # the dead engine's worker exits: its copies are over
        procs[0].wait()
        deadline = time.monotonic() + 5
        while node.status()["classes"][str(BLOCK)]["occupancy"]["held"]:
            assert time.monotonic() < deadline, "held after the engine's last worker exited"
            time.sleep(0.05)
        assert q.slots == 0 and node.status()["writers"] == 1  # the other engine's
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_claims_on_slots_not_leased_close_only_that_connection(node: Node) -> None:
    a, b = node.engine(engine="a"), node.engine(engine="b")
    pool = a.attach_pool()
    store(a, pool, [1])
    with pytest.raises(NodeError, match="does not hold"):
        b._client.call(P.Op.COMPLETE_LOAD, [key(1)], None)  # b never loaded it
    assert not b._client.connected
    c = node.engine(engine="c")
    with pytest.raises(NodeError, match="not writing"):
        c._client.call(P.Op.COMPLETE_STORE, [key(1)], None, True)  # nor wrote it
    assert a.lookup(key(1)) is LookupResult.HIT
    assert node.status()["counters"]["protocol_errors"] == 2


def test_a_fault_of_the_nodes_own_closes_only_that_connection(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the node's own code fails on (a bug, not bad input) drops
    that engine's connection, counted and logged; the node and the other
    engines go on."""
    from kvtier.node.state import Session

    a, b = node.engine(engine="a"), node.engine(engine="b")
    pool = a.attach_pool()
    store(a, pool, [1])

    def broken(self: Session, keys: list[bytes]) -> None:
        raise RuntimeError("a fault of the node's own")

    monkeypatch.setattr(Session, "touch", broken)
    with pytest.raises(NodeUnavailable):
        b._client.post(P.Op.TOUCH, [key(1)])
        b._client.call(P.Op.STATUS)  # the node closed b's connection at the TOUCH
    assert a.lookup(key(1)) is LookupResult.HIT
    st = node.status()
    assert st["counters"]["internal_errors"] == 1 and st["counters"]["protocol_errors"] == 0


def test_socket_is_0660_and_strangers_are_refused(node: Node) -> None:
    assert stat.S_IMODE(os.stat(node.path).st_mode) == 0o660
    node.server._allowed_uids = set()  # as if this process's uid were not allowed
    node.server._allowed_gids = set()
    with pytest.raises(NodeError, match="PermissionDenied"):
        node.engine()
    node.server._allowed_uids = {os.getuid()}
    assert node.status()["counters"]["refused"] == 1


def _fuzz_frames(n: int, rng: random.Random) -> Iterator[bytes]:
    good = [
        P.pack([int(P.Op.HELLO), P.VERSION, NS_A, BLOCK, "f"]),
        P.pack([int(P.Op.LOOKUP), [key(1)], None]),
        P.pack([int(P.Op.PREPARE_STORE), [key(2), key(3)], "r"]),
        P.pack([int(P.Op.COMPLETE_STORE), [key(2)], "r", True]),
        P.pack([int(P.Op.PREPARE_LOAD), [key(1)], None]),
        P.pack([int(P.Op.STEP_END), ["r"], []]),
        P.pack([int(P.Op.STORES), [key(4), key(4)], [0], ["r", None], [1, -1]]),
    ]
    for _ in range(n):
        kind = rng.randrange(5)
        if kind == 0:  # random bytes
            yield rng.randbytes(rng.randrange(1, 64))
        elif kind == 1:  # a valid frame with bytes flipped
            f = bytearray(rng.choice(good))
            for _ in range(rng.randrange(1, 4)):
                f[rng.randrange(len(f))] = rng.randrange(256)
            yield bytes(f)
        elif kind == 2:  # an oversized length
            yield P.HEADER.pack(P.MAX_FRAME + rng.randrange(1, 1 << 20)) + b"x"
        elif kind == 3:  # valid msgpack, wrong shapes
            obj = rng.choice(
                [
                    [99],
                    [int(P.Op.LOOKUP), "k", None],
                    {"a": 1},
                    [int(P.Op.HELLO), 2, NS_A, 1, "x"],
                    [int(P.Op.COMPLETE_LOAD), [key(9)], None],
                    [int(P.Op.LOAD_FAILED), [1 << 40]],
                    [int(P.Op.STORES), [key(5)], [], [None], [0]],
                ]
            )
            yield P.pack(obj)
        else:  # a truncated frame, then the connection closes
            f = rng.choice(good)
            yield f[: rng.randrange(1, len(f))]


def test_fuzz_10000_frames_leave_the_node_and_other_engines_unaffected(node: Node) -> None:
    a = node.engine(engine="steady")
    pool = a.attach_pool()
    store(a, pool, [1])
    rng = random.Random(59)
    sent = 0
    for frame in _fuzz_frames(10_000, rng):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(node.path)
        s.sendall(P.pack([int(P.Op.HELLO), P.VERSION, NS_A, BLOCK, "fuzz"]) + frame)
        s.shutdown(socket.SHUT_WR)
        while s.recv(1 << 16):
            pass
        s.close()
        sent += 1
        if sent % 2000 == 0:  # the steady engine is served throughout
            assert a.lookup(key(1)) is LookupResult.HIT
            a.on_schedule_end()
    assert sent == 10_000
    st = node.status()
    assert [e["engine"] for e in st["engines"]] == ["steady"]
    occ = st["classes"][str(BLOCK)]["occupancy"]
    assert (occ["pinned"], occ["writing"]) == (0, 0)
    assert st["counters"]["protocol_errors"] > 3000
    spec = a.prepare_load([key(1)])
    assert np.array_equal(pool.view(int(spec.slots[0])), content(1))
    a.complete_load([key(1)])


def _calls(rng: random.Random, n: int) -> bytes:
    """``n`` well-formed calls of an engine that stores nothing (so it evicts
    nothing), each with random keys, slots, requests and counts: what a
    buggy engine of another model could send."""
    out = b""
    for _ in range(n):
        ks = [key(rng.randrange(16)) for _ in range(rng.randrange(5))]
        slots = [rng.randrange(-1, 64) for _ in range(rng.randrange(5))]
        req = rng.choice([None, "r1", "r2"])
        op, args = rng.choice(
            [
                (P.Op.LOOKUP, [ks, req]),
                (P.Op.CONTAINS, [ks]),
                (P.Op.LOAD_PRESENT, [ks, req]),
                (P.Op.PREPARE_LOAD, [ks, req]),
                (P.Op.LOAD_PINNED, [ks, req]),
                (P.Op.COMPLETE_LOAD, [ks, req]),
                (P.Op.LOAD_FAILED, [slots]),
                (P.Op.TOUCH, [ks]),
                (P.Op.COMPLETE_STORE, [ks, req, rng.random() < 0.5]),
                (P.Op.STORES, [ks, slots[: len(ks)], [req], [-len(ks) or 1]]),
                (P.Op.REQUEST_FINISHED, [req]),
                (P.Op.STEP_END, [[req], slots]),
                (P.Op.RESET, []),
            ]
        )
        out += P.pack([int(op), *args])
    return out


def test_another_models_wrong_calls_never_cost_an_engine_a_block(node: Node) -> None:
    """Connections of another model send well-formed calls with random
    keys, slots and counts (the node refuses most and closes those
    connections): the steady engine's blocks, of the same key bytes, stay
    resident and load with their bytes throughout, and the node itself
    never fails (no internal error)."""
    a = node.engine(engine="steady")
    pool = a.attach_pool()
    ids = list(range(8))
    store(a, pool, ids)
    rng = random.Random(33)
    for c in range(150):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(node.path)
        s.sendall(P.pack([int(P.Op.HELLO), P.VERSION, NS_B, BLOCK, f"f{c}"]) + _calls(rng, 20))
        s.shutdown(socket.SHUT_WR)
        while s.recv(1 << 16):
            pass
        s.close()
        if c % 15 == 0:
            assert _load_each(a, pool, ids) == ids, f"after connection {c}"
    assert _load_each(a, pool, ids) == ids
    st = node.status()
    assert st["counters"]["internal_errors"] == 0 and st["counters"]["protocol_errors"] > 50
    assert [e["engine"] for e in st["engines"]] == ["steady"]
    a.shutdown()


def _node_proc(
    path: str, name: str, host_bytes: int = 64 * BLOCK, *flags: str
) -> subprocess.Popen[bytes]:
    """``kvtier node`` with ``flags`` in a child process, answering on ``path``."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "node",
            "--socket",
            path,
            "--name",
            name,
            "--host-bytes",
            str(host_bytes),
            "--adopt-grace-s",  # restarted at once here, no copy in flight
            "0",
            *flags,
        ],
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            node_status(path)
            return p
        except NodeUnavailable:
            assert time.monotonic() < deadline and p.poll() is None, "node did not start"
            time.sleep(0.05)


@pytest.mark.parametrize("flags", [(), ("--shared-index",)], ids=["round-trips", "shared-index"])
def test_engines_keep_serving_without_the_node_and_reattach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    """A node SIGKILLed: the engine's lookups miss and its offers are
    dropped (counted), never read through a dead node's index; a node
    started again is reattached at a step end and serves both engines."""
    monkeypatch.setattr(node_link, "REATTACH_PERIOD_S", 0.05)
    path, name = str(tmp_path / "n.sock"), f"t{os.getpid()}-r"
    p = _node_proc(path, name, 64 * BLOCK, *flags)
    try:
        a = NodeManager(path, NS_A, BLOCK, engine="a")
        pool = a.attach_pool()
        store(a, pool, [1])
        assert a.lookup(key(1)) is LookupResult.HIT
        a.on_schedule_end()  # (the step end sent: the next scan polls the node first)
        time.sleep(0.2)  # its reply waits in the socket, ahead of the end of the stream
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert a.lookup(key(1)) is LookupResult.MISS  # served, without the node
        assert a.lookup(key(2)) is LookupResult.MISS
        assert a.prepare_store([key(3)]) is None
        a.on_schedule_end()
        assert a.client_stats.node_down_lookups == 2
        assert a.client_stats.node_dropped_stores == 1
        p = _node_proc(path, name, 64 * BLOCK, *flags)  # adopts the pool the engine maps
        time.sleep(0.06)
        a.on_schedule_end()
        assert a.attached and a.client_stats.reattaches == 1
        keys = store(a, pool, [4])
        b = NodeManager(path, NS_A, BLOCK, engine="b")
        spec = b.prepare_load(keys) if b.lookup(keys[0]) is LookupResult.HIT else None
        assert spec is not None and np.array_equal(pool.view(int(spec.slots[0])), content(4))
    finally:
        p.kill()
        p.wait()
        _remove_pools(name)


def test_status_command_and_prometheus_metrics(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    import urllib.request

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    n = Node(tmp_path, metrics_port=port)
    try:
        a = n.engine(engine="metered")
        pool = a.attach_pool()
        store(a, pool, [1, 2, 3])
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "node", "status", "--socket", n.path],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        assert "engines attached: 1" in out.stdout and "metered" in out.stdout
        assert f"region kvnode-{n.name}-region: 16 chunks of 16.0 KiB, 15 free" in out.stdout
        assert "blocks of 4.0 KiB: 3 of at most 64 (4.7%) in 1 chunks; pinned 0" in out.stdout
        deadline = time.monotonic() + 10
        while True:  # the snapshot is refreshed once a second
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            lines = text.decode().splitlines()
            if 'kvtier_node_blocks{block_bytes="4096",state="blocks"} 3.0' in lines:
                break
            assert time.monotonic() < deadline, "\n".join(lines)
            a.on_schedule_end()
            time.sleep(0.2)
        assert "kvtier_node_engines 1.0" in lines
        assert 'kvtier_node_chunks{block_bytes="4096"} 1.0' in lines
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_client_that_never_reads_is_dropped(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.node import server as node_server

    monkeypatch.setattr(node_server, "MAX_UNREAD", 100_000)
    a = node.engine(engine="steady")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(node.path)
    s.settimeout(10)
    frame = P.pack([int(P.Op.STATUS)])
    with pytest.raises(OSError):  # the node closes it: a send fails at last
        for _ in range(20_000):
            s.sendall(frame)
    s.close()
    assert a.lookup(key(1)) is LookupResult.MISS  # the other engine is served
    assert node.status()["counters"]["protocol_errors"] == 1


def test_a_store_its_engine_finished_is_loadable_at_once_and_kept_if_it_dies(
    tmp_path: Path,
) -> None:
    """Through the shared index, a finished store is ready to every engine
    before the node hears of it; an engine that dies then leaves it whole
    (its bytes were in), while a store it never finished is dropped."""
    n = Node(tmp_path, shared_index=True)
    try:
        a, b = n.engine(engine="a"), n.engine(engine="b")
        pool = a.attach_pool()
        keys = [key(i) for i in range(6)]
        out = a.prepare_store(keys)
        assert out is not None
        for i, s in zip(range(6), out.store_spec.slots.tolist()):
            pool.view(s)[:] = content(i)
        assert a._view is not None
        a._view.finish(keys[:4], True)  # as complete_store does, before its message
        assert [b.lookup(k) for k in keys[:5]] == [LookupResult.HIT] * 4 + [
            LookupResult.HIT_PENDING
        ]
        spec = b.prepare_load(keys[:4])
        assert all(np.array_equal(pool.view(s), content(i)) for i, s in enumerate(spec.slots))
        b.complete_load(keys[:4])
        b.on_schedule_end()
        a._client.close()  # dies: COMPLETE_STORE never sent
        deadline = time.monotonic() + 5
        while len(n.status()["engines"]) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        occ = n.status()["classes"][str(BLOCK)]["occupancy"]
        assert (occ["blocks"], occ["writing"], occ["pinned"]) == (4, 0, 0)
        assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 2
        b.on_schedule_end()
        b.shutdown()
    finally:
        n.stop()
        _remove_pools(n.name)


def test_reserved_stores_of_one_key_keep_one_block_and_free_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines store the same keys into their reservations before the
    node hears of either: the node keeps the blocks of the offer it serves
    first, frees the other's slots when their writes end, and frees a closed
    engine's reservation: no slot is lost."""
    monkeypatch.setattr(quarantine, "GRACE_S", 0.5)
    n = Node(tmp_path, blocks=256, shared_index=True)
    try:
        a, b = n.engine(engine="a"), n.engine(engine="b")
        pool = a.attach_pool()
        for m in (a, b):  # a first round trip, then room reserved (256 // 32)
            store(m, pool, [1000 + id(m) % 997])
            assert m._view is not None and m._view.reserved == 8
        keys = [key(i) for i in range(4)]
        # b takes its slots before a's offer reaches the node (as b's
        # prepare_store would), and its STORE_BEGIN comes after a's.
        assert b._view is not None
        got = b._view.native.store_from_reserve(keys)
        assert got is not None and got[0] == keys
        out = a.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        b._send(P.Op.STORE_BEGIN, keys, got[1], None)
        for slots, salt in ((out.store_spec.slots.tolist(), 1), (got[1], 2)):
            for i, s in zip(range(4), slots):
                pool.view(s)[:] = content(i, salt)
        for m in (a, b):
            m.complete_store(keys)
            m.on_schedule_end()
            m.take_events()  # the step end's reply: the node has served both
        cls = n.server.classes[BLOCK]
        assert len(cls.manager.host) == 6  # 2 single blocks, 4 keys once
        assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 4
        spec = b.prepare_load(keys)
        # One writer's blocks, whole (the node serves the two connections in
        # either order): its slots, its bytes.
        kept = spec.slots.tolist()
        salt = 1 if kept == out.store_spec.slots.tolist() else 2
        assert kept in (out.store_spec.slots.tolist(), got[1])
        assert all(np.array_equal(pool.view(s), content(i, salt)) for i, s in enumerate(kept))
        b.complete_load(keys)
        b.on_schedule_end()
        a.shutdown()
        b.shutdown()
        deadline = time.monotonic() + 5
        while n.status()["engines"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        host = cls.manager.host
        # Nothing reserved, nothing lost: every slot of the class's chunks is
        # free, holds a block or is held a while (the engines' reservations:
        # their workers might still write them), and then free.
        owned = sum(len(host.slots_of(c)) for c in host.chunks)
        assert cls.quarantine.slots == 16
        assert host.free_slots + len(host) + cls.quarantine.slots == owned
        while cls.quarantine.slots:  # the node's once-a-second tick after the grace
            assert time.monotonic() < deadline + 5
            time.sleep(0.05)
        assert host.free_slots + len(host) == owned
    finally:
        n.stop()
        _remove_pools(n.name)


def test_a_stopping_node_holds_nothing_and_does_not_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Engines still attached when the node stops: their reservations and
    unfinished writes go with the node (a node started over the region
    waits out its adopt grace), not into the quarantine, whose cap every
    stop with a few engines attached passed, warning of dead engines."""
    n = Node(tmp_path, blocks=64, shared_index=True)
    engines = [n.engine(engine=f"e{i}") for i in range(6)]
    try:
        pool = engines[0].attach_pool()
        for i, m in enumerate(engines):
            store(m, pool, [i])
            m.take_events()  # the step end's reply: this engine's reservation
        q = n.server.classes[BLOCK].quarantine
        reserved = sum(len(s.reserved) for s in n.server.classes[BLOCK].sessions)
        assert reserved > 64 // 8  # past the quarantine cap (an eighth), were they held
        unfinished = engines[0].prepare_store([key(99)])  # a write never completed
        assert unfinished is not None and unfinished.keys_to_store == [key(99)]
        engines[0]._client.flush()
        with caplog.at_level(logging.INFO, logger="kvtier.node"):
            n.stop()
        assert q.slots == 0 and "past the cap" not in caplog.text
        assert caplog.text.count("node stopping; released") == 6
    finally:
        for m in engines:
            m.shutdown()
        _remove_pools(n.name)
