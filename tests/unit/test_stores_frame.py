"""An engine's STORES frame written natively (kvtier._native.StoresFrame,
csrc/bindings/stores_frame.cc) is, byte for byte, msgpack's frame of the
same begins and ends as the protocol defines it; it refuses bad input
before writing anything."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier._native import StoresFrame
from kvtier.errors import InvalidArgument
from kvtier.node import protocol as P

_keys = st.lists(st.binary(min_size=0, max_size=300), max_size=20)
_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_reqs = st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=300)
_calls = st.lists(
    st.tuples(_keys, st.booleans(), st.data()),
    max_size=12,
)


def _model(calls: list[tuple[list[bytes], list[int] | None, Any]]) -> bytes | None:
    """The frame NodeClient built before: lists, packed by msgpack."""
    keys: list[bytes] = []
    slots: list[int] = []
    reqs: list[Any] = []
    counts: list[int] = []
    for ks, ss, req in calls:
        if not ks:
            continue
        keys += ks
        if ss is not None:
            slots += ss
            reqs.append(req)
            counts.append(len(ks))
        elif counts and counts[-1] < 0:
            counts[-1] -= len(ks)
        else:
            reqs.append(None)
            counts.append(-len(ks))
    return P.pack([int(P.Op.STORES), keys, slots, reqs, counts]) if keys else None


@settings(max_examples=300, deadline=None)
@given(calls=_calls)
def test_the_frame_is_msgpacks(calls: list[tuple[list[bytes], bool, Any]]) -> None:
    frame = StoresFrame(P.MAX_FRAME)
    done = []
    for ks, is_begin, data in calls:
        if is_begin:
            ss = data.draw(st.lists(_ints, min_size=len(ks), max_size=len(ks)))
            req = data.draw(_reqs)
            frame.begin(ks, ss, req)
            done.append((ks, ss, req))
        else:
            frame.end(ks)
            done.append((ks, None, None))
    assert len(frame) == sum(len(ks) for ks, _, _ in done)
    assert frame.take() == _model(done)
    assert len(frame) == 0 and frame.take() is None


def test_long_arrays_take_their_long_headers() -> None:
    keys = [i.to_bytes(4, "big") for i in range(70_000)]  # past array16
    frame = StoresFrame(P.MAX_FRAME)
    frame.begin(keys[:20], list(range(20)), "r")
    frame.end(keys)
    assert frame.take() == _model([(keys[:20], list(range(20)), "r"), (keys, None, None)])


@pytest.mark.parametrize(
    ("keys", "slots", "req", "message"),
    [
        ([b"k", "k"], [1, 2], None, "keys must be bytes"),
        ([b"k"], [1, 2], None, "a slot a key"),
        ([b"k"], [True], None, "slots must be ints"),
        ([b"k"], [2**63], None, "past 64 bits"),
        ([b"k"], [1], 1.5, "a request id is None, an int or a str"),
        ([b"k"], [1], (1,), "a request id is None, an int or a str"),
        ([b"k"], [1], 2**64, "past 64 bits"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    keys: list[Any], slots: list[Any], req: Any, message: str
) -> None:
    frame = StoresFrame(P.MAX_FRAME)
    frame.begin([b"a"], [7], "r")
    with pytest.raises(InvalidArgument, match=message):
        frame.begin(keys, slots, req)
    with pytest.raises(InvalidArgument, match="keys must be bytes"):
        frame.end([b"k", None])  # type: ignore[list-item]
    assert frame.take() == _model([([b"a"], [7], "r")])


def test_a_frame_past_the_limit_is_refused_and_dropped() -> None:
    frame = StoresFrame(64)
    frame.end([b"k" * 40, b"j" * 40])
    with pytest.raises(InvalidArgument, match="exceeds the limit of 64"):
        frame.take()
    assert len(frame) == 0 and frame.take() is None
