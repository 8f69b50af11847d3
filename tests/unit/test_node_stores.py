"""The node's STORES frame in one native pass (kvtier._native.adopt_stores,
csrc/bindings/node_stores.cc) against the Python path it stands for
(Session.stores through TieredOffloadingManager.adopt_store): the same
frames leave the same index, leases, chains and errors. And the native
chain rule (csrc/bindings/chains.h, which kvtier.scheduler.chains and the
native frame both use) against a model of it written out here."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier import _native
from kvtier.node.chunks import Region, open_region
from kvtier.node.classes import build_class
from kvtier.node.protocol import ProtocolError
from kvtier.node.state import Session
from kvtier.options.tiers import HostOptions
from kvtier.scheduler.chains import offer_parents

NS = "ab" * 16


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(12, "big") + group.to_bytes(4, "big")


KEYS = [key(i, i % 3) for i in range(10)] + [b"short-" + bytes([i]) for i in range(2)]


# -- chains ------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    offer=st.lists(st.sampled_from(KEYS), max_size=12),
    last=st.none() | st.dictionaries(st.sampled_from([k[-4:] for k in KEYS] + [b""]),
                                     st.sampled_from(KEYS), max_size=3),
    miss=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(KEYS), max_size=4),
)  # fmt: skip
def test_native_chains_are_the_rule(
    offer: list[bytes], last: dict[bytes, bytes] | None, miss: dict[bytes, bytes]
) -> None:
    last2, miss2 = (None if last is None else dict(last)), dict(miss)
    want = _model_parents(offer, last, miss)
    got = offer_parents(offer, last2, miss2)
    # None for the whole offer and a None for each key name the same parents.
    assert (got if got is not None else [None] * len(offer)) == want
    assert (last2, miss2) == (last, miss)


def _model_parents(
    offer: list[bytes], last: dict[bytes, bytes] | None, miss: dict[bytes, bytes]
) -> list[bytes | None]:
    """The chain rule spelled out: a key's parent is the key before it in
    the offer when both are of one group (a key's last 4 bytes; b"" under
    12 bytes), else the request's last key of its group, else its scan's
    hint (popped); each group's last key is remembered for the request."""
    out: list[bytes | None] = []
    for i, k in enumerate(offer):
        g = k[-4:] if len(k) >= 12 else b""
        prev = offer[i - 1] if i else None
        if prev is not None and (prev[-4:] if len(prev) >= 12 else b"") == g:
            out.append(prev)
            continue
        if last is not None and prev is not None:
            last[prev[-4:] if len(prev) >= 12 else b""] = prev
        p = last.get(g) if last is not None else None
        out.append(p if p is not None else miss.pop(k, None))
    if last is not None and offer:
        last[offer[-1][-4:] if len(offer[-1]) >= 12 else b""] = offer[-1]
    return out


def test_native_chains_refuse_what_is_not_bytes() -> None:
    from kvtier.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="keys must be bytes"):
        _native.offer_parents([b"k" * 16, "k"], None, {})  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="last must be a dict"):
        _native.offer_parents([b"k" * 16], [], {})  # type: ignore[arg-type]


# -- frames --------------------------------------------------------------------
@contextlib.contextmanager
def _regions() -> Iterator[tuple[Region, Region]]:
    name = f"kvtest-stores-{os.getpid()}-{next(_ids)}"
    # Two block sizes a region: blocks evicted lately are remembered, and
    # their return counted as regret.
    a = open_region(name + "a", 64 * 4096, 4096, 2)
    b = open_region(name + "b", 64 * 4096, 4096, 2)
    try:
        yield a, b
    finally:
        for r in (a, b):
            r.pool.close()


_ids = itertools.count()


def _session(region: Region, native: bool) -> Session:
    c = build_class(64, 64, region, HostOptions(), [])
    s = Session(c, NS, "e", 1, 0, events=False)
    s._native_stores = native
    s.top_up()
    return s


def _state(s: Session) -> dict[str, Any]:
    m = s.cls.manager
    ix = m.host._ix  # type: ignore[attr-defined]
    return {
        "slots": list(ix.slots.items()),
        "states": [ix.state(v) for v in ix.slots.values()],
        "parents": [ix.parent(k) for k in ix.slots],
        "lru": ix.lru(),
        "reserved": sorted(s.reserved),
        "writes": sorted(s.writes),
        "spare": {k: list(v) for k, v in s.spare.items()},
        "last": {(r[0] == s.id, r[1]): v for r, v in m._last_offer.items()},
        "miss": m._miss_prev,
        "stores": m.stats.stores,
        "ghost": list(m.host._ghost),  # type: ignore[attr-defined]
        "regret": m.host.regret,  # type: ignore[attr-defined]
    }


