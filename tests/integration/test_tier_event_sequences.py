"""Exact event sequences of the disk tier (issue 35 item 1): every block it
announced stored is announced removed when it goes (eviction, a dropped
unreadable record, reset), at any size, named by key or by event id
(index only: ``no_data``, so these need no device)."""

from __future__ import annotations

from pathlib import Path

from kvtier.tiers import LookupResult
from kvtier.tiers.base import TierEvent
from kvtier.tiers.disk import DiskTier, record_bytes
from kvtier.tiers.events import vllm_event_id

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
