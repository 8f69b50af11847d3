"""``kvtier bench soak``: replay for minutes through host, disk and Redis
tiers, every load verified, while faults are injected on a schedule.

Two processes. The driver (:func:`run_soak`, called by the CLI) starts its
own redis-server on a free loopback port, puts the disk tier on a small tmpfs
it mounts (when root; else a plain directory, and the full-disk fault is
skipped and said so), starts the workload child and injects the faults:
Redis killed with SIGKILL and restarted on the same port, the disk tier's
file system filled with a ballast file, records corrupted inside the slab
files and inside Redis values, the child killed with SIGKILL and restarted on
the same disk directory. The child (:func:`child_main`, ``python -m
kvtier.bench.soak CONFIG``) replays an endless synthetic multi-turn workload
through :class:`~kvtier.manager.TieredOffloadingManager` with real bytes
(each block derived from its key, each loaded block compared byte for byte)
and appends one JSON line per sample interval: requests, hits per tier,
wrong blocks served, its slowest step, RSS, open fds, threads, locked and
pinned memory, the tiers' counters. The driver adds the /dev/shm entries of
the child's host pools, prints one row per minute and judges the run
(:func:`verdict`): resources flat after warm-up, no wrong byte, no hang, no
crash, recovery after every fault.

A command-line tool. Who calls: ``kvtier bench soak``
(:mod:`kvtier.bench.commands`) and the tests. Everything blocks
for the run's length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

FAULT_KINDS = ("corrupt_disk", "redis_kill", "corrupt_redis", "disk_full", "process_kill")
"""Every fault the soak injects, in the order of each round."""

FLAT_METRICS = ("rss_kib", "fds", "threads", "shm")
FLAT_TOLERANCE = 0.05  # the "within 5%"
WARMUP_SHARE = 0.2  # the first fifth of the run fills the tiers; flatness is judged after it
SETTLE_S = 10.0  # a restarted child's first seconds (imports, pool, recovery) are not judged
RECOVERY_SHARE = 0.5  # recovered: a sample's hit rate back to half the rate before the fault
TIER_TIMEOUT_S = {"disk": 2.0, "remote": 1.0}
HANG_S = 10 * max(TIER_TIMEOUT_S.values())  # a request step this long is a hang
# The remote tier's existence cache (RemoteTier.known, about 230 B a key) at
# its default bound of 2**20 keys fills for hours at this request rate: bounded
# at 8x what this soak's Redis holds, it is full within warm-up, so the soak
# judges steady state as it does for the other tiers' small sizes.
KNOWN_CAPACITY = 1 << 14


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


# -- the schedule ---------------------------------------------------------------
def fault_schedule(total_s: float, warmup_s: float) -> list[tuple[float, str]]:
    """(seconds from the start, kind) of every fault: whole rounds of
    :data:`FAULT_KINDS` (one round per 5 minutes after warm-up, at least one),
    evenly spaced between the end of warm-up and a tail left to watch the
    last recovery."""
    tail = max(15.0, 0.05 * total_s)
    span = total_s - warmup_s - tail
    if span <= 0:
        raise ValueError(f"a soak of {total_s:.0f} s leaves no time for faults")
    rounds = max(1, int(span // 300))
    n = rounds * len(FAULT_KINDS)
    gap = span / n
    return [(warmup_s + (i + 0.5) * gap, FAULT_KINDS[i % len(FAULT_KINDS)]) for i in range(n)]


# -- the child ------------------------------------------------------------------
def proc_status(pid: int | str = "self") -> dict[str, int]:
    """RSS, locked and pinned memory (KiB), threads and open fds of a process
    from /proc. ``threads`` leaves out the kernel's io_uring workers
    (``iou-wrk-*``, counted in ``io_workers``): the kernel starts them while
    buffered I/O is punted to it and ends them after they idle, so they come
    and go with the load without anything leaking. Never blocks."""
    out = {"rss_kib": 0, "lck_kib": 0, "pin_kib": 0, "threads": 0, "io_workers": 0, "fds": 0}
    names = {"VmRSS": "rss_kib", "VmLck": "lck_kib", "VmPin": "pin_kib"}
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
    from kvtier.manager import TieredOffloadingManager
    from kvtier.pool import HostPool
    from kvtier.replay import FakeKV, Replayer, synthetic_requests
    from kvtier.tiers.factory import TierConfig, build_lower_tiers, host_slot_bytes
    from kvtier.tiers.host import HostTier
    from kvtier.transfer import DeviceTransfer

    faulthandler.enable()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def emit(rec: dict[str, Any]) -> None:
        out.write(json.dumps({"t": time.time(), "inc": c["inc"], "pid": os.getpid(), **rec}) + "\n")

    block = int(c["block_bytes"])
    tier_cfg = TierConfig(
        disk_path=c["disk_dir"], disk_bytes=int(c["disk_bytes"]), disk_reserve_bytes=0,
        disk_timeout_s=TIER_TIMEOUT_S["disk"], remote_url=c["redis_url"],
        remote_timeout_s=TIER_TIMEOUT_S["remote"], remote_degraded_ok=True,
        remote_known_capacity=KNOWN_CAPACITY,
    )  # fmt: skip
    t_start = time.monotonic()
    lower = build_lower_tiers(tier_cfg, block, namespace=f"soak-{block}")
    name = f"kvtier-soak-{c['tag']}-{c['inc']}"
    try:
        pool = HostPool(c["host_blocks"], host_slot_bytes(block, tier_cfg), name, mlock=True)
    except (KvtierError, OSError):  # no RLIMIT_MEMLOCK for it: unlocked (the samples show lck 0)
        pool = HostPool(c["host_blocks"], host_slot_bytes(block, tier_cfg), name)
    kv = FakeKV(256, block, seed=int(c["seed"]))  # a prompt has at most 124 blocks
    transfer = DeviceTransfer(kv.layers, pool)
    manager = TieredOffloadingManager(HostTier(pool, c["host_blocks"]), lower)
    rep = Replayer(manager, transfer, kv, block, series_every=1 << 62)
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


# -- faults -----------------------------------------------------------------------
@dataclass
class Fault:
    """One injected fault: when it began and ended (the medium restored),
    what was done, and what the verdict found."""

    kind: str
    start: float
    end: float = 0.0
    detail: str = ""
    skipped: str = ""
    recovered_s: float | None = None
    felt: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def corrupt_files(paths: Sequence[Path], record_bytes: int, count: int, rng: random.Random) -> int:
    """Overwrite 16 random bytes inside ``count`` random records of the slab
    files (a bad sector, a stray writer). Returns the records hit."""
    hit = 0
    for _ in range(count):
        p = rng.choice(list(paths))
        size = p.stat().st_size
        records = size // record_bytes
        if records < 1:
            continue
        off = rng.randrange(records) * record_bytes + rng.randrange(record_bytes - 16)
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, rng.randbytes(16), off)
        finally:
            os.close(fd)
        hit += 1
    return hit


def fill_disk(path: Path) -> int:
    """Write a ballast file until the file system says ENOSPC; returns its size."""
    n = 0
    chunk = b"\xa5" * (1 << 20)
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                w = f.write(chunk)
            except OSError:
                break
            n += w or 0
            if not w:
                break
    return n


class Tmpfs:
    """A tmpfs of ``size`` bytes mounted on a new temporary directory (root
    only); :attr:`path` is None when it could not be mounted (``reason`` says why)."""

    def __init__(self, size: int) -> None:
        self.path: Path | None = None
        self.reason = ""
        if os.geteuid() != 0:
            self.reason = "not root: cannot mount a small file system to fill"
            return
        d = Path(tempfile.mkdtemp(prefix="kvtier-soak-fs-"))
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            d.rmdir()
            self.reason = f"mount -t tmpfs failed: {r.stderr.strip()}"
            return
        self.path = d

    def close(self) -> None:
        if self.path is not None:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.path = None


# -- the verdict ----------------------------------------------------------------
@dataclass
class Criterion:
    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flatness(
    samples: Sequence[dict[str, Any]], metric: str, warmup_end: float, starts: Iterable[float]
) -> tuple[bool, str]:
    """Whether ``metric`` stays within :data:`FLAT_TOLERANCE` above its level
    after warm-up. Judged: samples after ``warmup_end`` and at least
    :data:`SETTLE_S` after any child start (``starts``, same clock as the
    samples' ``t``). The level is the median of the first tenth of them (at
    least 3); the peak of all of them must not pass it by more than 5%. A
    drop (fewer connections while Redis is down) is no leak and passes."""
    starts = sorted(starts)

    def settled(t: float) -> bool:
        return all(not (s <= t < s + SETTLE_S) for s in starts)

    judged = [
        s for s in samples if s["t"] >= warmup_end and settled(s["t"]) and s.get("event") != "final"
    ]
    if len(judged) < 3:
        return False, f"only {len(judged)} samples after warm-up to judge"
    head = judged[: max(3, len(judged) // 10)]
    level = statistics.median(s[metric] for s in head)
    peak = max(s[metric] for s in judged)
    ok = peak <= level * (1 + FLAT_TOLERANCE)
    growth = (peak / level - 1) if level else (0.0 if peak == 0 else float("inf"))
    return ok, f"level {level:g}, peak {peak:g} ({growth:+.1%}) over {len(judged)} samples"


def hit_rate(samples: Iterable[dict[str, Any]]) -> float:
    """Hits over block references of the samples' intervals together."""
    hits = refs = 0
    for s in samples:
        hits += s["d_hits"]
        refs += s["d_refs"]
    return hits / refs if refs else 0.0


