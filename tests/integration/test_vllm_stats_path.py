"""The vLLM shim's ``kvtier_stats_path`` report at shutdown carries each
lower tier's own counters (corrupt records caught, I/O and server errors,
refused writes) beside the manager's: the serving soak (issue 52) found
them reported nowhere else from a running server (not in /metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
from kvtier.integrations.vllm.scheduler import KVTierManager
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import HostTier
from kvtier.tiers.disk import DiskTier


def test_stats_json_at_shutdown_holds_every_lower_tiers_counters(tmp_path: Path) -> None:
    pool = HostPool(8, DiskTier.slot_bytes_for(4096))
    try:
        disk = DiskTier(tmp_path, 1 << 20, 4096, reserve_bytes=0)
        disk.counters["corrupt"] += 3  # as a load that failed its checksum counts it
        path = tmp_path / "stats.json"
        KVTierManager(TieredOffloadingManager(HostTier(pool, 8), [disk]), str(path)).shutdown()
        report = json.loads(path.read_text())
    finally:
        pool.close()
    assert report["tiers"]["disk"]["corrupt"] == 3
    assert {"nospace", "io_errors", "load_failures"} <= set(report["tiers"]["disk"])
    assert report["closed_occupancy"]["tier_jobs"] == 0
