"""kvtier.jobs.Joined: parent jobs made of parts, checked against the cases
its users meet (parts ending out of order, a refused submission part way,
a parent with no part, held parts released later)."""

from __future__ import annotations

import pytest
from kvtier.jobs import Joined


def test_a_parent_ends_with_its_last_part_in_item_order() -> None:
    j: Joined[str, int, str] = Joined()
    j.add("a", 1, first=4, count=4)
    j.add("a", 2, first=0, count=4)
    j.add("b", 3)
    j.seal("a")
    j.seal("b")
    assert j.done(2, "second") is None
    assert j.done(3, "b-only") == "b"
    assert j.subs("a") == [1]
    assert j.done(1, "first") == "a"
    ended = j.take_ended()
    assert [e.parent for e in ended] == ["b", "a"]  # the order they ended
    assert [(p.sub, p.first, p.result) for p in ended[1].parts] == [
        (2, 0, "second"),
        (1, 4, "first"),
    ]
    assert j.take_ended() == [] and len(j) == 0 and not j.busy()


def test_a_parent_ends_only_once_sealed_and_at_once_without_parts() -> None:
    j: Joined[int, int, bool] = Joined()
    j.add(7, 70)
    assert j.done(70, True) is None  # more parts may come
    j.add(7, 71)
    j.seal(7, missing_from=2)  # items from 2 on were never submitted (Busy)
    assert j.done(71, False) == 7
    (e,) = j.take_ended()
    assert e.results == [True, False] and e.missing_from == 2
    j.seal(8)  # nothing was submitted
    assert [e.parent for e in j.take_ended()] == [8]
    j.add(9, 90)
    j.seal(9)
    with pytest.raises(RuntimeError, match="sealed"):
        j.add(9, 91)


def test_held_parts_are_released_later_and_unknown_parts_ignored() -> None:
    j: Joined[str, int, str] = Joined()
    j.add("a", 1, first=0, count=3)
    j.seal("a")
    assert j.done(99, "stray") is None  # not in flight: ignored
    assert j.done(1, "timed out", held=True) == "a"
    assert j.held == 1 and j.busy()
    j.take_ended()
    got = j.release(1)
    assert got is not None and got[0] == "a" and (got[1].first, got[1].count) == (0, 3)
    assert j.release(1) is None and j.held == 0 and not j.busy()
    with pytest.raises(RuntimeError, match="in flight"):
        j.add("b", 2)
        j.add("c", 2)
