"""``kvtier bench vllm``: kvtier against vLLM 0.33's own implementation, same
machine, same run: (a) manager cycles per second vs CPUOffloadingManager,
(b) disk tier vs vLLM's ``fs`` secondary tier (same chunk size, same
directory), (c) a Mooncake-format trace (or the synthetic workload) replayed
through both managers at the same capacity (hit rates).

It lives under ``integrations/`` because every part of it drives vLLM's
classes. Who calls: ``kvtier bench vllm`` (the CLI). Everything blocks.

A command-line tool: runs in the ``kvtier`` process, vLLM's classes in it.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np


def _config(extra: dict[str, Any], page: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def _key(i: int) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(32, "little"), 0)


def _cycles(m: Any, keys: list[Any], ctx: Any, batch: int = 1) -> float:
    """Keys per second through lookup (each key) + prepare_store +
    complete_store + prepare_load + complete_load, ``batch`` keys a call."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ks = keys[i : i + batch]
        for k in ks:
            m.lookup(k, ctx)
        out = m.prepare_store(ks, ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.prepare_load(ks, ctx)
        m.complete_load(ks, ctx)
    return len(keys) / (time.perf_counter() - t0)


def bench_managers(num_keys: int = 200_000, repeats: int = 3) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.bench.harness import freeze_heap_as_engines_do
    from kvtier.integrations.vllm import KVTierManager
    from kvtier.scheduler.manager import TieredOffloadingManager
    from kvtier.tiers.host_native import make_host_tier

    keys = [_key(i) for i in range(num_keys)]
    cap = num_keys // 2
    freeze_heap_as_engines_do()
    out: dict[str, Any] = {"keys": num_keys, "capacity": cap}
    for batch in (1, 16):
        ours, theirs = [], []
        for _ in range(repeats):
            ctx = ReqContext(req_id="bench")
            v = CPUOffloadingManager(num_chunks=cap)
            v.on_new_request(ctx)
            theirs.append(_cycles(v, keys, ctx, batch))
            # Without events, as vLLM's manager here (enable_events=False)
            # and as the spec builds kvtier's for an engine without KV events.
            k = KVTierManager(TieredOffloadingManager(make_host_tier(None, cap), events=False))
            ours.append(_cycles(k, keys, ctx, batch))
        o, t = statistics.median(ours), statistics.median(theirs)
        # batch 1 keeps the names of the results before 16-key offers were measured
        sfx = "" if batch == 1 else f"_batch{batch}"
        out[f"kvtier_cycles_per_s{sfx}"] = round(o)
        out[f"vllm_cpu_manager_cycles_per_s{sfx}"] = round(t)
        out[f"ratio{sfx}"] = round(o / t, 3)
    return out


def _drive_tier(tier: Any, kind: str, keys: list[Any], chunks: int, batch: int) -> float:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(req_id="bench")
    jobs = 0
    t0 = time.perf_counter()
    pending: set[int] = set()
    i = 0
    while i < len(keys) or pending:
        while i < len(keys) and len(pending) < 4:
            ks = keys[i : i + batch]
            jobs += 1
            job = TransferJob(
                job_id=jobs,
                keys=ks,
                chunk_ids=np.arange(i, i + len(ks), dtype=np.int64) % chunks,
                is_promotion=kind == "load",
                req_context=ctx,
            )
            (tier.submit_store if kind == "store" else tier.submit_load)(job)
            pending.add(jobs)
            i += len(ks)
        for r in tier.get_finished_jobs():
            if not r.success:
                raise RuntimeError(f"{type(tier).__name__} {kind} job failed")
            pending.discard(r.job_id)
        time.sleep(0.0002)
    return time.perf_counter() - t0


def bench_disk(
    directory: str, chunk_bytes: int, total_bytes: int = 512 << 20, repeats: int = 3
) -> dict[str, Any]:
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.integrations.vllm import KVTierDiskTier

    n = max(16, total_bytes // chunk_bytes)
    chunks = min(n, max(16, (256 << 20) // chunk_bytes))
    region = np.zeros(chunks * chunk_bytes + 4096, np.uint8)
    off = (-region.ctypes.data) % 4096  # page-aligned rows, as vLLM's mmap region
    rows = region[off : off + chunks * chunk_bytes].reshape(chunks, chunk_bytes)
    rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
    view = rows.data  # a memoryview of (chunks, chunk_bytes), as vLLM hands over
    spec = TieringOffloadingSpec(_config({"cpu_bytes_to_use": chunks * chunk_bytes}, chunk_bytes))
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir=directory))
    res: dict[str, list[float]] = {
        "kvtier_store": [],
        "kvtier_load": [],
        "fs_store": [],
        "fs_load": [],
    }
    batch = max(1, min(64, (16 << 20) // chunk_bytes))
    try:
        ours = KVTierDiskTier(
            spec,
            view,
            "kvtier",
            path=str(base / "kvtier"),
            capacity_bytes=2 * n * (chunk_bytes + 4096),
        )
        theirs = FileSystemTierManager(spec, view, "fs", root_dir=str(base / "fs"))
        for r in range(repeats):
            keys = [_key(r * n + i) for i in range(n)]
            for name, tier in (("kvtier", ours), ("fs", theirs)):
                res[f"{name}_store"].append(
                    n * chunk_bytes / _drive_tier(tier, "store", keys, chunks, batch) / 1e9
                )
                res[f"{name}_load"].append(
                    n * chunk_bytes / _drive_tier(tier, "load", keys, chunks, batch) / 1e9
                )
        ours.shutdown()
        theirs.shutdown()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: round(statistics.median(v), 3) for k, v in res.items()}
    return {
        "chunk_bytes": chunk_bytes,
        "gbps": med,
        "ratio": {
            "store": round(med["kvtier_store"] / med["fs_store"], 3),
            "load": round(med["kvtier_load"] / med["fs_load"], 3),
        },
    }


def _replay(m: Any, trace: list[list[int]]) -> float:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    hits = refs = 0
    for n, ids in enumerate(trace):
        ctx = ReqContext(req_id=str(n))
        m.on_new_request(ctx)
        keys = [_key(h) for h in ids]
        h = 0
        for k in keys:
            if m.lookup(k, ctx) is not LookupResult.HIT:
                break
            h += 1
        if h:
            m.prepare_load(keys[:h], ctx)
            m.complete_load(keys[:h], ctx)
        out = m.prepare_store(keys[h:], ctx) if h < len(keys) else None
        if out is not None:
            m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
        hits += h
        refs += len(keys)
    return hits / refs


def bench_replay(
    capacity: int = 10_000, max_requests: int | None = None, trace_path: str | None = None
) -> dict[str, Any]:
    """Hit rates of both managers over ``trace_path`` (Mooncake JSONL), or
    over the synthetic workload when None."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.integrations.vllm import KVTierManager
    from kvtier.replay import read_trace, synthetic_trace
    from kvtier.scheduler.manager import TieredOffloadingManager
    from kvtier.tiers.host_native import make_host_tier

    n = max_requests or 4000
    trace = read_trace(trace_path, max_requests) if trace_path else synthetic_trace(n)
    out: dict[str, Any] = {
        "trace": Path(trace_path).name if trace_path is not None else "synthetic",
        "requests": len(trace),
        "capacity_blocks": capacity,
    }
    for policy in ("lru", "arc"):
        out[f"vllm_{policy}"] = round(
            _replay(CPUOffloadingManager(capacity, cache_policy=policy), trace), 4
        )
        out[f"kvtier_{policy}"] = round(
            _replay(
                KVTierManager(
                    TieredOffloadingManager(make_host_tier(None, capacity, policy=policy))
                ),
                trace,
            ),
            4,
        )
    out["kvtier_arc_admit2"] = round(
        _replay(
            KVTierManager(
                TieredOffloadingManager(make_host_tier(None, capacity, policy="arc", admit_after=2))
            ),
            trace,
        ),
        4,
    )
    return out


def run_vllm(
    directory: str,
    chunk_sizes: tuple[int, ...] = (262144, 2 << 20),
    repeats: int = 3,
    capacity: int = 10_000,
    trace_path: str | None = None,
) -> dict[str, Any]:
    """All three comparisons as one result object (``component: vllm``)."""
    import vllm

    return {
        "component": "vllm",
        "vllm_version": vllm.__version__,
        "manager": bench_managers(repeats=repeats),
        "disk": [bench_disk(directory, c, repeats=repeats) for c in chunk_sizes],
        "replay": bench_replay(capacity, trace_path=trace_path),
    }
