"""KVTierConnector: vLLM's OffloadingConnector over kvtier, reporting failed loads.

vLLM's offloading worker (0.32, 0.33) asserts that every transfer succeeds,
so under the plain OffloadingConnector a Redis value that vanished or a disk
record that fails its check after the lookup said HIT would stop the engine.
This connector is that connector with one difference: the worker reports a
failed load's blocks through ``get_block_ids_with_load_errors`` and vLLM
recomputes them. For that it sets vLLM's ``kv_load_failure_policy`` to
"recompute" (vLLM's default, "fail", ends the request with an error: wrong
for a cache). Because failed loads are survivable, the engine's worker may
also read Redis values itself (a hit that finds no room in the host tier
loads from Redis instead of being recomputed).

It also loads a hit within the step that computes the rest of its prompt
(``sync_load_budget_bytes`` per step, default 64 MiB; 0 turns it off).
vLLM 0.33 does that itself; under 0.32 every hit took the asynchronous
path, two more engine steps before the prefill (measured on a later turn,
the worker's copy took 2.1-3 ms and the prefill began 5.2 ms after the load
was handed over), so this connector does it there: the hit is reported
synchronous, its blocks are loaded from the allocation's fresh blocks, and
the worker waits for the load before the forward pass. Under both, only a
hit that cannot fail to load (in ready host slots) is loaded within the
step; a fenced read or a stream takes the asynchronous path (see
:func:`_keep_risky_hits_async` for why).

Use it by module path; kvtier's spec is filled in::

    KVTransferConfig(kv_connector="KVTierConnector",
                     kv_connector_module_path="kvtier.integrations.vllm_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"kvtier_host_bytes": "64GiB", ...})

Not imported by the package :mod:`kvtier.integrations.vllm` because importing
vLLM's connector loads torch and vLLM's engine modules, which the API server
importing the spec module must not pay for.

Runs in vLLM's engine core (the scheduler side: the hit and the step's
loads) and in each worker (the load before the forward pass, which blocks
until a synchronous load is done). Who calls: vLLM, through the module path
:mod:`kvtier.integrations.vllm_connector`.

Process: vLLM's engine core (the scheduler side) and its workers (the
worker side).
"""

from __future__ import annotations

import logging
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvtier.errors import InvalidArgument, UnsupportedEngine
from kvtier.integrations.vllm.config import check_engine
from kvtier.integrations.vllm.host_spec import KVTierSpec
from kvtier.integrations.vllm.scheduler import KVTierManager
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.units import to_bytes

__all__ = ["KVTierConnector"]

_SPEC = ("KVTierReportingSpec", "kvtier.integrations.vllm")
# vLLM 0.33 loads a hit within the step itself (TransferJob.sync).
_NATIVE_SYNC_LOADS = "sync" in getattr(TransferJob, "__dataclass_fields__", {})
SYNC_LOAD_BUDGET = 64 << 20