def judge_recovery(fault: Fault, samples: Sequence[dict[str, Any]], until: float) -> None:
    """Fill ``fault.recovered_s``: seconds from the fault's end to the first
    sample (before ``until``, the next fault) whose hit rate is back to
    :data:`RECOVERY_SHARE` of the 15 s before the fault, in which the faulted
    medium works again: Redis stores or loads for ``redis_kill``, disk stores
    for ``disk_full``, hits served by the restarted child for ``process_kill``.
    None: not recovered."""
    before = [s for s in samples if fault.start - 15 <= s["t"] < fault.start]
    want = RECOVERY_SHARE * hit_rate(before)
    after = [s for s in samples if fault.end <= s["t"] < until]
    medium_ok = fault.kind not in ("redis_kill", "disk_full", "process_kill")
    for s in after:
        if fault.kind == "redis_kill":
            medium_ok |= s["d_remote_io"] > 0
        elif fault.kind == "disk_full":
            medium_ok |= s["d_disk_stores"] > 0
        elif fault.kind == "process_kill":  # every sample after its end is the new child's
            medium_ok |= s["d_hits"] > 0
        if medium_ok and s["d_refs"] and s["d_hits"] / s["d_refs"] >= want:
            fault.recovered_s = round(s["t"] - fault.end, 1)
            return


