"""A tier's events not taken are bounded (EventLog): a tier driven without
the manager, whose events nobody takes, keeps at most its bound of keys and
counts exactly what it dropped (``events_dropped`` in its stats)."""

from __future__ import annotations

import sys
from pathlib import Path

import kvtier
import pytest
from kvtier.tiers import MemoryTier, TierEvent
from kvtier.tiers.disk import DiskTier, record_bytes
from kvtier.tiers.events import EventLog
from kvtier.tiers.staged import StagedTier


def K(i: int) -> bytes:
    return b"key-%08d" % i


def ev(*ids: int, removed: bool = False) -> TierEvent:
    return TierEvent([K(i) for i in ids], "t", removed)


def test_the_log_drops_the_oldest_keys_and_counts_them() -> None:
    log = EventLog(5)
    log.append(ev(0, 1, 2))
    log.append(ev(3, 4))
    assert len(log) == 5 and log.dropped == 0
    log.append(ev(5, 6))  # two over: the oldest event loses its first two keys
    assert len(log) == 5 and log.dropped == 2
    log.append(ev(7, removed=True))  # K(2) goes, and its event with it
    assert len(log) == 5 and log.dropped == 3
    got = log.take()
    assert [(e.keys, e.removed) for e in got] == [
        ([K(3), K(4)], False),
        ([K(5), K(6)], False),
        ([K(7)], True),
    ]
    assert len(log) == 0 and log.take() == [] and log.dropped == 3


def test_a_cut_event_is_taken_without_its_dropped_keys() -> None:
    log = EventLog(4)
    log.append(ev(0, 1, 2))
    log.append(ev(3, 4))  # one over: K(0) is dropped lazily
    (first, second) = log.take()
    assert first.keys == [K(1), K(2)] and second.keys == [K(3), K(4)]


def test_an_event_larger_than_the_bound_keeps_its_newest_keys() -> None:
    log = EventLog(3)
    log.append(ev(*range(10)))
    assert len(log) == 3 and log.dropped == 7
    assert [e.keys for e in log.take()] == [[K(7), K(8), K(9)]]
    nothing = EventLog(0)
    nothing.append(ev(1, 2))
    assert len(nothing) == 0 and nothing.dropped == 2 and nothing.take() == []
    with pytest.raises(kvtier.InvalidArgument, match="must be >= 0"):
        EventLog(-1)


def test_a_disk_tier_nobody_takes_events_from_stays_bounded(tmp_path: Path) -> None:
    """Without the manager: more stores than the bound, no take_events."""
    bound, stores, batch = 64, 1000, 10
    t = DiskTier(
        tmp_path, 2 * stores * record_bytes(4096), 4096, no_data=True, event_log_keys=bound
    )
    try:
        held = []
        for first in range(0, stores, batch):
            keys = [K(i) for i in range(first, first + batch)]
            assert t.submit_store(keys, list(range(batch))) is not None
            assert all(c.ok for c in t.poll())
            held.append(len(t._events))
        assert max(held) == bound  # never more
        assert sys.getsizeof(t._events._events) < 4096  # a few events, not a thousand keys' worth
        assert t.stats()["events_dropped"] == stores - bound
        got = [k for e in t.take_events() for k in e.keys]
        assert got == [K(i) for i in range(stores - bound, stores)]  # the newest, in order
        assert t.stats()["events_dropped"] == stores - bound
    finally:
        t.close()


def test_memory_and_staged_tiers_report_what_they_dropped(tmp_path: Path) -> None:
    m = MemoryTier(event_log_keys=2)
    assert m.submit_store([K(0), K(1), K(2)], [0, 1, 2]) is not None
    m.poll()
    assert m.stats()["events_dropped"] == 1
    assert [e.keys for e in m.take_events()] == [[K(1), K(2)]]

    stages = [MemoryTier(name=f"s{i}", delay_polls=1, event_log_keys=1) for i in range(2)]
    s = StagedTier(stages, [None, None], "staged", event_log_keys=2)
    s.attach(None)
    for i in range(3):
        assert s.submit_store([K(i)], [i]) is not None
        s.poll()
    st = s.stats()
    # Each stage kept 1 of its 3 stored keys; the staged log kept 2 of 3.
    assert st["events_dropped"] == 2 * 2 + 1
    assert [e.keys for e in s.take_events()] == [[K(1)], [K(2)]]


def test_ids_count_toward_the_bound_and_are_cut_after_keys() -> None:
    log = EventLog(3)
    log.append(TierEvent([K(0)], "t", True, ids=[b"i" * 12, b"j" * 12]))
    log.append(TierEvent([], "t", True, ids=[b"k" * 12]))  # one over: K(0) goes first
    assert len(log) == 3 and log.dropped == 1
    first, second = log.take()
    assert first.keys == [] and first.ids == [b"i" * 12, b"j" * 12]
    assert second.ids == [b"k" * 12]
    log.append(TierEvent([K(1)], "t", True, ids=[b"a" * 12, b"b" * 12, b"c" * 12]))
    (cut,) = log.take()  # larger than the bound: its key is dropped
    assert cut.keys == [] and cut.ids == [b"a" * 12, b"b" * 12, b"c" * 12]
    assert log.dropped == 2
