"""The host tier's native index (``kvtier._native.HostIndex``) against the
Python host tier (:class:`kvtier.tiers.host.HostTier` under LRU): the same
calls give the same slots, the same victims in the same order, the same
LRU order and the same chains. Random call sequences; chains are plain
(one block after each) because at a branch the Python tier walks a set, in
an order that changes with the interpreter's string hashing. Branches are
checked by their rule: a block goes only after every block after it that
can go."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier._native import HostIndex, SharedIndex
from kvtier.errors import InvalidArgument
from kvtier.pool import HostPool
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_entry import Fill
from kvtier.tiers.host_native import make_host_tier


def _lru(t: HostTier) -> list[bytes]:
    return [k for k in t.policy.victims() if k in t.entries]


class _Twin:
    """A native index and one mirrored into a node's shared index (which
    finds its keys by digest there, with no dict): each call goes to both,
    and both must answer alike."""

    def __init__(self, capacity: int, pool: HostPool) -> None:
        self.plain = HostIndex(capacity)
        self.mirrored = HostIndex(capacity)
        self.shared = SharedIndex.create(pool.native, capacity)
        self.mirrored.set_mirror(self.shared)

    def __getattr__(self, name: str) -> Any:
        a, b = getattr(self.plain, name), getattr(self.mirrored, name)

        def both(*args: Any) -> Any:
            got = a(*args)
            assert b(*args) == got, name
            return got

        return both

    def __len__(self) -> int:
        assert len(self.mirrored) == len(self.plain)
        return len(self.plain)

    @property
    def slots(self) -> dict[bytes, int]:
        view = self.mirrored.slots
        assert dict(view.items()) == self.plain.slots
        assert sorted(view) == sorted(self.plain.slots) and len(view) == len(self.plain.slots)
        assert all(
            view[k] == s and view.get(k) == s and k in view for k, s in self.plain.slots.items()
        )
        return self.plain.slots  # type: ignore[return-value]

    @property
    def free_slots(self) -> int:
        assert self.mirrored.free_slots == self.plain.free_slots
        return self.plain.free_slots

    @property
    def held_slots(self) -> int:
        assert self.mirrored.held_slots == self.plain.held_slots
        return self.plain.held_slots


def _run(seed: int, capacity: int, steps: int) -> None:
    with HostPool(1, SharedIndex.bytes_for(capacity)) as pool:
        _run_on(seed, capacity, steps, pool)


def _run_on(seed: int, capacity: int, steps: int, pool: HostPool) -> None:
    rng = random.Random(seed)
    py = HostTier(None, capacity, policy="lru")
    nat: Any = _Twin(capacity, pool)
    nxt = 0
    written: list[bytes] = []  # resident keys not yet ready (ref -1)

    def tails() -> list[bytes]:
        return [k for k, e in py.entries.items() if e.kids is None]

    for _ in range(steps):
        op = rng.random()
        if op < 0.35:  # an offer: allocate, then write, chained to a tail or not
            n = rng.randint(1, 6)
            prot = set(rng.sample(list(py.entries), min(len(py.entries), rng.randint(0, 3))))
            partial = rng.random() < 0.5
            got_py = py.allocate(n, protected=prot, partial=partial)
            got_nat = nat.allocate(n, prot, partial)
            assert (got_py is None) == (got_nat is None)
            if got_py is None:
                continue
            assert list(got_nat[0]) == got_py[0]
            assert list(got_nat[1]) == got_py[1]
            for k in got_py[1]:
                if k in written:
                    written.remove(k)
            t = tails()
            parent = rng.choice(t) if t and rng.random() < 0.7 else None
            keys, parents = [], []
            for _ in got_py[0]:
                keys.append(nxt.to_bytes(8, "little"))
                parents.append(parent)
                parent = keys[-1]
                nxt += 1
            py.add_writing_many(keys, got_py[0], parents)
            nat.add_writing_many(keys, got_nat[0], parents)
            ready = keys[: rng.randint(0, len(keys))]
            py.mark_ready_many(ready, [py.entries[k] for k in ready])
            nat.mark_ready_many(ready)
            written += keys[len(ready) :]
        elif op < 0.45 and written:  # a write completes
            k = written.pop(rng.randrange(len(written)))
            py.mark_ready(k)
            if rng.random() < 0.5:
                nat.mark_ready_many([k])
            else:  # as the node ends its writes (a list: found together)
                assert nat.complete_writes([b"never", k, k], True) == [k]
            assert nat.complete_writes([k], True) == []  # ready already
        elif op < 0.6 and py.entries:  # a load pins ready blocks
            ready = [k for k, e in py.entries.items() if e.ref >= 0]
            ks = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
            assert nat.pin_many(ks) == [0] * len(ks)
            py.pin_many(ks)
        elif op < 0.75:  # loads end
            pinned = [k for k, e in py.entries.items() if e.ref > 0]
            ks = rng.sample(pinned, min(len(pinned), 2))
            py.unpin_many(ks)
            nat.unpin_many(ks)
        elif op < 0.8 and py.entries:  # touched by an offer
            ks = rng.sample(list(py.entries), min(len(py.entries), 3))
            py.touch_many(ks)
            nat.touch_many(ks)
        elif op < 0.85 and py.entries:  # an offer of held keys (used), repeats and new keys
            ks = rng.sample(list(py.entries), min(len(py.entries), 3))
            ks += [rng.choice(ks), nxt.to_bytes(8, "little"), (nxt + 1).to_bytes(8, "little")]
            rng.shuffle(ks)
            to_store, seen, refused = py.offered(ks)
            assert refused == 0
            assert nat.offered(ks) == (to_store, seen)
        elif op < 0.93 and py.entries:  # dropped (a failed load, a reset)
            k = rng.choice(list(py.entries))
            if k in written:
                written.remove(k)
            e = py.drop(k)
            assert e is not None
            slot = nat.detach(k)
            assert slot == e.slot
            nat.release(slot)
        elif py.entries:  # a timed-out job holds a slot, or lets it go
            slot = py.entries[rng.choice(list(py.entries))].slot
            if rng.random() < 0.5:
                py.hold(slot)
                nat.hold(slot)
            else:
                py.unhold(slot)
                nat.unhold(slot)
        assert len(nat) == len(py)
        assert nat.free_slots == py.free_slots
        assert nat.held_slots == py.held_slots
    assert nat.lru() == _lru(py)
    assert nat.slots == {k: e.slot for k, e in py.entries.items()}
    for k, e in py.entries.items():
        assert nat.entry(k)[:2] == (e.slot, e.ref)
        kids = [] if e.kids is None else [e.kids]
        assert nat.kids(k) == kids
        parent = e.parent if e.parent in py.entries else None
        assert nat.parent(k) == parent
        assert nat.parent_key(k) == e.parent  # kept after the parent left, as host.py does


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([4, 16, 64]))
def test_the_same_calls_give_what_the_python_tier_gives(seed: int, capacity: int) -> None:
    _run(seed, capacity, 400)


def test_a_long_run_of_chains_and_holds() -> None:
    _run(12345, 256, 20_000)


def test_a_branch_goes_after_the_blocks_after_it() -> None:
    nat = HostIndex(16)
    k = [bytes([i]) * 8 for i in range(8)]
    nat.add_writing_many(k[:8], list(range(8)), [None, k[0], k[1], k[0], k[3], k[3], None, k[6]])
    nat.mark_ready_many(k[:8])
    assert nat.kids(k[0]) == [k[1], k[3]]
    assert nat.kids(k[3]) == [k[4], k[5]]
    order = nat.victims(8)
    assert sorted(order) == sorted(k)
    for i, key in enumerate(order):
        after = nat.kids(key)
        assert all(order.index(a) < i for a in after)  # every block after it went first
    nat.pin_many([k[4]])
    order = nat.victims(8)
    assert k[4] not in order and len(order) == 7
    assert order.index(k[3]) > order.index(k[5])


def test_touching_by_slot_is_touching_by_key() -> None:
    """touch_slots (the node's engines name their shared-index loads by
    slot) moves ready blocks as touch_many of their keys does; a slot
    without a ready block is passed over, one out of range refused with
    nothing touched."""
    by_key, by_slot = HostIndex(8, False), HostIndex(8, False)
    k = [bytes([i]) * 8 for i in range(6)]
    for nat in (by_key, by_slot):
        nat.add_writing_many(k, list(range(6)), None)
        nat.mark_ready_many(k[:5])  # k[5] still written
    by_key.touch_many([k[1], k[0], k[3]])
    by_slot.touch_slots([1, 0, 5, 7, 3])
    assert by_slot.victims(5) == by_key.victims(5) == [k[2], k[4], k[1], k[0], k[3]]
    with pytest.raises(InvalidArgument, match=r"slot 8 out of range \(8 slots\)"):
        by_slot.touch_slots([2, 8])
    assert by_slot.victims(5) == by_key.victims(5)  # k[2] not touched


def test_bad_calls_are_refused_and_change_nothing() -> None:
    nat = HostIndex(2)
    with pytest.raises(InvalidArgument, match="capacity must be 1 to"):
        HostIndex(0)
    nat.add_writing(b"a", 0)
    with pytest.raises(InvalidArgument, match="slot 0 holds a block already"):
        nat.add_writing(b"b", 0)
    with pytest.raises(InvalidArgument, match="key is resident already"):
        nat.add_writing(b"a", 1)
    with pytest.raises(InvalidArgument, match=r"outside 0\.\.1"):
        nat.add_writing(b"c", 2)
    with pytest.raises(InvalidArgument, match="not ready"):
        nat.pin_many([b"a"])
    with pytest.raises(KeyError):
        nat.mark_ready_many([b"zz"])
    with pytest.raises(InvalidArgument, match="a slot and a parent"):
        nat.add_writing_many([b"x"], [], None)
    assert len(nat) == 1 and nat.entry(b"a") == (0, -1, 0, 0, 0, 0)


@pytest.mark.parametrize("native", [False, True])
def test_census_counts_pinned_writing_and_cascading_blocks(native: bool) -> None:
    """The occupancy gauges' counts, exactly, on either tier: 10 blocks, of
    which 3 still written, 2 ready and pinned (one of them twice), 1
    cascading, 1 filling from a lower tier."""
    t = make_host_tier(None, 16, native=native)
    keys = [bytes([i]) * 8 for i in range(10)]
    got = t.allocate(10, protected=set(keys))
    assert got is not None
    for k, s in zip(keys, got[0]):
        t.add_writing(k, int(s))
    t.complete_writes(keys[3:], True)
    t.pin_many([keys[3], keys[4], keys[4]])
    t.entries[keys[5]].cascading = 1
    t.entries[keys[6]].fill = Fill.FILLING
    assert t.census() == (2, 4, 1)
    t.unpin_many([keys[3], keys[4], keys[4]])
    t.complete_writes(keys[:3], True)
    t.entries[keys[6]].fill = Fill.NONE
    assert t.census() == (0, 0, 1)