# A frame: (request or None, key positions, begin?) each; ends name keys
# begun before (or not: the node refuses them).
ENTRY = st.tuples(
    st.sampled_from([None, "r1", "r2", 7]),
    st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=6),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(
    frames=st.lists(st.lists(ENTRY, min_size=1, max_size=6), min_size=1, max_size=5),
    miss=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(KEYS), max_size=3),
    odd=st.sampled_from([None, "missing", "twice", "unreserved", "count"]),
    evicted=st.lists(st.integers(0, len(KEYS) - 1), max_size=4),
)
def test_a_frame_native_leaves_what_the_python_path_leaves(
    frames: list[Any], miss: dict[bytes, bytes], odd: Any, evicted: list[int]
) -> None:
    with _regions() as (ra, rb):
        a, b = _session(ra, True), _session(rb, False)
        for s in (a, b):
            s.cls.manager._miss_prev.update(miss)
            # Blocks evicted lately (for another block size): stored again, regret.
            s.cls.manager.host._forget([s.prefix + KEYS[i] for i in evicted])  # type: ignore[attr-defined]
        assert _state(a) == _state(b)
        for n, frame in enumerate(frames):
            args = _frame(a, frame, odd if n == len(frames) - 1 else None)
            assert sorted(a.reserved) == sorted(b.reserved)
            outcome = []
            for s in (a, b):
                try:
                    s.stores(*(list(x) for x in args))
                    outcome.append(None)
                except ProtocolError as e:
                    outcome.append(str(e))
            assert outcome[0] == outcome[1]
            # Refused, both leave the same (the reservation and the writes
            # as they were): the node drops such a connection and releases those.
            assert _state(a) == _state(b)
            if outcome[0] is not None:
                return
            for s in (a, b):
                s.top_up()


def _frame(s: Session, frame: list[Any], odd: str | None) -> tuple[list[Any], ...]:
    """STORES arguments for ``frame``: begun offers into ``s``'s reserved
    slots; an end names keys being written (by earlier frames or begun
    earlier in this one); ``odd``, one fault the node refuses."""
    keys: list[bytes] = []
    slots: list[int] = []
    reqs: list[Any] = []
    counts: list[int] = []
    free = sorted(s.reserved)
    writing = sorted(k[8:] for k in s.writes)
    for req, pos, begin in frame:
        if begin:
            ks = [KEYS[i] for i in pos]
            slots += free[: len(ks)]
            free = free[len(ks) :]
            reqs.append(req)
            counts.append(len(ks))
            writing += ks
        elif writing:
            ks = [writing.pop(i % len(writing)) for i in pos[: len(writing)]]
            reqs.append(None)
            counts.append(-len(ks))
        else:
            continue
        keys += ks
    if odd == "missing":
        keys.append(b"never-begun-key!")
        reqs.append(None)
        counts.append(-1)
    elif odd == "twice" and len(slots) > 1:
        slots[1] = slots[0]
    elif odd == "unreserved" and slots:
        slots[0] = 10**6
    elif odd == "count":
        counts.append(0)
        reqs.append(None)
    return keys, slots, reqs, counts


@pytest.mark.parametrize("count", [2**63, 2**64 - 1, -(2**63), 2**41])
def test_a_count_past_any_frame_is_the_protocol_error_of_both_paths(count: int) -> None:
    with _regions() as (ra, rb):
        for s in (_session(ra, True), _session(rb, False)):
            slot = min(s.reserved)
            with pytest.raises(ProtocolError, match="a nonzero count per request"):
                s.stores([KEYS[0]], [slot], ["r"], [count])
            assert slot in s.reserved and not s.writes  # nothing changed


def test_an_end_of_a_key_not_being_written_leaves_the_writes_as_they_were() -> None:
    # The native pass takes a frame's ended keys out of the writes itself:
    # one it cannot take puts back those it took, as the Python path never
    # took any (the node then drops the connection and releases the writes).
    with _regions() as (ra, rb):
        for s in (_session(ra, True), _session(rb, False)):
            two = sorted(s.reserved)[:2]
            s.stores(KEYS[:2], two, ["r"], [2])
            with pytest.raises(ProtocolError, match="not writing"):
                s.stores([KEYS[0], b"never-begun-key!"], [], [None], [-2])
            assert sorted(s.writes) == sorted(s.prefix + k for k in KEYS[:2])
            s.stores(KEYS[:2], [], [None], [-2])  # the writes end after all
            assert not s.writes and s.cls.manager.stats.stores == 2
