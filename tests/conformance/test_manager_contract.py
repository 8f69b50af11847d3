"""vLLM's ``OffloadingManager`` contract (0.33), promise by promise, as
kvtier's manager keeps it in every configuration it ships: a host tier
alone, over a disk tier, over Redis; each host eviction policy (LRU, ARC,
PLFU). One test per promise; its docstring states the promise.

The engine's side is played by hand, as vLLM's connector plays it: lookups
under the lock, then ``prepare_*`` / ``complete_*``, then the step end
(``on_schedule_end``), which drains the lower tiers and submits the
step's batched cascades and promotions. A host tier of four slots makes
every eviction deliberate: each test leaves one choice for the policy, or
none, so that it states exact keys whatever the policy's order.

Lower tiers answer asynchronously (disk and Redis jobs run on their own
threads; Redis answers an unknown key RETRY until its existence check comes
back): :func:`settle` and :func:`resolve` run step ends until they did,
bounded, never timing anything. tests/conformance/test_manager.py has the
manager's own behaviours beyond the contract (read-ahead, eager
promotions, backpressure) over an in-memory lower tier.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvtier
import pytest
from conftest import block_content
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.disk import DiskTier, record_bytes
from kvtier.tiers.host_native import make_host_tier
from test_tiers import _flip_record_byte

HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)  # fmt: skip
BLOCK = 4096
SLOTS = 4  # host slots
LOWERS = ("host", "host+disk", "host+redis")
POLICIES = ("lru", "arc", "plfu")


def K(i: int) -> bytes:
    """Key ``i`` in vLLM's shape: a 32-byte block hash, then group 0."""
    return i.to_bytes(32, "big") + bytes(4)


@dataclass
class Setup:
    """A manager under test, its host pool, how to spoil a key's copy in its
    lower tier (None: host only) and what else to close after the test."""

    m: TieredOffloadingManager
    pool: HostPool
    corrupt: Callable[[bytes], None] | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)


def _build(request: pytest.FixtureRequest, tmp_path: Path, lower: str, policy: str) -> Setup:
    pool = HostPool(SLOTS, record_bytes(BLOCK))
    tiers: list[Any] = []
    closers: list[Callable[[], None]] = []
    corrupt: Callable[[bytes], None] | None = None
    if lower == "host+disk":
        disk = DiskTier(tmp_path, 32 * record_bytes(BLOCK), BLOCK, reserve_bytes=0)
        tiers.append(disk)

        def corrupt(key: bytes) -> None:
            _flip_record_byte(disk, key)

    elif lower == "host+redis":
        import redis
        from kvtier.tiers.remote import RemoteTier

        server = request.getfixturevalue("redis_standalone")
        # No pool index (the default reads the pool's event stream on a thread
        # that costs 0.2 s a close): a key this tier does not know is RETRY
        # until its existence check answers, the contract's asynchronous
        # lookup. tests/integration/test_pool_index.py has the index.
        remote = RemoteTier(server.url, BLOCK, namespace=f"contract-{uuid.uuid4()}",
                            pool_index=False)  # fmt: skip
        tiers.append(remote)
        client = redis.Redis(host="127.0.0.1", port=server.port)
        closers.append(client.close)

        def corrupt(key: bytes) -> None:
            at = 64 + 1000  # inside the block, past the record's header
            byte = client.getrange(remote.server_key(key), at, at)
            assert isinstance(byte, bytes)
            client.setrange(remote.server_key(key), at, bytes([byte[0] ^ 0xFF]))

    m = TieredOffloadingManager(make_host_tier(pool, policy=policy), tiers)
    return Setup(m, pool, corrupt, closers)


def _setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    lower, policy = request.param
    s = _build(request, tmp_path, lower, policy)
    yield s
    s.m.shutdown()
    s.pool.close()
    for close in s.closers:
        close()


CONFIGS = [(lower, policy) for lower in LOWERS for policy in POLICIES]
TIERED = [c for c in CONFIGS if c[0] != "host"]


