"""Shared benchmark machinery: repetition and medians, machine facts, result files.

Who calls: the ``kvtier bench`` subcommands. Everything here blocks.

A command-line tool's module: runs in the ``kvtier`` process.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def print_json_last(obj: dict[str, Any]) -> None:
    """Print ``obj`` as one JSON line: always the last line of a command's
    output (scripts parse it)."""
    print(json.dumps(obj, sort_keys=False))


def freeze_heap_as_engines_do() -> None:
    """Collect, then freeze every object alive now out of the garbage
    collector's reach, as vLLM's engine core does once started
    (``freeze_gc_heap``, vllm/v1/engine/core.py) and ``kvtier node`` does:
    a scheduler's full collections then walk only what it allocated since,
    not torch's and vLLM's modules. Without it a manager bench that imports
    vLLM measures the collector: kvtier's cycle 29.8k/s and vLLM's 43.5k/s
    (0.68x) against 55.2k and 46.9k (1.18x) frozen (5 runs, 60,000 keys).
    Who calls: the manager benches, before timing anything."""
    gc.collect()
    gc.freeze()


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) a process has used so far:
    this one when ``pid`` is None, else a child's from /proc (Linux). Who
    calls: benches that split a run's cost between processes (the node's
    and its client's). Raises OSError when the process is gone."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


PAIRED = "median over repeats of kvtier / baseline, each repeat running both"


def paired_ratio(ours: list[float], base: list[float]) -> float:
    """Median of ``ours[i] / base[i]``: each repeat runs kvtier and then the
    baseline, so pairing them keeps this machine's slow drift (the
    hypervisor's steal, the virtual disk's cache) out of the ratio."""
    return round(statistics.median(o / b for o, b in zip(ours, base, strict=True)), 3)


class TierDriver:
    """Keeps a kvtier lower tier's queue full (``depth`` batches in flight)
    while keys move between it and the attached pool, one :meth:`step` at a
    time, so a caller can interleave the driving with its own work the way an
    engine polls once per scheduler step. Slots are used round-robin.

    Who calls: :func:`drive_tier` and the GIL probe. ``step`` never blocks;
    it raises RuntimeError if any key fails."""

    def __init__(self, tier: Any, batch: int, depth: int = 4) -> None:
        self.tier, self.batch, self.depth = tier, batch, depth
        self.slots = tier.pool.num_slots
        self.keys: list[bytes] = []
        self.store = True
        self.i = self.done = self.inflight = 0
        self.moved = 0  # bytes moved over the driver's life, both directions

    def start(self, store: bool, keys: list[bytes]) -> None:
        """Begin moving ``keys`` (the previous run must be finished)."""
        self.store, self.keys = store, keys
        self.i = self.done = 0

    @property
    def finished(self) -> bool:
        return self.done >= len(self.keys)

    def step(self) -> None:
        for c in self.tier.poll():
            self.inflight -= 1
            self.done += len(c.keys)
            self.moved += len(c.keys) * self.tier.block_bytes
            if not c.ok:
                bad = c.key_ok.count(False) if c.key_ok else "?"
                what = "store" if self.store else "load"
                raise RuntimeError(f"{self.tier.name} {what} failed for {bad} keys")
        n = len(self.keys)
        while self.i < n and self.inflight < self.depth:
            ks = self.keys[self.i : self.i + self.batch]
            sl = [(self.i + j) % self.slots for j in range(len(ks))]
            sub = self.tier.submit_store if self.store else self.tier.submit_load
            if sub(ks, sl) is None:
                break
            self.i += len(ks)
            self.inflight += 1


def drive_tier(
    tier: Any, store: bool, keys: list[bytes], batch: int, poll_s: float = 0.0002
) -> float:
    """Moves every key between ``tier`` and its pool (4 batches in flight),
    polling every ``poll_s``; returns the seconds taken. Blocks; raises
    RuntimeError if any key fails."""
    d = TierDriver(tier, batch)
    d.start(store, keys)
    t0 = time.perf_counter()
    while not d.finished:
        d.step()
        time.sleep(poll_s)
    return time.perf_counter() - t0


def loop_rate(seconds: float, step: Callable[[], None] | None = None, every: float = 0) -> float:
    """Iterations per second of a pure-Python loop; with ``step``, the loop
    calls it every ``every`` seconds (an engine's scheduler doing its own work
    between polls) and the time inside counts against the loop."""
    n = 0
    t = time.perf_counter()
    end, due = t + seconds, t + every
    while t < end:
        if step is not None and t >= due:
            step()
            due = time.perf_counter() + every
        for _ in range(1000):
            n += 1
        t = time.perf_counter()
    return n / seconds


def gil_probe(
    step: Callable[[], None],
    moved: Callable[[], int],
    drain: Callable[[], None],
    interval_s: float,
    rounds: int = 12,
    window_s: float = 0.25,
) -> dict[str, Any]:
    """How fast a pure-Python loop in the calling thread runs while a tier is
    kept busy by ``step`` (one scheduler step of driving: poll, resubmit;
    ``moved`` says how many bytes have moved so far), relative to the loop
    alone measured just before. Two placements of the driving:

    * in the loop's own thread, every ``interval_s`` (how an engine calls the
      tier: from its scheduler thread): the headline
      ``python_loop_speed_while_busy``; whatever the tier's Python side costs
      counts against the loop, and any GIL taken by its worker threads would
      too;
    * in a second Python thread waking every ``interval_s``, beside the floor
      of a thread that only wakes (handing the GIL over costs the loop
      something whatever the other thread does).

    Each round measures the loop alone and then a placement, ``window_s``
    each, and calls ``drain`` (blocks until the tier is quiet) after each
    busy window; short adjacent windows and the median over ``rounds`` keep
    the hypervisor's steal (which slows the loop alone as much as the busy
    one) out of the ratio. Blocks ``5 * window_s`` per round and the drains."""

    def beside(fn: Callable[[], None]) -> float:
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                fn()
                time.sleep(interval_s)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        rate = loop_rate(window_s)
        stop.set()
        th.join()
        return rate

    def rated(fn: Callable[[], float]) -> tuple[float, float]:
        m0, t0 = moved(), time.perf_counter()
        rate = fn()
        return rate, (moved() - m0) / (time.perf_counter() - t0) / 1e9

    inline, thread, floors, gbps_in, gbps_th = [], [], [], [], []
    for _ in range(rounds):
        idle = loop_rate(window_s)
        busy, g = rated(lambda: loop_rate(window_s, step, interval_s))
        drain()
        inline.append(busy / idle)
        gbps_in.append(g)
        idle = loop_rate(window_s)
        busy, g = rated(lambda: beside(step))
        drain()
        thread.append(busy / idle)
        gbps_th.append(g)
        floors.append(beside(lambda: None) / idle)
    med = statistics.median
    return {
        "python_loop_speed_while_busy": round(med(inline), 3),
        "tier_gbps_meanwhile": round(med(gbps_in), 3),
        "runs": [round(r, 3) for r in inline],
        "poll_interval_s": interval_s,
        "driver_in_second_thread": {
            "python_loop_speed_while_busy": round(med(thread), 3),
            "floor_thread_waking_alone": round(med(floors), 3),
            "tier_gbps_meanwhile": round(med(gbps_th), 3),
            "runs": [round(r, 3) for r in thread],
        },
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
    with contextlib.suppress(ValueError, OSError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
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


def save_result(result: dict[str, Any], results_dir: str | Path | None) -> Path | None:
    """Write ``result`` plus machine facts as JSON under ``results_dir``
    (None or '': skip); returns the file's path."""
    if not results_dir:
        return None
    d = Path(results_dir)
    d.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = d / f"{result['component']}-{result.get('block_bytes', 'all')}-{stamp}.json"
    path.write_text(json.dumps({**result, "machine": machine_facts()}, indent=2) + "\n")
    return path


def default_output_dir(name: str) -> Path:
    """Where a benchmark writes when not told: ``build/<name>`` of the source
    tree kvtier runs from (an editable install), else a new temporary
    directory, whose path is printed (to stderr: stdout may carry JSON).
    Never the current directory."""
    import tempfile

    import kvtier

    repo = Path(kvtier.__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists() and (repo / "python" / "kvtier").is_dir():
        return repo / "build" / name
    d = Path(tempfile.mkdtemp(prefix=f"kvtier-{name}-"))
    print(f"kvtier bench: writing to {d}", file=sys.stderr)
    return d


def output_dir(out: str | None, name: str) -> Path | None:
    """The directory a benchmark writes to: ``out`` when given ('' means
    nowhere: None), else :func:`default_output_dir`. Who calls: every
    ``kvtier bench`` component and ``bench/run.py``, so none writes anywhere
    it was not told except under ``build/`` or a printed temporary path."""
    if out is None:
        return default_output_dir(name)
    return Path(out) if out else None
