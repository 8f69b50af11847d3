from __future__ import annotations

import multiprocessing as mp

import kvtier
import numpy as np
import pytest
from kvtier.pool import HostPool


def _child_rw(name: str, q: mp.Queue) -> None:
    p = HostPool.attach(name)
    got = bytes(p.view(7)[:4096])
    p.view(9)[:] = 0xC3  # written by the child, read by the parent
    q.put((p.num_slots, p.slot_bytes, got))


def test_two_processes_share_slots_byte_for_byte() -> None:
    with HostPool(16, 64 * 1024) as p:
        pattern = np.random.default_rng(0).integers(0, 256, p.slot_bytes, dtype=np.uint8)
        p.view(7)[:] = pattern
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_child_rw, args=(p.name, q))
        proc.start()
        slots, slot_bytes, got = q.get(timeout=60)
        proc.join(60)
        assert proc.exitcode == 0
        assert (slots, slot_bytes) == (16, 64 * 1024)
        assert got == pattern[:4096].tobytes()
        assert (p.view(9) == 0xC3).all()


def _faults_to_touch_every_page(p: HostPool) -> int:
    """Page faults to read and write back one byte a page (as a copy reads
    and writes): a fault maps its page's neighbours too (the kernel's fault
    around, 16 pages by default)."""
    import resource

    data = p.view(0, p.num_slots)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    data[:, ::4096] = data[:, ::4096].copy()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _child_populate(name: str, q: mp.Queue) -> None:
    lazy, entered = HostPool.attach(name), HostPool.attach(name)  # two mappings
    done = entered.populate(chunk_bytes=1 << 20)
    q.put(
        (
            done,
            _faults_to_touch_every_page(entered),
            _faults_to_touch_every_page(lazy),
            bytes(entered.view(0, entered.num_slots)),
        )
    )


def test_populate_enters_every_page_without_writing_one() -> None:
    """A process that attaches pays page faults at its first touch (one a
    16 pages) unless it populated the mapping (what a CPU worker does in
    the background); populating changes no byte."""
    with HostPool(64, 64 * 1024) as p:
        rng = np.random.default_rng(1)
        p.view(0, 64)[:] = rng.integers(0, 256, (64, p.slot_bytes), dtype=np.uint8)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_child_populate, args=(p.name, q))
        proc.start()
        done, populated_faults, lazy_faults, seen = q.get(timeout=60)
        proc.join(60)
        assert proc.exitcode == 0
        assert done == p.native.map_bytes  # header, 64 slots and the fence page
        pages = 64 * 64 * 1024 // 4096
        assert lazy_faults >= pages // 16  # the test can tell: untouched pages fault
        assert populated_faults < pages // 64, (populated_faults, lazy_faults)
        assert seen == bytes(p.view(0, 64))
        assert p.populate() == p.native.map_bytes  # the creator's too, bytes unchanged
        assert seen == bytes(p.view(0, 64))


def test_populate_stops_at_close_and_refuses_a_bad_chunk() -> None:
    p = HostPool(4, 4096)
    with pytest.raises(kvtier.InvalidArgument):
        p.populate(chunk_bytes=0)
    p.populate_in_background().join(10)
    p.close()
    assert p.populate() == 0


def test_views_are_zero_copy(pool: HostPool) -> None:
    t = pool.tensor(3)
    t.fill_(5)
    assert pool.view(3)[100] == 5
    assert pool.view(0, 4).shape == (4, pool.slot_bytes)
    assert pool.view(2).ctypes.data == pool.slot_address(2)
    assert pool.slot_address(1) - pool.slot_address(0) == pool.slot_bytes


def test_bad_sizes_raise_invalid_argument() -> None:
    for args in [(0, 4096), (4, 0), (4, 100), (-1, 4096)]:
        with pytest.raises(kvtier.InvalidArgument):
            HostPool(*args)
    with pytest.raises(ValueError):  # InvalidArgument is also a ValueError
        HostPool(1, 4096, name="no/slashes")


def test_slot_out_of_range(pool: HostPool) -> None:
    with pytest.raises(kvtier.InvalidArgument, match="out of range"):
        pool.view(pool.num_slots)
    with pytest.raises(kvtier.InvalidArgument):
        pool.slot_address(10**6)


def test_attach_missing_is_ioerror_with_errno() -> None:
    with pytest.raises(kvtier.IoError) as ei:
        HostPool.attach("kvtier-does-not-exist")
    assert ei.value.errno == 2
    assert isinstance(ei.value, OSError)


def test_attach_validates_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A foreign shared-memory object of the right kind but not a kvtier pool.
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=8192)
    try:
        with pytest.raises(kvtier.InvalidArgument, match="not a kvtier pool"):
            HostPool.attach(shm.name.lstrip("/"))
    finally:
        shm.close()
        shm.unlink()


def test_close_removes_name_and_refuses_use() -> None:
    p = HostPool(2, 4096)
    v = p.view(1)
    v[:] = 1
    p.close()
    assert p.closed
    with pytest.raises(kvtier.ClosedError):
        p.view(0)
    with pytest.raises(kvtier.IoError):
        HostPool.attach(p.name)
    assert int(v.sum()) == 4096  # earlier views stay valid
    p.close()  # idempotent


def test_name_collision_is_refused(pool: HostPool) -> None:
    with pytest.raises(kvtier.IoError):
        HostPool(2, 4096, name=pool.name)


def _child_create_then_die(name: str, q: mp.Queue) -> None:
    import os
    import signal

    p = HostPool(4, 4096, name=name)
    p.view(0)[:] = 7
    q.put(p.name)
    q.close()
    q.join_thread()  # the name reached the parent
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: as the OOM killer would


def test_pools_of_dead_creators_are_reaped_live_ones_kept() -> None:
    """A process killed without closing its pool leaves the name in /dev/shm
    (pinning its memory); the next pool created here removes it, while a pool
    whose creator lives (this process) is kept."""
    import os
    import uuid

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dead = f"kvtier-test-dead-{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_child_create_then_die, args=(dead, q))
    proc.start()
    assert q.get(timeout=60) == dead
    proc.join(60)
    assert proc.exitcode == -9
    assert os.path.exists(f"/dev/shm/{dead}")
    with HostPool(2, 4096) as live:
        assert not os.path.exists(f"/dev/shm/{dead}")  # reaped by this create
        assert os.path.exists(f"/dev/shm/{live.name}")
        assert HostPool.reap_stale() == 0  # nothing stale left; the live pool stays
        assert HostPool.attach(live.name).num_slots == 2


def test_a_pool_larger_than_dev_shm_fails_with_enospc_not_sigbus() -> None:
    # A container's /dev/shm is often 64 MiB: a bigger pool must be refused
    # with ENOSPC when it is made, not kill the process with SIGBUS when a
    # page past the end is first touched. A child with a 16 MiB /dev/shm of
    # its own (a private mount namespace: root and unshare needed).
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    code = (
        "import errno, kvtier\nfrom kvtier.pool import HostPool\n"
        "try:\n    HostPool(64, 1 << 20)\nexcept kvtier.IoError as e:\n"
        "    print('refused', e.errno == errno.ENOSPC)\n"
        "with HostPool(4, 1 << 20) as p:\n    p.view(3)[:] = 1; print('small ok')\n"
    )
    script = f'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, code],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if out.returncode != 0 and "mount" in out.stderr and "refused" not in out.stdout:
        pytest.skip(f"cannot mount a private /dev/shm here: {out.stderr.strip()}")
    assert out.stdout.split("\n")[:2] == ["refused True", "small ok"], (out.returncode, out.stderr)
