from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import kvtier
import numpy as np
import pytest
from kvtier.engine import Engine, crc32c
from kvtier.pool import HostPool


def _descs(pool: HostPool, pairs: list[tuple[int, int]], nbytes: int | None = None) -> np.ndarray:
    n = nbytes or pool.slot_bytes
    return np.array([[pool.slot_address(s), pool.slot_address(d), n] for s, d in pairs], np.int64)


def test_ten_thousand_random_copy_jobs_verified(pool: HostPool, engine: Engine) -> None:
    rng = np.random.default_rng(1)
    engine.register_pool(pool)
    data = pool.view(0, pool.num_slots)
    data[:] = rng.integers(0, 256, data.shape, dtype=np.uint8)
    half = pool.num_slots // 2
    expected = data.copy()
    for batch in range(100):
        ids = []
        # Sources are never destinations, so the expected bytes are exact.
        for _ in range(100):
            src = int(rng.integers(0, half))
            dst = int(rng.integers(half, pool.num_slots))
            off = int(rng.integers(0, 1024))
            n = int(rng.integers(1, pool.slot_bytes - off))
            d = np.array(
                [[pool.slot_address(src) + off, pool.slot_address(dst) + off, n]], np.int64
            )
            ids.append(engine.submit_copy(d))
            engine.wait([ids[-1]])  # a dst may repeat within a batch: keep order exact
            expected[dst, off : off + n] = expected[src, off : off + n]
        results = engine.poll()
        assert len(results) == 100 and all(r.ok for r in results), batch
    assert np.array_equal(data, expected)


def test_batched_copy_descriptors_without_python_loop(pool: HostPool, engine: Engine) -> None:
    engine.register_pool(pool)
    pool.view(0, 32)[:] = np.arange(32, dtype=np.uint8)[:, None]
    d = _descs(pool, [(i, 32 + i) for i in range(32)])
    jid = engine.submit_copy(d)
    engine.wait([jid], timeout=10)
    (r,) = engine.poll()
    job_id, ok, error, nbytes, seconds = r
    assert (job_id, ok, error, nbytes) == (jid, True, "", 32 * pool.slot_bytes)
    assert seconds > 0
    assert np.array_equal(pool.view(32, 32)[:, 0], np.arange(32))


def test_busy_when_budget_full() -> None:
    with Engine(1, [(1000, False)]) as e:
        a = e.submit_sleep(0.2, nbytes=600)
        with pytest.raises(kvtier.Busy):
            e.submit_sleep(0, nbytes=600)
        b = e.submit_sleep(0, nbytes=400)
        assert e.in_flight_bytes() == 1000
        e.wait([a, b], timeout=10)
        assert e.in_flight_bytes() == 0
        e.submit_sleep(0, nbytes=600)


def test_failed_job_is_data_not_an_exception(engine: Engine) -> None:
    jid = engine.submit_sleep(0, fail="injected failure")
    engine.wait([jid])
    (r,) = engine.poll()
    assert (r.job_id, r.ok, r.error) == (jid, False, "injected failure")


def test_poll_drains_everything_once(engine: Engine) -> None:
    ids = [engine.submit_sleep(0) for _ in range(20)]
    engine.wait(ids)
    assert sorted(r.job_id for r in engine.poll()) == ids
    assert engine.poll() == []


def test_wait_timeout(engine: Engine) -> None:
    jid = engine.submit_sleep(2.0)
    t0 = time.monotonic()
    with pytest.raises(kvtier.Timeout):
        engine.wait([jid], timeout=0.1)
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(TimeoutError):  # also the builtin
        engine.wait([jid], timeout=0.0)


def test_wait_unknown_id(engine: Engine) -> None:
    with pytest.raises(kvtier.InvalidArgument):
        engine.wait([12345])


def test_ctrl_c_interrupts_wait(engine: Engine) -> None:
    # Python's handler even where SIGINT came in ignored (a job a shell put in
    # the background: interrupt_main then does nothing, as Ctrl-C would not).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        jid = engine.submit_sleep(3.0)
        timer = threading.Timer(0.1, _thread.interrupt_main)
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            engine.wait([jid])
        assert time.monotonic() - t0 < 2.0
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_wait_releases_the_gil(engine: Engine) -> None:
    jid = engine.submit_sleep(0.3)
    count = 0
    stop = False

    def spin() -> None:
        nonlocal count
        while not stop:
            count += 1

    t = threading.Thread(target=spin)
    t.start()
    engine.wait([jid])
    stop = True
    t.join()
    assert count > 10_000


@pytest.mark.parametrize(
    "desc,match",
    [
        ("outside", "outside every registered region"),
        ("zero", "size must be > 0"),
        ("negative", "size must be > 0"),
        ("overlap", "overlap"),
        ("dst_overlap", "overlapping destinations"),
        ("shape", "shape"),
        ("dtype", "int64"),
    ],
)
def test_bad_descriptors_raise_at_submit(
    pool: HostPool, engine: Engine, desc: str, match: str
) -> None:
    engine.register_pool(pool)
    a, b = pool.slot_address(0), pool.slot_address(1)
    arrays = {
        "outside": np.array([[a, pool.address + pool.nbytes - 10, 100]], np.int64),
        "zero": np.array([[a, b, 0]], np.int64),
        "negative": np.array([[a, b, -5]], np.int64),
        "overlap": np.array([[a, a + 10, 100]], np.int64),
        "dst_overlap": np.array([[a, b, 100], [a + 200, b + 50, 100]], np.int64),
        "shape": np.array([[a, b]], np.int64),
        "dtype": np.array([[a, b, 100]], np.float64),
    }
    with pytest.raises(kvtier.InvalidArgument, match=match):
        engine.submit_copy(arrays[desc])


