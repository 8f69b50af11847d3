"""The disk tier's records read and written by another process: an engine
worker streaming a hit the host tier has no room for, or storing blocks it
holds alone.

Process: the engine's scheduler (these methods run there, under the
manager's lock; the I/O itself runs in the worker, :mod:`.worker`). Who
calls: the manager's streams (:mod:`kvtier.scheduler.streams`). Never
blocks: records are pinned, reserved and committed in the index only.
:class:`SharedRecords` is a base class of
:class:`~kvtier.tiers.disk.tier.DiskTier`: the part of its interface another
process's I/O goes through, kept apart from the tier's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.options.tiers import DiskOptions
from kvtier.tiers.base import TierEvent
from kvtier.tiers.disk.journal import JournalOp, RecordState
from kvtier.tiers.disk.worker import DiskReaderSpec
from kvtier.tiers.events import EventLog
from kvtier.tiers.jobs import count_moved
from kvtier.tiers.records import key_digest

if TYPE_CHECKING:
    from kvtier._native import DiskIndex


class SharedRecords:
    """A disk tier's records lent to another process to read or write
    itself: pinned, reserved and committed here, moved by the worker's
    :class:`~kvtier.tiers.disk.worker.DiskIO`. What it uses of the tier is
    declared below; :class:`~kvtier.tiers.disk.tier.DiskTier` provides it."""

    # The tier's state these methods read (DiskTier sets every one).
    options: DiskOptions
    no_data: bool
    store: Any
    index: DiskIndex
    paths: list[str]
    file_bytes: int
    ns: bytes
    block_bytes: int
    record_bytes: int
    name: str
    counters: dict[str, int]
    event_id: Callable[[bytes], bytes | None]
    _events: EventLog

    # The tier's own bookkeeping these methods share (DiskTier's methods).
    def _locate(self, rec: int) -> tuple[int, int]:
        raise NotImplementedError

    def _claim(self, dig: bytes, name: bytes | None, evicted: list[bytes]) -> int:
        raise NotImplementedError

    def _removed(self, keys: list[bytes], ids: list[bytes]) -> None:
        raise NotImplementedError

    def _journal(
        self,
        op: JournalOp,
        rec: int,
        dig: bytes,
        event_id: bytes | None = None,
        parent: bytes | None = None,
    ) -> None:
        raise NotImplementedError

    def _forget(self, dig: bytes, rec: int, hold: bool = False) -> None:
        raise NotImplementedError

    def _drop_unreadable(self, rec: int, dig: bytes, key: bytes | None = None) -> None:
        raise NotImplementedError

    def admit(self, key: bytes) -> bool:
        raise NotImplementedError

    def count_io_error(self, code: int | None) -> None:
        raise NotImplementedError

    def reader_spec(self) -> DiskReaderSpec | None:
        """What a :class:`DiskIO` in another process needs to read and write
        this tier's records (None without data: nothing to read)."""
        if self.no_data or self.store is None:
            return None
        o = self.options
        return DiskReaderSpec(
            tuple(self.paths),
            self.file_bytes,
            self.ns,
            self.block_bytes,
            o.backend,
            o.timeout_s,
        )

    def pin_for_read(self, keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
        """Locations of ``keys`` (all HIT) as ``(n, 3)`` int64 of record,
        file, offset, and their digests (16 bytes each, concatenated). The
        records are neither evicted nor reused until :meth:`unpin_read` of the
        same record numbers. Counts as a use for the eviction policy."""
        out = np.empty((len(keys), 3), np.int64)
        digs = [key_digest(k) for k in keys]
        for i, d in enumerate(digs):
            rec = self.index.get(d)
            if rec is None or self.index.state(rec) != RecordState.READY:
                raise InvalidArgument(f"pin_for_read of a key that is not a HIT: {d.hex()[:16]}")
            out[i] = (rec, *self._locate(rec))
        for rec in out[:, 0].tolist():
            self.index.pin(rec)
            self.index.touch(rec)
        return out, b"".join(digs)

    def unpin_read(self, records: Sequence[int]) -> None:
        """The reads of ``records`` pinned by :meth:`pin_for_read` ended."""
        for rec in records:
            self.index.unpin(int(rec))

    def read_failed(self, locations: np.ndarray, digests: bytes) -> None:
        for i, loc in enumerate(locations):
            self._drop_unreadable(int(loc[0]), digests[16 * i : 16 * i + 16])

    def reserve_for_write(self, keys: Sequence[bytes]) -> list[tuple[int, np.ndarray, bytes]]:
        """Records for ``keys`` that another process writes itself (an engine
        worker storing blocks the host tier has no room for): per key that
        is admitted, not stored yet and gets a record, ``(position in keys,
        location (record, file, offset), digest)``. Each stays unreadable
        until :meth:`commit_write`; may evict (reported as events)."""
        out: list[tuple[int, np.ndarray, bytes]] = []
        evicted: list[bytes] = []
        for i, k in enumerate(keys):
            d = key_digest(k)
            if d in self.index or not self.admit(k):
                continue
            rec = self._claim(d, self.event_id(k), evicted)
            if rec < 0:
                break
            out.append((i, np.array([rec, *self._locate(rec)], np.int64), d))
        self._removed([], evicted)
        return out

    def commit_write(self, key: bytes, record: int, ok: bool) -> None:
        """The write of ``record`` reserved for ``key`` ended: readable (and
        journaled) when ``ok``, else the record is free again."""
        d = key_digest(key)
        if self.index.state(record) != RecordState.WRITING or not self.index.holds(record, d):
            return  # not ours any more (reset)
        if ok:
            self.index.set_ready(record)
            self._journal(JournalOp.PUT, record, d, self.index.event_id(record))
            count_moved(self.counters, "store", 1, self.record_bytes)
            self._events.append(TierEvent([key], self.name, removed=False))
        else:
            self.count_io_error(None)
            self._forget(d, record)
