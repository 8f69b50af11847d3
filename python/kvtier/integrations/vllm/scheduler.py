"""vLLM shim, scheduler process: vLLM's ``OffloadingManager`` over
kvtier's :class:`~kvtier.scheduler.manager.TieredOffloadingManager`, its metrics and
events.

Who calls: vLLM's offloading connector in the engine core, from the
scheduler's thread, under ``lock``. Nothing here blocks beyond the
manager's bounded read-ahead wait.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

if TYPE_CHECKING:
    from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.integrations.vllm.host_spec import KVTierSpec

GAUGE_PERIOD_S = 0.5  # the host tier's gauges are refreshed at most this often

# vLLM 0.33's OffloadingEvent has metadata_only (a removal that announces
# nothing); 0.32's has not.
_METADATA_ONLY = "metadata_only" in getattr(OffloadingEvent, "__dataclass_fields__", {})

_SOURCE_MEDIUM = {
    "host": (Medium.CPU, None),
    "disk": (Medium.STORAGE, Locality.LOCAL),
    "remote": (Medium.CPU, Locality.REMOTE),
}


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


def _prefix_order(req_context: Any, key: bytes) -> _PrefixOrder | None:
    """The request's keys in prefix order (kept on its context), or None when
    the context has no position for ``key``."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or key not in positions:
        return None
    get_state = getattr(req_context, "get_state", None)
    order = get_state(_PrefixOrder) if get_state is not None else None
    if order is None or order.count != len(positions):
        order = _PrefixOrder(positions)
        if get_state is not None:
            req_context.set_state(order)
    return order


def following_keys(key: bytes, req_context: Any) -> list[bytes]:
    """The keys of ``key``'s KV-cache group that the request looks up after
    it, in prefix order: vLLM 0.32 and 0.33 record every key's end-token
    position in ``ReqContext`` before they look any up (``update_offload_keys``).
    Empty when the context has none (another vLLM, or a key not recorded)."""
    order = _prefix_order(req_context, key)
    if order is None:
        return []
    return order.groups[key[-4:]][order.index[key] + 1 :]


