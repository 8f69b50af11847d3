"""The CUDA copier on the fake runtime: nothing leaks when its constructor
fails at any step, the host side of every copy is checked against the
registered pool, and a wait honours its timeout."""

from __future__ import annotations

import ctypes
import gc
import time

import kvtier
import numpy as np
import pytest
from kvtier import _native
from kvtier.pool import HostPool


@pytest.fixture
def fake(fake_cudart):  # type: ignore[no-untyped-def]
    fake_cudart.fake_cuda_live_objects.restype = ctypes.c_long
    fake_cudart.fake_cuda_set_delay_us(0)
    fake_cudart.fake_cuda_fail_copies(0, 0)
    fake_cudart.fake_cuda_fail_queries(0, 0)
    yield fake_cudart
    fake_cudart.fake_cuda_fail_setup(0)
    fake_cudart.fake_cuda_set_delay_us(0)


def test_a_constructor_failing_at_every_step_leaks_nothing(fake) -> None:  # type: ignore[no-untyped-def]
    with HostPool(8, 4096) as pool:
        half = pool.nbytes // 2
        regions = [(pool.address, half), (pool.address + half, half)]
        gc.collect()
        live, registered = fake.fake_cuda_live_objects(), fake.fake_cuda_registered_bytes()
        # set device, 3 streams, 1 event, 2 registrations: 7 steps that can fail
        failures = 0
        for step in range(1, 20):
            fake.fake_cuda_fail_setup(step)
            try:
                copier = _native.CudaCopier(0, regions, True)
            except kvtier.CudaError:
                failures += 1
                assert fake.fake_cuda_live_objects() == live, f"leak after failing step {step}"
                assert fake.fake_cuda_registered_bytes() == registered
                continue
            fake.fake_cuda_fail_setup(0)
            assert fake.fake_cuda_registered_bytes() == registered + pool.nbytes
            del copier
            gc.collect()
            break
        assert failures == 7
        assert fake.fake_cuda_live_objects() == live
        assert fake.fake_cuda_registered_bytes() == registered


def test_jobs_release_their_events_and_a_failed_event_leaks_nothing(fake) -> None:  # type: ignore[no-untyped-def]
    dev = np.zeros(4 * 4096, np.uint8)
    with HostPool(4, 4096) as pool:
        gc.collect()
        live = fake.fake_cuda_live_objects()
        copier = _native.CudaCopier(0, [(pool.address, pool.nbytes)], True)
        d = np.array([[dev.ctypes.data, pool.slot_address(0), 4096]], np.int64)
        fake.fake_cuda_fail_setup(2)  # the job's end event cannot be created
        with pytest.raises(kvtier.CudaError):
            copier.submit(0, d)
        fake.fake_cuda_fail_setup(0)
        ids = [copier.submit(0, d) for _ in range(3)]
        copier.wait(ids, 5.0)
        assert sorted(r.job_id for r in copier.poll()) == ids
        del copier
        gc.collect()
        assert fake.fake_cuda_live_objects() == live


def test_the_host_side_must_lie_in_the_registered_pool(fake) -> None:  # type: ignore[no-untyped-def]
    dev = np.zeros(2 * 4096, np.uint8)
    with HostPool(2, 4096) as pool:
        copier = _native.CudaCopier(0, [(pool.address, pool.nbytes)], True)
        store = np.array([[dev.ctypes.data, pool.slot_address(1) + 1, 4096]], np.int64)
        with pytest.raises(kvtier.InvalidArgument, match="outside the registered pool"):
            copier.submit(0, store)  # a store writes past the pool's end
        load = np.array([[dev.ctypes.data, pool.slot_address(0), 4096]], np.int64)
        with pytest.raises(kvtier.InvalidArgument, match="outside the registered pool"):
            copier.submit(1, load)  # a load reads host memory: here the "device" array
        ok = copier.submit(1, np.array([[pool.slot_address(0), dev.ctypes.data, 4096]], np.int64))
        copier.wait([ok], 5.0)
        del copier


def test_wait_honours_its_timeout(fake) -> None:  # type: ignore[no-untyped-def]
    dev = np.zeros(4096, np.uint8)
    with HostPool(2, 4096) as pool:
        copier = _native.CudaCopier(0, [(pool.address, pool.nbytes)], True)
        fake.fake_cuda_set_delay_us(500_000)
        job = copier.submit(0, np.array([[dev.ctypes.data, pool.slot_address(0), 4096]], np.int64))
        t0 = time.monotonic()
        with pytest.raises(kvtier.Timeout):
            copier.wait([job], 0.05)
        assert time.monotonic() - t0 < 0.4
        fake.fake_cuda_set_delay_us(0)
        copier.wait([job], 5.0)
        assert [r.ok for r in copier.poll()] == [True]
        del copier
