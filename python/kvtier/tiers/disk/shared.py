"""The disk tier's records read and written by another process: an engine
worker streaming a hit the host tier has no room for, or storing blocks it
holds alone.

Process: the engine's scheduler (these methods run there, under the
manager's lock; the I/O itself runs in the worker, :mod:`.worker`). Who
calls: the manager's streams (:mod:`kvtier.scheduler.streams`). Never
blocks: records are pinned, reserved and committed in the index only.
These functions are :class:`~kvtier.tiers.disk.tier.DiskTier`'s methods
(assigned in its class body), kept apart from its own I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import TierEvent
from kvtier.tiers.disk.journal import JournalOp, RecordState
from kvtier.tiers.disk.worker import DiskReaderSpec
from kvtier.tiers.jobs import count_moved
from kvtier.tiers.records import key_digest

if TYPE_CHECKING:
    from kvtier.tiers.disk.tier import DiskTier


def reader_spec(self: DiskTier) -> DiskReaderSpec | None:
    """What a :class:`DiskIO` in another process needs to read and write
    this tier's records (None without data: nothing to read)."""
    if self.no_data or self.store is None:
        return None
    o = self.options
    return DiskReaderSpec(
        tuple(self.paths), self.file_bytes, self.ns, self.block_bytes, o.backend,
        o.timeout_s,
    )  # fmt: skip


def pin_for_read(self: DiskTier, keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
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


def unpin_read(self: DiskTier, records: Sequence[int]) -> None:
    """The reads of ``records`` pinned by :meth:`pin_for_read` ended."""
    for rec in records:
        self.index.unpin(int(rec))


def read_failed(self: DiskTier, locations: np.ndarray, digests: bytes) -> None:
    for i, loc in enumerate(locations):
        self._drop_unreadable(int(loc[0]), digests[16 * i : 16 * i + 16])


def reserve_for_write(self: DiskTier, keys: Sequence[bytes]) -> list[tuple[int, np.ndarray, bytes]]:
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


def commit_write(self: DiskTier, key: bytes, record: int, ok: bool) -> None:
    """The write of ``record`` reserved for ``key`` ended: readable (and
    journaled) when ``ok``, else the record is free again."""
    d = key_digest(key)
    if self.index.state(record) != RecordState.WRITING or self.index.digest(record) != d:
        return  # not ours any more (reset)
    if ok:
        self.index.set_ready(record)
        self._journal(JournalOp.PUT, record, d, self.index.event_id(record))
        count_moved(self.counters, "store", 1, self.record_bytes)
        self._events.append(TierEvent([key], self.name, removed=False))
    else:
        self.counters["io_errors"] += 1
        self._forget(d, record)
