"""Disk tier beside other programs: capacity checked against the free space
(refusal, a share of the free space, cleanup after a failed start), a file
system that fills up while the tier runs, and one owner per directory (a
second process refused by name, a killed owner's directory taken over).

Every test that fills a file system does it on a small tmpfs it mounts itself
(root only), so no test can fill a real disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import kvtier
import numpy as np
import pytest
from conftest import block_content as content
from conftest import block_key as K
from conftest import finish, store_blocks
from kvtier.options import DiskOptions
from kvtier.options.surfaces import parse_disk_spec
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.disk import DiskTier, record_bytes, resolve_capacity
from kvtier.tiers.disk.journal import JOURNAL_ENTRY_BYTES
from kvtier.tiers.factory import build_tier
from kvtier.units import FreeFraction

BLOCK = 16384
SLOT = record_bytes(BLOCK)  # 20 KiB
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test alone (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the test never fills a real disk)")
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], text=True,
                       capture_output=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=False)


def test_capacity_past_free_space_is_refused_and_leaves_nothing(small_fs: Path) -> None:
    before = free_bytes(small_fs)
    with pytest.raises(kvtier.NoSpace) as e:
        DiskTier(small_fs, 16 << 20, BLOCK)
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC
    assert "capacity 16777216 B (16.0 MiB) needs 16.0 MiB more" in msg
    assert "the file system has 8.0 MiB free" in msg
    assert "--disk DIR:SIZE or kvtier_disk_bytes" in msg and "'80%'" in msg
    assert list(small_fs.iterdir()) == []  # nor a directory, nor a lock file
    assert free_bytes(small_fs) == before


def test_reserve_is_kept_free(small_fs: Path) -> None:
    # 7.8 MiB fits in 8 MiB but not beside the default reserve (5%: 409.6 KiB)...
    with pytest.raises(kvtier.NoSpace, match=r"409\.6 KiB of it stays free"):
        DiskTier(small_fs, "7.8MiB", BLOCK)
    # ...and does with no reserve.
    t = DiskTier(small_fs, "7.8MiB", BLOCK, reserve_bytes=0)
    assert t.num_records == int(7.8 * (1 << 20)) // SLOT
    assert free_bytes(small_fs) <= (8 << 20) - t.num_records * SLOT
    t.close()
    with pytest.raises(kvtier.InvalidArgument, match="reserve_bytes must be >= 0"):
        DiskTier(small_fs, 1 << 20, BLOCK, reserve_bytes=-1)


def test_fraction_of_free_space_and_restart(small_fs: Path) -> None:
    t = DiskTier(small_fs, "50%", BLOCK)
    want = int(0.5 * (8 << 20)) // SLOT
    assert t.num_records == want
    assert sum(os.stat(p).st_blocks * 512 for p in t.paths) == want * SLOT
    t.close()
    # The tier's own slabs count as free: a restart gets the same capacity.
    t = DiskTier(small_fs, FreeFraction(0.5), BLOCK)
    assert t.num_records == want
    t.close()
    # Every front end takes the same spelling.
    assert parse_disk_spec(f"{small_fs}:80%") == (str(small_fs), FreeFraction(0.8))
    tier = build_tier(DiskOptions(str(small_fs), FreeFraction(0.5)), BLOCK, "default")
    assert isinstance(tier, DiskTier) and tier.num_records == want
    tier.close()
    assert resolve_capacity("1MiB", small_fs) == 1 << 20
    with pytest.raises(kvtier.InvalidArgument, match=r"in \(0, 100\]"):
        DiskTier(small_fs, "150%", BLOCK)


def test_failed_preallocation_removes_what_it_created(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Space taken between the check and the allocation (another program
    # writing): the second slab's fallocate fails, nothing stays behind.
    import kvtier.tiers.disk.directory as directory

    monkeypatch.setattr(directory, "EXTENT_MAX", 2 << 20)  # 2 MiB slabs
    real = os.posix_fallocate
    calls = []

    def fallocate(fd: int, off: int, n: int) -> None:
        calls.append(n)
        if len(calls) == 2:
            (small_fs / "hog").write_bytes(b"\0" * (free_bytes(small_fs) - 4096))
        real(fd, off, n)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(kvtier.NoSpace, match=r"preallocate .*slab-001\.dat: No space left"):
        DiskTier(small_fs, 6 << 20, BLOCK, reserve_bytes=0)
    assert len(calls) == 2
    assert sorted(p.name for p in small_fs.iterdir()) == ["hog"]
    (small_fs / "hog").unlink()
    assert free_bytes(small_fs) == 8 << 20


def test_failed_growth_of_an_existing_tier_restores_it(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HostPool(4, SLOT) as p:
        t = DiskTier(small_fs, 32 * SLOT, BLOCK)
        t.attach(p)
        p.view(0)[:BLOCK] = content(0)
        assert finish(t, t.submit_store([K(0)], [0])) == [True]
        t.close()
        size = os.path.getsize(t.paths[0])

        def fail(fd: int, off: int, n: int) -> None:
            raise OSError(errno.EIO, "injected")

        monkeypatch.setattr(os, "posix_fallocate", fail)
        with pytest.raises(kvtier.IoError, match=r"preallocate .*Input/output error"):
            DiskTier(small_fs, 64 * SLOT, BLOCK)
        monkeypatch.undo()
        assert os.path.getsize(t.paths[0]) == size  # shrunk back, the directory kept
        t = DiskTier(small_fs, 32 * SLOT, BLOCK)
        t.attach(p)
        assert finish(t, t.submit_load([K(0)], [1])) == [True]
        assert np.array_equal(p.view(1)[:BLOCK], content(0))
        t.close()


def fill(fs: Path) -> Path:
    """Take every free byte of ``fs`` (a file, written until ENOSPC)."""
    hog = fs / "hog"
    fd = os.open(hog, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    assert free_bytes(fs) == 0
    return hog


def store(t: DiskTier, p: HostPool, keys: range) -> None:
    for first in range(keys.start, keys.stop, 16):
        assert all(store_blocks(t, p, range(first, min(first + 16, keys.stop))))


def verify(t: DiskTier, p: HostPool, keys: range) -> None:
    for first in range(keys.start, keys.stop, 16):
        ks = range(first, min(first + 16, keys.stop))
        assert all(t.lookup(K(k)) is HIT for k in ks)
        assert all(finish(t, t.submit_load([K(k) for k in ks], list(range(len(ks))))))
        for j, k in enumerate(ks):
            assert np.array_equal(p.view(j)[:BLOCK], content(k)), k


def test_file_system_full_mid_run(small_fs: Path) -> None:
    """ENOSPC while running: the slabs were allocated at start, so stores
    still land; the journal append that needs a new page fails and is cut
    back to whole entries; every block stays served; a checkpoint catches up
    once there is room, and a restart finds every block, nothing corrupt."""
    journal = JOURNAL_ENTRY_BYTES
    with HostPool(16, SLOT) as p:
        t = DiskTier(small_fs, 128 * SLOT, BLOCK, reserve_bytes=0)
        t.attach(p)
        first = 4096 // journal  # 78 entries: the journal's first page nearly full
        store(t, p, range(first))
        t._flush_journal()
        assert os.path.getsize(t.dir / "index.journal") == first * journal
        hog = fill(small_fs)
        store(t, p, range(first, 100))  # their journal entries need a second page
        t._flush_journal()
        assert t.stats()["nospace"] == 1
        assert os.path.getsize(t.dir / "index.journal") == first * journal  # cut back
        assert t.admit(K(1000)) is False  # no new stores for a while
        verify(t, p, range(100))
        hog.unlink()
        t.close()  # the last flush writes a checkpoint now that there is room
        t = DiskTier(small_fs, 128 * SLOT, BLOCK, reserve_bytes=0)
        t.attach(p)
        assert t.stats()["recovered"] == 100
        verify(t, p, range(100))
        assert t.stats()["corrupt"] == 0 and t.stats()["load_failures"] == 0
        t.close()


OWNER = textwrap.dedent("""
    import sys, time
    from kvtier.pool import HostPool
    from kvtier.tiers.disk import DiskTier, record_bytes
    BLOCK = 16384
    p = HostPool(4, record_bytes(BLOCK))
    t = DiskTier(sys.argv[1], 32 * record_bytes(BLOCK), BLOCK)
    t.attach(p)
    p.view(0)[:BLOCK] = 7
    token = t.submit_store([b"owned"], [0])
    while not any(c.token == token for c in t.poll()):
        time.sleep(0.001)
    t._flush_journal()
    print("ready", flush=True)
    if sys.argv[2] == "close":
        t.close()
        print("closed", flush=True)
    time.sleep(60)
