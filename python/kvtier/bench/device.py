"""``kvtier bench copy --device cpu``: KV blocks through DeviceTransfer with a
numpy array as the KV cache (as in ``kvtier replay``; no torch needed),
against a plain single-threaded memcpy of the same descriptors in the same
run; also the cost of building descriptors.

A command-line tool: runs in the ``kvtier`` process. Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from kvtier.pool import HostPool
from kvtier.worker.transfer import DeviceTransfer


def run_device_copy(
    block_bytes: int,
    total_bytes: int = 256 << 20,
    repeats: int = 5,
    layers: int = 1,
    per_job_blocks: int = 32,
) -> dict[str, Any]:
    n = max(1, total_bytes // block_bytes)
    page = block_bytes // layers
    kv = np.zeros((n, layers, page), dtype=np.uint8)
    kv.reshape(-1)[::4096] = 1  # fault the KV "device" memory in before timing
    tensors = [kv[:, i, :] for i in range(layers)]
    pool = HostPool(2 * n, block_bytes)
    t = DeviceTransfer(tensors, pool)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(n)
    slots = rng.permutation(2 * n)[:n]
    job = 0
    try:

        def run(store: bool) -> float:
            nonlocal job
            t0 = time.perf_counter()
            ids = []
            for i in range(0, n, per_job_blocks):
                job += 1
                b, s = blocks[i : i + per_job_blocks], slots[i : i + per_job_blocks]
                ok = t.submit_store(job, b, s) if store else t.submit_load(job, s, b)
                assert ok
                ids.append(job)
            t.wait(ids)
            bad = [r for r in t.get_finished() if not r.success]
            assert not bad, bad[0]
            return n * block_bytes / (time.perf_counter() - t0) / 1e9

        store_d = t.descriptors(blocks, slots, to_host=True)
        load_d = t.descriptors(blocks, slots, to_host=False)

        def base(d: np.ndarray) -> float:
            t0 = time.perf_counter()
            t._b.engine.copy_inline(d)
            return n * block_bytes / (time.perf_counter() - t0) / 1e9

        run(True), run(False), base(store_d)  # warm-up
        eng, ref = [], []
        for _ in range(repeats):
            eng += [run(True), run(False)]
            ref += [base(store_d), base(load_d)]
        # Descriptor building: numpy, per descriptor
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            t.descriptors(blocks, slots)
        build_us = (time.perf_counter() - t0) / reps / (n * layers) * 1e6
        gbps, bgbps = statistics.median(eng), statistics.median(ref)
        # Per-job overhead: one-block jobs, minus the memcpy time of their bytes.
        jobs = min(n, 2000)
        t0 = time.perf_counter()
        for i in range(jobs):
            job += 1
            t.submit_store(job, blocks[i : i + 1], slots[i : i + 1])
            t.get_finished()
        t.wait([job])
        t.get_finished()
        wall = time.perf_counter() - t0
        overhead_us = max(0.0, (wall - jobs * block_bytes / (bgbps * 1e9)) / jobs * 1e6)
        return {
            "component": "copy",
            "device": "cpu",
            "block_bytes": block_bytes,
            "gbps": round(gbps, 3),
            "baseline_gbps": round(bgbps, 3),
            "ratio": round(gbps / bgbps, 3),
            "descriptor_build_us": round(build_us, 4),
            "per_job_overhead_us": round(overhead_us, 3),
            "blocks_per_job": per_job_blocks,
            "baseline": "single-threaded memcpy of the same descriptors (C, GIL released)",
        }
    finally:
        t.shutdown()
        pool.close()
