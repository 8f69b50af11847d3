"""DeviceTransfer: the worker side, moving KV blocks between the engine's KV
cache tensors and host pool slots.

Process: the engine's worker. Who calls: vLLM's OffloadingWorker (through
the shim's worker), one thread. Submits never block; transfers in one direction complete in
submission order (one serial engine queue per direction, plus one for
expedited loads); :meth:`DeviceTransfer.get_finished` drains completions;
:meth:`DeviceTransfer.wait` blocks (GIL released) until the asked jobs are
done and their destination bytes are final, at most ``wait_timeout_s`` by
default (then :class:`kvtier.Timeout` names the jobs not done).

Slot layout: a slot holds one chunk of ``blocks_per_chunk`` blocks; within
it, each KV tensor's pages for the chunk's blocks lie back to back, tensors
in the order given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.engine import Engine
from kvtier.errors import Busy, ClosedError, InvalidArgument, Timeout
from kvtier.jobs import Joined
from kvtier.pool import HostPool
from kvtier.worker import WAIT_TIMEOUT_S

if TYPE_CHECKING:
    from kvtier import _native

STORE_QUEUE, LOAD_QUEUE, EXPEDITED_QUEUE = 0, 1, 2
_KIND = {STORE_QUEUE: "store", LOAD_QUEUE: "load", EXPEDITED_QUEUE: "expedited load"}


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    error: str = ""  # the runtime's message when success is False


@dataclass
class KVLayout:
    """Where each KV tensor's pages are: base address, page size, block stride."""

    bases: np.ndarray  # int64, per tensor
    page_bytes: np.ndarray  # int64, per tensor (copied bytes per block)
    strides: np.ndarray  # int64, per tensor (bytes between blocks)
    num_blocks: int
    chunk_offsets: np.ndarray  # int64, offset of each tensor's pages inside a slot

    @property
    def chunk_page_bytes(self) -> int:
        return int(self.page_bytes.sum())


@dataclass
class _Tensor:
    """What DeviceTransfer reads of a KV tensor: a ``torch.Tensor`` (CPU or
    CUDA) or a numpy array (CPU; stands in for the GPU cache without torch)."""

    device: str
    shape: tuple[int, ...]
    address: int
    itemsize: int
    block_stride: int  # bytes between blocks (dimension 0)
    block_contiguous: bool  # each block's page is one contiguous run
    memory: tuple[int, int]  # address and bytes of the whole allocation it views


def _describe(t: Any) -> _Tensor:
    if isinstance(t, np.ndarray):
        if not t.flags.writeable:
            raise InvalidArgument("a numpy KV array must be writeable")
        root = t
        while isinstance(root.base, np.ndarray):
            root = root.base
        return _Tensor(
            "cpu",
            tuple(t.shape),
            t.ctypes.data,
            t.itemsize,
            t.strides[0] if t.ndim else 0,
            t.ndim <= 1 or bool(t[0].flags.c_contiguous),
            (root.ctypes.data, root.nbytes),
        )
    storage = t.untyped_storage()
    esz = t.element_size()
    return _Tensor(
        str(t.device),
        tuple(t.shape),
        t.data_ptr(),
        esz,
        t.stride(0) * esz if t.dim() else 0,
        t.dim() <= 1 or bool(t[0].is_contiguous()),
        (storage.data_ptr(), storage.nbytes()),
    )


