"""``kvtier bench manager``: manager overhead, in lookup + prepare_store +
complete_store + prepare_load + complete_load cycles per second over many keys
(no data moves; this is the policy layer's cost per block).

A command-line tool: runs in the ``kvtier`` process, the
manager on its calling thread. Who calls: :mod:`kvtier.bench.commands`.
Blocks for the whole run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvtier.bench.harness import freeze_heap_as_engines_do
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.base import LookupResult
from kvtier.tiers.host import HostTier


def cycles(m: Any, keys: list[bytes], batch: int, scan: bool = False) -> float:
    """Cycles per second over ``keys``, ``batch`` keys a call. ``scan``: the
    lookups stop at the first MISS, as vLLM's scan does (``bench manager
    --node``: a node answers a scan in one round trip up to there)."""
    miss = LookupResult.MISS
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ks = keys[i : i + batch]
        for k in ks:
            if m.lookup(k) is miss and scan:
                break
        out = m.prepare_store(ks)
        assert out is not None
        m.complete_store(out.keys_to_store)
        m.prepare_load(ks)
        m.complete_load(ks)
    return len(keys) / (time.perf_counter() - t0)


def run_manager(num_keys: int = 1_000_000, policy: str = "lru", repeats: int = 3) -> dict[str, Any]:
    keys = [i.to_bytes(32, "little") + b"\0\0\0\0" for i in range(num_keys)]
    capacity = max(1, num_keys // 2)  # half fits: the second half evicts
    freeze_heap_as_engines_do()
    out: dict[str, Any] = {
        "component": "manager",
        "policy": policy,
        "keys": num_keys,
        "host_blocks": capacity,
    }
    for batch in (1, 16):
        rates = []
        for _ in range(repeats):
            m = TieredOffloadingManager(HostTier(None, capacity, policy=policy))
            rates.append(cycles(m, keys, batch))
        out[f"cycles_per_s_batch{batch}"] = round(statistics.median(rates))
    out["ops_per_s"] = out["cycles_per_s_batch1"]
    out["us_per_cycle"] = round(1e6 / out["ops_per_s"], 3)
    out["note"] = (
        "a cycle is lookup + prepare_store + complete_store + prepare_load + "
        "complete_load of one key; batch16 passes 16 keys per call"
    )
    return out
