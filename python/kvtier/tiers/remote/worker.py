"""Remote I/O in an engine worker: a :class:`~kvtier.tiers.remote.tier.RemoteTier`'s
values read and written by another process, and the spec that opens them.

:class:`RemoteReaderSpec` is made in the scheduler process (by
:meth:`RemoteTier.reader_spec`) and pickled to the engine's worker process,
where :class:`RemoteIO` runs with its own native client. Who calls: the
worker's stream loader (:mod:`kvtier.worker.streaming`), from its one driver
thread. Opening connects (blocks); :meth:`RemoteIO.submit` never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvtier.errors import ClosedError
from kvtier.tiers.base import ReaderSpec
from kvtier.tiers.remote.url import RemoteConnection

if TYPE_CHECKING:
    from kvtier import _native
    from kvtier.pool import HostPool

__all__ = ["RemoteIO", "RemoteReaderSpec"]


class RemoteIO:
    """Reads and writes a :class:`RemoteTier`'s values from another process
    (an engine worker streaming blocks between its KV cache and the pool)
    through slots of ``pool``, with its own native client. Every read checks
    the value's header (namespace, key digest, length, crc32c).

    Who calls: one thread of the worker. :meth:`submit` never blocks; results
    come from ``engine.poll()`` in completion order, one status per value.
    """

    def __init__(self, spec: RemoteReaderSpec, pool: HostPool, num_threads: int = 2) -> None:
        from kvtier.engine import Engine

        self.block_bytes = spec.block_bytes
        self.prefix = spec.prefix
        self.pool = pool
        self.store: _native.RemoteStore | None = spec.connection.open_store()
        self.engine = Engine(num_threads, [(256 << 20, False, 4 * spec.timeout_s)])
        self.engine.register_pool(pool)

    def submit(
        self, slots: Sequence[int], locations: np.ndarray, digests: bytes, write: bool = False
    ) -> int:
        """One job moving the values of ``digests`` (16 bytes each) from or
        to ``slots``; returns its engine job id."""
        if self.store is None:
            raise ClosedError("remote I/O is closed")
        n = len(slots)
        digs = np.frombuffer(digests, np.uint8).reshape(n, 16)
        skeys = [self.prefix + digests[16 * i : 16 * i + 16].hex().encode() for i in range(n)]
        addr = self.pool.address + np.asarray(slots, np.int64) * self.pool.slot_bytes
        kind = "store" if write else "load"
        return self.engine.submit_remote(self.store, kind, skeys, addr, self.block_bytes, digs)

    def close(self) -> None:
        """Drain what is in flight and disconnect. Blocks."""
        self.engine.close()
        self.store = None


@dataclass(frozen=True)
class RemoteReaderSpec(ReaderSpec):
    """What a worker needs to reach a remote tier's values: the pool
    (``connection``), the tier's ``block_bytes``, the ``prefix`` of its server
    keys and the tier's ``timeout_s`` (a worker's job may take four times it)."""

    connection: RemoteConnection
    block_bytes: int
    prefix: bytes
    timeout_s: float

    io: ClassVar[type[RemoteIO]] = RemoteIO
