"""What kvtier costs beside its copies, for ``kvtier bench copy --device
cuda`` (:mod:`kvtier.bench.device_cuda`): creating and page-locking a host
pool against torch's pinned allocation, and how much a decode-like matmul
loop slows while kvtier's copies, or torch's, run beside it ("do no harm").

A command-line tool's module: runs in the ``kvtier`` process, torch with a
CUDA GPU there (:func:`kvtier.bench.device_cuda.require_cuda` checked it).
Who calls: :func:`kvtier.bench.device_cuda_run.run_device_cuda`. Everything here
blocks; each function returns its rows in the order measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.bench.device_cuda import GIB, Case, Settings, Staging, blocks_per_run, median, shape_of

STEP_MATMULS = 32  # matmuls per decode-like step: about 0.4 ms on an H100


def _empty_host_cache(torch: Any) -> bool:
    """Hand torch's cached pinned blocks back (else a second allocation of a
    size is served from its cache and costs nothing). False if torch has no way."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):  # older, newer torch
        fn = getattr(torch._C, name, None)
        if fn is not None:
            torch.cuda.synchronize()  # a block still in a copy's use stays cached
            fn()
            return True
    return False


def pool_setup(torch: Any, s: Settings, shm_free: int) -> list[dict[str, Any]]:
    """Seconds per GiB to create (map and pre-fault) a host pool and to
    page-lock it (DeviceTransfer's construction registers it), against
    torch.empty(pin_memory=True) of the same size. Blocks."""
    from kvtier.pool import HostPool
    from kvtier.worker.transfer import DeviceTransfer

    slot = 2 << 20
    tiny = torch.empty((1, 4096), dtype=torch.uint8, device="cuda")
    with HostPool(4, slot) as p:  # warm-up: the runtime, streams, threads
        DeviceTransfer([tiny], p).shutdown()
    rows: list[dict[str, Any]] = []
    for size in s.pool_sizes:
        row: dict[str, Any] = {"measure": "pool_setup", "bytes": size}
        if size > shm_free * 0.9:
            rows.append({**row, "skipped": f"/dev/shm has {shm_free >> 20} MiB free"})
            continue
        create, register, pinned = [], [], []
        emptied = True
        for _ in range(s.pool_repeats):
            t0 = time.perf_counter()
            pool = HostPool(size // slot, slot)
            t1 = time.perf_counter()
            t = DeviceTransfer([tiny], pool)
            t2 = time.perf_counter()
            t.shutdown()
            pool.close()
            del pool
            emptied = _empty_host_cache(torch) and emptied
            t3 = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            t4 = time.perf_counter()
            del x
            _empty_host_cache(torch)
            create.append(t1 - t0)
            register.append(t2 - t1)
            pinned.append(t4 - t3)
        gib = size / GIB
        ours = (median(create) + median(register)) / gib
        theirs = median(pinned) / gib
        rows.append(
            {
                **row,
                "pool_create_s_per_gib": round(median(create) / gib, 4),
                "register_s_per_gib": round(median(register) / gib, 4),
                "kvtier_s_per_gib": round(ours, 4),
                "torch_pinned_s_per_gib": round(theirs, 4),
                "ratio_to_torch_pinned": round(ours / theirs, 3),
                "repeats": s.pool_repeats,
                "torch_cache_emptied": emptied,
            }
        )
    return rows


class _Traffic(threading.Thread):
    """Runs ``fn`` (then ``sync``) over and over on this device until
    stopped, counting the bytes moved: copies at full speed beside the
    matmul loop."""

    def __init__(
        self, torch: Any, fn: Callable[[], None], sync: Callable[[], None], moved: int
    ) -> None:
        super().__init__(daemon=True)
        self.torch, self.fn, self.sync, self.per_run = torch, fn, sync, moved
        self.device = torch.cuda.current_device()
        self.stop, self.ready = threading.Event(), threading.Event()
        self.moved = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.torch.cuda.set_device(self.device)  # a new thread's device is 0
            while not self.stop.is_set():
                self.fn()
                self.sync()
                self.moved += self.per_run
                self.ready.set()
        except BaseException as e:  # re-raised by the main thread
            self.error = e
            self.ready.set()


def do_no_harm(torch: Any, s: Settings, st: Staging, host_budget: int) -> list[dict[str, Any]]:
    """How much slower a decode-like step (a CUDA graph of STEP_MATMULS
    bf16 matmuls, (256 x 4096) @ (4096 x 4096), on a stream of its own) runs
    while kvtier stores and loads at full speed in another thread, and while
    torch's gather does, against the step alone (the window before). The
    slowdown counts what this process's host side adds too. Blocks."""
    from kvtier.pool import HostPool

    shape = shape_of("per_layer", min(s.tokens), s.model)
    n = blocks_per_run(shape.block_bytes, min(s.bytes_per_run, 512 << 20), host_budget)
    a = torch.randn(256, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    cs = torch.cuda.Stream()
    with torch.cuda.stream(cs):
        for _ in range(3):
            a @ w
    cs.synchronize()
    graph: Any = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _outputs = [a @ w for _ in range(STEP_MATMULS)]  # allocated in the graph's pool
    except RuntimeError:
        graph = None  # eager launches instead: the host side then counts more

    def step() -> None:
        if graph is not None:
            graph.replay()
        else:
            for _ in range(STEP_MATMULS):
                a @ w

    def seconds_per_step(k: int) -> float:
        # At most ~20 steps queued: the host waits (GIL released) on events.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks: list[Any] = []
        with torch.cuda.stream(cs):
            start.record(cs)
            for i in range(k):
                step()
                if i % 4 == 3:
                    marks.append(torch.cuda.Event())
                    marks[-1].record(cs)
                    if len(marks) > 4:
                        marks.pop(0).synchronize()
            end.record(cs)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / k

    seconds_per_step(10)
    k = max(20, int(s.harm_seconds / seconds_per_step(20)))
    with HostPool(2 * n, shape.block_bytes) as pool:
        case = Case(torch, shape, n, pool, st, s, batched_only=True)
        try:
            loads: dict[str, tuple[Callable[[], None], Callable[[], None], int]] = {}
            fn, moved = case.contender("kvtier_batched", "both")
            loads["kvtier_batched"] = (fn, lambda: None, moved)  # its wait ends the run

            def streams() -> None:
                st.out_stream.synchronize()
                st.in_stream.synchronize()

            fn, moved = case.contender("torch_gather", "both")
            loads["torch_gather"] = (fn, streams, moved)
            alone: list[float] = []
            busy: dict[str, list[float]] = {c: [] for c in loads}
            gbps: dict[str, list[float]] = {c: [] for c in loads}
            for _ in range(s.harm_rounds):
                alone.append(seconds_per_step(k))
                for c, (fn, sync, moved) in loads.items():
                    traffic = _Traffic(torch, fn, sync, moved)
                    traffic.start()
                    traffic.ready.wait(120)
                    m0, t0 = traffic.moved, time.perf_counter()
                    busy[c].append(seconds_per_step(k))
                    m1, t1 = traffic.moved, time.perf_counter()
                    traffic.stop.set()
                    traffic.join()
                    if traffic.error is not None:
                        raise traffic.error
                    gbps[c].append((m1 - m0) / (t1 - t0) / 1e9)
                    torch.cuda.synchronize()
        finally:
            case.close()
    base = median(alone)
    slow = {c: median(busy[c]) / base for c in loads}
    return [
        {
            "measure": "do_no_harm",
            "contender": c,
            "direction": "both",
            "step": f"{'CUDA graph' if graph is not None else 'eager launches'} of {STEP_MATMULS} "
            "bf16 matmuls (256 x 4096) @ (4096 x 4096)",
            "step_ms_alone": round(base * 1e3, 4),
            "step_ms_busy": round(median(busy[c]) * 1e3, 4),
            "slowdown": round(slow[c], 4),
            "slowdown_vs_torch_gather": round(slow[c] / slow["torch_gather"], 4),
            "copy_gbps_meanwhile": round(median(gbps[c]), 3),
            "layout": shape.layout,
            "tokens_per_block": shape.tokens,
            "steps_per_window": k,
            "rounds": s.harm_rounds,
        }
        for c in loads
    ]
