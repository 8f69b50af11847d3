"""kvtier's manager under vLLM's own KV-event tracker (issue 49 item 1):
failed writes a lookup saw leave nothing behind in the tracker, and a store
retried after a failure keeps the payload vLLM snapshotted for it. Free of
pytest, so that the engine's Python (vLLM 0.32, no pytest there) runs it
too: ``python tests/integration/vllm_events_case.py`` prints ``ok``.

What runs is vLLM's: its connector scheduler's own prefix lookup
(``_maximal_prefix_lookup``, which records what a lookup saw in the tracker)
and event drain (``take_events``, manager events through
``OffloadingEventsTracker`` to published ``BlockStored``/``BlockRemoved``),
on a scheduler built without its constructor (both only read ``manager`` and
``_events_tracker``), over kvtier's shim (:class:`KVTierManager`). The store
path's tracker call (``record_store``, made per stored key by the
scheduler's ``_build_store_jobs``) is made here as the scheduler makes it.
The request is a stand-in with the three fields the tracker reads.

Where vLLM 0.33 and 0.32 differ: 0.33's ``OffloadingEvent`` has
``metadata_only`` and its tracker snapshots a HIT_PENDING lookup too; 0.32
has neither (a removal is always published, a pending lookup records
nothing), so kvtier's shim gives 0.32 no event for a failed write.

Who calls: tests/integration/test_vllm_events_contract.py, in-process
(vLLM 0.33) and as a child process of the engine's Python (0.32).
Nothing blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from kvtier.integrations.vllm.scheduler import KVTierManager
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import HostTier, MemoryTier
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

#: vLLM 0.33 (not 0.32) announces a failed write as a metadata-only removal.
METADATA_ONLY = "metadata_only" in getattr(OffloadingEvent, "__dataclass_fields__", {})

BLOCK = 16  # tokens per block, one block per chunk
SLOT = 4096
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
GROUP = GroupOffloadConfig(
    group_idx=0,
    tokens_per_block=BLOCK,
    tokens_per_chunk=BLOCK,
    hashes_per_chunk=1,
    kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
    sliding_window_size_in_chunks=None,
    kv_cache_spec=FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    ),
    manager_cls=FullAttentionManager,
)


class Request:
    """What the tracker reads of vLLM's Request: block hashes (a chain),
    every token id, the LoRA request."""

    def __init__(self, req_id: str, prompt: str, blocks: int) -> None:
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:2], "big")
        self.all_token_ids = [(seed + t) % 50_000 for t in range(blocks * BLOCK)]
        self.block_hashes: list[bytes] = []
        parent = b""
        for b in range(blocks):
            tokens = self.all_token_ids[b * BLOCK : (b + 1) * BLOCK]
            parent = hashlib.sha256(parent + repr(tokens).encode()).digest()
            self.block_hashes.append(parent)
        self.blocks = blocks
        self.lora_request = None
        self.ctx = ReqContext(req_id=req_id)
        self.keys = [make_offload_key(h, 0) for h in self.block_hashes]
        # The hashes as vLLM publishes them (ints by default).
        self.published = [maybe_convert_block_hash(BlockHash(h)) for h in self.block_hashes]

    def tokens(self, chunk: int) -> list[int]:
        return self.all_token_ids[chunk * BLOCK : (chunk + 1) * BLOCK]


class Engine:
    """vLLM's connector scheduler (lookups, store bookkeeping, event drain)
    over kvtier's manager: a host tier of ``slots`` over a memory tier."""

    def __init__(self, slots: int = 8) -> None:
        self.pool = HostPool(slots, SLOT)
        self.lower = MemoryTier()
        self.m = TieredOffloadingManager(HostTier(self.pool), [self.lower])
        self.manager = KVTierManager(self.m)
        sched: Any = OffloadingConnectorScheduler.__new__(OffloadingConnectorScheduler)
        sched.manager = self.manager
        sched._events_tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, True))
        self.sched = sched
        self.tracker: Any = sched._events_tracker

    def close(self) -> None:
        self.manager.shutdown()
        self.pool.close()

    def lookup(self, req: Request) -> int | None:
        """The request's prefix scan: hit chunks, or None when deferred (a
        HIT_PENDING or RETRY)."""
        with self.manager.lock:
            hits: int | None = self.sched._maximal_prefix_lookup(req.keys, req.ctx, req, GROUP, 0)
            return hits

    def store(self, req: Request, chunks: Iterable[int]) -> list[OffloadKey]:
        """Offer the request's ``chunks``; snapshot each stored one as
        vLLM's ``_build_store_jobs`` does. The keys to store."""
        keys = [req.keys[c] for c in chunks]
        with self.manager.lock:
            out = self.manager.prepare_store(keys, req.ctx)
            assert out is not None
            for k in out.keys_to_store:
                self.tracker.record_store(req, GROUP, req.keys.index(k), k)
            return out.keys_to_store

    def complete_store(self, req: Request, keys: list[OffloadKey], success: bool) -> None:
        with self.manager.lock:
            self.manager.complete_store(keys, req.ctx, success)

    def step_end(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(END)

    def events(self) -> list[Any]:
        """What vLLM publishes now (takes the manager's lock itself in 0.33)."""
        return list(self.sched.take_events())

    def pending(self, req: Request) -> set[bytes]:
        """Keys of ``req`` the tracker keeps a payload for."""
        return set(self.tracker._pending_event_metadata) & set(req.keys)


def published(events: list[Any]) -> list[tuple[str, str | None, list[Any]]]:
    """(type, medium, hashes) of each published event."""
    return [(type(e).__name__, e.medium, list(e.block_hashes)) for e in events]


def check_failed_store() -> None:
    """A store another request's lookup saw pending fails: nothing is
    published (the blocks were never announced), and in 0.33 the tracker
    forgets them; a scan then misses."""
    e = Engine()
    try:
        a, b = Request("a", "p", 3), Request("b", "p", 3)
        keys = e.store(a, range(3))
        assert keys == a.keys
        assert e.lookup(b) is None  # HIT_PENDING: deferred
        assert e.pending(a) == set(keys)
        e.complete_store(a, keys, success=False)
        assert e.events() == []
        # 0.32's tracker keeps what its own record_store snapshotted: it has
        # no way to forget a key but a published removal (events.py), which
        # would announce blocks that were never stored.
        assert e.pending(a) == (set() if METADATA_ONLY else set(keys))
        assert e.lookup(b) == 0
        assert e.m.stats.store_failures == 3
    finally:
        e.close()


def check_retried_store() -> None:
    """A store fails, and the request's retry re-allocates the key before
    vLLM drains the events: the failed write's removal is not applied to
    the retry's payload, so the retry is published in full and its later
    eviction names its hashes."""
    e = Engine()
    try:
        a, b = Request("a", "p", 2), Request("b", "p", 2)
        keys = e.store(a, range(2))
        assert e.lookup(b) is None
        e.complete_store(a, keys, success=False)
        assert e.store(a, range(2)) == keys  # the retry, before the drain
        assert e.events() == []
        assert e.pending(a) == set(keys)
        e.complete_store(a, keys, success=True)
        stored = e.events()
        assert published(stored) == [("BlockStored", "CPU", [h]) for h in a.published]
        assert [ev.token_ids for ev in stored] == [a.tokens(0), a.tokens(1)]  # not placeholders
        assert e.pending(a) == set(keys)
        with e.manager.lock:
            e.manager.reset_cache()
        got = e.events()
        assert published(got) == [("BlockRemoved", "CPU", a.published)], published(got)
        assert e.pending(a) == set()
    finally:
        e.close()


def check_stored_payload(req: Request, events: list[Any], chunks: list[int]) -> None:
    """``events`` are one full BlockStored per chunk of ``chunks`` (0.33,
    whose tracker snapshotted the pending lookups) or placeholders (0.32)."""
    assert all(isinstance(ev, BlockStored) for ev in events), published(events)
    got = {ev.block_hashes[0]: ev for ev in events}
    assert sorted(got) == sorted(req.published[c] for c in chunks)
    for c in chunks:
        ev = got[req.published[c]]
        assert ev.token_ids == (req.tokens(c) if METADATA_ONLY else [])


def _below(e: Engine, req: Request, chunks: list[int]) -> Request:
    """Store ``chunks`` of ``req`` in the host tier, copy them to the
    memory tier, then evict them from the host tier by storing a filler
    request's blocks (returned): they are held below only, every change
    published."""
    keys = e.store(req, chunks)
    e.complete_store(req, keys, success=True)
    e.step_end()  # the cascade to the memory tier
    filler = Request("f", "filler", e.pool.num_slots)
    e.complete_store(filler, e.store(filler, range(filler.blocks)), success=True)
    e.step_end()  # its cascade too: evictable again
    e.events()
    assert all(k not in e.m.host.entries and k in e.lower.data for k in keys)
    return filler


def _promote(e: Engine, req: Request, filler: Request, promotions: int) -> None:
    """Look ``req`` up: deferred, its promotions evicting as many filler
    blocks, whose removals are what vLLM publishes."""
    assert e.lookup(req) is None
    got = e.events()
    assert all(isinstance(ev, BlockRemoved) and ev.medium == "CPU" for ev in got), published(got)
    gone = [h for ev in got for h in ev.block_hashes]
    assert len(gone) == promotions and set(gone) <= set(filler.published), published(got)


def check_failed_promotion() -> None:
    """Three blocks held below only are looked up (HIT_PENDING: promotions
    start); the read of the second fails. The host tier publishes the two
    it promoted and nothing for the third, which the tracker forgets; the
    memory tier publishes the removal of the record it dropped."""
    e = Engine()
    try:
        a, b = Request("a", "p", 3), Request("b", "p", 3)
        filler = _below(e, a, [0, 1, 2])
        e.lower.fail_loads.add(a.keys[1])
        _promote(e, b, filler, 3)
        e.step_end()  # promotions end: 0 and 2 read, 1 failed
        events = e.events()
        host = [ev for ev in events if ev.medium == "CPU"]
        below = [ev for ev in events if ev.medium != "CPU"]
        check_stored_payload(b, host, [0, 2])
        assert [(type(ev).__name__, ev.ownership) for ev in below] == [("BlockRemoved", "memory")]
        assert e.pending(a) == ({a.keys[0], a.keys[2]} if METADATA_ONLY else set())
        assert e.lookup(b) == 1  # the scan stops at the block that failed
        assert e.m.stats.promotion_failures == 1
    finally:
        e.close()


def check_retried_promotion() -> None:
    """A promotion fails, and a lookup in the same step promotes the key
    again before vLLM drains the events (its tier holds it again): the
    retry's snapshot survives and the promoted block is published in full."""
    e = Engine()
    try:
        a, b = Request("a", "p", 1), Request("b", "p", 1)
        filler = _below(e, a, [0])
        saved = e.lower.data[a.keys[0]]
        e.lower.fail_loads.add(a.keys[0])
        _promote(e, b, filler, 1)
        e.step_end()  # the read fails; the tier drops its record
        e.lower.fail_loads.clear()
        e.lower.data[a.keys[0]] = saved  # written there again (another engine)
        assert e.lookup(b) is None  # promoted anew (into the freed slot), before the drain
        assert [ev for ev in e.events() if ev.medium == "CPU"] == []
        e.step_end()
        host = [ev for ev in e.events() if ev.medium == "CPU"]
        check_stored_payload(b, host, [0])
        assert e.pending(a) == ({a.keys[0]} if METADATA_ONLY else set())
        assert e.lookup(b) == 1
    finally:
        e.close()


def check_shim_events() -> None:
    """The shim's own events for a failed store: vLLM 0.33's metadata-only
    removal of the host tier (CPU, no ownership: the tracker's primary
    residency), exactly; under 0.32 none."""
    e = Engine()
    try:
        a = Request("a", "p", 2)
        keys = e.store(a, range(2))
        e.complete_store(a, keys, success=False)
        with e.manager.lock:
            got = list(e.manager.take_events())
        if not METADATA_ONLY:
            assert got == [], got  # 0.32: a removal would be public
            return
        md: Any = {"metadata_only": True}  # a field 0.32's OffloadingEvent lacks
        assert got == [OffloadingEvent(keys=keys, medium=Medium.CPU, removed=True, **md)], got
    finally:
        e.close()


CHECKS = [
    check_shim_events,
    check_failed_store,
    check_retried_store,
    check_failed_promotion,
    check_retried_promotion,
]


if __name__ == "__main__":
    for check in CHECKS:
        check()
    print("metadata_only" if METADATA_ONLY else "no metadata_only", "ok")
