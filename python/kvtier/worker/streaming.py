"""StreamLoader: the worker side of a load whose blocks stay in a lower tier.

A hit in the disk tier that finds no room in the host tier (a prefix longer
than the host tier, or a host tier full of other hits) is not promoted
through host slots: the engine's worker reads the records itself into a
small private staging ring and copies them into its KV cache from there,
ring slot by ring slot. So a request's hit never has to fit in the host tier
at once, and its load is one pipeline (read, copy, reuse the slot) instead
of a promotion, a scheduler step, then a load.

Process: the engine's worker. Who calls: vLLM's OffloadingWorker, one thread.
:meth:`StreamLoader.submit` never blocks; a driver thread of the loader moves
the bytes (it waits on native jobs with the GIL released, so it does not
depend on the engine stepping); :meth:`StreamLoader.get_finished` returns
finished jobs in completion order; :meth:`StreamLoader.wait` blocks.
Integrity: every read re-checks the record (namespace, key digest, length,
crc32c); a failed read fails its job (the engine recomputes), never serves
other bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import ClosedError, InvalidArgument, KvtierError, Timeout
from kvtier.jobs import Joined
from kvtier.pool import HostPool
from kvtier.tiers.base import ReaderSpec, TierIO
from kvtier.worker.transfer import DeviceTransfer, TransferResult

__all__ = ["StreamChunk", "StreamLoader"]


@dataclass
class StreamChunk:
    """One chunk of a load: KV-cache group, its engine block ids (``first``:
    logical index of ``blocks[0]`` in its request), where it lies in which
    tier (record, file, offset) and its 16-byte key digest."""

    group: int
    blocks: np.ndarray
    first: int
    tier: str
    location: np.ndarray
    digest: bytes


@dataclass
class _Job:
    job_id: int
    store: bool  # KV cache -> tier (else tier -> KV cache)
    chunks: list[StreamChunk]
    readers: Mapping[str, ReaderSpec]
    left: int
    start: float = field(default_factory=time.monotonic)
    ok: bool = True
    nbytes: int = 0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class StreamLoader:
    """Reads chunks from lower tiers into a ring of ``num_slots`` staging
    slots and copies them into the KV tensors of each group.

    ``groups``: per KV-cache group, its tensors and page bytes (as for
    :class:`~kvtier.worker.transfer.DeviceTransfer`); ``slot_bytes`` the size of a
    record (block plus trailer); ``slot_offset`` this worker's cell inside a
    block shared by tensor-parallel ranks.
    """

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[Any], Sequence[int]]],
        *,
        blocks_per_chunk: int,
        slot_bytes: int,
        slot_offset: int = 0,
        num_slots: int = 32,
        wait_slice_s: float = 0.05,
    ) -> None:
        if num_slots < 1:
            raise InvalidArgument(f"stream staging slots must be >= 1, got {num_slots}")
        self.pool = HostPool(num_slots, slot_bytes)
        self.transfers = [
            DeviceTransfer(tensors, self.pool, blocks_per_chunk=blocks_per_chunk,
                           page_bytes=list(pages), slot_offset=slot_offset, num_threads=1)
            for tensors, pages in groups
        ]  # fmt: skip
        self._readers: dict[str, TierIO] = {}
        # Reads go in jobs of a quarter of the ring, so the first copies
        # overlap the later reads (measured, 62 chunks of 128 KiB from this
        # machine's disk: one job for all then one copy took 14.6 ms against
        # 12.4 ms for the reads alone).
        self._per_job = max(1, min(16, num_slots // 4))
        self.bpc = blocks_per_chunk
        self._slice = wait_slice_s
        self._cv = threading.Condition()
        self._incoming: list[_Job] = []
        self._finished: list[TransferResult] = []
        self._jobs: dict[int, _Job] = {}
        self._closing = False
        self._next_sub = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-stream", daemon=True)
        self._thread.start()

    # -- the worker's calls ---------------------------------------------------
    def submit(
        self,
        job_id: int,
        chunks: list[StreamChunk],
        readers: Mapping[str, ReaderSpec],
        store: bool = False,
    ) -> None:
        """Queue a job moving ``chunks`` from their tier into the KV cache (or,
        with ``store``, from the KV cache to their tier; the tier reserved
        their records); its result comes from :meth:`get_finished`."""
        with self._cv:
            if self._closing:
                raise ClosedError("stream loader is shut down")
            if job_id in self._jobs:
                raise InvalidArgument(f"stream job {job_id} is already in flight")
            job = _Job(job_id, store, chunks, readers, len(chunks))
            self._jobs[job_id] = job
            if not chunks:
                self._end(job)
            else:
                self._incoming.append(job)
                self._cv.notify()

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, in completion order. Non-blocking."""
        with self._cv:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until ``job_ids`` finished (their results stay for :meth:`get_finished`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for j in job_ids:
            with self._cv:
                job = self._jobs.get(j)
            if job is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                raise Timeout(f"stream job {j} not done after {timeout} s")

    def close(self) -> None:
        """Finish the jobs in flight, then free the ring and the readers. Blocks."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        for r in self._readers.values():
            r.close()
        for t in self.transfers:
            t.shutdown()
        self.pool.close()

    # -- the driver thread ------------------------------------------------------
    def _end(self, job: _Job) -> None:
        """Under the lock: report ``job``."""
        self._jobs.pop(job.job_id, None)
        self._finished.append(TransferResult(
            job.job_id, job.ok, job.nbytes, time.monotonic() - job.start, job.error))  # fmt: skip
        job.done.set()

    def _fail(self, job: _Job, why: str) -> None:
        if job.ok:
            job.ok, job.error = False, why

    def _chunk_done(self, job: _Job) -> None:
        job.left -= 1
        if job.left == 0:
            with self._cv:
                self._end(job)

    def _reader(self, tier: str, spec: ReaderSpec) -> TierIO:
        r = self._readers.get(tier)
        if r is None:
            r = self._readers[tier] = spec.open(self.pool)
        return r

    def _run(self) -> None:
        free = list(range(self.pool.num_slots - 1, -1, -1))
        pending: deque[tuple[_Job, StreamChunk]] = deque()
        # (tier, engine job) -> the items it moves: (job, chunk, slot)
        ios: dict[tuple[str, int], list[tuple[_Job, StreamChunk, int]]] = {}
        # Timed-out I/O that may still touch its slots (its result: those
        # slots), held until the engine reports its late end.
        held: Joined[tuple[str, int], tuple[str, int], list[int]] = Joined()
        while True:
            with self._cv:
                while not (self._incoming or pending or ios or held.held or self._closing):
                    self._cv.wait()
                if self._closing and not (self._incoming or pending or ios):
                    return
                new, self._incoming = self._incoming, []
            for job in new:
                pending.extend((job, c) for c in job.chunks)
            self._submit_io(pending, free, ios)
            if ios:
                tier, jid = next(iter(ios))
                # The oldest first: jobs end about in submission order.
                with contextlib.suppress(Timeout):
                    self._readers[tier].engine.wait([jid], self._slice)
            elif held.held:
                time.sleep(self._slice)
            for tier, io in self._readers.items():
                for r in io.engine.poll():
                    key = (tier, int(r.job_id))
                    if r.released:
                        late = held.release(key)
                        if late is not None and late[1].result:
                            free.extend(late[1].result)
                        continue
                    items = ios.pop(key, None)
                    if items is None:
                        continue
                    codes = list(r.items) or [0 if r.ok else -1] * len(items)
                    good = []
                    touched: list[int] = []  # slots a timed-out job may still write
                    for (job, c, slot), code in zip(items, codes):
                        if code == 0:
                            good.append((job, c, slot))
                            continue
                        what = "write" if job.store else "read"
                        self._fail(job, f"{tier} {what} failed ({code}): {r.error}".rstrip(": "))
                        (touched if r.held else free).append(slot)
                        self._chunk_done(job)
                    if touched:
                        held.add(key, key)
                        held.seal(key)
                        held.done(key, touched, held=True)
                        held.take_ended()
                    loads = [g for g in good if not g[0].store]
                    for job, _, slot in good:
                        if job.store:
                            job.nbytes += io.block_bytes
                            free.append(slot)
                            self._chunk_done(job)
                    for job, _, slot in self._copy(loads, to_slots=False):
                        self._chunk_done(job)
                        free.append(slot)

    def _submit_io(
        self,
        pending: deque[tuple[_Job, StreamChunk]],
        free: list[int],
        ios: dict[tuple[str, int], list[tuple[_Job, StreamChunk, int]]],
    ) -> None:
        """I/O for the pending chunks that get a free slot, one engine job
        per run of one tier and direction; a store's chunks are copied into
        their slots first."""
        while pending and free:
            tier, store = pending[0][1].tier, pending[0][0].store
            batch: list[tuple[_Job, StreamChunk, int]] = []
            while (
                pending
                and free
                and len(batch) < self._per_job
                and (pending[0][1].tier, pending[0][0].store) == (tier, store)
            ):
                job, c = pending.popleft()
                batch.append((job, c, free.pop()))
            if store:  # KV cache -> slots; what failed to copy ends here
                copied = self._copy(batch, to_slots=True)
                kept = {id(item[1]) for item in copied}
                for item in batch:
                    if id(item[1]) not in kept:
                        free.append(item[2])
                        self._chunk_done(item[0])
                batch = copied
                if not batch:
                    continue
            try:
                io = self._reader(tier, batch[0][0].readers[tier])
                jid = io.submit(
                    [s for _, _, s in batch],
                    np.stack([c.location for _, c, _ in batch]),
                    b"".join(c.digest for _, c, _ in batch),
                    write=store,
                )
            except KvtierError as e:  # Busy, or a tier that cannot be opened here
                for job, _, slot in batch:
                    self._fail(job, f"{tier} I/O not submitted: {e}")
                    free.append(slot)
                    self._chunk_done(job)
                continue
            ios[(tier, jid)] = batch

    def _copy(
        self, items: list[tuple[_Job, StreamChunk, int]], to_slots: bool
    ) -> list[tuple[_Job, StreamChunk, int]]:
        """Staging slots -> KV blocks (or back, ``to_slots``) for ``items``;
        blocks until copied. Returns the items copied (for loads, every item:
        a failed copy fails its job and frees its slot all the same)."""
        # Whole chunks of a group go in one copy job (a job per chunk cost
        # about 0.05 ms each here); a chunk that starts part way gets its own.
        parts: dict[tuple[int, bool, int], list[tuple[_Job, StreamChunk, int]]] = {}
        for n, (job, c, slot) in enumerate(items):
            whole = len(c.blocks) == self.bpc and c.first % self.bpc == 0
            parts.setdefault((c.group, whole, 0 if whole else n), []).append((job, c, slot))
        subs: dict[tuple[int, int], list[tuple[_Job, StreamChunk, int]]] = {}
        out: list[tuple[_Job, StreamChunk, int]] = []
        for (g, _, _), part in parts.items():
            self._next_sub += 1
            t = self.transfers[g]
            blocks = np.concatenate([c.blocks for _, c, _ in part])
            slots = [slot for _, _, slot in part]
            first = part[0][1].first
            try:
                ok = (
                    t.submit_store(self._next_sub, blocks, slots, first_block_index=first)
                    if to_slots
                    else t.submit_load(self._next_sub, slots, blocks, first_block_index=first)
                )
                why = "copy queue full"
            except KvtierError as e:
                ok, why = False, f"copy not submitted: {e}"
            if not ok:
                for job, _, _ in part:
                    self._fail(job, why)
                if not to_slots:
                    out += part  # nothing in flight: the slots are free
                continue
            subs[(g, self._next_sub)] = part
        for g, t in enumerate(self.transfers):
            mine = [sub for grp, sub in subs if grp == g]
            if not mine:
                continue
            t.wait(mine)
            for r in t.get_finished():
                part = subs[(g, r.job_id)]
                for job, c, slot in part:
                    if not r.success:
                        self._fail(job, f"copy failed: {r.error}")
                    elif not to_slots:
                        job.nbytes += (
                            len(c.blocks)
                            * int(r.transfer_size or 0)
                            // max(1, sum(len(x.blocks) for _, x, _ in part))
                        )
                    if r.success or not to_slots:
                        out.append((job, c, slot))
        return out
