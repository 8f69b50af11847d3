"""One conformance suite that every lower tier passes (memory, disk on both backends,
disk split over pipeline stages, remote standalone and cluster on Redis and on Valkey);
then one test per optional capability (probes, fenced loads, reads and writes by an
engine worker, failed-read reports, slots released after a timeout), run on every
tier that declares it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvtier
import numpy as np
import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult, LowerTier, MemoryTier, TierCompletion
from kvtier.tiers.base import TierEvent, TierIO
from kvtier.tiers.disk import DiskTier, key_digest, record_bytes
from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.host_native import make_host_tier

BLOCK = 16384
SLOT = record_bytes(BLOCK)
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def K(i: int) -> bytes:
    return b"key-%08d" % i


def names(e: TierEvent) -> list[bytes]:
    """The blocks an event names, each by its event id."""
    return [vllm_event_id(k) for k in e.keys] + list(e.ids)


@dataclass
class Setup:
    """How a factory builds its tier: where, how big, and the options a
    capability needs (the defaults are each tier's own)."""

    root: Path
    capacity: int = 16
    worker_io: bool = False  # remote: offer reads and writes by another process
    timeout_s: float | None = None  # disk: the I/O deadline


class TierUnderTest:
    def __init__(
        self, tier: LowerTier, corrupt: Callable[[bytes], None], bounded: bool = True
    ) -> None:
        self.tier = tier
        self.corrupt = corrupt
        self.bounded = bounded  # evicts by its own capacity (the remote pool evicts server-side)


def _memory(s: Setup) -> TierUnderTest:
    t = MemoryTier(capacity=s.capacity)
    return TierUnderTest(t, lambda k: t.fail_loads.add(k))


def _flip_record_byte(t: DiskTier, key: bytes) -> None:
    rec = t.index[key_digest(key)]
    f, off = t._locate(rec)
    with open(t.paths[f], "r+b") as fh:
        fh.seek(off + 1000)
        b = fh.read(1)
        fh.seek(off + 1000)
        fh.write(bytes([b[0] ^ 0xFF]))


def _disk_tier(s: Setup, root: Path, capacity: int, block: int, **kw: Any) -> DiskTier:
    if s.timeout_s is not None:
        kw["timeout_s"] = s.timeout_s
    return DiskTier(root, capacity * record_bytes(block), block, queue_depth=8, **kw)


def _disk(backend: str) -> Callable[[Setup], TierUnderTest]:
    def make(s: Setup) -> TierUnderTest:
        t = _disk_tier(s, s.root, s.capacity, BLOCK, backend=backend)
        return TierUnderTest(t, lambda key: _flip_record_byte(t, key))

    return make


def _remote(fixture: str) -> Callable[..., TierUnderTest]:
    def make(s: Setup, server: Any) -> TierUnderTest:
        import uuid

        import redis
        from kvtier.tiers.remote import RemoteTier
        from redis.cluster import RedisCluster

        t = RemoteTier(
            server.url, BLOCK, namespace=f"conformance-{uuid.uuid4()}", worker_io=s.worker_io
        )
        if fixture.endswith("_cluster"):
            client: Any = RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
        else:
            client = redis.Redis(host="127.0.0.1", port=server.port)

        def corrupt(key: bytes) -> None:
            sk = t.server_key(key)
            b = client.getrange(sk, 64 + 1000, 64 + 1000)
            client.setrange(sk, 64 + 1000, bytes([b[0] ^ 0xFF]))

        return TierUnderTest(t, corrupt, bounded=False)

    make.fixture = fixture  # type: ignore[attr-defined]
    return make


def _staged(s: Setup) -> TierUnderTest:
    """Two pipeline stages on disk: the manager's pool and a second stage's
    pool with slots twice as big; a block is in the tier when both hold it."""
    from kvtier.tiers.staged import StagedTier

    (s.root / "s0").mkdir()
    (s.root / "s1").mkdir()
    s0 = _disk_tier(s, s.root / "s0", s.capacity, BLOCK)
    s1 = _disk_tier(s, s.root / "s1", s.capacity * 2, 2 * BLOCK)
    other = HostPool(32, record_bytes(2 * BLOCK))
    other.view(0, 32)[:] = 0x3C
    t = StagedTier([s0, s1], [None, other], "disk-staged")
    return TierUnderTest(t, lambda key: _flip_record_byte(s0, key))


FACTORIES: dict[str, Callable[..., TierUnderTest]] = {
    "staged-disk": _staged,
    "memory": _memory,
    "disk-io_uring": _disk("io_uring"),
    "disk-pread": _disk("pread"),
    "remote": _remote("redis_standalone"),
    "remote-cluster": _remote("redis_cluster"),
    "remote-valkey": _remote("valkey_standalone"),
    "remote-valkey-cluster": _remote("valkey_cluster"),
}


class MakeTier:
    """The test's tier factory: ``make_tier(capacity, **setup)``; ``kind``
    names the factory (a key of FACTORIES)."""

    def __init__(self, kind: str, root: Path, server: tuple[Any, ...]) -> None:
        self.kind, self.root, self.server = kind, root, server
        self.made: list[TierUnderTest] = []

    def __call__(self, capacity: int = 16, **setup: Any) -> TierUnderTest:
        s = Setup(setup.pop("root", self.root), capacity, **setup)
        t = FACTORIES[self.kind](s, *self.server)
        self.made.append(t)
        return t


@pytest.fixture(params=list(FACTORIES))
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTier]:
    server = getattr(FACTORIES[request.param], "fixture", None)
    extra = (request.getfixturevalue(server),) if server else ()
    make = MakeTier(request.param, tmp_path, extra)
    yield make
    for t in make.made:
        t.tier.close()


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = HostPool(32, SLOT)
    yield p
    p.close()


