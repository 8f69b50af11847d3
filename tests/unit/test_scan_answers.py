"""kvtier._native.ScanAnswers: an engine's per-key lookup against a node
(NodeManager.lookup), the stored answer popped and counted, the fallback
asked for a key without one."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from kvtier._native import scan_answers
from kvtier.errors import InvalidArgument
from kvtier.tiers.base import LookupResult as R

RESULTS = (R.MISS, R.HIT, R.HIT_PENDING, R.RETRY)
NAMES = ("miss", "hit", "hit_pending", "retry")


def _counts() -> dict[str, int]:
    return {"hit": 0, "hit_pending": 0, "retry": 0, "miss": 0}


def test_a_stored_answer_is_taken_once_and_counted_by_name() -> None:
    asked: list[tuple[bytes, Any]] = []

    def fallback(key: bytes, ctx: Any) -> tuple[R, int]:
        asked.append((key, ctx))
        return (R.MISS, -1)

    answers: dict[bytes, tuple[R, int]] = {b"a": (R.HIT, 7), b"b": (R.HIT_PENDING, -1)}
    counts = _counts()
    lookup = scan_answers(answers, counts, RESULTS, NAMES, fallback).lookup
    assert lookup(b"a") is R.HIT
    assert lookup(b"b", "req-1") is R.HIT_PENDING
    assert answers == {}
    assert asked == []
    # Taken already: the fallback answers now, with the context as passed.
    assert lookup(b"a", req_context="req-2") is R.MISS
    assert lookup(b"c") is R.MISS
    assert asked == [(b"a", "req-2"), (b"c", None)]
    assert counts == {"hit": 1, "hit_pending": 1, "retry": 0, "miss": 2}


def test_a_name_missing_from_the_counts_starts_at_one() -> None:
    counts: dict[str, int] = {}
    lookup = scan_answers({b"k": (R.RETRY, -1)}, counts, RESULTS, NAMES, lambda k, c: None).lookup
    assert lookup(b"k") is R.RETRY
    assert counts == {"retry": 1}


def test_bad_calls_and_answers_raise_and_change_nothing() -> None:
    def fallback(key: bytes, ctx: Any) -> Any:
        if key == b"boom":
            raise KeyError("from the fallback")
        return "not a tuple"

    answers: dict[Any, Any] = {b"x": (R.HIT, 1)}
    counts = _counts()
    lookup = scan_answers(answers, counts, RESULTS, NAMES, fallback).lookup
    with pytest.raises(TypeError, match=r"lookup\(key, req_context=None\)"):
        lookup()
    with pytest.raises(TypeError, match=r"lookup\(key, req_context=None\)"):
        lookup(b"x", None, None)
    with pytest.raises(TypeError, match=r"lookup\(key, req_context=None\)"):
        lookup(b"x", ctx=None)
    with pytest.raises(TypeError, match=r"lookup\(key, req_context=None\)"):
        lookup(b"x", None, req_context=None)
    with pytest.raises(TypeError, match="unhashable"):
        lookup([b"x"])
    with pytest.raises(KeyError, match="from the fallback"):
        lookup(b"boom")
    with pytest.raises(TypeError, match=r"a \(result, slot\) tuple"):
        lookup(b"y")
    assert answers == {b"x": (R.HIT, 1)}
    assert counts == _counts()


def test_bad_construction_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="4 results and their 4 names"):
        scan_answers({}, {}, RESULTS[:3], NAMES[:3], print)
    with pytest.raises(InvalidArgument, match="fallback must be callable"):
        scan_answers({}, {}, RESULTS, NAMES, None)


def test_a_manager_holding_its_own_answers_is_collected() -> None:
    """The fallback is a bound method of the object that holds the
    ScanAnswers: a cycle the collector must see through."""

    class Owner:
        def __init__(self) -> None:
            self.front = scan_answers({}, {}, RESULTS, NAMES, self.fallback)

        def fallback(self, key: bytes, ctx: Any) -> tuple[R, int]:
            return (R.MISS, -1)

    o = Owner()
    gone = weakref.ref(o)
    assert o.front.lookup(b"k") is R.MISS
    del o
    gc.collect()
    assert gone() is None
