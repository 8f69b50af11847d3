"""One conformance suite for the manager, parametrized over eviction policies."""

from __future__ import annotations

from collections.abc import Iterator

import kvtier
import numpy as np
import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult, MemoryTier
from kvtier.tiers.host_native import make_host_tier

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def K(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


@pytest.fixture(params=["lru", "arc"])
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = HostPool(8, 4096)
    yield p
    p.close()


def make(
    pool: HostPool | None, policy: str, lower=(), capacity: int | None = None, admit_after: int = 1
) -> TieredOffloadingManager:
    return TieredOffloadingManager(
        make_host_tier(pool, capacity, policy=policy, admit_after=admit_after), list(lower)
    )


def store(m: TieredOffloadingManager, keys: list[bytes], success: bool = True) -> list[bytes]:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store, success=success)
    return out.keys_to_store


def test_lookup_states(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    assert m.lookup(K(1)) is MISS
    out = m.prepare_store([K(1)])
    assert out is not None and out.keys_to_store == [K(1)]
    assert m.lookup(K(1)) is PENDING  # being written
    m.complete_store([K(1)])
    assert m.lookup(K(1)) is HIT


def test_prepare_store_order_and_spec(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    store(m, [K(3)])
    keys = [K(5), K(3), K(1), K(4)]
    out = m.prepare_store(keys)
    assert out is not None
    assert out.keys_to_store == [K(5), K(1), K(4)]  # K(3) present: skipped, order kept
    assert len(out.store_spec.slots) == 3
    assert len(set(out.store_spec.slots.tolist())) == 3
    assert out.evicted_keys == []


def test_prepare_load_preserves_key_order(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    out = m.prepare_store([K(i) for i in range(5)])
    assert out is not None
    m.complete_store(out.keys_to_store)
    slot_of = dict(zip(out.keys_to_store, out.store_spec.slots.tolist()))
    order = [K(4), K(0), K(2)]
    spec = m.prepare_load(order)
    assert spec.slots.tolist() == [slot_of[k] for k in order]
    m.complete_load(order)


def test_pinned_keys_are_never_evicted(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    store(m, [K(i) for i in range(8)])
    m.prepare_load([K(0), K(1)])
    out = m.prepare_store([K(100 + i) for i in range(6)])
    assert out is not None
    assert K(0) not in out.evicted_keys and K(1) not in out.evicted_keys
    assert len(out.evicted_keys) == 6
    # everything else is now pinned or being written: no room
    assert m.prepare_store([K(200)]) is None
    m.complete_load([K(0), K(1)])
    assert m.prepare_store([K(200)]) is not None


def test_never_evicts_the_offer(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    store(m, [K(i) for i in range(8)])
    # The offer holds 4 resident keys and 5 new ones: only the other 4 can go,
    # so the first 4 new keys are stored (a prefix's head is worth most).
    offer = [K(0), K(1), K(2), K(3)] + [K(50 + i) for i in range(5)]
    out = m.prepare_store(offer)
    assert out is not None
    assert out.keys_to_store == [K(50 + i) for i in range(4)]
    assert sorted(out.evicted_keys) == [K(4), K(5), K(6), K(7)]
    assert m.stats.allocation_failures == 1
    m.complete_store(out.keys_to_store)
    assert m.lookup(K(54)) is MISS
    assert all(m.lookup(k) is HIT for k in offer[:8])


def test_none_when_full_changes_nothing(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    out = m.prepare_store([K(i) for i in range(8)])  # all being written
    assert out is not None
    assert m.prepare_store([K(99)]) is None
    assert all(m.lookup(K(i)) is PENDING for i in range(8))
    assert m.lookup(K(99)) is MISS


def test_failed_store_drops_keys_and_frees_slots(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    store(m, [K(i) for i in range(8)], success=False)
    assert all(m.lookup(K(i)) is MISS for i in range(8))
    assert len(store(m, [K(10 + i) for i in range(8)])) == 8  # slots are free again
    assert m.stats.store_failures == 8


def test_events(pool: HostPool, policy: str) -> None:
    m = make(pool, policy, capacity=2)
    store(m, [K(1), K(2)])  # one offer: a chain, K(2) after K(1)
    m.on_request_finished()
    store(m, [K(3)])
    ev = m.take_events()
    assert [(e.tier, e.removed, e.keys) for e in ev] == [
        ("host", False, [K(1), K(2)]),
        ("host", True, [K(2)]),  # the chain's tail goes first, under every policy
        ("host", False, [K(3)]),
    ]
    assert m.take_events() == []


def test_admission_threshold(pool: HostPool, policy: str) -> None:
    m = make(pool, policy, admit_after=2)
    out = m.prepare_store([K(1), K(2)])
    assert out is not None and out.keys_to_store == []
    out = m.prepare_store([K(1)])
    assert out is not None and out.keys_to_store == [K(1)]
    assert m.stats.not_admitted == 2


def test_reset_cache(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    store(m, [K(i) for i in range(4)])
    pending = m.prepare_store([K(10), K(11)])
    assert pending is not None
    m.prepare_load([K(0)])
    m.reset_cache()
    assert all(m.lookup(K(i)) is MISS for i in (0, 1, 2, 3, 10, 11))
    # complete_* of pre-reset jobs never comes; the 3 slots under GPU jobs
    # (2 stores, 1 load) are freed once the engine says they were flushed.
    assert m.host.free_slots == 5
    m.on_reset_flushed()
    assert m.host.free_slots == 8
    # Only the blocks announced stored are announced removed: 10 and 11 were
    # still being written (issue 35: a router must never see a removal of a
    # block it was not told of).
    removed = [e for e in m.take_events() if e.removed]
    assert sorted(removed[-1].keys) == [K(i) for i in range(4)]


def test_lock_is_real(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    assert m.lock.acquire(blocking=False)
    assert not m.lock.acquire(blocking=False)
    m.lock.release()


def test_bad_input(pool: HostPool, policy: str) -> None:
    m = make(pool, policy)
    with pytest.raises(kvtier.InvalidArgument):
        m.prepare_store(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(kvtier.InvalidArgument, match="not a HIT"):
        m.prepare_load([K(1)])
    m.shutdown()
    with pytest.raises(kvtier.ClosedError):
        m.lookup(K(1))


def test_cascade_and_promotion_with_data(pool: HostPool, policy: str) -> None:
    tier = MemoryTier()
    m = make(pool, policy, [tier])
    keys = [K(i) for i in range(3)]
    out = m.prepare_store(keys)
    assert out is not None
    for k, s in zip(keys, out.store_spec.slots):
        pool.view(int(s))[:] = k[31]
    m.complete_store(keys)
    e = m.host.get(keys[0])
    assert e is not None and e.cascading == 1  # held until the lower tier copied it
    assert m.has_pending_work()
    m.on_schedule_end()
    assert e.cascading == 0 and tier.lookup(keys[0]) is HIT
    assert not m.has_pending_work()
    m.reset_cache()
    assert [m.lookup(k) for k in keys] == [PENDING] * 3  # promotion staged
    assert m.lookup(keys[0]) is PENDING
    m.on_schedule_end()
    assert [m.lookup(k) for k in keys] == [HIT] * 3
    assert m.get_load_source(keys[1]) == "memory"
    spec = m.prepare_load(keys)
    for k, s in zip(keys, spec.slots):
        assert (pool.view(int(s)) == k[31]).all()
    m.complete_load(keys)
    assert m.get_load_source(keys[1]) == "host"
    assert m.stats.promotions == 3


def test_failed_promotion_is_a_miss(pool: HostPool, policy: str) -> None:
    tier = MemoryTier()
    m = make(pool, policy, [tier])
    store(m, [K(1), K(2)])
    m.on_schedule_end()
    m.reset_cache()
    tier.fail_loads.add(K(2))
    assert m.lookup(K(1)) is PENDING and m.lookup(K(2)) is PENDING
    m.on_schedule_end()
    assert m.lookup(K(1)) is HIT
    assert m.lookup(K(2)) is MISS  # the bad record was dropped by the tier
    assert m.stats.promotion_failures == 1
    assert m.host.free_slots == 7


def test_cascade_dropped_under_backpressure(pool: HostPool, policy: str) -> None:
    tier = MemoryTier()
    tier.busy = True
    m = make(pool, policy, [tier])
    store(m, [K(1)])
    m.on_schedule_end()
    assert m.stats.cascades_dropped == 1
    e = m.host.get(K(1))
    assert e is not None and e.cascading == 0 and e.evictable
    assert tier.lookup(K(1)) is MISS


def test_promotion_waits_when_tier_busy(pool: HostPool, policy: str) -> None:
    tier = MemoryTier()
    m = make(pool, policy, [tier])
    store(m, [K(1)])
    m.on_schedule_end()
    m.reset_cache()
    tier.busy = True
    assert m.lookup(K(1)) is PENDING
    m.on_schedule_end()
    assert m.lookup(K(1)) is PENDING
    tier.busy = False
    m.on_schedule_end()
    assert m.lookup(K(1)) is HIT


def test_promotion_needs_a_free_slot(pool: HostPool, policy: str) -> None:
    tier = MemoryTier()
    m = make(pool, policy, [tier])
    store(m, [K(i) for i in range(8)])
    m.on_schedule_end()
    m.prepare_load([K(i) for i in range(8)])  # host full and pinned
    tier.data[K(50)] = np.zeros(4096, np.uint8)
    assert m.lookup(K(50)) is MISS
    assert m.stats.allocation_failures == 1


def test_reset_during_cascade_frees_slot_on_completion(pool: HostPool, policy: str) -> None:
    tier = MemoryTier(delay_polls=3)
    m = make(pool, policy, [tier])
    store(m, [K(1)])
    m.on_schedule_end()  # cascade submitted, completes after 3 polls
    m.reset_cache()
    assert m.host.free_slots == 7
    m.on_schedule_end()
    m.on_schedule_end()
    assert m.host.free_slots == 8
    assert not m.has_pending_work()


def test_no_data_unbounded(policy: str) -> None:
    m = make(None, policy)
    for i in range(1000):
        store(m, [K(i)])
    assert all(m.lookup(K(i)) is HIT for i in range(1000))


def _scan(m: TieredOffloadingManager, keys: list[bytes]) -> tuple[int, bool]:
    """What vLLM's connector does each step: look keys up in order, stop at
    the first MISS; (hits, deferred)."""
    hits, deferred = 0, False
    for k in keys:
        r = m.lookup(k)
        if r is MISS:
            break
        hits += 1
        deferred |= r is PENDING
    return hits, deferred


def test_prefix_longer_than_host_loads_what_fits(pool: HostPool, policy: str) -> None:
    """A 12-block prefix in the lower tier, 8 host slots: the scan promotes 8,
    never evicts its own head to promote its tail, and loads those 8."""
    tier = MemoryTier()
    m = make(pool, policy, [tier])
    keys = [K(i) for i in range(12)]
    for k in keys:
        tier.data[k] = np.full(4096, k[31], np.uint8)
    assert _scan(m, keys) == (8, True)
    m.on_schedule_end()
    assert _scan(m, keys) == (8, False)  # every step finds the same 8
    spec = m.prepare_load(keys[:8])
    for k, s in zip(keys[:8], spec.slots):
        assert (pool.view(int(s)) == k[31]).all()
    m.complete_load(keys[:8])
    m.on_schedule_end()
    assert m.stats.promotions == 8
    assert m.stats.loaded_from == {"memory": 8}


def test_promotion_never_evicts_a_hit_of_the_same_step(pool: HostPool, policy: str) -> None:
    """Host full of ready blocks; a prefix whose head is in the host and tail
    only below: promoting the tail must not evict the head it just reported
    as a HIT (prepare_load of the whole prefix follows in the same step)."""
    tier = MemoryTier()
    m = make(pool, policy, [tier])
    head = [K(i) for i in range(4)]
    store(m, head)
    store(m, [K(100 + i) for i in range(4)])  # newer: LRU would keep these
    m.on_schedule_end()
    tail = [K(10), K(11)]
    for k in tail:
        tier.data[k] = np.full(4096, k[31], np.uint8)
    assert _scan(m, head + tail) == (6, True)
    assert all(m.host.get(k) is not None for k in head)
    m.on_schedule_end()
    assert _scan(m, head + tail) == (6, False)
    m.prepare_load(head + tail)  # raises if any key stopped being a HIT
    m.complete_load(head + tail)


def test_a_lookup_sees_a_promotion_that_finished_since_the_step_end(
    pool: HostPool, policy: str
) -> None:
    tier = MemoryTier(delay_polls=2)  # done at the second poll after submission
    m = make(pool, policy, [tier])
    store(m, [K(1)])
    m.on_schedule_end()
    m.on_schedule_end()
    m.reset_cache()
    assert m.lookup(K(1)) is PENDING
    m.on_schedule_end()  # submits the promotion, polls once: not done yet
    assert m.lookup(K(1)) is HIT  # the lookup polled: done, readable this step
    assert m.stats.promotions == 1


def _long_prefix(policy: str, n: int) -> tuple[TieredOffloadingManager, MemoryTier, HostPool]:
    """An empty 32-slot host tier over a memory tier holding keys 0..n-1."""
    big = HostPool(32, 4096)
    tier = MemoryTier()
    m = make(big, policy, [tier])
    for i in range(n):
        tier.data[K(i)] = np.full(4096, i, np.uint8)
    return m, tier, big


def test_a_long_prefix_starts_its_promotions_during_the_scan(policy: str) -> None:
    """The first EAGER_PROMOTE promotions of a scan go to the tier from the
    lookup that queued the last of them, before the step ends; the rest at
    the step end. A record that fails its read is a miss, never loaded."""
    from kvtier.manager import EAGER_PROMOTE

    n = EAGER_PROMOTE + 4
    m, tier, big = _long_prefix(policy, n)
    tier.fail_loads.add(K(3))
    keys = [K(i) for i in range(n)]
    try:
        assert [m.lookup(k) for k in keys[: EAGER_PROMOTE - 1]] == [PENDING] * (EAGER_PROMOTE - 1)
        assert tier.loading == {} and m.occupancy()["tier_jobs"] == 0
        assert m.lookup(keys[EAGER_PROMOTE - 1]) is PENDING
        assert sorted(tier.loading) == keys[:EAGER_PROMOTE]  # in flight, mid-scan
        assert m.occupancy()["tier_jobs"] == 1
        assert [m.lookup(k) for k in keys[EAGER_PROMOTE:]] == [PENDING] * 4
        assert len(tier.loading) == EAGER_PROMOTE  # the last 4 wait for the step end
        m.on_schedule_end()
        assert m.occupancy()["tier_jobs"] == 0 and tier.loading == {}
        assert [m.lookup(k) for k in keys[:3]] == [HIT] * 3
        assert m.lookup(K(3)) is MISS  # failed its read: dropped, not a HIT
        assert [m.lookup(k) for k in keys[4:]] == [HIT] * (n - 4)
        assert m.stats.promotions == n - 1 and m.stats.promotion_failures == 1
        good = keys[:3] + keys[4:]
        spec = m.prepare_load(good)
        for k, s in zip(good, spec.slots):
            assert (big.view(int(s)) == k[31]).all()  # each key's own bytes
        assert m.stats.loaded_from == {"memory": n - 1}
        with pytest.raises(kvtier.InvalidArgument, match="not a HIT"):
            m.prepare_load([K(3)])
        m.complete_load(good)
    finally:
        m.shutdown()
        big.close()


def test_a_busy_tier_is_asked_once_a_step_for_eager_promotions(policy: str) -> None:
    """A tier that refuses a promotion mid-scan is not asked again by every
    later lookup of that step; the queued promotions go at the step end."""
    from kvtier.manager import EAGER_PROMOTE

    n = EAGER_PROMOTE + 8
    m, tier, big = _long_prefix(policy, n)
    asked: list[int] = []
    submit = tier.submit_load

    def counted(keys, slots):  # type: ignore[no-untyped-def]
        asked.append(len(keys))
        return submit(keys, slots)

    tier.submit_load = counted  # type: ignore[method-assign]
    keys = [K(i) for i in range(n)]
    try:
        tier.busy = True
        assert [m.lookup(k) for k in keys] == [PENDING] * n
        assert asked == [EAGER_PROMOTE]  # refused once, not retried per lookup
        tier.busy = False
        m.on_schedule_end()
        assert asked == [EAGER_PROMOTE, n]  # everything queued, at the step end
        assert [m.lookup(k) for k in keys] == [HIT] * n
        assert m.stats.promotions == n
    finally:
        m.shutdown()
        big.close()


def _in_order(keys: list[bytes]):  # type: ignore[no-untyped-def]
    """A key_order over one request's ``keys`` (what the vLLM shim reads
    from vLLM's ReqContext)."""

    def following(key: bytes, req_context: object) -> list[bytes]:
        return keys[keys.index(key) + 1 :] if key in keys else []

    return following


def test_read_ahead_answers_hit_in_the_first_scan(policy: str) -> None:
    """scan_wait_s: the first lookup that misses the host tier reads the
    request's following keys too, waits, and the whole prefix is HIT in the
    step it is first looked up, each key its own bytes; the scan stops at the
    first key no tier holds."""
    n = 6
    m, _, big = _long_prefix(policy, n)
    keys = [K(i) for i in range(n + 2)]  # the last two are nowhere
    m.options.scan_wait_s = m.read_ahead.wait_left_s = 5.0
    m.options.key_order = _in_order(keys)
    try:
        assert [m.lookup(k) for k in keys] == [HIT] * n + [MISS] * 2
        assert m.stats.scan_waits == 1 and m.stats.scan_reads == n
        assert m.stats.promotions == n and m.stats.lookups["hit"] == n
        assert len(m.host) == n  # nothing allocated for the keys no tier holds
        spec = m.prepare_load(keys[:n])
        for k, s in zip(keys[:n], spec.slots):
            assert (big.view(int(s)) == k[31]).all()
        m.complete_load(keys[:n])
    finally:
        m.shutdown()
        big.close()


def test_read_ahead_failures_are_misses_and_counted(policy: str) -> None:
    m, tier, big = _long_prefix(policy, 5)
    keys = [K(i) for i in range(5)]
    tier.fail_loads.add(K(2))
    m.options.scan_wait_s = m.read_ahead.wait_left_s = 5.0
    m.options.key_order = _in_order(keys)
    try:
        assert [m.lookup(k) for k in keys[:3]] == [HIT, HIT, MISS]  # the engine stops here
        assert m.stats.promotion_failures == 1
        assert K(2) not in m.host.entries
        with pytest.raises(kvtier.InvalidArgument, match="not a HIT"):
            m.prepare_load([K(2)])
    finally:
        m.shutdown()
        big.close()


def test_read_ahead_is_bounded_by_the_step_budget(policy: str) -> None:
    """A request whose reads exceed what is left of the step's bytes takes
    the asynchronous path (HIT_PENDING, HIT after the step end); the budget
    comes back at the step end."""
    m, _, big = _long_prefix(policy, 6)
    keys = [K(i) for i in range(6)]
    m.options.scan_wait_s = m.read_ahead.wait_left_s = 5.0
    m.options.scan_bytes = m.read_ahead.bytes_left = 5 * big.slot_bytes
    m.options.key_order = _in_order(keys)
    try:
        assert [m.lookup(k) for k in keys] == [PENDING] * 6
        assert m.stats.scan_waits == 0
        m.on_schedule_end()
        assert [m.lookup(k) for k in keys] == [HIT] * 6
        m.reset_cache()
        m.on_reset_flushed()
        m.options.scan_bytes = 6 * big.slot_bytes
        m.on_schedule_end()
        assert [m.lookup(k) for k in keys] == [HIT] * 6  # fits now: read in the scan
        assert m.stats.scan_waits == 1
        with pytest.raises(kvtier.InvalidArgument):
            TieredOffloadingManager(m.host, [], scan_wait_s=-1)
    finally:
        m.shutdown()
        big.close()


def test_read_ahead_never_evicts_a_key_of_the_same_request(policy: str) -> None:
    """A host tier of 4 slots holds keys 1 and 3 of a 5-key prefix: reading
    0, 2 and 4 ahead evicts the other host blocks, never 1 or 3."""
    tier = MemoryTier()
    with HostPool(4, 4096) as p:
        m = make(p, policy, [tier])
        keys = [K(i) for i in range(5)]
        for i in (0, 2, 4):
            tier.data[K(i)] = np.full(4096, i, np.uint8)
        store(m, [K(1), K(3), K(8), K(9)])
        m.on_schedule_end()
        m.options.scan_wait_s = m.read_ahead.wait_left_s = 5.0
        m.options.key_order = _in_order(keys)
        assert m.lookup(keys[0]) is HIT
        # Two slots free up (8 and 9 evicted); 4 finds none: its promotion
        # is left to the ordinary path when the scan gets there.
        assert {K(1), K(3)} <= set(m.host.entries) and K(8) not in m.host.entries
        assert [m.lookup(k) for k in keys[1:4]] == [HIT] * 3
        m.shutdown()


@pytest.mark.parametrize("on_hit", [False, True])
def test_cascade_on_hit_writes_a_block_below_on_its_first_reuse(
    pool: HostPool, policy: str, on_hit: bool
) -> None:
    """Lower tiers that admit on the second offer, with ``cascade_on_hit``:
    a stored block is not written below until the engine loads it from the
    host tier (a reuse), then it is, once; a block never reused never is.
    Without ``cascade_on_hit`` the load is no offer: nothing is written."""
    tier = MemoryTier(admit_after=2)
    m = TieredOffloadingManager(make_host_tier(pool, policy=policy), [tier], cascade_on_hit=on_hit)
    out = m.prepare_store([K(1), K(2)])
    assert out is not None
    for k, slot in zip(out.keys_to_store, out.store_spec.slots.tolist()):
        pool.view(slot)[:] = k[31]  # the engine's bytes of the block
    m.complete_store(out.keys_to_store)
    m.on_schedule_end()
    m.on_schedule_end()
    assert tier.counters["stores"] == 0 and not tier.data
    for _ in range(2):  # reused twice: written once
        m.prepare_load([K(1)])
        m.complete_load([K(1)])
        m.on_schedule_end()
        m.on_schedule_end()
    assert set(tier.data) == ({K(1)} if on_hit else set())
    assert tier.counters["stores"] == (1 if on_hit else 0)
    if on_hit:
        written = tier.data[K(1)]
        assert written is not None and (written == 1).all()
    assert m.occupancy()["cascading"] == 0
    m.shutdown()
