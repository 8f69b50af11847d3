"""The node's shared index through the binding (csrc/bindings/shared_index.cc):
an engine's view (EngineView) finds and pins what the node published under
its keys' digests, a request's scan stops at its first MISS, a pinned slot
cannot be retired, and an engine process killed while it pins slots leaves
pins that the node reaps exactly (its bit on every slot, no one else's)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier import _native
from kvtier.errors import InvalidArgument
from kvtier.pool import HostPool

SLOTS = 64
MISS, HIT, PENDING = 0, 1, 2
NS = b"ns-12345"  # an engine's namespace prefix


def digest(key: bytes) -> bytes:
    """A node key's digest as Python computes it (the disk and remote
    records' ``key_digest``): the node publishes blocks under it."""
    return hashlib.blake2b(key, digest_size=16).digest()


def view(pool: HostPool, engine: int, prefix: bytes = NS) -> _native.EngineView:
    return _native.EngineView.attach(pool.native, engine, prefix)


def _index_pool() -> HostPool:
    return HostPool(1, _native.SharedIndex.bytes_for(SLOTS))


def test_an_engine_finds_and_pins_what_the_node_published() -> None:
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        engine = view(HostPool.attach(pool.name), 3)
        keys = [bytes([i]) * 36 for i in range(4)]
        node.publish(10, digest(NS + keys[0]), ready=True)
        node.publish(11, digest(NS + keys[1]))  # being written
        node.publish(12, digest(NS + keys[3]), ready=True)
        # The scan stops at the first MISS (keys[2]): keys[3] is not asked.
        assert engine.scan(keys) == [(HIT, 10), (PENDING, -1), (MISS, -1)]
        assert engine.scan_pins == 1 and engine.hits == 1
        assert engine.pin_present([keys[0], keys[3]]) == [10, 12]
        assert engine.pin_present(keys) is None  # all or nothing
        assert engine.pinned_slots == 2
        assert node.pinned(10) and not node.pinned(11)
        assert node.retire(10) is False  # an engine reads it
        engine.end_step()  # the scan's pin
        assert node.pinned(10)  # pin_present's are loads: held until complete
        assert engine.complete([keys[0], keys[3], b"other"]) == [b"other"]
        assert engine.pinned_slots == 0
        assert node.retire(10) is True
        assert engine.scan([keys[0]]) == [(MISS, -1)]
        node.set_ready(11)
        assert engine.scan([keys[1]]) == [(HIT, 11)]
        engine.end_step()
        assert not node.pinned(11)


def test_scan_into_stores_what_scan_returns() -> None:
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        keys = [b"k0", b"k1", b"k2", b"k3"]
        node.publish(10, digest(NS + keys[0]), ready=True)
        node.publish(11, digest(NS + keys[1]))  # being written
        node.publish(12, digest(NS + keys[3]), ready=True)
        engine = view(pool, 0)
        answers: dict[bytes, object] = {b"old": ("x", 1)}
        slots: dict[bytes, int] = {}
        names = ("miss", "hit", "pending", "retry")
        # Up to and including the first MISS, as scan: keys[3] is not asked.
        assert engine.scan_into(keys, answers, slots, names) == (3, MISS)
        assert answers == {
            b"old": ("x", 1),
            keys[0]: ("hit", 10),
            keys[1]: ("pending", -1),
            keys[2]: ("miss", -1),
        }
        assert slots == {keys[0]: 10}  # only HITs have a slot
        assert engine.scan_pins == 1 and engine.hits == 1
        assert engine.scan_into([keys[3]], answers, slots, names) == (1, HIT)
        assert answers[keys[3]] == ("hit", 12) and slots[keys[3]] == 12
        with pytest.raises(InvalidArgument, match="an answer code has no result"):
            engine.scan_into([keys[3]], {}, {}, ("miss",))
        engine.end_step()


