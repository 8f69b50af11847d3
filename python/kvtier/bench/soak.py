"""``kvtier bench soak``: replay for minutes through host, disk and Redis
tiers, every load verified, while faults are injected on a schedule.

Two processes. The driver (:func:`run_soak`, called by the CLI) starts its
own redis-server on a free loopback port, puts the disk tier on a small tmpfs
it mounts (when root; else a plain directory, and the full-disk fault is
skipped and said so), starts the workload child and injects the faults
(:mod:`kvtier.bench.soak_faults`): Redis killed with SIGKILL and restarted
on the same port, the disk tier's file system filled with a ballast file,
records corrupted inside the slab files and inside Redis values, the child
killed with SIGKILL and restarted on the same disk directory. The child
(:mod:`kvtier.bench.soak_child`, ``python -m kvtier.bench.soak CONFIG``)
replays an endless synthetic multi-turn workload through
:class:`~kvtier.scheduler.manager.TieredOffloadingManager` with real bytes (each block
derived from its key, each loaded block compared byte for byte) and appends
one JSON line per sample interval: requests, hits per tier, wrong blocks
served, its slowest step, RSS, open fds, threads, locked and pinned memory,
the tiers' counters. The driver (:class:`Recorder`) adds the /dev/shm
entries of the child's host pools, prints one row per minute and judges the
run (:mod:`kvtier.bench.soak_verdict`): resources flat after warm-up, no
wrong byte, no hang, no crash, recovery after every fault.

This module is the driver and the child's entry point; every name the soak
had here before its split is still importable from it.

A command-line tool. Who calls: ``kvtier bench soak``
(:mod:`kvtier.bench.commands`) and the tests. Everything blocks
for the run's length.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvtier.bench.soak_child import (
    HANG_S,
    KNOWN_CAPACITY,
    TIER_TIMEOUT_S,
    child_main,
    proc_status,
)
from kvtier.bench.soak_faults import (
    FAULT_KINDS,
    Fault,
    Tmpfs,
    corrupt_files,
    fault_schedule,
    fill_disk,
)
from kvtier.bench.soak_verdict import (
    FLAT_METRICS,
    FLAT_TOLERANCE,
    MINUTE_HEADER,
    RECOVERY_SHARE,
    SETTLE_S,
    Criterion,
    flatness,
    format_row,
    hit_rate,
    judge_recovery,
    minute_rows,
    plot,
    report,
    verdict,
)

__all__ = [
    "FAULT_KINDS",
    "FLAT_METRICS",
    "FLAT_TOLERANCE",
    "HANG_S",
    "KNOWN_CAPACITY",
    "RECOVERY_SHARE",
    "SETTLE_S",
    "TIER_TIMEOUT_S",
    "WARMUP_SHARE",
    "Criterion",
    "Fault",
    "Recorder",
    "SoakConfig",
    "Tmpfs",
    "child_main",
    "corrupt_files",
    "fault_schedule",
    "fill_disk",
    "flatness",
    "format_row",
    "hit_rate",
    "judge_recovery",
    "minute_rows",
    "plot",
    "proc_status",
    "report",
    "run_soak",
    "verdict",
]

WARMUP_SHARE = 0.2  # the first fifth of the run fills the tiers; flatness is judged after it


@dataclass(frozen=True)
class SoakConfig:
    """Sizes of one soak (small, so the tiers evict all the time)."""

    minutes: float = 2.0
    block_bytes: int = 32 << 10
    host_blocks: int = 256
    disk_fs_bytes: int = 48 << 20  # the tmpfs the disk tier lives on
    disk_bytes: int = 24 << 20  # the disk tier's capacity on it
    redis_maxmemory: str = "64mb"
    seed: int = 0
    corrupt_records: int = 16  # per corruption fault, on disk and in Redis each

    @property
    def total_s(self) -> float:
        return self.minutes * 60.0

    @property
    def sample_s(self) -> float:
        """Seconds between the child's samples: 2 s in a 2-minute run, 10 s from 10 minutes."""
        return min(10.0, max(1.0, self.total_s / 60.0))

    @property
    def warmup_s(self) -> float:
        return WARMUP_SHARE * self.total_s