def verdict(
    samples: Sequence[dict[str, Any]],
    faults: Sequence[Fault],
    warmup_end: float,
    starts: Iterable[float],
    hangs: int,
    crashes: int,
    t0: float,
) -> list[Criterion]:
    """Every acceptance criterion of the soak, judged from its records (the
    samples as :class:`Recorder` keeps them; ``t0``: the run's start)."""
    starts = list(starts)
    out = []
    for m in FLAT_METRICS:
        ok, detail = flatness(samples, m, warmup_end, starts)
        out.append(Criterion(f"{m} flat after warm-up (within 5%)", ok, detail))
    wrong = sum(s["d_wrong"] for s in samples)
    loaded = sum(s["d_hits"] for s in samples)
    out.append(
        Criterion("0 wrong bytes served", wrong == 0, f"{wrong} wrong of {loaded:,} blocks loaded")
    )
    out.append(Criterion("0 hangs", hangs == 0, f"{hangs} steps over {HANG_S:g} s or silent"))
    out.append(Criterion("0 crashes", crashes == 0, f"{crashes} unexpected child exits"))
    done = [f for f in faults if not f.skipped]
    bad = [f"{f.kind} at {f.start - t0:.0f} s" for f in done if f.recovered_s is None]
    kinds = {f.kind for f in done}
    out.append(
        Criterion(
            "recovery after every fault",
            not bad and bool(done),
            f"{len(done) - len(bad)}/{len(done)} recovered"
            + (f"; not: {', '.join(bad)}" if bad else "")
            + f"; kinds run: {len(kinds)}/{len(FAULT_KINDS)}",
        )
    )
    return out


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


