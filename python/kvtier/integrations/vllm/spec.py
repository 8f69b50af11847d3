"""vLLM shim: kvtier as vLLM's whole offloading spec.

vLLM builds the spec in its engine core (scheduler) and in every worker:
``get_manager`` runs in the scheduler process, ``get_worker`` in each
worker. The host pool is one shared-memory region the first process creates
and the others attach to (blocking up to a timeout). The spec's transfer
format between them is :class:`~kvtier.integrations.vllm.host_spec.KVTierSpec`.

Who calls: vLLM's OffloadingConnector, once per process.
"""

from __future__ import annotations

import errno
import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)

from kvtier.errors import InvalidArgument
from kvtier.options.engines import VllmOptions
from kvtier.options.fields import key_of
from kvtier.options.tiers import HostOptions
from kvtier.planner import RankCells, host_pool_for_chunks, stage_disks
from kvtier.tiers.records import TRAILER_BYTES

if TYPE_CHECKING:
    from kvtier.pool import HostPool
    from kvtier.tiers.base import LowerTier
    from kvtier.tiers.factory import LowerOptions
from kvtier.integrations.vllm.config import (
    GAUGES,
    KVTIER_METRICS,
    check_current_engine,
    engine_namespace,
    parse_extra_config,
)

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler import KVTierManager


def _pool_name(engine_id: str, stage: int) -> str:
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:80] or "engine"
    return f"kvtier-{tag}-pp{stage}"


def _open_pool(name: str, num_slots: int, slot_bytes: int, timeout_s: float = 60.0) -> HostPool:
    """Create the shared pool, or attach when another process of the engine did."""
    from kvtier.errors import IoError
    from kvtier.pool import HostPool

    try:
        return HostPool(num_slots, slot_bytes, name=name)
    except IoError as e:
        if e.errno != errno.EEXIST:  # the scheduler or another worker created it
            raise
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pool = HostPool.attach(name)
            break
        except InvalidArgument:  # header not written yet: the creator is pre-faulting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    if (pool.num_slots, pool.slot_bytes) != (num_slots, slot_bytes):
        raise InvalidArgument(
            f"host pool {name} is {pool.num_slots} x {pool.slot_bytes} B, this process expects "
            f"{num_slots} x {slot_bytes} B: do all ranks share one kvtier configuration?"
        )
    return pool


def _wait_pool(name: str, timeout_s: float = 300.0) -> HostPool:
    """Attach to a pool another process creates (a pipeline stage's workers),
    waiting for it. Blocks up to ``timeout_s``."""
    from kvtier.errors import IoError
    from kvtier.pool import HostPool

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return HostPool.attach(name)
        except (IoError, InvalidArgument):  # not created, or not written yet
            if time.monotonic() > deadline:
                raise InvalidArgument(
                    f"host pool {name} of another pipeline stage did not appear in "
                    f"{timeout_s:.0f} s: are that stage's workers up?"
                ) from None
            time.sleep(0.05)


