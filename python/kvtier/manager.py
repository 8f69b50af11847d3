"""TieredOffloadingManager: the policy brain, with vLLM 0.33's
``OffloadingManager`` semantics and no vLLM import.

Who calls: the engine's scheduler, one thread, holding :attr:`lock` for the
whole scheduling step (vLLM does; the manager never takes it itself). No call
blocks: lower-tier I/O is batched per step and submitted in
:meth:`on_schedule_end`, which also drains every tier's completions.

Reference counts of host blocks: -1 while written (GPU store or promotion in
flight), 0 ready and evictable, > 0 pinned by loads. A host block also stays
held while lower tiers copy it (write-through cascade).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import ClosedError, InvalidArgument
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent
from kvtier.tiers.host import HostTier

__all__ = [
    "HostSpec",
    "LookupResult",
    "OffloadEvent",
    "PrepareStoreResult",
    "TieredOffloadingManager",
]


@dataclass
class HostSpec:
    """Host pool slots, co-indexed with the keys of the call that made it."""

    slots: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class PrepareStoreResult:
    keys_to_store: list[bytes]
    store_spec: HostSpec
    evicted_keys: list[bytes]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.keys_to_store, self.store_spec, self.evicted_keys))


OffloadEvent = TierEvent


@dataclass
class _Stats:
    lookups: dict[str, int] = field(
        default_factory=lambda: {"hit": 0, "hit_pending": 0, "retry": 0, "miss": 0}
    )
    promotions: int = 0
    promotion_failures: int = 0
    cascades: int = 0
    cascades_dropped: int = 0
    cascade_failures: int = 0
    held_slots: int = 0  # host slots kept from reuse after a device timeout
    stores: int = 0
    store_failures: int = 0
    loads: int = 0
    not_admitted: int = 0
    allocation_failures: int = 0
    # Blocks handed to the engine by prepare_load, by the tier they came from.
    loaded_from: dict[str, int] = field(default_factory=dict)


def _check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    for k in out:
        if not isinstance(k, (bytes, bytearray)):
            raise InvalidArgument(f"keys must be bytes, got {type(k).__name__}")
    return out


class TieredOffloadingManager:
    """Host tier plus an ordered list of lower tiers (e.g. disk, then remote)."""

    def __init__(self, host: HostTier, lower: Sequence[LowerTier] = ()) -> None:
        self.host = host
        self.lower = list(lower)
        names = [host.name] + [t.name for t in self.lower]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must be unique, got {names}")
        for t in self.lower:
            t.attach(host.pool)
        self._lock = threading.Lock()
        self._events: list[TierEvent] = []
        self._cascade: list[list[bytes]] = [[] for _ in self.lower]
        self._promote: list[list[bytes]] = [[] for _ in self.lower]
        self._inflight: dict[tuple[int, int], tuple[str, list[bytes], list[int]]] = {}
        self._stale: set[int] = set()  # slots freed by reset, still under a GPU job
        # Keys some lookup reported HIT or HIT_PENDING since the last step end:
        # a promotion must not evict them, or a prefix longer than the host
        # tier would evict its own head while its tail is promoted (and the
        # engine would never see the whole prefix readable). They become
        # pinned by prepare_load, or are looked up again next step.
        self._scanned: set[bytes] = set()
        self._polled = False  # tiers polled by a lookup since the last step end
        self._closed = False
        self.stats = _Stats()

    # -- vLLM interface --------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        """A real, non-reentrant lock: the caller holds it around every call but shutdown."""
        return self._lock

    def lookup(self, key: bytes, req_context: Any = None) -> LookupResult:
        """State of one key; on a host miss found in a lower tier, starts a
        promotion (HIT_PENDING now, HIT after a later step end)."""
        self._check_open()
        r = self._lookup(key)
        self.stats.lookups[r.name.lower()] += 1
        if r is LookupResult.HIT or r is LookupResult.HIT_PENDING:
            self._scanned.add(key)
        return r

    def _lookup(self, key: bytes) -> LookupResult:
        e = self.host.get(key)
        if e is not None and e.ref < 0 and e.source != "host" and not self._polled:
            # A promotion in flight: its tier may have finished since the last
            # step end. Polling here (once a step) lets the engine load it this
            # step instead of the next (measured: one scheduler step, 2-5 ms
            # of a 30-50 ms time to first token on the CPU engine).
            self._polled = True
            self._poll_tiers()
            e = self.host.get(key)  # dropped if the promotion failed
        if e is not None:
            return LookupResult.HIT if e.ref >= 0 else LookupResult.HIT_PENDING
        for i, tier in enumerate(self.lower):
            r = tier.lookup(key)
            if r is LookupResult.MISS:
                continue
            if r is not LookupResult.HIT:
                return r  # RETRY / HIT_PENDING: ask again next step
            got = self.host.allocate(1, protected=self._scanned)
            if got is None:  # the host tier is full of this step's hits: load those
                self.stats.allocation_failures += 1
                return LookupResult.MISS
            (slot,), evicted = got
            self._removed(evicted)
            self.host.add_writing(key, slot, source=tier.name)
            self._promote[i].append(key)
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def get_load_source(self, key: bytes, req_context: Any = None) -> str:
        """Tier the bytes of a HIT key came from ("host" once loaded from host)."""
        e = self.host.get(key)
        return e.source if e is not None else "host"

    def prepare_load(self, keys: Collection[bytes], req_context: Any = None) -> HostSpec:
        """Pin ``keys`` (all HIT this step) until :meth:`complete_load`; slots in key order."""
        self._check_open()
        keys = _check_keys(keys)
        slots = np.empty(len(keys), np.int64)
        for i, k in enumerate(keys):
            e = self.host.get(k)
            if e is None or e.ref < 0:
                raise InvalidArgument(f"prepare_load of a key that is not a HIT: {k.hex()[:16]}")
            slots[i] = e.slot
        loaded_from = self.stats.loaded_from
        for k in keys:
            source = self.host.pin(k)
            loaded_from[source] = loaded_from.get(source, 0) + 1
        self.stats.loads += len(keys)
        return HostSpec(slots)

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        """Unpin keys of a finished load."""
        for k in keys:
            self.host.unpin(k)

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        for k in keys:
            if k in self.host.entries:
                self.host.policy.touch(k)

    def prepare_store(
        self, keys: Collection[bytes], req_context: Any = None
    ) -> PrepareStoreResult | None:
        """Choose which offered keys to store and give them slots (order kept).

        Never evicts a key of the offer or a pinned / in-flight key. When not
        every new key fits, stores the first ones that do (a prefix is looked
        up in order, so its head is worth most); returns None, changing
        nothing, when none fits.
        """
        self._check_open()
        keys = _check_keys(keys)
        to_store: list[bytes] = []
        seen: set[bytes] = set()
        for k in keys:
            if k in seen:
                continue
            seen.add(k)
            if k in self.host.entries:
                self.host.policy.touch(k)
                continue
            if not self.host.admission.offer(k):
                self.stats.not_admitted += 1
                continue
            to_store.append(k)
        got = (
            self.host.allocate(len(to_store), protected=seen, partial=True)
            if to_store
            else ([], [])
        )
        if got is None:
            self.stats.allocation_failures += 1
            return None
        slots, evicted = got
        if len(slots) < len(to_store):
            self.stats.allocation_failures += 1
            to_store = to_store[: len(slots)]
        for k, s in zip(to_store, slots):
            self.host.add_writing(k, s)
        self._removed(evicted)
        return PrepareStoreResult(to_store, HostSpec(np.asarray(slots, np.int64)), evicted)

    def complete_store(
        self, keys: Collection[bytes], req_context: Any = None, success: bool = True
    ) -> None:
        """Stored blocks become readable (or are dropped on failure); starts the cascade."""
        stored = []
        for k in keys:
            e = self.host.get(k)
            if e is None or e.ref != -1 or e.source != "host":
                continue  # not ours to complete (reset, or a promotion)
            if not success:
                self.host.drop(k)
                self.stats.store_failures += 1
                continue
            self.host.mark_ready(k)
            stored.append(k)
            for i, tier in enumerate(self.lower):
                if tier.lookup(k) is LookupResult.HIT or not tier.admit(k):
                    continue
                self.host.begin_cascade(k)
                self._cascade[i].append(k)
        self.stats.stores += len(stored)
        if stored:
            self._events.append(TierEvent(stored, self.host.name, removed=False))

    def on_new_request(self, req_context: Any = None) -> None:
        return None

    def on_request_finished(self, req_context: Any = None) -> None:
        return None

    def on_schedule_end(self, context: Any = None) -> None:
        """Drain tier completions, then submit this step's batched cascades and promotions."""
        self._check_open()
        self._scanned.clear()
        self._polled = False
        self._poll_tiers()
        self._flush()
        self._poll_tiers()

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events of every tier, oldest first."""
        ev, self._events = self._events, []
        for t in self.lower:
            ev.extend(t.take_events())
        return ev

    def occupancy(self) -> dict[str, int]:
        """Host blocks by state and tier jobs in flight: what a drained engine
        must have given back (pinned, writing, held and stale at 0, no job).
        Non-blocking; under the lock like every other call."""
        entries = self.host.entries.values()
        return {
            "blocks": len(self.host),
            "pinned": sum(1 for e in entries if e.ref > 0),
            "writing": sum(1 for e in entries if e.ref < 0),
            "cascading": sum(1 for e in entries if e.cascading),
            "held": self.host.held_slots,
            "stale": len(self._stale),
            "tier_jobs": len(self._inflight),
        }

    def has_pending_work(self) -> bool:
        return bool(
            self._inflight
            or any(self._cascade)
            or any(self._promote)
            or any(t.has_pending_work() for t in self.lower)
        )

    def reset_cache(self) -> None:
        """Evict every host block. Blocks under a GPU job become stale (their
        slots are freed by :meth:`on_reset_flushed`); blocks under a tier job
        are freed when it completes. Lower tiers keep their data."""
        removed = []
        tier_slots = {slot for _, _, slots in self._inflight.values() for slot in slots}
        for key in list(self.host.entries):
            e = self.host.entries[key]
            self.host.detach(key)
            removed.append(key)
            if e.slot in tier_slots:
                continue  # freed when the tier job completes (see _complete)
            if e.ref != 0:
                self._stale.add(e.slot)  # a GPU job may still be using it
            else:
                self.host.release_slot(e.slot)
        self._cascade = [[] for _ in self.lower]
        self._scanned.clear()
        for batch in self._promote:
            batch.clear()
        self._removed(removed)

    def on_reset_flushed(self) -> None:
        """Every GPU job in flight at the last reset has finished: free their slots."""
        for s in self._stale:
            self.host.release_slot(s)
        self._stale.clear()

    def shutdown(self) -> None:
        """Drain what is in flight, then close the lower tiers. Idempotent; no lock needed."""
        if self._closed:
            return
        self._closed = True
        for t in self.lower:
            t.close()

    def __enter__(self) -> TieredOffloadingManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ---------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("manager is shut down")

    def _removed(self, keys: list[bytes]) -> None:
        if keys:
            self._events.append(TierEvent(list(keys), self.host.name, removed=True))

    def _flush(self) -> None:
        for i, tier in enumerate(self.lower):
            batch, self._cascade[i] = self._cascade[i], []
            live = [(k, self.host.entries[k]) for k in batch if k in self.host.entries]
            if live:
                keys = [k for k, _ in live]
                slots = [e.slot for _, e in live]
                token = tier.submit_store(keys, slots)
                if token is None:  # backpressure: drop this cascade, unhold the blocks
                    self.stats.cascades_dropped += len(keys)
                    for k in keys:
                        self.host.end_cascade(k)
                else:
                    self._inflight[(i, token)] = ("store", keys, slots)
                    self.stats.cascades += len(keys)
            pbatch = self._promote[i]
            live_p = [k for k in pbatch if k in self.host.entries]
            if live_p:
                slots = [self.host.entries[k].slot for k in live_p]
                token = tier.submit_load(live_p, slots)
                if token is None:
                    continue  # busy: keep the batch for the next step
                self._inflight[(i, token)] = ("load", live_p, slots)
            self._promote[i] = []

    def _poll_tiers(self) -> None:
        for i, tier in enumerate(self.lower):
            for c in tier.poll():
                self._complete(i, c)
            for slot in tier.take_released_slots():
                self.host.unhold(slot)

    def _complete(self, tier_index: int, c: TierCompletion) -> None:
        kind, keys, slots = self._inflight.pop((tier_index, c.token), (c.kind, c.keys, []))
        oks = c.key_ok if c.key_ok is not None else [c.ok] * len(keys)
        held = c.held or [False] * len(keys)
        for idx, (k, ok) in enumerate(zip(keys, oks)):
            slot = slots[idx] if idx < len(slots) else None
            if held[idx] and slot is not None:
                self.host.hold(slot)  # before anything below may free it
                self.stats.held_slots += 1
            e = self.host.get(k)
            mine = e is not None and slot is not None and e.slot == slot
            if kind == "store":
                if not ok:
                    self.stats.cascade_failures += 1
                if mine:
                    self.host.end_cascade(k)
                elif slot is not None and not self._slot_in_use(slot):
                    self.host.release_slot(slot)  # detached by reset: free it now
            else:
                if mine and ok:
                    assert e is not None
                    self.host.mark_ready(k)
                    self.stats.promotions += 1
                    self._events.append(TierEvent([k], self.host.name, removed=False))
                elif mine:
                    self.host.drop(k)
                    self.stats.promotion_failures += 1
                elif slot is not None and not self._slot_in_use(slot):
                    self.host.release_slot(slot)

    def _slot_in_use(self, slot: int) -> bool:
        return any(slot in s for _, _, s in self._inflight.values()) or any(
            e.slot == slot for e in self.host.entries.values()
        )
