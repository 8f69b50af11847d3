"""Disk tier: bad input, permissions, namespaces, warm restart, crashes, damage."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import kvtier
import numpy as np
import pytest
from conftest import block_content as content
from conftest import block_key as K
from conftest import finish, store_blocks
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.disk import DiskTier, key_digest, record_bytes

BLOCK = 16384
SLOT = record_bytes(BLOCK)
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def attached(directory: Path, pool: HostPool, records: int, **kw: Any) -> DiskTier:
    """A tier in ``directory`` holding ``records`` records, attached to ``pool``."""
    t = DiskTier(directory, records * SLOT, BLOCK, **kw)
    t.attach(pool)
    return t


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(kvtier.IoError, match="does not exist") as e:
        DiskTier(tmp_path / "nope", 1 << 20, BLOCK)
    assert e.value.errno == 2


def test_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(kvtier.IoError, match="owned by uid 65534"):
        DiskTier(d, 1 << 20, BLOCK)


def test_capacity_and_size_errors(tmp_path: Path) -> None:
    with pytest.raises(kvtier.InvalidArgument, match="holds no record"):
        DiskTier(tmp_path, 100, BLOCK)
    with pytest.raises(kvtier.InvalidArgument):
        DiskTier(tmp_path, 1 << 20, BLOCK, backend="magic")
    t = DiskTier(tmp_path, 1 << 20, 10000)
    with pytest.raises(kvtier.InvalidArgument, match="slot_bytes_for"):
        t.attach(HostPool(4, 10048))
    t.close()


def test_slots_without_trailer_room(tmp_path: Path) -> None:
    # vLLM's primary region: slots of exactly the (4 KiB multiple) block.
    with HostPool(8, BLOCK) as p:
        t = attached(tmp_path, p, 16)
        assert all(store_blocks(t, p, range(4)))
        assert all(finish(t, t.submit_load([K(i) for i in range(4)], [4, 5, 6, 7])))
        for i in range(4):
            assert np.array_equal(p.view(4 + i), content(i))
        t.close()


def test_files_are_private(tmp_path: Path) -> None:
    t = DiskTier(tmp_path, 8 * SLOT, BLOCK)
    with HostPool(4, SLOT) as p:
        t.attach(p)
        assert (os.stat(t.dir).st_mode & 0o777) == 0o700
        for f in [*t.paths, t.dir / "index.journal"]:
            assert (os.stat(f).st_mode & 0o777) == 0o600
        t.close()


def test_namespaces_never_mix(tmp_path: Path) -> None:
    with HostPool(8, SLOT) as p:
        a = DiskTier(tmp_path, 8 * SLOT, BLOCK, namespace="model-a/bf16/tp0")
        b = DiskTier(tmp_path, 8 * SLOT, BLOCK, namespace="model-b/bf16/tp0")
        a.attach(p)
        b.attach(p)
        assert store_blocks(a, p, [1]) == [True]
        assert a.lookup(K(1)) is HIT and b.lookup(K(1)) is MISS
        assert a.dir != b.dir
        # Even pointed at a's records, b's namespace digest rejects them.
        b.index[key_digest(K(1))] = a.index[key_digest(K(1))]  # indexed as readable
        b.store = a.store.__class__(
            a.paths, a.file_bytes, "pread", 4, 1 << 20, True, False, b.ns, [(p.address, p.nbytes)]
        )
        assert finish(b, b.submit_load([K(1)], [1])) == [False]
        assert b.stats()["corrupt"] == 1
        a.close()
        b.close()


def test_warm_restart_finds_every_block(tmp_path: Path) -> None:
    with HostPool(16, SLOT) as p:
        t = attached(tmp_path, p, 64)
        assert all(store_blocks(t, p, range(8)))
        t.checkpoint()
        assert all(store_blocks(t, p, [8]))
        t.close()
        with open(t.dir / "index.journal", "ab") as f:
            f.write(b"torn-entry")  # a crash mid-append
        t2 = attached(tmp_path, p, 64)
        assert t2.stats()["recovered"] == 9
        assert all(t2.lookup(K(i)) is HIT for i in range(9))
        assert all(finish(t2, t2.submit_load([K(i) for i in range(9)], list(range(9)))))
        for i in range(9):
            assert np.array_equal(p.view(i)[:BLOCK], content(i))
        t2.close()


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_random_ops_byte_for_byte(tmp_path: Path, backend: str) -> None:
    """100k random store/load operations against a small tier (evicting all the time)."""
    rng = random.Random(7)
    with HostPool(64, SLOT) as p:
        t = attached(tmp_path, p, 200, queue_depth=16, backend=backend)
        assert t.backend == backend
        versions: dict[int, int] = {}
        ops = 0
        bad = 0
        while ops < 100_000:
            batch = rng.sample(range(600), 32)
            if rng.random() < 0.5:
                oks = store_blocks(t, p, batch)
                versions.update({k: k for k, ok in zip(batch, oks) if ok})
            else:
                oks = finish(t, t.submit_load([K(k) for k in batch], list(range(32, 64))))
                for j, (k, ok) in enumerate(zip(batch, oks)):
                    if ok:
                        bad += not np.array_equal(p.view(32 + j)[:BLOCK], content(k))
                    else:
                        assert t.lookup(K(k)) is MISS
            ops += 32
        assert bad == 0
        s = t.stats()
        assert s["evictions"] > 1000 and s["loads"] > 1000 and s["corrupt"] == 0
        t.close()


CHILD = textwrap.dedent("""
    import sys, time, numpy as np
    from kvtier.pool import HostPool
    from kvtier.tiers.disk import DiskTier, record_bytes
    BLOCK = 16384
    d, start, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    def content(i):
        return ((np.arange(BLOCK, dtype=np.uint32) * 2654435761 + i * 97) >> 7).astype(np.uint8)
    p = HostPool(8, record_bytes(BLOCK))
    t = DiskTier(d, 4000 * record_bytes(BLOCK), BLOCK, queue_depth=8, backend=backend)
    t.attach(p)
    assert t.backend == backend
    i = start
    while True:
        keys = []
        for j in range(8):
            p.view(j)[:BLOCK] = content(i + j)
            keys.append(b"blk-%010d" % (i + j))
        t.submit_store(keys, list(range(8)))
        done = False
        while not done:
            for c in t.poll():
                done = True
                print(" ".join(str(i + j) for j, ok in enumerate(c.key_ok) if ok), flush=True)
            time.sleep(0.0002)
        i += 8