def layout_from_tensors(
    tensors: Sequence[Any], page_bytes: Sequence[int] | None = None, blocks_per_chunk: int = 1
) -> KVLayout:
    """Describe block-major KV tensors ``(num_blocks, ...)``: views may share
    storage (several layers in one tensor) or pack all layers per block.
    torch tensors or (CPU) numpy arrays."""
    if not tensors:
        raise InvalidArgument("DeviceTransfer needs at least one KV tensor")
    bases, pages, strides, nblocks = [], [], [], []
    for i, raw in enumerate(tensors):
        t = _describe(raw)
        if len(t.shape) < 1 or t.shape[0] == 0:
            raise InvalidArgument(f"KV tensor {i} must be (num_blocks, ...) with num_blocks > 0")
        row = int(np.prod(t.shape[1:], dtype=np.int64)) * t.itemsize
        if not t.block_contiguous:
            raise InvalidArgument(f"KV tensor {i}: each block's page must be contiguous")
        pb = int(page_bytes[i]) if page_bytes is not None else row
        if pb <= 0 or pb > row:
            raise InvalidArgument(f"KV tensor {i}: page_bytes {pb} not in (0, {row}]")
        bases.append(t.address)
        pages.append(pb)
        strides.append(t.block_stride)
        nblocks.append(t.shape[0])
    if len(set(nblocks)) != 1:
        raise InvalidArgument(f"KV tensors disagree on num_blocks: {sorted(set(nblocks))}")
    pages_a = np.asarray(pages, np.int64)
    offsets = np.concatenate([[0], np.cumsum(pages_a * blocks_per_chunk)[:-1]]).astype(np.int64)
    return KVLayout(
        np.asarray(bases, np.int64), pages_a, np.asarray(strides, np.int64), nblocks[0], offsets
    )


def _allocations(tensors: Sequence[Any]) -> list[tuple[int, int]]:
    """The memory the KV tensors view, ``(address, bytes)`` sorted, overlapping
    or touching ranges merged (several layers may view one allocation)."""
    spans = sorted(_describe(t).memory for t in tensors)
    out: list[tuple[int, int]] = []
    for start, n in spans:
        if out and start <= out[-1][0] + out[-1][1]:
            s0, n0 = out[-1]
            out[-1] = (s0, max(s0 + n0, start + n) - s0)
        else:
            out.append((start, n))
    return out


class _EngineBackend:
    """What both backends share: their jobs are engine jobs (ids, byte
    budgets, deadlines, poll and wait are the engine's), one serial queue per
    direction so that each direction's jobs end in submission order."""

    name: str

    def __init__(self, num_threads: int, budget_bytes: int, deadline_s: float) -> None:
        self.engine = Engine(num_threads, [(budget_bytes, True, deadline_s)] * 3)

    def poll(self) -> list[Any]:
        return self.engine.poll()

    def wait(self, ids: list[int], timeout: float | None) -> None:
        self.engine.wait(ids, timeout)

    def close(self) -> None:
        self.engine.close()


class _CpuBackend(_EngineBackend):
    """Copies on engine worker threads."""

    name = "cpu"

    def __init__(
        self,
        tensors: Sequence[Any],
        pool: HostPool,
        num_threads: int,
        budget_bytes: int,
        deadline_s: float,
    ) -> None:
        super().__init__(num_threads, budget_bytes, deadline_s)
        self.engine.register_pool(pool)
        # As CUDA's registration does (a created pool was pre-faulted):
        # else a restarted engine's first loads fault (HostPool.populate).
        self.populating = None if pool.native.owner else pool.populate_in_background()
        seen: set[int] = set()
        for t in tensors:
            ptr, nbytes = _describe(t).memory
            if ptr not in seen:
                seen.add(ptr)
                self.engine.register_memory(ptr, nbytes, owner=t)

    def submit(
        self,
        queue: int,
        descs: np.ndarray,
        wait_stream: int,
        conflicts: dict[int, int],
        fences: np.ndarray | None = None,
    ) -> tuple[int, int] | None:
        queues = set(conflicts.values())
        if len(queues) == 1:
            queue = queues.pop()  # a serial queue runs it after the job it depends on
        elif queues:
            self.engine.wait(list(conflicts))  # rare: depends on both other directions
        try:
            return self.engine.submit_copy(descs, queue, fences), queue
        except Busy:
            return None


