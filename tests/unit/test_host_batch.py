"""The host tier's batch paths (one call per offer, not per key) keep the
per-key semantics: slots handed out once each, in the order single pops
gave them; the LRU's batch calls order keys as its per-key calls do; and
each block's record of the blocks after it (a key, or a set at a branch)
names resident blocks whose parent it is after any sequence of offers,
loads and evictions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.manager import TieredOffloadingManager
from kvtier.policy.lru import LRUPolicy
from kvtier.tiers.host import HostTier


def K(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def test_allocating_every_free_slot_hands_each_out_once_last_first() -> None:
    host = HostTier(None, 4)
    got = host.allocate(4)
    assert got == ([0, 1, 2, 3], [])
    assert host.free_slots == 0
    assert host.allocate(1) is None  # nothing ready to evict: unchanged
    host.add_writing(K(0), 0)
    host.mark_ready(K(0))
    assert host.allocate(1) == ([0], [K(0)])
    assert host.allocate(0) == ([], [])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "touch", "evict"]), st.lists(st.integers(0, 9), max_size=6)
        )
    )
)
def test_lru_batch_calls_order_keys_as_per_key_calls(ops: list[tuple[str, list[int]]]) -> None:
    batch, single = LRUPolicy(), LRUPolicy()
    for op, keys in ops:
        if op == "insert":
            batch.insert_many(keys)
            for k in keys:
                single.insert(k)
        elif op == "touch":
            batch.touch_many(keys)
            for k in keys:
                single.touch(k)
        else:
            batch.evict_many(keys)
            for k in keys:
                single.remove(k, evicted=True)
    assert list(batch.victims()) == list(single.victims())


def _kids(host: HostTier) -> dict[bytes, set[bytes]]:
    out: dict[bytes, set[bytes]] = {}
    for k, e in host.entries.items():
        if e.kids is not None:
            out[k] = set(e.kids) if isinstance(e.kids, set) else {e.kids}
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 30), min_size=1, max_size=6)),
        max_size=25,
    )
)
def test_each_blocks_recorded_successors_are_resident_blocks_after_it(
    offers: list[tuple[int, list[int]]],
) -> None:
    m = TieredOffloadingManager(HostTier(None, 12))
    for req, ids in offers:
        keys = [K(i) for i in ids]
        ctx = type("Ctx", (), {"req_id": req})()
        out = m.prepare_store(keys, ctx)
        if out is not None:
            m.complete_store(out.keys_to_store, ctx)
        ready = [k for k in dict.fromkeys(keys) if k in m.host.entries]
        m.prepare_load(ready, ctx)
        m.complete_load(ready, ctx)
        if req == 3:
            m.on_request_finished(ctx)
        entries = m.host.entries
        for k, kids in _kids(m.host).items():
            for kid in kids:  # each recorded successor is resident, after k
                assert kid in entries and entries[kid].parent == k
        # a set only at a branch; no empty set
        assert all(not isinstance(e.kids, set) or len(e.kids) >= 2 for e in entries.values())
        assert m.host._links == sum(e.parent is not None for e in entries.values())
