"""Disk I/O in an engine worker: reads and writes of a disk tier's records
owned by another process, and the spec that opens them.

:class:`DiskReaderSpec` is made in the scheduler process (by
:meth:`DiskTier.reader_spec`) and pickled to the engine's worker process,
where :class:`DiskIO` runs. Who calls: the worker's stream loader
(:mod:`kvtier.worker.streaming`), from its one driver thread. Opening the files
blocks briefly; :meth:`DiskIO.submit` never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvtier.errors import ClosedError, InvalidArgument
from kvtier.tiers.base import ReaderSpec
from kvtier.tiers.records import record_bytes

if TYPE_CHECKING:
    from kvtier.pool import HostPool

__all__ = ["DiskIO", "DiskReaderSpec"]


class DiskIO:
    """Reads and writes records of a :class:`DiskTier` owned by another
    process (the engine's scheduler) from and to slots of ``pool``: an engine
    worker streaming blocks between its KV cache and the disk. The owner pins
    the records (:meth:`DiskTier.pin_for_read`, :meth:`DiskTier.reserve_for_write`)
    for as long as the I/O may run; every read re-checks the record's
    trailer (namespace, key digest, length, crc32c), so a record that changed
    under it fails rather than serving wrong bytes; a write builds the
    trailer in the slot.

    Who calls: one thread of the worker. :meth:`submit` never blocks; results
    come from ``engine.poll()`` in completion order, one status per record.
    """

    def __init__(self, spec: DiskReaderSpec, pool: HostPool, num_threads: int = 2) -> None:
        from kvtier import _native
        from kvtier.engine import Engine

        need = record_bytes(spec.block_bytes)
        if pool.slot_bytes < need or pool.slot_bytes % 4096:
            raise InvalidArgument(
                f"reader slots of {pool.slot_bytes} B cannot hold a record of {need} B"
            )
        self.block_bytes = spec.block_bytes
        self.pool = pool
        self.store: _native.DiskStore | None = _native.DiskStore(
            list(spec.paths),
            spec.file_bytes,
            spec.backend,
            32,
            1 << 20,
            True,
            False,
            spec.ns,
            [(pool.address, pool.nbytes)],
            True,
        )
        # Queue 1 is serial: the byte ranges of a record read range by range
        # (submit_range) arrive in submission order, the last one checking
        # the record whole.
        self.engine = Engine(
            num_threads, [(256 << 20, False, spec.timeout_s), (256 << 20, True, spec.timeout_s)]
        )
        self.engine.register_pool(pool)

    def submit(
        self, slots: Sequence[int], locations: np.ndarray, digests: bytes, write: bool = False
    ) -> int:
        """One job reading record ``locations[i]`` (record, file, offset)
        into slot ``slots[i]`` (or writing it from there); returns its engine job id."""
        if self.store is None:
            raise ClosedError("disk reader is closed")
        arr, keys = self._records(slots, locations, digests)
        return self.engine.submit_disk(self.store, write, arr, keys)

    def submit_range(
        self, slots: Sequence[int], locations: np.ndarray, digests: bytes, lo: int, hi: int
    ) -> int:
        """One job reading bytes ``[lo, hi)`` (4 KiB aligned) of each record
        into the same bytes of its slot, after this reader's earlier ranges
        (one serial queue); returns its engine job id. Its per-record
        statuses say only that the range was read, except for a range ending
        at the record's end: that one checks the whole slot as a record, so
        it is submitted after the record's other ranges. Never blocks."""
        if self.store is None:
            raise ClosedError("disk reader is closed")
        arr, keys = self._records(slots, locations, digests)
        return self.engine.submit_disk_range(self.store, arr, keys, lo, hi, queue=1)

    def _records(
        self, slots: Sequence[int], locations: np.ndarray, digests: bytes
    ) -> tuple[np.ndarray, np.ndarray]:
        n = len(slots)
        arr = np.empty((n, 4), np.int64)
        arr[:, 0] = self.pool.address + np.asarray(slots, np.int64) * self.pool.slot_bytes
        arr[:, 1:3] = locations[:, 1:3]
        arr[:, 3] = self.block_bytes
        return arr, np.frombuffer(digests, np.uint8).reshape(n, 16)

    def close(self) -> None:
        """Drain the reads in flight and let go of the files. Blocks."""
        self.engine.close()
        self.store = None


@dataclass(frozen=True)
class DiskReaderSpec(ReaderSpec):
    """What a worker needs to open a disk tier's slab files: their ``paths``
    (each of ``file_bytes``), the tier's namespace digest ``ns`` (checked in
    every trailer), its ``block_bytes``, the I/O ``backend`` (``auto``,
    ``io_uring`` or ``pread``) and the deadline of one job (``timeout_s``)."""

    paths: tuple[str, ...]
    file_bytes: int
    ns: bytes
    block_bytes: int
    backend: str
    timeout_s: float

    io: ClassVar[type[DiskIO]] = DiskIO