class LookupOrder:
    """The manager's ``key_order``: the keys a request looks up after
    ``key``, in the order vLLM looks them up. A full-attention group is
    scanned from its first chunk on (:func:`following_keys`); a
    sliding-window group from its last chunk back, until a window of hits
    (vLLM's ``_sliding_window_lookup``), so its order is the preceding keys,
    nearest first, as many as a window holds. Read-ahead reads that run in
    one batch: one key per round trip, as the scan walks back, took 12 ms
    for the 2 x 16 window chunks of a Gemma-3-style model from disk.

    ``windows`` maps a group's key suffix (its index, 4 bytes big-endian)
    to its window in chunks. Pure; called from the scheduler's thread."""

    def __init__(self, windows: dict[bytes, int]) -> None:
        self.windows = windows

    def __call__(self, key: bytes, req_context: Any) -> list[bytes]:
        window = self.windows.get(key[-4:])
        if window is None:
            return following_keys(key, req_context)
        order = _prefix_order(req_context, key)
        if order is None:
            return []
        i = order.index[key]
        # One more than the window: vLLM's first window may need a chunk
        # more when the hit ends inside a chunk.
        return order.groups[key[-4:]][max(0, i - window) : i][::-1]


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
        self._gauges: tuple[float, int, int] | None = None  # gauges last reported
        self._gauges_due = 0.0  # monotonic time of the next gauge refresh
        self._sig: tuple[int, ...] = ()  # the counters' values at the last full check
        self._stats_path = stats_path
        self._shared_tiers = list(shared_tiers)  # tiers that outlive this process
        self._seed_checked = False
        # vLLM 0.32 has no on_reset_flushed(): its reset flushes in-flight jobs
        # with the next step's metadata, so the workers are done with them two
        # step ends later (one more with asynchronous scheduling).
        self._flush_hook = callable(getattr(OffloadingManager, "on_reset_flushed", None))
        self._steps_since_reset: int | None = None
        # Keys of store jobs whose KV was computed on top of a load that
        # failed in the same step: dropped when their store completes.
        self._poisoned: set[bytes] = set()
        # Requests whose last lookup found a HIT that can still fail to load
        # (a fenced fill, a stream): KVTierConnector loads those
        # asynchronously. vLLM caches a synchronous hit's blocks at once and,
        # when its load fails, lets a request sharing them use them as
        # computed until the failed request recomputes them; asynchronous
        # hits are cached only once loaded. Measured by the 30-minute serving
        # soak: 7 of 3,622 requests got a wrong first token, each beside a
        # failed synchronous load (issue 52).
        # Kept only while the connector asks (track_risky), one request at a time.
        self.risky_hits: set[Any] = set()
        self.track_risky = False
        from kvtier.tiers.base import LookupResult as TierResult

        # Compared by identity in lookup (an enum's name is a Python call),
        # and each answer's vLLM value by identity too.
        self._hit = TierResult.HIT
        self._answer = {id(r): LookupResult[r.name] for r in TierResult}

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # vLLM's OffloadKey is a NewType of bytes: passed as it is (a
        # conversion per key per call was 4% of `kvtier bench vllm`'s cycle).
        r = self.m.lookup(key, req_context)
        if self.track_risky and r is self._hit and self.m.may_fail_to_load(key):
            self.risky_hits.add(getattr(req_context, "req_id", None))
        return self._answer[id(r)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        source = self.m.get_load_source(bytes(key), req_context)
        return {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
            source, CacheHitSource.EXTERNAL_UNSPECIFIED
        )

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.m.prepare_load(keys, req_context)
        return KVTierSpec(spec.slots, spec.stream, spec.fences)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.m.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.m.touch([bytes(k) for k in keys], req_context)

    def load_failed(self, spec: KVTierSpec) -> None:
        """See :meth:`TieredOffloadingManager.load_failed` (KVTierConnector
        calls it, holding the lock, after the load's complete_load)."""
        from kvtier.scheduler.specs import HostSpec

        self.m.load_failed(HostSpec(spec.slots, spec.stream))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self.m.prepare_store(keys, req_context)
        if out is None:
            return None
        # The key lists as they are: OffloadKey is a NewType of bytes.
        return PrepareStoreOutput(
            keys_to_store=out.keys_to_store,  # type: ignore[arg-type]
            store_spec=KVTierSpec(out.store_spec.slots, out.store_spec.stream),
            evicted_keys=out.evicted_keys,  # type: ignore[arg-type]
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        ks = list(keys)
        if self._poisoned and success:
            bad = [k for k in ks if k in self._poisoned]
            if bad:
                self._poisoned.difference_update(bad)
                self.m.complete_store(bad, req_context, False)
                ks = [k for k in ks if k not in bad]
        self.m.complete_store(ks, req_context, success)

    def poison_stores(self, keys: Collection[OffloadKey]) -> None:
        """Drop these keys when their store job completes, whatever the
        workers report: their KV was computed in a step whose load of the
        same request failed, on top of engine blocks the load never filled
        (vLLM recomputes the request, but the step's stores were already
        built). KVTierConnector calls it, holding the lock. Non-blocking."""
        self._poisoned.update(bytes(k) for k in keys)

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
        """The manager's events as vLLM's. A metadata-only removal (a failed
        store or promotion a lookup may have seen) becomes
        ``OffloadingEvent(removed=True, metadata_only=True)`` where vLLM has
        that field (0.33), and is left out where it has not (0.32): there a
        removal is always public, and these blocks were never announced.
        Who calls: vLLM's connector, under the lock. Non-blocking."""
        for e in self.m.take_events():
            if e.metadata_only and not _METADATA_ONLY:
                continue
            medium, locality = _SOURCE_MEDIUM.get(e.tier, (Medium.STORAGE, None))
            out = OffloadingEvent(
                # Blocks named by event id (kvtier.tiers.events.vllm_event_id) are
                # OffloadKeys of an 8-byte hash: vLLM publishes their int block hash.
                keys=[OffloadKey(k) for k in ([*e.keys, *e.ids] if e.ids else e.keys)],
                medium=medium,
                removed=e.removed,
                locality=locality,
                ownership=None if e.tier == "host" else e.tier,
            )
            if e.metadata_only:  # only here under 0.33 (see above)
                out.metadata_only = True
            yield out

    def has_pending_work(self) -> bool:
        return self.m.has_pending_work()

    def reset_cache(self) -> None:
        self._poisoned.clear()
        self.m.reset_cache()
        if not self._flush_hook:
            self._steps_since_reset = 0

    def on_reset_flushed(self) -> None:
        self.m.on_reset_flushed()

    def get_stats(self) -> Any:
        """vLLM's scheduler calls this after every engine step (through
        ``get_kv_connector_stats``); non-blocking. Returns None when nothing
        changed: vLLM ships a non-empty payload to the API server on every
        step, and a step with no store or load changes no counter. The
        gauges scan the host tier's entries, so they are refreshed at most
        every :data:`GAUGE_PERIOD_S` (Prometheus keeps a gauge's last value).
        Measured (zero reuse, concurrency 1, `vllm serve`): a payload and a
        scan on every step cost about 2% of output throughput."""
        s = self.m.stats
        now = time.monotonic()
        # Every reported counter moves one of these: a step that moved none
        # (most decode steps) returns at once. Building the counters each
        # step cost 6-8 us of the engine core's step (zero reuse, c=1).
        sig = (
            s.promotions,
            s.cascades,
            s.cascades_dropped,
            s.allocation_failures,
            s.scan_reads,
            s.fenced_reads,
            s.fenced_failures,
            s.scan_timeouts,
            s.scan_waits,
            s.load_failures,
            s.loads,
            s.promotion_failures,  # a read that failed moves only this
        )
        if sig == self._sig and now < self._gauges_due:
            return None
        self._sig = sig
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
            **_tier_reads(self.m.lower),
        }
        grown = {
            n: v - self._last.get(n, 0) for n, v in counters.items() if v > self._last.get(n, 0)
        }
        self._last = counters
        gauges = None
        if now >= self._gauges_due:
            self._gauges_due = now + GAUGE_PERIOD_S
            occ = self.m.occupancy()
            busy = occ["pinned"] + occ["writing"] + occ["held"] + occ["stale"]
            g = (len(self.m.host) / (self.m.host.capacity or 1), busy, occ["tier_jobs"])
            if g != self._gauges:
                gauges = self._gauges = g
        if not grown and gauges is None:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        if gauges is not None:
            stats.set_gauge("vllm:kv_offload_kvtier_host_usage_perc", gauges[0])
            stats.set_gauge("vllm:kv_offload_kvtier_host_busy", gauges[1])
            stats.set_gauge("vllm:kv_offload_kvtier_tier_jobs", gauges[2])
        for name, value in grown.items():
            stats.increase_counter(f"vllm:kv_offload_kvtier_{name}", value)
        return stats

    def shutdown(self) -> None:
        if self._stats_path:
            import dataclasses
            import json

            report = {
                "stats": dataclasses.asdict(self.m.stats),
                "occupancy": self.m.occupancy(),
                "pending_work": self.m.has_pending_work(),
                # Each lower tier's own counters (corrupt records caught, I/O
                # and server errors, refused writes): nowhere else to read them.
                "tiers": {t.name: t.stats() for t in self.m.lower},
            }
            client = getattr(self.m, "client_stats", None)  # attached to a kvtier node
            if client is not None:
                report["node"] = dataclasses.asdict(client)
        self.m.shutdown()
        if self._stats_path:
            report["closed_occupancy"] = self.m.occupancy()
            with open(self._stats_path, "w") as f:
                json.dump(report, f)


def _tier_reads(lower: Sequence[Any]) -> dict[str, int]:
    """``disk_reads`` and ``remote_reads`` (get_stats'): the blocks each of
    those tiers read, failed reads (corrupt ones among them) included, from
    its own counters. ``loaded_disk`` counts every load of a block promoted
    from disk, however long ago it was read: a serving soak once took loads
    of such blocks for reads of the records it had just corrupted."""
    out = {}
    for t in lower:
        c = getattr(t, "counters", None)
        if t.name in ("disk", "remote") and c is not None:
            out[f"{t.name}_reads"] = c.get("loads", 0) + c.get("load_failures", 0)
    return out


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
