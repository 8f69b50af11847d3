"""``kvtier bench copy``: gather/scatter of blocks between scattered pool slots
and a contiguous buffer through the engine, against a plain single-threaded
memcpy of the same descriptors in the same run.

A command-line tool: runs in the ``kvtier`` process. Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np

from kvtier.bench.harness import median_rate
from kvtier.engine import Engine
from kvtier.pool import HostPool

DEFAULT_SIZES = (64 * 1024, 256 * 1024, 2 * 1024 * 1024)


def _split(descs: np.ndarray, per_job_bytes: int) -> list[np.ndarray]:
    per = max(1, per_job_bytes // int(descs[0, 2]))
    return [descs[i : i + per] for i in range(0, len(descs), per)]


def per_job_overhead_us(engine: Engine, pool: HostPool, jobs: int = 20000) -> float:
    """Median cost of submit + poll for a tiny (64-byte) copy job, in microseconds."""
    d = np.array([[pool.slot_address(0), pool.slot_address(1), 64]], np.int64)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        done = 0
        for _ in range(jobs):
            engine.submit_copy(d)
            done += len(engine.poll())
        while done < jobs:
            done += len(engine.poll())
        samples.append((time.perf_counter() - t0) / jobs * 1e6)
    return float(np.median(samples))


def run_copy(
    block_bytes: int,
    total_bytes: int = 256 << 20,
    repeats: int = 5,
    threads: int = 2,
    per_job_bytes: int = 8 << 20,
) -> dict[str, Any]:
    """Measure one block size; returns the JSON object ``kvtier bench copy`` prints."""
    n = max(1, total_bytes // block_bytes)
    pool = HostPool(2 * n, block_bytes)  # scattered slots: half of them used, shuffled
    buf = np.zeros(n * block_bytes, np.uint8)
    buf[::4096] = 1  # fault the contiguous buffer in before timing
    engine = Engine(threads, [(4 << 30, False)])
    try:
        engine.register_pool(pool)
        engine.register_memory(buf.ctypes.data, buf.nbytes, owner=buf)
        rng = np.random.default_rng(0)
        slots = rng.permutation(2 * n)[:n]
        slot_addr = pool.address + slots.astype(np.int64) * block_bytes
        buf_addr = buf.ctypes.data + np.arange(n, dtype=np.int64) * block_bytes
        size = np.full(n, block_bytes, np.int64)
        gather = np.stack([slot_addr, buf_addr, size], axis=1)
        scatter = np.stack([buf_addr, slot_addr, size], axis=1)
        moved = n * block_bytes

        def through_engine(descs: np.ndarray) -> int:
            ids = [engine.submit_copy(part) for part in _split(descs, per_job_bytes)]
            engine.wait(ids)
            bad = [r for r in engine.poll() if not r.ok]
            if bad:
                raise RuntimeError(f"copy job failed: {bad[0].error}")
            return moved

        def baseline(descs: np.ndarray) -> int:
            engine.copy_inline(descs)
            return moved

        out: dict[str, Any] = {}
        for name, descs in (("gather", gather), ("scatter", scatter)):
            # Interleave engine and baseline runs so drift affects both alike.
            eng_runs, base_runs = [], []
            for _ in range(repeats):
                eng_runs.append(median_rate(partial(through_engine, descs), 1, 1)[0])
                base_runs.append(median_rate(partial(baseline, descs), 1, 1)[0])
            out[name] = {
                "gbps": float(np.median(eng_runs)),
                "baseline_gbps": float(np.median(base_runs)),
                "runs": eng_runs,
                "baseline_runs": base_runs,
            }
        gbps = float(np.median([out["gather"]["gbps"], out["scatter"]["gbps"]]))
        base = float(np.median([out["gather"]["baseline_gbps"], out["scatter"]["baseline_gbps"]]))
        return {
            "component": "copy",
            "device": "host",
            "block_bytes": block_bytes,
            "gbps": round(gbps, 3),
            "baseline_gbps": round(base, 3),
            "ratio": round(gbps / base, 3),
            "per_job_overhead_us": round(per_job_overhead_us(engine, pool), 3),
            "threads": threads,
            "bytes_per_run": moved,
            "repeats": repeats,
            "detail": out,
            "baseline": "single-threaded memcpy of the same descriptors (C, GIL released)",
        }
    finally:
        engine.close(cancel=True)
        pool.close()