def test_take_all_loads_takes_every_key_or_none() -> None:
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        keys = [b"k0", b"k1", b"k2"]
        for i, k in enumerate(keys):
            node.publish(20 + i, digest(NS + k), ready=True)
        engine = view(pool, 0)
        assert engine.scan(keys[:2]) == [(HIT, 20), (HIT, 21)]
        loaded: list[int] = [7]
        # keys[2] was not found by this step's scans: nothing is taken.
        assert engine.take_all_loads(keys, loaded) is None
        assert loaded == [7] and engine.scan_pins == 2 and engine.loads == 0
        got = engine.take_all_loads(keys[:2], loaded)
        assert got is not None and got.dtype == np.int64 and got.tolist() == [20, 21]
        assert loaded == [7, 20, 21]
        assert engine.scan_pins == 0 and engine.loads == 2  # the scan pins are the loads' now
        assert engine.take_all_loads(keys[:2], loaded) is None  # taken already
        engine.end_step()
        assert node.pinned(20) and node.pinned(21)  # held by the loads past the step
        assert engine.complete(keys[:2]) == []
        assert not node.pinned(20) and not node.pinned(21)


def test_bad_input_is_refused() -> None:
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        engine = view(pool, 0)
        with pytest.raises(InvalidArgument, match="keys must be bytes"):
            engine.scan([b"a", "b"])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="a digest is 16 bytes"):
            node.publish(1, b"short")
        with pytest.raises(InvalidArgument, match="out of range"):
            node.publish(SLOTS, digest(b"k"))
        with pytest.raises(InvalidArgument, match="engine index 32 out of range"):
            view(pool, 32)
        with pytest.raises(InvalidArgument, match="a slot per key"):
            engine.add_writing([b"a"], [])
        node.publish(1, digest(b"k"))
        with pytest.raises(InvalidArgument, match="in use"):
            node.publish(1, digest(b"j"))
    with HostPool(1, 64) as small, pytest.raises(InvalidArgument, match="need"):
        _native.SharedIndex.create(small.native, SLOTS)
    with HostPool(1, 4096) as blank, pytest.raises(InvalidArgument, match="not a kvtier"):
        view(blank, 0)


def _engine_pins_and_waits(name: str, keys: list[bytes], q: mp.Queue) -> None:
    engine = view(HostPool.attach(name), 5)
    q.put(engine.scan(keys))
    signal.pause()  # killed here, pins held


def test_a_killed_engines_pins_are_reaped_exactly() -> None:
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        keys = [b"k%d" % i for i in range(8)]
        for i, k in enumerate(keys):
            node.publish(i, digest(NS + k), ready=True)
        other = view(pool, 6)
        assert other.scan([keys[0]]) == [(HIT, 0)]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_engine_pins_and_waits, args=(pool.name, keys[:5], q))
        proc.start()
        assert q.get(timeout=60) == [(HIT, i) for i in range(5)]
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        assert [node.retire(i) for i in range(5)] == [False] * 5
        assert node.unpin_all(5) == 5
        # Slot 0 is still engine 6's; the rest can go now.
        assert [node.retire(i) for i in range(5)] == [False, True, True, True, True]
        other.end_step()
        assert node.retire(0) is True


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.binary(min_size=0, max_size=400), max_size=8, unique=True),
    prefix=st.binary(max_size=16),
)
def test_an_engine_finds_keys_under_pythons_blake2b_of_prefix_and_key(
    keys: list[bytes], prefix: bytes
) -> None:
    # Lengths across the 128-byte block edges: the native digest names keys
    # in the index, Python's in the disk and remote records.
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        for i, k in enumerate(keys):
            node.publish(i, digest(prefix + k), ready=True)
        engine = view(pool, 0, prefix)
        assert engine.scan(keys) == [(HIT, i) for i in range(len(keys))]
        engine.end_step()


def test_a_mirrored_host_index_publishes_each_added_key_under_its_digest() -> None:
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        engine = view(pool, 1)
        ix = _native.HostIndex(SLOTS)
        ix.set_mirror(node)
        keys = [bytes([i]) * 40 for i in range(3)]
        ix.add_writing_many([NS + k for k in keys], [4, 9, 2], None)
        ix.add_writing(NS + b"-one", 7)
        assert [node.state(s) for s in (4, 9, 2, 7)] == [1, 1, 1, 1]  # being written
        ix.mark_ready_many([NS + k for k in keys])
        found = engine.scan([*keys, b"-one"])
        assert found == [(HIT, 4), (HIT, 9), (HIT, 2), (PENDING, -1)]
        engine.end_step()
        with pytest.raises(InvalidArgument, match="keys are bytes"):
            ix.add_writing("a str", 11)  # type: ignore[arg-type]
        assert node.state(11) == 0
        assert ix.slot("a str") == -1 and len(ix) == 4  # refused whole


