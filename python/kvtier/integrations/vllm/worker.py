"""vLLM shim, worker processes: vLLM's ``OffloadingWorker`` over kvtier's
:class:`~kvtier.worker.transfer.DeviceTransfer` (KV cache <-> host slots), one per
KV-cache group, and the stream loader for chunks read straight from a lower
tier.

Who calls: vLLM's offloading connector in each GPU worker, once per forward
pass (submit, ``get_finished``) and ``wait`` before blocks are reused;
only ``wait`` blocks.

Process: each vLLM worker (one per GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

if TYPE_CHECKING:
    from kvtier.pool import HostPool
    from kvtier.scheduler.specs import StreamSpec
    from kvtier.worker.streaming import StreamChunk, StreamLoader
    from kvtier.worker.transfer import DeviceTransfer
from kvtier.errors import Timeout
from kvtier.integrations.vllm.host_spec import KVTierSpec
from kvtier.jobs import Joined
from kvtier.worker.chunks import GroupPart, chunk_bounds, layer_ranges, runs, split_groups

if TYPE_CHECKING:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec


_STREAM = -1  # the "group" of a job's streamed part in KVTierWorker._jobs


class KVTierWorker(OffloadingWorker):
    """vLLM's OffloadingWorker over kvtier's DeviceTransfer: one transfer per
    KV-cache group (each group's chunks have their own slots)."""

    def __init__(self, kv_caches: CanonicalKVCaches, spec: KVTierOffloadingSpec) -> None:
        from kvtier.affinity import off_compute_cpus

        pool = spec.host_pool()
        offset = spec.cell_index * spec.cell_bytes
        self.transfers: list[DeviceTransfer] = []
        # How long a wait for one of our copies may take before it is an
        # error naming the job (0: no bound); streamed parts are held to it too.
        self.wait_s = spec.kvtier.engine.transfer_wait_s
        self._groups: list[tuple[list[Any], list[int]]] = []  # per group: tensors, page bytes
        self._aliased: list[bool] = []  # per group: some of its layers share a tensor
        with off_compute_cpus():  # the copy threads start off the engine's compute cores
            self._start_transfers(kv_caches, spec, pool, offset)
        self.bpc = spec.blocks_per_chunk
        # For loads streamed from a lower tier: a staging ring made at first use.
        self._stream_args = (spec.slot_bytes, offset, _stream_slots(spec))
        self._stream: StreamLoader | None = None
        self._next = 0
        # vLLM's jobs, each made of parts: (group, transfer job) or (_STREAM, stream job).
        # A job is known here by an id of ours, so a job vLLM had refused (submit
        # returned False part way) never meets a later job of the same id.
        self._jobs: Joined[int, tuple[int, int], Any] = Joined()
        self._ours: dict[int, int] = {}  # vLLM's job id -> ours
        self._vllm: dict[int, int] = {}  # ours -> vLLM's job id
        self._refused: set[int] = set()  # ours, whose parts still run
        # Under KVTierConnector a failed load is reported as its engine
        # blocks (vLLM recomputes them) rather than as a failed job, which
        # vLLM's offloading worker asserts never happens.
        self.reports_load_errors = spec.reports_load_errors
        self._load_blocks: dict[int, np.ndarray | Sequence[int]] = {}  # load job -> engine blocks
        self._load_errors: set[int] = set()
        # Load jobs to put ahead of queued stores: KVTierConnector names those
        # the forward pass waits for (vLLM 0.33 passes expedited itself).
        self.expedite: set[int] = set()
        # Layer-by-layer loads: per KV-cache group, KV tensors per layer (0:
        # the group's tensors do not map one run per layer, so its loads
        # are waited for whole), and each layer's (group, index).
        self._per_layer = [0] * len(self._groups)
        self.layered_loads = spec.kvtier.engine.layered_loads
        self.layers: dict[str, tuple[int, int]] = {}
        # Ours -> {(group, layer index): transfer job} of a load split by layer.
        self._layer_parts: dict[int, dict[tuple[int, int], int]] = {}

    def _start_transfers(
        self, kv_caches: CanonicalKVCaches, spec: KVTierOffloadingSpec, pool: HostPool, offset: int
    ) -> None:
        """One DeviceTransfer (its own copy threads) per KV-cache group."""
        from kvtier.worker.transfer import DeviceTransfer

        for refs in kv_caches.group_data_refs:
            seen: dict[int, int] = {}
            for r in refs:  # layers aliasing one tensor are copied once
                seen.setdefault(r.tensor_idx, r.page_size_bytes)
            tensors = [kv_caches.tensors[i].tensor for i in seen]
            self._groups.append((tensors, list(seen.values())))
            self._aliased.append(len(seen) != len(refs))
            self.transfers.append(
                DeviceTransfer(
                    tensors,
                    pool,
                    blocks_per_chunk=spec.blocks_per_chunk,
                    page_bytes=list(seen.values()),
                    is_writer=spec.is_writer,
                    slot_offset=offset,
                    wait_timeout_s=self.wait_s,
                )
            )

    def _split(self, gpu: GPULoadStoreSpec, slots: np.ndarray) -> list[GroupPart]:
        """vLLM's GPU spec (its block ids, and per group their count and first
        index: vLLM 0.33's ``group_sizes`` and ``block_indices``) per group."""
        blocks = np.asarray(gpu.block_ids, np.int64)
        return split_groups(
            blocks,
            slots,
            self.bpc,
            getattr(gpu, "group_sizes", None),
            getattr(gpu, "block_indices", None),
        )

    def _submit(
        self,
        job_id: int,
        gpu: GPULoadStoreSpec,
        host: KVTierSpec,
        store: bool,
        expedited: bool = False,
    ) -> bool:
        if not store and self.reports_load_errors:
            self._load_blocks[job_id] = gpu.block_ids
        self._next += 1
        ours = self._next
        self._ours[job_id], self._vllm[ours] = ours, job_id
        ok = (
            self._submit_streamed(ours, gpu, host, host.stream, store, expedited)
            if host.stream is not None
            else self._submit_host(ours, gpu, host, store, expedited)
        )
        if not ok:  # vLLM takes the job back: what was submitted of it is dropped when it ends
            del self._ours[job_id]
            self._load_blocks.pop(job_id, None)
            self._refused.add(ours)
        self._jobs.seal(ours)
        return ok

    def _submit_host(
        self, ours: int, gpu: GPULoadStoreSpec, host: KVTierSpec, store: bool, expedited: bool
    ) -> bool:
        """Every chunk in a host slot: one transfer job per KV-cache group."""
        fences = None if store or host.fences is None else self._split(gpu, host.fences)
        for n, (g, blocks, slots, first) in enumerate(self._split(gpu, host.slots)):
            if len(blocks) == 0:
                continue
            t = self.transfers[g]
            armed = None if fences is None else fences[n][2]
            k = self._per_layer[g]
            if not store and expedited and k:
                # The forward pass waits for it layer by layer: one transfer
                # job per layer, in layer order, so layer 0 is ready first.
                parts = self._layer_parts.setdefault(ours, {})
                for i, tensors in enumerate(layer_ranges(len(t.layout.bases), k)):
                    self._next += 1
                    if not t.submit_load(
                        self._next,
                        slots,
                        blocks,
                        True,
                        first_block_index=first,
                        fences=armed,
                        tensors=tensors,
                    ):
                        return False
                    self._jobs.add(ours, (g, self._next))
                    parts[(g, i)] = self._next
                continue
            self._next += 1
            ok = (
                t.submit_store(self._next, blocks, slots, first_block_index=first)
                if store
                else t.submit_load(
                    self._next, slots, blocks, expedited, first_block_index=first, fences=armed
                )
            )
            if not ok:
                return False
            self._jobs.add(ours, (g, self._next))
        return True

    def _submit_streamed(
        self,
        ours: int,
        gpu: GPULoadStoreSpec,
        host: KVTierSpec,
        st: StreamSpec,
        store: bool,
        expedited: bool,
    ) -> bool:
        """A load or store of which some chunks (slot -1) move between the KV
        cache and a lower tier through the stream loader: runs of host chunks
        go as usual, one sub-job each; the streamed chunks make one stream job."""
        from kvtier.worker.streaming import StreamChunk, StreamLoader

        row = {int(i): n for n, i in enumerate(st.index.tolist())}  # key position -> stream row
        chunks: list[StreamChunk] = []
        pos0 = 0  # key position of the group's first chunk
        fences = None if store or host.fences is None else self._split(gpu, host.fences)
        for n_g, (g, blocks, slots, first) in enumerate(self._split(gpu, host.slots)):
            armed = None if fences is None else fences[n_g][2]
            bounds = chunk_bounds(first, len(blocks), len(slots), self.bpc)
            for in_host, c, end in runs(slots):
                if not in_host:
                    n = row[pos0 + c]
                    lo, hi = bounds[c]
                    chunks.append(
                        StreamChunk(
                            g,
                            blocks[lo:hi],
                            first + lo,
                            st.tiers[n],
                            st.locations[n],
                            st.digests[16 * n : 16 * n + 16],
                        )
                    )
                    continue
                lo, hi = bounds[c][0], bounds[end - 1][1]
                self._next += 1
                t = self.transfers[g]
                if not (
                    t.submit_store(
                        self._next, blocks[lo:hi], slots[c:end], first_block_index=first + lo
                    )
                    if store
                    else t.submit_load(
                        self._next,
                        slots[c:end],
                        blocks[lo:hi],
                        expedited,
                        first_block_index=first + lo,
                        fences=None if armed is None else armed[c:end],
                    )
                ):
                    return False
                self._jobs.add(ours, (g, self._next))
            pos0 += len(slots)
        if self._stream is None:
            from kvtier.affinity import off_compute_cpus

            slot_bytes, offset, num = self._stream_args
            with off_compute_cpus():
                self._stream = StreamLoader(
                    self._groups,
                    blocks_per_chunk=self.bpc,
                    slot_bytes=slot_bytes,
                    slot_offset=offset,
                    num_slots=num,
                )
        self._next += 1
        # The forward pass waits for it layer by layer (as _submit_host's).
        layers = self._per_layer if not store and expedited and any(self._per_layer) else None
        self._stream.submit(self._next, chunks, st.readers, store=store, layers=layers)
        self._jobs.add(ours, (_STREAM, self._next))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, KVTierSpec)
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, KVTierSpec)
        if job_id in self.expedite:
            self.expedite.discard(job_id)
            expedited = True
        return self._submit(job_id, dst_spec, src_spec, store=False, expedited=expedited)

    def get_finished(self) -> list[TransferResult]:
        """vLLM's jobs whose every part ended, in the order they ended."""
        if not self._jobs.busy():
            return []  # called on every engine step; most decode steps move nothing
        for g, t in enumerate(self.transfers):
            for r in t.get_finished():
                self._jobs.done((g, r.job_id), r)
        for r in self._stream.get_finished() if self._stream is not None else ():
            self._jobs.done((_STREAM, r.job_id), r)
        out = []
        for ended in self._jobs.take_ended():
            ours = ended.parent
            job = self._vllm.pop(ours)
            self._layer_parts.pop(ours, None)
            if ours in self._refused:
                self._refused.discard(ours)
                continue
            del self._ours[job]
            rs = ended.results
            ok = all(r.success for r in rs)
            blocks = self._load_blocks.pop(job, None)
            # A failed copy between the KV cache and host slots (not a stream's part).
            copy_failed = any(
                not p.result.success for p in ended.parts if p.result and p.sub[0] != _STREAM
            )
            if not ok and self.reports_load_errors and (blocks is not None or not copy_failed):
                # Finished all the same. A failed load's blocks go to
                # take_load_errors; a store that failed only in what the
                # worker wrote to a lower tier itself left a value or record
                # that fails its check when read (recomputed then). A store
                # into host slots that failed still fails: those bytes are
                # not checked when loaded, so they must never count as stored.
                why = "; ".join(sorted({r.error for r in rs if not r.success and r.error}))
                what = (
                    f"its {len(blocks)} blocks are recomputed"
                    if blocks is not None
                    else "a later read of it fails its check and is recomputed"
                )
                logging.getLogger("kvtier").warning(
                    "kvtier: %s job %d failed (%s): %s",
                    "load" if blocks is not None else "store",
                    job,
                    why or "no reason given",
                    what,
                )
                if blocks is not None:
                    self._load_errors.update(int(b) for b in blocks)
                ok = True
            out.append(
                TransferResult(
                    job_id=job,
                    success=ok,
                    transfer_size=sum(r.transfer_size or 0 for r in rs if r.success),
                    transfer_time=max((r.transfer_time or 0.0 for r in rs), default=0.0),
                )
            )
        return out

    def take_load_errors(self) -> set[int]:
        """Engine block ids of loads that failed since the last call (their
        jobs were reported finished). Called by KVTierConnector once per
        forward pass, after get_finished; non-blocking."""
        out, self._load_errors = self._load_errors, set()
        return out

    def map_layers(self, group_layers: Sequence[Sequence[str]]) -> None:
        """Name each KV-cache group's layers, in the order of the engine's
        KV-cache configuration (the order of its tensors here), so that a
        load the forward pass waits for is split and waited for layer by
        layer (:meth:`wait_layer`). A group whose tensors are not the same
        number per layer (layers aliasing one tensor, a packed layout) keeps
        whole loads. Called once by KVTierConnector after the KV caches are
        registered; non-blocking."""
        for g, names in enumerate(group_layers):
            if g >= len(self.transfers) or not names or self._aliased[g]:
                continue
            tensors = len(self.transfers[g].layout.bases)
            if tensors % len(names):
                continue
            self._per_layer[g] = tensors // len(names)
            for i, name in enumerate(names):
                self.layers[name] = (g, i)

    def wait_layer(self, job_ids: set[int], layer_name: str) -> None:
        """Block until this layer's part of each load in ``job_ids`` landed
        (and the loads' parts not split by layer: a group loaded whole; a
        streamed part submitted by layers waits for this layer only). A
        layer not named by :meth:`map_layers` waits for the loads whole.
        Called by KVTierConnector before each attention layer of a forward
        pass."""
        where = self.layers.get(layer_name)
        if where is None:
            self.wait(job_ids)
            return
        g, i = where
        for job in job_ids:
            ours = self._ours.get(job)
            if ours is None:
                continue
            parts = self._layer_parts.get(ours, {})
            split = set(parts.values())
            sub = parts.get((g, i))
            try:
                for pg, psub in self._jobs.subs(ours):
                    if pg == _STREAM and self._stream is not None:
                        self._stream.wait_layer(psub, g, i, self.wait_s or None)
                    elif psub == sub or psub not in split:
                        self._wait_part(pg, psub)
            except Timeout as e:
                raise Timeout(f"vLLM's transfer job {job}, layer {layer_name}: {e}") from None

    def _wait_part(self, g: int, sub: int) -> None:
        if g == _STREAM:
            assert self._stream is not None
            self._stream.wait([sub], self.wait_s or None)
        else:
            self.transfers[g].wait([sub])

    def wait(self, job_ids: set[int]) -> None:
        """Block until the jobs ended, each part at most ``wait_s``: past it,
        kvtier.Timeout names vLLM's job and the part that did not end."""
        for job in job_ids:
            ours = self._ours.get(job)
            try:
                for g, sub in [] if ours is None else self._jobs.subs(ours):
                    self._wait_part(g, sub)
            except Timeout as e:
                raise Timeout(f"vLLM's transfer job {job}: {e}") from None

    def shutdown(self) -> None:
        self._load_blocks.clear()
        if self._stream is not None:
            self._stream.close()
        for t in self.transfers:
            t.shutdown()


def _stream_slots(spec: KVTierOffloadingSpec) -> int:
    """Staging slots of the stream ring: ``kvtier_stream_slots``, else 32,
    or with layered loads as many as one step's synchronous loads take
    (``sync_load_budget_bytes``): a load read layer by layer holds every
    chunk's slot until its last layer arrived, so a smaller ring would
    read the later chunks' first layers only after the earlier chunks'
    last ones."""
    opts = spec.kvtier.engine
    if opts.stream_slots is not None:
        return int(opts.stream_slots)
    budget = spec.extra_config.get("sync_load_budget_bytes", 0)
    if not opts.layered_loads or not isinstance(budget, int):
        return 32
    return max(32, -(-budget // spec.slot_bytes))


# -- secondary tiers under vLLM's TieringOffloadingSpec ---------------------------
