"""The manager's read-ahead (``scan_wait_s``) over a real redis-server: a
returning prefix held only by Redis is HIT in the first scheduler step that
looks it up, every byte checked; what fails is a counted miss; a server that
stops answering costs one bounded wait. Fenced (as under KVTierConnector):
HIT before the values arrive, the engine's copy waiting for each one."""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from kvtier.bench.redis_server import RedisServer
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import HostTier, LookupResult
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer import DeviceTransfer

BLOCK = 16384
HIT, MISS = LookupResult.HIT, LookupResult.MISS
PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY


def K(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def content(i: int) -> np.ndarray:
    return ((np.arange(BLOCK, dtype=np.uint32) * 2654435761 + i * 97) >> 7).astype(np.uint8)


class Ctx:
    """What the vLLM shim's key_order reads: the request's keys in order."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys


def following(key: bytes, ctx: Any) -> list[bytes]:
    keys: list[bytes] = ctx.keys
    return keys[keys.index(key) + 1 :] if key in keys else []


@contextlib.contextmanager
def stopped(s: RedisServer) -> Iterator[None]:
    """The server process stopped (SIGSTOP) for the block: nothing it was
    sent is answered until the block ends (SIGCONT)."""
    assert s.proc is not None
    s.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        s.proc.send_signal(signal.SIGCONT)


def fill(url: str, ns: str, ids: list[int]) -> None:
    """Store blocks ``ids`` in Redis as another engine would (this test's
    manager has never heard of them: its tier answers RETRY)."""
    with HostPool(len(ids), BLOCK) as p:
        t = RemoteTier(url, BLOCK, namespace=ns)
        t.attach(p)
        for j, i in enumerate(ids):
            p.view(j)[:BLOCK] = content(i)
        token = t.submit_store([K(i) for i in ids], list(range(len(ids))))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            done = [c for c in t.poll() if c.token == token]
            if done:
                assert done[0].ok
                break
            time.sleep(0.002)
        else:
            raise AssertionError("store did not finish")
        t.close()


Setup = tuple[TieredOffloadingManager, RemoteTier, HostPool, str]


@pytest.fixture(params=[False, True], ids=["exists-first", "probe"])
def setup(redis_standalone: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    """A manager whose remote tier never heard of the test's keys; keys it
    does not know are checked with EXISTS first, or probed with GET."""
    ns = str(uuid.uuid4())
    pool = HostPool(16, BLOCK)
    # pool_index off: the tier must not learn the keys from the pool's
    # stream either (as behind an index that is not authoritative).
    tier = RemoteTier(redis_standalone.url, BLOCK, namespace=ns, pool_index=False)
    m = TieredOffloadingManager(
        HostTier(pool), [tier], scan_wait_s=10.0, key_order=following, probe=request.param
    )
    yield m, tier, pool, ns
    m.shutdown()
    pool.close()


def test_a_prefix_only_in_redis_is_a_hit_in_the_first_scan(
    setup: Setup, redis_standalone: Any
) -> None:
    m, tier, pool, ns = setup
    fill(redis_standalone.url, ns, list(range(6)))
    keys = [K(i) for i in range(8)]  # 6 and 7 were never stored
    ctx = Ctx(keys)
    assert tier.lookup(K(0)) is RETRY  # what the scan would have met without read-ahead
    assert [m.lookup(k, ctx) for k in keys[:7]] == [HIT] * 6 + [MISS]
    s = tier.stats()
    assert s["loads"] == 6 and s["load_failures"] == 0 and s["vanished"] == 0
    if m.options.probe:  # one round trip: GETs of all 8, two nil replies
        assert s["probes"] == 8 and s["probe_misses"] == 2 and s["exists_checks"] == 0
        assert m.stats.scan_waits == 1 and m.stats.probe_misses == 2
    else:  # EXISTS of all 8, then GETs of the 6 there: no slot for the others
        assert s["probes"] == 0 and s["exists_checks"] == 8
        assert m.stats.scan_waits == 2 and m.stats.probe_misses == 0
    assert m.stats.scan_reads == 6 and m.stats.promotion_failures == 0
    assert m.stats.lookups == {"hit": 6, "hit_pending": 0, "retry": 0, "miss": 1}
    assert len(m.host) == 6 and m.host.free_slots == 10  # the misses' slots came back
    spec = m.prepare_load(keys[:6], ctx)
    for i, slot in enumerate(spec.slots):
        assert np.array_equal(pool.view(int(slot))[:BLOCK], content(i)), i
    m.complete_load(keys[:6], ctx)
    assert m.stats.loaded_from == {"remote": 6}
    # The next step: the host tier has them, nothing is read again.
    m.on_schedule_end()
    waits, s = m.stats.scan_waits, tier.stats()
    assert [m.lookup(k, ctx) for k in keys[:7]] == [HIT] * 6 + [MISS]
    assert m.stats.scan_waits == waits and tier.stats()["loads"] == 6
    assert tier.stats()["probes"] == s["probes"]


def test_corrupted_and_vanished_values_are_counted_misses(
    setup: Setup, redis_standalone: Any
) -> None:
    m, tier, pool, ns = setup
    fill(redis_standalone.url, ns, list(range(8)))
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)
    client.setrange(tier.server_key(K(2)), 777, b"\x00\x01")  # payload bytes flipped
    keys = [K(i) for i in range(8)]
    assert [m.lookup(k, Ctx(keys)) for k in keys[:3]] == [HIT, HIT, MISS]  # the engine stops
    assert tier.stats()["corrupt"] == 1 and m.stats.promotion_failures == 1
    assert K(2) not in m.host.entries
    # Known to exist now (read by this tier), then gone from the server: the
    # read is a promotion, and a vanished value is a miss too.
    m.on_schedule_end()
    m.reset_cache()
    m.on_reset_flushed()
    m.on_schedule_end()
    assert tier.lookup(K(1)) is HIT
    client.delete(tier.server_key(K(1)))
    assert [m.lookup(k, Ctx(keys)) for k in keys[:2]] == [HIT, MISS]
    assert tier.stats()["vanished"] == 1 and m.stats.promotion_failures == 2
    assert m.stats.probe_misses == 0
    spec = m.prepare_load([K(0)])
    assert np.array_equal(pool.view(int(spec.slots[0]))[:BLOCK], content(0))
    m.complete_load([K(0)])


@pytest.mark.parametrize("probe", [False, True], ids=["exists-first", "probe"])
def test_a_stopped_server_costs_one_bounded_wait(tmp_path: Path, probe: bool) -> None:
    """SIGSTOP: the lookup's wait ends at its deadline with the reads (or the
    existence check) still in flight: HIT_PENDING (RETRY), never HIT; the
    next steps do not wait again; after SIGCONT the reads end and the keys
    are HIT with their own bytes."""
    s = RedisServer(tmp_path)
    ns = str(uuid.uuid4())
    pool = HostPool(16, BLOCK)
    tier = RemoteTier(s.url, BLOCK, namespace=ns, timeout_s=30.0, pool_index=False)
    m = TieredOffloadingManager(
        HostTier(pool), [tier], scan_wait_s=0.2, key_order=following, probe=probe
    )
    waiting = PENDING if probe else RETRY
    try:
        fill(s.url, ns, list(range(4)))
        keys = [K(i) for i in range(4)]
        with stopped(s):
            assert [m.lookup(k, Ctx(keys)) for k in keys] == [waiting] * 4
            assert m.stats.scan_timeouts == 1 and m.stats.scan_waits == 1
            assert 0.19 < m.stats.scan_wait_s < 5.0  # it waited until its deadline (0.2 s)
            # still out: the probe (a job of the manager), or the EXISTS check
            assert m.occupancy()["tier_jobs"] == int(probe) and tier.has_pending_work()
            assert len(m.host) == (4 if probe else 0)
            m.on_schedule_end()
            assert [m.lookup(k, Ctx(keys)) for k in keys] == [waiting] * 4
            assert m.stats.scan_waits == 1  # backing off: no second wait
        deadline = time.monotonic() + 20
        got: list[LookupResult] = []
        while got != [HIT] * 4 and time.monotonic() < deadline:
            m.on_schedule_end()
            time.sleep(0.01)
            got = [m.lookup(k, Ctx(keys)) for k in keys]
        assert got == [HIT] * 4
        spec = m.prepare_load(keys)
        for i, slot in enumerate(spec.slots):
            assert np.array_equal(pool.view(int(slot))[:BLOCK], content(i)), i
        m.complete_load(keys)
        assert m.stats.promotion_failures == 0 and m.stats.promotions == 4
    finally:
        m.shutdown()
        pool.close()
        s.stop()


def test_read_ahead_checks_past_a_key_the_worker_streams(redis_standalone: Any) -> None:
    """With the engine's worker reading Redis itself (``promote=False``, as
    under KVTierConnector), a key the tier already knows is a HIT with
    nothing to read ahead; the read-ahead goes on to check the keys after it
    in the same step (not stopping there, which left them RETRY), and reads
    nothing into host slots."""
    ns = str(uuid.uuid4())
    fill(redis_standalone.url, ns, list(range(6)))
    with HostPool(16, BLOCK) as pool:
        tier = RemoteTier(
            redis_standalone.url, BLOCK, namespace=ns, worker_io=True, pool_index=False
        )
        m = TieredOffloadingManager(
            HostTier(pool), [tier], streaming=True, promote=False, scan_wait_s=10.0,
            key_order=following, probe=False,
        )  # fmt: skip
        try:
            assert tier.lookup(K(0)) is RETRY  # learn that K(0) exists, as a past step would
            token = tier.submit_checks()
            assert token is not None and tier.wait([token], 10)
            tier.poll()
            assert tier.lookup(K(0)) is HIT and tier.lookup(K(1)) is RETRY
            keys = [K(i) for i in range(7)]
            assert [m.lookup(k, Ctx(keys)) for k in keys] == [HIT] * 6 + [MISS]
            assert m.stats.scan_waits == 1 and m.stats.scan_reads == 0 and len(m.host) == 0
            assert all(m.may_fail_to_load(k) for k in keys[:6])  # the worker streams them
            assert tier.stats()["loads"] == 0
            spec = m.prepare_load(keys[:6], Ctx(keys))
            assert list(spec.slots) == [-1] * 6 and spec.stream is not None
            m.complete_load(keys[:6], Ctx(keys))
        finally:
            m.shutdown()


def settle(m: TieredOffloadingManager) -> None:
    """Step ends until the manager's tier jobs have all completed."""
    deadline = time.monotonic() + 20
    while m.occupancy()["tier_jobs"] and time.monotonic() < deadline:
        m.on_schedule_end()
        time.sleep(0.002)
    assert m.occupancy()["tier_jobs"] == 0


