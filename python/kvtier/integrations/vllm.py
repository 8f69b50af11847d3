"""vLLM 0.33 connector shim: with ``vllm_connector``, the only kvtier modules
that import vllm.

Two routes, both loaded by vLLM's OffloadingConnector (or kvtier's
subclass of it, :mod:`kvtier.integrations.vllm_connector`) from
``kv_connector_extra_config``:

- the whole spec: ``{"spec_name": "KVTierOffloadingSpec",
  "spec_module_path": "kvtier.integrations.vllm", "kvtier_host_bytes": ...}``
  (kvtier's host tier, GPU worker and lower tiers); ``KVTierReportingSpec``,
  the same under KVTierConnector, which reports failed loads to vLLM;
- secondary tiers under vLLM's own ``TieringOffloadingSpec``:
  ``{"secondary_tiers": [{"type": "KVTierDiskTier", "module_path":
  "kvtier.integrations.vllm", "path": "/mnt/nvme/kv"}]}`` (and
  ``KVTierRedisTier`` with ``url``).

vLLM imports this module in its API server, engine core and every worker, so
importing it loads only vLLM's light base modules: kvtier's native core,
torch-side transfers and vLLM's heavy stats module are imported on first use.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.errors import InvalidArgument, UnsupportedEngine
from kvtier.planner import host_pool_for_chunks
from kvtier.tiers.records import TRAILER_BYTES, namespace_name
from kvtier.units import FreeFraction, to_bytes, to_capacity

if TYPE_CHECKING:
    from kvtier.manager import StreamSpec, TieredOffloadingManager
    from kvtier.pool import HostPool
    from kvtier.streaming import StreamChunk, StreamLoader
    from kvtier.tiers.base import LowerTier
    from kvtier.transfer import DeviceTransfer

__all__ = [
    "KVTierDiskTier", "KVTierOffloadingSpec", "KVTierRedisTier", "KVTierReportingSpec", "KVTierSpec",
]  # fmt: skip

# Keys of kv_connector_extra_config that vLLM itself reads (never ours to reject).
_VLLM_KEYS = {
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "self_describing_kv_events", "offload_prompt_only", "sync_load_budget_bytes",
}  # fmt: skip
# kvtier's keys: name -> (type, what it is)
CONFIG_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "kvtier_host_bytes": ((int, str), "host tier size across all workers, e.g. 64GiB (required)"),
    "kvtier_policy": (str, "host eviction policy: lru, arc or a dotted class path (default lru)"),
    "kvtier_disk_policy": (
        str,
        "disk eviction policy (native): lru, clock or clock:N (default lru)",
    ),
    "kvtier_admit_after": (int, "store a block after it was offered N times (default 1)"),
    "kvtier_disk_path": (str, "directory of the disk tier (optional)"),
    "kvtier_disk_bytes": (
        (int, str),
        "disk tier size, e.g. 100GiB, or a share of the free space, e.g. 80% (default 100GiB)",
    ),
    "kvtier_disk_reserve": (
        (int, str),
        "free space the disk tier never takes (default 5% of the file system, at most 4GiB)",
    ),
    "kvtier_disk_write_budget": (
        (int, str),
        "disk write budget in bytes per second (default none)",
    ),
    "kvtier_disk_timeout_s": (
        (int, float),
        "a disk job not done after this fails; its memory stays held until it ends (default 30)",
    ),
    "kvtier_remote_url": (
        str,
        "redis://[USER:PASS@]HOST:PORT or redis-cluster://H:P,H:P; rediss:// for TLS (optional)",
    ),
    "kvtier_remote_tls_ca_file": (str, "rediss: PEM CA file (default: the system's trust store)"),
    "kvtier_remote_tls_cert_file": (str, "rediss: PEM client certificate (optional)"),
    "kvtier_remote_tls_key_file": (str, "rediss: PEM key of the client certificate (optional)"),
    "kvtier_remote_tls_server_name": (str, "rediss: name the server certificate must carry"),
    "kvtier_remote_ttl_s": ((int, float), "expiry of remote values in seconds (default none)"),
    "kvtier_namespace": (str, "extra namespace mixed into every key (default none)"),
    "kvtier_num_slots": (int, "host slots per rank; required with pipeline parallelism"),
    "kvtier_stats_path": (
        str,
        "write kvtier's counters and host occupancy here as JSON at shutdown",
    ),
    "kvtier_promote": (
        bool,
        "copy a disk hit into the host tier before loading it (default true; false: the worker "
        "streams every disk hit into the engine's cache itself)",
    ),
    "kvtier_remote_probe": (
        bool,
        "keys the Redis tier does not know yet are read with one GET into a host slot (true) or "
        "checked with EXISTS first (false; with kvtier_promote false the worker then streams "
        "them); default true when kvtier_admit_after is 1",
    ),
    "kvtier_fenced_reads": (
        bool,
        "under KVTierConnector, a returning prefix read ahead from Redis is HIT before its "
        "values arrive and the engine's copies wait for each block's value (the read and the "
        "load overlap; default true); false: the lookup waits for every value first",
    ),
    "kvtier_stream_slots": (
        int,
        "staging slots per worker for blocks moved straight between the engine and the disk "
        "or Redis tier when the host tier has no room (default 32; 0 turns streaming off)",
    ),
    "kvtier_scan_wait_ms": (
        (int, float),
        "a request's first lookup that misses the host tier reads its prefix from the lower "
        "tiers and waits for it, at most this long per scheduler step (default 20; 0: never "
        "wait, hits become readable a step later)",
    ),
    "kvtier_scan_bytes": (
        (int, str),
        "at most this much read per scheduler step by such waits (default 64MiB)",
    ),
}
_GAUGES = ("host_usage_perc", "host_busy", "tier_jobs")

_SOURCE_MEDIUM = {"host": (Medium.CPU, None), "disk": (Medium.STORAGE, Locality.LOCAL),
                  "remote": (Medium.CPU, Locality.REMOTE)}  # fmt: skip
KVTIER_METRICS = {
    "vllm:kv_offload_kvtier_host_usage_perc": "Fraction of kvtier host slots in use.",
    "vllm:kv_offload_kvtier_host_busy": "kvtier host blocks pinned, being written or held.",
    "vllm:kv_offload_kvtier_tier_jobs": "kvtier lower-tier jobs in flight.",
    "vllm:kv_offload_kvtier_loaded_host": "Chunks loaded into the engine from kvtier's host tier.",
    "vllm:kv_offload_kvtier_loaded_disk": "Chunks loaded into the engine after promotion from disk.",
    "vllm:kv_offload_kvtier_loaded_remote": "Chunks loaded into the engine after promotion from Redis.",
    "vllm:kv_offload_kvtier_promotions": "Blocks promoted from lower tiers into the host tier.",
    "vllm:kv_offload_kvtier_cascades": "Blocks copied from the host tier to lower tiers.",
    "vllm:kv_offload_kvtier_cascades_dropped": "Cascades dropped under backpressure.",
    "vllm:kv_offload_kvtier_allocation_failures": "Stores or promotions refused for lack of room.",
    "vllm:kv_offload_kvtier_scan_reads": "Blocks read ahead by a lookup and readable in its step.",
    "vllm:kv_offload_kvtier_fenced_reads": "Blocks read ahead and HIT before their value "
    "arrived (the engine's copy waits for it).",
    "vllm:kv_offload_kvtier_fenced_failures": "Of those, reads that failed (their loads recomputed).",
    "vllm:kv_offload_kvtier_scan_timeouts": "Read-ahead waits cut short by their deadline.",
    "vllm:kv_offload_kvtier_scan_waits": "Lookups that waited for their request's read-ahead.",
    "vllm:kv_offload_kvtier_scan_wait_us": "Microseconds lookups waited for read-ahead, in all.",
    "vllm:kv_offload_kvtier_load_failures": "Chunks of loads that failed in the engine's worker "
    "(recomputed by vLLM under KVTierConnector).",
}


def parse_extra_config(extra: dict[str, Any] | Any) -> dict[str, Any]:
    """Validate kvtier's keys of ``kv_connector_extra_config``; clear errors for
    unknown or mistyped ones. Returns the kvtier keys with sizes in bytes."""
    if not isinstance(extra, Mapping):
        raise InvalidArgument(
            f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"kv_connector_extra_config keys must be strings, got {key!r}")
        if not key.startswith("kvtier_"):
            continue
        if key not in CONFIG_KEYS:
            known = ", ".join(sorted(CONFIG_KEYS))
            raise InvalidArgument(f"unknown kv_connector_extra_config key {key!r}; known: {known}")
        typ, _ = CONFIG_KEYS[key]
        if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
            raise InvalidArgument(f"{key}: expected {typ}, got {value!r}")
        out[key] = value
    for key in (
        "kvtier_host_bytes", "kvtier_disk_reserve", "kvtier_disk_write_budget", "kvtier_scan_bytes",
    ):  # fmt: skip
        if key in out:
            out[key] = to_bytes(key, out[key])
    if "kvtier_disk_bytes" in out:
        out["kvtier_disk_bytes"] = to_capacity("kvtier_disk_bytes", out["kvtier_disk_bytes"])
    if out.get("kvtier_admit_after", 1) < 1:
        raise InvalidArgument("kvtier_admit_after: must be >= 1")
    if out.get("kvtier_scan_wait_ms", 0) < 0:
        raise InvalidArgument("kvtier_scan_wait_ms: must be >= 0")
    return out


def check_engine(vllm_config: Any) -> None:
    """Refuse an engine that would compute wrong tokens from loaded KV.

    vLLM's CPU platform turns prefix caching and chunked prefill off for MLA
    models on its reference CPU_MLA backend (not on AMX_MLA), because that
    backend's prefill over cached context is wrong. A connector that loads a
    prefix into such an engine gets different tokens (measured with a small
    DeepSeek-V3-shaped model: the latents kvtier loaded were bitwise equal
    to the ones the engine computed for the same tokens, and vLLM's own
    prefix cache, forced on, gave the same wrong tokens). Who calls: the
    shim's connector and spec, in every engine process, at start-up; cheap.
    Raises :class:`~kvtier.errors.UnsupportedEngine`."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None or cache is None or not getattr(model, "use_mla", False):
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not cache.enable_prefix_caching:
        raise UnsupportedEngine(
            "kvtier: this engine cannot use offloaded KV for an MLA model: vLLM's CPU "
            "platform turned prefix caching off for it (its CPU_MLA backend does not "
            "compute a prompt on top of cached context, so loaded prefixes would give "
            "wrong tokens). Serve it without kv_transfer_config, or where the engine "
            "keeps prefix caching on (a GPU, or vLLM's AMX_MLA backend with a bfloat16 "
            "model on a CPU with AMX)."
        )


