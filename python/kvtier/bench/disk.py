"""``kvtier bench disk``: the disk tier's store and load throughput against fio
(io_uring, direct=1, same block size, queue depth and directory) measured in
the same run, beside a Python thread pool writing one file per block with
O_DIRECT (what a file-per-block tier does), and a GIL probe.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.bench.harness import (
    PAIRED,
    TierDriver,
    drive_tier,
    gil_probe,
    loop_rate,
    paired_ratio,
)
from kvtier.errors import InvalidArgument
from kvtier.pool import HostPool
from kvtier.tiers.disk import DiskTier, record_bytes


def _keys(n: int, salt: int) -> list[bytes]:
    return [b"bench-%d-%d" % (salt, i) for i in range(n)]


def _fio(directory: Path, rw: str, bs: int, qd: int, size: int) -> float:
    path = directory / "fio-bench.dat"
    out = subprocess.run(
        [
            "fio",
            "--name=kvtier",
            f"--filename={path}",
            f"--size={size}",
            f"--rw={rw}",
            f"--bs={bs}",
            "--ioengine=io_uring",
            "--direct=1",
            f"--iodepth={qd}",
            "--output-format=json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[:300]}")
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"]) / 1e9


def _loop_beside_fio(directory: Path, bs: int, qd: int, size: int, rounds: int) -> dict[str, Any]:
    """The machine's own floor for the GIL probe: the same Python loop while
    fio (another process: no GIL, nothing of kvtier's) moves the same I/O,
    writes and reads in turn, relative to the loop alone just before. On a
    VM the hypervisor's I/O emulation and the interrupts cost the guest's
    CPUs something whatever issues the I/O."""
    ratios = []
    for r in range(rounds):
        idle = loop_rate(0.4)
        p = subprocess.Popen(
            [
                "fio", "--name=kvtier-probe", f"--filename={directory / 'fio-bench.dat'}",
                f"--size={size}", f"--rw={'write' if r % 2 else 'read'}", f"--bs={bs}",
                "--ioengine=io_uring", "--direct=1", f"--iodepth={qd}",
                "--time_based", "--runtime=1", "--output-format=terse",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(0.3)  # fio starts its job and fills its queue
            ratios.append(loop_rate(0.4) / idle)
        finally:
            p.wait(60)
    return {
        "python_loop_speed_while_busy": round(statistics.median(ratios), 3),
        "runs": [round(x, 3) for x in ratios],
    }


def _threadpool(
    directory: Path, pool: HostPool, bs: int, n: int, threads: int
) -> tuple[float, float]:
    """One O_DIRECT file per block from a Python thread pool; (store, load) GB/s."""
    d = directory / "pyfiles"
    d.mkdir(exist_ok=True)
    flags = getattr(os, "O_DIRECT", 0)

    def store(i: int) -> None:
        fd = os.open(d / f"b{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            os.write(fd, pool.view(i % pool.num_slots).data[:bs])
        finally:
            os.close(fd)

    def load(i: int) -> None:
        fd = os.open(d / f"b{i}", os.O_RDONLY | flags)
        try:
            os.preadv(fd, [pool.view(i % pool.num_slots).data[:bs]], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(store, range(n)))
        ts = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(ex.map(load, range(n)))
        tl = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    return n * bs / ts / 1e9, n * bs / tl / 1e9


def run_disk(
    directory: str,
    block_bytes: int,
    queue_depth: int = 32,
    total_bytes: int = 1 << 30,
    repeats: int = 3,
    backend: str = "auto",
    threads: int = 2,
    probe_rounds: int = 12,
) -> dict[str, Any]:
    base = Path(directory)
    if not base.is_dir():
        raise InvalidArgument(f"--dir {directory} is not a directory")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=base))
    os.chmod(work, 0o700)
    n = max(64, total_bytes // block_bytes)
    slots = min(n, max(64, (512 << 20) // record_bytes(block_bytes)))
    pool = HostPool(slots, record_bytes(block_bytes))
    pool.view(0, slots)[:] = 0x5A
    tier = DiskTier(
        work,
        n * record_bytes(block_bytes),
        block_bytes,
        backend=backend,
        queue_depth=max(1, queue_depth // threads),
        num_threads=threads,
        inflight_bytes=1 << 40,
    )
    tier.attach(pool)
    batch = max(1, min(256, (16 << 20) // block_bytes))
    have_fio = shutil.which("fio") is not None
    ks, kl, fs, fl = [], [], [], []
    try:
        for r in range(repeats):
            keys = _keys(n, r)
            ks.append(n * block_bytes / drive_tier(tier, True, keys, batch) / 1e9)
            kl.append(n * block_bytes / drive_tier(tier, False, keys, batch) / 1e9)
            if have_fio:
                fs.append(_fio(work, "write", block_bytes, queue_depth, n * block_bytes))
                fl.append(_fio(work, "read", block_bytes, queue_depth, n * block_bytes))
        py_s, py_l = _threadpool(work, pool, block_bytes, min(n, 2048), 8)
        # GIL probe: the tier kept busy by one poll-and-resubmit step every
        # 5 ms (an engine polls once per scheduler step, 5-50 ms) while a
        # Python loop runs. Rounds of 256 MiB, stored then loaded back.
        rounds = itertools.count(1000)
        m = min(n, max(4 * batch, (256 << 20) // block_bytes))
        drv = TierDriver(tier, batch)

        def step() -> None:
            if drv.finished and not drv.inflight:
                if drv.store and drv.keys:
                    drv.start(False, drv.keys)
                else:
                    drv.start(True, _keys(n, next(rounds))[:m])
            drv.step()

        def drain() -> None:
            while drv.inflight:
                drv.step()
                time.sleep(0.001)

        gil = gil_probe(step, lambda: drv.moved, drain, 0.005, probe_rounds)
        if have_fio:
            size = n * block_bytes
            gil["loop_beside_fio"] = _loop_beside_fio(
                work, block_bytes, queue_depth, size, max(1, probe_rounds // 2)
            )
    finally:
        tier.close()
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    out: dict[str, Any] = {
        "component": "disk",
        "block_bytes": block_bytes,
        "queue_depth": queue_depth,
        "store_gbps": round(med(ks), 3),
        "load_gbps": round(med(kl), 3),
        "backend": tier.backend,
        "direct": tier.stats()["direct"],
        "runs": {"store": ks, "load": kl},
        "bytes_per_run": n * block_bytes,
        "python_threadpool": {
            "name": "Python thread pool (8), one O_DIRECT file per block",
            "store_gbps": round(py_s, 3),
            "load_gbps": round(py_l, 3),
        },
        "vs_python_threadpool": {
            "store": round(med(ks) / py_s, 3),
            "load": round(med(kl) / py_l, 3),
        },
        "gil": gil,
    }
    if have_fio:
        out["baseline"] = {
            "name": "fio",
            "store_gbps": round(med(fs), 3),
            "load_gbps": round(med(fl), 3),
            "runs": {"store": fs, "load": fl},
        }
        out["ratio"] = {"store": paired_ratio(ks, fs), "load": paired_ratio(kl, fl)}
        out["ratio_method"] = PAIRED
    else:
        out["baseline"] = {"name": "fio", "error": "fio not installed"}
    return out