def test_unregistered_memory_is_refused(engine: Engine) -> None:
    buf = np.zeros(4096, np.uint8)
    other = np.zeros(4096, np.uint8)
    with pytest.raises(kvtier.InvalidArgument):
        engine.submit_copy(np.array([[buf.ctypes.data, other.ctypes.data, 16]], np.int64))
    engine.register_memory(buf.ctypes.data, buf.nbytes, owner=buf)
    engine.register_memory(other.ctypes.data, other.nbytes, owner=other)
    buf[:16] = 9
    engine.wait(
        [engine.submit_copy(np.array([[buf.ctypes.data, other.ctypes.data, 16]], np.int64))]
    )
    assert other[:16].tolist() == [9] * 16


def test_close_drains_then_refuses() -> None:
    e = Engine(2)
    ids = [e.submit_sleep(0.01) for _ in range(10)]
    e.close()
    assert sorted(r.job_id for r in e.poll() if r.ok) == ids
    with pytest.raises(kvtier.ClosedError):
        e.submit_sleep(0)
    e.close()  # idempotent


def test_close_cancel_fails_queued_jobs() -> None:
    e = Engine(1)
    ids = [e.submit_sleep(0.2)] + [e.submit_sleep(0) for _ in range(5)]
    time.sleep(0.05)
    e.close(cancel=True)
    results = {r.job_id: r for r in e.poll()}
    assert set(results) == set(ids)
    # The first job was running (it finishes) unless the worker had not picked it up yet.
    assert results[ids[0]].ok or "cancelled" in results[ids[0]].error
    assert all(not results[i].ok and "cancelled" in results[i].error for i in ids[1:])


def test_bad_engine_config() -> None:
    with pytest.raises(kvtier.InvalidArgument):
        Engine(0)
    with pytest.raises(kvtier.InvalidArgument):
        Engine(1, [])
    with pytest.raises(kvtier.InvalidArgument):
        Engine(1, [(0, False)])
    with pytest.raises(kvtier.InvalidArgument, match="deadline"):
        Engine(1, [(1 << 20, False, -1.0)])
    with pytest.raises(kvtier.InvalidArgument, match="budget_bytes, serial"):
        Engine(1, [(1 << 20, False, 1.0, 2)])  # type: ignore[list-item]
    for nice in (-1, 20):
        with pytest.raises(kvtier.InvalidArgument, match=rf"^nice must be in 0\.\.19, got {nice}$"):
            Engine(1, nice=nice)


def thread_nices() -> list[int]:
    """The niceness of every thread of this process (field 19 of its stat)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            out.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    return out


def test_workers_run_at_the_engine_niceness_and_callers_keep_theirs() -> None:
    before, mine = thread_nices(), os.getpriority(os.PRIO_PROCESS, 0)
    e = Engine(3, nice=7)
    try:
        e.wait([e.submit_sleep(0.0)])  # every worker has started by now
        deadline = time.monotonic() + 5
        while thread_nices().count(7) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread_nices().count(7) == before.count(7) + 3
        assert e.nice == 7 and os.getpriority(os.PRIO_PROCESS, 0) == mine
    finally:
        e.close()
    plain = Engine(2)
    assert plain.nice == 0
    plain.close()


def test_deadline_reports_timeouts_then_release() -> None:
    """A job past its queue's deadline is reported at once (wait returns),
    held if it had started; the one queued behind it never starts; the
    late end of the held job comes as a second result, ``released``."""
    e = Engine(1, [(1 << 20, False, 0.1)])
    t0 = time.monotonic()
    slow = e.submit_sleep(0.6, nbytes=100)
    time.sleep(0.02)
    queued = e.submit_sleep(0.0, nbytes=100)
    e.wait([slow, queued], timeout=5)
    assert time.monotonic() - t0 < 0.5
    first = {r.job_id: r for r in e.poll()}
    assert set(first) == {slow, queued}
    assert all(r.timed_out and not r.ok and not r.released for r in first.values())
    assert first[slow].held and not first[queued].held
    assert e.in_flight_bytes(0) == 100  # the sleeping job still holds its bytes
    late: list = []
    deadline = time.monotonic() + 5
    while not late and time.monotonic() < deadline:
        late = e.poll()
        time.sleep(0.01)
    assert [(r.job_id, r.released, r.timed_out) for r in late] == [(slow, True, False)]
    assert e.in_flight_bytes(0) == 0
    ok = e.submit_sleep(0.0)
    e.wait([ok])
    assert [r.ok for r in e.poll()] == [True]
    e.close()


def test_crc32c_known_values() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    data = np.random.default_rng(2).integers(0, 256, 200_000, dtype=np.uint8)
    whole = crc32c(data)
    assert crc32c(data[70_000:], crc32c(data[:70_000])) == whole
    flipped = data.copy()
    flipped[12345] ^= 1
    assert crc32c(flipped) != whole
    with pytest.raises(kvtier.InvalidArgument):
        crc32c(data[::2])
