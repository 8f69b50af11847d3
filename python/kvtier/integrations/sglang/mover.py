"""SGLang HiCache shim: pages between one of SGLang's host pools and kvtier's
disk and Redis tiers, on kvtier's native threads.

SGLang's host pool tensor is registered with a copy engine as a region; a
page goes through a staging slot of kvtier's own (one record per page, its
trailer beside it: one I/O per page on disk, one value in Redis). A store
gathers the page's runs (:class:`~kvtier.integrations.sglang.pages.PagePlan`)
into staging slots with one native copy job, then the tiers write the slots;
a load reads into staging slots, the tiers check every record (namespace,
key digest, length, crc32c), and only the pages that passed are scattered
into SGLang's pool: a failed or corrupt page is a miss and none of its
bytes reach the pool. No page is copied by Python. With a memory tier
(:mod:`~kvtier.integrations.sglang.host_pages`, slots of the same pool after
the staging slots) a store gathers a page into a memory slot instead and the
tiers write it from there; loads and hit queries look there first.

Who calls: :class:`kvtier.integrations.sglang.storage.KVTierStorage`, from
SGLang's storage threads (prefetch and backup), possibly at once. Every
public method blocks until its pages moved (SGLang's interface returns the
results): the tiers' state is touched under one short lock, and the waits
for the native jobs are outside it, so a store and a load overlap.

Runs in each SGLang scheduler process (one per TP/PP rank).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.errors import InvalidArgument, Timeout
from kvtier.integrations.sglang.pages import PagePlan
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion
from kvtier.tiers.records import key_digest

if TYPE_CHECKING:
    from kvtier.tiers.jobs import JobTier

_WAIT_SLICE_S = 5.0
#: Staging slots each way by default: SGLang's storage batch (its
#: STORAGE_BATCH_SIZE), so that a batch moves in one part. Measured with
#: 1 MiB pages (2 cores): loads 1.4x faster than in two parts of 64.
STAGING_PAGES = 128
#: The most staging memory a pool gets by default (large pages: fewer slots).
STAGING_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class _Call:
    """One :meth:`PageMover.store` or :meth:`PageMover.load` call: its keys,
    their pages' addresses, and per key whether it succeeded so far (the
    parts of the call fill ``ok`` in)."""

    keys: Sequence[bytes]
    pages: np.ndarray
    ok: list[bool]


class PageCopies:
    """What both page movers share (this one and the node's,
    :class:`~kvtier.integrations.sglang.node_pages.NodePageMover`): host
    copies between SGLang's pool and kvtier slots on a copy engine
    (``copier``), waited for outside ``_lock``, whose results and
    ``counters`` it guards (stores and loads run at once)."""

    copier: Any
    _lock: Any
    _copied: dict[int, bool]
    counters: dict[str, int]

    def _copy_submit(self, descs: np.ndarray) -> list[int]:
        """Queue host copies on the copy engine (two jobs: both threads work)."""
        parts = np.array_split(descs, 2) if len(descs) > 1 else [descs]
        return [self.copier.submit_copy(np.ascontiguousarray(p)) for p in parts if len(p)]

    def _copy_wait(self, jids: list[int]) -> bool:
        """Block until the copy jobs ``jids`` ended; True when all succeeded."""
        while True:
            try:
                self.copier.wait(jids, _WAIT_SLICE_S)
                break
            except Timeout:
                continue
        with self._lock:
            for r in self.copier.poll():
                self._copied[int(r.job_id)] = bool(r.ok)
            ok = all(self._copied.pop(j, False) for j in jids)
        if not ok:
            self._count("copy_failures", 1)
        return ok

    def _count(self, *pairs: str | int) -> None:
        """Add to counters (name, amount, ...): stores and loads run at once."""
        with self._lock:
            for name, n in zip(pairs[::2], pairs[1::2]):
                self.counters[str(name)] += int(n)


class PageMover(PageCopies):
    """Pages of one SGLang host pool to and from ``tiers`` (fastest first:
    disk, then remote), through ``staging_bytes`` of kvtier host slots (default
    :data:`STAGING_PAGES` pages each way, at most :data:`STAGING_MAX_BYTES`),
    half for stores and half for loads (at least 2 slots each). ``writes[i]``:
    this rank stores to ``tiers[i]`` (default all; a store to none of them
    succeeds: another rank writes). ``host_bytes``: a memory tier of that
    size in front of ``tiers`` (None: none).

    Results are per page, in the order of the keys given. Closing closes the
    tiers.
    """

    def __init__(
        self,
        plan: PagePlan,
        tiers: Sequence[LowerTier],
        staging_bytes: int | None = None,
        writes: Sequence[bool] | None = None,
        host_bytes: int | None = None,
    ) -> None:
        from kvtier.engine import Engine
        from kvtier.integrations.sglang.host_pages import HostPages
        from kvtier.pool import HostPool
        from kvtier.tiers.disk import DiskTier
        from kvtier.tiers.jobs import JobTier
        from kvtier.tiers.records import record_bytes
        from kvtier.tiers.slot_holds import SlotHolds

        self.plan = plan
        # The waits below go to each tier's engine jobs: data-moving tiers only.
        self.tiers: list[JobTier] = [t for t in tiers if isinstance(t, JobTier)]
        if len(self.tiers) != len(tiers) or not self.tiers:
            raise InvalidArgument("kvtier: SGLang pages need disk or remote tiers")
        # Tiers this rank writes (MLA: another rank writes the shared one).
        written = [True] * len(self.tiers) if writes is None else list(writes)
        self.writable = [t for t, w in zip(self.tiers, written) if w]
        has_disk = any(getattr(t, "record_bytes", None) for t in self.tiers)
        self.slot_bytes = record_bytes(plan.page_bytes) if has_disk else plan.page_bytes
        if staging_bytes is None:
            staging_bytes = min(2 * STAGING_PAGES * self.slot_bytes, STAGING_MAX_BYTES)
        half = max(2, min(256, staging_bytes // (2 * self.slot_bytes)))
        self._free = {"store": list(range(half)), "load": list(range(half, 2 * half))}
        self._dir_locks = {"store": threading.Lock(), "load": threading.Lock()}
        self._lock = threading.RLock()  # the tiers, the copy engine's results, slot lists
        self._done: dict[int, dict[int, TierCompletion]] = {id(t): {} for t in self.tiers}
        self._copied: dict[int, bool] = {}
        # The memory tier's slots follow the staging slots in one pool: the
        # tiers write a page from its memory slot, so a store copies it once
        # (a second gather into a pool of its own cost 14-21% of the store rate
        # of 32 KiB pages, 2 cores).
        mem_slots = (host_bytes or 0) // self.slot_bytes
        if host_bytes and not mem_slots:
            raise InvalidArgument(
                f"kvtier_host_bytes {host_bytes} holds no page of {self.slot_bytes} bytes"
            )
        self.staging = HostPool(2 * half + mem_slots, self.slot_bytes)
        self.host_pages = HostPages(mem_slots, self.staging, 2 * half) if mem_slots else None
        # Slots of timed-out jobs, out of use until they end: one count per
        # pool slot, staging or memory (a memory slot evicted meanwhile is
        # freed when its last hold ends).
        self._held = self.host_pages.held if self.host_pages is not None else SlotHolds([])
        try:
            # Host copies (gather before a store, scatter after a load) on
            # their own threads: SGLang's pool tensor and the staging slots
            # are its regions; its budget holds every slot at once.
            self.copier = Engine(2, [(self.staging.nbytes + 1, False)])
            self.copier.register_memory(plan.base, plan.nbytes, owner=plan.buffer)
            self.copier.register_pool(self.staging)
            for t in self.tiers:
                t.attach(self.staging)
        except BaseException:
            if hasattr(self, "copier"):
                self.copier.close()
            self.staging.close()
            raise
        # SGLang asks for the longest stored prefix at every prefetch: the
        # disk tier's readable test straight from its native index (what
        # DiskTier.lookup answers, about 40% less Python per key).
        self._ready: dict[int, Callable[[bytes], bool]] = {
            id(t): t.index.ready_fn() for t in self.tiers if isinstance(t, DiskTier)
        }
        self.counters = dict.fromkeys(
            ("pages_stored", "pages_loaded", "store_failures", "load_failures", "copy_failures"), 0
        )
        self._closed = False

    def _step(self, n: int, tiers: Sequence[JobTier]) -> int:
        """Pages per piece of a batch of ``n`` moved by ``tiers``: on disk a
        large batch goes in 4 pieces of at least 8 MiB, the host copy of one
        overlapping the I/O of the others; smaller ones, and Redis (whose
        batch is spread over its connections), go whole. Measured on 2
        cores, 64-page batches: 1 MiB pages loaded 1.15-1.65x faster in
        pieces, 32 KiB ones 1.15x faster whole, from Redis 1.5-1.8x faster whole."""
        if not any(getattr(t, "record_bytes", 0) for t in tiers):
            return max(1, n)
        return max(1, -(-n // 4), -(-(8 << 20) // self.plan.page_bytes))

    def _drain(self, tier: JobTier) -> None:
        """Poll ``tier`` (lock held): completions kept by token for whichever
        thread waits on them; events and released slots consumed."""
        done = self._done[id(tier)]
        for c in tier.poll():
            done[c.token] = c
        tier.take_events()  # nobody subscribes: SGLang asks, it is not told
        for slot in tier.take_released_slots():
            self._held.unhold(slot)

    def _wait_jobs(self, tier: JobTier, token: int) -> None:
        """Block until no engine job of batch ``token`` of ``tier`` is queued
        or running (the lock released while waiting)."""
        while True:
            with self._lock:
                self._drain(tier)
                jids = tier.jobs.job_ids([token])
            if not jids:
                return
            with contextlib.suppress(Timeout):
                tier.jobs.engine.wait(jids, _WAIT_SLICE_S)

    def _finish(self, tier: JobTier, token: int) -> TierCompletion:
        """Block until batch ``token`` of ``tier`` ended; its completion."""
        while True:
            self._wait_jobs(tier, token)
            with self._lock:
                self._drain(tier)
                c = self._done[id(tier)].pop(token, None)
            if c is not None:
                return c

    def _take_slots(self, kind: str, n: int) -> list[int]:
        """Staging slots for the next part of ``n`` pages still to move: all
        of them if there are enough, else parts of equal size (128 pages
        over 127 slots go as 64 + 64, not 127 + 1)."""
        with self._lock:
            free = [s for s in self._free[kind] if s not in self._held]
        if not free:
            return []
        parts = -(-n // len(free))
        return free[: -(-n // parts)]

    def _note_held(self, c: TierCompletion, slots: Sequence[int]) -> None:
        if c.held:
            with self._lock:
                for s, h in zip(slots, c.held):
                    if h:
                        self._held.hold(s)

    # -- pages ---------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: does any tier hold it? A remote key not known yet is
        asked with one pipelined EXISTS for all of them. Blocks for that
        round trip only (a disk lookup is in memory)."""
        hit = [False] * len(keys)
        if self.host_pages is not None:
            with self._lock:
                hit = [self.host_pages.holds(k) for k in keys]
        for tier in self.tiers:
            ask = [i for i, h in enumerate(hit) if not h]
            if not ask:
                break
            ready = self._ready.get(id(tier))
            if ready is not None:  # the disk's native index, without a call per key
                with self._lock:
                    for i in ask:
                        hit[i] = ready(key_digest(keys[i]))
                continue
            answers = self._ask(tier, [keys[i] for i in ask])
            for i, a in zip(ask, answers):
                hit[i] = a == LookupResult.HIT
        return hit

    def _ask(self, tier: JobTier, keys: list[bytes]) -> list[LookupResult]:
        """``tier``'s answers for ``keys``, waiting for the existence checks
        they need (the tier's timeout at most: an answer still unknown then
        is RETRY, which callers take as absent). A check queued by an
        earlier call may still be in flight, and the tier does not ask
        twice for a key: then its jobs are waited for too."""
        timeout_s = float(getattr(tier, "timeout_s", 2.0))
        deadline = time.monotonic() + timeout_s + 1.0
        while True:
            with self._lock:
                self._drain(tier)  # checks that ended since: answered now
                answers = [tier.lookup(k) for k in keys]
                if LookupResult.RETRY not in answers or time.monotonic() > deadline:
                    return answers
                token = tier.submit_checks()
                jids = tier.jobs.job_ids([token]) if token is not None else []
                jids = jids or sorted(tier.jobs.in_flight())
            if jids:
                with contextlib.suppress(Timeout):
                    tier.jobs.engine.wait(jids, min(_WAIT_SLICE_S, timeout_s))

    def store(self, keys: Sequence[bytes], pages: np.ndarray) -> list[bool]:
        """Write the pages at addresses ``pages`` as ``keys`` to every tier
        this rank writes; per key True when such a tier holds it now (it did
        already, or this write succeeded). Blocks until written."""
        if not self.writable:  # another rank writes these pages
            return [True] * len(keys)
        call = _Call(keys, pages, [False] * len(keys))
        ok = call.ok
        with self._dir_locks["store"]:
            todo = self._to_store(keys, ok)
            while todo:
                slots = self._take_slots("store", len(todo))
                if not slots:  # every slot held by a timed-out job
                    break
                part, todo = todo[: len(slots)], todo[len(slots) :]
                self._store_part(call, part, slots[: len(part)])
        self._count("pages_stored", sum(ok), "store_failures", len(ok) - sum(ok))
        return ok

    def _to_store(self, keys: Sequence[bytes], ok: list[bool]) -> list[int]:
        """Positions of ``keys`` to write: not stored yet (those already are
        ``ok``: SGLang offers a prefix again) and admitted by a tier."""
        todo = []
        # Only the disk answers at once; a Redis lookup would queue an
        # existence check per key, dearer than writing the value again.
        ready = self._ready.get(id(self.writable[0]))
        with self._lock:
            for i, k in enumerate(keys):
                if ready is not None and ready(key_digest(k)):
                    ok[i] = True
                elif any([t.admit(k) for t in self.writable]):
                    todo.append(i)
        return todo

    def _store_part(self, call: _Call, part: list[int], slots: list[int]) -> None:
        """Gather ``call.pages[part]`` into ``slots`` and write them, piece by
        piece: a piece's writes run while the next piece is gathered."""
        keys, pages = call.keys, call.pages
        pending: list[tuple[JobTier, int | None, list[int], list[int]]] = []
        kept_keys: list[bytes] = []
        step = self._step(len(part), self.writable)
        for a in range(0, len(part), step):
            pp, ps = part[a : a + step], list(slots[a : a + step])
            pkeys = [keys[i] for i in pp]
            # A page the memory tier keeps goes to its memory slot, and the
            # tiers write it from there (it stays unreadable until they end).
            kept = self._reserve_host(pkeys)
            for j, slot in kept:
                ps[j] = slot
            addr = self.staging.address + np.asarray(ps, np.int64) * self.slot_bytes
            if not self._copy_wait(self._copy_submit(self.plan.descriptors(pages[pp], addr, True))):
                self._end_host([pkeys[j] for j, _ in kept], False)
                continue
            with self._lock:
                pending += [(t, t.submit_store(pkeys, ps), pp, ps) for t in self.writable]
            kept_keys += [pkeys[j] for j, _ in kept]
        self._end_stores(pending, call.ok)
        self._end_host(kept_keys, True)

    def _reserve_host(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """Memory slots for the ``keys`` being stored that it lacks, as
        ``(position, slot)`` (none without a memory tier)."""
        if self.host_pages is None:
            return []
        with self._lock:
            return self.host_pages.reserve(keys)

    def _end_host(self, keys: list[bytes], copied: bool) -> None:
        """The copy into the memory slots reserved for ``keys`` ended."""
        if self.host_pages is not None and keys:
            with self._lock:
                (self.host_pages.commit if copied else self.host_pages.abort)(keys)

    def _store_slots(
        self, keys: Sequence[bytes], part: list[int], slots: list[int], ok: list[bool]
    ) -> None:
        """Write staging ``slots`` (filled) as ``keys[part]`` to the tiers."""
        pkeys = [keys[i] for i in part]
        slots = slots[: len(part)]
        with self._lock:
            pending = [(t, t.submit_store(pkeys, slots), part, slots) for t in self.writable]
        self._end_stores(pending, ok)

    def _end_stores(
        self, pending: list[tuple[JobTier, int | None, list[int], list[int]]], ok: list[bool]
    ) -> None:
        """Wait for store batches ``(tier, token, positions, slots)``; a
        position is ``ok`` once one tier stored it."""
        for tier, token, part, slots in pending:
            if token is None:  # backpressure: this tier skipped the batch
                continue
            c = self._finish(tier, token)
            self._note_held(c, slots)
            for j, good in enumerate(c.key_ok or [c.ok] * len(part)):
                ok[part[j]] = ok[part[j]] or good

    def load(self, keys: Sequence[bytes], pages: np.ndarray) -> list[bool]:
        """Read ``keys`` into the pages at addresses ``pages``: per key True
        when its bytes were read, checked and copied in. A page no tier
        holds, or whose record fails a check, is False and its page in the
        pool untouched. Tiers are tried in order (a page the disk lost
        comes from Redis). Blocks until read."""
        call = _Call(keys, pages, [False] * len(keys))
        ok = call.ok
        with self._dir_locks["load"]:
            self._load_host(keys, pages, ok)
            for tier in self.tiers:
                with self._lock:
                    want = [
                        i
                        for i, k in enumerate(keys)
                        if not ok[i] and tier.lookup(k) != LookupResult.MISS
                    ]
                while want:
                    slots = self._take_slots("load", len(want))
                    if not slots:
                        break
                    part, want = want[: len(slots)], want[len(slots) :]
                    self._load_part(tier, call, part, slots[: len(part)])
        self._count("pages_loaded", sum(ok), "load_failures", len(ok) - sum(ok))
        return ok

    def _load_host(self, keys: Sequence[bytes], pages: np.ndarray, ok: list[bool]) -> None:
        """Copy the pages of ``keys`` the memory tier holds into ``pages``
        (one copy job; they stay pinned until it ends) and mark them ``ok``."""
        if self.host_pages is None:
            return
        with self._lock:
            slots = self.host_pages.pin(keys)
        found = [(i, s) for i, s in enumerate(slots) if s is not None]
        copied = False
        try:
            if found:
                addr = (
                    self.staging.address
                    + np.asarray([s for _, s in found], np.int64) * self.slot_bytes
                )
                descs = self.plan.descriptors(pages[[i for i, _ in found]], addr, to_slots=False)
                copied = self._copy_wait(self._copy_submit(descs))
        finally:
            with self._lock:
                self.host_pages.unpin([keys[i] for i, _ in found], len(found) if copied else 0)
        if copied:
            for i, _ in found:
                ok[i] = True

    def _load_part(self, tier: JobTier, call: _Call, part: list[int], slots: list[int]) -> None:
        """Read ``call.keys[part]`` from ``tier`` into ``slots`` and scatter
        each piece into its pages while the later pieces are read."""
        keys, pages, ok = call.keys, call.pages, call.ok
        step = self._step(len(part), [tier])
        reads = []
        with self._lock:
            # A remote key not known to exist is read with a probe (a GET
            # whose absence is a plain miss); one known is read alike.
            for a in range(0, len(part), step):
                pp, ps = part[a : a + step], slots[a : a + step]
                pkeys = [keys[i] for i in pp]
                read = tier.submit_probe if tier.can_probe else tier.submit_load
                reads.append((read(pkeys, ps), pp, ps))
        # Each piece is scattered into the pool while the later ones are read.
        copies = []
        for token, pp, ps in reads:
            if token is None:
                continue
            c = self._finish(tier, token)
            self._note_held(c, ps)
            good = [j for j, g in enumerate(c.key_ok or [c.ok] * len(pp)) if g]
            if good:
                addr = (
                    self.staging.address
                    + np.asarray([ps[j] for j in good], np.int64) * self.slot_bytes
                )
                descs = self.plan.descriptors(pages[[pp[j] for j in good]], addr, to_slots=False)
                copies.append((self._copy_submit(descs), [pp[j] for j in good]))
        for jids, done in copies:
            if self._copy_wait(jids):
                for i in done:
                    ok[i] = True

    def read_slot(self, key: bytes) -> np.ndarray | None:
        """One page's bytes (a copy) from the first tier that holds it and
        whose record passes its checks; None when none does. Blocks. For the
        key-value fallbacks (SGLang's generic path), not the page path."""
        with self._dir_locks["load"]:
            if self.host_pages is not None:
                with self._lock:
                    (slot,) = self.host_pages.pin([key])
                if slot is not None:
                    try:
                        found: np.ndarray = self.staging.view(slot)[: self.plan.page_bytes].copy()
                    finally:
                        with self._lock:
                            self.host_pages.unpin([key], 1)
                    return found
            slots = self._take_slots("load", 1)
            if not slots:
                return None
            for tier in self.tiers:
                with self._lock:
                    if tier.lookup(key) == LookupResult.MISS:
                        continue
                    probe = tier.can_probe
                    token = (
                        tier.submit_probe([key], slots) if probe else tier.submit_load([key], slots)
                    )
                if token is None:
                    continue
                c = self._finish(tier, token)
                self._note_held(c, slots)
                if c.key_ok[0] if c.key_ok else c.ok:
                    data: np.ndarray = self.staging.view(slots[0])[: self.plan.page_bytes].copy()
                    return data
        return None

    def write_slot(self, key: bytes, data: np.ndarray) -> bool:
        """Store one page given as bytes (SGLang's generic path: one copy
        into a memory or staging slot in Python). Blocks."""
        if not self.writable:
            return True
        ok = [False]
        with self._dir_locks["store"]:
            todo = self._to_store([key], ok)
            kept = self._reserve_host([key])
            slots = [kept[0][1]] if kept else self._take_slots("store", 1) if todo else []
            if slots:
                self.staging.view(slots[0])[: self.plan.page_bytes] = data
                if todo:
                    self._store_slots([key], todo, slots, ok)
            self._end_host([key] if kept else [], True)
        return ok[0]

    def clear(self, wipe: Callable[[JobTier], None] | None = None) -> None:
        """Forget every page of these tiers that this rank can drop (disk:
        its records; Redis: what it remembers — the server keeps the values
        other engines may share; they expire by their TTL). ``wipe``: what
        clears each tier instead of its ``reset`` (the backend's clear:
        Redis values deleted too), with every call of this rank waiting, so
        that none of its stores straddles the clear. Blocks."""
        with self._dir_locks["store"], self._dir_locks["load"], self._lock:
            for t in self.tiers:
                self._drain(t)
                if wipe is None:
                    t.reset()
                else:
                    wipe(t)
            if self.host_pages is not None:
                self.host_pages.reset()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "page_bytes": self.plan.page_bytes,
                "staging_slots": self.staging.num_slots,
                **self.counters,
                **(self.host_pages.stats() if self.host_pages is not None else {}),
                "tiers": {t.name: t.stats() for t in self.tiers},
            }

    def close(self) -> None:
        """Let every job end, close the tiers and the copy engine, free the
        staging slots. Blocks; idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._dir_locks["store"], self._dir_locks["load"], self._lock:
            for t in self.tiers:
                t.close()
            self.copier.close()
            self.staging.close()
