"""Exact event sequences (issue 35 item 1). The disk tier alone: every block
it announced stored is announced removed when it goes (eviction, a dropped
unreadable record, reset), at any size, named by key or by event id (index
only: ``no_data``, so these need no device). Then host, disk and Redis
through the manager, with faults: a corrupt record, a reset while blocks are
written and promoted, ENOSPC under the disk tier, Redis killed."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import block_content
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.base import TierEvent
from kvtier.tiers.disk import DiskTier, record_bytes
from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.host import HostTier
from kvtier.tiers.records import key_digest
from kvtier.tiers.remote import RemoteTier
from test_disk_safety import fill, small_fs  # noqa: F401 (a fixture)

BLOCK = 4096


def V(i: int, group: int = 0) -> bytes:
    """A key of vLLM's shape: a 32-byte block hash, then its group index."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def names(e: TierEvent) -> list[bytes]:
    return [vllm_event_id(k) for k in e.keys] + list(e.ids)


def tier(path: Path, records: int) -> DiskTier:
    return DiskTier(path, records * record_bytes(BLOCK), BLOCK, no_data=True)


def store(t: DiskTier, keys: list[bytes]) -> None:
    assert t.submit_store(keys, list(range(len(keys)))) is not None
    assert all(c.ok for c in t.poll())


def test_a_tier_larger_than_4096_records_names_every_eviction(tmp_path: Path) -> None:
    # 20,000 blocks through 2,000 records (the recency map named only the
    # last 4,096 stores: a tier this size used to report no removal at all).
    t = tier(tmp_path, 2000)
    held: dict[bytes, int] = {}  # event id -> net announcements
    stored = removed = 0
    for first in range(0, 20_000, 64):
        store(t, [V(i, i % 3) for i in range(first, min(first + 64, 20_000))])
        for e in t.take_events():
            for n in names(e):
                held[n] = held.get(n, 0) + (-1 if e.removed else 1)
            if e.removed:
                removed += len(names(e))
            else:
                stored += len(names(e))
    assert stored == 20_000 and removed == t.stats()["evictions"] == 18_000
    now = {n for n, c in held.items() if c}
    assert all(c in (0, 1) for c in held.values())  # never removed before stored
    assert now == {vllm_event_id(V(i, i % 3)) for i in range(18_000, 20_000)}
    assert len(now) == len(t.index) == 2000  # stored minus removed is what it holds
    t.close()


def test_an_exact_sequence_through_evictions_a_drop_a_restart_and_a_reset(
    tmp_path: Path,
) -> None:
    t = tier(tmp_path, 4)
    keys = [V(i, 1) for i in range(7)]
    store(t, keys[:4])
    assert [(e.removed, e.keys, list(e.ids)) for e in t.take_events()] == [(False, keys[:4], [])]
    store(t, keys[4:5])  # LRU: keys[0] goes, named by event id
    assert [(e.removed, e.keys, list(e.ids)) for e in t.take_events()] == [
        (True, [], [keys[0][-12:]]),
        (False, keys[4:5], []),
    ]
    # A worker failed to read keys[1]: dropped, named by event id.
    loc, digs = t.pin_for_read([keys[1]])
    t.unpin_read(loc[:, 0].tolist())
    t.read_failed(loc, digs)
    assert t.lookup(keys[1]) is LookupResult.MISS
    assert [(e.removed, e.keys, list(e.ids)) for e in t.take_events()] == [
        (True, [], [keys[1][-12:]])
    ]
    t.close()
    t = tier(tmp_path, 4)  # recovered: 2, 3, 4, still named
    assert t.stats()["recovered"] == 3
    store(t, keys[5:7])  # one free record, then keys[2] goes
    assert [(e.removed, e.keys, list(e.ids)) for e in t.take_events()] == [
        (True, [], [keys[2][-12:]]),
        (False, keys[5:7], []),
    ]
    t.reset()
    (gone,) = t.take_events()
    assert gone.removed and sorted(gone.ids) == sorted(k[-12:] for k in (keys[3], *keys[4:7]))
    assert len(t.index) == 0 and t.stats()["unnamed_removals"] == 0
    t.close()


# -- host + disk + Redis through the manager (issue 35 item 1) ---------------
#
# Each step is one script line, then every tier's completions drained; the
# events of that step are compared exactly: (tier, op, blocks by index),
# blocks named by key or by event id alike (see ``seen``).

SEQ_BLOCK = 4096
Seq = list[tuple[str, str, list[int]]]


