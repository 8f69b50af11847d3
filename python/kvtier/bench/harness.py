"""Shared benchmark machinery: repetition and medians, machine facts, result files.

Who calls: the ``kvtier bench`` subcommands. Everything here blocks.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_rate(
    fn: Callable[[], int], repeats: int = 5, warmup: int = 1
) -> tuple[float, list[float]]:
    """Run ``fn`` (returns bytes moved) ``warmup + repeats`` times; GB/s median and all runs."""
    for _ in range(warmup):
        fn()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
        rates.append(n / dt / 1e9)
    return statistics.median(rates), rates


def drive_tier(
    tier: Any, store: bool, keys: list[bytes], batch: int, poll_s: float = 0.0002
) -> float:
    """Keep a kvtier lower tier's queue full (4 batches in flight) until every
    key moved between it and the attached pool; returns the seconds taken.
    Blocks; raises RuntimeError if any key fails."""
    slots = tier.pool.num_slots
    n = len(keys)
    t0 = time.perf_counter()
    i = done = inflight = 0
    while done < n:
        while i < n and inflight < 4:
            ks = keys[i : i + batch]
            sl = [(i + j) % slots for j in range(len(ks))]
            tok = tier.submit_store(ks, sl) if store else tier.submit_load(ks, sl)
            if tok is None:
                break
            i += len(ks)
            inflight += 1
        for c in tier.poll():
            inflight -= 1
            done += len(c.keys)
            if not c.ok:
                bad = c.key_ok.count(False) if c.key_ok else "?"
                raise RuntimeError(
                    f"{tier.name} {'store' if store else 'load'} failed for {bad} keys"
                )
        time.sleep(poll_s)
    return time.perf_counter() - t0


def _loop_rate(seconds: float) -> float:
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n / seconds


def gil_probe(
    drive: Callable[[threading.Event], int], interval_s: float, rounds: int = 5
) -> dict[str, Any]:
    """How fast a pure-Python loop in the calling thread runs while ``drive``
    (run in a Python thread until its event is set, waking every
    ``interval_s`` like an engine's scheduler step; returns bytes moved) keeps
    a tier busy, relative to the loop alone measured just before. Also the
    floor: the same loop beside a thread that only wakes at that interval
    (switching the GIL costs the loop something whatever the thread does).
    Medians over ``rounds`` alternations. Blocks about 1.5 s per round."""

    def waker(stop: threading.Event) -> int:
        while not stop.is_set():
            time.sleep(interval_s)
        return 0

    def beside(fn: Callable[[threading.Event], int]) -> tuple[float, float]:
        stop = threading.Event()
        moved: list[int] = []
        th = threading.Thread(
            target=lambda ev, out: out.append(fn(ev)), args=(stop, moved), daemon=True
        )
        t0 = time.perf_counter()
        th.start()
        time.sleep(0.05)
        rate = _loop_rate(0.6)
        stop.set()
        th.join()
        return rate, sum(moved) / (time.perf_counter() - t0) / 1e9

    ratios, floors, rates = [], [], []
    for _ in range(rounds):
        idle = _loop_rate(0.3)
        busy, gbps = beside(drive)
        woken, _ = beside(waker)
        ratios.append(busy / idle)
        floors.append(woken / idle)
        rates.append(gbps)
    return {
        "python_loop_speed_while_busy": round(statistics.median(ratios), 3),
        "floor_thread_waking_alone": round(statistics.median(floors), 3),
        "poll_interval_s": interval_s,
        "tier_gbps_meanwhile": round(statistics.median(rates), 3),
        "runs": [round(r, 3) for r in ratios],
    }


def machine_facts() -> dict[str, Any]:
    """CPU, cores, memory, kernel and Python: what a reader needs to compare runs."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git": rev,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save_result(result: dict[str, Any], results_dir: str | None) -> Path | None:
    """Write ``result`` plus machine facts as JSON under ``results_dir`` (None: skip)."""
    if not results_dir:
        return None
    d = Path(results_dir)
    d.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = d / f"{result['component']}-{result.get('block_bytes', 'all')}-{stamp}.json"
    path.write_text(json.dumps({**result, "machine": machine_facts()}, indent=2) + "\n")
    return path


def parse_size(text: str) -> int:
    """``"256KiB"``, ``"2MiB"``, ``"1GB"``, ``"65536"`` -> bytes. Raises InvalidArgument."""
    from kvtier.errors import InvalidArgument

    units = {
        "": 1, "b": 1,
        "k": 1024, "kb": 1000, "kib": 1024,
        "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
        "g": 1 << 30, "gb": 10**9, "gib": 1 << 30,
        "t": 1 << 40, "tb": 10**12, "tib": 1 << 40,
    }  # fmt: skip
    s = text.strip().lower()
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    num, unit = s[:i], s[i:].strip()
    if not num or unit not in units:
        raise InvalidArgument(f"cannot parse size {text!r} (examples: 65536, 256KiB, 2MiB, 1GiB)")
    try:
        value = float(num)
    except ValueError:
        raise InvalidArgument(f"cannot parse size {text!r}") from None
    n = int(value * units[unit])
    if n <= 0:
        raise InvalidArgument(f"size must be > 0, got {text!r}")
    return n