""")


@contextlib.contextmanager
def _owner(tmp_path: Path, then: str) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """Another process owning the tier directory ``tmp_path/disk`` (one
    record stored, then ``then``: ``hold`` or ``close``), killed at the end."""
    d = tmp_path / "disk"
    d.mkdir()
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = subprocess.Popen([sys.executable, str(script), str(d), then], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        yield d, proc
    finally:
        proc.kill()  # does nothing to one the test has already reaped
        proc.wait()


def test_second_process_is_refused_naming_the_owner(tmp_path: Path) -> None:
    with _owner(tmp_path, "hold") as (d, proc):
        with pytest.raises(kvtier.InUse) as e:
            DiskTier(d, 32 * SLOT, BLOCK)
        assert e.value.errno == errno.EBUSY
        assert f"is in use by pid {proc.pid} " in str(e.value)
        # Refused before touching anything: the owner's journal is intact.
        (ns_dir,) = d.iterdir()
        assert os.path.getsize(ns_dir / "index.journal") == JOURNAL_ENTRY_BYTES
        # Another namespace in the same directory is another owner's business.
        DiskTier(d, 32 * SLOT, BLOCK, namespace="other-model").close()


def test_closing_hands_the_directory_over(tmp_path: Path) -> None:
    with _owner(tmp_path, "close") as (d, proc):
        assert proc.stdout is not None and proc.stdout.readline() == "closed\n"
        t = DiskTier(d, 32 * SLOT, BLOCK)  # the owner is alive but closed its tier
        assert t.lookup(b"owned") is HIT
        t.close()


def test_killed_owner_is_taken_over(tmp_path: Path) -> None:
    with _owner(tmp_path, "hold") as (d, proc):
        with pytest.raises(kvtier.InUse, match=f"pid {proc.pid} "):
            DiskTier(d, 32 * SLOT, BLOCK)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with HostPool(4, SLOT) as p:
        t = DiskTier(d, 32 * SLOT, BLOCK)
        (ns_dir,) = d.iterdir()
        assert (ns_dir / "owner.lock").read_text() == f"{os.getpid()}\n"
        t.attach(p)
        assert finish(t, t.submit_load([b"owned"], [1])) == [True]
        assert (p.view(1)[:BLOCK] == 7).all()
        # Within one process, too, a directory has one owner at a time.
        with pytest.raises(kvtier.InUse, match=f"pid {os.getpid()} "):
            DiskTier(d, 32 * SLOT, BLOCK)
        t.close()


def test_losing_a_new_directory_to_another_owner_removes_nothing_of_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process takes the directory between our mkdir and our flock:
    # the refusal must leave its files alone.
    import kvtier.tiers.disk.directory as disk

    real = disk.OwnerLock
    theirs: list[disk.OwnerLock] = []

    def race(directory: Path) -> disk.OwnerLock:
        theirs.append(real(directory))
        (directory / "slab-000.dat").write_bytes(b"their data")
        return real(directory)

    monkeypatch.setattr(disk, "OwnerLock", race)
    with pytest.raises(kvtier.InUse, match=f"pid {os.getpid()} "):
        DiskTier(tmp_path, 32 * SLOT, BLOCK)
    (ns_dir,) = tmp_path.iterdir()
    assert (ns_dir / "slab-000.dat").read_bytes() == b"their data"
    assert (ns_dir / "owner.lock").exists()
    theirs[0].release()
