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

Layer by layer (``submit(..., layers=...)``, a load the forward pass waits
for per layer, :meth:`StreamLoader.wait_layer`): a disk record is read as
byte ranges in layer order, layer 0's range of every chunk first, and each
layer is copied into the KV cache as soon as its range arrived, so the read
overlaps the forward pass. Those copies precede the record's check (the
range that completes a record checks it whole): a record that then fails
fails its job all the same, which the worker reports as load errors (vLLM
recomputes the blocks and drops that step's output of the request).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import ClosedError, InvalidArgument, KvtierError, Timeout
from kvtier.jobs import Joined
from kvtier.pool import HostPool
from kvtier.tiers.base import ReaderSpec, TierIO
from kvtier.tiers.records import ALIGN, record_bytes
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
    # Layer by layer: per group, KV tensors per layer (empty: whole waits);
    # the chunks read by ranges (by id) and the first layer of each not yet
    # copied; per (group, layer) how many of those still miss that layer;
    # how many chunks read whole are not done.
    per_layer: Sequence[int] = ()
    next_layer: dict[int, int] = field(default_factory=dict)
    layer_left: dict[tuple[int, int], int] = field(default_factory=dict)
    whole_left: int = 0


@dataclass(frozen=True)
class _Plan:
    """How a group's record is read by ranges: the byte ranges, in order;
    each layer's KV tensors; the range by whose end a layer's bytes are in."""

    ranges: list[tuple[int, int]]
    tensors: list[tuple[int, int]]
    last_range: list[int]


@dataclass
class _Ranged:
    """Chunks of one group whose records are read by ranges, one engine job
    per range; their slots stay theirs until every range job ended (and
    those that timed out while running were released)."""

    tier: str
    items: list[tuple[_Job, StreamChunk, int]]
    plan: _Plan
    failed: list[bool]
    left: int = 0  # range jobs not ended
    ended: set[int] = field(default_factory=set)  # ranges whose job ended
    copied: int = 0  # layers copied
    held: set[tuple[str, int]] = field(default_factory=set)


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
        min_range_bytes: int = 16 << 10,
    ) -> None:
        if num_slots < 1:
            raise InvalidArgument(f"stream staging slots must be >= 1, got {num_slots}")
        self.pool = HostPool(num_slots, slot_bytes)
        self.transfers = [
            DeviceTransfer(
                tensors,
                self.pool,
                blocks_per_chunk=blocks_per_chunk,
                page_bytes=list(pages),
                slot_offset=slot_offset,
                num_threads=1,
                wait_timeout_s=0,  # the driver's own waits: those of wait() are the bounded ones
            )
            for tensors, pages in groups
        ]
        self._readers: dict[str, TierIO] = {}
        # Reads go in jobs of a quarter of the ring, so the first copies
        # overlap the later reads (measured, 62 chunks of 128 KiB from this
        # machine's disk: one job for all then one copy took 14.6 ms against
        # 12.4 ms for the reads alone).
        self._per_job = max(1, min(16, num_slots // 4))
        self.bpc = blocks_per_chunk
        self._slice = wait_slice_s
        # Layers merge into ranges of at least this much: each range is one more I/O per record.
        self._min_range = min_range_bytes
        self._plans: dict[tuple[int, int, int], _Plan] = {}
        # The driver's range jobs in flight, (tier, engine job) -> (their
        # chunks, which range), and those that timed out while running.
        self._ranges: dict[tuple[str, int], tuple[_Ranged, int]] = {}
        self._held_ranges: dict[tuple[str, int], _Ranged] = {}
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
        layers: Sequence[int] | None = None,
    ) -> None:
        """Queue a job moving ``chunks`` from their tier into the KV cache (or,
        with ``store``, from the KV cache to their tier; the tier reserved
        their records); its result comes from :meth:`get_finished`.
        ``layers`` (a load): per group, KV tensors per layer (0: that group
        whole), to load layer by layer for :meth:`wait_layer`; a tier that
        cannot read byte ranges (Redis) is loaded whole all the same."""
        job = _Job(job_id, store, chunks, readers, len(chunks))
        if layers is not None and not store:
            job.per_layer = layers
            for c in chunks:
                k = layers[c.group] if c.group < len(layers) else 0
                spec = readers.get(c.tier)
                if not k or spec is None or not hasattr(spec.io, "submit_range"):
                    job.whole_left += 1
                    continue
                job.next_layer[id(c)] = 0
                for i in range(len(self.transfers[c.group].layout.bases) // k):
                    job.layer_left[(c.group, i)] = job.layer_left.get((c.group, i), 0) + 1
        with self._cv:
            if self._closing:
                raise ClosedError("stream loader is shut down")
            if job_id in self._jobs:
                raise InvalidArgument(f"stream job {job_id} is already in flight")
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

    def wait_layer(self, job_id: int, group: int, layer: int, timeout: float | None = None) -> None:
        """Block until layer ``layer`` of group ``group`` of job ``job_id`` is
        in the KV cache (its chunks loaded whole: until they are), or the job
        ended; a job not submitted by layers is waited for whole. Called by
        the worker's forward pass before that layer's attention. The bytes
        may not have been checked yet: a record that fails its check later
        fails the job."""
        with self._cv:
            job = self._jobs.get(job_id)
            if job is None:
                return
            if job.per_layer:
                if not self._cv.wait_for(
                    lambda: (
                        job.done.is_set()
                        or (job.whole_left == 0 and job.layer_left.get((group, layer), 0) == 0)
                    ),
                    timeout,
                ):
                    raise Timeout(f"stream job {job_id} layer {layer} not in after {timeout} s")
                return
        if not job.done.wait(timeout):
            raise Timeout(f"stream job {job_id} not done after {timeout} s")

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
        self._finished.append(
            TransferResult(job.job_id, job.ok, job.nbytes, time.monotonic() - job.start, job.error)
        )
        job.done.set()
        self._cv.notify_all()

    def _fail(self, job: _Job, why: str) -> None:
        if job.ok:
            job.ok, job.error = False, why

    def _chunk_done(self, job: _Job, c: StreamChunk) -> None:
        with self._cv:
            if id(c) in job.next_layer:
                self._copied(job, c, None)
            elif job.per_layer:
                job.whole_left -= 1
                self._cv.notify_all()
            job.left -= 1
            if job.left == 0:
                self._end(job)

    def _copied(self, job: _Job, c: StreamChunk, layer: int | None) -> None:
        """Under the lock: chunk ``c`` of ``job`` has its layers up to
        ``layer`` in the KV cache (None: it is done, copied or failed)."""
        first = job.next_layer[id(c)]
        last = (
            layer
            if layer is not None
            else len(self.transfers[c.group].layout.bases) // (job.per_layer[c.group]) - 1
        )
        for i in range(first, last + 1):
            job.layer_left[(c.group, i)] -= 1
        job.next_layer[id(c)] = max(first, last + 1)
        self._cv.notify_all()

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
                while not (
                    self._incoming
                    or pending
                    or ios
                    or self._ranges
                    or held.held
                    or self._held_ranges
                    or self._closing
                ):
                    self._cv.wait()
                if self._closing and not (self._incoming or pending or ios or self._ranges):
                    return
                new, self._incoming = self._incoming, []
            for job in new:
                pending.extend((job, c) for c in job.chunks)
            self._submit_io(pending, free, ios)
            if self._ranges or ios:
                # The oldest first: jobs end about in submission order. A
                # layer the forward pass waits for comes first (a short
                # slice when whole reads are in flight too).
                tier, jid = next(iter(self._ranges or ios))
                with contextlib.suppress(Timeout):
                    self._readers[tier].engine.wait(
                        [jid], 0.001 if self._ranges and ios else self._slice
                    )
            elif held.held or self._held_ranges:
                time.sleep(self._slice)
            for tier, io in self._readers.items():
                for r in io.engine.poll():
                    key = (tier, int(r.job_id))
                    if r.released:
                        b = self._held_ranges.pop(key, None)
                        if b is not None:
                            b.held.discard(key)
                            self._free_ranged(b, free)
                            continue
                        late = held.release(key)
                        if late is not None and late[1].result:
                            free.extend(late[1].result)
                        continue
                    rng = self._ranges.pop(key, None)
                    if rng is not None:
                        self._range_ended(key, r, rng[0], rng[1], free)
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
                        self._chunk_done(job, c)
                    if touched:
                        held.add(key, key)
                        held.seal(key)
                        held.done(key, touched, held=True)
                        held.take_ended()
                    loads = [g for g in good if not g[0].store]
                    for job, c, slot in good:
                        if job.store:
                            job.nbytes += io.block_bytes
                            free.append(slot)
                            self._chunk_done(job, c)
                    for job, c, slot in self._copy(loads, to_slots=False):
                        self._chunk_done(job, c)
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

        def kind(item: tuple[_Job, StreamChunk]) -> tuple[str, bool, int]:
            job, c = item  # by ranges: one group's chunks (one plan) per batch
            return c.tier, job.store, c.group if id(c) in job.next_layer else -1

        while pending and free:
            tier, store, ranged = kind(pending[0])
            batch: list[tuple[_Job, StreamChunk, int]] = []
            # A batch read by ranges takes every slot it can: its layers
            # arrive together, layer 0 of all its chunks first.
            most = len(free) if ranged >= 0 else self._per_job
            while (
                pending and free and len(batch) < most and kind(pending[0]) == (tier, store, ranged)
            ):
                job, c = pending.popleft()
                batch.append((job, c, free.pop()))
            if ranged >= 0:
                self._submit_ranges(tier, batch, free)
                continue
            if store:  # KV cache -> slots; what failed to copy ends here
                copied = self._copy(batch, to_slots=True)
                kept = {id(item[1]) for item in copied}
                for item in batch:
                    if id(item[1]) not in kept:
                        free.append(item[2])
                        self._chunk_done(item[0], item[1])
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
                for job, c, slot in batch:
                    self._fail(job, f"{tier} I/O not submitted: {e}")
                    free.append(slot)
                    self._chunk_done(job, c)
                continue
            ios[(tier, jid)] = batch

    def _plan(self, g: int, k: int, payload: int) -> _Plan:
        """How group ``g``'s records (``payload`` bytes, ``k`` KV tensors a
        layer) are read by ranges: cut at the 4 KiB boundary at or after
        each layer's start (O_DIRECT), so a layer's bytes are in once its
        last range arrived; cuts closer than ``min_range_bytes`` dropped."""
        plan = self._plans.get((g, k, payload))
        if plan is not None:
            return plan
        t = self.transfers[g]
        n = len(t.layout.bases) // k
        starts = [t.slot_offset + int(t.layout.chunk_offsets[i * k]) for i in range(n)]
        ends = [*starts[1:], t.slot_offset + t.layout.chunk_page_bytes * self.bpc]
        size = record_bytes(payload)
        cuts = [0]
        for start in starts[1:]:
            cut = -(-start // ALIGN) * ALIGN
            if cut - cuts[-1] >= self._min_range and size - cut >= self._min_range:
                cuts.append(cut)
        cuts.append(size)
        plan = self._plans[(g, k, payload)] = _Plan(
            list(itertools.pairwise(cuts)),
            [(i * k, (i + 1) * k) for i in range(n)],
            [bisect_right(cuts, end - 1) - 1 for end in ends],
        )
        return plan

    def _submit_ranges(
        self, tier: str, batch: list[tuple[_Job, StreamChunk, int]], free: list[int]
    ) -> None:
        """One engine job per range of the records of ``batch`` (one group's
        chunks), in order; what cannot be submitted fails."""
        job0, c0, _ = batch[0]
        b = _Ranged(tier, batch, _Plan([], [], []), [False] * len(batch))
        try:
            io = self._reader(tier, job0.readers[tier])
            b.plan = self._plan(c0.group, job0.per_layer[c0.group], io.block_bytes)
            slots = [s for _, _, s in batch]
            locations = np.stack([c.location for _, c, _ in batch])
            digests = b"".join(c.digest for _, c, _ in batch)
            for j, (lo, hi) in enumerate(b.plan.ranges):
                jid = io.submit_range(slots, locations, digests, lo, hi)  # type: ignore[attr-defined]
                self._ranges[(tier, jid)] = (b, j)
                b.left += 1
        except KvtierError as e:  # Busy, or a tier that cannot be opened here
            # The ranges submitted still run; the rest (the check) never will.
            for n, (job, _, _) in enumerate(batch):
                b.failed[n] = True
                self._fail(job, f"{tier} I/O not submitted: {e}")
        if b.left == 0:
            self._ranges_done(b, free)

    def _range_ended(
        self, key: tuple[str, int], r: Any, b: _Ranged, j: int, free: list[int]
    ) -> None:
        """Range ``j`` of ``b`` was read (or failed): copy each layer whose
        ranges have all arrived, in layer order; once every range ended,
        the chunks are done."""
        b.left -= 1
        b.ended.add(j)
        if r.held:  # timed out while running: its slots wait for its end
            b.held.add(key)
            self._held_ranges[key] = b
        codes = list(r.items) or [0 if r.ok else -1] * len(b.items)
        for n, ((job, _, _), code) in enumerate(zip(b.items, codes)):
            if code != 0 and not b.failed[n]:
                b.failed[n] = True
                self._fail(job, f"{b.tier} read failed ({code}): {r.error}".rstrip(": "))
        plan = b.plan
        while b.copied < len(plan.tensors) and all(
            x in b.ended for x in range(plan.last_range[b.copied] + 1)
        ):
            good = [it for it, bad in zip(b.items, b.failed) if not bad]
            self._copy(good, to_slots=False, tensors=plan.tensors[b.copied])
            with self._cv:
                for job, c, _ in b.items:
                    self._copied(job, c, b.copied)
            b.copied += 1
        if b.left == 0:
            self._ranges_done(b, free)

    def _ranges_done(self, b: _Ranged, free: list[int]) -> None:
        for job, c, _ in b.items:
            self._chunk_done(job, c)
        self._free_ranged(b, free)

    def _free_ranged(self, b: _Ranged, free: list[int]) -> None:
        if b.left == 0 and not b.held:
            free.extend(s for _, _, s in b.items)

    def _copy(
        self,
        items: list[tuple[_Job, StreamChunk, int]],
        to_slots: bool,
        tensors: tuple[int, int] | None = None,
    ) -> list[tuple[_Job, StreamChunk, int]]:
        """Staging slots -> KV blocks (or back, ``to_slots``) for ``items``
        (``tensors``: of those KV tensors only); blocks until copied.
        Returns the items copied (for loads, every item: a failed copy fails
        its job and frees its slot all the same)."""
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
                    else t.submit_load(
                        self._next_sub, slots, blocks, first_block_index=first, tensors=tensors
                    )
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
