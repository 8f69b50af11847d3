"""Does DeviceTransfer's submit block behind work queued on torch's streams?

Run on a GPU with the package importable (``PYTHONPATH=build/gpu-check/pkg``).
It prints one JSON line per case: how long the GPU sleep, an optional
``index_select`` and kvtier's submit held the host, and whether the stream
was still busy afterwards. Cases are batched or per copy, on the default
stream with or without a torch stream context or on a side stream, as a
load, a load after an ``index_select``, a store, or nothing. It wrote
lazy-loading-h200-20261204.log beside it. Only the process's first
``index_select`` blocked: CUDA loaded that kernel at its first launch.
"""

import contextlib
import json
import time

import torch
from kvtier.pool import HostPool
from kvtier.worker.transfer import DeviceTransfer

NB, PAGE, SLEEP = 48, 64 * 1024, 300_000_000


def wait_all(t: DeviceTransfer, ids: list[int]) -> None:
    t.wait(ids, 30)
    got: set[int] = set()
    for _ in range(3000):
        for r in t.get_finished():
            assert r.success, r.error
            got.add(r.job_id)
        if got >= set(ids):
            return
        time.sleep(0.001)


def main() -> None:
    kv = torch.randint(0, 256, (NB, PAGE), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    idx = torch.tensor([3, 9, 20], device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(SLEEP)
    e.record()
    torch.cuda.synchronize()
    print("sleep_ms", round(s.elapsed_time(e), 1), flush=True)
    for use_batch in (True, False):
        with HostPool(16, PAGE) as pool:
            t = DeviceTransfer([kv], pool, use_batch=use_batch)
            j = 1000
            assert t.submit_store(j, [0], [15])
            wait_all(t, [j])
            assert t.submit_load(j + 1, [15], [0])
            wait_all(t, [j + 1])
            j += 2
            torch.cuda.synchronize()
            for trial in range(3):
                for where in ("default_ctx", "default_noctx", "side_ctx"):
                    for op in ("load_select", "load", "store", "none"):
                        side = where == "side_ctx"
                        stream = torch.cuda.Stream() if side else torch.cuda.default_stream()
                        ctx = (
                            contextlib.nullcontext()
                            if where == "default_noctx"
                            else torch.cuda.stream(stream)
                        )
                        with ctx:
                            t0 = time.perf_counter()
                            torch.cuda._sleep(SLEEP)
                            t1 = time.perf_counter()
                            if op == "load_select":
                                kv.index_select(0, idx)
                            t2 = time.perf_counter()
                            if op.startswith("load"):
                                assert t.submit_load(j, [0, 1, 2], [3, 9, 20])
                            elif op == "store":
                                assert t.submit_store(j, [3, 9, 20], [0, 1, 2])
                            t3 = time.perf_counter()
                        busy = not stream.query()
                        t4 = time.perf_counter()
                        if op != "none":
                            wait_all(t, [j])
                        j += 1
                        torch.cuda.synchronize()
                        row = {
                            "batch": use_batch, "trial": trial, "where": where, "op": op,
                            "busy": busy, "sleep_ms": round((t1 - t0) * 1e3, 2),
                            "select_ms": round((t2 - t1) * 1e3, 2),
                            "submit_ms": round((t3 - t2) * 1e3, 2),
                            "query_ms": round((t4 - t3) * 1e3, 2),
                        }  # fmt: skip
                        print(json.dumps(row), flush=True)
            t.shutdown()


if __name__ == "__main__":
    main()
