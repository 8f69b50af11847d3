"""TieredOffloadingManager: the policy brain, with vLLM 0.33's
``OffloadingManager`` semantics and no vLLM import.

Who calls: the engine's scheduler, one thread, holding :attr:`lock` for the
whole scheduling step (vLLM does; the manager never takes it itself). No call
blocks, but :meth:`TieredOffloadingManager.lookup` with ``scan_wait_s`` > 0
(bounded per step in time and bytes, see there): lower-tier I/O is batched
per step and submitted in :meth:`on_schedule_end`, which also drains every
tier's completions (a lookup also submits promotions once
:data:`EAGER_PROMOTE` are queued for a tier).

Reference counts of host blocks: -1 while written (GPU store or promotion in
flight), 0 ready and evictable, > 0 pinned by loads. A host block also stays
held while lower tiers copy it (write-through cascade).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
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
class StreamSpec:
    """Keys of a load read by the engine's worker straight from a lower tier
    (their slot in :class:`HostSpec` is -1): ``index[i]`` is the key's
    position in the load, read from tier ``tiers[i]`` at ``locations[i]``
    (record, file, offset) and checked against ``digests`` (16 bytes each);
    ``readers`` says how to open each tier's reader."""

    index: np.ndarray  # int64
    tiers: list[str]
    locations: np.ndarray  # int64 (n, 3)
    digests: bytes
    readers: dict[str, dict[str, Any]]


@dataclass
class HostSpec:
    """Host pool slots, co-indexed with the keys of the call that made it;
    -1 for keys the worker streams from a lower tier (``stream``)."""

    slots: np.ndarray  # int64
    stream: StreamSpec | None = None
    # Per key, the armed fence of a slot a lower tier is still filling (the
    # worker's copy waits for it: HostPool.arm_fences), 0 when filled; None
    # when every slot is filled.
    fences: np.ndarray | None = None

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

EAGER_PROMOTE = 16
"""Promotions a lookup queues for one tier before it starts them itself,
rather than waiting for the step to end: a long prefix's first reads then
overlap the rest of its scan (the engine scans a prefix key by key)."""

SCAN_BACKOFF_S = 1.0
"""After a lookup's wait ran into its deadline (a server that stopped
answering, a device stuck), lookups do not wait again for this long: a hung
tier costs the scheduler one deadline, not one per step."""

KeyOrder = Callable[[bytes, Any], Sequence[bytes]]
"""``key_order(key, req_context)``: the keys the request will look up after
``key``, in prefix order (empty when unknown)."""


@dataclass
class _Stats:
    lookups: dict[str, int] = field(
        default_factory=lambda: {"hit": 0, "hit_pending": 0, "retry": 0, "miss": 0}
    )
    promotions: int = 0
    promotion_failures: int = 0
    # Lookups that waited for their request's reads (scan_wait_s) and the
    # seconds they waited in all (the part of a returning prefix's time to
    # first token spent reading lower tiers), reads that ended within the
    # wait, probes of keys no tier held, and waits cut short by the deadline.
    scan_waits: int = 0
    scan_wait_s: float = 0.0
    scan_reads: int = 0
    fenced_reads: int = 0  # read ahead and HIT at once, loads waiting on their fences
    fenced_failures: int = 0  # of those, reads that failed
    probe_misses: int = 0
    scan_timeouts: int = 0
    cascades: int = 0
    cascades_dropped: int = 0
    cascade_failures: int = 0
    held_slots: int = 0  # host slots kept from reuse after a device timeout
    stores: int = 0
    store_failures: int = 0
    loads: int = 0
    streamed: int = 0  # loaded blocks the engine's worker read from a lower tier
    streamed_stores: int = 0  # stored blocks it wrote to a lower tier itself
    load_failures: int = 0  # chunks (keys) of loads the engine's worker reported failed
    not_admitted: int = 0
    allocation_failures: int = 0
    # Blocks handed to the engine by prepare_load, by the tier they came from.
    loaded_from: dict[str, int] = field(default_factory=dict)


