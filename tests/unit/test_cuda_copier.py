"""CUDA copies as engine jobs, on the fake runtime: nothing leaks when the
copier's constructor fails at any step, the host side of every copy is
checked against the registered pool and the engine's memory, the engine
gives the ids (shared with its other jobs), its deadlines fail a job with the
timeout status and its waits honour their timeout and Ctrl-C."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import kvtier
import numpy as np
import pytest
from kvtier import _native
from kvtier.engine import Engine
from kvtier.pool import HostPool

STORE, LOAD = 0, 1


@pytest.fixture
def fake(fake_cudart):  # type: ignore[no-untyped-def]
    fake_cudart.fake_cuda_live_objects.restype = ctypes.c_long
    fake_cudart.fake_cuda_set_delay_us(0)
    fake_cudart.fake_cuda_fail_copies(0, 0)
    fake_cudart.fake_cuda_fail_queries(0, 0)
    yield fake_cudart
    fake_cudart.fake_cuda_fail_setup(0)
    fake_cudart.fake_cuda_set_delay_us(0)


@pytest.fixture
def pool() -> Iterator[HostPool]:
    with HostPool(4, 4096) as p:
        yield p


def store_desc(dev: np.ndarray, pool: HostPool, slot: int, offset: int = 0) -> np.ndarray:
    return np.array([[dev.ctypes.data + offset, pool.slot_address(slot), 4096]], np.int64)


def make_copier(fake, pool: HostPool, dev: np.ndarray) -> _native.CudaCopier:  # type: ignore[no-untyped-def]
    """A copier between ``pool`` and ``dev``, an array standing in for the
    KV cache (declared device memory on the fake runtime)."""
    fake.on_gpu(dev)
    return _native.CudaCopier(0, [(pool.address, pool.nbytes)], [(dev.ctypes.data, dev.nbytes)])


def cuda_engine(pool: HostPool, deadline_s: float = 0.0) -> Engine:
    """Two serial queues (store, load) and one for other jobs."""
    e = Engine(3, [(1 << 30, True, deadline_s), (1 << 30, True, deadline_s), (1 << 30, False)])
    e.register_pool(pool)
    return e


def test_a_constructor_failing_at_every_step_leaks_nothing(fake) -> None:  # type: ignore[no-untyped-def]
    with HostPool(8, 4096) as pool:
        half = pool.nbytes // 2
        regions = [(pool.address, half), (pool.address + half, half)]
        dev = np.zeros(4096, np.uint8)
        fake.on_gpu(dev)
        assert fake.cudaSetDevice(0) == 0  # as torch.cuda.set_device: the copier keeps to it
        gc.collect()
        live, registered = fake.fake_cuda_live_objects(), fake.fake_cuda_registered_bytes()
        # 3 streams, 1 event, 2 registrations: 6 steps that can fail
        failures = 0
        for step in range(1, 20):
            fake.fake_cuda_fail_setup(step)
            try:
                copier = _native.CudaCopier(0, regions, [(dev.ctypes.data, dev.nbytes)], True)
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
        assert failures == 6
        assert fake.fake_cuda_live_objects() == live
        assert fake.fake_cuda_registered_bytes() == registered


def test_jobs_give_their_events_back_and_a_failed_event_leaks_nothing(fake, pool) -> None:  # type: ignore[no-untyped-def]
    dev = np.arange(4096, dtype=np.uint8)
    gc.collect()
    live = fake.fake_cuda_live_objects()
    engine = cuda_engine(pool)
    copier = make_copier(fake, pool, dev)
    with_copier = fake.fake_cuda_live_objects()
    d = store_desc(dev, pool, 0)
    fake.fake_cuda_fail_setup(2)  # the job's end event cannot be created
    with pytest.raises(kvtier.CudaError, match="cudaEventCreateWithFlags"):
        engine.submit_cuda(copier, STORE, d, queue=STORE)
    fake.fake_cuda_fail_setup(0)
    assert fake.fake_cuda_live_objects() == with_copier
    for _ in range(3):  # one after the other: each reuses the events the last gave back
        job = engine.submit_cuda(copier, STORE, d, queue=STORE)
        engine.wait([job], 5.0)
        assert [(r.job_id, r.ok, r.nbytes) for r in engine.poll()] == [(job, True, 4096)]
        assert fake.fake_cuda_live_objects() == with_copier + 2
    assert bytes(pool.view(0)) == dev.tobytes()
    engine.close()
    del copier
    gc.collect()
    assert fake.fake_cuda_live_objects() == live


def test_the_host_side_must_lie_in_the_pool_and_the_engines_memory(fake, pool) -> None:  # type: ignore[no-untyped-def]
    dev = np.zeros(2 * 4096, np.uint8)
    engine = cuda_engine(pool)
    copier = make_copier(fake, pool, dev)
    past_end = np.array([[dev.ctypes.data, pool.slot_address(3) + 1, 4096]], np.int64)
    with pytest.raises(kvtier.InvalidArgument, match="outside the registered pool"):
        engine.submit_cuda(copier, STORE, past_end)  # a store writes past the pool's end
    load = np.array([[dev.ctypes.data, pool.slot_address(0), 4096]], np.int64)
    with pytest.raises(kvtier.InvalidArgument, match="outside the registered pool"):
        engine.submit_cuda(copier, LOAD, load)  # a load reads host memory: here the "device" array
    with pytest.raises(kvtier.InvalidArgument, match="direction must be 0"):
        engine.submit_cuda(copier, 3, load)
    # Pinned by the copier but unknown to this engine: it could be unmapped under the copy.
    other = Engine(1)
    with pytest.raises(kvtier.InvalidArgument, match="outside the engine's registered memory"):
        other.submit_cuda(copier, STORE, store_desc(dev, pool, 0))
    other.close()
    ok = engine.submit_cuda(copier, LOAD, np.array([[pool.slot_address(0), dev.ctypes.data, 4096]]))
    engine.wait([ok], 5.0)
    assert [r.ok for r in engine.poll()] == [True]
    engine.close()


def test_copy_job_ids_come_from_the_engine_beside_its_other_jobs(  # type: ignore[no-untyped-def]
    fake, tmp_path, redis_standalone
) -> None:
    with HostPool(4, 8192) as pool:  # a disk record: 4 KiB of payload, 4 KiB of trailer
        interleave(fake, pool, tmp_path, redis_standalone.port)


def interleave(fake, pool: HostPool, tmp_path: Path, redis_port: int) -> None:  # type: ignore[no-untyped-def]
    dev = (np.arange(2 * 4096) % 251).astype(np.uint8)
    second = dev[4096:].copy()
    engine = cuda_engine(pool)
    copier = make_copier(fake, pool, dev)
    ns = bytes(16)
    disk = _native.DiskStore(
        [str(tmp_path / "f")], 1 << 20, "pread", 4, 1 << 20, False, False, ns,
        [(pool.address, pool.nbytes)],
    )  # fmt: skip
    remote = _native.RemoteStore(
        [("127.0.0.1", redis_port)], False, "", "", 0, 2000, 2000, 8, 0, False, ns
    )
    payload = 8192 - _native.DISK_TRAILER_BYTES
    key = np.zeros((1, 16), np.uint8)
    ids = [
        engine.submit_cuda(copier, STORE, store_desc(dev, pool, 0), queue=STORE),
        engine.submit_disk(disk, True, np.array([[pool.slot_address(3), 0, 0, payload]]), key, 2),
        engine.submit_cuda(copier, STORE, store_desc(dev, pool, 1, 4096), queue=STORE),
        engine.submit_remote(
            remote, "exists", [b"kvt:h17"], np.array([pool.slot_address(2)]), 4096, key, 2
        ),
        engine.submit_sleep(0.0, queue=2),
        0,
    ]  # fmt: skip
    # A load of the slot the second store fills, into the bytes the first
    # store reads: its stream waits for that store's end (deps).
    load = np.array([[pool.slot_address(1), dev.ctypes.data, 4096]])
    ids[5] = engine.submit_cuda(copier, LOAD, load, deps=[ids[2]], queue=LOAD)
    assert ids == list(range(ids[0], ids[0] + 6))  # one sequence for every kind of job
    engine.wait(ids, 10.0)
    results = {r.job_id: r for r in engine.poll()}
    assert sorted(results) == ids
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    assert results[ids[0]].nbytes == results[ids[2]].nbytes == 4096
    assert bytes(pool.view(1)[:4096]) == bytes(dev[:4096]) == second.tobytes()
    engine.close()


def test_a_deadline_fails_the_job_and_its_events_come_back_at_its_end(fake, pool) -> None:  # type: ignore[no-untyped-def]
    dev = np.full(2 * 4096, 7, np.uint8)
    engine = cuda_engine(pool, deadline_s=0.05)
    copier = make_copier(fake, pool, dev)
    with_copier = fake.fake_cuda_live_objects()
    fake.fake_cuda_set_delay_us(300_000)  # the GPU is slow: each copy takes 0.3 s
    slow = engine.submit_cuda(copier, STORE, store_desc(dev, pool, 0), queue=STORE)
    behind = engine.submit_cuda(copier, STORE, store_desc(dev, pool, 1, 4096), queue=STORE)
    engine.wait([slow, behind], 5.0)  # both timed out: finished for wait
    timed = engine.poll()
    assert sorted((r.job_id, r.ok, r.timed_out, r.held, r.released) for r in timed) == [
        (slow, False, True, True, False),  # on the GPU: its memory stays in use
        (behind, False, True, True, False),  # queued behind it on the stream, in use too
    ]
    assert all(r.error.startswith("timed out: still running") for r in timed)
    assert engine.in_flight_bytes(STORE) == 2 * 4096  # both copies still count
    fake.fake_cuda_set_delay_us(0)
    released: list[tuple[int, bool]] = []
    until = time.monotonic() + 10
    while len(released) < 2 and time.monotonic() < until:
        released += [(r.job_id, r.released) for r in engine.poll()]
        time.sleep(0.01)
    assert released == [(slow, True), (behind, True)]
    assert engine.in_flight_bytes(STORE) == 0
    assert (pool.view(0, 2) == 7).all()  # the copies did land
    assert fake.fake_cuda_live_objects() == with_copier + 4  # two jobs' events, now free
    again = engine.submit_cuda(copier, STORE, store_desc(dev, pool, 2), queue=STORE)
    engine.wait([again], 5.0)
    assert [(r.job_id, r.ok) for r in engine.poll()] == [(again, True)]
    assert fake.fake_cuda_live_objects() == with_copier + 4  # reused, none created
    engine.close()


def test_wait_honours_its_timeout_and_ctrl_c(fake, pool) -> None:  # type: ignore[no-untyped-def]
    dev = np.zeros(4096, np.uint8)
    engine = cuda_engine(pool)
    copier = make_copier(fake, pool, dev)
    fake.fake_cuda_set_delay_us(2_000_000)
    job = engine.submit_cuda(copier, STORE, store_desc(dev, pool, 0), queue=STORE)
    with pytest.raises(kvtier.Timeout):
        engine.wait([job], 0.05)
    assert engine.poll() == []  # it gave up while the copy was still on the GPU
    # Python's handler even where SIGINT came in ignored (a shell's background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()  # as Ctrl-C
            engine.wait([job])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert engine.poll() == []
    fake.fake_cuda_set_delay_us(0)
    engine.wait([job], 5.0)
    assert [(r.job_id, r.ok) for r in engine.poll()] == [(job, True)]
    engine.close()


def test_closing_with_cancel_lets_enqueued_copies_end(fake, pool) -> None:  # type: ignore[no-untyped-def]
    dev = np.full(3 * 4096, 9, np.uint8)
    gc.collect()
    live = fake.fake_cuda_live_objects()
    engine = cuda_engine(pool)
    copier = make_copier(fake, pool, dev)
    fake.fake_cuda_set_delay_us(50_000)
    ids = [
        engine.submit_cuda(copier, STORE, store_desc(dev, pool, s, s * 4096), queue=STORE)
        for s in range(3)
    ]
    engine.submit_sleep(0.2, queue=LOAD)  # a serial queue: the next one cannot start before
    never = engine.submit_sleep(0.0, queue=LOAD)
    engine.close(cancel=True)  # on the GPU already: the copies cannot be called back
    done = {r.job_id: r for r in engine.poll()}
    assert [(done[i].ok, done[i].error) for i in ids] == [(True, "")] * 3
    assert (pool.view(0, 3) == 9).all()
    assert done[never].error == "cancelled: engine closed"
    del copier
    gc.collect()
    assert fake.fake_cuda_live_objects() == live