@pytest.fixture(params=CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def s(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    """Every configuration."""
    yield from _setup(request, tmp_path)


@pytest.fixture(params=TIERED, ids=lambda c: f"{c[0]}-{c[1]}")
def tiered(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    """The configurations with a lower tier (promises about promotions)."""
    yield from _setup(request, tmp_path)


# -- the engine's side ---------------------------------------------------------


def settle(m: TieredOffloadingManager) -> None:
    """Step ends until no tier has work in flight (the cascades of the
    stores so far ended, their blocks evictable again)."""
    deadline = time.monotonic() + 20
    m.on_schedule_end()
    while m.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not end"
        time.sleep(0.001)
        m.on_schedule_end()


def resolve(m: TieredOffloadingManager, key: bytes) -> LookupResult:
    """``key``'s lookup, asked again after step ends while it is RETRY
    (a tier still checking)."""
    deadline = time.monotonic() + 20
    r = m.lookup(key)
    while r is RETRY:
        assert time.monotonic() < deadline, "lookup stayed RETRY"
        time.sleep(0.001)
        m.on_schedule_end()
        r = m.lookup(key)
    return r


def offer(s: Setup, keys: list[bytes], complete: bool = True, success: bool = True) -> list[bytes]:
    """The engine offers ``keys``, writes each stored block's bytes into its
    slot and (``complete``) reports the store; the keys stored."""
    out = s.m.prepare_store(keys)
    assert out is not None
    assert len(out.store_spec.slots) == len(out.keys_to_store)
    for k, slot in zip(out.keys_to_store, out.store_spec.slots.tolist()):
        s.pool.view(slot)[:BLOCK] = block_content(int.from_bytes(k[:32], "big"), BLOCK)
    if complete:
        s.m.complete_store(out.keys_to_store, success=success)
    return out.keys_to_store


def host_events(m: TieredOffloadingManager) -> list[tuple[str, list[bytes]]]:
    """The host tier's events taken now: ("stored" | "removed" | "forgotten",
    keys); "forgotten" is a metadata-only removal."""
    return [
        ("forgotten" if e.metadata_only else "removed" if e.removed else "stored", e.keys)
        for e in m.take_events()
        if e.tier == "host"
    ]


def holds_bytes(s: Setup, key: bytes, slot: int) -> bool:
    want = block_content(int.from_bytes(key[:32], "big"), BLOCK)
    return bool((s.pool.view(slot)[:BLOCK] == want).all())


def full_of_ready_blocks(s: Setup) -> list[bytes]:
    """Fill the host tier with K(0)..K(3), stored and settled (evictable)."""
    keys = [K(i) for i in range(SLOTS)]
    assert offer(s, keys) == keys
    settle(s.m)
    host_events(s.m)
    return keys


# -- lookup ----------------------------------------------------------------------


def test_lookup_is_miss_then_pending_then_hit(s: Setup) -> None:
    """lookup: MISS for a key not offloaded (after RETRY while a tier checks
    asynchronously), HIT_PENDING once its store is prepared and until it
    completes, HIT once readable."""
    m = s.m
    assert resolve(m, K(7)) is MISS
    assert offer(s, [K(7)], complete=False) == [K(7)]
    assert m.lookup(K(7)) is PENDING
    m.complete_store([K(7)])
    assert m.lookup(K(7)) is HIT
    assert m.get_load_source(K(7)) == "host"


def test_lookup_is_pending_while_a_promotion_runs_then_hit(tiered: Setup) -> None:
    """lookup of a key held only by a lower tier: HIT_PENDING while its
    promotion into the host tier runs, HIT once it ended (its source the
    lower tier until loaded), and the promoted slot holds its bytes."""
    s, m = tiered, tiered.m
    offer(s, [K(1), K(2)])
    settle(m)
    m.reset_cache()  # the host tier forgets; the lower tier keeps them
    assert resolve(m, K(1)) is PENDING and m.lookup(K(2)) is PENDING
    settle(m)
    assert [m.lookup(K(1)), m.lookup(K(2))] == [HIT, HIT]
    assert m.get_load_source(K(1)) == m.lower[0].name
    spec = m.prepare_load([K(2), K(1)])
    assert [holds_bytes(s, k, slot) for k, slot in zip([K(2), K(1)], spec.slots.tolist())] == [
        True, True]  # fmt: skip
    m.complete_load([K(2), K(1)])
    assert host_events(m)[-1] == ("stored", [K(2)])  # each announced once readable


# -- loads ----------------------------------------------------------------------


def test_prepare_load_returns_slots_co_indexed_with_the_keys(s: Setup) -> None:
    """prepare_load: the spec lists one host slot per key, in the order of
    the keys given (not the order they were stored in), each holding that
    key's bytes."""
    keys = full_of_ready_blocks(s)
    order = [keys[3], keys[0], keys[2]]
    spec = s.m.prepare_load(order)
    assert len(spec.slots) == 3 and len(set(spec.slots.tolist())) == 3
    assert all(holds_bytes(s, k, slot) for k, slot in zip(order, spec.slots.tolist()))
    s.m.complete_load(order)


def test_prepare_load_pins_until_complete_load(s: Setup) -> None:
    """prepare_load pins its keys against eviction; complete_load unpins
    them (evictable again)."""
    m = s.m
    keys = full_of_ready_blocks(s)
    m.prepare_load(keys)
    assert m.prepare_store([K(50)]) is None  # every block pinned
    m.complete_load(keys[1:])
    out = m.prepare_store([K(50)])
    assert out is not None and out.keys_to_store == [K(50)]
    assert len(out.evicted_keys) == 1 and out.evicted_keys[0] in keys[1:]
    m.complete_load(keys[:1])


def test_prepare_load_of_a_key_that_is_not_a_hit_is_refused_and_pins_nothing(s: Setup) -> None:
    """prepare_load is only for keys HIT this step: any other key is an
    InvalidArgument, and the call pins none of the others."""
    m = s.m
    keys = full_of_ready_blocks(s)
    with pytest.raises(kvtier.InvalidArgument, match="not a HIT"):
        m.prepare_load([keys[0], K(99)])
    assert m.occupancy()["pinned"] == 0


# -- stores ---------------------------------------------------------------------


def test_prepare_store_offers_new_keys_in_order_with_a_slot_each(s: Setup) -> None:
    """prepare_store: keys already offloaded (or repeated in the offer) are
    not stored again; the others keep the offer's order, each with a slot
    of its own."""
    m = s.m
    offer(s, [K(2)])
    out = m.prepare_store([K(3), K(2), K(1), K(3)])
    assert out is not None and out.keys_to_store == [K(3), K(1)] and out.evicted_keys == []
    assert len(set(out.store_spec.slots.tolist()) | {m.host.entries[K(2)].slot}) == 3


def test_prepare_store_never_evicts_a_key_of_its_offer(s: Setup) -> None:
    """prepare_store never evicts a key of the offer itself, even one
    already stored and evictable: here the only victim is the one block
    not offered."""
    m = s.m
    keys = full_of_ready_blocks(s)
    out = m.prepare_store([*keys[:3], K(9)])
    assert out is not None and out.keys_to_store == [K(9)]
    assert out.evicted_keys == [keys[3]]


def test_prepare_store_never_evicts_pinned_or_written_keys(s: Setup) -> None:
    """prepare_store never evicts a key pinned by a load, nor one whose
    write is in flight (prepared, not completed): with one ready block
    left, it is the one evicted, and then nothing can be."""
    m = s.m
    keys = full_of_ready_blocks(s)
    m.prepare_load([keys[0]])
    out = m.prepare_store([K(10), K(11)])  # evicts two of keys[1:]
    assert out is not None and out.keys_to_store == [K(10), K(11)]
    left = [k for k in keys[1:] if k not in out.evicted_keys]
    assert len(left) == 1 and set(out.evicted_keys) <= set(keys[1:])
    out = m.prepare_store([K(12)])
    assert out is not None and out.evicted_keys == left
    assert m.prepare_store([K(13)]) is None
    assert [m.lookup(k) for k in (keys[0], K(10), K(11), K(12))] == [HIT] + [PENDING] * 3


def test_prepare_store_never_evicts_a_block_being_promoted(tiered: Setup) -> None:
    """prepare_store never evicts a block whose promotion into the host tier
    is in flight (HIT_PENDING): the ready blocks go, then nothing can."""
    s, m = tiered, tiered.m
    keys = full_of_ready_blocks(s)
    m.reset_cache()  # the lower tier keeps all four
    assert [resolve(m, k) for k in keys[:2]] == [PENDING, PENDING]
    settle(m)  # promoted: ready (and already below: no copy holds them)
    assert resolve(m, keys[2]) is PENDING
    evicted = []
    for new in (K(9), K(10), K(11)):  # the free slot, then the two ready blocks
        out = m.prepare_store([new])
        assert out is not None and out.keys_to_store == [new]
        evicted += out.evicted_keys
    assert sorted(evicted) == keys[:2]
    assert m.prepare_store([K(12)]) is None
    assert m.lookup(keys[2]) is PENDING
    settle(m)
    assert m.lookup(keys[2]) is HIT


def test_prepare_store_returns_none_and_changes_nothing_when_nothing_fits(s: Setup) -> None:
    """prepare_store returns None when no block can be evicted for any new
    key, and then changes nothing: no slot, no index entry, no event."""
    m = s.m
    keys = [K(i) for i in range(SLOTS)]
    offer(s, keys, complete=False)  # every slot being written
    host_events(m)

    def state() -> Any:
        return sorted((k, e.slot, e.ref) for k, e in m.host.entries.items()), m.host.free_slots

    before = state()
    assert m.prepare_store([K(20), K(21)]) is None
    assert state() == before and host_events(m) == []
    assert [m.lookup(k) for k in keys] == [PENDING] * SLOTS


def test_prepare_store_reports_its_evictions_and_announces_them(s: Setup) -> None:
    """prepare_store's evicted_keys are exactly the blocks it evicted: they
    leave the host tier and are announced removed, before the new blocks
    are announced stored (on complete_store)."""
    m = s.m
    keys = full_of_ready_blocks(s)
    m.prepare_load(keys[:2])
    out = m.prepare_store([K(30), K(31)])
    assert out is not None and sorted(out.evicted_keys) == keys[2:]
    assert all(m.host.get(k) is None for k in keys[2:])
    m.complete_store(out.keys_to_store)
    assert host_events(m) == [("removed", out.evicted_keys), ("stored", [K(30), K(31)])]
    m.complete_load(keys[:2])


def test_complete_store_makes_blocks_readable_and_announces_them(s: Setup) -> None:
    """complete_store(success=True): the blocks are HIT, their bytes
    loadable, and they are announced stored once, in the order stored."""
    m = s.m
    keys = offer(s, [K(5), K(4)], complete=False)
    assert host_events(m) == []  # not announced while written
    m.complete_store(keys)
    m.complete_store(keys)  # a second report changes nothing
    assert host_events(m) == [("stored", [K(5), K(4)])]
    spec = m.prepare_load(keys)
    assert all(holds_bytes(s, k, slot) for k, slot in zip(keys, spec.slots.tolist()))
    m.complete_load(keys)


def test_complete_store_failure_drops_blocks_with_a_metadata_only_removal(s: Setup) -> None:
    """complete_store(success=False): the blocks are dropped (MISS, their
    slots free again) and, never announced stored, only forgotten: a
    metadata-only removal, no public one."""
    m = s.m
    keys = offer(s, [K(1), K(2)], complete=False)
    assert [m.lookup(k) for k in keys] == [PENDING, PENDING]
    m.complete_store(keys, success=False)
    assert [resolve(m, k) for k in keys] == [MISS, MISS]
    assert m.host.free_slots == SLOTS
    assert host_events(m) == [("forgotten", keys)]
    assert m.stats.store_failures == 2


def test_a_store_retried_before_the_events_are_taken_is_not_forgotten(s: Setup) -> None:
    """A failed store's metadata-only removal leaves out a key that a
    retried store owns again by the time the events are taken (the engine
    would forget what it learnt of the retry)."""
    m = s.m
    keys = offer(s, [K(1), K(2)], complete=False)
    m.complete_store(keys, success=False)
    assert offer(s, [K(2)], complete=False) == [K(2)]
    assert host_events(m) == [("forgotten", [K(1)])]
    m.complete_store([K(2)])
    assert host_events(m) == [("stored", [K(2)])]


def test_a_failed_promotion_is_a_miss_and_only_forgotten(tiered: Setup) -> None:
    """A promotion whose read fails (a record that fails its check) makes
    its key a MISS, and the host tier, which never announced it, only
    forgets it (metadata-only removal)."""
    s, m = tiered, tiered.m
    offer(s, [K(1), K(2)])
    settle(m)
    m.reset_cache()
    assert s.corrupt is not None
    s.corrupt(K(2))
    host_events(m)
    assert resolve(m, K(1)) is PENDING and m.lookup(K(2)) is PENDING
    settle(m)
    assert m.lookup(K(1)) is HIT and resolve(m, K(2)) is MISS
    assert sorted(host_events(m)) == [("forgotten", [K(2)]), ("stored", [K(1)])]
    assert m.stats.promotion_failures == 1


# -- events, step ends, pending work ---------------------------------------------


def test_events_come_oldest_first_and_are_taken_once(s: Setup) -> None:
    """take_events: each tier's events in the order they happened, each
    returned once."""
    m = s.m
    keys = full_of_ready_blocks(s)
    m.prepare_load(keys[1:])
    a = offer(s, [K(40)])  # evicts keys[0], the one block not pinned
    settle(m)  # K(40)'s copies below ended: evictable
    b = offer(s, [K(41)], complete=False)  # evicts K(40), likewise
    m.complete_store(b, success=False)
    assert host_events(m) == [("removed", [keys[0]]), ("stored", a), ("removed", a),
                              ("forgotten", b)]  # fmt: skip
    assert m.take_events() == []
    m.complete_load(keys[1:])


def test_step_end_submits_the_batched_cascade(tiered: Setup) -> None:
    """on_schedule_end flushes the step's batched work: a stored block
    reaches the lower tier only from the step end on; has_pending_work is
    True while that copy runs, False once it ended."""
    s, m = tiered, tiered.m
    offer(s, [K(8)])
    tier = m.lower[0]
    assert tier.lookup(K(8)) is not HIT and m.has_pending_work()
    settle(m)
    assert tier.lookup(K(8)) is HIT and not m.has_pending_work()


def test_no_pending_work_without_a_lower_tier_job(s: Setup) -> None:
    """has_pending_work is False when nothing is in flight: a new manager,
    stores and loads of the host tier alone (GPU jobs are the engine's)."""
    m = s.m
    assert not m.has_pending_work()
    keys = offer(s, [K(1)], complete=False)
    m.complete_store(keys)
    settle(m)
    m.prepare_load(keys)
    assert not m.has_pending_work()
    m.complete_load(keys)


# -- reset, lock, shutdown -----------------------------------------------------------


def test_reset_cache_empties_the_host_tier_and_announces_only_announced_blocks(s: Setup) -> None:
    """reset_cache evicts every host block: all MISS there; removals name
    only the blocks announced stored (not one being written); slots under
    GPU jobs come free at on_reset_flushed, and a pre-reset job's
    complete_store changes nothing."""
    m = s.m
    ready = offer(s, [K(1), K(2)])
    settle(m)
    writing = offer(s, [K(3)], complete=False)
    m.prepare_load([K(1)])
    host_events(m)
    m.reset_cache()
    assert len(m.host) == 0
    assert host_events(m) == [("removed", ready)]
    assert m.host.free_slots == SLOTS - 2  # K(1) loading, K(3) written
    m.complete_store(writing)  # stale: never comes in vLLM; harmless here
    m.on_reset_flushed()
    assert m.host.free_slots == SLOTS and host_events(m) == []
    assert m.host.get(K(3)) is None


def test_the_lock_is_one_real_non_reentrant_lock(s: Setup) -> None:
    """lock: the same lock object each time, a real one (another thread
    cannot take it while held) and not reentrant (a second acquire by its
    holder fails)."""
    m = s.m
    assert m.lock is m.lock and isinstance(m.lock, type(threading.Lock()))
    with m.lock:
        assert not m.lock.acquire(blocking=False)
        took: list[bool] = []
        t = threading.Thread(target=lambda: took.append(m.lock.acquire(blocking=False)))
        t.start()
        t.join()
        assert took == [False]
    assert m.lock.acquire(blocking=False)
    m.lock.release()


def test_shutdown_is_idempotent_and_ends_the_manager(s: Setup) -> None:
    """shutdown (called without the lock) may be called again; the manager
    refuses work after it."""
    m = s.m
    offer(s, [K(1)])
    m.shutdown()
    m.shutdown()
    with pytest.raises(kvtier.ClosedError):
        m.lookup(K(1))
    with pytest.raises(kvtier.ClosedError):
        m.prepare_store([K(2)])
    with pytest.raises(kvtier.ClosedError):
        m.on_schedule_end()