def minute_rows(
    samples: Sequence[dict[str, Any]], faults: Sequence[Fault], t0: float, minutes: int
) -> list[dict[str, Any]]:
    """One row per minute: what happened in it (sums of the intervals ending
    in it) and the resources at its last sample."""
    rows = []
    for m in range(minutes):
        lo, hi = t0 + 60 * m, t0 + 60 * (m + 1)
        ss = [s for s in samples if lo <= s["t"] < hi]
        live = [s for s in ss if s.get("event") != "final"]  # resources before shutdown
        last = live[-1] if live else {}
        rows.append(
            {
                "minute": m + 1,
                "requests": sum(s["d_requests"] for s in ss),
                "hit_rate": round(hit_rate(ss), 4),
                "wrong_blocks": sum(s["d_wrong"] for s in ss),
                "corrupt_caught": sum(s["d_corrupt"] for s in ss),
                "step_max_s": max((s["step_max_s"] for s in ss), default=0.0),
                **{
                    k: last.get(k, 0)
                    for k in ("rss_kib", "fds", "threads", "shm", "lck_kib", "pin_kib")
                },
                "faults": [f.kind for f in faults if lo <= f.start < hi],
            }
        )
    return rows


_HEADER = (
    f"{'min':>4} {'requests':>9} {'hit rate':>8} {'wrong':>5} {'corrupt':>7} {'max step':>8} "
    f"{'RSS MiB':>8} {'fds':>4} {'thr':>4} {'shm':>3} {'VmLck':>7} {'VmPin':>5}  faults"
)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['minute']:>4} {r['requests']:>9,} {r['hit_rate']:>8.1%} {r['wrong_blocks']:>5} "
        f"{r['corrupt_caught']:>7} {r['step_max_s']:>7.2f}s {r['rss_kib'] / 1024:>8.1f} "
        f"{r['fds']:>4} {r['threads']:>4} {r['shm']:>3} {r['lck_kib']:>5}Ki {r['pin_kib']:>3}Ki"
        f"  {', '.join(r['faults'])}"
    )


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
            "samples": str(work / "samples.jsonl"), "inc": inc, "tag": tag,
            "disk_dir": str(disk_root), "disk_bytes": cfg.disk_bytes,
            "block_bytes": cfg.block_bytes, "host_blocks": cfg.host_blocks,
            "redis_url": redis.url, "seed": cfg.seed, "sample_s": cfg.sample_s,
        }  # fmt: skip
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
    log(_HEADER)

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


def report(result: dict[str, Any]) -> str:
    """The fault log and the verdict as text (after the per-minute table)."""
    lines = ["faults:"]
    for f in result["faults"]:
        rec = (
            "skipped: " + f["skipped"]
            if f["skipped"]
            else (
                f"recovered in {f['recovered_s']} s"
                if f["recovered_s"] is not None
                else "NOT recovered"
            )
        )
        lines.append(f"  {f['at_s']:>7.1f} s  {f['kind']:<13} {rec}; {f['detail']}; {f['felt']}")
    counts = ", ".join(f"{k} {n}" for k, n in result["fault_counts"].items())
    lines.append(f"fault counts: {counts}; child starts {result['child_starts']}")
    lines.append("verdict:")
    lines.extend(
        f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['detail']}"
        for c in result["verdict"]
    )
    lines.append(f"soak {'PASSED' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS, fds and threads, hit rate and /dev/shm entries over time, one
    vertical line per fault. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ss = result["samples"]
    xs = [s["at_s"] / 60 for s in ss]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    series = [
        ("RSS (MiB)", [s["rss_kib"] / 1024 for s in ss]),
        ("open fds / threads", None),
        (
            "hit rate per interval (%)",
            [100 * s["d_hits"] / s["d_refs"] if s["d_refs"] else 0 for s in ss],
        ),
        ("/dev/shm pools", [s["shm"] for s in ss]),
    ]
    for ax, (label, ys) in zip(axes, series, strict=True):
        if ys is None:
            ax.plot(xs, [s["fds"] for s in ss], ".-", label="fds")
            ax.plot(xs, [s["threads"] for s in ss], ".-", label="threads")
            ax.legend(loc="lower right")
        else:
            ax.plot(xs, ys, ".-")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        colors = dict(
            zip(
                FAULT_KINDS,
                ("tab:red", "tab:blue", "tab:orange", "tab:green", "black"),
                strict=True,
            )
        )
        for f in result["faults"]:
            if not f["skipped"]:
                ax.axvline(f["at_s"] / 60, color=colors[f["kind"]], alpha=0.5, lw=1)
    axes[-1].set_xlabel(
        "minutes (vertical lines: faults; "
        + ", ".join(
            f"{c}: {k}"
            for k, c in zip(FAULT_KINDS, ("red", "blue", "orange", "green", "black"), strict=True)
        )
        + ")"
    )
    axes[0].set_title(
        f"kvtier bench soak, {result['config']['minutes']:g} min: "
        + ("PASSED" if result["passed"] else "FAILED")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