# -- the driver -----------------------------------------------------------------
class Recorder:
    """Turns the child's cumulative sample lines into per-interval rows (each
    row: the raw sample plus ``d_*`` deltas since the previous sample of the
    same child, and ``shm``: /dev/shm entries of the soak's pools when it was
    read). Who calls: :func:`run_soak`, as lines arrive."""

    def __init__(self, shm_prefix: str) -> None:
        self.shm_prefix = shm_prefix
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.hangs = 0
        self._prev: dict[int, dict[str, Any]] = {}

    def shm_entries(self) -> int:
        try:
            return sum(n.startswith(self.shm_prefix) for n in os.listdir("/dev/shm"))
        except OSError:
            return 0

    def add(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """One line from the child; returns the row when it was a sample."""
        ev = rec.get("event")
        if ev not in ("sample", "final"):
            self.events.append(rec)
            self.hangs += ev == "hang"
            return None
        p = self._prev.get(rec["inc"], {})
        pt: dict[str, Any] = p.get("tiers", {})
        t = rec["tiers"]

        def d(tier: str, *keys: str) -> int:
            return sum(t.get(tier, {}).get(k, 0) - pt.get(tier, {}).get(k, 0) for k in keys)

        row = {
            **rec,
            "shm": self.shm_entries(),
            "d_requests": rec["requests"] - p.get("requests", 0),
            "d_refs": rec["block_refs"] - p.get("block_refs", 0),
            "d_hits": sum(rec["hits"].values()) - sum(p.get("hits", {}).values()),
            "d_hits_by": {k: v - p.get("hits", {}).get(k, 0) for k, v in rec["hits"].items()},
            "d_wrong": rec["wrong_blocks"] - p.get("wrong_blocks", 0),
            "d_disk_stores": d("disk", "stores"),
            "d_remote_io": d("remote", "stores", "loads"),
            "d_corrupt": d("disk", "corrupt") + d("remote", "corrupt"),
            "d_disk_corrupt": d("disk", "corrupt"),
            "d_remote_corrupt": d("remote", "corrupt"),
            "d_remote_errors": d("remote", "io_errors", "server_errors", "load_failures"),
            "d_disk_nospace": d("disk", "nospace"),
        }
        self._prev[rec["inc"]] = rec
        self.samples.append(row)
        return row


class _Lines:
    """New whole lines of a file another process appends to. Never blocks."""

    def __init__(self, path: Path) -> None:
        path.touch()
        self.f: TextIO = path.open()
        self.buf = ""

    def read(self) -> list[dict[str, Any]]:
        self.buf += self.f.read()
        *whole, self.buf = self.buf.split("\n")
        return [json.loads(x) for x in whole if x]


def run_soak(
    cfg: SoakConfig, out_dir: Path | None, progress: bool = True, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the soak for ``cfg.minutes`` and return its record (machine facts,
    per-interval samples, per-minute rows, the fault log, the verdict); the
    JSON and a plot are written under ``out_dir`` (None: nowhere). Prints a
    row per minute through ``log`` as the run goes. Blocks for the run."""
    from kvtier.bench.harness import machine_facts
    from kvtier.bench.redis_server import RedisServer
    from kvtier.tiers.records import record_bytes

    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    fs = Tmpfs(cfg.disk_fs_bytes)
    on_tmpfs = fs.path is not None
    disk_root = fs.path or work / "disk"
    disk_root.mkdir(exist_ok=True)
    tag = str(os.getpid())
    rec = Recorder(f"kvtier-soak-{tag}-")
    rng = random.Random(cfg.seed)
    faults: list[Fault] = []
    starts: list[float] = []
    crashes = 0
    redis = RedisServer(work, maxmemory=cfg.redis_maxmemory)
    lines = _Lines(work / "samples.jsonl")
    logs: list[Path] = []
    child: subprocess.Popen[bytes] | None = None

    def launch() -> subprocess.Popen[bytes]:
        inc = len(starts)
        conf = {
            "samples": str(work / "samples.jsonl"),
            "inc": inc,
            "tag": tag,
            "disk_dir": str(disk_root),
            "disk_bytes": cfg.disk_bytes,
            "block_bytes": cfg.block_bytes,
            "host_blocks": cfg.host_blocks,
            "redis_url": redis.url,
            "seed": cfg.seed,
            "sample_s": cfg.sample_s,
        }
        logs.append(work / f"child-{inc}.log")
        starts.append(time.time())
        with logs[-1].open("wb") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "kvtier.bench.soak", json.dumps(conf)],
                stdout=err,
                stderr=subprocess.STDOUT,
            )

    def kill_child() -> None:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(30)

    def slab_files() -> list[Path]:
        return sorted(disk_root.glob("kvtier-*/slab-*.dat"))

    schedule = fault_schedule(cfg.total_s, cfg.warmup_s)
    gap = (schedule[1][0] - schedule[0][0]) if len(schedule) > 1 else 30.0
    restore: list[tuple[float, Callable[[], None], Fault]] = []
    minutes = int(-(-cfg.total_s // 60))
    printed = 0
    say = log  # the bar, while it runs, prints above itself
    bar: Any = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=int(cfg.total_s), unit="s", desc="soak", mininterval=1.0, leave=False)
        log = bar.write
    log(
        f"kvtier bench soak: {cfg.minutes:g} min, {len(schedule)} faults "
        f"({len(schedule) // len(FAULT_KINDS)} rounds), warm-up {cfg.warmup_s:.0f} s, "
        f"sample every {cfg.sample_s:g} s; disk tier on "
        + (f"a {cfg.disk_fs_bytes >> 20} MiB tmpfs" if fs.path else f"{disk_root} ({fs.reason})")
        + f"; {redis.url} (maxmemory {cfg.redis_maxmemory})"
    )
    log(MINUTE_HEADER)

    def undo_later(f: Fault, after_s: float, undo: Callable[[], None]) -> None:
        """Run `undo` (restore the medium) `after_s` from now; the fault ends then."""

        def run() -> None:
            undo()
            f.end = time.time()

        restore.append((time.time() + after_s, run, f))

    def inject(kind: str) -> Fault:
        f = Fault(kind, time.time())
        if kind == "redis_kill":
            redis.kill()
            down = min(3.0, gap / 4)
            f.detail = f"redis-server SIGKILL, restarted on port {redis.port} after {down:.1f} s"
            undo_later(f, down, redis.start)
        elif kind == "disk_full":
            if fs.path is None:
                f.skipped = fs.reason
                return f
            ballast = fs.path / "ballast"
            n = fill_disk(ballast)
            hold = min(10.0, gap / 3)
            f.detail = f"{n >> 20} MiB ballast filled the tmpfs for {hold:.1f} s"
            undo_later(f, hold, ballast.unlink)
        elif kind == "corrupt_disk":
            n = corrupt_files(slab_files(), record_bytes(cfg.block_bytes), cfg.corrupt_records, rng)
            f.detail = f"16 random bytes overwritten in {n} random records of the slab files"
            f.end = f.start
        elif kind == "corrupt_redis":
            n = 0
            for _ in range(cfg.corrupt_records):
                key = redis.cli("RANDOMKEY").strip()
                length = int(redis.cli("STRLEN", key).strip() or 0) if key else 0
                if length > 16:
                    redis.cli(
                        "SETRANGE", key, str(rng.randrange(length - 16)), rng.randbytes(8).hex()
                    )
                    n += 1
            f.detail = f"SETRANGE of 16 random bytes in {n} random values"
            f.end = f.start
        elif kind == "process_kill":
            nonlocal child
            kill_child()
            f.detail = f"child pid {child.pid if child else '?'} SIGKILL, restarted on {disk_root}"
            child = launch()
            f.end = time.time()
        return f

    try:
        child = launch()
        silent_since = time.monotonic()
        while True:
            el = time.time() - t0
            for r in lines.read():
                silent_since = time.monotonic()
                rec.add(r)
                if r.get("event") == "error":
                    log(f"  child {r['inc']} failed: {r['error']}")
            if child.poll() is not None:
                crashes += 1
                if crashes >= 3 and not any(s["inc"] >= len(starts) - 3 for s in rec.samples):
                    log("  three children in a row ended before their first sample: stopping")
                    break
                log(f"  child {len(starts) - 1} exited with {child.returncode}: restarted")
                child = launch()
                silent_since = time.monotonic()
            elif time.monotonic() - silent_since > HANG_S + 3 * cfg.sample_s:
                rec.hangs += 1
                log(f"  child {len(starts) - 1} silent for {HANG_S + 3 * cfg.sample_s:g} s: a hang")
                kill_child()
                child = launch()
                silent_since = time.monotonic()
            for item in [x for x in restore if time.time() >= x[0]]:
                item[1]()
                restore.remove(item)
            if schedule and el >= schedule[0][0]:
                faults.append(inject(schedule.pop(0)[1]))
            while printed < minutes - 1 and el >= 60 * (printed + 1) + cfg.sample_s:
                log(format_row(minute_rows(rec.samples, faults, t0, printed + 1)[printed]))
                printed += 1
            if bar is not None:
                bar.update(int(el) - bar.n)
            if el >= cfg.total_s:
                break
            time.sleep(0.2)
        for _, fn, _f in restore:
            fn()
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(HANG_S + 10)
        except subprocess.TimeoutExpired:
            rec.hangs += 1
            log("  child did not stop within its timeout after SIGTERM: a hang")
            kill_child()
        for r in lines.read():
            rec.add(r)
    finally:
        if bar is not None:
            bar.close()
        kill_child()
        redis.stop()
        fs.close()
    rows = minute_rows(rec.samples, faults, t0, minutes)
    for r in rows[printed:]:
        say(format_row(r))
    for i, f in enumerate(faults):
        nxt = faults[i + 1].start if i + 1 < len(faults) else float("inf")
        judge_recovery(f, rec.samples, nxt)
        window = [s for s in rec.samples if f.start <= s["t"] < nxt]
        felt = {
            "corrupt_disk": ("d_disk_corrupt", "corrupt records caught on disk"),
            "corrupt_redis": ("d_remote_corrupt", "corrupt values caught from Redis"),
            "redis_kill": ("d_remote_errors", "remote errors, each a miss"),
            "disk_full": ("d_disk_nospace", "disk writes refused for no space"),
        }.get(f.kind)
        if felt:
            f.felt = f"{sum(s[felt[0]] for s in window)} {felt[1]}"
        else:
            disk_hits = sum(s["d_hits_by"].get("disk", 0) for s in window)
            recovered = window[0]["tiers"].get("disk", {}).get("recovered", 0) if window else 0
            f.felt = (
                f"the restarted child recovered {recovered} disk records from the journal "
                f"and served {disk_hits} verified disk hits before the next fault"
            )
    crits = verdict(rec.samples, faults, t0 + cfg.warmup_s, starts, rec.hangs, crashes, t0)
    counts = {k: sum(f.kind == k and not f.skipped for f in faults) for k in FAULT_KINDS}
    result: dict[str, Any] = {
        "component": "soak",
        "config": {**dataclasses.asdict(cfg), "sample_s": cfg.sample_s, "warmup_s": cfg.warmup_s},
        "tier_timeouts_s": TIER_TIMEOUT_S,
        "hang_s": HANG_S,
        "disk_on_tmpfs": on_tmpfs,
        "machine": machine_facts(),
        "minutes": rows,
        "faults": [{**f.to_json(), "at_s": round(f.start - t0, 1)} for f in faults],
        "fault_counts": counts,
        "skipped_faults": sorted({f.kind for f in faults if f.skipped}),
        "child_starts": len(starts),
        "crashes": crashes,
        "hangs": rec.hangs,
        "events": rec.events,
        "verdict": [c.to_json() for c in crits],
        "passed": all(c.passed for c in crits),
        "samples": [{**s, "at_s": round(s["t"] - t0, 2)} for s in rec.samples],
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t0))
        result["json_path"] = str(out_dir / f"soak-{stamp}.json")
        result["plot_path"] = str(out_dir / f"soak-{stamp}.png")
        for i, p in enumerate(logs):
            if p.exists() and p.stat().st_size:
                shutil.copy(p, out_dir / f"soak-{stamp}-child{i}.log")
        Path(result["json_path"]).write_text(json.dumps(result, indent=1) + "\n")
        plot(result, Path(result["plot_path"]))
    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
