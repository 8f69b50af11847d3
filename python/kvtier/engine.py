"""The native engine: job queues served by C++ worker threads.

Runs in any process that moves bytes (the scheduler's tiers, an engine
worker's transfers and stream readers). Who calls: tiers and device
transfers submit jobs; the manager drains completions with
:meth:`Engine.poll` once per scheduler step. ``submit_*`` never blocks (it
raises :class:`kvtier.Busy` when the queue's byte budget is full);
:meth:`Engine.wait` blocks with the GIL released and honours Ctrl-C. This is
the only module that touches ``_native.Engine``: everyone else goes through
these methods.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvtier import _native
from kvtier.errors import InvalidArgument
from kvtier.pool import HostPool

JobResult = _native.JobResult
"""``(job_id, ok, error, nbytes, seconds)`` of one finished job (iterable)."""


def crc32c(data: Any, crc: int = 0) -> int:
    """crc32c (Castagnoli) of a C-contiguous buffer, extending ``crc``. Releases the GIL."""
    return int(_native.crc32c(data, crc))


# The niceness of the remote tier's worker threads, unless told
# (``RemoteTier(worker_nice=...)``, or ``KVTIER_IO_NICE`` for a whole
# process, an engine's included). Measured against a redis-server on the
# same two cores: see the README's "Redis and Valkey" section.
IO_NICE = 10


def io_nice(given: int | None = None) -> int:
    """The niceness for background I/O workers: ``given`` when not None,
    else ``KVTIER_IO_NICE`` when set, else :data:`IO_NICE`. Raises
    InvalidArgument for anything outside 0..19 (before anything connects)."""
    if given is not None:
        if not 0 <= given <= 19:
            raise InvalidArgument(f"worker_nice must be in 0..19, got {given}")
        return given
    text = os.environ.get("KVTIER_IO_NICE")
    if text is None:
        return IO_NICE
    try:
        nice = int(text)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise InvalidArgument(f"KVTIER_IO_NICE must be an integer in 0..19, got {text!r}")
    return nice


class Engine:
    """Worker threads plus one or more bounded queues.

    ``queues`` is a list of ``(budget_bytes, serial[, deadline_s])``:
    ``budget_bytes`` of jobs may be in flight per queue before submit says
    Busy; a serial queue runs its jobs one at a time, in submission order; a
    job not finished ``deadline_s`` after submit is reported failed with
    ``timed_out`` (and ``held`` if it had started: the memory it touches stays
    in use until a later result for the same id with ``released``).

    Jobs are submitted with one method per medium, each taking that medium's
    descriptors: :meth:`submit_copy` (host memcpy), :meth:`submit_cuda`
    (host <-> device), :meth:`submit_disk` (a ``DiskStore``'s records),
    :meth:`submit_remote` (a ``RemoteStore``'s values), :meth:`submit_sleep`
    (tests); :meth:`copy_inline` copies on the calling thread (a baseline).

    ``nice`` (0..19) is the niceness of the worker threads: the remote tier
    runs its at :func:`io_nice` (10 unless told) so that background I/O takes a
    core only when no thread of the engine's (or a server on the same
    machine) wants it; host/device copies, on a request's critical path,
    stay at 0.
    """

    def __init__(
        self,
        num_threads: int = 2,
        queues: Sequence[tuple[int, bool] | tuple[int, bool, float]] = ((1 << 30, False),),
        nice: int = 0,
    ) -> None:
        self._engine = _native.Engine(num_threads, list(queues), nice)
        self._budgets = [int(q[0]) for q in queues]
        self._regions: dict[int, Any] = {}

    @property
    def nice(self) -> int:
        """The worker threads' niceness."""
        return int(self._engine.nice)

    def register_pool(self, pool: HostPool | Any) -> None:
        """Allow jobs to touch ``pool``'s slots and fence words, if it has
        them (keeps the mapping alive until unregistered)."""
        owner = getattr(pool, "native", pool)
        self.register_memory(pool.address, pool.nbytes, owner=owner)
        if isinstance(pool, HostPool):  # not a view of another's memory
            self.register_memory(pool.fence_address, pool.fence_bytes, owner=owner)

    def register_memory(self, address: int, nbytes: int, owner: Any = None) -> None:
        """Allow jobs to touch ``[address, address + nbytes)``; ``owner`` is kept alive meanwhile."""
        self._engine.register_region(address, nbytes)
        self._regions[address] = owner

    def unregister_memory(self, address: int) -> None:
        """Forbid the region again; blocks until no job can still be using it."""
        self._engine.unregister_region(address)
        self._regions.pop(address, None)

    def submit_copy(
        self, descs: np.ndarray, queue: int = 0, fences: np.ndarray | None = None
    ) -> int:
        """Queue host copies from an ``(N, 3)`` int64 array of ``(src, dst, nbytes)``.

        ``fences``: ``(N, 2)`` int64 (fence word, armed value; see
        :meth:`HostPool.fences`): each copy waits for its source slot's write.
        Returns the job id. Raises InvalidArgument for bad descriptors (outside
        registered memory, size <= 0, overlapping) and Busy when full.
        """
        return int(self._engine.submit_copy(descs, queue, fences))

    def submit_cuda(
        self,
        copier: _native.CudaCopier,
        direction: int,
        descs: np.ndarray,
        wait_stream: int = 0,
        deps: Sequence[int] = (),
        queue: int = 0,
        fences: np.ndarray | None = None,
    ) -> int:
        """Queue copies between device memory and registered host memory on
        ``copier``'s stream ``direction`` (0 store: device -> host, 1 load,
        2 expedited load), from an ``(N, 3)`` int64 array of ``(src, dst, nbytes)``.

        The copies are enqueued on the stream now (after the work so far of the
        compute stream ``wait_stream``, 0 being the device's legacy default
        stream, and after the still running jobs ``deps``); the job ends, for :meth:`poll` and
        :meth:`wait`, once the GPU has passed them. Put one direction's jobs on
        one serial queue so that they are reported in stream order. With
        ``fences`` (as for :meth:`submit_copy`) the copies are enqueued by a
        worker once their source slots are filled instead. Returns the
        job id. Raises InvalidArgument when the host side lies outside the
        copier's registered pool or this engine's registered memory or the
        device side outside the copier's device memory, CudaError
        when the runtime cannot create the job's events, Busy when full.
        """
        return int(
            self._engine.submit_cuda(
                copier, direction, descs, wait_stream, list(deps), queue, fences
            )
        )

    def submit_disk(
        self,
        store: _native.DiskStore,
        write: bool,
        records: np.ndarray,
        digests: np.ndarray,
        queue: int = 0,
        fences: np.ndarray | None = None,
    ) -> int:
        """Queue reads (or, ``write``, writes) of disk records between
        ``store``'s slab files and registered host memory: ``records`` is
        ``(N, 4)`` int64 of (host address, file, offset, payload bytes),
        ``digests`` ``(N, 16)`` uint8 key digests checked against (or written
        into) each record's trailer. With ``fences`` (reads only; ``(N, 2)``
        int64 of fence word address and armed value, :meth:`HostPool.fences`)
        each record's slot fence is settled once the job read and checked it.
        Returns the job id; per-item codes come with its result. Raises
        InvalidArgument for bad descriptors, Busy when full."""
        return int(self._engine.submit_disk(store, write, records, digests, queue, fences))

    def submit_disk_range(
        self,
        store: _native.DiskStore,
        records: np.ndarray,
        digests: np.ndarray,
        lo: int,
        hi: int,
        queue: int = 0,
    ) -> int:
        """Queue reads of bytes ``[lo, hi)`` (4 KiB aligned) of each record
        into the same bytes of its host memory (``records`` and ``digests``
        as for :meth:`submit_disk`). A range ending at the record's end
        checks the whole record in memory, so on a serial queue it goes
        after the record's other ranges; the others' codes say only that
        they were read. Returns the job id; raises as :meth:`submit_disk`."""
        return int(self._engine.submit_disk_range(store, records, digests, lo, hi, queue))

    def submit_remote(
        self,
        store: _native.RemoteStore,
        kind: str,
        keys: Sequence[bytes],
        slots: np.ndarray,
        payload_bytes: int,
        digests: np.ndarray,
        queue: int = 0,
        fences: np.ndarray | None = None,
        commands: Sequence[Sequence[bytes]] | None = None,
    ) -> int:
        """Queue one pipelined batch of ``kind`` (``store``, ``load``,
        ``exists`` or ``command``: ``commands`` holds each key's whole command,
        its arguments, sent to the node of that key; any reply but an error
        succeeds) for the server ``keys`` of ``store``, their values of
        ``payload_bytes`` at the host addresses ``slots`` (int64, one per
        key), checked against ``digests`` (``(N, 16)`` uint8). ``fences`` (as
        for :meth:`submit_copy`, loads only): each slot's fence is settled when
        the job ends. Returns the job id. Raises InvalidArgument, Busy when full."""
        return int(
            self._engine.submit_remote(
                store, kind, keys, slots, payload_bytes, digests, queue, fences, commands
            )
        )

    def copy_inline(self, descs: np.ndarray) -> None:
        """The copies of an ``(N, 3)`` int64 array of ``(src, dst, nbytes)``
        done now, on the calling thread (no job: a baseline for benchmarks).
        Blocks."""
        self._engine.copy_inline(descs)

    def submit_sleep(self, seconds: float, nbytes: int = 0, fail: str = "", queue: int = 0) -> int:
        """Queue a job that sleeps then succeeds (or fails with ``fail``): for tests and drills."""
        return int(self._engine.submit_sleep(seconds, nbytes, fail, queue))

    def poll(self) -> list[Any]:
        """Every job finished since the last poll, in completion order (non-blocking)."""
        return list(self._engine.poll())

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until all ``job_ids`` finished (results stay for :meth:`poll`).

        Raises :class:`kvtier.Timeout` after ``timeout`` seconds and
        KeyboardInterrupt on Ctrl-C.
        """
        self._engine.wait(list(job_ids), -1.0 if timeout is None else float(timeout))

    def in_flight_bytes(self, queue: int = 0) -> int:
        return int(self._engine.in_flight_bytes(queue))

    def budget(self, queue: int = 0) -> int:
        """The bytes ``queue`` may hold in flight before submit says Busy."""
        return self._budgets[queue]

    @property
    def closed(self) -> bool:
        return bool(self._engine.closed)

    def close(self, cancel: bool = False) -> None:
        """Drain (or cancel) queued jobs and join the threads. Blocks; idempotent."""
        self._engine.close(cancel)
        self._regions.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