def seen(events: list[TierEvent]) -> Seq:
    """Events as (tier, "stored" | "removed" | "forgotten", block indexes): a
    key ``V(i)`` and its event id both give ``i``; "forgotten" is a
    metadata-only removal (a block never announced stored)."""
    return [
        (e.tier, "forgotten" if e.metadata_only else "removed" if e.removed else "stored",
         [int.from_bytes(k[:32], "big") for k in e.keys]
         + [int.from_bytes(n[:8], "big") for n in e.ids])
        for e in events
    ]  # fmt: skip


def drained(m: TieredOffloadingManager) -> Seq:
    """A step end, then step ends until no tier has work; the events."""
    m.on_schedule_end()
    deadline = time.monotonic() + 30
    while m.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not end"
        time.sleep(0.002)
        m.on_schedule_end()
    return seen(m.take_events())


def offer(m: TieredOffloadingManager, ids: list[int], complete: bool = True) -> list[bytes]:
    """The engine stores blocks ``ids`` in the host tier (their bytes put in
    the slots it got); completed unless told not to."""
    out = m.prepare_store([V(i) for i in ids])
    assert out is not None and out.keys_to_store == [V(i) for i in ids]
    pool = m.host.pool
    assert pool is not None
    for k, s in zip(out.keys_to_store, out.store_spec.slots.tolist()):
        pool.view(s)[:SEQ_BLOCK] = block_content(int.from_bytes(k[:32], "big"), SEQ_BLOCK)
    if complete:
        m.complete_store(out.keys_to_store)
    return out.keys_to_store


def holds(history: Seq) -> dict[str, set[int]]:
    """What each tier holds by its events: stored minus removed, in order
    (a block is never removed before it was stored, nor stored twice, nor
    forgotten while held)."""
    out: dict[str, set[int]] = {}
    for tier, op, blocks in history:
        have = out.setdefault(tier, set())
        for b in blocks:
            if op == "forgotten":
                assert b not in have, (tier, op, b)
                continue
            assert (b in have) == (op == "removed"), (tier, op, b)
            (have.discard if op == "removed" else have.add)(b)
    return out


def disk_holds(disk: DiskTier, ids: range) -> set[int]:
    return {i for i in ids if disk.lookup(V(i)) is LookupResult.HIT}


def corrupt(disk: DiskTier, key: bytes) -> None:
    """Spoil ``key``'s record on disk (its payload: the crc32c no longer matches)."""
    rec = disk.index.get(key_digest(key))
    assert rec is not None
    f, off = disk._locate(int(rec))
    fd = os.open(disk.paths[f], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * 64, off + 128)
    finally:
        os.close(fd)


@contextlib.contextmanager
def tiers(
    disk_dir: Path, url: str, host_slots: int, disk_records: int, **remote: Any
) -> Iterator[tuple[TieredOffloadingManager, DiskTier, RemoteTier]]:
    """A manager over a host tier of ``host_slots``, a disk tier of
    ``disk_records`` and Redis at ``url`` (a namespace of its own; what a
    tier learnt about Redis is kept for the whole test)."""
    pool = HostPool(host_slots, record_bytes(SEQ_BLOCK))
    disk = DiskTier(disk_dir, disk_records * record_bytes(SEQ_BLOCK), SEQ_BLOCK, reserve_bytes=0)
    redis = RemoteTier(url, SEQ_BLOCK, namespace=str(uuid.uuid4()), known_ttl_s=3600.0, **remote)
    # Plain LRU in the host tier: these sequences follow blocks through the
    # tiers, not prefixes (their offers are not chains).
    m = TieredOffloadingManager(HostTier(pool, host_slots, prefix_aware=False), [disk, redis])
    try:
        yield m, disk, redis
    finally:
        m.shutdown()
        pool.close()


