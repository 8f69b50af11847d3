"""One conformance suite that every lower tier passes (memory, disk on both backends,
disk split over pipeline stages, remote standalone and cluster on Redis and on Valkey)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kvtier
import numpy as np
import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import HostTier, LookupResult, LowerTier, MemoryTier, TierCompletion
from kvtier.tiers.disk import DiskTier, record_bytes

BLOCK = 16384
SLOT = record_bytes(BLOCK)
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def K(i: int) -> bytes:
    return b"key-%08d" % i


class TierUnderTest:
    def __init__(
        self, tier: LowerTier, corrupt: Callable[[bytes], None], bounded: bool = True
    ) -> None:
        self.tier = tier
        self.corrupt = corrupt
        self.bounded = bounded  # evicts by its own capacity (the remote pool evicts server-side)


def _memory(tmp_path: Path, capacity: int) -> TierUnderTest:
    t = MemoryTier(capacity=capacity)
    return TierUnderTest(t, lambda k: t.fail_loads.add(k))


def _flip_record_byte(t: DiskTier, key: bytes) -> None:
    from kvtier.tiers.disk import key_digest

    rec = t.index[key_digest(key)]
    f, off = t._locate(rec)
    with open(t.paths[f], "r+b") as fh:
        fh.seek(off + 1000)
        b = fh.read(1)
        fh.seek(off + 1000)
        fh.write(bytes([b[0] ^ 0xFF]))


def _disk(backend: str) -> Callable[[Path, int], TierUnderTest]:
    def make(tmp_path: Path, capacity: int) -> TierUnderTest:
        t = DiskTier(tmp_path, capacity * SLOT, BLOCK, backend=backend, queue_depth=8)
        return TierUnderTest(t, lambda key: _flip_record_byte(t, key))

    return make


def _remote(fixture: str) -> Callable[..., TierUnderTest]:
    def make(tmp_path: Path, capacity: int, server: Any) -> TierUnderTest:
        import uuid

        import redis
        from kvtier.tiers.remote import RemoteTier
        from redis.cluster import RedisCluster

        t = RemoteTier(server.url, BLOCK, namespace=f"conformance-{uuid.uuid4()}")
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


def _staged(tmp_path: Path, capacity: int) -> TierUnderTest:
    """Two pipeline stages on disk: the manager's pool and a second stage's
    pool with slots twice as big; a block is in the tier when both hold it."""
    from kvtier.tiers.staged import StagedTier

    (tmp_path / "s0").mkdir()
    (tmp_path / "s1").mkdir()
    s0 = DiskTier(tmp_path / "s0", capacity * SLOT, BLOCK, queue_depth=8)
    s1 = DiskTier(tmp_path / "s1", capacity * 2 * SLOT, 2 * BLOCK, queue_depth=8)
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


@pytest.fixture(params=list(FACTORIES))
def make_tier(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[int], TierUnderTest]]:
    made: list[TierUnderTest] = []
    factory = FACTORIES[request.param]
    server = getattr(factory, "fixture", None)
    extra = (request.getfixturevalue(server),) if server else ()

    def make(capacity: int = 16) -> TierUnderTest:
        t = factory(tmp_path, capacity, *extra)
        made.append(t)
        return t

    yield make
    for t in made:
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
    removed = sorted(k for e in t.take_events() if e.removed for k in e.keys)
    assert removed == [K(0), K(1)]


def test_restore_of_present_key_is_ok(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    t.attach(pool)
    fill(pool, 0, 0)
    wait_done(t, t.submit_store([K(0)], [0]))
    c = wait_done(t, t.submit_store([K(0)], [0]))
    assert c.ok and look(t, K(0)) is HIT


def test_cascade_reset_promote_with_manager(make_tier, pool: HostPool) -> None:  # type: ignore[no-untyped-def]
    t = make_tier().tier
    m = TieredOffloadingManager(HostTier(pool, 8), [t])
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