def _req_id(req_context: Any) -> Any:
    """The request a call is for (vLLM's ReqContext.req_id; None without one)."""
    return getattr(req_context, "req_id", None)


def _check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    for k in out:
        if not isinstance(k, (bytes, bytearray)):
            raise InvalidArgument(f"keys must be bytes, got {type(k).__name__}")
    return out


class TieredOffloadingManager:
    """Host tier plus an ordered list of lower tiers (e.g. disk, then remote).

    ``streaming``: a hit in a lower tier that can be read by another process
    (``pin_for_read``) and that finds no room in the host tier is reported
    HIT and handed to the engine's worker to read itself (a :class:`StreamSpec`
    in the load), instead of MISS: a prefix longer than the host tier still
    loads whole. ``streaming_stores``: likewise, offered blocks that find no
    host slot are written by the worker straight to such a tier (only where
    one worker holds a whole block: no tensor parallelism). Only for engines
    whose worker streams (the vLLM shim). ``promote=False`` (with
    ``streaming``): such hits are always streamed, never promoted into the
    host tier first (one step sooner; the host tier keeps what the engine
    stored).

    ``scan_wait_s`` > 0: the first lookup of a request that misses the host
    tier reads that key and the request's following keys (``key_order``)
    from the lower tiers into host slots at once, in one batch per tier, up
    to the first key no tier holds: keys a tier knows by a promotion; keys it
    does not know yet (RETRY) after its existence check
    (:meth:`LowerTier.submit_checks`, waited for), or with ``probe`` by a
    probe (:meth:`LowerTier.submit_probe`: for Redis one GET answers
    "exists?" and brings the bytes; a new prompt's probes take host slots for
    a moment). It then waits for those reads (the GIL released) and answers
    from the host tier, so a returning prefix is HIT in the step it is first
    looked up rather than RETRY, then HIT_PENDING, then HIT. Bounded per
    scheduler step: at most
    ``scan_wait_s`` of waiting and ``scan_bytes`` read (a request whose reads
    would exceed what is left takes the asynchronous path). A HIT is given
    only for bytes in a host slot whose read was checked; a read that fails
    (corrupt, vanished, server error) is a MISS, counted; what the deadline
    cuts short stays HIT_PENDING and ends as a promotion.

    ``fenced`` (with ``scan_wait_s``; only for engines whose worker reports
    failed loads, as the vLLM shim's KVTierConnector does): the read-ahead
    of keys a tier is known to hold is not waited for. Their slots are armed
    (:meth:`HostPool.arm_fences`) and the keys are HIT at once; the load's
    copies wait, slot by slot, for the tier to fill each slot, so the copy
    into the engine overlaps the reads (promotion pipelined with the load).
    A read that fails fails the loads waiting on it (the engine recomputes
    those blocks, :meth:`load_failed`) and is dropped.
    """

    def __init__(
        self,
        host: HostTier,
        lower: Sequence[LowerTier] = (),
        *,
        streaming: bool = False,
        streaming_stores: bool = False,
        promote: bool = True,
        scan_wait_s: float = 0.0,
        scan_bytes: int = 64 << 20,
        key_order: KeyOrder | None = None,
        probe: bool = False,
        fenced: bool = False,
    ) -> None:
        if not scan_wait_s >= 0 or scan_bytes < 0:
            raise InvalidArgument(
                f"scan_wait_s and scan_bytes must be >= 0, got {scan_wait_s}, {scan_bytes}"
            )
        self.host = host
        self.lower = list(lower)
        self.streaming = streaming
        self.promote = promote
        self.streaming_stores = streaming_stores
        self.scan_wait_s = float(scan_wait_s)
        self.scan_bytes = int(scan_bytes)
        self.key_order = key_order
        self.probe = probe
        self.fenced = fenced
        self._fills = 0  # host entries with fence != 0 (fast paths skip them when none)
        self._failed_fills: set[bytes] = set()  # entries with fence < 0
        names = [host.name] + [t.name for t in self.lower]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must be unique, got {names}")
        for t in self.lower:
            t.attach(host.pool)
        self._lock = threading.Lock()
        self._events: list[TierEvent] = []
        self._cascade: list[list[bytes]] = [[] for _ in self.lower]
        self._promote: list[list[bytes]] = [[] for _ in self.lower]
        self._promote_busy: set[int] = set()  # tiers that refused a promotion this step
        self._inflight: dict[tuple[int, int], tuple[str, list[bytes], list[int]]] = {}
        self._stale: set[int] = set()  # slots freed by reset, still under a GPU job
        # Keys some lookup reported HIT or HIT_PENDING since the last step end:
        # a promotion must not evict them, or a prefix longer than the host
        # tier would evict its own head while its tail is promoted (and the
        # engine would never see the whole prefix readable). They become
        # pinned by prepare_load, or are looked up again next step.
        self._scanned: set[bytes] = set()
        self._polled = False  # tiers polled by a lookup since the last step end
        # Lower-tier hits reported HIT without a host slot this step (key -> tier),
        # and the records pinned for loads in flight ((request, key) -> [(tier, record)]).
        self._streamable: dict[bytes, int] = {}
        self._stream_pins: dict[tuple[Any, bytes], list[tuple[int, int]]] = {}
        self._stream_writes: dict[bytes, tuple[int, int]] = {}  # key -> (tier, record)
        # Reads a lookup waits for (scan_wait_s): keys already read ahead this
        # step, what is left of this step's time and bytes, no wait before.
        self._ahead: set[bytes] = set()
        self._wait_left_s = self.scan_wait_s
        self._bytes_left = self.scan_bytes
        self._no_wait_until = 0.0
        self._closed = False
        self.stats = _Stats()

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
        self._check_open()
        if self.scan_wait_s > 0 and key not in self._ahead and key not in self.host.entries:
            self._read_ahead(key, req_context)
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
            if e.ref < 0:
                return LookupResult.HIT_PENDING
            return LookupResult.HIT if e.fence >= 0 else LookupResult.MISS  # < 0: read failed
        for i, tier in enumerate(self.lower):
            r = tier.lookup(key)
            if r is LookupResult.MISS:
                continue
            if r is not LookupResult.HIT:
                return r  # RETRY / HIT_PENDING: ask again next step
            streamable = self._worker_reads(tier)
            if streamable and not self.promote:
                self._streamable[key] = i
                return LookupResult.HIT
            got = self.host.allocate(1, protected=self._scanned)
            if got is None and streamable:
                self._streamable[key] = i  # the worker reads it from the tier itself
                return LookupResult.HIT
            if got is None:  # the host tier is full of this step's hits: load those
                self.stats.allocation_failures += 1
                return LookupResult.MISS
            (slot,), evicted = got
            self._removed(evicted)
            self.host.add_writing(key, slot, source=tier.name)
            queue = self._promote[i]
            queue.append(key)
            if len(queue) >= EAGER_PROMOTE and i not in self._promote_busy:
                self._submit_promotions(i)
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def get_load_source(self, key: bytes, req_context: Any = None) -> str:
        """Tier the bytes of a HIT key came from ("host" once loaded from host)."""
        e = self.host.get(key)
        if e is None and key in self._streamable:
            return self.lower[self._streamable[key]].name
        return e.source if e is not None else "host"

    def prepare_load(self, keys: Collection[bytes], req_context: Any = None) -> HostSpec:
        """Pin ``keys`` (all HIT this step) until :meth:`complete_load`; slots
        in key order, -1 with a :class:`StreamSpec` for streamed keys."""
        self._check_open()
        keys = _check_keys(keys)
        slots = [-1] * len(keys)
        streamed: dict[int, list[int]] = {}  # tier -> positions in keys
        entries = self.host.entries
        for i, k in enumerate(keys):
            e = entries.get(k)
            if e is not None and e.ref >= 0:
                slots[i] = e.slot
            elif k in self._streamable:  # (a store of it may have begun since)
                streamed.setdefault(self._streamable[k], []).append(i)
            else:
                raise InvalidArgument(f"prepare_load of a key that is not a HIT: {k.hex()[:16]}")
        # Checked first, pinned after: a refused call changes nothing.
        loaded_from = self.stats.loaded_from
        for k, slot in zip(keys, slots):
            source = self.host.pin(k) if slot >= 0 else self.lower[self._streamable[k]].name
            loaded_from[source] = loaded_from.get(source, 0) + 1
        self.stats.loads += len(keys)
        fences = None
        if self._fills:
            # A failed read's value too: the copy then fails on its fence.
            armed = [abs(entries[k].fence) if s >= 0 else 0 for k, s in zip(keys, slots)]
            if any(armed):
                fences = np.asarray(armed, np.int64)
        if not streamed:
            return HostSpec(np.asarray(slots, np.int64), fences=fences)
        stream = self._pin_streams(keys, streamed, _req_id(req_context))
        return HostSpec(np.asarray(slots, np.int64), stream, fences)

    def _pin_streams(
        self, keys: list[bytes], streamed: dict[int, list[int]], req: Any
    ) -> StreamSpec:
        index: list[int] = []
        tiers: list[str] = []
        locs, digs, readers = [], [], {}
        for t, pos in streamed.items():
            tier = self.lower[t]
            loc, dig = tier.pin_for_read([keys[i] for i in pos])
            for i, rec in zip(pos, loc[:, 0].tolist()):
                self._stream_pins.setdefault((req, keys[i]), []).append((t, rec))
            spec = tier.reader_spec()
            assert spec is not None
            readers[tier.name] = spec
            index += pos
            tiers += [tier.name] * len(pos)
            locs.append(loc)
            digs.append(dig)
        self.stats.streamed += len(index)
        return StreamSpec(np.asarray(index, np.int64), tiers, np.concatenate(locs), b"".join(digs),
                          readers)  # fmt: skip

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        """Unpin keys of a finished load (host slots, or streamed records)."""
        if self._fills:
            self._unpin_fills(keys)
        if not self._stream_pins:  # the common case, kept to one call per key
            for k in keys:
                self.host.unpin(k)
            return
        req = _req_id(req_context)
        for k in keys:
            pins = self._stream_pins.get((req, k))
            if pins:
                t, rec = pins.pop()
                if not pins:
                    del self._stream_pins[(req, k)]
                self.lower[t].unpin_read([rec])
            else:
                self.host.unpin(k)

    def _unpin_fills(self, keys: Collection[bytes]) -> None:
        """Before the unpins of a load: a block whose fenced read failed is
        dropped when this load was its last."""
        failed = self._failed_fills
        if failed:
            entries = self.host.entries
            self._drop_failed([k for k in keys if k in failed and entries[k].ref <= 1])

    def _drop_failed(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if self.host.drop(k) is not None:
                self._fills -= 1
            self._failed_fills.discard(k)

    def load_failed(self, spec: HostSpec) -> None:
        """The engine's worker reported that the load of ``spec`` (a
        :meth:`prepare_load` result, its load completed) failed: the lower-
        tier records it read itself are forgotten there and its host blocks
        no longer loaded by anyone are dropped, so the next lookup of those
        keys misses rather than loading the same bytes again.

        Who calls: the vLLM shim's connector, after ``complete_load`` of the
        same load. Non-blocking."""
        self.stats.load_failures += len(spec.slots)
        bad = {int(s) for s in spec.slots if s >= 0}
        if bad:
            dead = [k for k, e in self.host.entries.items() if e.slot in bad and e.evictable]
            for k in dead:
                self.host.drop(k)
            self._removed(dead)
        st = spec.stream
        if st is None:
            return
        rows: dict[str, list[int]] = {}
        for n, name in enumerate(st.tiers):
            rows.setdefault(name, []).append(n)
        for tier in self.lower:
            mine = rows.get(tier.name)
            if mine:
                digs = b"".join(st.digests[16 * n : 16 * n + 16] for n in mine)
                tier.read_failed(st.locations[mine], digs)

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
        slots, evicted = got if got is not None else ([], [])
        if len(slots) == len(to_store):  # all fit (the common case: no copies of lists)
            for k, s in zip(to_store, slots):
                self.host.add_writing(k, s)
            self._removed(evicted)
            return PrepareStoreResult(to_store, HostSpec(np.asarray(slots, np.int64)), evicted)
        host_keys, rest = to_store[: len(slots)], to_store[len(slots) :]
        streamed, stream = (
            self._reserve_writes(rest, len(host_keys)) if self.streaming_stores else ([], None)
        )
        if len(host_keys) + len(streamed) < len(to_store):
            self.stats.allocation_failures += 1
        if got is None and not streamed:
            return None
        for k, s in zip(host_keys, slots):
            self.host.add_writing(k, s)
        self._removed(evicted)
        all_slots = np.asarray(list(slots) + [-1] * len(streamed), np.int64)
        return PrepareStoreResult(host_keys + streamed, HostSpec(all_slots, stream), evicted)

    def _reserve_writes(
        self, keys: list[bytes], first: int
    ) -> tuple[list[bytes], StreamSpec | None]:
        """Records of the first lower tier another process can write, for
        ``keys`` (positions from ``first`` in the store): what got one."""
        for t, tier in enumerate(self.lower):
            spec = tier.reader_spec()
            if spec is None:
                continue
            got = tier.reserve_for_write(keys)
            out = [keys[i] for i, _, _ in got]
            for k, (_, loc, _) in zip(out, got):
                self._stream_writes[k] = (t, int(loc[0]))
            self.stats.streamed_stores += len(out)
            if not out:
                return [], None
            return out, StreamSpec(
                np.arange(first, first + len(out), dtype=np.int64), [tier.name] * len(out),
                np.stack([loc for _, loc, _ in got]), b"".join(d for _, _, d in got),
                {tier.name: spec},
            )  # fmt: skip
        return [], None

    def complete_store(
        self, keys: Collection[bytes], req_context: Any = None, success: bool = True
    ) -> None:
        """Stored blocks become readable (or are dropped on failure); starts the cascade."""
        stored = []
        streamed = self._stream_writes
        for k in keys:
            w = streamed.pop(k, None) if streamed else None
            if w is not None:  # written by the worker straight to a lower tier
                self.lower[w[0]].commit_write(k, w[1], success)
                continue
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
        self._ahead.clear()
        self._wait_left_s, self._bytes_left = self.scan_wait_s, self.scan_bytes
        self._streamable.clear()
        self._polled = False
        self._poll_tiers()
        if self._failed_fills:  # failed reads of blocks HIT last step and never loaded
            entries = self.host.entries
            self._drop_failed([k for k in self._failed_fills if entries[k].ref == 0])
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
            "writing": sum(1 for e in entries if e.ref < 0 or e.fence > 0),
            "cascading": sum(1 for e in entries if e.cascading),
            "held": self.host.held_slots,
            "stale": len(self._stale),
            "streaming": sum(len(p) for p in self._stream_pins.values()) + len(self._stream_writes),
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
            if e.fence:
                self._fills -= 1
                self._failed_fills.discard(key)
            if e.slot in tier_slots and e.ref <= 0:
                continue  # freed when the tier job completes (see _complete)
            if e.ref != 0:
                self._stale.add(e.slot)  # a GPU job may still be using it
            else:
                self.host.release_slot(e.slot)
        self._cascade = [[] for _ in self.lower]
        self._scanned.clear()
        self._ahead.clear()
        self._streamable.clear()
        for batch in self._promote:
            batch.clear()
        self._removed(removed)

    def on_reset_flushed(self) -> None:
        """Every GPU job in flight at the last reset has finished: free their
        slots (those a tier job still fills are freed when it completes)."""
        tier_slots = {slot for _, _, slots in self._inflight.values() for slot in slots}
        stale, self._stale = self._stale, set()
        for s in stale:
            if s not in tier_slots:
                self.host.release_slot(s)

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
            self._submit_promotions(i)
        self._promote_busy.clear()

    def _submit_promotions(self, i: int) -> None:
        """Start the promotions queued for tier ``i``: at step end, or from a
        lookup once :data:`EAGER_PROMOTE` are queued. Under backpressure
        they stay queued (and lookups stop trying until the step ends)."""
        entries = self.host.entries
        live = [k for k in self._promote[i] if k in entries]
        if live:
            slots = [entries[k].slot for k in live]
            token = self.lower[i].submit_load(live, slots)
            if token is None:
                self._promote_busy.add(i)
                return
            self._inflight[(i, token)] = ("load", live, slots)
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
            if kind == "fenced":
                self._fill_done(k, slot, ok)
                continue
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
                    if c.missing is not None and c.missing[idx]:
                        self.stats.probe_misses += 1  # not there: a plain miss
                    else:
                        self.stats.promotion_failures += 1
                elif slot is not None and not self._slot_in_use(slot):
                    self.host.release_slot(slot)

    def _fill_done(self, key: bytes, slot: int | None, ok: bool) -> None:
        """A fenced read of ``key`` into ``slot`` ended."""
        e = self.host.get(key)
        if e is None or slot is None or e.slot != slot or e.fence <= 0:
            if slot is not None and not self._slot_in_use(slot):
                self.host.release_slot(slot)  # detached by reset: free it now
            return
        if ok:  # read and checked by the tier, which settled the fence itself
            e.fence = 0
            self._fills -= 1
            self.stats.promotions += 1
            self._events.append(TierEvent([key], self.host.name, removed=False))
            return
        pool = self.host.pool
        if pool is not None:  # a job cancelled or timed out never settled its fences
            pool.settle_fence(slot, e.fence, False)
        self.stats.fenced_failures += 1
        if e.ref > 0 or key in self._scanned:
            # A load holds it, or may still be prepared this step: MISS from
            # now on, its loads fail on the fence, dropped once none holds it.
            e.fence = -e.fence
            self._failed_fills.add(key)
        else:
            self._drop_failed([key])

    def _fence_reads(self, i: int, keys: list[bytes], slots: list[int]) -> bool:
        """Read ``keys`` from tier ``i`` into ``slots`` under fences and make
        them HIT now (see the class docstring); False (nothing changed) when
        the tier cannot or is busy."""
        pool = self.host.pool
        if pool is None:
            return False
        armed = pool.arm_fences(slots)
        token = self.lower[i].submit_fenced_load(keys, slots, armed)
        if token is None:
            for slot, a in zip(slots, armed.tolist()):
                pool.settle_fence(slot, a, False)
            return False
        self._inflight[(i, token)] = ("fenced", keys, slots)
        entries = self.host.entries
        for k, a in zip(keys, armed.tolist()):
            entries[k].fence = a
            self.host.mark_ready(k)
        self._fills += len(keys)
        self.stats.fenced_reads += len(keys)
        return True

    def _read_ahead(self, key: bytes, req_context: Any) -> None:
        """Read ``key`` and the request's following keys that miss the host
        tier into host slots, and wait for them (see the class docstring)."""
        following = list(self.key_order(key, req_context)) if self.key_order else []
        run = [key, *following]
        self._ahead.update(run)
        if self._wait_left_s <= 0 or time.monotonic() < self._no_wait_until:
            return
        picks = self._pick_reads(run)
        tiers = sorted({i for i, unknown, _ in picks if unknown and not self._probes(i)})
        if tiers:
            # Existence first (one round trip of small replies), so that no
            # slot is taken, nor block evicted, for a key no tier holds.
            checks = {i: self.lower[i].submit_checks() for i in tiers}
            if not self._wait({i: [t] for i, t in checks.items() if t is not None}):
                return
            self._poll_tiers()
            picks = self._pick_reads(run)
            cut = (n for n, (i, unknown, _) in enumerate(picks) if unknown and not self._probes(i))
            picks = picks[: next(cut, len(picks))]
        pool = self.host.pool
        slot_bytes = pool.slot_bytes if pool is not None else 0
        if not picks or len(picks) * slot_bytes > self._bytes_left:
            return  # nothing to read, or too much to wait for: the asynchronous path
        # Never evict a key of this request (a later one may be a host hit)
        # or a hit of this step.
        got = self.host.allocate(len(picks), protected=self._scanned.union(run), partial=True)
        if got is None:
            return
        slots, evicted = got
        self._removed(evicted)
        picks = picks[: len(slots)]
        self._bytes_left -= len(picks) * slot_bytes
        groups: dict[tuple[int, bool], tuple[list[bytes], list[int]]] = {}
        for (i, probe, k), slot in zip(picks, slots):
            self.host.add_writing(k, slot, source=self.lower[i].name)
            ks, ss = groups.setdefault((i, probe), ([], []))
            ks.append(k)
            ss.append(slot)
        waits: dict[int, list[int]] = {}
        # Probes first: on the same connections, a probe queued behind the
        # fenced reads would make the lookup wait for those reads after all.
        for (i, probe), (ks, ss) in sorted(groups.items(), key=lambda g: not g[0][1]):
            tier = self.lower[i]
            if not probe and self.fenced and tier.can_fence and self._fence_reads(i, ks, ss):
                continue
            token = tier.submit_probe(ks, ss) if probe else tier.submit_load(ks, ss)
            if token is not None:
                self._inflight[(i, token)] = ("probe" if probe else "load", ks, ss)
                waits.setdefault(i, []).append(token)
            elif probe:  # busy: back to the asynchronous existence check
                for k in ks:
                    self.host.drop(k)
            else:
                self._promote[i].extend(ks)  # a promotion, started at the step end
        self._wait(waits)
        before = self.stats.promotions
        self._poll_tiers()
        self.stats.scan_reads += self.stats.promotions - before

    def _wait(self, waits: dict[int, list[int]]) -> bool:
        """Wait for tier batches (tier -> tokens) within what is left of this
        step's ``scan_wait_s``; False (and no more waiting for a while) when
        the deadline came first."""
        if not waits:
            return True
        start = time.monotonic()
        deadline = start + self._wait_left_s
        self.stats.scan_waits += 1
        done = True
        for i, tokens in waits.items():
            if not self.lower[i].wait(tokens, deadline - time.monotonic()):
                self.stats.scan_timeouts += 1
                self._no_wait_until = time.monotonic() + SCAN_BACKOFF_S
                done = False
                break
        now = time.monotonic()
        self.stats.scan_wait_s += now - start
        self._wait_left_s = max(0.0, deadline - now)
        return done

    def _worker_reads(self, tier: LowerTier) -> bool:
        """The engine's worker can read ``tier``'s hits itself (streaming)."""
        return self.streaming and tier.reader_spec() is not None

    def _probes(self, tier: int) -> bool:
        """Keys lower tier ``tier`` does not know yet are probed (rather than
        checked first)."""
        return self.probe and self.lower[tier].can_probe

    def _pick_reads(self, run: list[bytes]) -> list[tuple[int, bool, bytes]]:
        """``(tier, unknown, key)`` for the keys of ``run`` that miss the
        host tier, in order, up to the first key no tier holds (the engine
        stops its scan there); ``unknown``: the tier said RETRY."""
        picks: list[tuple[int, bool, bytes]] = []
        entries = self.host.entries
        for k in run:
            if k in entries:
                continue
            for i, tier in enumerate(self.lower):
                r = tier.lookup(k)
                if r is LookupResult.MISS:
                    continue
                if r is LookupResult.HIT:
                    if self.promote or not self._worker_reads(tier):
                        picks.append((i, False, k))
                    # else the worker reads it itself: nothing to read ahead
                elif r is LookupResult.RETRY:
                    picks.append((i, True, k))
                else:
                    return picks
                break
            else:
                return picks
        return picks

    def _slot_in_use(self, slot: int) -> bool:
        return (
            slot in self._stale
            or any(slot in s for _, _, s in self._inflight.values())
            or any(e.slot == slot for e in self.host.entries.values())
        )