def look(tier: LowerTier, key: bytes) -> LookupResult:
    """Lookup, stepping the tier while an asynchronous check is in flight."""
    for _ in range(5000):
        r = tier.lookup(key)
        if r is not LookupResult.RETRY:
            return r
        tier.poll()
        time.sleep(0.001)
    raise AssertionError("lookup stayed RETRY")


def wait_done(tier: LowerTier, token: int | None, timeout: float = 10.0) -> TierCompletion:
    assert token is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in tier.poll():
            if c.token == token:
                return c
        time.sleep(0.001)
    raise AssertionError("tier job did not complete")


def fill(pool: HostPool, slot: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)
    pool.view(slot)[:BLOCK] = data
    return data


def test_store_then_load_byte_for_byte(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    t.attach(pool)
    want = [fill(pool, i, i) for i in range(4)]
    assert all(look(t, K(i)) is MISS for i in range(4))
    c = wait_done(t, t.submit_store([K(i) for i in range(4)], [0, 1, 2, 3]))
    assert c.ok and c.kind == "store" and c.key_ok == [True] * 4
    assert all(look(t, K(i)) is HIT for i in range(4))
    c = wait_done(t, t.submit_load([K(2), K(0)], [10, 11]))
    assert c.ok and c.keys == [K(2), K(0)]
    assert np.array_equal(pool.view(10)[:BLOCK], want[2])
    assert np.array_equal(pool.view(11)[:BLOCK], want[0])
    stored = [e for e in t.take_events() if not e.removed]
    assert sorted(k for e in stored for k in e.keys) == [K(i) for i in range(4)]


@pytest.mark.parametrize("slots", [[0, 32], [-1, 0]])
def test_bad_slots_are_refused_before_anything_moves(
    make_tier, pool: HostPool, slots: list[int]
) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    t.attach(pool)
    bad = slots[0] if slots[0] < 0 else slots[1]
    for submit in (t.submit_store, t.submit_load):
        with pytest.raises(
            kvtier.InvalidArgument, match=rf"^host slot {bad} out of range \[0, 32\)$"
        ):
            submit([K(0), K(1)], slots)
    with pytest.raises(kvtier.InvalidArgument, match=r"^2 keys but 1 slots$"):
        t.submit_store([K(0), K(1)], [0])
    assert t.poll() == [] and t.take_events() == []
    assert look(t, K(0)) is MISS


def test_load_of_unknown_key_fails_that_key_only(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    t.attach(pool)
    fill(pool, 0, 0)
    wait_done(t, t.submit_store([K(0)], [0]))
    c = wait_done(t, t.submit_load([K(0), K(99)], [5, 6]))
    assert c.key_ok == [True, False] and not c.ok


def test_corrupted_record_is_a_counted_miss(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    tut = make_tier()
    t = tut.tier
    t.attach(pool)
    fill(pool, 0, 0)
    fill(pool, 1, 1)
    wait_done(t, t.submit_store([K(0), K(1)], [0, 1]))
    tut.corrupt(K(1))
    c = wait_done(t, t.submit_load([K(0), K(1)], [5, 6]))
    assert c.key_ok == [True, False]
    assert look(t, K(1)) is MISS  # dropped
    assert t.stats()["load_failures"] == 1
    assert any(e.removed and K(1) in e.keys for e in t.take_events())


def test_capacity_evicts_oldest(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    tut = make_tier(capacity=4)
    if not tut.bounded:
        pytest.skip("capacity is the server's (maxmemory), tested with the remote tier")
    t = tut.tier
    t.attach(pool)
    for i in range(6):
        fill(pool, i, i)
    wait_done(t, t.submit_store([K(i) for i in range(4)], [0, 1, 2, 3]))
    wait_done(t, t.submit_store([K(4), K(5)], [4, 5]))
    assert [look(t, K(i)) for i in range(6)] == [MISS, MISS, HIT, HIT, HIT, HIT]
    # Named by key, or by event id where the tier no longer has the key (disk).
    removed = sorted(n for e in t.take_events() if e.removed for n in names(e))
    assert removed == sorted(vllm_event_id(K(i)) for i in (0, 1))


def test_restore_of_present_key_is_ok(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    t.attach(pool)
    fill(pool, 0, 0)
    wait_done(t, t.submit_store([K(0)], [0]))
    c = wait_done(t, t.submit_store([K(0)], [0]))
    assert c.ok and look(t, K(0)) is HIT


def test_cascade_reset_promote_with_manager(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    m = TieredOffloadingManager(make_host_tier(pool, 8), [t])
    keys = [K(i) for i in range(3)]
    out = m.prepare_store(keys)
    assert out is not None
    want = [fill(pool, int(s), 100 + i) for i, s in enumerate(out.store_spec.slots)]
    m.complete_store(keys)
    deadline = time.monotonic() + 10
    while m.has_pending_work() and time.monotonic() < deadline:
        m.on_schedule_end()
        time.sleep(0.001)
    assert all(look(t, k) is HIT for k in keys)
    m.reset_cache()
    assert [m.lookup(k) for k in keys] == [PENDING] * 3
    while any(m.lookup(k) is PENDING for k in keys) and time.monotonic() < deadline:
        m.on_schedule_end()
        time.sleep(0.001)
    assert [m.lookup(k) for k in keys] == [HIT] * 3
    spec = m.prepare_load(keys)
    for w, s in zip(want, spec.slots):
        assert np.array_equal(pool.view(int(s))[:BLOCK], w)
    m.complete_load(keys)
    m.shutdown()


# -- capabilities -------------------------------------------------------------
# A tier offers some of the interface's optional parts; one test per part,
# run on every tier that declares it and skipped (by that declaration) on the
# rest. OFFERS says which factories must declare what, so that a tier that
# stops declaring a capability fails here instead of skipping its test.

_REMOTES = {"remote", "remote-cluster", "remote-valkey", "remote-valkey-cluster"}
_DISKS = {"disk-io_uring", "disk-pread"}
OFFERS: dict[str, set[str]] = {
    "probe": _REMOTES,
    "fenced_load": _REMOTES | _DISKS,
    "pin_for_read": _DISKS | _REMOTES,
    "read_failed": _DISKS | _REMOTES,
    "write_by_worker": _DISKS | _REMOTES,
    "released_slots": _DISKS | {"staged-disk"},
}


def declares(t: LowerTier, capability: str) -> bool:
    """What ``t`` (attached to its pool) says it offers: the flags of
    :class:`LowerTier`, a reader spec for the parts another process uses,
    its own ``take_released_slots`` for slots held past a timeout."""
    if capability == "probe":
        return bool(t.can_probe)
    if capability == "fenced_load":
        return bool(t.can_fence)
    if capability in ("pin_for_read", "read_failed", "write_by_worker"):
        return t.reader_spec() is not None
    assert capability == "released_slots", capability
    return type(t).take_released_slots is not LowerTier.take_released_slots


def offered(make_tier: MakeTier, pool: HostPool, capability: str, **setup: Any) -> TierUnderTest:
    """A tier of this test's kind attached to ``pool``, built to offer
    ``capability``; the test is skipped when the tier does not declare it."""
    tut = make_tier(worker_io=True, **setup)
    tut.tier.attach(pool)
    if not declares(tut.tier, capability):
        assert make_tier.kind not in OFFERS[capability], f"{make_tier.kind} lost {capability}"
        pytest.skip(f"{make_tier.kind} does not offer {capability}")
    assert make_tier.kind in OFFERS[capability], f"{make_tier.kind} declares {capability}: test it"
    return tut


def test_declared_capabilities(make_tier: MakeTier, pool: HostPool) -> None:
    tut = make_tier(worker_io=True)
    tut.tier.attach(pool)
    got = {c for c in OFFERS if declares(tut.tier, c)}
    assert got == {c for c, kinds in OFFERS.items() if make_tier.kind in kinds}


def test_probe_reads_what_is_there_and_misses_the_rest(make_tier: MakeTier, pool: HostPool) -> None:
    tut = offered(make_tier, pool, "probe")
    t = tut.tier
    want = [fill(pool, i, 40 + i) for i in range(3)]
    assert wait_done(t, t.submit_store([K(0), K(1), K(2)], [0, 1, 2])).ok
    pool.view(21)[:] = 0x5A
    c = wait_done(t, t.submit_probe([K(1), K(7), K(0)], [20, 21, 22]))
    assert (c.kind, c.ok, c.keys) == ("probe", False, [K(1), K(7), K(0)])
    assert c.key_ok == [True, False, True] and c.missing == [False, True, False]
    assert np.array_equal(pool.view(20)[:BLOCK], want[1])
    assert np.array_equal(pool.view(22)[:BLOCK], want[0])
    assert (pool.view(21) == 0x5A).all()  # an absent key leaves its slot alone
    assert look(t, K(7)) is MISS and look(t, K(1)) is HIT
    # A value that fails its checks is a failed read, not an absent key.
    tut.corrupt(K(2))
    c = wait_done(t, t.submit_probe([K(2)], [23]))
    assert (c.ok, c.key_ok, c.missing) == (False, [False], None)
    assert look(t, K(2)) is MISS


def test_fenced_load_settles_each_fence_before_the_batch_is_polled(
    make_tier: MakeTier, pool: HostPool
) -> None:
    t = offered(make_tier, pool, "fenced_load").tier
    want = [fill(pool, i, 60 + i) for i in range(2)]
    assert wait_done(t, t.submit_store([K(0), K(1)], [0, 1])).ok
    slots = [10, 11, 12]
    armed = pool.arm_fences(slots)
    assert [pool.fence_word(s) & 3 for s in slots] == [1, 1, 1]  # pending
    token = t.submit_fenced_load([K(1), K(0), K(9)], slots, armed)
    assert token is not None
    deadline = time.monotonic() + 10
    while any(pool.fence_word(s) & 3 == 1 for s in slots) and time.monotonic() < deadline:
        time.sleep(0.001)  # no poll: the fences settle without the scheduler
    ready, failed = [int(a) & ~3 for a in armed], [(int(a) & ~3) | 2 for a in armed]
    assert [pool.fence_word(s) for s in slots] == [ready[0], ready[1], failed[2]]
    assert np.array_equal(pool.view(10)[:BLOCK], want[1])
    assert np.array_equal(pool.view(11)[:BLOCK], want[0])
    assert not any(pool.settle_fence(s, int(a), True) for s, a in zip(slots, armed))
    c = wait_done(t, token)
    assert (c.kind, c.keys, c.key_ok) == ("load", [K(1), K(0), K(9)], [True, True, False])


def test_fenced_load_of_a_corrupt_value_fails_its_fence(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tut = offered(make_tier, pool, "fenced_load")
    t = tut.tier
    want = fill(pool, 0, 70)
    assert wait_done(t, t.submit_store([K(3), K(4)], [0, 1])).ok
    tut.corrupt(K(4))
    slots = [13, 14]
    armed = pool.arm_fences(slots)
    token = t.submit_fenced_load([K(3), K(4)], slots, armed)
    assert token is not None
    c = wait_done(t, token)
    # The bytes a copy would take are checked first: a corrupt one fails its
    # fence (the waiting copy fails its load), the good one is ready.
    assert [pool.fence_word(s) for s in slots] == [int(armed[0]) & ~3, (int(armed[1]) & ~3) | 2]
    assert np.array_equal(pool.view(13)[:BLOCK], want)
    assert (c.ok, c.key_ok) == (False, [True, False])
    assert look(t, K(4)) is MISS


def _worker_io(t: LowerTier, pool: HostPool) -> TierIO:
    """What an engine worker opens from the tier's reader spec."""
    spec = t.reader_spec()
    assert spec is not None
    return spec.open(pool)


def _worker_job(
    io: TierIO, slots: list[int], locs: np.ndarray, digs: bytes, write: bool
) -> list[int]:
    """One worker I/O job to its end: each item's code."""
    job = io.submit(slots, locs, digs, write=write)
    io.engine.wait([job], 10.0)
    (r,) = [r for r in io.engine.poll() if int(r.job_id) == job]
    return list(r.items)


def test_pinned_records_are_read_by_a_worker_byte_for_byte(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tut = offered(make_tier, pool, "pin_for_read", capacity=4)
    t = tut.tier
    want = [fill(pool, i, 80 + i) for i in range(2)]
    assert wait_done(t, t.submit_store([K(0), K(1)], [0, 1])).ok
    locs, digs = t.pin_for_read([K(1), K(0)])
    assert locs.shape == (2, 3) and digs == key_digest(K(1)) + key_digest(K(0))
    if tut.bounded:  # pinned records survive a cache that fills up under them
        for i in range(2, 6):
            fill(pool, i, i)
        for i in range(2, 6):
            wait_done(t, t.submit_store([K(i)], [i]))
        assert look(t, K(0)) is HIT and look(t, K(1)) is HIT
    with HostPool(4, SLOT) as wpool:
        io = _worker_io(t, wpool)
        try:
            assert _worker_job(io, [2, 3], locs, digs, write=False) == [0, 0]
        finally:
            io.close()
        assert np.array_equal(wpool.view(2)[:BLOCK], want[1])
        assert np.array_equal(wpool.view(3)[:BLOCK], want[0])
    t.unpin_read(locs[:, 0].tolist())
    c = wait_done(t, t.submit_load([K(0)], [9]))
    assert c.key_ok == [True] and np.array_equal(pool.view(9)[:BLOCK], want[0])


def test_a_failed_worker_read_makes_the_key_a_miss(make_tier: MakeTier, pool: HostPool) -> None:
    t = offered(make_tier, pool, "read_failed").tier
    for i in range(2):
        fill(pool, i, i)
    assert wait_done(t, t.submit_store([K(0), K(1)], [0, 1])).ok
    locs, digs = t.pin_for_read([K(0)])
    t.unpin_read(locs[:, 0].tolist())
    t.read_failed(locs, digs)
    assert look(t, K(0)) is MISS and look(t, K(1)) is HIT
    want = fill(pool, 0, 99)  # stored anew, it is a hit again
    assert wait_done(t, t.submit_store([K(0)], [0])).ok
    assert look(t, K(0)) is HIT
    c = wait_done(t, t.submit_load([K(0)], [5]))
    assert c.key_ok == [True] and np.array_equal(pool.view(5)[:BLOCK], want)


def test_worker_writes_are_readable_once_committed(make_tier: MakeTier, pool: HostPool) -> None:
    t = offered(make_tier, pool, "write_by_worker").tier
    keys = [K(0), K(1), K(2)]
    reserved = t.reserve_for_write(keys)
    assert [pos for pos, _, _ in reserved] == [0, 1, 2]
    assert [dig for _, _, dig in reserved] == [key_digest(k) for k in keys]
    assert all(look(t, k) is not HIT for k in keys)  # unreadable until committed
    with HostPool(4, SLOT) as wpool:
        want = [np.random.default_rng(120 + i).integers(0, 256, BLOCK, np.uint8) for i in range(2)]
        for i in range(2):
            wpool.view(i)[:BLOCK] = want[i]
        locs = np.stack([loc for _, loc, _ in reserved[:2]])
        digs = b"".join(dig for _, _, dig in reserved[:2])
        io = _worker_io(t, wpool)
        try:
            assert _worker_job(io, [0, 1], locs, digs, write=True) == [0, 0]
        finally:
            io.close()
    for (pos, loc, _), ok in zip(reserved, [True, True, False]):  # K(2)'s write failed
        t.commit_write(keys[pos], int(loc[0]), ok)
    assert [look(t, k) for k in keys] == [HIT, HIT, MISS]
    c = wait_done(t, t.submit_load([K(1), K(0)], [10, 11]))
    assert c.key_ok == [True, True]
    assert np.array_equal(pool.view(10)[:BLOCK], want[1])
    assert np.array_equal(pool.view(11)[:BLOCK], want[0])


def test_slots_held_past_a_timeout_are_released_once_the_device_lets_go(
    make_tier: MakeTier, pool: HostPool, request: pytest.FixtureRequest
) -> None:
    offered(make_tier, pool, "released_slots")
    mnt: Path = request.getfixturevalue("freezable_dir")
    t = make_tier(root=mnt, timeout_s=0.3).tier
    t.attach(pool)
    slots = [0, 1, 2, 3]
    want = [fill(pool, s, 140 + s) for s in slots]
    subprocess.run(["fsfreeze", "--freeze", str(mnt)], check=True)
    try:
        c = wait_done(t, t.submit_store([K(i) for i in range(4)], slots))
        assert c.key_ok == [False] * 4 and c.held is not None
        held = sorted(s for s, h in zip(slots, c.held) if h)
        assert held, "no write was under way when the deadline passed"
        for _ in range(20):  # the device still has them: none comes back
            t.poll()
            assert t.take_released_slots() == []
            time.sleep(0.01)
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(mnt)], check=True)
    released: list[int] = []
    deadline = time.monotonic() + 10
    while len(released) < len(held) and time.monotonic() < deadline:
        t.poll()
        released += t.take_released_slots()
        time.sleep(0.01)
    assert sorted(released) == held
    t.poll()
    assert t.take_released_slots() == []
    assert wait_done(t, t.submit_store([K(i) for i in range(4)], slots)).ok
    c = wait_done(t, t.submit_load([K(3), K(0)], [10, 11]))
    assert c.key_ok == [True, True]
    assert np.array_equal(pool.view(10)[:BLOCK], want[3])
    assert np.array_equal(pool.view(11)[:BLOCK], want[0])
    t.close()  # before the filesystem goes
