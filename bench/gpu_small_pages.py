"""What would close the small-page gap of docs/benchmarks/gpu.md? On a GPU
(cupy and libcudart.so.13 there, nothing of kvtier's build needed):
``python3 bench/gpu_small_pages.py`` (`make gpu-check` runs it), about 2 minutes at most.

Pages of 18, 32 and 64 KiB (MLA and K/V split at 16 tokens a block, and
one size up), 32 layers, 512 blocks to random slots of registered host
memory, each way. It compares cudaMemcpyBatchAsync with kvtier's
attributes against the same call with location hints, the overlap flag
and any-order access; an SM copy kernel over the host memory mapped into
the GPU, at several grid sizes (its descriptors' upload counted), with
its bytes checked; and one contiguous copy (the ceiling). Each figure is
the median GB/s of 5 runs, from GPU events. It writes JSON lines to
stdout and to $OUT/small_pages.jsonl.

Written on 4 December 2026, after the first gpu-check. It has not run
yet: the session's GPU was taken back before it could.
"""

import ctypes
import json
import mmap
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KERNEL = r"""
// One CUDA block copies pages src[c] -> dst[c] for c = blockIdx.x, += gridDim.x,
// in 16-byte loads and stores; one side may be host memory mapped into the GPU.
extern "C" __global__ void page_copy(const unsigned long long* __restrict__ src,
                                     const unsigned long long* __restrict__ dst, int n, int page16) {
  for (int c = blockIdx.x; c < n; c += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(src[c]);
    uint4* d = reinterpret_cast<uint4*>(dst[c]);
    for (int i = threadIdx.x; i < page16; i += blockDim.x) d[i] = s[i];
  }
}
"""
LAYERS, NB_GPU, MOVED, SLOTS, REPEATS = 32, 1024, 512, 512, 5
PAGES = (18432, 32768, 65536)
GRIDS = (16, 32, 66, 132, 264, 1056)
BUDGET_S = 110.0  # gpu_check.sh gives it 150 s; checked between page sizes and ways
HOST, DEVICE = 2, 1  # cudaMemLocationType
ORDER_STREAM, ORDER_ANY = 1, 3  # cudaMemcpySrcAccessOrder


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attr(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("src", Loc), ("dst", Loc), ("flags", ctypes.c_uint)]


def runtime() -> Any:
    rt = ctypes.CDLL("libcudart.so.13")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    rt.cudaMemcpyBatchAsync.argtypes = [vp, vp, vp, sz, ctypes.POINTER(Attr),
                                        ctypes.POINTER(sz), sz, vp]  # fmt: skip
    rt.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
    rt.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [vp]
    rt.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_uint]
    return rt


