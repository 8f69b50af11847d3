"""The CUDA path under the real runtime's semantics, as the fake runtime
models them (csrc/tests/fake_cudart.cc): one test per defect a GPU would
show on its first requests, each failing on the code before its fix.

- the legacy default stream (torch's default: handle 0) is waited for by
  stores and loads, which run on non-blocking streams;
- two transfers over one pool share its page-locked registration;
- a slot is never split between two registrations;
- the KV cache must be device memory of the copier's GPU, every
  descriptor's device side inside it, and a sticky error ends every later
  job with a clear message;
- engine workers act on the copier's device, never on GPU 0 by default.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import time

import kvtier
import numpy as np
import pytest
import torch
from kvtier.engine import Engine
from kvtier.pool import HostPool
from kvtier.transfer import DeviceTransfer

NB = 16


def finish(t: DeviceTransfer, ids: list[int]) -> dict[int, object]:
    t.wait(ids)
    got: dict[int, object] = {}
    deadline = time.monotonic() + 10
    while len(got) < len(ids) and time.monotonic() < deadline:
        for r in t.get_finished():
            got[r.job_id] = r
        time.sleep(0.001)
    assert set(got) == set(ids)
    return got


@pytest.fixture
def fake(fake_cudart):  # type: ignore[no-untyped-def]
    fake_cudart.fake_cuda_set_delay_us(0)
    fake_cudart.fake_cuda_set_store_delay_us(0)
    fake_cudart.fake_cuda_fail_copies(0, 0)
    fake_cudart.fake_cuda_fail_queries(0, 0)
    assert fake_cudart.fake_cuda_sticky_error() == 0
    yield fake_cudart


def test_a_store_waits_for_work_queued_on_the_default_stream(fake) -> None:  # type: ignore[no-untyped-def]
    # The forward pass on torch's default stream (handle 0) has yet to write
    # block 5: the store must copy what it writes, not what was there.
    kv = [torch.zeros(NB, 4096, dtype=torch.uint8)]
    fake.on_gpu(*kv)
    with HostPool(4, 4096) as pool:
        t = DeviceTransfer(kv, pool, backend="cuda")
        fake.fake_cuda_stream_sleep_us(None, 50_000)
        fake.fake_cuda_stream_fill(None, kv[0][5].data_ptr(), 0x77, 4096)
        assert t.submit_store(1, [5], [0])  # stream: torch's current, i.e. 0 here
        assert finish(t, [1])[1].success  # type: ignore[attr-defined]
        assert (pool.view(0) == 0x77).all()
        t.shutdown()


def test_a_load_waits_for_reads_queued_on_the_default_stream(fake) -> None:  # type: ignore[no-untyped-def]
    # A kernel queued on the default stream still reads block 5 (into `seen`):
    # a load into block 5 must not overwrite it before that read.
    kv = [torch.full((NB, 4096), 0x11, dtype=torch.uint8)]
    seen = np.zeros(4096, np.uint8)
    fake.on_gpu(*kv, seen)
    with HostPool(4, 4096) as pool:
        t = DeviceTransfer(kv, pool, backend="cuda")
        pool.view(2)[:] = 0x99
        fake.fake_cuda_stream_sleep_us(None, 50_000)
        fake.fake_cuda_stream_read(None, seen.ctypes.data, kv[0][5].data_ptr(), 4096)
        assert t.submit_load(1, [2], [5])
        assert finish(t, [1])[1].success  # type: ignore[attr-defined]
        assert (seen == 0x11).all(), "the load overwrote a block a queued kernel still read"
        assert (kv[0][5] == 0x99).all()
        t.shutdown()


def test_two_transfers_over_one_pool_share_its_registration(fake) -> None:  # type: ignore[no-untyped-def]
    # vLLM makes one transfer per KV-cache group over one pool (sliding
    # window, hybrid models): the runtime refuses to register memory twice.
    a = [torch.randint(0, 256, (NB, 4096), dtype=torch.uint8)]
    b = [torch.randint(0, 256, (NB, 2048), dtype=torch.uint8)]
    fake.on_gpu(*a, *b)
    gc.collect()
    regs, registered = fake.fake_cuda_registrations(), fake.fake_cuda_registered_bytes()
    with HostPool(8, 8192) as pool:
        ta = DeviceTransfer(a, pool, backend="cuda")
        tb = DeviceTransfer(b, pool, backend="cuda", slot_offset=4096)
        assert fake.fake_cuda_registrations() == regs + 1
        assert fake.fake_cuda_registered_bytes() == registered + pool.nbytes
        assert tb.stats()["shared_registrations"] == 1
        assert ta.submit_store(1, [3], [0]) and tb.submit_store(1, [4], [0])
        finish(ta, [1]), finish(tb, [1])
        assert bytes(pool.view(0)[:4096]) == a[0][3].numpy().tobytes()
        assert bytes(pool.view(0)[4096:6144]) == b[0][4].numpy().tobytes()
        ta.shutdown()
        del ta
        gc.collect()
        # The other transfer's copies still run on page-locked memory.
        assert fake.fake_cuda_registrations() == regs + 1
        pageable = fake.fake_cuda_pageable_copies()
        assert tb.submit_load(2, [0], [9])
        assert finish(tb, [2])[2].success  # type: ignore[attr-defined]
        assert fake.fake_cuda_pageable_copies() == pageable
        assert torch.equal(b[0][9], b[0][4])
        tb.shutdown()
        del tb
        gc.collect()
    assert fake.fake_cuda_registrations() == regs
    assert fake.fake_cuda_registered_bytes() == registered


def test_a_slot_across_the_first_gibibyte_of_the_pool_copies(fake) -> None:  # type: ignore[no-untyped-def]
    # A disk tier's slot is its cell plus a 4 KiB trailer: slot 1020 of these
    # runs across byte 1 GiB of the pool, where a registration in 1 GiB chunks
    # split it (the runtime fails such a copy with invalid argument).
    slot = (1 << 20) + 4096
    kv = [torch.randint(0, 256, (2, slot), dtype=torch.uint8)]
    fake.on_gpu(*kv)
    with HostPool(1024, slot) as pool:
        k = (1 << 30) // slot
        assert (
            pool.slot_address(k) - pool.address < 1 << 30 < pool.slot_address(k + 1) - pool.address
        )
        t = DeviceTransfer(kv, pool, backend="cuda")
        assert t.submit_store(1, [0], [k])
        assert finish(t, [1])[1].success  # type: ignore[attr-defined]
        assert t.submit_load(2, [k], [1])
        assert finish(t, [2])[2].success  # type: ignore[attr-defined]
        assert torch.equal(kv[0][1], kv[0][0])
        t.shutdown()


def test_the_kv_cache_must_be_device_memory_of_the_copiers_gpu(fake) -> None:  # type: ignore[no-untyped-def]
    # With cudaMemcpyDefault the runtime takes a host address on the device
    # side for a host-to-host copy: a CPU tensor handed over by mistake would
    # be "offloaded" without a word. It is refused where the transfer is made.
    kv = [torch.zeros(NB, 4096, dtype=torch.uint8)]
    with HostPool(4, 4096) as pool:
        with pytest.raises(kvtier.InvalidArgument, match="unregistered host memory, not device"):
            DeviceTransfer(kv, pool, backend="cuda")
        fake.on_gpu(*kv, device=0)
        t = DeviceTransfer(kv, pool, backend="cuda")
        t.shutdown()


def test_a_device_address_outside_the_kv_cache_is_refused_at_submit(fake) -> None:  # type: ignore[no-untyped-def]
    from kvtier import _native

    kv = np.zeros((NB, 4096), np.uint8)
    stray = np.zeros(4096, np.uint8)  # device memory, but not the KV cache's
    fake.on_gpu(kv, stray)
    with HostPool(4, 4096) as pool:
        engine = Engine(1, [(1 << 30, True)])
        engine.register_pool(pool)
        copier = _native.CudaCopier(0, [(pool.address, pool.nbytes)], [(kv.ctypes.data, kv.nbytes)])
        bad = np.array([[stray.ctypes.data, pool.slot_address(0), 4096]], np.int64)
        with pytest.raises(kvtier.InvalidArgument, match="device range outside the KV cache"):
            engine.submit_cuda(copier, 0, bad)
        past = np.array([[kv.ctypes.data + kv.nbytes - 2048, pool.slot_address(0), 4096]], np.int64)
        with pytest.raises(kvtier.InvalidArgument, match="device range outside the KV cache"):
            engine.submit_cuda(copier, 0, past)
        engine.close()


def _child(fake_path: str, body: str) -> list[str]:
    """Runs ``body`` in a child on the fake runtime (``fake``: the library,
    ``gpu(array, device)`` declares device memory); its printed lines."""
    code = textwrap.dedent(
        """
        import ctypes, gc, os, time
        import numpy as np
        from kvtier.pool import HostPool
        from kvtier.transfer import DeviceTransfer
        fake = ctypes.CDLL(os.environ["KVTIER_CUDART"])
        fake.fake_cuda_declare_device.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fake.fake_cuda_has_context.restype = ctypes.c_bool
        def gpu(a, device=0):
            fake.fake_cuda_declare_device(a.ctypes.data, a.nbytes, device)
        def done(t, ids):
            t.wait(ids)
            got = {}
            while len(got) < len(ids):
                got.update((r.job_id, r) for r in t.get_finished())
            return got
        """
    ) + textwrap.dedent(body)
    env = {**os.environ, "KVTIER_CUDART": fake_path}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_sticky_error_fails_every_later_job_and_is_reported(fake) -> None:  # type: ignore[no-untyped-def]
    # An illegal address (700) poisons the process's context: later jobs must
    # fail, at once and saying so, and the process must still report it.
    lines = _child(
        fake.fake_path,
        """
        kv = np.zeros((8, 4096), np.uint8); gpu(kv)
        pool = HostPool(4, 4096)
        t = DeviceTransfer([kv], pool, backend="cuda")
        assert done(t, [1] if t.submit_store(1, [0], [0]) else [])[1].success
        fake.fake_cuda_fail_queries(1, 700)
        t.submit_load(2, [0], [3])
        print(done(t, [2])[2].error)
        t.submit_load(3, [0], [4])
        r = done(t, [3])[3]
        print(r.success, r.error)
        print(t.stats()["sticky_error"])
        t.shutdown()
        print("reported")
        """,
    )
    assert "illegal memory access" in lines[0] and "sticky" in lines[0], lines
    assert lines[1].startswith("False the CUDA context was lost"), lines
    assert lines[2:] == ["700", "reported"], lines


def test_engine_workers_act_on_the_copiers_device_not_gpu_0(fake) -> None:  # type: ignore[no-untyped-def]
    # A rank on GPU 1: the thread that makes the transfer has chosen GPU 1
    # (as torch.cuda.set_device does); the engine's workers, which query and
    # time events, must choose it too, or the runtime makes GPU 0 current on
    # them and creates a context there (memory every rank would pay on GPU 0).
    lines = _child(
        fake.fake_path,
        """
        fake.fake_cuda_set_device_count(2)
        assert fake.cudaSetDevice(1) == 0
        kv = np.arange(8 * 4096, dtype=np.uint32).astype(np.uint8).reshape(8, 4096); gpu(kv, 1)
        pool = HostPool(4, 4096)
        t = DeviceTransfer([kv], pool, backend="cuda", device=1)
        t.submit_store(1, [3], [0]); t.submit_load(2, [0], [6])
        res = done(t, [1, 2])
        t.shutdown(); del t; gc.collect()
        print(all(r.success for r in res.values()), bool((kv[6] == kv[3]).all()))
        print(fake.fake_cuda_has_context(0), fake.fake_cuda_has_context(1))
        """,
    )
    assert lines == ["True True", "False True"], lines


def test_the_fake_models_the_legacy_stream_and_registrations(fake) -> None:  # type: ignore[no-untyped-def]
    # The fake itself: a blocking stream waits for the legacy stream, a
    # non-blocking one does not; a second registration of memory fails as
    # the runtime's does; an event cannot be recorded on another device's stream.
    f = fake
    blocking, free = ctypes.c_void_p(), ctypes.c_void_p()
    assert f.cudaStreamCreateWithFlags(ctypes.byref(blocking), 0) == 0
    assert f.cudaStreamCreateWithFlags(ctypes.byref(free), 1) == 0
    a = np.zeros(64, np.uint8)
    f.fake_cuda_stream_sleep_us(None, 100_000)
    f.fake_cuda_stream_fill(None, a.ctypes.data, 1, 64)
    f.fake_cuda_stream_fill(free, a.ctypes.data + 32, 3, 32)  # runs at once
    f.fake_cuda_stream_fill(blocking, a.ctypes.data, 2, 16)  # runs after the legacy work
    time.sleep(0.03)
    assert a[32] == 3 and a[0] == 0
    deadline = time.monotonic() + 5
    while a[0] != 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert a[0] == 2 and a[16] == 1 and a[40] == 1
    buf = np.zeros(8192, np.uint8)
    f.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    f.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    assert f.cudaHostRegister(buf.ctypes.data, 8192, 0) == 0
    assert f.cudaHostRegister(buf.ctypes.data + 4096, 4096, 0) == 712
    assert f.cudaHostUnregister(buf.ctypes.data) == 0
    f.cudaStreamDestroy(blocking)
    f.cudaStreamDestroy(free)


def test_the_runtime_is_found_in_pips_nvidia_packages(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # pip's CUDA wheels keep libcudart off the loader's path: a process that
    # has not imported torch finds it through this list (13 before 12).
    from kvtier.worker import cuda_runtime

    for rel in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12"):
        (tmp_path / rel).parent.mkdir(parents=True)
        (tmp_path / rel).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    got = [p for p in cuda_runtime.search_paths() if p.startswith(str(tmp_path))]
    assert got == [
        str(tmp_path / "nvidia/cu13/lib/libcudart.so.13"),
        str(tmp_path / "nvidia/cuda_runtime/lib/libcudart.so.12"),
    ]


def test_doctor_reports_the_runtime_and_each_gpu(fake) -> None:  # type: ignore[no-untyped-def]
    import json

    env = {**os.environ, "KVTIER_CUDART": fake.fake_path}
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "doctor", "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    cuda = json.loads(out.stdout.splitlines()[-1])["cuda"]
    assert cuda["ok"] and cuda["runtime"] == fake.fake_path and cuda["found"] == "KVTIER_CUDART"
    assert cuda["version"] == 13000
    assert cuda["gpus"] == [
        {
            "index": 0,
            "name": "Fake GPU 0",
            "pci_bus_id": "0000:01:00.0",
            "registered_host_pointer_usable": True,
        }
    ]


def test_gpu_check_script_parses_and_names_its_outputs() -> None:
    # `make gpu-check` runs on the GPU machine only; here: it parses, and the
    # files it promises are the ones it writes (at most 8 come back).
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    written = {
        "build.log",
        "tests.log",
        "doctor.json",
        "bench.json",
        "bench.log",
        "node_cost.json",
        "small_pages.jsonl",
        "gpu-check.json",
    }
    for name in written:
        assert name in text, name
    assert len(written) <= 8