class _CudaBackend(_EngineBackend):
    """Copies on CUDA streams (libcudart loaded with dlopen at first use),
    submitted as engine jobs: each is enqueued on its direction's stream at
    submit and ends on an engine worker once the GPU has passed it (one worker
    per direction, so an expedited load is never reported behind a store)."""

    name = "cuda"

    def __init__(
        self,
        tensors: Sequence[Any],
        pool: HostPool,
        device: int,
        use_batch: bool,
        budget_bytes: int,
        deadline_s: float,
    ) -> None:
        from kvtier import _native
        from kvtier.worker import cuda_runtime

        cuda_runtime.load()  # finds pip's libcudart even where torch is not imported
        # The copier checks once that these are memory of `device` and then
        # that every descriptor's device side lies in one of them.
        self.copier: _native.CudaCopier | None = _native.CudaCopier(
            device, [(pool.address, pool.nbytes)], _allocations(tensors), use_batch
        )
        super().__init__(3, budget_bytes, deadline_s)
        self.engine.register_pool(pool)

    def submit(
        self,
        queue: int,
        descs: np.ndarray,
        wait_stream: int,
        conflicts: dict[int, int],
        fences: np.ndarray | None = None,
    ) -> tuple[int, int] | None:
        if self.copier is None:
            raise ClosedError("device transfer is shut down")
        try:
            # A job of another direction on the same slots: its stream waits
            # for that job's end event (no blocking here).
            job = self.engine.submit_cuda(
                self.copier, queue, descs, wait_stream, list(conflicts), queue, fences
            )
        except Busy:
            return None
        return job, queue

    def close(self) -> None:
        # Every job has ended (the engine lets begun ones run to their end)
        # before the copier's streams and registrations go.
        super().close()
        self.copier = None