def _check_current_engine() -> None:
    """:func:`check_engine` on the config vLLM is building, where the caller
    (a spec or secondary tier, handed only vLLM's OffloadingConfig) runs
    inside vLLM's config context; nothing outside one."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # a vLLM without it: the connector checks
        return
    current = get_current_vllm_config_or_none()
    if current is not None:
        check_engine(current)


class KVTierSpec(LoadStoreSpec):
    """Host pool slots, co-indexed with the keys of the manager call that
    made it; -1 for keys the worker streams from a lower tier (``stream``);
    ``fences``: armed fences of slots still being filled (see
    :class:`~kvtier.manager.HostSpec`)."""

    def __init__(
        self,
        slots: np.ndarray,
        stream: StreamSpec | None = None,
        fences: np.ndarray | None = None,
    ) -> None:
        self.slots = np.asarray(slots, np.int64)
        self.block_ids = self.slots  # vLLM's BlockIDsLoadStoreSpec spelling
        self.stream = stream
        self.fences = fences

    def __len__(self) -> int:
        return len(self.slots)


def engine_namespace(
    *,
    model: str,
    dtype: str,
    worker_kv_bytes_per_block: int,
    blocks_per_chunk: int,
    world_size: int,
    pp_size: int,
    kv_cache_layout: str | None,
    canonical_layout: bool,
    user_namespace: str,
    groups: Iterable[Any],
) -> str:
    """The namespace of this engine's blocks in kvtier's disk and Redis tiers,
    the same for both routes (the whole spec, per pipeline stage, and the
    secondary tiers): what makes bytes compatible (DESIGN.md, hard rule 4).

    Model, KV dtype, one worker's KV bytes per block, blocks per chunk, the
    world and pipeline sizes (TP=2 and PP=2 move equal bytes of different
    layers), vLLM's KV layout and whether the canonical one was asked for, the
    user's extra tag, and the KV-cache group structure (``groups``: vLLM's
    ``OffloadingConfig.groups``; each group's tokens per block and number of
    layers count). Pure; see :func:`~kvtier.tiers.records.namespace_name`.
    """
    structure = tuple((int(g.tokens_per_block), len(g.layer_names)) for g in groups)
    return namespace_name((
        model, dtype, int(worker_kv_bytes_per_block), int(blocks_per_chunk), int(world_size),
        int(pp_size), kv_cache_layout, bool(canonical_layout), structure, user_namespace,
    ))  # fmt: skip


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
            gauge = name.rsplit("kvtier_", 1)[1] in _GAUGES
            cls_ = OffloadingGaugeMetadata if gauge else OffloadingCounterMetadata
            defs[name] = cls_(documentation=doc)
        return defs

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _check_current_engine()
        self.kvtier = parse_extra_config(self.extra_config)
        if "kvtier_host_bytes" not in self.kvtier:
            raise InvalidArgument(
                "kv_connector_extra_config needs kvtier_host_bytes (e.g. '64GiB')"
            )
        par = config.parallel
        self.world_size = int(par.world_size)
        self.rank = int(par.rank)
        self.pp_size = int(par.pp_size)
        self.tp_size = max(1, self.world_size // max(1, self.pp_size))
        self.stage = self.rank // self.tp_size if self.pp_size > 1 else 0
        # A slot holds one chunk of every rank of this stage, rank cells back to back
        # (each stage has its own pool: with uneven layer splits their cells differ).
        # vLLM's replicated layout (MLA: every TP rank holds the same latent)
        # keeps one cell a slot: rank 0 writes it and every rank reads it, so
        # the latent is stored once, and its blocks do not depend on the TP size.
        self.replicated_layout = bool(getattr(config, "replicated_layout", False))
        self.cell_bytes = int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk)
        rank_in_stage = self.rank % self.tp_size if self.pp_size > 1 else self.rank
        self.cell_index = 0 if self.replicated_layout else rank_in_stage
        self.is_writer = not self.replicated_layout or rank_in_stage == 0
        cells = (
            1 if self.replicated_layout else (self.tp_size if self.pp_size > 1 else self.world_size)
        )
        if self.pp_size > 1 and "kvtier_num_slots" not in self.kvtier:
            raise InvalidArgument(
                "kvtier_num_slots: required with pipeline parallelism (every stage must agree; "
                "see kvtier plan --host-memory)"
            )
        self.num_slots, self.slot_bytes = host_pool_for_chunks(
            self.cell_bytes,
            cells,
            self.kvtier["kvtier_host_bytes"],
            trailer_bytes=TRAILER_BYTES if "kvtier_disk_path" in self.kvtier else 0,
            num_slots=self.kvtier.get("kvtier_num_slots"),
            setting="kvtier_host_bytes",
        )
        self.namespace = engine_namespace(
            model=config.model.name, dtype=config.model.dtype,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            blocks_per_chunk=self.blocks_per_chunk,
            world_size=self.pp_size if self.replicated_layout else self.world_size,
            pp_size=self.pp_size, kv_cache_layout=getattr(config, "kv_cache_layout", None),
            canonical_layout=getattr(config, "canonical_layout", False),
            user_namespace=self.kvtier.get("kvtier_namespace", ""), groups=config.groups,
        )  # fmt: skip
        self.engine_id = str(config.engine_id)
        self.pool_name = _pool_name(self.engine_id, self.stage)
        self._manager: OffloadingManager | None = None
        self._pool: HostPool | None = None

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
            self._pool = _open_pool(self.pool_name, self.num_slots, self.slot_bytes)
        return self._pool

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            k = self.kvtier
            # One pool per pipeline stage (just this one without PP); the
            # lower tiers move every stage's part of a block.
            pools = [
                self.host_pool() if st == self.stage else _wait_pool(_pool_name(self.engine_id, st))
                for st in range(self.pp_size)
            ]
            from dataclasses import replace

            from kvtier.tiers.factory import TierConfig, build_tiers, close_after_failure

            trailer = TRAILER_BYTES if "kvtier_disk_path" in k else 0
            payloads = [p.slot_bytes - trailer for p in pools]
            cfg = TierConfig(
                disk_path=k.get("kvtier_disk_path"),
                disk_bytes=k.get("kvtier_disk_bytes", 100 << 30),
                disk_reserve_bytes=k.get("kvtier_disk_reserve"),
                disk_policy=k.get("kvtier_disk_policy", "lru"),
                disk_write_budget_bps=k.get("kvtier_disk_write_budget"),
                disk_timeout_s=k.get("kvtier_disk_timeout_s", 30.0),
                remote_url=k.get("kvtier_remote_url"),
                remote_ttl_s=k.get("kvtier_remote_ttl_s"),
                remote_tls_ca_file=k.get("kvtier_remote_tls_ca_file"),
                remote_tls_cert_file=k.get("kvtier_remote_tls_cert_file"),
                remote_tls_key_file=k.get("kvtier_remote_tls_key_file"),
                remote_tls_server_name=k.get("kvtier_remote_tls_server_name"),
                remote_worker_io=self.reports_load_errors,
            )
            # (kind, config, block bytes, namespace) of each tier: per kind,
            # one per pipeline stage, grouped below into a StagedTier.
            wanted: list[tuple[str, TierConfig, int, str]] = []
            disk_path = cfg.disk_path
            if disk_path is not None:
                # Each stage its own directory, and a share of the bytes in
                # proportion to its part of a block.
                if self.pp_size > 1 and isinstance(cfg.disk_bytes, FreeFraction):
                    # One share of the free space for all stages, taken before
                    # the first one allocates (their slabs count as free).
                    from pathlib import Path

                    from kvtier.tiers.disk import resolve_capacity

                    root = Path(disk_path)
                    root.mkdir(mode=0o700, parents=True, exist_ok=True)
                    own = root.glob("stage*/kvtier-*/slab-*.dat")
                    cfg = replace(cfg, disk_bytes=resolve_capacity(cfg.disk_bytes, root, own))
                total = cfg.disk_bytes if isinstance(cfg.disk_bytes, int) else 0  # pp == 1
                stage_cfgs = [
                    cfg if self.pp_size == 1 else replace(
                        cfg, disk_path=os.path.join(disk_path, f"stage{st}"),
                        disk_bytes=total * payloads[st] // sum(payloads))
                    for st in range(self.pp_size)
                ]  # fmt: skip
                wanted += [("disk", stage_cfgs[st], payloads[st], self._stage_ns(st))
                           for st in range(self.pp_size)]  # fmt: skip
            if cfg.remote_url is not None:
                wanted += [("remote", cfg, payloads[st], self._stage_ns(st))
                           for st in range(self.pp_size)]  # fmt: skip
            # All or nothing: a tier that fails to build (Redis down) closes
            # those built before it (the disk tier's directory lock), and a
            # failure after them (a bad host policy) closes them all.
            built = build_tiers(wanted)
            try:
                lower = [
                    self._staged(built[i : i + self.pp_size], pools, wanted[i][0])
                    for i in range(0, len(built), self.pp_size)
                ]
                self._manager = self._build_manager(k, lower)
            except BaseException:
                close_after_failure(built)
                raise
        return self._manager

    def _build_manager(self, k: dict[str, Any], lower: list[LowerTier]) -> KVTierManager:
        """The manager over kvtier's host tier and the lower tiers ``lower``."""
        from kvtier.manager import TieredOffloadingManager
        from kvtier.tiers.host import HostTier

        host = HostTier(
            self.host_pool(),
            self.num_slots,
            policy=k.get("kvtier_policy", "lru"),
            admit_after=k.get("kvtier_admit_after", 1),
        )
        # Streaming needs one tier per record (no pipeline stages), and
        # stores a worker holding whole blocks (no tensor parallelism).
        streaming = self.pp_size == 1 and k.get("kvtier_stream_slots", 32) > 0
        return KVTierManager(
            TieredOffloadingManager(
                host,
                lower,
                streaming=streaming,
                streaming_stores=streaming and self.world_size == 1,
                # Measured (bench serve, host+disk): loading after a
                # promotion beat streaming every hit, 1.24x against 1.43x
                # of vLLM's prefix cache; streaming is for what has no room.
                promote=k.get("kvtier_promote", True),
                scan_wait_s=k.get("kvtier_scan_wait_ms", 20) / 1000,
                scan_bytes=k.get("kvtier_scan_bytes", 64 << 20),
                key_order=following_keys,
                # One GET per key not known yet rather than EXISTS then
                # GET: later turns 25.5 ms against 26.8 (bench serve,
                # host+redis, 3 runs each). The slots a new prompt's
                # probes take (evicting what the host tier would evict
                # to store that prompt moments later) come back at once;
                # when blocks are stored only after several sightings
                # that eviction would be wasted, so check first.
                probe=k.get("kvtier_remote_probe", k.get("kvtier_admit_after", 1) == 1),
                # A fenced read that fails fails the load waiting on it:
                # only where the connector reports that to vLLM.
                fenced=self.reports_load_errors and k.get("kvtier_fenced_reads", True),
            ),
            stats_path=k.get("kvtier_stats_path"),
            shared_tiers=[t.name for t in lower],
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return KVTierWorker(kv_caches, self)


class KVTierReportingSpec(KVTierOffloadingSpec):
    """The spec :class:`kvtier.integrations.vllm_connector.KVTierConnector`
    loads: the same tiers, with failed loads reported to vLLM as blocks to
    recompute, so the engine's worker may also read Redis hits itself."""

    reports_load_errors: ClassVar[bool] = True


class _PrefixOrder:
    """A request's keys in prefix order, per KV-cache group, kept on its
    ReqContext (``set_state``) until vLLM records more keys: sorting them
    again for every lookup of a long prompt would cost milliseconds."""

    def __init__(self, positions: dict[Any, int]) -> None:
        self.count = len(positions)
        self.groups: dict[bytes, list[bytes]] = {}
        self.index: dict[bytes, int] = {}
        for k, _ in sorted(positions.items(), key=lambda kv: kv[1]):
            keys = self.groups.setdefault(k[-4:], [])
            self.index[k] = len(keys)
            keys.append(k)


def following_keys(key: bytes, req_context: Any) -> list[bytes]:
    """The keys of ``key``'s KV-cache group that the request looks up after
    it, in prefix order: vLLM 0.32 and 0.33 record every key's end-token
    position in ``ReqContext`` before they look any up (``update_offload_keys``).
    Empty when the context has none (another vLLM, or a key not recorded)."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or key not in positions:
        return []
    get_state = getattr(req_context, "get_state", None)
    order = get_state(_PrefixOrder) if get_state is not None else None
    if order is None or order.count != len(positions):
        order = _PrefixOrder(positions)
        if get_state is not None:
            req_context.set_state(order)
    return order.groups[key[-4:]][order.index[key] + 1 :]


class KVTierManager(OffloadingManager):
    """vLLM's OffloadingManager over kvtier's TieredOffloadingManager."""

    def __init__(
        self,
        m: TieredOffloadingManager,
        stats_path: str | None = None,
        shared_tiers: Sequence[str] = (),
    ) -> None:
        self.m = m
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}  # counters already reported by get_stats
        self._stats_path = stats_path
        self._shared_tiers = list(shared_tiers)  # tiers that outlive this process
        self._seed_checked = False
        # vLLM 0.32 has no on_reset_flushed(): its reset flushes in-flight jobs
        # with the next step's metadata, so the workers are done with them two
        # step ends later (one more with asynchronous scheduling).
        self._flush_hook = callable(getattr(OffloadingManager, "on_reset_flushed", None))
        self._steps_since_reset: int | None = None

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult[self.m.lookup(bytes(key), req_context).name]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        source = self.m.get_load_source(bytes(key), req_context)
        return {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
            source, CacheHitSource.EXTERNAL_UNSPECIFIED)  # fmt: skip

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.m.prepare_load([bytes(k) for k in keys], req_context)
        return KVTierSpec(spec.slots, spec.stream, spec.fences)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.m.complete_load([bytes(k) for k in keys], req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.m.touch([bytes(k) for k in keys], req_context)

    def load_failed(self, spec: KVTierSpec) -> None:
        """See :meth:`TieredOffloadingManager.load_failed` (KVTierConnector
        calls it, holding the lock, after the load's complete_load)."""
        from kvtier.manager import HostSpec

        self.m.load_failed(HostSpec(spec.slots, spec.stream))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self.m.prepare_store([bytes(k) for k in keys], req_context)
        if out is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in out.keys_to_store],
            store_spec=KVTierSpec(out.store_spec.slots, out.store_spec.stream),
            evicted_keys=[OffloadKey(k) for k in out.evicted_keys],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.m.complete_store([bytes(k) for k in keys], req_context, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.m.on_new_request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.m.on_request_finished(req_context)

    def on_schedule_end(self, context: Any) -> None:
        if not self._seed_checked:
            self._seed_checked = True
            _warn_unshared_hashes(self._shared_tiers)
        if self._steps_since_reset is not None:
            self._steps_since_reset += 1
            if self._steps_since_reset >= 3:
                self._steps_since_reset = None
                self.m.on_reset_flushed()
        self.m.on_schedule_end(context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        for e in self.m.take_events():
            medium, locality = _SOURCE_MEDIUM.get(e.tier, (Medium.STORAGE, None))
            yield OffloadingEvent(
                keys=[OffloadKey(k) for k in e.keys],
                medium=medium,
                removed=e.removed,
                locality=locality,
                ownership=None if e.tier == "host" else e.tier,
            )

    def has_pending_work(self) -> bool:
        return self.m.has_pending_work()

    def reset_cache(self) -> None:
        self.m.reset_cache()
        if not self._flush_hook:
            self._steps_since_reset = 0

    def on_reset_flushed(self) -> None:
        self.m.on_reset_flushed()

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        s = self.m.stats
        stats = OffloadingConnectorStats()
        cap = self.m.host.capacity or 1
        occ = self.m.occupancy()
        stats.set_gauge("vllm:kv_offload_kvtier_host_usage_perc", len(self.m.host) / cap)
        busy = occ["pinned"] + occ["writing"] + occ["held"] + occ["stale"]
        stats.set_gauge("vllm:kv_offload_kvtier_host_busy", busy)
        stats.set_gauge("vllm:kv_offload_kvtier_tier_jobs", occ["tier_jobs"])
        counters = {
            "promotions": s.promotions,
            "cascades": s.cascades,
            "cascades_dropped": s.cascades_dropped,
            "allocation_failures": s.allocation_failures,
            "scan_reads": s.scan_reads,
            "fenced_reads": s.fenced_reads,
            "fenced_failures": s.fenced_failures,
            "scan_timeouts": s.scan_timeouts,
            "scan_waits": s.scan_waits,
            "scan_wait_us": int(s.scan_wait_s * 1e6),
            "load_failures": s.load_failures,
            **{f"loaded_{t}": s.loaded_from.get(t, 0) for t in ("host", "disk", "remote")},
        }
        for name, value in counters.items():
            last = self._last.get(name, 0)
            if value > last:
                stats.increase_counter(f"vllm:kv_offload_kvtier_{name}", value - last)
        self._last = counters
        return stats

    def shutdown(self) -> None:
        if self._stats_path:
            import dataclasses
            import json

            report = {"stats": dataclasses.asdict(self.m.stats), "occupancy": self.m.occupancy(),
                      "pending_work": self.m.has_pending_work()}  # fmt: skip
        self.m.shutdown()
        if self._stats_path:
            report["closed_occupancy"] = self.m.occupancy()
            with open(self._stats_path, "w") as f:
                json.dump(report, f)


def _warn_unshared_hashes(shared_tiers: Sequence[str]) -> None:
    """Say once, with the fix, when this engine's block hashes cannot match
    another process's: vLLM seeds non-cryptographic prefix hashes (xxhash)
    per process unless PYTHONHASHSEED is set, and then blocks kept in the
    disk or Redis tier are never found by another engine or after a restart."""
    if not shared_tiers or os.environ.get("PYTHONHASHSEED") is not None:
        return
    try:
        from vllm.v1.core import kv_cache_utils as kcu
    except ImportError:  # pragma: no cover - every vLLM with offloading has it
        return
    seed = getattr(kcu, "_NONE_HASH_SEED", None)
    default = getattr(kcu, "DEFAULT_NONE_HASH_SEED", None)
    if seed is None or default is None or seed == default:
        return
    logging.getLogger("kvtier").warning(
        "kvtier: this engine's prefix-cache block hashes are seeded per process "
        "(a non-cryptographic prefix_caching_hash_algo without PYTHONHASHSEED), so blocks in "
        "kvtier's %s tier(s) will never be found by another engine or after a restart. "
        "Fix: set PYTHONHASHSEED to the same value for every engine (e.g. PYTHONHASHSEED=0), "
        "or use prefix_caching_hash_algo=sha256 (vLLM's default).",
        " and ".join(shared_tiers),
    )


_STREAM = -1  # the "group" of a load's streamed part in KVTierWorker._parts


class KVTierWorker(OffloadingWorker):
    """vLLM's OffloadingWorker over kvtier's DeviceTransfer: one transfer per
    KV-cache group (each group's chunks have their own slots)."""

    def __init__(self, kv_caches: CanonicalKVCaches, spec: KVTierOffloadingSpec) -> None:
        from kvtier.affinity import off_compute_cpus

        pool = spec.host_pool()
        offset = spec.cell_index * spec.cell_bytes
        self.transfers: list[DeviceTransfer] = []
        self._groups: list[tuple[list[Any], list[int]]] = []  # per group: tensors, page bytes
        with off_compute_cpus():  # the copy threads start off the engine's compute cores
            self._start_transfers(kv_caches, spec, pool, offset)
        self.bpc = spec.blocks_per_chunk
        # For loads streamed from a lower tier: a staging ring made at first use.
        self._stream_args = (spec.slot_bytes, offset,
                             int(spec.kvtier.get("kvtier_stream_slots", 32)))  # fmt: skip
        self._stream: StreamLoader | None = None
        self._next = 0
        self._parts: dict[int, list[tuple[int, int]]] = {}  # job -> [(group, sub job)]
        self._done: dict[int, list[Any]] = {}
        # Under KVTierConnector a failed load is reported as its engine
        # blocks (vLLM recomputes them) rather than as a failed job, which
        # vLLM's offloading worker asserts never happens.
        self.reports_load_errors = spec.reports_load_errors
        self._load_blocks: dict[int, np.ndarray | Sequence[int]] = {}  # load job -> engine blocks
        self._load_errors: set[int] = set()
        self._copy_failed: set[int] = set()  # jobs with a failed copy to or from host slots

    def _start_transfers(
        self, kv_caches: CanonicalKVCaches, spec: KVTierOffloadingSpec, pool: HostPool, offset: int
    ) -> None:
        """One DeviceTransfer (its own copy threads) per KV-cache group."""
        from kvtier.transfer import DeviceTransfer

        for refs in kv_caches.group_data_refs:
            seen: dict[int, int] = {}
            for r in refs:  # layers aliasing one tensor are copied once
                seen.setdefault(r.tensor_idx, r.page_size_bytes)
            tensors = [kv_caches.tensors[i].tensor for i in seen]
            self._groups.append((tensors, list(seen.values())))
            self.transfers.append(DeviceTransfer(
                tensors, pool, blocks_per_chunk=spec.blocks_per_chunk, page_bytes=list(seen.values()),
                is_writer=spec.is_writer, slot_offset=offset))  # fmt: skip

    def _split(
        self, gpu: GPULoadStoreSpec, slots: np.ndarray
    ) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
        blocks = np.asarray(gpu.block_ids, np.int64)
        sizes = list(getattr(gpu, "group_sizes", None) or [len(blocks)])
        firsts = list(getattr(gpu, "block_indices", None) or [0] * len(sizes))
        out, b0, s0 = [], 0, 0
        for g, (n, first) in enumerate(zip(sizes, firsts)):
            chunks = -(-((first % self.bpc) + n) // self.bpc) if n else 0
            out.append((g, blocks[b0 : b0 + n], slots[s0 : s0 + chunks], int(first)))
            b0, s0 = b0 + n, s0 + chunks
        return out

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
        if host.stream is not None:
            return self._submit_streamed(job_id, gpu, host, host.stream, store, expedited)
        fences = None if store or host.fences is None else self._split(gpu, host.fences)
        parts = []
        for n, (g, blocks, slots, first) in enumerate(self._split(gpu, host.slots)):
            if len(blocks) == 0:
                continue
            self._next += 1
            t = self.transfers[g]
            ok = (
                t.submit_store(self._next, blocks, slots, first_block_index=first)
                if store
                else t.submit_load(self._next, slots, blocks, expedited, first_block_index=first,
                                   fences=None if fences is None else fences[n][2])
            )  # fmt: skip
            if not ok:
                return False
            parts.append((g, self._next))
        self._parts[job_id] = parts
        self._done[job_id] = []
        return True

    def _submit_streamed(
        self,
        job_id: int,
        gpu: GPULoadStoreSpec,
        host: KVTierSpec,
        st: StreamSpec,
        store: bool,
        expedited: bool,
    ) -> bool:
        """A load or store of which some chunks (slot -1) move between the KV
        cache and a lower tier through the stream loader: runs of host chunks
        go as usual, one sub-job each; the streamed chunks make one stream job."""
        from kvtier.streaming import StreamChunk, StreamLoader

        row = {int(i): n for n, i in enumerate(st.index.tolist())}  # key position -> stream row
        parts: list[tuple[int, int]] = []
        chunks: list[StreamChunk] = []
        pos0 = 0  # key position of the group's first chunk
        fences = None if store or host.fences is None else self._split(gpu, host.fences)
        for n_g, (g, blocks, slots, first) in enumerate(self._split(gpu, host.slots)):
            armed = None if fences is None else fences[n_g][2]
            skip = first % self.bpc
            bounds = [(max(0, c * self.bpc - skip), min(len(blocks), (c + 1) * self.bpc - skip))
                      for c in range(len(slots))]  # fmt: skip
            c = 0
            while c < len(slots):
                if slots[c] < 0:
                    n = row[pos0 + c]
                    lo, hi = bounds[c]
                    chunks.append(StreamChunk(g, blocks[lo:hi], first + lo, st.tiers[n],
                                              st.locations[n], st.digests[16 * n : 16 * n + 16]))  # fmt: skip
                    c += 1
                    continue
                end = c
                while end < len(slots) and slots[end] >= 0:
                    end += 1
                lo, hi = bounds[c][0], bounds[end - 1][1]
                self._next += 1
                t = self.transfers[g]
                if not (
                    t.submit_store(self._next, blocks[lo:hi], slots[c:end], first_block_index=first + lo)
                    if store
                    else t.submit_load(self._next, slots[c:end], blocks[lo:hi], expedited,
                                       first_block_index=first + lo,
                                       fences=None if armed is None else armed[c:end])
                ):  # fmt: skip
                    return False
                parts.append((g, self._next))
                c = end
            pos0 += len(slots)
        if self._stream is None:
            from kvtier.affinity import off_compute_cpus

            slot_bytes, offset, num = self._stream_args
            with off_compute_cpus():
                self._stream = StreamLoader(self._groups, blocks_per_chunk=self.bpc,
                                            slot_bytes=slot_bytes, slot_offset=offset,
                                            num_slots=num)  # fmt: skip
        self._next += 1
        self._stream.submit(self._next, chunks, st.readers, store=store)
        parts.append((_STREAM, self._next))
        self._parts[job_id] = parts
        self._done[job_id] = []
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
        return self._submit(job_id, dst_spec, src_spec, store=False, expedited=expedited)

    def get_finished(self) -> list[TransferResult]:
        owner = {sub: job for job, parts in self._parts.items() for _, sub in parts}
        for t in self.transfers:
            for r in t.get_finished():
                self._done[owner[r.job_id]].append(r)
                if not r.success:
                    self._copy_failed.add(owner[r.job_id])
        for r in self._stream.get_finished() if self._stream is not None else ():
            self._done[owner[r.job_id]].append(r)
        out = []
        for job in [j for j, parts in self._parts.items() if len(self._done[j]) == len(parts)]:
            rs = self._done.pop(job)
            del self._parts[job]
            ok = all(r.success for r in rs)
            blocks = self._load_blocks.pop(job, None)
            copy_failed = job in self._copy_failed
            self._copy_failed.discard(job)
            if not ok and self.reports_load_errors and (blocks is not None or not copy_failed):
                # Finished all the same. A failed load's blocks go to
                # take_load_errors; a store that failed only in what the
                # worker wrote to a lower tier itself left a value or record
                # that fails its check when read (recomputed then). A store
                # into host slots that failed still fails: those bytes are
                # not checked when loaded, so they must never count as stored.
                why = "; ".join(sorted({r.error for r in rs if not r.success and r.error}))
                what = (f"its {len(blocks)} blocks are recomputed" if blocks is not None
                        else "a later read of it fails its check and is recomputed")  # fmt: skip
                logging.getLogger("kvtier").warning(
                    "kvtier: %s job %d failed (%s): %s",
                    "load" if blocks is not None else "store", job, why or "no reason given", what,
                )  # fmt: skip
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

    def wait(self, job_ids: set[int]) -> None:
        for job in job_ids:
            for g, sub in self._parts.get(job, []):
                if g == _STREAM:
                    assert self._stream is not None
                    self._stream.wait([sub])
                else:
                    self.transfers[g].wait([sub])

    def shutdown(self) -> None:
        self._load_blocks.clear()
        self._copy_failed.clear()
        if self._stream is not None:
            self._stream.close()
        for t in self.transfers:
            t.shutdown()


# -- secondary tiers under vLLM's TieringOffloadingSpec ---------------------------
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
    """A kvtier lower tier as one of vLLM's secondary tiers (scheduler side)."""

    def _build(self, kind: str, locality: Locality, cfg: Any, namespace: str, name: str) -> None:
        """Build this tier's kvtier tier from ``cfg`` and attach it to vLLM's primary region."""
        from kvtier.tiers.factory import build_tier

        _check_current_engine()
        self.locality = locality
        spec = self._offloading_spec
        c = spec.config
        ns = engine_namespace(
            model=c.model.name, dtype=c.model.dtype,
            worker_kv_bytes_per_block=c.worker_kv_bytes_per_block,
            blocks_per_chunk=spec.blocks_per_chunk,
            world_size=(c.parallel.pp_size if getattr(spec, "replicated_layout", False)
                        else c.parallel.world_size),
            pp_size=c.parallel.pp_size, kv_cache_layout=getattr(c, "kv_cache_layout", None),
            canonical_layout=getattr(c, "canonical_layout", False),
            user_namespace=namespace, groups=c.groups,
        )  # fmt: skip
        self._attach(build_tier(kind, cfg, self.block_size_bytes, ns, name=name))

    def _attach(self, tier: LowerTier) -> None:
        self.tier = tier
        tier.attach(_ViewPool(self._primary_kv_view))  # type: ignore[arg-type]
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
                job_id=job.job_id, success=c.ok, successful_keys=None if c.ok else good,
                transfer_time=time.monotonic() - job.submit_time,
                transfer_bytes=len(good) * self.block_size_bytes)  # fmt: skip
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
                keys=[OffloadKey(k) for k in e.keys],
                medium=self.medium or Medium.STORAGE,
                removed=e.removed,
                locality=self.locality,
                ownership=self.tier_type,
            )

    def shutdown(self) -> None:
        self.drain_jobs()
        self.tier.close()


class KVTierDiskTier(_KVTierSecondary):
    """kvtier's disk tier (io_uring, checksummed records, warm restart) as a vLLM secondary tier."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        path: str,
        capacity_bytes: int | str = "100GiB",
        queue_depth: int = 32,
        policy: str = "lru",
        admit_after: int = 1,
        write_budget_bps: float | None = None,
        backend: str = "auto",
        namespace: str = "",
        timeout_s: float = 30.0,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        from kvtier.tiers.factory import TierConfig

        cfg = TierConfig(
            disk_path=path, disk_bytes=to_capacity("capacity_bytes", capacity_bytes),
            disk_policy=policy, disk_admit_after=admit_after,
            disk_write_budget_bps=write_budget_bps, disk_backend=backend,
            disk_queue_depth=queue_depth, disk_timeout_s=timeout_s,
        )  # fmt: skip
        self._build("disk", Locality.LOCAL, cfg, namespace, tier_type)


class KVTierRedisTier(_KVTierSecondary):
    """kvtier's remote tier (native pipelined RESP client, Redis/Valkey, cluster) as a vLLM secondary tier."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str,
        ttl_s: float | None = None,
        timeout_s: float = 2.0,
        admit_after: int = 1,
        namespace: str = "",
        degraded_ok: bool = False,
        backpressure_detector: Any = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        from kvtier.tiers.factory import TierConfig

        cfg = TierConfig(
            remote_url=url, remote_ttl_s=ttl_s, remote_timeout_s=timeout_s,
            remote_admit_after=admit_after, remote_degraded_ok=degraded_ok,
            remote_tls_ca_file=tls_ca_file, remote_tls_cert_file=tls_cert_file,
            remote_tls_key_file=tls_key_file, remote_tls_server_name=tls_server_name,
        )  # fmt: skip
        self._build("remote", Locality.REMOTE, cfg, namespace, tier_type)