def learn(tier: RemoteTier, keys: list[bytes]) -> None:
    """Have ``tier`` know that Redis holds ``keys`` (as a past step's check would)."""
    assert all(tier.lookup(k) is RETRY for k in keys)
    token = tier.submit_checks()
    assert token is not None and tier.wait([token], 10)
    tier.poll()
    assert all(tier.lookup(k) is HIT for k in keys)


Fenced = tuple[TieredOffloadingManager, RemoteTier, HostPool, RedisServer]


@pytest.fixture
def fenced(tmp_path: Path) -> Iterator[Fenced]:
    """A fenced manager (as under KVTierConnector) on a server of its own
    (the tests stop it), its tier knowing keys 0-3 are there."""
    s = RedisServer(tmp_path)
    ns = str(uuid.uuid4())
    pool = HostPool(16, BLOCK)
    tier = RemoteTier(s.url, BLOCK, namespace=ns, timeout_s=30.0, pool_index=False)
    m = TieredOffloadingManager(
        HostTier(pool), [tier], scan_wait_s=10.0, key_order=following, probe=True, fenced=True
    )
    try:
        fill(s.url, ns, list(range(4)))
        learn(tier, [K(i) for i in range(4)])
        yield m, tier, pool, s
    finally:
        m.shutdown()
        pool.close()
        s.stop()