def test_a_mirrored_host_index_finds_its_keys_by_digest_and_only_its_own() -> None:
    """A mirrored index keeps no dict: a key is found by its digest in the
    shared index, and only when this index holds that key in the slot named
    there (a record it did not add names no key of its)."""
    with _index_pool() as pool:
        node = _native.SharedIndex.create(pool.native, SLOTS)
        ix = _native.HostIndex(SLOTS)
        ix.add_writing(NS + b"early", 1)
        with pytest.raises(InvalidArgument, match="holds no block"):
            ix.set_mirror(node)  # its block would be found in neither
        ix = _native.HostIndex(SLOTS)
        ix.set_mirror(node)
        ix.add_writing_many([NS + b"a", NS + b"b"], [4, 9], [None, NS + b"a"])
        assert ix.parent(NS + b"b") == NS + b"a"
        node.publish(6, digest(NS + b"stray"), ready=True)  # not this index's
        assert ix.slot(NS + b"stray") == -1 and NS + b"stray" not in ix.slots
        assert dict(ix.slots.items()) == {NS + b"a": 4, NS + b"b": 9} and len(ix.slots) == 2
        assert ix.detach(NS + b"a") == 4 and ix.slot(NS + b"a") == -1 and node.state(4) == 0
        ix.release(4)
        assert ix.complete_writes([NS + b"b", NS + b"a"], True) == [NS + b"b"]
        with pytest.raises(KeyError):
            ix.slots[NS + b"a"]


CHURN_KEYS = 256
CHURN_SLOT_BYTES = 256


def _pattern(key: bytes) -> bytes:
    return digest(key) * (CHURN_SLOT_BYTES // 16)


def _engine_reads_while_the_node_churns(
    index_name: str, data_name: str, enough: Any, q: mp.Queue
) -> None:
    """Reads for 2 s at least, and on until it has 1,000 hits and the node
    says it has churned enough (``enough``): a loaded machine makes it
    slower, not the test weaker. 60 s at most."""
    import random
    import time

    engine = view(HostPool.attach(index_name), 2)
    data = HostPool.attach(data_name)
    keys = [b"churn-%d" % i for i in range(CHURN_KEYS)]
    hits = bad = 0
    start = time.monotonic()
    while True:
        t = time.monotonic() - start
        if t > 60 or (t > 2 and hits >= 1000 and enough.is_set()):
            break
        k = random.choice(keys)
        [(code, slot)] = engine.scan([k])
        if code != HIT:
            engine.end_step()
            continue
        hits += 1
        if data.view(slot).tobytes() != _pattern(k):
            bad += 1
        engine.end_step()
    q.put((hits, bad))


def test_an_engine_process_never_reads_another_keys_bytes_while_the_node_churns() -> None:
    """The node publishes, fills, readies and retires keys over few slots
    (writing another key's bytes into a slot as soon as it is retired)
    while an engine process looks keys up, pins, reads and unpins them:
    every pinned read holds its own key's bytes."""
    import random
    import time

    with _index_pool() as ipool, HostPool(SLOTS, CHURN_SLOT_BYTES) as data:
        node = _native.SharedIndex.create(ipool.native, SLOTS)
        ctx = mp.get_context("spawn")
        q, enough = ctx.Queue(), ctx.Event()
        proc = ctx.Process(
            target=_engine_reads_while_the_node_churns, args=(ipool.name, data.name, enough, q)
        )
        proc.start()
        keys = [b"churn-%d" % i for i in range(CHURN_KEYS)]
        where: dict[int, bytes] = {}  # slot -> its key
        free = list(range(SLOTS))
        retired = refused = 0
        while proc.is_alive() and q.empty():
            if free:
                slot = free.pop()
                k = random.choice([k for k in keys if k not in where.values()])
                node.publish(slot, digest(NS + k))
                data.view(slot)[:] = np.frombuffer(_pattern(k), np.uint8)
                node.set_ready(slot)
                where[slot] = k
            slot = random.choice(list(where))
            if node.retire(slot):
                data.view(slot)[:] = 0xEE  # the next key's bytes, as soon as it is free
                del where[slot]
                free.append(slot)
                retired += 1
            else:
                refused += 1
            if retired >= 1000 and refused > 0:
                enough.set()
            time.sleep(0)
        hits, bad = q.get(timeout=60)
        proc.join(60)
    assert bad == 0
    # The churn was real: the engine read many blocks, and held some of them
    # while the node tried to retire them.
    assert hits > 500 and retired > 500 and refused > 0, (hits, retired, refused)