class Probe:
    def __init__(self, out_dir: str) -> None:
        import cupy as cp

        self.cp, self.rt = cp, runtime()
        self.rt.cudaSetDevice(0)
        cp.cuda.Device(0).use()
        self.kern = cp.RawModule(code=KERNEL).get_function("page_copy")  # NVRTC
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.out = open(os.path.join(out_dir, "small_pages.jsonl"), "w")  # noqa: SIM115
        self.t0 = time.time()

    def emit(self, row: dict[str, Any]) -> None:
        row["t"] = round(time.time() - self.t0, 1)
        line = json.dumps(row)
        print(line, flush=True)
        self.out.write(line + "\n")
        self.out.flush()

    def timed(self, fn: Callable[[], None]) -> float:
        """Median seconds of ``fn``'s work on the probe's stream (GPU events), after a warm run."""
        cp = self.cp
        fn()
        self.stream.synchronize()
        ts = []
        for _ in range(REPEATS):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(self.stream)
            fn()
            b.record(self.stream)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        return statistics.median(ts)

    def batch(self, src: np.ndarray, dst: np.ndarray, size: int, attr: Attr) -> Callable[[], None]:
        n = src.size
        sizes = np.full(n, size, np.uint64)
        idx = ctypes.c_size_t(0)

        def go() -> None:
            e = self.rt.cudaMemcpyBatchAsync(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n,
                                             ctypes.byref(attr), ctypes.byref(idx), 1,
                                             self.stream.ptr)  # fmt: skip
            assert e == 0, f"cudaMemcpyBatchAsync: error {e}"

        return go

    def kernel(
        self, src: np.ndarray, dst: np.ndarray, page: int, grid: int, threads: int
    ) -> Callable[[], None]:
        cp, n = self.cp, src.size

        def go() -> None:
            with self.stream:
                s, d = cp.asarray(src), cp.asarray(dst)  # the descriptors' upload, counted
                self.kern((min(grid, n),), (threads,), (s, d, np.int32(n), np.int32(page // 16)))

        return go

    def page_size(self, page: int) -> None:
        cp, rt = self.cp, self.rt
        slot = LAYERS * page
        hsize = SLOTS * slot
        buf = mmap.mmap(-1, hsize)
        host = np.frombuffer(buf, np.uint8)
        host[:] = 7
        hptr = host.ctypes.data
        assert rt.cudaHostRegister(hptr, hsize, 0x01 | 0x02) == 0, "cudaHostRegister"
        dp = ctypes.c_void_p()
        assert rt.cudaHostGetDevicePointer(ctypes.byref(dp), hptr, 0) == 0
        kv = [cp.zeros((NB_GPU, page), cp.uint8) for _ in range(LAYERS)]
        rng = np.random.default_rng(page)
        slots, blocks = rng.permutation(SLOTS)[:MOVED], rng.permutation(NB_GPU)[:MOVED]
        hoff = np.array([[s * slot + t * page for t in range(LAYERS)] for s in slots], np.uint64)
        dev = np.array(
            [[kv[t].data.ptr + b * page for t in range(LAYERS)] for b in blocks], np.uint64
        )
        hoff, dev = hoff.reshape(-1), dev.reshape(-1)
        h_cpu, h_gpu = hoff + np.uint64(hptr), hoff + np.uint64(dp.value)
        nbytes = hoff.size * page
        try:
            for way in ("h2d", "d2h"):
                src_c, dst_c = (h_cpu, dev) if way == "h2d" else (dev, h_cpu)
                src_g, dst_g = (h_gpu, dev) if way == "h2d" else (dev, h_gpu)
                near, far = (Loc(HOST, 0), Loc(DEVICE, 0))
                s_loc, d_loc = (near, far) if way == "h2d" else (far, near)
                variants = {
                    "batch_kvtier": Attr(ORDER_STREAM, Loc(0, 0), Loc(0, 0), 0),
                    "batch_hints": Attr(ORDER_STREAM, s_loc, d_loc, 0),
                    "batch_hints_overlap": Attr(ORDER_STREAM, s_loc, d_loc, 1),
                    "batch_any_hints": Attr(ORDER_ANY, s_loc, d_loc, 0),
                }
                for name, attr in variants.items():
                    self.measure(page, way, name, nbytes, self.batch(src_c, dst_c, page, attr))
                total = min(nbytes, hsize)
                big = cp.empty(total, cp.uint8)
                a, b = (big.data.ptr, hptr) if way == "h2d" else (hptr, big.data.ptr)

                def one(a: int = a, b: int = b, total: int = total) -> None:
                    assert rt.cudaMemcpyAsync(a, b, total, 4, self.stream.ptr) == 0

                self.measure(page, way, "contiguous", total, one)
                del big
                for grid in GRIDS:
                    for threads in (256, 512):
                        go = self.kernel(src_g, dst_g, page, grid, threads)
                        self.measure(page, way, f"kernel_g{grid}_t{threads}", nbytes, go)
                self.check(page, way, host, kv, slots, blocks, src_g, dst_g)
                if time.time() - self.t0 > BUDGET_S:
                    return
        finally:
            del kv
            cp.get_default_memory_pool().free_all_blocks()
            rt.cudaHostUnregister(hptr)

    def measure(self, page: int, way: str, how: str, nbytes: int, fn: Callable[[], None]) -> None:
        try:
            s = self.timed(fn)
            self.emit({"page": page, "dir": way, "how": how, "gbps": round(nbytes / s / 1e9, 2)})
        except Exception as e:  # one variant's failure is its row, not the run's end
            self.emit({"page": page, "dir": way, "how": how, "error": repr(e)})

    def check(self, page: int, way: str, host: np.ndarray, kv: list[Any], slots: np.ndarray,
              blocks: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:  # fmt: skip
        """The kernel moved the bytes asked for (random bytes on the source side)."""
        cp = self.cp
        try:
            if way == "h2d":
                host[:] = np.frombuffer(np.random.default_rng(1).bytes(host.size), np.uint8)
                for t in kv:
                    t[:] = 0
            else:
                for t in kv:
                    t[:] = cp.random.randint(0, 256, t.shape, dtype=cp.uint8)
                host[:] = 0
            self.kernel(src, dst, page, 132, 256)()
            self.stream.synchronize()
            view = host.reshape(SLOTS, LAYERS, page)
            ok = all(
                np.array_equal(cp.asnumpy(t[cp.asarray(blocks)]), view[slots, i])
                for i, t in enumerate(kv)
            )
            self.emit({"page": page, "dir": way, "how": "kernel_bytes_checked", "ok": bool(ok)})
        except Exception as e:
            self.emit({"page": page, "dir": way, "how": "kernel_bytes_checked", "error": repr(e)})


def main() -> None:
    probe = Probe(os.environ.get("OUT", "."))
    for page in PAGES:
        probe.page_size(page)
        if time.time() - probe.t0 > BUDGET_S:
            probe.emit({"stopped": f"past {BUDGET_S:.0f} s"})
            break


if __name__ == "__main__":
    main()