class KVTierOffloadingSpec(OffloadingSpec):
    """kvtier as vLLM's whole offloading spec (host tier, GPU worker, lower tiers)."""

    # Whether the connector above reports failed loads to vLLM (KVTierConnector
    # does, through KVTierReportingSpec; vLLM's OffloadingConnector asserts
    # every load succeeds). Only then may the engine's worker read Redis
    # values itself: one can vanish between the existence check and the read.
    reports_load_errors: ClassVar[bool] = False

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {}
        for name, doc in KVTIER_METRICS.items():
            gauge = name.rsplit("kvtier_", 1)[1] in GAUGES
            cls_ = OffloadingGaugeMetadata if gauge else OffloadingCounterMetadata
            defs[name] = cls_(documentation=doc)
        return defs

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        check_current_engine()
        self.kvtier = parse_extra_config(self.extra_config)
        opts: VllmOptions = self.kvtier.engine
        self.node = opts.node
        if self.kvtier.host.bytes is None and self.node is None:
            raise InvalidArgument(
                "kv_connector_extra_config needs kvtier_host_bytes (e.g. '64GiB') "
                "or kvtier_node (a kvtier node's socket)"
            )
        par = config.parallel
        self.world_size = int(par.world_size)
        self.rank = int(par.rank)
        self.pp_size = int(par.pp_size)
        # vLLM's replicated layout: see RankCells.
        self.replicated_layout = bool(getattr(config, "replicated_layout", False))
        rc = RankCells.of(self.world_size, self.rank, self.pp_size, self.replicated_layout)
        self.tp_size, self.stage = rc.tp_size, rc.stage
        self.cell_index, self.is_writer, cells = rc.cell_index, rc.is_writer, rc.cells
        self.cell_bytes = int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk)
        if self.pp_size > 1 and opts.num_slots is None:
            raise InvalidArgument(
                "kvtier_num_slots: required with pipeline parallelism (every stage must agree; "
                "see kvtier plan --host-memory)"
            )
        self.engine_id = str(config.engine_id)  # the node knows its workers by it
        if self.node is not None:
            self._node_layout(cells)
        else:
            assert self.kvtier.host.bytes is not None  # checked above
            self.num_slots, self.slot_bytes = host_pool_for_chunks(
                self.cell_bytes,
                cells,
                self.kvtier.host.bytes,
                trailer_bytes=TRAILER_BYTES if self.kvtier.disk is not None else 0,
                num_slots=opts.num_slots,
                setting=key_of(HostOptions, "bytes"),
            )
        self.namespace = engine_namespace(
            model=config.model.name,
            dtype=config.model.dtype,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            blocks_per_chunk=self.blocks_per_chunk,
            world_size=self.pp_size if self.replicated_layout else self.world_size,
            pp_size=self.pp_size,
            kv_cache_layout=getattr(config, "kv_cache_layout", None),
            canonical_layout=getattr(config, "canonical_layout", False),
            user_namespace=opts.namespace,
            groups=config.groups,
        )
        # Sliding-window groups by key suffix (the group index, as vLLM makes
        # keys): vLLM 0.33 says here; under 0.32 KVTierConnector fills them in.
        self.windows: dict[bytes, int] = {
            int(g.group_id).to_bytes(4, "big"): int(w)
            for g in config.groups
            if (w := getattr(g, "sliding_window_size_in_chunks", None))
        }
        if self.node is None:
            self.pool_name = _pool_name(self.engine_id, self.stage)
        self._manager: OffloadingManager | None = None
        self._pool: HostPool | None = None

    def _node_layout(self, cells: int) -> None:
        """Attached to a node: its pool for this engine's block size (every
        process of the engine asks; the node answers the same). Blocks for
        one round trip."""
        from kvtier.node.connection import pool_info

        if self.pp_size > 1:
            raise InvalidArgument(
                "kvtier_node: pipeline parallelism is not served by a node yet; "
                "leave kvtier_node unset (each engine its own host tier)"
            )
        if self.kvtier.disk is not None or self.kvtier.remote is not None:
            raise InvalidArgument(
                "kvtier_node: the node owns the disk and remote tiers; give their settings "
                "to `kvtier node` (--disk, --remote), not to the engine"
            )
        assert self.node is not None
        self.payload_bytes = self.cell_bytes * cells
        info = pool_info(self.node, self.payload_bytes, engine=self.engine_id)
        self.num_slots, self.slot_bytes = int(info["num_slots"]), int(info["slot_bytes"])
        self.pool_name = str(info["pool"])

    def _stage_ns(self, stage: int) -> str:
        return self.namespace if self.pp_size == 1 else f"{self.namespace}-stage{stage}"

    def _staged(self, tiers: list[LowerTier], pools: list[HostPool], name: str) -> LowerTier:
        if len(tiers) == 1:
            return tiers[0]
        from kvtier.tiers.staged import StagedTier

        for t in tiers:
            t.name = f"{name}-stage"
        return StagedTier(tiers, pools, name)

    def host_pool(self) -> HostPool:
        if self._pool is None:
            if self.node is not None:  # the node's: never created here
                from kvtier.pool import HostPool

                # As slots of this engine's size: the node's block sizes
                # share one region.
                self._pool = HostPool.attach(self.pool_name, slot_bytes=self.slot_bytes)
            else:
                self._pool = _open_pool(self.pool_name, self.num_slots, self.slot_bytes)
        return self._pool

    def get_manager(self) -> OffloadingManager:
        if self._manager is None and self.node is not None:
            from kvtier.integrations.vllm.scheduler import KVTierManager, LookupOrder
            from kvtier.node.client import NodeManager

            self._manager = KVTierManager(
                NodeManager(  # type: ignore[arg-type]
                    self.node,
                    self.namespace,
                    self.payload_bytes,
                    engine=self.engine_id,
                    key_order=LookupOrder(self.windows),
                    # As in-process: the node makes none for an engine
                    # without KV events (vLLM drops what it drains then).
                    events=bool(self.kv_events_config.enable_kv_cache_events),
                ),
                stats_path=self.kvtier.engine.stats_path,
            )
        if self._manager is None:
            from kvtier.tiers.factory import build_tiers, close_after_failure, kind_of

            # One pool per pipeline stage (just this one without PP); the
            # lower tiers move every stage's part of a block.
            pools = [
                self.host_pool() if st == self.stage else _wait_pool(_pool_name(self.engine_id, st))
                for st in range(self.pp_size)
            ]
            disk, remote = self.kvtier.disk, self.kvtier.remote
            trailer = TRAILER_BYTES if disk is not None else 0
            payloads = [p.slot_bytes - trailer for p in pools]
            # (options, block bytes, namespace) of each tier: per kind, one
            # per pipeline stage, grouped below into a StagedTier.
            wanted: list[tuple[LowerOptions, int, str]] = []
            if disk is not None:
                stages = stage_disks(disk, payloads)
                wanted += [
                    (stages[st], payloads[st], self._stage_ns(st)) for st in range(self.pp_size)
                ]
            if remote is not None:
                remote = replace(remote, worker_io=self.reports_load_errors)
                wanted += [(remote, payloads[st], self._stage_ns(st)) for st in range(self.pp_size)]
            # All or nothing: a tier that fails to build (Redis down) closes
            # those built before it (the disk tier's directory lock), and a
            # failure after them (a bad host policy) closes them all.
            built = build_tiers(wanted)
            try:
                lower = [
                    self._staged(built[i : i + self.pp_size], pools, kind_of(wanted[i][0]))
                    for i in range(0, len(built), self.pp_size)
                ]
                self._manager = self._build_manager(lower)
            except BaseException:
                close_after_failure(built)
                raise
        return self._manager

    def _build_manager(self, lower: list[LowerTier]) -> KVTierManager:
        """The manager over kvtier's host tier and the lower tiers ``lower``."""
        from kvtier.integrations.vllm.scheduler import KVTierManager, LookupOrder
        from kvtier.scheduler.manager import TieredOffloadingManager
        from kvtier.tiers.host_native import host_tier_from_options

        opts: VllmOptions = self.kvtier.engine
        host = host_tier_from_options(self.host_pool(), self.num_slots, self.kvtier.host)
        # Streaming needs one tier per record (no pipeline stages), and
        # stores a worker holding whole blocks (no tensor parallelism).
        streaming = self.pp_size == 1 and (opts.stream_slots is None or opts.stream_slots > 0)
        probe = opts.remote_probe
        return KVTierManager(
            TieredOffloadingManager(
                host,
                lower,
                streaming=streaming,
                streaming_stores=streaming and self.world_size == 1,
                # Measured (bench serve, host+disk): loading after a
                # promotion beat streaming every hit, 1.24x against 1.43x
                # of vLLM's prefix cache; streaming is for what has no room.
                promote=opts.promote,
                scan_wait_s=opts.scan_wait_ms / 1000,
                scan_bytes=opts.scan_bytes,
                key_order=LookupOrder(self.windows),
                # One GET per key not known yet rather than EXISTS then
                # GET: later turns 25.5 ms against 26.8 (bench serve,
                # host+redis, 3 runs each). The slots a new prompt's
                # probes take (evicting what the host tier would evict
                # to store that prompt moments later) come back at once;
                # when blocks are stored only after several sightings
                # that eviction would be wasted, so check first.
                probe=self.kvtier.host.admit_after == 1 if probe is None else probe,
                # A fenced read that fails fails the load waiting on it:
                # only where the connector reports that to vLLM.
                fenced=self.reports_load_errors and opts.fenced_reads,
                cascade_on_hit=opts.lower_writes == "on_reuse",
                partial_stores=opts.partial_stores,
                # The engine publishes no KV events: vLLM drains the
                # manager's and drops them (its own manager makes none).
                events=bool(self.kv_events_config.enable_kv_cache_events),
            ),
            stats_path=opts.stats_path,
            shared_tiers=[t.name for t in lower],
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from kvtier.integrations.vllm.worker import KVTierWorker

        return KVTierWorker(kv_caches, self)


class KVTierReportingSpec(KVTierOffloadingSpec):
    """The spec :class:`kvtier.integrations.vllm_connector.KVTierConnector`
    loads: the same tiers, with failed loads reported to vLLM as blocks to
    recompute, so the engine's worker may also read Redis hits itself."""

    reports_load_errors: ClassVar[bool] = True