def test_a_fenced_read_ahead_is_hit_before_its_values_and_the_copy_waits(fenced: Fenced) -> None:
    """With the server stopped, the keys are HIT at once (no wait); the
    engine's copy waits on their fences and ends with every byte once the
    server answers."""
    m, _, pool, s = fenced
    keys = [K(i) for i in range(4)]
    with stopped(s):
        assert [m.lookup(k, Ctx(keys)) for k in keys] == [HIT] * 4
        assert m.stats.scan_waits == 0 and m.stats.fenced_reads == 4
        assert m.occupancy()["writing"] == 4 and m.host.free_slots == 12
        assert all(m.may_fail_to_load(k) for k in keys)  # HIT before the bytes
        spec = m.prepare_load(keys, Ctx(keys))
        assert spec.fences is not None and all(spec.fences)
        kv = np.zeros((8, BLOCK), np.uint8)
        t = DeviceTransfer([kv], pool, page_bytes=[BLOCK])
        assert t.submit_load(1, spec.slots, np.arange(4), fences=spec.fences)
        time.sleep(0.1)
        assert t.get_finished() == [] and not kv.any()
    t.wait([1], 20)
    (r,) = t.get_finished()
    assert r.success, r.error
    for i in range(4):
        assert np.array_equal(kv[i], content(i)), i
    t.shutdown()
    settle(m)  # the reads' completions: promotions, evictable once unpinned
    assert m.stats.promotions == 4 and m.stats.fenced_failures == 0
    m.complete_load(keys, Ctx(keys))
    assert m.occupancy()["writing"] == 0 and m.occupancy()["pinned"] == 0
    assert all(m.host.entries[k].evictable for k in keys)
    assert not any(m.may_fail_to_load(k) for k in keys)  # in ready host slots now


