"""TieredOffloadingManager: the offloading-manager facade, with vLLM 0.33's
``OffloadingManager`` semantics and no vLLM import.

Process: the engine's scheduler. Who calls: its scheduling thread, holding
:attr:`TieredOffloadingManager.lock` for the whole scheduling step (vLLM
does; the manager never takes it itself). No call blocks, but ``lookup``
with ``scan_wait_s`` > 0 (bounded per step in time and bytes: see
:mod:`kvtier.scheduler.readahead`): lower-tier I/O is batched per step and
submitted in ``on_schedule_end``, which also drains every tier's completions.

Reference counts of host blocks: -1 while written (GPU store or promotion in
flight), 0 ready and evictable, > 0 pinned by loads. A host block also stays
held while lower tiers copy it (write-through cascade). The work behind the
interface lives in rooms: :mod:`.slots`, :mod:`.movement`,
:mod:`.readahead`, :mod:`.fences`, :mod:`.streams`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np

from kvtier.errors import ClosedError, InvalidArgument
from kvtier.scheduler.chains import offer_parents
from kvtier.scheduler.core import Core
from kvtier.scheduler.fences import Fills
from kvtier.scheduler.movement import Movement
from kvtier.scheduler.options import ManagerOptions
from kvtier.scheduler.readahead import ReadAhead
from kvtier.scheduler.specs import HostSpec, PrepareStoreResult
from kvtier.scheduler.stats import ManagerStats
from kvtier.scheduler.streams import Streams
from kvtier.tiers.base import LookupResult, LowerTier, TierEvent
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_entry import Fill


def _req_id(req_context: Any) -> Any:
    """The request a call is for (vLLM's ReqContext.req_id; None without one)."""
    return getattr(req_context, "req_id", None)


def _group(key: bytes) -> bytes:
    """A key's chain among a request's: vLLM's OffloadKey ends in its group's
    4-byte index (keys of 12 bytes or more); shorter keys form one chain."""
    return key[-4:] if len(key) >= 12 else b""


# Keys whose scan predecessor is remembered for their store: one a request
# (its first new block), so a few engine batches' worth. A hint whose store
# never comes (an aborted request, a scan that went on past pending keys)
# stays until pushed out: the bound is the memory it can hold (about 0.6 MB).
_MISS_HINTS = 4096
# The stats' name of each answer by the member's id: an enum member's
# ``name`` is a descriptor call and its hash a Python method (callgrind: each
# about 1% of a lookup + store + load cycle).
_ANSWER_NAMES = {id(r): r.name.lower() for r in LookupResult}
# Enum members as module globals for the per-key calls: a member's lookup on
# its class is a Python-level descriptor call in 3.11 (0.12 us, against
# 0.02 us for a global), several times per key.
_HIT, _PENDING, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
_FILL_FAILED = Fill.FAILED


def _check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    for k in out:
        if k.__class__ is not bytes and not isinstance(k, (bytes, bytearray)):
            raise InvalidArgument(f"keys must be bytes, got {type(k).__name__}")
    return out


class TieredOffloadingManager:
    """Host tier plus an ordered list of lower tiers (e.g. disk, then remote).

    ``options`` (:class:`~kvtier.scheduler.options.ManagerOptions`) say how
    blocks move; its fields may also be given as keywords
    (``TieredOffloadingManager(host, lower, scan_wait_s=0.02)``).
    """

    def __init__(
        self,
        host: HostTier,
        lower: Sequence[LowerTier] = (),
        options: ManagerOptions | None = None,
        **option_fields: Any,
    ) -> None:
        try:
            opts = dataclasses.replace(options or ManagerOptions(), **option_fields)
        except TypeError as e:
            raise InvalidArgument(f"unknown manager option: {e}") from None
        names = [host.name] + [t.name for t in lower]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must be unique, got {names}")
        for t in lower:
            t.attach(host.pool)
        self._core = core = Core(host, list(lower), opts)
        self._fills = Fills(core)
        self._movement = Movement(core, self._fills)
        self.read_ahead = ReadAhead(core, self._movement, self._fills)
        self._streams = Streams(core)
        self._lock = threading.Lock()
        self._polled = False  # tiers polled by a lookup since the last step end
        # Prefix chains, for the host tier's prefix-aware eviction: the key a
        # scan looked up last (HIT or pending: the one before the next); the
        # predecessor of each key a scan stopped at (MISS: the first block
        # the request will offer); each live request's last offered key per
        # group (the predecessor of its next offer's first), by request.
        self._scan_prev: bytes | None = None
        self._miss_prev: dict[bytes, bytes] = {}
        self._last_offer: dict[Any, dict[bytes, bytes]] = {}
        self._closed = False
        # The shared state again as plain attributes: the calls below run per
        # key, and a property costs a call each time (measured, kvtier bench
        # manager: 14% fewer cycles per second with properties here).
        self.host: HostTier = host
        self.lower: list[LowerTier] = core.lower
        self.stats: ManagerStats = core.stats
        # Read at each call: a change of a field takes effect from the next
        # call (the read-ahead budget from the next step end).
        self.options: ManagerOptions = opts

    # -- vLLM interface --------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        """A real, non-reentrant lock: the caller holds it around every call but shutdown."""
        return self._lock

    def lookup(self, key: bytes, req_context: Any = None) -> LookupResult:
        """State of one key; on a host miss found in a lower tier, starts a
        promotion (HIT_PENDING now, HIT after a later step end).

        The engine calls it key by key in prefix order, stopping at the first
        MISS. Non-blocking, except with ``scan_wait_s`` > 0: the first lookup
        of a request that misses the host tier may wait for its reads (at
        most what is left of this step's ``scan_wait_s``) and answer HIT."""
        if self._closed:
            raise ClosedError("manager is shut down")
        if self.options.scan_wait_s > 0 and self.read_ahead.wanted(key):
            self.read_ahead.read(key, req_context)
        # The common answers inline (a resident block; a miss with no lower
        # tier to ask), without _lookup's call and the host tier's get.
        a = self.host.answer(key)
        if a == 1 or a == 4:
            r = _HIT
        elif a == 3 or (a == 0 and not self.lower):
            r = _MISS
        else:
            r = self._lookup(key)
        self.stats.lookups[_ANSWER_NAMES[id(r)]] += 1
        if r is _HIT or r is _PENDING:
            self._core.scanned.add(key)
            self._scan_prev = key
        elif self._scan_prev is not None:  # the scan ends here
            prev, self._scan_prev = self._scan_prev, None
            if r is _MISS and _group(prev) == _group(key):
                if len(self._miss_prev) >= _MISS_HINTS:
                    del self._miss_prev[next(iter(self._miss_prev))]
                self._miss_prev[key] = prev
        return r

    def may_fail_to_load(self, key: bytes) -> bool:
        """Whether a load of ``key``, a HIT now, can still fail: its bytes are
        not in a ready host slot yet (a fenced fill under way) or the engine's
        worker reads them from a lower tier itself (a stream). Who calls: the
        vLLM shim, right after the lookup (its synchronous loads must be ones
        that cannot fail). Non-blocking."""
        a = self.host.answer(key)
        if a == 0:
            return self._streams.tier_of(key) is not None
        return a >= 3

    def _scan_parent(self, key: bytes) -> bytes | None:
        """The key a scan looked up just before ``key``, of its chain."""
        p = self._scan_prev
        return p if p is not None and _group(p) == _group(key) else None

    def _lookup(self, key: bytes) -> LookupResult:
        core = self._core
        e = core.host.get(key)
        if e is not None and e.ref < 0 and e.source != "host" and not self._polled:
            # A promotion in flight: its tier may have finished since the last
            # step end. Polling here (once a step) lets the engine load it this
            # step instead of the next (measured: one scheduler step, 2-5 ms
            # of a 30-50 ms time to first token on the CPU engine).
            self._polled = True
            self._movement.poll()
            e = core.host.get(key)  # dropped if the promotion failed
        if e is not None:
            if e.ref < 0:
                return _PENDING
            return _MISS if e.fill is _FILL_FAILED else _HIT
        for i, tier in enumerate(core.lower):
            r = tier.lookup(key)
            if r is _MISS:
                continue
            if r is not _HIT:
                return r  # RETRY / HIT_PENDING: ask again next step
            streamable = core.worker_reads(tier)
            if streamable and not core.options.promote:
                self._streams.hit(key, i)
                return _HIT
            got = core.host.allocate(1, protected=core.scanned)
            if got is None and streamable:
                self._streams.hit(key, i)  # the worker reads it from the tier itself
                return _HIT
            if got is None:  # the host tier is full of this step's hits: load those
                core.stats.allocation_failures += 1
                return _MISS
            (slot,), evicted = got
            core.removed(evicted)
            core.host.add_writing(key, slot, source=tier.name, parent=self._scan_parent(key))
            self._movement.promote(i, [key])
            return _PENDING
        return _MISS

    def get_load_source(self, key: bytes, req_context: Any = None) -> str:
        """Tier the bytes of a HIT key came from ("host" once loaded from host)."""
        e = self.host.get(key)
        t = self._streams.tier_of(key) if e is None else None
        if t is not None:
            return self.lower[t].name
        return e.source if e is not None else "host"

    def prepare_load(self, keys: Collection[bytes], req_context: Any = None) -> HostSpec:
        """Pin ``keys`` (all HIT this step) until :meth:`complete_load`; slots
        in key order, -1 with a :class:`StreamSpec` for streamed keys."""
        self._check_open()
        keys = _check_keys(keys)
        slots = self.host.load_slots(keys)
        streamed: dict[int, list[int]] = {}  # tier -> positions in keys
        if -1 in slots:
            for i, (k, s) in enumerate(zip(keys, slots)):
                if s >= 0:
                    continue
                t = self._streams.tier_of(k)
                if t is None:
                    raise InvalidArgument(
                        f"prepare_load of a key that is not a HIT: {k.hex()[:16]}"
                    )
                streamed.setdefault(t, []).append(i)  # (a store of it may have begun since)
        # Checked first, pinned after: a refused call changes nothing.
        loaded_from = self.stats.loaded_from
        on_hit = self.options.cascade_on_hit and self.lower
        host_keys = [k for k, s in zip(keys, slots) if s >= 0] if streamed else keys
        sources = self.host.pin_many(host_keys)
        if on_hit:
            for k, source in zip(host_keys, sources):
                if source == "host":  # a reuse: now worth writing below
                    self._movement.cascade(k)
        n = sources.count("host")  # the common source, counted in C
        if n:
            loaded_from["host"] = loaded_from.get("host", 0) + n
        if n != len(sources):
            for source in sources:
                if source != "host":
                    loaded_from[source] = loaded_from.get(source, 0) + 1
        if streamed:
            lower, hits = self.lower, self._streams.hits
            for k, slot in zip(keys, slots):
                if slot < 0:
                    source = lower[hits[k]].name
                    loaded_from[source] = loaded_from.get(source, 0) + 1
        self.stats.loads += len(keys)
        fences = self._fills.fences(keys, slots) if self._fills.count else None
        stream = self._streams.pin(keys, streamed, _req_id(req_context)) if streamed else None
        return HostSpec(np.asarray(slots, np.int64), stream, fences)

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        """Unpin keys of a finished load (host slots, or streamed records)."""
        if self._fills.count:
            self._fills.before_unpins(keys)
        if not self._streams.pins:  # the common case: one call
            self.host.unpin_many(keys)
            return
        req = _req_id(req_context)
        for k in keys:
            if not self._streams.unpin(k, req):
                self.host.unpin(k)

    def load_failed(self, spec: HostSpec) -> None:
        """The engine's worker reported that the load of ``spec`` (a
        :meth:`prepare_load` result, its load completed) failed: the lower-
        tier records it read itself are forgotten there and its host blocks
        no longer loaded by anyone are dropped, so the next lookup of those
        keys misses rather than loading the same bytes again.

        Who calls: the vLLM shim's connector, after ``complete_load`` of the
        same load. Non-blocking."""
        self.stats.load_failures += len(spec.slots)
        dead = []
        for s in spec.slots.tolist():
            k = self.host.owner(s) if s >= 0 else None
            if k is not None and self.host.entries[k].evictable:
                self.host.drop(k)
                dead.append(k)
        self._core.removed(dead)
        if spec.stream is not None:
            self._streams.load_failed(spec.stream)

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        self.host.touch_many(keys)

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
        host = self.host
        to_store, seen, refused = host.offered(keys)
        self.stats.not_admitted += refused
        if not to_store:
            got: tuple[list[int], list[bytes]] | None = ([], [])
        elif self.options.partial_stores == "prefix":
            got = host.allocate(len(to_store), protected=seen, partial=True)
        else:
            got = self._allocate(len(to_store), seen)
        slots, evicted = got if got is not None else ([], [])
        parents = self._offer_parents(keys, to_store, req_context)
        if len(slots) == len(to_store):  # all fit (the common case: no copies of lists)
            host.add_writing_many(to_store, slots, parents)
            self._core.removed(evicted)
            return PrepareStoreResult(to_store, HostSpec(np.asarray(slots, np.int64)), evicted)
        host_keys, rest = to_store[: len(slots)], to_store[len(slots) :]
        streamed, stream = (
            self._streams.reserve_writes(rest, len(host_keys))
            if self.options.streaming_stores
            else ([], None)
        )
        if len(host_keys) + len(streamed) < len(to_store):
            self.stats.allocation_failures += 1
        if got is None and not streamed:
            return None
        host.add_writing_many(host_keys, slots, parents)
        self._core.removed(evicted)
        all_slots = np.asarray(list(slots) + [-1] * len(streamed), np.int64)
        return PrepareStoreResult(host_keys + streamed, HostSpec(all_slots, stream), evicted)

    def adopt_store(
        self, keys: list[bytes], slots: list[int], reqs: list[Any], counts: list[int]
    ) -> tuple[list[bytes], list[int], list[int]]:
        """:meth:`prepare_store` of offers given slots already (the node's
        reservation for their engine, written without waiting), request
        ``reqs[i]``'s the next ``counts[i]`` keys (its id, as
        :meth:`on_requests_finished` takes it; None: no request): the keys
        stored, their slots, and the other slots (held already, refused or
        offered twice), for the caller to free when their writes end. Node
        only; non-blocking."""
        self._check_open()
        to_store, _, refused = self.host.offered(keys)
        self.stats.not_admitted += refused
        parts, i, last, miss = [], 0, self._last_offer, self._miss_prev
        for req, n in zip(reqs, counts):  # each offer's chain, as prepare_store's
            ks = keys if n == len(keys) else keys[i : i + n]
            if req is not None:
                parts.append((offer_parents(ks, last.setdefault(req, {}), miss), n))
            else:  # one key and no hints: no chain to learn
                parts.append((offer_parents(ks, None, miss) if n > 1 or miss else None, n))
            i += n
        parents = None  # or one list: [None] * n where an offer has no chain
        if any(p is not None for p, _ in parts):
            parents = [x for p, n in parts for x in (p if p is not None else [None] * n)]
        if len(to_store) == len(keys):  # every key new (the common case): no maps
            self.host.add_writing_many(to_store, slots, parents)
            return to_store, slots, []
        by_key: dict[bytes, tuple[int, bytes | None]] = {}
        for k, s, p in zip(keys, slots, parents or [None] * len(keys)):
            by_key.setdefault(k, (s, p))  # a key offered twice: its first slot
        used = [by_key[k][0] for k in to_store]
        taken = set(used)
        unused = [s for s in slots if s not in taken]
        ps = None if parents is None else [by_key[k][1] for k in to_store]
        self.host.add_writing_many(to_store, used, ps)
        return to_store, used, unused

    def _offer_parents(
        self, keys: list[bytes], to_store: list[bytes], req_context: Any
    ) -> list[bytes | None] | None:
        """Each key to store's parent in its chain, as :meth:`_parents`."""
        if req_context is None and len(keys) == 1 and not self._miss_prev:
            return None  # a plain caller's one-key offer: no chain to learn
        parents = self._parents(keys, _req_id(req_context))
        if parents is not None and len(to_store) != len(keys):  # some kept or refused
            by_key = dict(zip(keys, parents))
            parents = [by_key[k] for k in to_store]
        return parents

    def _allocate(self, n: int, offer: set[bytes]) -> tuple[list[int], list[bytes]] | None:
        """Slots for ``n`` new blocks of an offer under ``partial_stores``
        "free" or "none" (see :class:`ManagerOptions`; prepare_store calls
        the host tier itself for "prefix", the default)."""
        host, mode = self.host, self.options.partial_stores
        got = host.allocate(n, protected=offer)
        if got is not None or mode == "none":
            return got
        free = min(n, host.free_slots)  # "free": what fits without evicting
        return host.allocate(free) if free else None

    def _parents(self, offer: list[bytes], req: Any) -> list[bytes | None] | None:
        """:func:`~kvtier.scheduler.chains.offer_parents` of ``offer``, an
        offer of request ``req`` (None: no request, chained within itself)."""
        last = None if req is None else self._last_offer.setdefault(req, {})
        return offer_parents(offer, last, self._miss_prev)

    def complete_store(
        self, keys: Collection[bytes], req_context: Any = None, success: bool = True
    ) -> None:
        """Stored blocks become readable, announced stored, and their cascade
        to lower tiers starts; on failure they are dropped with a
        metadata-only removal (a lookup may have seen them HIT_PENDING).

        Who calls: the engine, once every worker finished the store job of
        ``keys`` (a :meth:`prepare_store` result). Non-blocking."""
        host, writes, lower = self.host, self._streams.writes, self.lower
        if writes:
            # A streamed write needs no event either way here: until it is
            # committed its tier answers MISS (disk) or RETRY (Redis), never
            # HIT_PENDING, and the tier itself announces it once readable.
            commit = self._streams.commit
            keys = [k for k in keys if not commit(k, success)]  # the rest: host writes
        # Only the host tier's writes in flight are ours to complete (not a
        # key reset since, nor a promotion): ready before their cascades,
        # which hold them from there.
        stored = host.complete_writes(keys, success)
        failed: list[bytes] = []
        if not success:
            stored, failed = failed, stored
            for k in failed:
                host.drop(k)
        elif lower:
            cascade = self._movement.cascade
            for k in stored:
                cascade(k)
        if failed:
            self.stats.store_failures += len(failed)
            self._core.unannounced(failed)
        self.stats.stores += len(stored)
        self._core.readable(stored)

    def on_new_request(self, req_context: Any = None) -> None:
        self._scan_prev = None  # its scan begins: not the last request's successor
        return None

    def on_requests_finished(self, req_ids: list[Any]) -> None:
        """:meth:`on_request_finished` of several requests, by id (the node's,
        a step end's finished requests at once)."""
        last = self._last_offer
        if last:
            for r in req_ids:
                last.pop(r, None)
        self._scan_prev = None

    def on_request_finished(self, req_context: Any = None) -> None:
        """No more offers from this request: forget its chain ends."""
        if self._last_offer:
            self._last_offer.pop(_req_id(req_context), None)
        self._scan_prev = None
        return None

    def on_schedule_end(self, context: Any = None) -> None:
        """Drain tier completions, then submit this step's batched cascades and promotions."""
        self._check_open()
        self._core.scanned.clear()
        self.read_ahead.new_step()
        self._streams.step_end()
        self._polled = False
        self._movement.poll()
        self._fills.step_end()
        if self._movement.flush():
            self._movement.poll()

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events of every tier, oldest first.

        A metadata-only removal (:attr:`TierEvent.metadata_only`) leaves out
        the keys that the host tier holds again by now (a retried store or a
        new promotion owns them: forgetting them would lose what the engine
        learned of the new write), and is left out when none is left, as
        vLLM's CPUOffloadingManager does. Who calls: the engine, once a step
        or more, under the lock. Non-blocking."""
        core = self._core
        ev, core.events = core.events, []
        if core.unannounced_events:  # rare: a write failed since the last call
            core.unannounced_events = 0
            entries = self.host.resident
            kept = []
            for e in ev:
                if e.metadata_only:
                    keys = [k for k in e.keys if k not in entries]
                    if not keys:
                        continue
                    if len(keys) < len(e.keys):
                        e = dataclasses.replace(e, keys=keys)
                kept.append(e)
            ev = kept
        for t in self.lower:
            ev.extend(t.take_events())
        return ev

    def occupancy(self) -> dict[str, int]:
        """Host blocks by state and tier jobs in flight: what a drained engine
        must have given back (pinned, writing, held and stale at 0, no job).
        Non-blocking; under the lock like every other call."""
        pinned, writing, cascading = self.host.census()
        return {
            "blocks": len(self.host),
            "pinned": pinned,
            "writing": writing,
            "cascading": cascading,
            "held": self.host.held_slots,
            "stale": len(self._core.slots.stale),
            "streaming": self._streams.in_flight(),
            "tier_jobs": len(self._core.slots),
        }

    def has_pending_work(self) -> bool:
        return self._movement.pending()

    def reset_cache(self) -> None:
        """Evict every host block. Blocks under a GPU job become stale (their
        slots are freed by :meth:`on_reset_flushed`); blocks under a tier job
        are freed when it completes. Lower tiers keep their data."""
        slots = self._core.slots
        keys = list(self.host.entries)
        # Only blocks the engine was told are stored: one still being written
        # (a GPU store, a promotion) or filled was never announced, and a
        # removal of it would make a router's count of this tier go wrong.
        removed: list[bytes] = []
        for key in keys:
            e = self.host.detach(key)
            assert e is not None
            if e.ref >= 0 and e.fill is Fill.NONE:
                removed.append(key)
            self._fills.forget(key, e)
            if slots.under_job(e.slot) and e.ref <= 0:
                continue  # freed when the tier job completes
            if e.ref != 0:
                slots.stale.add(e.slot)  # a GPU job may still be using it
            else:
                self.host.release_slot(e.slot)
        self._movement.reset()
        self._core.scanned.clear()
        self.read_ahead.reset()
        self._streams.step_end()
        self._core.removed(removed)

    def on_reset_flushed(self) -> None:
        """Every GPU job in flight at the last reset has finished: free their
        slots (those a tier job still fills are freed when it completes)."""
        self._core.slots.reset_flushed()

    def shutdown(self) -> None:
        """Close the lower tiers (each drains what it has in flight).
        Idempotent; no lock needed."""
        if self._closed:
            return
        self._closed = True
        for t in self.lower:
            t.close()

    def __enter__(self) -> TieredOffloadingManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("manager is shut down")
