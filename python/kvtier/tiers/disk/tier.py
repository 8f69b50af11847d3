"""The disk tier: a slab store on local NVMe, read and written by C++ worker
threads through io_uring (or pread/pwrite), never under the GIL.

Runs in the scheduler process. Who calls: the manager, under its lock, once
per step (``poll``) and when it cascades or promotes. Nothing here blocks
except construction (directory checks, preallocation, index recovery) and
:meth:`DiskTier.close`. Files: :mod:`kvtier.tiers.disk.directory` (slabs of
records with checked trailers) and :mod:`kvtier.tiers.disk.journal`; a record
is journaled only after its data write completed and every load re-checks its
trailer, so a crash can lose recent blocks but never serve wrong bytes. The
index is native (``_native.DiskIndex``: 31.5-44.5 bytes per record by policy,
chains kept across a restart); admission is Python's, per key (:class:`WriteGate`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.codes import ItemStatus
from kvtier.errors import InvalidArgument, IoError, NoSpace
from kvtier.options.tiers import DISK_POLICIES, DiskOptions, parse_disk_policy
from kvtier.policy.admission import WriteGate
from kvtier.tiers.base import LookupResult, TierCompletion, TierEvent
from kvtier.tiers.disk.directory import SlabFiles, check_directory
from kvtier.tiers.disk.journal import IndexJournal, JournalOp, RecordState
from kvtier.tiers.disk.shared import SharedRecords
from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.jobs import Batch, JobTier, count_moved
from kvtier.tiers.records import key_digest, namespace_digest, record_bytes
from kvtier.units import FreeFraction, to_capacity

__all__ = ["DISK_POLICIES", "DiskTier"]


class DiskTier(SharedRecords, JobTier):
    """Disk tier over ``capacity_bytes`` of preallocated slab files in ``path``.

    ``capacity_bytes``: bytes, a size string (``"100GiB"``) or a share of the
    file system's free space (``"80%"``, see :func:`resolve_capacity`). The
    slabs are allocated here, at construction, and only when the file system
    keeps ``reserve_bytes`` free beside them (default: 5% of its size, at
    most 4 GiB); else :class:`~kvtier.errors.NoSpace`, with nothing left
    behind. ``namespace`` names what makes bytes compatible (model, dtype,
    layout, rank); two namespaces sharing ``path`` never read each other's
    blocks. One process at a time owns a namespace's directory (an ``flock``
    held until :meth:`close`; a second opener gets :class:`~kvtier.errors.InUse`
    naming the owner's pid).
    Its settings are a :class:`~kvtier.options.tiers.DiskOptions` (``options``,
    or that class's fields given as keywords, which override it).
    ``policy``: ``lru``, ``clock``, ``clock:N`` or ``plfu`` (:data:`DISK_POLICIES`).
    ``event_id``: what names a record in removal events once its key is gone
    (the index keeps digests, not keys): a function of the key giving 12
    bytes (an 8-byte id, then a group index below 63, big-endian), or None
    to leave it unnamed; default :func:`~kvtier.tiers.events.vllm_event_id`
    (for a vLLM key: the block hash's last 8 bytes, vLLM's int block hash,
    and the group). The index keeps it (8 bytes a record) and the journal
    and checkpoint persist it, so evictions, drops and resets name every
    record they remove, recovered ones included (:attr:`TierEvent.ids`; a
    removal whose key is at hand names the key). Records without one
    (``None``, or recovered from files of an earlier format) are removed
    unnamed, counted in ``unnamed_removals``. ``event_log_keys``: the
    blocks of events not taken (:meth:`take_events`) held before the oldest
    are dropped (counted in ``events_dropped``).
    """

    @classmethod
    def from_options(
        cls, options: DiskOptions, block_bytes: int, *, namespace: str | bytes, name: str = "disk"
    ) -> DiskTier:
        """The tier ``options`` describe (their ``path`` must be set). Blocks
        while it checks and preallocates its directory."""
        if options.path is None:
            raise InvalidArgument("DiskOptions.path is None: no disk tier configured")
        return cls(
            options.path,
            options.capacity_bytes,
            block_bytes,
            namespace=namespace,
            name=name,
            options=options,
        )

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | str | FreeFraction,
        block_bytes: int,
        *,
        namespace: str | bytes = "default",
        name: str = "disk",
        event_id: Callable[[bytes], bytes | None] = vllm_event_id,
        options: DiskOptions | None = None,
        **settings: Any,
    ) -> None:
        # ``settings``: fields of DiskOptions, a keyword convenience over ``options``.
        o = replace(
            options or DiskOptions(),
            path=str(path),
            capacity_bytes=to_capacity("capacity_bytes", capacity_bytes),
            **settings,
        )
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        self.options = o
        # io_errors by errno name: a full file system told from a failing disk.
        self.io_error_codes: dict[str, int] = {}
        self._tier_init(
            name,
            "load_failures",
            "corrupt",
            "io_errors",
            "evictions",
            "budget_skips",
            "not_admitted",
            "nospace",
            "recovered",
            "unnamed_removals",
            event_log_keys=o.event_log_keys,
        )
        self.block_bytes = block_bytes
        self.record_bytes = record_bytes(block_bytes)
        root = Path(path)
        check_directory(root)
        self.ns = namespace_digest(namespace, block_bytes)
        self.dir = root / f"kvtier-{self.ns.hex()[:16]}"
        self.no_data = o.no_data
        # What this constructor creates, removed again if it fails.
        self._files = files = SlabFiles(self.dir, self.record_bytes)
        self.journal: IndexJournal | None = None
        try:
            files.open(o.capacity_bytes, o.reserve_bytes, o.no_data)
            self.num_records, self.per_file = files.num_records, files.per_file
            self.paths, self.file_bytes = files.paths, files.file_bytes
            self.job_records = max(1, o.job_bytes // self.record_bytes)
            self.policy, clock_max = parse_disk_policy(o.policy)
            if self.num_records >= 1 << 32:
                raise InvalidArgument(f"disk tier of {self.num_records} records: at most 2^32 - 1")
            self.gate = WriteGate(o.admit_after, o.write_budget_bps)
            from kvtier import _native

            self.index = _native.DiskIndex(self.num_records, self.policy, clock_max)
            self._hints: dict[bytes, bytes] = {}
            self._ready = self.index.ready_fn()  # lookup's test, without pybind11's dispatch
            self.event_id = event_id
            self._held = 0  # records out of use until a timed-out write ends
            self._ended_early: set[int] = set()  # such writes that ended before their batch
            self._released: list[int] = []  # host slots of timed-out jobs that ended
            self._nospace_until = 0.0
            self.engine: Any = None
            self.store: Any = None
            self.journal = IndexJournal(self.dir, block_bytes, self.num_records, o.sync)
            self.journal.recover(self.index)  # warm restart
            self.counters["recovered"] = self.index.rebuild()
        except BaseException:
            if self.journal is not None:
                self.journal.close()
            files.undo()
            raise
        files.keep()

    @staticmethod
    def slot_bytes_for(block_bytes: int) -> int:
        """Host slot size a pool needs for this tier (payload + trailer)."""
        return record_bytes(block_bytes)

    def attach(self, pool: Any) -> None:
        self.pool = pool
        if pool is None or self.no_data:
            self.no_data = True
            return
        # Slots with room for the trailer: one request per record (and coalescing);
        # slots of a 4 KiB-multiple block (vLLM's) send the trailer as a second request.
        trailer_in_slot = pool.slot_bytes >= self.record_bytes
        if not trailer_in_slot and (pool.slot_bytes < self.block_bytes or self.block_bytes % 4096):
            raise InvalidArgument(
                f"host slots of {pool.slot_bytes} B cannot hold a disk record of "
                f"{self.record_bytes} B (block + 4 KiB trailer), and the block is not a "
                f"multiple of 4 KiB: size the pool with DiskTier.slot_bytes_for({self.block_bytes})"
            )
        if pool.slot_bytes % 4096 or pool.address % 4096:
            raise InvalidArgument("host slots must be 4 KiB aligned for direct I/O")
        from kvtier import _native
        from kvtier.engine import Engine

        o = self.options
        self.store = _native.DiskStore(
            self.paths,
            self.file_bytes,
            o.backend,
            o.queue_depth,
            o.max_io_bytes,
            True,
            o.sync,
            self.ns,
            [(pool.address, pool.nbytes)],
            trailer_in_slot,
        )
        if self.store.note:
            warnings.warn(f"kvtier disk tier: {self.store.note}", stacklevel=2)
        self._backend, self._direct = str(self.store.backend), bool(self.store.direct)
        # Every job ends within timeout_s: a hung device fails it (the
        # records and host slots it touches stay out of use until it ends).
        self.engine = Engine(o.num_threads, [(o.inflight_bytes, False, o.timeout_s)])
        self.engine.register_pool(pool)
        self.jobs.engine = self.engine

    @property
    def free_records(self) -> int:
        """Records neither indexed nor held by a timed-out job."""
        return self.num_records - len(self.index) - self._held

    @property
    def rec_loading(self) -> np.ndarray:
        """Loads in flight per record (a copy, for tests and diagnostics: O(records))."""
        return self.index.loading_counts()

    @property
    def backend(self) -> str:
        return getattr(self, "_backend", "none (no data)")

    # -- journal ---------------------------------------------------------------
    def _journal(
        self,
        op: JournalOp,
        rec: int,
        dig: bytes,
        event_id: bytes | None = None,
        parent: bytes | None = None,
    ) -> None:
        """Buffer an entry; a PUT carries the record's event id and the record
        of its ``parent`` digest (its prefix link): a restart keeps both."""
        assert self.journal is not None
        prec = self.index.find(parent) if parent is not None else -1
        link = (prec, parent) if parent is not None and prec >= 0 and prec != rec else None
        self.journal.append(op, rec, dig, event_id, link)

    def _flush_journal(self) -> None:
        """Append the buffered entries; once an append failed (the file system
        full), stop admitting for a while and retry with a checkpoint."""
        j = self.journal
        assert j is not None
        if j.lost:
            j.discard()
            if time.monotonic() >= self._nospace_until or self._closed:
                with contextlib.suppress(NoSpace, IoError):
                    self.checkpoint()  # clears j.lost once it is written
                self._nospace_until = time.monotonic() + 1.0
            return
        if not j.flush():
            self.counters["nospace"] += 1
            self._nospace_until = time.monotonic() + 1.0  # stop admitting for a while
            return
        if j.entries > max(100_000, 4 * self.num_records):
            with contextlib.suppress(NoSpace, IoError):
                self.checkpoint()

    def checkpoint(self) -> None:
        """Snapshot the index and truncate the journal (crash safe at every
        point). Raises NoSpace or IoError, leaving the files as they were.

        Who calls: the tier itself when the journal grows past a bound, and
        users. Blocks while it writes and fsyncs 29 bytes per record."""
        assert self.journal is not None
        self.journal.checkpoint(self.index)

    # -- tier interface --------------------------------------------------------
    def lookup(self, key: bytes) -> LookupResult:
        return LookupResult.HIT if self._ready(key_digest(key)) else LookupResult.MISS

    def admit(self, key: bytes) -> bool:
        if time.monotonic() < self._nospace_until:
            self.counters["nospace"] += 1
            return False
        return self.gate.admit(key, self.record_bytes, self.counters)

    def _claim(self, dig: bytes, name: bytes | None, evicted: list[bytes]) -> int:
        """A record being written for ``dig`` (event id ``name``): a free
        one, else the policy's first victim neither being written nor read
        (its event id appended to ``evicted``). -2 when ``dig`` is stored or
        being stored, -1 when no record can be had."""
        rec, gone = self.index.claim(dig, name)
        if gone is not None:
            self.counters["evictions"] += 1
            if gone:
                evicted.append(gone)
            else:
                self.counters["unnamed_removals"] += 1
        return int(rec)

    def _removed(self, keys: list[bytes], ids: list[bytes]) -> None:  # one event naming them
        if keys or ids:
            self._events.append(TierEvent(keys, self.name, removed=True, ids=ids))

    def _forget(self, dig: bytes, rec: int, hold: bool = False) -> None:
        """``rec`` leaves the index: free now, or (``hold``) when its timed-out job ends."""
        self.index.remove(rec, hold)
        self._held += hold

    def _locate(self, rec: int) -> tuple[int, int]:
        return rec // self.per_file, (rec % self.per_file) * self.record_bytes

    def _submit(self, write: bool, batch: Batch) -> bool:
        """Engine jobs for one batch, split so both worker threads get work."""
        assert self.pool is not None
        d = batch.data
        n = batch.n
        arr = np.empty((n, 4), np.int64)
        r = np.asarray(d["io_recs"], np.int64)
        arr[:, 0] = self.pool.address + np.asarray(d["io_slots"], np.int64) * self.pool.slot_bytes
        arr[:, 1] = r // self.per_file
        arr[:, 2] = (r % self.per_file) * self.record_bytes
        arr[:, 3] = self.block_bytes
        digs = d["digs"]
        keys = np.frombuffer(b"".join(digs[i] for i in d["io_idx"]), np.uint8).reshape(n, 16)
        per = min(self.job_records, -(-n // self.options.num_threads))
        engine = self.engine

        fences = d.get("io_fences")

        def submit_one(first: int, count: int) -> int:
            end = first + count
            f = None if fences is None else fences[first:end]
            return int(
                engine.submit_disk(self.store, write, arr[first:end], keys[first:end], fences=f)
            )

        return self.jobs.submit(batch, per, submit_one, self.record_bytes)

    def _launch(
        self,
        kind: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        digs: list[bytes],
        recs: list[int | None],
        io_idx: list[int],
        ok: list[bool],
        fences: np.ndarray | None = None,
    ) -> Batch | None:
        """One batch over ``keys``: items ``io_idx`` move data (record
        ``recs[i]`` <-> host slot ``slots[i]``); it ends at once when there
        is no I/O. None when the engine was busy: nothing queued, the caller
        undoes its bookkeeping."""
        batch = self.jobs.batch(
            kind,
            0 if self.no_data else len(io_idx),
            keys=list(keys),
            digs=digs,
            recs=recs,
            slots=list(slots),
            ok=ok,
            io_idx=io_idx,
            io_recs=[recs[i] for i in io_idx],
            io_slots=[slots[i] for i in io_idx],
            io_fences=fences,
        )
        if batch.n == 0:
            self.jobs.end_now(batch)
            return batch
        return batch if self._submit(kind == "store", batch) else None

    def chain_hints(self, parents: Mapping[bytes, bytes]) -> None:
        """The next :meth:`submit_store`'s blocks' predecessors in their
        prefix chains (key -> parent key): a block linked to its parent's
        record keeps that record from eviction while it is here (the index's
        prefix-aware eviction). Who calls: the manager, just before the
        store, under its lock. Non-blocking."""
        self._hints = dict(parents)

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        self._check(keys, slots)
        digs = [key_digest(k) for k in keys]
        names = [self.event_id(k) for k in keys]
        ok = [False] * len(keys)
        recs: list[int | None] = [None] * len(keys)
        io_idx: list[int] = []
        evicted: list[bytes] = []
        hints, self._hints = self._hints, {}
        parents: list[bytes | None] = [None] * len(keys)
        for i, d in enumerate(digs):
            rec = self._claim(d, names[i], evicted)
            if rec < 0:
                ok[i] = rec == -2  # already stored (or being stored)
                continue
            recs[i] = rec
            io_idx.append(i)
            parent = hints.get(keys[i])
            if parent is not None:
                pdig = parents[i] = key_digest(parent)
                prec = self.index.find(pdig)
                if prec >= 0:
                    self.index.link(rec, prec)
        self._removed([], evicted)
        batch = self._launch("store", keys, slots, digs, recs, io_idx, ok)
        if batch is not None:
            batch.data["names"] = names
            batch.data["parents"] = parents
        if batch is None:
            for i in io_idx:  # backpressure: undo, nothing was queued
                undo = recs[i]
                assert undo is not None
                self._forget(digs[i], undo)
            self.counters["busy_drops"] += len(keys)
            return None
        return batch.token

    def submit_load(
        self, keys: Sequence[bytes], slots: Sequence[int], armed: np.ndarray | None = None
    ) -> int | None:
        self._check(keys, slots)
        digs = [key_digest(k) for k in keys]
        recs: list[int | None] = [None] * len(keys)
        io_idx: list[int] = []
        for i, d in enumerate(digs):
            rec = self.index.pin_ready(d)  # pinned: not evicted while it loads
            if rec < 0:
                continue
            recs[i] = rec
            io_idx.append(i)
        fences = None
        if armed is not None:
            assert self.pool is not None
            io_slots = np.asarray([slots[i] for i in io_idx], np.int64)
            fences = self.pool.fences(io_slots, np.asarray(armed, np.int64)[io_idx])
        batch = self._launch(
            "load", keys, slots, digs, recs, io_idx, [False] * len(keys), fences=fences
        )
        if batch is None:
            for i in io_idx:
                pinned = recs[i]
                assert pinned is not None
                self.index.unpin(pinned)
            return None
        if armed is not None:
            # What no record holds is read by no job: its fence fails now.
            assert self.pool is not None
            held = set(io_idx)
            for i, a in enumerate(np.asarray(armed, np.int64).tolist()):
                if i not in held and a:
                    self.pool.settle_fence(slots[i], a, False)
        return batch.token

    @property
    def can_fence(self) -> bool:  # type: ignore[override]
        return not self.no_data and self.pool is not None

    def submit_fenced_load(
        self, keys: Sequence[bytes], slots: Sequence[int], armed: np.ndarray
    ) -> int | None:
        """See :meth:`LowerTier.submit_fenced_load`: each engine job settles
        its records' fences once they were read and checked (a read is
        spread over the worker threads, so the first records are ready while
        later ones are read); a key no record holds fails its fence at once."""
        if not self.can_fence:
            return None
        return self.submit_load(keys, slots, armed)

    def _drop_unreadable(self, rec: int, dig: bytes, key: bytes | None = None) -> None:
        """A read of ``rec`` (holding ``dig``: ``key``, when known) failed:
        counted, and the record dropped unless another read still has it or
        it was reused since."""
        self.counters["load_failures"] += 1
        ix = self.index
        if ix.state(rec) == RecordState.READY and ix.loading(rec) == 0 and ix.holds(rec, dig):
            name = ix.event_id(rec) if key is None else None
            self._forget(dig, rec)
            self._journal(JournalOp.DROP, rec, dig)
            if key is None and name is None:
                self.counters["unnamed_removals"] += 1
            self._removed([] if key is None else [key], [] if name is None else [name])

    def poll(self) -> list[TierCompletion]:
        j = self.journal  # every engine step: nothing in flight nor buffered, nothing to do
        if not self.jobs.busy() and not (j is not None and j.pending):
            return []
        ended, released = self.jobs.poll()
        for rel in released:  # a timed-out job really ended: its memory is free
            d = rel.batch.data
            idx = d["io_idx"][rel.first : rel.first + rel.count]
            if rel.batch.kind == "store":  # a late write may have landed in these records
                for i in idx:
                    rec = d["recs"][i]
                    state = self.index.state(rec)
                    if state == RecordState.HELD:
                        self.index.release(rec)
                        self._held -= 1
                    elif state == RecordState.WRITING:  # its batch has not ended: free it then
                        self._ended_early.add(rec)
            self._released.extend(d["slots"][i] for i in idx)
        out = [self._finish(b) for b in ended]
        self._flush_journal()
        return out

    def _finish(self, b: Batch) -> TierCompletion:
        d = b.data
        keys, digs, recs, ok = d["keys"], d["digs"], d["recs"], d["ok"]
        names: list[bytes | None] = d.get("names") or [None] * len(keys)
        parents: list[bytes | None] = d.get("parents") or [None] * len(keys)
        held = [False] * len(keys)
        stored: list[bytes] = []
        loaded = 0
        for k, i in enumerate(d["io_idx"]):
            rec, dig = recs[i], digs[i]
            code = b.items[k] if b.n else 0  # no-data mode: the index only
            held[i] = b.held[k] if b.n else False
            if b.kind == "store":
                if code == 0:
                    self.index.set_ready(rec)
                    self._journal(JournalOp.PUT, rec, dig, names[i], parents[i])
                    ok[i] = True
                    stored.append(keys[i])
                else:
                    if code == ItemStatus.NO_SPACE:  # stop admitting for a while
                        self._nospace_until = time.monotonic() + 1.0
                    self.count_io_error(code)
                    hold = held[i] and rec not in self._ended_early  # freed when the job ends
                    self._ended_early.discard(rec)
                    self._forget(dig, rec, hold=hold)
            else:
                self.index.unpin(rec)
                if code == 0:
                    ok[i] = True
                    self.index.touch(rec)
                    loaded += 1
                else:
                    # Torn, foreign or unreadable: a miss, counted, and dropped.
                    if code < 0:
                        self.counters["corrupt"] += 1
                    else:
                        self.count_io_error(code)
                    self._drop_unreadable(rec, dig, keys[i])
        count_moved(self.counters, "store", len(stored), self.record_bytes)
        count_moved(self.counters, "load", loaded, self.record_bytes)
        if stored:
            self._events.append(TierEvent(stored, self.name, removed=False))
        return TierCompletion(
            b.token, all(ok), b.kind, keys, key_ok=list(ok), held=held if any(held) else None
        )

    def has_pending_work(self) -> bool:
        return self.jobs.busy()

    def take_released_slots(self) -> list[int]:
        out, self._released = self._released, []
        return out

    def reset(self) -> None:
        """Drop every readable record not being loaded (each named in a
        removal event); records being written or loaded stay."""
        ix, ids = self.index, []
        for rec in ix.ready_records().tolist():
            if ix.loading(rec) == 0:
                dig, name = ix.digest(rec), ix.event_id(rec)
                self._forget(dig, rec)
                self._journal(JournalOp.DROP, rec, dig)
                if name is None:
                    self.counters["unnamed_removals"] += 1
                else:
                    ids.append(name)
        self._removed([], ids)
        self._flush_journal()

    def _release(self) -> None:
        self._flush_journal()
        assert self.journal is not None
        self.journal.close()
        # The native store holds the extent files open: let go of them now,
        # not whenever the tier object is collected (an unmount waits on it).
        self.store = None
        self._files.release()  # after the files: the next owner may start now

    def count_io_error(self, code: int | None) -> None:
        """One record's read or write failed with errno ``code`` (None: a
        worker's own write, whose errno it keeps): counted in ``io_errors``
        and by name in ``io_error_codes``."""
        self.counters["io_errors"] += 1
        name = "worker write" if code is None else errno.errorcode.get(code, str(code))
        self.io_error_codes[name] = self.io_error_codes.get(name, 0) + 1

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "direct": getattr(self, "_direct", None),
            "blocks": len(self.index),
            "capacity_blocks": self.num_records,
            "held_jobs": self.jobs.held_jobs,
            "events_dropped": self._events.dropped,
            **self.counters,
            "io_error_codes": dict(self.io_error_codes),
        }
