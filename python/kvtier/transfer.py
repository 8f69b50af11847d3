"""DeviceTransfer: the worker side, moving KV blocks between the engine's KV
cache tensors and host pool slots.

Who calls: the engine's GPU worker process (vLLM's OffloadingWorker), one
thread. Submits never block; transfers in one direction complete in
submission order (one serial engine queue per direction, plus one for
expedited loads); :meth:`DeviceTransfer.get_finished` drains completions;
:meth:`DeviceTransfer.wait` blocks (GIL released) until the asked jobs are
done and their destination bytes are final.

Slot layout: a slot holds one chunk of ``blocks_per_chunk`` blocks; within
it, each KV tensor's pages for the chunk's blocks lie back to back, tensors
in the order given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.engine import Engine
from kvtier.errors import Busy, InvalidArgument
from kvtier.pool import HostPool

STORE_QUEUE, LOAD_QUEUE, EXPEDITED_QUEUE = 0, 1, 2


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


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


def layout_from_tensors(tensors: Sequence[Any], page_bytes: Sequence[int] | None = None,
                        blocks_per_chunk: int = 1) -> KVLayout:
    """Describe block-major KV tensors ``(num_blocks, ...)``: views may share
    storage (several layers in one tensor) or pack all layers per block."""
    if not tensors:
        raise InvalidArgument("DeviceTransfer needs at least one KV tensor")
    bases, pages, strides, nblocks = [], [], [], []
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[0] == 0:
            raise InvalidArgument(f"KV tensor {i} must be (num_blocks, ...) with num_blocks > 0")
        esz = t.element_size()
        row = int(np.prod(t.shape[1:], dtype=np.int64)) * esz
        if t.dim() > 1 and not t[0].is_contiguous():
            raise InvalidArgument(f"KV tensor {i}: each block's page must be contiguous")
        pb = int(page_bytes[i]) if page_bytes is not None else row
        if pb <= 0 or pb > row:
            raise InvalidArgument(f"KV tensor {i}: page_bytes {pb} not in (0, {row}]")
        bases.append(t.data_ptr())
        pages.append(pb)
        strides.append(t.stride(0) * esz)
        nblocks.append(t.shape[0])
    if len(set(nblocks)) != 1:
        raise InvalidArgument(f"KV tensors disagree on num_blocks: {sorted(set(nblocks))}")
    pages_a = np.asarray(pages, np.int64)
    offsets = np.concatenate([[0], np.cumsum(pages_a * blocks_per_chunk)[:-1]]).astype(np.int64)
    return KVLayout(np.asarray(bases, np.int64), pages_a, np.asarray(strides, np.int64),
                    nblocks[0], offsets)


class DeviceTransfer:
    """Copies between KV tensors and host pool slots.

    ``tensors`` are the engine's KV cache tensors (CPU tensors run on the CPU
    backend, engine worker threads; CUDA tensors on the CUDA backend).
    ``is_writer=False`` (replicated MLA layout, a non-writing TP rank) acks
    stores without copying.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        pool: HostPool,
        *,
        blocks_per_chunk: int = 1,
        page_bytes: Sequence[int] | None = None,
        is_writer: bool = True,
        num_threads: int = 2,
        budget_bytes: int = 1 << 30,
    ) -> None:
        if blocks_per_chunk < 1:
            raise InvalidArgument(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        devices = {str(t.device) for t in tensors}
        if len(devices) > 1:
            raise InvalidArgument(f"KV tensors are on several devices: {sorted(devices)}")
        self.device = devices.pop() if devices else "cpu"
        if self.device != "cpu":
            raise InvalidArgument(
                f"KV tensors on {self.device}: use kvtier.transfer_cuda.CudaDeviceTransfer"
            )
        self.layout = layout_from_tensors(tensors, page_bytes, blocks_per_chunk)
        self.blocks_per_chunk = blocks_per_chunk
        need = self.layout.chunk_page_bytes * blocks_per_chunk
        if need > pool.slot_bytes:
            raise InvalidArgument(
                f"a chunk needs {need} bytes but host slots hold {pool.slot_bytes}"
            )
        self.pool = pool
        self.is_writer = is_writer
        self._tensors = list(tensors)  # keep the memory alive
        self._engine = Engine(num_threads, [(budget_bytes, True)] * 3)
        self._engine.register_pool(pool)
        seen: set[int] = set()
        for t in self._tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                self._engine.register_memory(ptr, storage.nbytes(), owner=t)
        self._to_user: dict[int, int] = {}
        self._user: dict[int, int] = {}
        self._acks: list[TransferResult] = []

    # -- descriptors -------------------------------------------------------
    def descriptors(self, block_ids: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray,
                    first_block_index: int = 0, to_host: bool = True) -> np.ndarray:
        """``(N, 3)`` int64 copy descriptors, built with numpy (no per-block loop).

        ``first_block_index`` is the logical index of ``block_ids[0]`` in its
        request: the first chunk may be partly covered when blocks_per_chunk > 1.
        """
        b = np.asarray(block_ids, np.int64)
        s = np.asarray(slots, np.int64)
        lay, bpc = self.layout, self.blocks_per_chunk
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
        host = (self.pool.address + slot_of[:, None] * self.pool.slot_bytes
                + lay.chunk_offsets[None, :] + in_chunk[:, None] * lay.page_bytes[None, :])
        n = np.broadcast_to(lay.page_bytes[None, :], gpu.shape)
        src, dst = (gpu, host) if to_host else (host, gpu)
        return np.stack([src.ravel(), dst.ravel(), n.ravel()], axis=1)

    # -- OffloadingWorker-like API ------------------------------------------
    def submit_store(self, job_id: int, gpu_block_ids: Sequence[int] | np.ndarray,
                     host_slots: Sequence[int] | np.ndarray, first_block_index: int = 0) -> bool:
        """KV blocks -> host slots. False when the store queue is full (retry later)."""
        if not self.is_writer:
            self._acks.append(TransferResult(job_id, True, 0, 0.0))
            return True
        d = self.descriptors(gpu_block_ids, host_slots, first_block_index, to_host=True)
        return self._submit(job_id, d, STORE_QUEUE)

    def submit_load(self, job_id: int, host_slots: Sequence[int] | np.ndarray,
                    gpu_block_ids: Sequence[int] | np.ndarray, expedited: bool = False,
                    first_block_index: int = 0) -> bool:
        """Host slots -> KV blocks. Expedited loads have their own queue."""
        d = self.descriptors(gpu_block_ids, host_slots, first_block_index, to_host=False)
        return self._submit(job_id, d, EXPEDITED_QUEUE if expedited else LOAD_QUEUE)

    def _submit(self, job_id: int, descs: np.ndarray, queue: int) -> bool:
        if job_id in self._user:
            raise InvalidArgument(f"job id {job_id} is already in flight")
        if len(descs) == 0:
            self._acks.append(TransferResult(job_id, True, 0, 0.0))
            return True
        try:
            eid = self._engine.submit_copy(descs, queue)
        except Busy:
            return False
        self._to_user[eid] = job_id
        self._user[job_id] = eid
        return True

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs since the last call (acks first, then completion order)."""
        out, self._acks = self._acks, []
        for r in self._engine.poll():
            job = self._to_user.pop(r.job_id)
            self._user.pop(job, None)
            out.append(TransferResult(job, r.ok, int(r.nbytes), float(r.seconds)))
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until ``job_ids`` finished; their destination bytes are final."""
        eids = [self._user[j] for j in job_ids if j in self._user]
        if eids:
            self._engine.wait(eids, timeout)

    def shutdown(self) -> None:
        self._engine.close()
