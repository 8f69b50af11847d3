"""``kvtier bench disk``: the disk tier's store and load throughput against fio
(io_uring, direct=1, same block size, queue depth and directory) measured in
the same run, beside a Python thread pool writing one file per block with
O_DIRECT (what a file-per-block tier does), and a GIL probe.

A command-line tool: runs in the ``kvtier`` process (fio and the
thread-pool baseline as child processes or threads of it). Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run.
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
from collections.abc import Callable
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
                "fio",
                "--name=kvtier-probe",
                f"--filename={directory / 'fio-bench.dat'}",
                f"--size={size}",
                f"--rw={'write' if r % 2 else 'read'}",
                f"--bs={bs}",
                "--ioengine=io_uring",
                "--direct=1",
                f"--iodepth={qd}",
                "--time_based",
                "--runtime=1",
                "--output-format=terse",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.3)  # fio starts its job and fills its queue
            ratios.append(loop_rate(0.4) / idle)
        finally:
            p.wait(60)
    return {
        "python_loop_speed_while_busy": round(statistics.median(ratios), 3),
        "runs": [round(x, 3) for x in ratios],
    }


class _ThreadPoolFiles:
    """The file-per-block baseline, as vLLM's fs tier does it: a Python
    thread pool, one file per block opened with O_DIRECT, written under a
    temporary name and published with ``os.replace``, read back with
    ``os.preadv``. ``store`` and ``load`` return the seconds taken."""

    def __init__(self, directory: Path, pool: HostPool, bs: int, threads: int) -> None:
        self.dir, self.pool, self.bs = directory / "pyfiles", pool, bs
        self.ex = ThreadPoolExecutor(threads)
        self.flags = getattr(os, "O_DIRECT", 0)

    def _buf(self, i: int) -> memoryview:
        return self.pool.view(i % self.pool.num_slots).data[: self.bs]

    def _store(self, i: int) -> None:
        tmp = self.dir / f"b{i}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flags, 0o600)
        try:
            os.write(fd, self._buf(i))
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / f"b{i}")

    def _load(self, i: int) -> None:
        fd = os.open(self.dir / f"b{i}", os.O_RDONLY | self.flags)
        try:
            os.preadv(fd, [self._buf(i)], 0)
        finally:
            os.close(fd)

    def store(self, n: int) -> float:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir()
        t0 = time.perf_counter()
        list(self.ex.map(self._store, range(n)))
        return time.perf_counter() - t0

    def load(self, n: int) -> float:
        t0 = time.perf_counter()
        list(self.ex.map(self._load, range(n)))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ex.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


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
    files = _ThreadPoolFiles(work, pool, block_bytes, 16)
    size = n * block_bytes
    # Each repeat runs every contender, stores then loads, in an order that
    # rotates from repeat to repeat so the disk's drift (its speed moves by
    # up to 2x within minutes here) favours no one.
    contenders: dict[str, tuple[Callable[[int], float], Callable[[int], float]]] = {
        "kvtier": (
            lambda r: size / drive_tier(tier, True, _keys(n, r), batch) / 1e9,
            lambda r: size / drive_tier(tier, False, _keys(n, r), batch) / 1e9,
        ),
        "threadpool": (
            lambda r: size / files.store(n) / 1e9,
            lambda r: size / files.load(n) / 1e9,
        ),
    }
    if have_fio:
        contenders["fio"] = (
            lambda r: _fio(work, "write", block_bytes, queue_depth, size),
            lambda r: _fio(work, "read", block_bytes, queue_depth, size),
        )
    runs: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in contenders}
    try:
        for r in range(repeats):
            names = list(contenders)
            names = names[r % len(names) :] + names[: r % len(names)]
            for phase in (0, 1):
                for c in names:
                    runs[c][phase].append(contenders[c][phase](r))
        files.close()
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
            gil["loop_beside_fio"] = _loop_beside_fio(
                work, block_bytes, queue_depth, size, max(1, probe_rounds // 2)
            )
    finally:
        files.close()
        tier.close()
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    ks, kl = runs["kvtier"]
    ps, pl = runs["threadpool"]
    out: dict[str, Any] = {
        "component": "disk",
        "block_bytes": block_bytes,
        "queue_depth": queue_depth,
        "store_gbps": round(med(ks), 3),
        "load_gbps": round(med(kl), 3),
        "backend": tier.backend,
        "direct": tier.stats()["direct"],
        "runs": {"store": ks, "load": kl},
        "bytes_per_run": size,
        "python_threadpool": {
            "name": "Python thread pool (16), one O_DIRECT file per block, tmp + os.replace",
            "store_gbps": round(med(ps), 3),
            "load_gbps": round(med(pl), 3),
            "runs": {"store": ps, "load": pl},
        },
        "vs_python_threadpool": {"store": paired_ratio(ks, ps), "load": paired_ratio(kl, pl)},
        "ratio_method": PAIRED + "; the order of the contenders rotates between repeats",
        "gil": gil,
    }
    if have_fio:
        fs, fl = runs["fio"]
        out["baseline"] = {
            "name": "fio",
            "store_gbps": round(med(fs), 3),
            "load_gbps": round(med(fl), 3),
            "runs": {"store": fs, "load": fl},
        }
        out["ratio"] = {"store": paired_ratio(ks, fs), "load": paired_ratio(kl, fl)}
    else:
        out["baseline"] = {"name": "fio", "error": "fio not installed"}
    return out