""")


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_crash_safety_sigkill_and_damage(tmp_path: Path, backend: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    d = tmp_path / "disk"
    d.mkdir()
    rng = random.Random(11)
    committed: list[int] = []
    for rnd in range(10):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(d), str(rnd * 1000), backend],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        want_lines = rng.randint(1, 40)
        for _ in range(want_lines):
            line = proc.stdout.readline()
            committed.extend(int(x) for x in line.split())
        time.sleep(rng.random() * 0.02)  # die at a random point, mid-write or not
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()  # lines printed before the kill also count
        committed.extend(int(x) for line in rest.splitlines() for x in line.split())
        proc.wait()
        # Restart: every committed block is found and verifies.
        with HostPool(8, SLOT) as p:
            t = attached(d, p, 4000, backend=backend)
            for i in range(0, len(committed), 8):
                ks = committed[i : i + 8]
                assert all(t.lookup(K(k)) is HIT for k in ks), f"round {rnd}: lost a block"
                oks = finish(t, t.submit_load([K(k) for k in ks], list(range(len(ks)))))
                assert all(oks)
                for j, k in enumerate(ks):
                    assert np.array_equal(p.view(j)[:BLOCK], content(k))
            t.close()
    # Damage: flip bytes in 20 records and truncate the extent's tail.
    with HostPool(8, SLOT) as p:
        t = attached(d, p, 4000, backend=backend)
        victims = rng.sample(committed, 20)
        for k in victims:
            f, off = t._locate(t.index[key_digest(K(k))])
            with open(t.paths[f], "r+b") as fh:
                pos = off + rng.randrange(0, SLOT)
                fh.seek(pos)
                b = fh.read(1)
                fh.seek(pos)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        last = max(committed, key=lambda k: t.index[key_digest(K(k))])
        f, off = t._locate(t.index[key_digest(K(last))])
        os.truncate(t.paths[f], off + SLOT // 2)
        damaged = set(victims) | {last}
        recs = {k: t.index[key_digest(K(k))] for k in committed}
        failures = served_wrong = 0
        for i in range(0, len(committed), 8):
            ks = committed[i : i + 8]
            oks = finish(t, t.submit_load([K(k) for k in ks], list(range(len(ks)))))
            for j, (k, ok) in enumerate(zip(ks, oks)):
                if ok:
                    served_wrong += not np.array_equal(p.view(j)[:BLOCK], content(k))
                else:
                    failures += 1
                    assert k in damaged, (
                        k,
                        recs[k],
                        recs[last],
                        committed.count(k),
                        sorted(recs[v] for v in victims),
                        t.stats(),
                    )
        assert served_wrong == 0
        assert failures == len(damaged)  # 100% of damaged records detected
        t.close()


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_hung_device_fails_within_timeout_and_holds_slots(
    freezable_dir: Path, backend: str
) -> None:
    """A frozen filesystem blocks every write in the kernel. The cascade to
    disk fails within the tier's timeout (nothing waits for the device), but
    the host slots under the hung writes are never handed out again until
    the writes really end; then everything is back to normal."""
    from kvtier.manager import TieredOffloadingManager
    from kvtier.tiers.host import HostTier

    mnt = freezable_dir
    with HostPool(8, SLOT) as pool:
        disk = attached(mnt, pool, 32, backend=backend, timeout_s=0.3)
        m = TieredOffloadingManager(HostTier(pool, 8), [disk])
        subprocess.run(["fsfreeze", "--freeze", str(mnt)], check=True)
        out = m.prepare_store([K(i) for i in range(4)])
        assert out is not None
        held = set(out.store_spec.slots.tolist())
        for k, s in zip(out.keys_to_store, out.store_spec.slots.tolist()):
            pool.view(s)[:BLOCK] = content(int(k[4:]))
        m.complete_store(out.keys_to_store)
        t0 = time.monotonic()
        while m.stats.cascade_failures < 4:
            m.on_schedule_end()
            assert time.monotonic() - t0 < 5, "the hung cascade was not failed by its timeout"
            time.sleep(0.01)
        assert disk.stats()["timeouts"] == 4 and disk.stats()["held_jobs"] >= 1
        assert m.host.held_slots == 4
        # Evict everything: the held slots must not come back for reuse yet.
        m.reset_cache()
        out2 = m.prepare_store([K(i) for i in range(10, 14)])
        assert out2 is not None and not held & set(out2.store_spec.slots.tolist())
        m.complete_store(out2.keys_to_store, success=False)
        # Only 4 slots are free: the first 4 keys fit, none in a held slot.
        part = m.prepare_store([K(i) for i in range(20, 25)])
        assert part is not None and part.keys_to_store == [K(i) for i in range(20, 24)]
        assert not held & set(part.store_spec.slots.tolist())
        m.complete_store(part.keys_to_store, success=False)
        assert disk.lookup(K(0)) is MISS
        subprocess.run(["fsfreeze", "--unfreeze", str(mnt)], check=True)
        t0 = time.monotonic()
        while m.host.held_slots:
            m.on_schedule_end()
            assert time.monotonic() - t0 < 10, "the writes never released their slots"
            time.sleep(0.01)
        assert disk.stats()["held_jobs"] == 0
        out3 = m.prepare_store([K(i) for i in range(30, 38)])  # all 8 slots usable again
        assert out3 is not None and len(out3.keys_to_store) == 8
        for k, s in zip(out3.keys_to_store, out3.store_spec.slots.tolist()):
            pool.view(s)[:BLOCK] = content(int(k[4:]))
        m.complete_store(out3.keys_to_store)
        t0 = time.monotonic()
        while m.has_pending_work() and time.monotonic() - t0 < 10:
            m.on_schedule_end()
            time.sleep(0.005)
        assert all(disk.lookup(K(i)) is HIT for i in range(30, 38))
        # and the data went to disk intact
        token = disk.submit_load([K(30), K(37)], [0, 1])
        assert finish(disk, token) == [True, True]
        assert np.array_equal(pool.view(0)[:BLOCK], content(30))
        assert np.array_equal(pool.view(1)[:BLOCK], content(37))
        m.shutdown()


# A container runtime's seccomp profile makes io_uring_setup fail with EPERM
# (Docker's default since 2023). The child installs the same kind of filter on
# itself (syscall 425 is io_uring_setup on every architecture) before kvtier
# starts, so the real fallback path runs, not a flag that skips it.
NO_URING_CHILD = textwrap.dedent("""
    import ctypes, sys, time, warnings
    import numpy as np

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                    ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    LD_NR, JEQ, RET = 0x20, 0x15, 0x06
    prog = (Insn * 4)(Insn(LD_NR, 0, 0, 0), Insn(JEQ, 0, 1, 425),
                      Insn(RET, 0, 0, 0x00050000 | 1), Insn(RET, 0, 0, 0x7FFF0000))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    fprog = Prog(4, ctypes.cast(prog, ctypes.POINTER(Insn)))
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()

    from kvtier.errors import KvtierError
    from kvtier.pool import HostPool
    from kvtier.tiers.disk import DiskTier, record_bytes
    BLOCK = 16384
    d = sys.argv[1]
    with HostPool(16, record_bytes(BLOCK)) as p:
        forced = DiskTier(d + "/forced", 64 * record_bytes(BLOCK), BLOCK, backend="io_uring")
        try:
            forced.attach(p)
            print("forced io_uring attached")
        except KvtierError as e:
            print("forced:", type(e).__name__, e)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t = DiskTier(d + "/auto", 64 * record_bytes(BLOCK), BLOCK)
            t.attach(p)
        print("backend:", t.backend)
        print("warning:", " | ".join(str(x.message) for x in w))
        rng = np.random.default_rng(3)
        data = rng.integers(0, 256, (8, BLOCK), dtype=np.uint8)
        for j in range(8):
            p.view(j)[:BLOCK] = data[j]
        keys = [b"k%d" % j for j in range(8)]
        def wait(tok):
            for _ in range(20000):  # 10 s at most
                for c in t.poll():
                    if c.token == tok:
                        return c.key_ok
                time.sleep(0.0005)
            raise SystemExit("disk job did not finish")
        print("stored:", all(wait(t.submit_store(keys, list(range(8))))))
        p.view(8, 8)[:] = 0
        print("loaded:", all(wait(t.submit_load(keys, list(range(8, 16))))))
        print("same bytes:", all(bytes(p.view(8 + j)[:BLOCK]) == data[j].tobytes() for j in range(8)))
        t.close()
""")


def test_io_uring_refused_by_seccomp_falls_back_to_pread(tmp_path: Path) -> None:
    (tmp_path / "forced").mkdir(mode=0o700)
    (tmp_path / "auto").mkdir(mode=0o700)
    script = tmp_path / "child.py"
    script.write_text(NO_URING_CHILD)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert lines["forced"] == "IoError [Errno 1] io_uring_queue_init: Operation not permitted"
    assert lines["backend"] == "pread"
    assert "io_uring unavailable" in lines["warning"] and "pread/pwrite" in lines["warning"]
    assert lines["stored"] == "True" and lines["loaded"] == "True"
    assert lines["same bytes"] == "True"