def test_a_fenced_read_that_fails_fails_its_copy_and_is_dropped(fenced: Fenced) -> None:
    """A corrupted value: the copy of its slot fails (the engine recomputes
    it), never copying those bytes; the block is a MISS from then on and
    leaves the host tier when its load lets go; the others load whole."""
    m, tier, pool, s = fenced
    client = redis.Redis(host="127.0.0.1", port=s.port)
    client.setrange(tier.server_key(K(2)), 777, b"\x00\x01")
    keys = [K(i) for i in range(4)]
    with stopped(s):  # so that no read ends before the load is prepared
        assert [m.lookup(k, Ctx(keys)) for k in keys] == [HIT] * 4
        spec = m.prepare_load(keys, Ctx(keys))
        assert spec.fences is not None
        kv = np.zeros((8, BLOCK), np.uint8)
        t = DeviceTransfer([kv], pool, page_bytes=[BLOCK])
        assert t.submit_load(1, spec.slots[:2], np.arange(2), fences=spec.fences[:2])
        assert t.submit_load(2, spec.slots[2:], np.arange(2, 4), fences=spec.fences[2:])
    t.wait([1, 2], 20)
    res = {r.job_id: r for r in t.get_finished()}
    assert res[1].success and not res[2].success and "never came" in res[2].error
    assert np.array_equal(kv[:2], np.stack([content(0), content(1)]))
    assert not kv[2].any()  # nothing of the bad slot, nor of the slot after it in that job
    t.shutdown()
    settle(m)
    assert m.stats.fenced_failures == 1 and m.stats.promotions == 3
    assert tier.stats()["corrupt"] == 1
    assert m.lookup(K(2), Ctx(keys)) is MISS  # still pinned by the failed load: never HIT again
    m.complete_load(keys, Ctx(keys))
    assert K(2) not in m.host.entries and len(m.host) == 3
    assert m.occupancy()["writing"] == 0 and m.occupancy()["pinned"] == 0
    m.load_failed(spec)  # as KVTierConnector reports a job of them all
    assert len(m.host) == 0 and m.host.free_slots == 16
    # K(2) was HIT but never announced stored: a metadata-only removal (issue 49).
    host = [e for e in m.take_events() if e.tier == "host"]
    assert [e.keys for e in host if e.metadata_only] == [[K(2)]]
    assert all(K(2) not in e.keys for e in host if not e.metadata_only)


def test_a_fenced_read_failing_in_the_step_of_its_hit_still_fails_its_load(
    fenced: Fenced,
) -> None:
    """The read of a block HIT this step fails before the engine prepares
    its load (another request's lookup polled the tier): the load is
    prepared all the same and fails on the fence, never copying the slot;
    a failed block no load took is dropped at the step's end."""
    m, tier, pool, s = fenced
    client = redis.Redis(host="127.0.0.1", port=s.port)
    client.setrange(tier.server_key(K(2)), 777, b"\x00\x01")
    client.setrange(tier.server_key(K(3)), 777, b"\x00\x01")
    keys = [K(i) for i in range(4)]
    assert [m.lookup(k, Ctx(keys)) for k in keys] == [HIT] * 4
    for n in range(2000):  # other requests' lookups (each a read-ahead polling the tier)
        if m.stats.fenced_failures == 2:
            break
        m.lookup(K(100 + n), Ctx([K(100 + n)]))
        time.sleep(0.01)
    assert m.stats.fenced_failures == 2
    assert m.lookup(K(2), Ctx(keys)) is MISS  # failed: no new load takes it
    spec = m.prepare_load(keys[:3], Ctx(keys))  # HIT earlier this step: still prepared
    assert spec.fences is not None and spec.fences[2] != 0
    kv = np.zeros((4, BLOCK), np.uint8)
    t = DeviceTransfer([kv], pool, page_bytes=[BLOCK])
    assert t.submit_load(1, spec.slots, np.arange(3), fences=spec.fences)
    t.wait([1], 20)
    (r,) = t.get_finished()
    assert not r.success and "never came" in r.error and not kv[2].any()
    t.shutdown()
    m.complete_load(keys[:3], Ctx(keys))
    assert K(2) not in m.host.entries and K(3) in m.host.entries  # K(3): no load yet
    m.on_schedule_end()
    assert K(3) not in m.host.entries and m.occupancy()["writing"] == 0
    host = [e for e in m.take_events() if e.tier == "host"]
    # K(2) and K(3) were HIT, never announced stored: metadata-only removals
    # (so are the other requests' probes of keys Redis lacks).
    forgotten = [k for e in host if e.metadata_only for k in e.keys]
    assert [k for k in forgotten if k in keys] == [K(2), K(3)]
    assert not any(e.removed for e in host if not e.metadata_only)
    assert m.host.free_slots == 16 - 2  # K(0), K(1) stay
