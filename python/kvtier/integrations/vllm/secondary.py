"""vLLM shim, scheduler process: kvtier's disk and Redis tiers as
secondary tiers of vLLM's own ``TieringOffloadingSpec`` (behind vLLM's
host tier), moving bytes between their medium and vLLM's primary region.

Who calls: vLLM's tiering manager in the engine core, once per scheduler
step (submit, collect) and at shutdown; nothing blocks but ``shutdown``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.errors import InvalidArgument
from kvtier.options.surfaces import secondary_options
from kvtier.options.tiers import DiskOptions, RemoteOptions

if TYPE_CHECKING:
    from kvtier.tiers.base import LowerTier
from kvtier.integrations.vllm.config import check_current_engine, engine_namespace


class _ViewPool:
    """vLLM's primary region (a memoryview of rows) seen as a kvtier host pool."""

    def __init__(self, view: memoryview) -> None:
        arr = np.frombuffer(view, dtype=np.uint8)
        shape, strides = view.shape, view.strides
        assert shape is not None and strides is not None
        self._arr = arr.reshape(shape[0], strides[0])
        self.view_obj = view
        self.num_slots = int(shape[0])
        self.slot_bytes = int(strides[0])
        self.nbytes = self.num_slots * self.slot_bytes
        self.address = int(arr.ctypes.data)

    def view(self, slot: int, count: int = 1) -> np.ndarray:
        return self._arr[slot] if count == 1 else self._arr[slot : slot + count]


class _KVTierSecondary(SecondaryTierManager):
    """A kvtier lower tier as one of vLLM's secondary tiers (scheduler side):
    vLLM passes its own arguments, ``namespace`` and the entry's other keys,
    which are the fields of ``options_class`` (``required`` among them)."""

    options_class: ClassVar[type[DiskOptions] | type[RemoteOptions]]
    required: ClassVar[str]
    where: ClassVar[Locality]

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        namespace: str = "",
        backpressure_detector: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"secondary tier {tier_type}"
        if self.required not in settings:
            raise InvalidArgument(f"{where}: {type(self).__name__} needs a {self.required}")
        self._build(secondary_options(self.options_class, settings, where), namespace, tier_type)

    def _build(self, options: DiskOptions | RemoteOptions, namespace: str, name: str) -> None:
        """Build this tier's kvtier tier from ``options`` and attach it to vLLM's primary region."""
        from kvtier.tiers.factory import build_tier

        check_current_engine()
        self.locality = self.where
        spec = self._offloading_spec
        c = spec.config
        ns = engine_namespace(
            model=c.model.name,
            dtype=c.model.dtype,
            worker_kv_bytes_per_block=c.worker_kv_bytes_per_block,
            blocks_per_chunk=spec.blocks_per_chunk,
            world_size=(
                c.parallel.pp_size
                if getattr(spec, "replicated_layout", False)
                else c.parallel.world_size
            ),
            pp_size=c.parallel.pp_size,
            kv_cache_layout=getattr(c, "kv_cache_layout", None),
            canonical_layout=getattr(c, "canonical_layout", False),
            user_namespace=namespace,
            groups=c.groups,
        )
        self._attach(build_tier(options, self.block_size_bytes, ns, name=name))

    def _attach(self, tier: LowerTier) -> None:
        """Attach ``tier`` to vLLM's primary region; a tier that cannot be
        attached (a region it cannot use) is closed before the error
        propagates, so its directory lock or connections do not outlive it."""
        from kvtier.tiers.factory import close_after_failure

        self.tier = tier
        try:
            tier.attach(_ViewPool(self._primary_kv_view))  # type: ignore[arg-type]
        except BaseException:
            close_after_failure([tier])
            raise
        self._jobs: dict[int, TransferJob] = {}  # kvtier token -> vLLM job
        self._ready: list[JobResult] = []
        # Results of jobs that timed out while the device still held some of
        # their rows (slots still to be released): vLLM would reuse a row as
        # soon as its job is reported, so the report waits for the release.
        self._deferred: list[tuple[list[int], JobResult]] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        r = self.tier.lookup(bytes(key))
        return LookupResult.RETRY if r.name == "HIT_PENDING" else LookupResult[r.name]

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys = [bytes(k) for k in job.keys]
        slots = [int(s) for s in job.chunk_ids]
        token = self.tier.submit_store(keys, slots) if store else self.tier.submit_load(keys, slots)
        if token is None:  # backpressure / busy: the job fails now, nothing moved
            self._ready.append(JobResult(job_id=job.job_id, success=False, successful_keys=[]))
        else:
            self._jobs[token] = job

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=False)

    def _collect(self) -> None:
        for c in self.tier.poll():
            job = self._jobs.pop(c.token, None)
            if job is None:
                continue
            good = [k for k, ok in zip(job.keys, c.key_ok or [c.ok] * len(c.keys)) if ok]
            r = JobResult(
                job_id=job.job_id,
                success=c.ok,
                successful_keys=None if c.ok else good,
                transfer_time=time.monotonic() - job.submit_time,
                transfer_bytes=len(good) * self.block_size_bytes,
            )
            if c.held:
                rows = [int(s) for s, h in zip(job.chunk_ids, c.held) if h]
                self._deferred.append((rows, r))
            else:
                self._ready.append(r)
        for slot in self.tier.take_released_slots():
            for rows, _ in self._deferred:
                if slot in rows:
                    rows.remove(slot)
                    break
        if self._deferred:
            self._ready += [r for rows, r in self._deferred if not rows]
            self._deferred = [(rows, r) for rows, r in self._deferred if rows]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect()
        out, self._ready = self._ready, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        deadline = time.monotonic() + 60
        while self._jobs and time.monotonic() < deadline:
            self._collect()
            time.sleep(0.0005)

    def has_pending_work(self) -> bool:
        return (
            bool(self._jobs)
            or bool(self._ready)
            or bool(self._deferred)
            or self.tier.has_pending_work()
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        for e in self.tier.take_events():
            yield OffloadingEvent(
                # Blocks named by event id (kvtier.tiers.events.vllm_event_id) are
                # OffloadKeys of an 8-byte hash: vLLM publishes their int block hash.
                keys=[OffloadKey(k) for k in ([*e.keys, *e.ids] if e.ids else e.keys)],
                medium=self.medium or Medium.STORAGE,
                removed=e.removed,
                locality=self.locality,
                ownership=self.tier_type,
            )

    def shutdown(self) -> None:
        self.drain_jobs()
        self.tier.close()


class KVTierDiskTier(_KVTierSecondary):
    """kvtier's disk tier (io_uring, checksummed records, warm restart) as a
    vLLM secondary tier. Its arguments (beside vLLM's and ``namespace``) are
    the fields of :class:`~kvtier.options.DiskOptions` a secondary tier takes
    (``path`` required, ``capacity_bytes``, ``policy``, ...)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    options_class = DiskOptions
    required = "path"
    where = Locality.LOCAL


class KVTierRedisTier(_KVTierSecondary):
    """kvtier's remote tier (native pipelined RESP client, Redis/Valkey,
    cluster) as a vLLM secondary tier. Its arguments (beside vLLM's and
    ``namespace``) are the fields of :class:`~kvtier.options.RemoteOptions` a
    secondary tier takes (``url`` required, ``ttl_s``, ``tls_ca_file``, ...)."""

    medium: ClassVar[Medium] = Medium.CPU
    options_class = RemoteOptions
    required = "url"
    where = Locality.REMOTE
