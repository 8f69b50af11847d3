"""The soak's workload child: replay through host, disk and Redis tiers with
every loaded block verified, one JSON sample line per interval.

Runs in its own process, started by the driver
(:func:`kvtier.bench.soak.run_soak`) as ``python -m kvtier.bench.soak
CONFIG``, and killed or restarted by it as faults demand. Who calls:
:func:`child_main`, from that entry point; the tests also call
:func:`proc_status` (never blocks). The child blocks for its whole life
(until SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

TIER_TIMEOUT_S = {"disk": 2.0, "remote": 1.0}
HANG_S = 10 * max(TIER_TIMEOUT_S.values())  # a request step this long is a hang
# The remote tier's existence cache (RemoteTier.known, about 230 B a key) at
# its default bound of 2**20 keys fills for hours at this request rate: bounded
# at 8x what this soak's Redis holds, it is full within warm-up, so the soak
# judges steady state as it does for the other tiers' small sizes.
KNOWN_CAPACITY = 1 << 14
# The remote tier's pool index (PoolIndex, 91 B a digest) learns every store
# and forgets only what a watcher reports removed or a load found gone; the
# soak runs no watcher while its Redis evicts under maxmemory, so at its
# default bound (2**21 digests, 190 MB) the index grew for hours (0.9 MB in a
# 2-minute run, the CI soak's RSS at +5.0%). Bounded at twice what this
# soak's Redis holds, it fills (and stops growing) within the first minute.
POOL_INDEX_CAPACITY = 1 << 12


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """RSS (and its anonymous, file-backed and shared-memory parts), locked
    and pinned memory (KiB), threads and open fds of a process
    from /proc. ``threads`` leaves out the kernel's io_uring workers
    (``iou-wrk-*``, counted in ``io_workers``): the kernel starts them while
    buffered I/O is punted to it and ends them after they idle, so they come
    and go with the load without anything leaking. Never blocks."""
    out = {
        "rss_kib": 0,
        "anon_kib": 0,
        "file_kib": 0,
        "shmem_kib": 0,
        "lck_kib": 0,
        "pin_kib": 0,
        "threads": 0,
        "io_workers": 0,
        "fds": 0,
    }
    names = {
        "VmRSS": "rss_kib",
        "RssAnon": "anon_kib",
        "RssFile": "file_kib",
        "RssShmem": "shmem_kib",
        "VmLck": "lck_kib",
        "VmPin": "pin_kib",
    }
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in names:
                out[names[k]] = int(v.split()[0])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):  # a worker may end meanwhile
                comm = Path(f"/proc/{pid}/task/{task}/comm").read_text()
                out["io_workers" if comm.startswith("iou-wrk") else "threads"] += 1
    except (OSError, ValueError):
        pass
    return out


def _numeric(d: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)}


def child_main(cfg_json: str) -> int:
    """The workload process: replay until SIGTERM, a sample line every
    ``sample_s``. Exit 0 after a clean shutdown, 1 when a request raised
    (the error is written as an ``error`` line first)."""
    c = json.loads(cfg_json)
    with Path(c["samples"]).open("a", buffering=1) as out:  # line-buffered: the driver tails it
        return _child_run(c, out)


def _child_run(c: dict[str, Any], out: TextIO) -> int:
    import faulthandler

    import numpy as np

    from kvtier.errors import KvtierError
    from kvtier.options.tiers import DiskOptions, RemoteOptions
    from kvtier.pool import HostPool
    from kvtier.replay import FakeKV, Replayer, synthetic_requests
    from kvtier.scheduler.manager import TieredOffloadingManager
    from kvtier.tiers.factory import TierConfig, build_lower_tiers, host_slot_bytes
    from kvtier.tiers.host_native import make_host_tier
    from kvtier.tiers.remote.tier import RemoteTier
    from kvtier.worker.transfer import DeviceTransfer

    faulthandler.enable()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def emit(rec: dict[str, Any]) -> None:
        out.write(json.dumps({"t": time.time(), "inc": c["inc"], "pid": os.getpid(), **rec}) + "\n")

    block = int(c["block_bytes"])
    tier_cfg = TierConfig(
        DiskOptions(
            c["disk_dir"], int(c["disk_bytes"]), reserve_bytes=0, timeout_s=TIER_TIMEOUT_S["disk"]
        ),
        RemoteOptions(
            c["redis_url"],
            timeout_s=TIER_TIMEOUT_S["remote"],
            degraded_ok=True,
            known_capacity=KNOWN_CAPACITY,
        ),
    )
    t_start = time.monotonic()
    lower = build_lower_tiers(tier_cfg, block, namespace=f"soak-{block}")
    for t in lower:
        if isinstance(t, RemoteTier) and t.index is not None:
            t.index.capacity = POOL_INDEX_CAPACITY
    name = f"kvtier-soak-{c['tag']}-{c['inc']}"
    try:
        pool = HostPool(c["host_blocks"], host_slot_bytes(block, tier_cfg), name, mlock=True)
    except (KvtierError, OSError):  # no RLIMIT_MEMLOCK for it: unlocked (the samples show lck 0)
        pool = HostPool(c["host_blocks"], host_slot_bytes(block, tier_cfg), name)
    kv = FakeKV(256, block, seed=int(c["seed"]))  # a prompt has at most 124 blocks
    transfer = DeviceTransfer(kv.layers, pool)
    manager = TieredOffloadingManager(make_host_tier(pool, c["host_blocks"]), lower)
    # No chain map: it would hold every key the run names (RSS must stay flat).
    rep = Replayer(manager, transfer, kv, block, series_every=1 << 62, chains=False)
    emit({"event": "started", "startup_s": time.monotonic() - t_start})

    step_started = [time.monotonic()]
    hangs = [0]

    def watchdog() -> None:
        reported = 0.0
        while not stop.wait(1.0):
            began = step_started[0]
            if time.monotonic() - began > HANG_S and began != reported:
                reported = began
                hangs[0] += 1
                emit({"event": "hang", "step_s": time.monotonic() - began})
                faulthandler.dump_traceback(file=sys.stderr)

    threading.Thread(target=watchdog, daemon=True).start()
    requests = synthetic_requests(int(c["seed"]))
    res = rep.result
    next_sample = time.monotonic() + float(c["sample_s"])
    step_max = 0.0
    code = 0

    def sample(final: bool = False) -> None:
        nonlocal step_max
        lat = res.load_latency_ms
        emit(
            {
                "event": "final" if final else "sample",
                "requests": res.requests,
                "block_refs": res.block_refs,
                "hits": dict(res.hit_blocks),
                "wrong_blocks": res.verify_failures,
                "store_rejections": res.store_rejections,
                "step_max_s": round(step_max, 4),
                "load_p99_ms": round(float(np.percentile(lat, 99)), 3) if lat else 0.0,
                "hangs": hangs[0],
                "tiers": {t.name: _numeric(t.stats()) for t in lower},
                **proc_status(),
            }
        )
        lat.clear()  # the replayer keeps every latency: bounded here, per sample
        step_max = 0.0

    try:
        while not stop.is_set():
            ids = next(requests)
            step_started[0] = t0 = time.monotonic()
            rep.run_request(ids)
            with manager.lock:  # an engine takes the events every step; else they pile up
                manager.take_events()
            now = time.monotonic()
            step_max = max(step_max, now - t0)
            if now >= next_sample:
                sample()
                next_sample = now + float(c["sample_s"])
    except Exception as e:  # any failure of a request ends this child; the driver restarts it
        emit({"event": "error", "error": f"{type(e).__name__}: {e}"})
        code = 1
    finally:
        stop.set()
        manager.shutdown()
        transfer.shutdown()
        pool.close()
    sample(final=True)
    return code