def test_host_disk_and_redis_through_evictions_a_corrupt_record_and_a_reset(
    tmp_path: Path, redis_standalone: Any
) -> None:
    history: Seq = []

    def step(got: Seq, want: Seq) -> None:
        assert got == want
        history.extend(got)

    with tiers(tmp_path, redis_standalone.url, host_slots=3, disk_records=4) as (m, disk, redis):
        offer(m, [0, 1, 2])
        step(drained(m), [("host", "stored", [0, 1, 2]), ("disk", "stored", [0, 1, 2]),
                          ("remote", "stored", [0, 1, 2])])  # fmt: skip
        # The host tier evicts its oldest; the disk tier fills up.
        offer(m, [3])
        step(drained(m), [("host", "removed", [0]), ("host", "stored", [3]),
                          ("disk", "stored", [3]), ("remote", "stored", [3])])  # fmt: skip
        # Both evict: the disk tier names its victim by event id.
        offer(m, [4])
        step(drained(m), [("host", "removed", [1]), ("host", "stored", [4]),
                          ("disk", "removed", [0]), ("disk", "stored", [4]),
                          ("remote", "stored", [4])])  # fmt: skip
        # A corrupt record: its promotion fails its check, the disk tier drops
        # it; the block promoted never became readable, so the host tier only
        # forgets it (a metadata-only removal: the lookup said HIT_PENDING),
        # and removes the block it evicted for the slot.
        corrupt(disk, V(1))
        assert m.lookup(V(1)) is LookupResult.HIT_PENDING
        step(drained(m), [("host", "removed", [2]), ("host", "forgotten", [1]),
                          ("disk", "removed", [1])])  # fmt: skip
        assert disk.stats()["corrupt"] == 1 and m.stats.promotion_failures == 1
        # Looked up again: Redis has it.
        assert m.lookup(V(1)) is LookupResult.HIT_PENDING
        step(drained(m), [("host", "stored", [1])])
        assert m.lookup(V(1)) is LookupResult.HIT
        # A reset while a block is being written (5) and one promoted (2):
        # neither was ever announced, so only the readable one (1) is removed.
        offer(m, [5], complete=False)
        assert m.lookup(V(2)) is LookupResult.HIT_PENDING
        m.reset_cache()
        m.complete_store([V(5)])  # too late: the reset dropped it
        m.on_reset_flushed()
        step(drained(m), [("host", "removed", [3]), ("host", "removed", [4]),
                          ("host", "removed", [1])])  # fmt: skip
        assert len(m.host) == 0
        held = holds(history)
        assert held["host"] == set()
        assert held["disk"] == disk_holds(disk, range(6)) == {2, 3, 4}
        assert held["remote"] == {0, 1, 2, 3, 4}
        assert redis.stats()["stores"] == 5


def test_enospc_on_the_disk_tier_announces_the_victim_not_the_failed_write(
    small_fs: Path,  # noqa: F811
    redis_standalone: Any,
) -> None:
    """The file system full under a record the disk tier reuses (a hole
    punched in its slab file, then every free byte taken): the write of the
    new block fails with ENOSPC and is never announced; its record's former
    block was evicted for it, and that removal is announced. Once there is
    room again the next block lands in that record."""
    history: Seq = []
    with tiers(small_fs, redis_standalone.url, host_slots=2, disk_records=2) as (m, disk, _):
        offer(m, [0, 1])
        history += drained(m)
        assert history == [("host", "stored", [0, 1]), ("disk", "stored", [0, 1]),
                           ("remote", "stored", [0, 1])]  # fmt: skip
        rec = disk.index.get(key_digest(V(0)))  # the disk tier's next victim
        assert rec is not None
        f, off = disk._locate(int(rec))
        punch_hole(disk.paths[f], off, record_bytes(SEQ_BLOCK))
        hog = fill(small_fs)
        offer(m, [2])
        got = drained(m)
        assert got == [("host", "removed", [0]), ("host", "stored", [2]),
                       ("disk", "removed", [0]), ("remote", "stored", [2])]  # fmt: skip
        history += got
        assert disk.stats()["io_errors"] == 1 and disk.lookup(V(2)) is LookupResult.MISS
        assert disk.stats()["io_error_codes"] == {"ENOSPC": 1}  # a full disk, not a failing one
        hog.unlink()
        while not disk.admit(V(3)):  # the tier stops taking blocks for a while after ENOSPC
            time.sleep(0.05)
        offer(m, [3])
        got = drained(m)
        assert got == [("host", "removed", [1]), ("host", "stored", [3]),
                       ("disk", "stored", [3]), ("remote", "stored", [3])]  # fmt: skip
        history += got
        held = holds(history)
        assert held["disk"] == disk_holds(disk, range(4)) == {1, 3}
        assert held["host"] == {2, 3}


def test_redis_killed_mid_run_stores_it_never_acknowledged_are_not_announced(
    tmp_path: Path,
) -> None:
    from kvtier.bench.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis")
    (tmp_path / "disk").mkdir()
    try:
        with tiers(tmp_path / "disk", server.url, 2, 4, timeout_s=0.5) as (m, _, redis):
            offer(m, [0])
            assert drained(m) == [("host", "stored", [0]), ("disk", "stored", [0]),
                                  ("remote", "stored", [0])]  # fmt: skip
            server.kill()
            offer(m, [1, 2])  # cascaded at the step end, to a server that is gone
            assert drained(m) == [("host", "removed", [0]), ("host", "stored", [1, 2]),
                                  ("disk", "stored", [1, 2])]  # fmt: skip
            assert redis.stats()["stores"] == 1 and redis.stats()["io_errors"] >= 2
    finally:
        server.stop()


def punch_hole(path: str, offset: int, length: int) -> None:
    """Give ``length`` bytes at ``offset`` of ``path`` back to the file system
    (fallocate PUNCH_HOLE | KEEP_SIZE): a later write there needs new pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, 0x02 | 0x01, offset, length) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        os.close(fd)