class KVTierConnector(OffloadingConnector):
    """vLLM builds one per role (scheduler, each worker); see the module
    docstring. Everything but failed loads is OffloadingConnector's."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # Scheduler side, per load job in flight: [the manager's spec for it,
        # its engine blocks, workers yet to report it, whether one failed it,
        # its request]
        self._loads: dict[int, list[Any]] = {}
        check_engine(vllm_config)
        _use_kvtier_spec(vllm_config)
        ktc = vllm_config.kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM's default ("fail") ends the request with an error; for a
            # cache a failed load is a miss. The scheduler reads the policy
            # after building its connector, so this one setting wins.
            logging.getLogger("kvtier").info(
                "kvtier: kv_load_failure_policy %r -> 'recompute' (a failed load from a "
                "cache is recomputed, not an error)",
                ktc.kv_load_failure_policy,
            )
            ktc.kv_load_failure_policy = "recompute"
        extra = ktc.kv_connector_extra_config
        extra["sync_load_budget_bytes"] = sync_load_budget(extra)
        super().__init__(vllm_config, role, kv_cache_config)
        # Under vLLM 0.32, on the scheduler's side: the step's synchronous loads.
        self._sync: _SyncLoads | None = None
        # On a worker: whether synchronous loads are waited for layer by layer
        # (None: not known until the first one), and this step's.
        self._layered: bool | None = None
        self._awaited: set[int] = set()
        if self.connector_scheduler is not None:
            _tell_windows(self.connector_scheduler)
        budget = extra["sync_load_budget_bytes"]
        # The manager's requests whose last lookup found a hit that may fail
        # to load (see KVTierManager.risky_hits); None without sync loads.
        self._risky: set[Any] | None = None
        cs: Any = self.connector_scheduler
        if budget > 0 and cs is not None and isinstance(cs.manager, KVTierManager):
            # Only a lower tier's hit may fail to load (a stream, a fenced
            # fill): without one the per-key check is skipped (about 0.2 us
            # a HIT lookup, measured).
            cs.manager.track_risky = bool(getattr(cs.manager.m, "lower", True))
            self._risky = cs.manager.risky_hits
            if _NATIVE_SYNC_LOADS:
                _keep_risky_hits_async(cs, self._risky)
            else:
                self._sync = _SyncLoads(budget, _kv_bytes_per_token(kv_cache_config))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's front end builds the metrics from the spec's definitions
        without constructing a connector: the spec must be named first."""
        _use_kvtier_spec(vllm_config)
        return super().build_prom_metrics(vllm_config, *args, **kwargs)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        """OffloadingConnector's: a hit that fits the step's budget and
        cannot fail to load (no fenced fill, no stream: see
        KVTierManager.risky_hits) is reported synchronous (loaded before
        this step's forward pass), by vLLM 0.33 itself
        (:func:`_keep_risky_hits_async` keeps the others out) or by this
        connector under 0.32. Called by vLLM's scheduler for each waiting
        request it considers; non-blocking beyond the manager's lookup."""
        hit, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        risky = self._risky
        if risky is None:
            return hit, load_async
        may_fail = request.request_id in risky
        risky.discard(request.request_id)
        sync = self._sync
        if (
            sync is not None
            and hit
            and load_async
            and sync.reserve(request, num_computed_tokens, hit, may_fail)
        ):
            return hit, False
        return hit, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """OffloadingConnector's. A synchronous hit's blocks were hashed when
        allocated (vLLM caches them at once), which 0.32's connector takes for
        blocks already holding their KV: it is shown them as fresh, the ones
        past what the engine computed itself, so it loads them as for an
        asynchronous hit; the load job is marked synchronous."""
        sync = self._sync
        if sync is None or not num_external_tokens or request.request_id not in sync.requests:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        cs: Any = self.connector_scheduler  # vLLM 0.32's, whose private state this reads
        local = cs._req_status[request.request_id].num_locally_computed_tokens
        fresh = _FreshBlocks(blocks, local, cs.config.kv_group_configs)
        before = set(cs._current_batch_load_jobs)
        super().update_state_after_alloc(request, cast(Any, fresh), num_external_tokens)
        jobs = cs._req_status[request.request_id].transfer_jobs
        for job in set(cs._current_batch_load_jobs) - before:
            # 0.32 asserts that a request computing this step has no load in
            # flight (its stores are built in the same step): the job is out
            # of the request's set until its completion is processed.
            jobs.discard(job)
            sync.jobs.add(job)
            sync.pending[job] = request.request_id

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """OffloadingConnector's, remembering each new load's spec, engine
        blocks and workers still to report it (to tell the manager which
        load failed), and naming the step's synchronous loads for the
        workers."""
        meta: Any = super().build_connector_meta(scheduler_output)
        if self._sync is not None:
            meta.kvtier_sync_loads = self._sync.end_step()
        workers = int(getattr(self.scheduler.config, "num_workers", 1))
        for job_id, job in getattr(meta, "load_jobs", {}).items():
            if isinstance(job.src_spec, KVTierSpec):
                self._loads[job_id] = [
                    job.src_spec,
                    job.dst_spec.block_ids,
                    workers,
                    False,
                    job.req_id,
                ]
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """OffloadingConnector's; then a load whose blocks were among the
        invalid ones of any worker's report is told to the manager once all
        workers finished it: the manager forgets what it read, so that the
        request's recomputation (and later lookups) miss instead of loading
        the same bytes again. Called by vLLM's scheduler once per step; takes
        the manager's lock (vLLM 0.33 releases it when the base method
        returns, 0.32 does not hold it here)."""
        meta = connector_output.kv_connector_worker_meta
        if not getattr(meta, "completed_jobs", None):
            # No job ended (most steps): nothing of kvtier's to track.
            super().update_connector_output(connector_output)
            return
        done = dict(meta.completed_jobs)
        if self._sync is not None and self._sync.pending:
            for job in done:
                rid = self._sync.pending.pop(job, None)
                cs: Any = self.connector_scheduler
                status = cs._req_status.get(rid) if rid else None
                if status is not None:
                    status.transfer_jobs.add(job)
        super().update_connector_output(connector_output)
        bad = connector_output.invalid_block_ids
        failed = []
        computed_on_failed: set[str] = set()
        for job_id, count in done.items():
            load = self._loads.get(job_id)
            if load is None:
                continue
            if bad and not bad.isdisjoint(load[1]):
                load[3] = True
                computed_on_failed.add(load[4])
            load[2] -= count
            if load[2] <= 0:
                del self._loads[job_id]
                if load[3]:
                    failed.append(load[0])
        if failed or computed_on_failed:
            manager = self.scheduler.manager
            assert isinstance(manager, KVTierManager)
            # A synchronous load that failed left its engine blocks unfilled,
            # and the step computed the rest of its request on top of them:
            # vLLM recomputes the request, but the stores that step built
            # (still pending: submitted a step later) hold KV derived from
            # those blocks. Measured by the serving soak (issue 52): stored,
            # they gave later turns wrong tokens (4-6 of 245 requests in two
            # minutes while Redis evicted). Those stores are dropped.
            jobs: Any = getattr(self.connector_scheduler, "_jobs", {})
            poisoned = [
                k
                for st in jobs.values()
                if st.is_store and st.req_id in computed_on_failed
                for k in st.keys
            ]
            with manager.lock:
                if poisoned:
                    manager.poison_stores(poisoned)
                for spec in failed:
                    manager.load_failed(spec)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """OffloadingConnector's; then waits for the step's synchronous loads
        (their requests compute this step, on the loaded blocks). Called by
        vLLM's model runner on each worker before the forward pass; blocks
        for those loads only. Their requests are running, so their jobs must
        not come back as finished receiving (vLLM asserts that only a
        waiting or finished request does)."""
        sync = getattr(self._connector_metadata, "kvtier_sync_loads", None)
        if not sync:  # no load waited for this step (most steps)
            super().start_load_kv(forward_context, **kwargs)
            return
        cw = self.connector_worker
        worker = cw.worker if cw is not None else None
        if isinstance(worker, KVTierWorker):
            worker.expedite.update(sync)
            if self._layered is None:
                self._layered = _map_layers(worker, cw)
        super().start_load_kv(forward_context, **kwargs)
        if cw is not None and isinstance(worker, KVTierWorker):
            for job in sync:
                cw._load_jobs[job] = None
            if self._layered:
                # Each attention layer waits for its own part (wait_for_layer_load):
                # the copies of later layers overlap the compute of earlier ones.
                self._awaited = set(sync)
            else:
                worker.wait(set(sync))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer's part of the step's synchronous loads
        landed. Called by vLLM before each attention layer of the forward
        pass, on each worker."""
        if self._awaited:
            cw = self.connector_worker
            assert cw is not None and isinstance(cw.worker, KVTierWorker)
            cw.worker.wait_layer(self._awaited, layer_name)

    def wait_for_save(self) -> None:
        """OffloadingConnector's, after the step's synchronous loads ended
        whole (a layer the forward pass did not announce is loaded all the
        same before vLLM reports the loads). Called by vLLM after the
        forward pass, on each worker; blocks for those loads only."""
        if self._awaited:
            cw = self.connector_worker
            assert cw is not None and isinstance(cw.worker, KVTierWorker)
            cw.worker.wait(self._awaited)
            self._awaited = set()
        super().wait_for_save()  # type: ignore[no-untyped-call]

    def reset_cache(self) -> bool | None:
        """OffloadingConnector's; loads in flight across a reset are stale
        (vLLM skips their reports, the manager forgot their keys)."""
        self._loads.clear()
        if self._sync is not None:
            self._sync.pending.clear()
        return super().reset_cache()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids of loads that failed since the last call.

        Who calls: vLLM's model runner on each worker, once per forward pass
        after ``get_finished`` (the failed jobs were reported finished there).
        Non-blocking."""
        cw = self.connector_worker
        worker = cw.worker if cw is not None else None
        if isinstance(worker, KVTierWorker):
            return worker.take_load_errors()
        return set()


