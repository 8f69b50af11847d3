"""units.py (sizes, durations) and the tier-job layer (tiers/jobs.py) with a
scripted engine: Busy part way through a batch, cancelled and timed-out
jobs, held memory released later, batches returned in the order they end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kvtier
import pytest
from kvtier.codes import ItemStatus
from kvtier.tiers.jobs import TierJobs, count_moved, new_counters
from kvtier.units import parse_duration, parse_size, to_bytes


def test_sizes() -> None:
    assert parse_size("65536") == 65536
    assert parse_size("256KiB") == 256 << 10
    assert parse_size(" 2 MiB ") == 2 << 20
    assert parse_size("1GB") == 10**9
    assert parse_size("1.5k") == 1536
    assert to_bytes("k", 4096) == 4096 and to_bytes("k", "4KiB") == 4096
    for bad in ("", "KiB", "12XB", "0", "-1"):
        with pytest.raises(kvtier.InvalidArgument):
            parse_size(bad)
    with pytest.raises(kvtier.InvalidArgument, match="kvtier_host_bytes"):
        to_bytes("kvtier_host_bytes", True)
    with pytest.raises(kvtier.InvalidArgument, match="kvtier_host_bytes"):
        to_bytes("kvtier_host_bytes", 0)


def test_durations() -> None:
    assert parse_duration("30") == 30.0
    assert parse_duration("250ms") == pytest.approx(0.25)
    assert parse_duration("2min") == 120.0
    for bad in ("", "s", "5 parsecs", "0"):
        with pytest.raises(kvtier.InvalidArgument):
            parse_duration(bad)


@dataclass
class _Result:
    job_id: int
    ok: bool = True
    items: list[int] = field(default_factory=list)
    timed_out: bool = False
    held: bool = False
    released: bool = False


class _Engine:
    """Accepts ``capacity`` jobs, then says Busy; results are scripted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.next_id = 0
        self.out: list[_Result] = []
        self.closed = False

    def submit(self, first: int, count: int) -> int:
        if self.capacity == 0:
            raise kvtier.Busy("full")
        self.capacity -= 1
        self.next_id += 1
        return self.next_id

    def poll(self) -> list[Any]:
        out, self.out = self.out, []
        return out

    def close(self) -> None:
        self.closed = True


def test_busy_part_way_ends_the_rest_busy() -> None:
    eng = _Engine(capacity=2)
    jobs = TierJobs(eng, new_counters())
    b = jobs.batch("store", 10, keys=["k"] * 10)
    assert jobs.submit(b, 3, eng.submit)  # jobs of items 0-2 and 3-5, then Busy
    assert jobs.in_flight() == {1, 2} and jobs.busy()
    eng.out = [_Result(2, items=[0, 0, 0]), _Result(1, items=[0, 5, 0])]
    ended, released = jobs.poll()
    assert ended == [b] and released == []
    assert b.items == [0, 5, 0, 0, 0, 0] + [ItemStatus.BUSY] * 4
    assert not jobs.busy()


def test_busy_before_any_job_queues_nothing() -> None:
    eng = _Engine(capacity=0)
    jobs = TierJobs(eng, new_counters())
    assert not jobs.submit(jobs.batch("load", 4), 2, eng.submit)
    assert not jobs.busy()


def test_timed_out_job_holds_its_items_until_released() -> None:
    eng = _Engine(capacity=8)
    counters = new_counters()
    jobs = TierJobs(eng, counters)
    a = jobs.batch("store", 4)
    b = jobs.batch("load", 2)
    assert jobs.submit(a, 2, eng.submit) and jobs.submit(b, 2, eng.submit)
    empty = jobs.batch("load", 0)
    assert jobs.submit(empty, 2, eng.submit)  # no items: ends at the next poll
    eng.out = [
        _Result(3, ok=False),  # b cancelled before it ran
        _Result(1, ok=False, timed_out=True, held=True),
        _Result(2, items=[0, 0]),
    ]
    ended, released = jobs.poll()
    assert ended == [empty, b, a]  # in the order they ended
    assert b.items == [ItemStatus.CANCELLED] * 2
    assert a.items == [ItemStatus.TIMED_OUT] * 2 + [0, 0]
    assert a.held == [True, True, False, False]
    assert counters["timeouts"] == 2 and jobs.held_jobs == 1 and jobs.busy()
    eng.out = [_Result(1, ok=False, released=True)]
    ended, released = jobs.poll()
    assert ended == [] and [(r.batch, r.first, r.count) for r in released] == [(a, 0, 2)]
    assert not jobs.busy()
    jobs.close()
    assert eng.closed


def test_count_moved() -> None:
    c = new_counters("extra")
    count_moved(c, "store", 3, 100)
    count_moved(c, "load", 2, 100)
    assert (c["stores"], c["bytes_written"], c["loads"], c["bytes_read"], c["extra"]) == (
        3, 300, 2, 200, 0,
    )  # fmt: skip


class _BudgetEngine(_Engine):
    """Holds ``used`` bytes of a ``limit``-byte budget in flight."""

    def __init__(self, used: int, limit: int) -> None:
        super().__init__(capacity=100)
        self.used, self.limit = used, limit

    def in_flight_bytes(self) -> int:
        return self.used

    def budget(self) -> int:
        return self.limit


def test_a_batch_that_would_not_fit_the_budget_is_busy_as_a_whole() -> None:
    eng = _BudgetEngine(used=60, limit=100)
    jobs = TierJobs(eng, new_counters())
    b = jobs.batch("store", 10, keys=["k"] * 10)
    assert not jobs.submit(b, 2, eng.submit, item_bytes=5)  # 60 + 50 > 100: nothing queued
    assert eng.next_id == 0 and not jobs.in_flight()
    assert jobs.submit(b, 2, eng.submit, item_bytes=4)  # 60 + 40 fits: five jobs
    assert eng.next_id == 5
    eng.used = 0  # alone, a batch goes whatever its size (part way Busy stays possible)
    alone = jobs.batch("store", 10, keys=["k"] * 10)
    assert jobs.submit(alone, 2, eng.submit, item_bytes=1000)
    assert eng.next_id == 10