class DeviceTransfer:
    """Copies between KV tensors and host pool slots.

    ``tensors``: the engine's KV cache, torch tensors (CPU or CUDA), or numpy
    arrays standing in for it where torch is not installed.

    ``backend``: "auto" (CUDA tensors -> "cuda", CPU tensors -> "cpu"),
    "cpu" (engine worker threads) or "cuda" (streams; also usable with CPU
    tensors against a fake runtime in tests). ``is_writer=False`` (replicated
    MLA layout, a non-writing TP rank) acks stores without copying.

    A job that reads or writes host slots still used by a pending job of the
    other direction runs after it (a load after a store of the same slot sees
    the stored bytes).

    ``deadline_s`` (0: none): a job not finished that long after its submit is
    reported failed (``error`` says it timed out); its slots stay in use until
    the copy has really ended, so a later job of the other direction on them
    still runs after it.

    ``wait_timeout_s`` (0: none): how long :meth:`wait` blocks when not
    given a timeout, after which it raises :class:`kvtier.Timeout` naming
    the jobs not finished: a copy that never ends (a GPU that stopped, a
    lower-tier write whose fence nobody settles) is an error rather than a
    worker that hangs for ever. The attribute of that name may be changed.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        pool: HostPool,
        *,
        blocks_per_chunk: int = 1,
        page_bytes: Sequence[int] | None = None,
        is_writer: bool = True,
        backend: str = "auto",
        device: int | None = None,
        use_batch: bool = True,
        num_threads: int = 2,
        budget_bytes: int = 1 << 30,
        slot_offset: int = 0,
        deadline_s: float = 0.0,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
    ) -> None:
        if blocks_per_chunk < 1:
            raise InvalidArgument(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        devices = {_describe(t).device for t in tensors}
        if len(devices) > 1:
            raise InvalidArgument(f"KV tensors are on several devices: {sorted(devices)}")
        dev = devices.pop() if devices else "cpu"
        if backend == "auto":
            backend = "cuda" if dev.startswith("cuda") else "cpu"
        if backend not in ("cpu", "cuda"):
            raise InvalidArgument(f"backend must be auto, cpu or cuda, not {backend!r}")
        if backend == "cpu" and dev != "cpu":
            raise InvalidArgument(f"the cpu backend needs CPU tensors, got {dev}")
        self.layout = layout_from_tensors(tensors, page_bytes, blocks_per_chunk)
        self.blocks_per_chunk = blocks_per_chunk
        need = self.layout.chunk_page_bytes * blocks_per_chunk
        if slot_offset < 0 or need + slot_offset > pool.slot_bytes:
            raise InvalidArgument(
                f"a chunk needs {need} bytes at offset {slot_offset} but host slots hold "
                f"{pool.slot_bytes}"
            )
        self.pool = pool
        self.slot_offset = slot_offset  # this worker's cell inside a slot shared by ranks
        self.is_writer = is_writer
        if not wait_timeout_s >= 0:  # NaN too
            raise InvalidArgument(f"wait_timeout_s must be >= 0, got {wait_timeout_s}")
        self.wait_timeout_s = float(wait_timeout_s)
        self._tensors = list(tensors)  # keep the memory alive
        self._b: _CpuBackend | _CudaBackend
        if backend == "cpu":
            self._b = _CpuBackend(self._tensors, pool, num_threads, budget_bytes, deadline_s)
        else:
            if device is None:
                device = int(dev.split(":")[1]) if ":" in dev else 0
            self._b = _CudaBackend(self._tensors, pool, device, use_batch, budget_bytes, deadline_s)
        self.backend = self._b.name
        # The caller's jobs, one engine job each; a timed-out one held (its
        # slots kept from later jobs' ordering) until the engine releases it.
        self._jobs: Joined[int, int, Any] = Joined()
        self._job_slots: dict[int, tuple[np.ndarray, int]] = {}  # internal id -> slots, direction
        self._slot_job: dict[int, tuple[int, int]] = {}  # slot -> (internal id, queue)
        self._acks: list[TransferResult] = []

    # -- descriptors -------------------------------------------------------
    def descriptors(
        self,
        block_ids: Sequence[int] | np.ndarray,
        slots: Sequence[int] | np.ndarray,
        first_block_index: int = 0,
        to_host: bool = True,
        tensors: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """``(N, 3)`` int64 copy descriptors, built with numpy (no per-block loop).

        ``first_block_index`` is the logical index of ``block_ids[0]`` in its
        request: the first chunk may be partly covered when blocks_per_chunk > 1.
        ``tensors``: only the KV tensors ``[lo, hi)`` (a layer's, for a load
        the forward pass waits for layer by layer); default all.
        """
        b = np.asarray(block_ids, np.int64)
        s = np.asarray(slots, np.int64)
        lay, bpc = self.layout, self.blocks_per_chunk
        if tensors is not None:
            lo, hi = tensors
            if not 0 <= lo < hi <= len(lay.bases):
                raise InvalidArgument(f"tensors [{lo}, {hi}) not within [0, {len(lay.bases)})")
            lay = KVLayout(
                lay.bases[lo:hi],
                lay.page_bytes[lo:hi],
                lay.strides[lo:hi],
                lay.num_blocks,
                lay.chunk_offsets[lo:hi],
            )
        if b.ndim != 1 or s.ndim != 1:
            raise InvalidArgument("block ids and slots must be 1-D")
        if b.size and (b.min() < 0 or b.max() >= lay.num_blocks):
            raise InvalidArgument(f"block id out of range [0, {lay.num_blocks})")
        if s.size and (s.min() < 0 or s.max() >= self.pool.num_slots):
            raise InvalidArgument(f"slot out of range [0, {self.pool.num_slots})")
        skip = first_block_index % bpc
        chunks = -(-(skip + b.size) // bpc) if b.size else 0
        if s.size != chunks:
            raise InvalidArgument(
                f"{b.size} blocks starting at index {first_block_index} span {chunks} chunk(s), "
                f"got {s.size} slot(s)"
            )
        pos = np.arange(b.size, dtype=np.int64) + skip
        slot_of = s[pos // bpc]
        in_chunk = pos % bpc
        gpu = lay.bases[None, :] + b[:, None] * lay.strides[None, :]
        host = (
            self.pool.address
            + self.slot_offset
            + slot_of[:, None] * self.pool.slot_bytes
            + lay.chunk_offsets[None, :]
            + in_chunk[:, None] * lay.page_bytes[None, :]
        )
        n = np.broadcast_to(lay.page_bytes[None, :], gpu.shape)
        src, dst = (gpu, host) if to_host else (host, gpu)
        return np.stack([src.ravel(), dst.ravel(), n.ravel()], axis=1)

    # -- OffloadingWorker-like API ------------------------------------------
    def submit_store(
        self,
        job_id: int,
        gpu_block_ids: Sequence[int] | np.ndarray,
        host_slots: Sequence[int] | np.ndarray,
        first_block_index: int = 0,
        stream: int | None = None,
    ) -> bool:
        """KV blocks -> host slots, after the compute ``stream``'s work so far
        (a CUDA stream handle of the tensors' device; default: torch's current
        stream there, whose handle is 0 for torch's default stream: the
        legacy default stream, which is waited for like any other). False
        when full."""
        if not self.is_writer:
            self._acks.append(TransferResult(job_id, True, 0, 0.0))
            return True
        d = self.descriptors(gpu_block_ids, host_slots, first_block_index, to_host=True)
        return self._submit(job_id, d, STORE_QUEUE, host_slots, self._stream(stream))

    def submit_load(
        self,
        job_id: int,
        host_slots: Sequence[int] | np.ndarray,
        gpu_block_ids: Sequence[int] | np.ndarray,
        expedited: bool = False,
        first_block_index: int = 0,
        stream: int | None = None,
        fences: Sequence[int] | np.ndarray | None = None,
        tensors: tuple[int, int] | None = None,
    ) -> bool:
        """Host slots -> KV blocks. Expedited loads have their own queue/stream.
        Like a store, the copies wait for the work queued so far on the
        compute ``stream`` (a kernel still reading the blocks keeps its bytes).

        ``fences``: per slot, the armed value of a write still filling it
        (:meth:`HostPool.arm_fences`; 0 for a slot already filled): its
        copies wait for that write, slot by slot, and the job fails if the
        write failed. ``tensors``: only those KV tensors (see
        :meth:`descriptors`)."""
        d = self.descriptors(
            gpu_block_ids, host_slots, first_block_index, to_host=False, tensors=tensors
        )
        f = None
        if fences is not None:
            armed = np.asarray(fences, np.int64)
            if armed.shape != np.shape(host_slots):
                raise InvalidArgument(f"{armed.size} fences for {np.size(host_slots)} slots")
            if armed.any():
                # Rows of d are block-major (pages of a block together), as
                # descriptors() builds them.
                lay, bpc = self.layout, self.blocks_per_chunk
                pos = np.arange(np.size(gpu_block_ids), dtype=np.int64) + first_block_index % bpc
                cols = len(lay.page_bytes) if tensors is None else tensors[1] - tensors[0]
                per_row = np.repeat(pos // bpc, cols)
                f = self.pool.fences(np.asarray(host_slots, np.int64)[per_row], armed[per_row])
        return self._submit(
            job_id,
            d,
            EXPEDITED_QUEUE if expedited else LOAD_QUEUE,
            host_slots,
            self._stream(stream),
            f,
        )

    def _stream(self, stream: int | None) -> int:
        """The compute stream jobs wait for: ``stream``, else torch's current
        stream of the tensors' device, else 0 (the legacy default stream)."""
        if stream is not None or self.backend != "cuda":
            return int(stream or 0)
        t = self._tensors[0]
        if not isinstance(t, np.ndarray) and str(t.device).startswith("cuda"):
            import torch

            return int(torch.cuda.current_stream(t.device).cuda_stream)
        return 0

    def _submit(
        self,
        job_id: int,
        descs: np.ndarray,
        queue: int,
        slots: Sequence[int] | np.ndarray,
        stream: int,
        fences: np.ndarray | None = None,
    ) -> bool:
        if job_id in self._jobs:
            raise InvalidArgument(f"job id {job_id} is already in flight")
        if len(descs) == 0:
            self._acks.append(TransferResult(job_id, True, 0, 0.0))
            return True
        s = np.unique(np.asarray(slots, np.int64))
        conflicts: dict[int, int] = {}
        for slot in s.tolist():
            hit = self._slot_job.get(slot)
            if hit is not None and hit[1] != queue:
                conflicts[hit[0]] = hit[1]
        got = self._b.submit(queue, descs, stream, conflicts, fences)
        if got is None:
            return False
        iid, q = got
        self._jobs.add(job_id, iid)
        self._jobs.seal(job_id)
        self._job_slots[iid] = (s, queue)  # its direction, whichever queue runs it
        for slot in s.tolist():
            self._slot_job[slot] = (iid, q)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs since the last call (acks first, then completion order)."""
        if not self._acks and not self._jobs.busy():
            return []  # called on every engine step: nothing in flight, nothing to drain
        out, self._acks = self._acks, []
        for r in self._b.poll():
            if r.released:  # a timed-out job has really ended: its slots are free
                self._jobs.release(r.job_id)
                self._free_slots(r.job_id)
                continue
            self._jobs.done(r.job_id, r, held=r.held)
            if not r.held:
                self._free_slots(r.job_id)
        for e in self._jobs.take_ended():
            (r,) = e.results  # one engine job each
            out.append(TransferResult(e.parent, r.ok, int(r.nbytes), float(r.seconds), r.error))
        return out

    def _free_slots(self, iid: int) -> None:
        for slot in self._job_slots.pop(iid)[0].tolist():
            if self._slot_job.get(slot, (0,))[0] == iid:
                del self._slot_job[slot]

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block (GIL released) until ``job_ids`` finished; their destination
        bytes are final and their results wait for :meth:`get_finished`.

        ``timeout``: seconds (None: ``wait_timeout_s``). Past it, raises
        :class:`kvtier.Timeout` naming each job not finished, which stays in
        flight: its slots stay in use and :meth:`get_finished` reports it
        when it ends. Who calls: the engine's worker before it reuses the
        jobs' KV blocks or slots (the vLLM shim's ``wait``), tools."""
        jobs = list(job_ids)
        ids = [sub for j in jobs for sub in self._jobs.subs(j)]
        if not ids:
            return
        limit = (self.wait_timeout_s or None) if timeout is None else timeout
        try:
            self._b.wait(ids, limit)
        except Timeout:
            late = [j for j in jobs if not self._ended(j)]
            if not late:  # they ended between the deadline and the check
                return
            names = ", ".join(self._describe(j) for j in late)
            raise Timeout(
                f"DeviceTransfer: {names} not finished within {limit:g} s (still in flight: "
                "get_finished reports each when it ends)"
            ) from None

    def _ended(self, job_id: int) -> bool:
        try:
            self._b.wait(self._jobs.subs(job_id), 0)
        except Timeout:
            return False
        return True

    def _describe(self, job_id: int) -> str:
        """``load job 7 (host slots 3, 4)``: what a Timeout names."""
        parts = [self._job_slots.get(sub) for sub in self._jobs.subs(job_id)]
        slots = sorted({s for p in parts if p is not None for s in p[0].tolist()})
        kind = next((_KIND[p[1]] for p in parts if p is not None), "transfer")
        shown = ", ".join(map(str, slots[:8])) + (f", ... ({len(slots)})" if len(slots) > 8 else "")
        return f"{kind} job {job_id} (host slots {shown})"

    def stats(self) -> dict[str, Any]:
        if isinstance(self._b, _CudaBackend) and self._b.copier is not None:
            return {
                "backend": "cuda",
                "device": self._b.copier.device,
                "runtime": self._b.copier.runtime_path,
                "runtime_version": self._b.copier.runtime_version,
                **self._b.copier.stats(),
            }
        return {"backend": self.backend}

    def shutdown(self) -> None:
        self._b.close()