def _use_kvtier_spec(vllm_config: Any) -> None:
    """Name kvtier's reporting spec in the connector's extra config (vLLM's
    OffloadingConnector loads the spec it names)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    given = (extra.get("spec_name"), extra.get("spec_module_path"))
    if given != (None, None) and given != _SPEC:
        raise InvalidArgument(
            "KVTierConnector runs kvtier's own spec; drop spec_name and spec_module_path "
            f"(got {given[0]!r} from {given[1]!r})"
        )
    extra["spec_name"], extra["spec_module_path"] = _SPEC


def _keep_risky_hits_async(cs: Any, risky: set[Any]) -> None:
    """Make vLLM 0.33's connector scheduler ``cs`` load a request's hit
    asynchronously when its lookup found a hit that may fail to load
    (``risky``, KVTierManager.risky_hits); other hits keep its own
    synchronous loads.

    Why (vLLM 0.33 line numbers, v1/core/sched/scheduler.py): a synchronous
    hit's blocks are cached when allocated (``delay_cache_blocks`` is false
    for them, line 1442), so a request scheduled next finds them in its
    local prefix hit. When the load fails, the "recompute" policy keeps them
    cached (they are evicted only under "fail", lines 3756-3760) and leaves
    a request sharing them counted as computed, for the failed request to
    recompute them (lines 3644-3651, 3672-3682). Under asynchronous
    scheduling (vLLM 0.33's default) the next step, scheduled before the
    failure is reported, reads them first; a request aborted or preempted
    before its recomputation leaves them cached for good. The failure path
    cannot drop them: a connector has no handle on vLLM's KV-cache manager,
    and the next step has already read them when the failure is known. An
    asynchronous hit's blocks are cached only once loaded, and then only
    their valid prefix (lines 3467-3501). Measured with vLLM's own scheduler
    (tests/integration/test_vllm_scheduler_failed_load.py): a request
    sharing a failed synchronous load's prefix got a first token computed
    on blocks the load never filled, both ways.

    How: vLLM's ``_reserve_sync_load`` (kv_connector/v1/offloading/
    scheduler.py:1279-1302) told of no hit reserves nothing and forgets an
    earlier reservation of the request, and its caller then reports the hit
    asynchronous (line 1277). Called once, by KVTierConnector's constructor
    in the engine core. Raises UnsupportedEngine for a vLLM whose connector
    scheduler has no such method (its synchronous loads could not be kept
    to safe hits)."""
    reserve = getattr(cs, "_reserve_sync_load", None)
    if reserve is None:
        raise UnsupportedEngine(
            "kvtier: this vLLM loads hits within the step in a way kvtier cannot limit to "
            "hits that cannot fail to load (no OffloadingConnectorScheduler._reserve_sync_load), "
            "so a failed load could give wrong tokens. Set sync_load_budget_bytes: 0 in "
            "kv_connector_extra_config, or use vLLM 0.32 or 0.33."
        )

    def reserve_unless_risky(req_status: Any, num_computed_tokens: int, hit: int | None) -> bool:
        if req_status.req.request_id in risky:
            hit = 0
        return bool(reserve(req_status, num_computed_tokens, hit))

    cs._reserve_sync_load = reserve_unless_risky


class _SyncLoads:
    """The scheduler's synchronous loads of one step (vLLM 0.32 only): the
    requests reported synchronous, the bytes they take of the budget, and
    their load jobs, handed to the workers with the step's metadata."""

    def __init__(self, budget: int, bytes_per_token: int) -> None:
        self.budget, self.bytes_per_token = budget, bytes_per_token
        self.requests: set[str] = set()
        self.jobs: set[int] = set()
        self.used = 0
        # Sync load job -> its request, until the job's completion is processed.
        self.pending: dict[int, str] = {}

    def reserve(
        self, request: Any, num_computed_tokens: int, hit: int, may_fail: bool = False
    ) -> bool:
        """Whether ``hit`` tokens of ``request`` load this step: the load
        cannot fail (``may_fail``: a fenced fill or a stream among them; see
        KVTierManager.risky_hits), one token at least is left to compute (or
        nothing would be scheduled), and the step's budget holds them
        (sliding-window groups, which load only their window, are counted
        whole, as vLLM 0.33 does)."""
        self.requests.discard(request.request_id)
        size = hit * self.bytes_per_token
        if (
            may_fail
            or num_computed_tokens + hit >= request.num_tokens
            or self.used + size > self.budget
        ):
            return False
        self.used += size
        self.requests.add(request.request_id)
        return True

    def end_step(self) -> set[int]:
        """The step's synchronous load jobs; the next step starts empty."""
        jobs, self.jobs = self.jobs, set()
        self.requests.clear()
        self.used = 0
        return jobs


class _Fresh:
    """An engine block as a block without KV yet (no hash)."""

    __slots__ = ("block_id", "is_null")
    block_hash = None

    def __init__(self, block: Any) -> None:
        self.block_id, self.is_null = block.block_id, block.is_null


class _FreshBlocks:
    """A request's allocated blocks per KV-cache group, those past the
    first ``computed`` tokens shown as fresh (see update_state_after_alloc)."""

    def __init__(self, blocks: Any, computed: int, groups: Any) -> None:
        out = list(blocks.blocks)
        for g in groups:
            first = computed // g.tokens_per_block
            row = out[g.group_idx]
            out[g.group_idx] = list(row[:first]) + [_Fresh(b) for b in row[first:]]
        self.blocks = tuple(out)


def sync_load_budget(extra: dict[str, Any]) -> int:
    """``sync_load_budget_bytes`` of the connector's extra config as the int
    of bytes vLLM 0.33 reads: 64 MiB when not given, ``"64MiB"`` taken, 0
    (off) kept. Raises InvalidArgument for anything else."""
    budget = extra.get("sync_load_budget_bytes", SYNC_LOAD_BUDGET)
    if budget in (0, "0") and not isinstance(budget, bool):
        return 0
    try:
        return to_bytes("sync_load_budget_bytes", budget)
    except InvalidArgument as e:
        msg = str(e)
        raise InvalidArgument(
            msg if msg.startswith("sync_load_budget_bytes") else f"sync_load_budget_bytes: {msg}"
        ) from None


def _map_layers(worker: KVTierWorker, cw: Any) -> bool:
    """Name the worker's KV tensors by layer (the offloaded groups' layers,
    in vLLM's order) so a synchronous load is waited for layer by layer;
    whether any layer could be named. ``kvtier_layered_loads: false`` in the
    extra config keeps whole loads."""
    if not worker.layered_loads:
        return False
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )

    config = cw.kv_cache_config
    groups = [config.kv_cache_groups[g].layer_names for g in get_offloading_group_ids(config)]
    worker.map_layers(groups)
    return bool(worker.layers)


def _tell_windows(scheduler: Any) -> None:
    """Give the manager's read-ahead each sliding-window group's window
    (vLLM 0.32 keeps it in the connector's group configurations only)."""
    manager = getattr(scheduler, "manager", None)
    order = getattr(getattr(manager, "m", None), "key_order", None)
    windows = getattr(order, "windows", None)
    if windows is None:
        return
    for g in scheduler.config.kv_group_configs:
        if g.sliding_window_size_in_chunks:
            windows[int(g.group_idx).to_bytes(4, "big")] = int(g.sliding_window_size_in_chunks)


def _kv_bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes per token on one worker over every layer (for the sync-load
    budget); 0 when vLLM gives no KV-cache configuration."""
    total = 0
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = g.kv_cache_spec
        total += len(g.layer_names) * int(spec.page_size_bytes) // int(spec.block_size)
    return total
