"""Prefix-aware eviction in the host tier, under every policy: among the
blocks of one prefix chain a later block is evicted no later than an earlier
one, unless it cannot go (pinned, being written, offered); chains come from
the manager's calls (an offer's order, a request's later offers, the key a
scan stopped at). And the three ways ``prepare_store`` can treat an offer
that does not fit whole (``partial_stores``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier.errors import InvalidArgument
from kvtier.manager import LookupResult, TieredOffloadingManager
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_native import make_host_tier

POLICIES = ["lru", "arc", "plfu"]


def K(i: int, group: int = 0) -> bytes:
    """A vLLM-shaped key: a 32-byte hash, then its KV-cache group."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def make(capacity: int, policy: str, **opts: object) -> TieredOffloadingManager:
    return TieredOffloadingManager(make_host_tier(None, capacity, policy=policy), **opts)  # type: ignore[arg-type]


def store(m: TieredOffloadingManager, keys: list[bytes], req: object = None) -> list[bytes]:
    """Offer ``keys`` and complete what was taken; the keys evicted for it."""
    out = m.prepare_store(keys, req)
    assert out is not None
    m.complete_store(out.keys_to_store, req)
    return list(out.evicted_keys)


def evicted_one_at_a_time(m: TieredOffloadingManager, n: int, base: int = 1000) -> list[bytes]:
    """Store ``n`` unrelated blocks one by one (separate requests); the keys
    they evicted, in order."""
    gone = []
    for i in range(n):
        gone += store(m, [K(base + i)])
        m.on_request_finished()
    return gone


def chain_leaves(m: TieredOffloadingManager, chain: list[bytes]) -> list[bytes]:
    """Offer as many unrelated blocks as the tier holds, so that everything
    resident goes in one allocation; the order ``chain``'s blocks left in."""
    cap = m.host.capacity
    assert cap is not None
    gone = store(m, [K(10_000 + i) for i in range(cap)])
    m.on_request_finished()
    return [k for k in gone if k in chain]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_offers_chain_leaves_tail_first(policy: str) -> None:
    m = make(4, policy)
    chain = [K(i) for i in range(4)]
    store(m, chain)
    m.on_request_finished()
    assert chain_leaves(m, chain) == chain[::-1]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_requests_later_offers_continue_its_chain(policy: str) -> None:
    # Chunked prefill: the request offers its blocks over several steps, the
    # later ones newer in every policy's eyes; still the tail goes first.
    m = make(6, policy)
    req = SimpleNamespace(req_id="r1")
    store(m, [K(0), K(1)], req)
    m.on_schedule_end()
    store(m, [K(2), K(3)], req)
    m.on_request_finished(req)
    store(m, [K(50), K(51)])  # fills the tier
    m.on_request_finished()
    assert chain_leaves(m, [K(0), K(1), K(2), K(3)]) == [K(3), K(2), K(1), K(0)]


def test_a_finished_requests_chain_ends_go_and_no_other_requests() -> None:
    m = make(8, "lru")
    a, b = SimpleNamespace(req_id="a"), SimpleNamespace(req_id="b")
    store(m, [K(0), K(1)], a)
    store(m, [K(10)], b)
    m.on_request_finished(a)
    assert list(m._last_offer) == ["b"]
    store(m, [K(11)], b)  # b's next offer still follows its last
    m.on_request_finished(b)
    assert m._last_offer == {}
    assert chain_leaves(m, [K(10), K(11)]) == [K(11), K(10)]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_key_a_scan_stopped_at_continues_the_hit_prefix(policy: str) -> None:
    m = make(4, policy)
    store(m, [K(0), K(1)])
    m.on_request_finished()
    # A returning request: K(0), K(1) hit, K(2) misses, then it offers K(2), K(3).
    assert [m.lookup(K(i)) for i in range(3)] == [LookupResult.HIT] * 2 + [LookupResult.MISS]
    m.prepare_load([K(0), K(1)])
    m.complete_load([K(0), K(1)])
    store(m, [K(2), K(3)])
    m.on_request_finished()
    assert chain_leaves(m, [K(0), K(1), K(2), K(3)]) == [K(3), K(2), K(1), K(0)]


def test_groups_are_separate_chains() -> None:
    # vLLM offers group by group: group 1's first block does not follow
    # group 0's last.
    m = make(4, "lru")
    store(m, [K(0, 0), K(1, 0), K(0, 1), K(1, 1)])
    m.on_request_finished()
    host = m.host
    assert host.get(K(0, 1)).parent is None  # type: ignore[union-attr]
    assert host.get(K(1, 1)).parent == K(0, 1)  # type: ignore[union-attr]
    assert host.get(K(1, 0)).parent == K(0, 0)  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_after_the_victim_that_cannot_go_does_not_keep_it(policy: str) -> None:
    # K0 <- K1 <- K2, the tail pinned by a load: the blocks before it still
    # leave in the policy's turn, the later one first. (Keeping them while a
    # tail is pinned or being written cost ARC and PLFU hit rate: see
    # bench/results/prefix-eviction/.)
    m = make(4, policy)
    store(m, [K(0), K(1), K(2)])
    m.on_request_finished()
    m.prepare_load([K(2)])
    assert store(m, [K(20), K(21)]) == [K(1)]
    m.on_request_finished()
    assert store(m, [K(30)]) == [K(0)]
    assert m.host.get(K(2)) is not None  # pinned: it stays (stranded) until unpinned


def test_without_prefix_awareness_the_policy_alone_decides() -> None:
    m = TieredOffloadingManager(HostTier(None, 4, policy="lru", prefix_aware=False))
    store(m, [K(i) for i in range(4)])
    m.on_request_finished()
    assert evicted_one_at_a_time(m, 2) == [K(0), K(1)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    ops=st.lists(
        st.tuples(
            st.integers(0, 7),  # which chain (request prefix)
            st.integers(1, 6),  # its length this time
            st.booleans(),  # pin its first block while the next offers run
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_no_block_leaves_before_a_block_after_it_that_could_have(
    policy: str, ops: list[tuple[int, int, bool]]
) -> None:
    """Each allocation's victims, against the chains as the manager knows
    them: a victim never has a block after it (still resident) that was
    evictable and not offered at that moment."""
    m = make(12, policy)
    host = m.host
    pinned: list[bytes] = []
    for chain, length, pin in ops:
        keys = [K(chain * 100 + j) for j in range(length)]
        hits: list[bytes] = []
        for k in keys:  # the engine's scan, up to the first MISS
            if m.lookup(k) is not LookupResult.HIT:
                break
            hits.append(k)
        if hits:
            m.prepare_load(hits)
            m.complete_load(hits)
        new = keys[len(hits) :]
        before = {k: (e.kids, e.evictable) for k, e in host.entries.items()}
        out = m.prepare_store(new) if new else None
        if out is not None:
            offered = set(new)
            for v in out.evicted_keys:
                for child in before[v][0] or ():
                    # a child that left in this allocation too went first
                    if child in host.entries and child not in offered:
                        assert not before[child][1], (v, child)
            m.complete_store(out.keys_to_store)
        m.on_request_finished()
        m.on_schedule_end()
        if pin and keys[0] in host.entries and host.entries[keys[0]].ref == 0:
            m.prepare_load([keys[0]])
            pinned.append(keys[0])
        if len(pinned) > 2:
            m.complete_load([pinned.pop(0)])


# -- partial stores ------------------------------------------------------------
def _full_with_two_pinned(mode: str) -> TieredOffloadingManager:
    """A tier of 4 blocks: 2 pinned by a load, 2 ready; nothing free."""
    m = make(4, "lru", partial_stores=mode)
    for i in range(4):
        store(m, [K(i)])
        m.on_request_finished()
    m.prepare_load([K(0), K(1)])
    return m


def test_partial_stores_prefix_stores_the_head_that_fits_evicting() -> None:
    m = _full_with_two_pinned("prefix")
    out = m.prepare_store([K(10), K(11), K(12)])
    assert out is not None and out.keys_to_store == [K(10), K(11)]
    assert sorted(out.evicted_keys) == [K(2), K(3)]


def test_partial_stores_free_evicts_nothing() -> None:
    m = _full_with_two_pinned("free")
    assert m.prepare_store([K(10), K(11), K(12)]) is None  # no free slot
    m.complete_load([K(0), K(1)])
    m.host.drop(K(3))  # one slot free
    out = m.prepare_store([K(10), K(11), K(12), K(13), K(14)])
    assert out is not None and out.keys_to_store == [K(10)] and out.evicted_keys == []
    # An offer that fits whole still evicts as it must.
    m.complete_store([K(10)])
    out = m.prepare_store([K(20)])
    assert out is not None and out.keys_to_store == [K(20)] and len(out.evicted_keys) == 1


def test_partial_stores_none_stores_nothing_unless_all_fit() -> None:
    m = _full_with_two_pinned("none")
    before = dict(m.host.entries)
    assert m.prepare_store([K(10), K(11), K(12)]) is None
    assert dict(m.host.entries) == before
    out = m.prepare_store([K(10), K(11)])
    assert out is not None and out.keys_to_store == [K(10), K(11)]


def test_partial_stores_refuses_an_unknown_mode() -> None:
    with pytest.raises(InvalidArgument, match="partial_stores must be one of prefix, free, none"):
        make(4, "lru", partial_stores="some")


def test_an_interleaved_replay_strands_fewer_blocks_and_hits_more() -> None:
    # 16 requests in flight storing 4 blocks a step (the engine's batch and
    # chunked prefill), 600 requests of the agent workload on 300 blocks:
    # deterministic; measured at 10.75 stranded blocks on average and 5,181
    # hits without prefix awareness, 6.0 and 6,321 with it.
    from kvtier.bench.interleaved import run_interleaved
    from kvtier.replay import WORKLOADS, Replayer

    trace = WORKLOADS["agent"](600, 0)
    got = {}
    for aware in (False, True):
        m = TieredOffloadingManager(HostTier(None, 300, policy="lru", prefix_aware=aware))
        got[aware] = run_interleaved(Replayer(m), trace, 16)
    assert got[True].hits > got[False].hits
    assert got[True].stranded_mean["host"] < got[False].stranded_mean["host"]


# -- the walk's hint -------------------------------------------------------------
class _NoHints(HostTier):
    """The host tier walking every chain from the block the policy names, as
    it did before the hint: the reference the hinted walk must agree with."""

    def _hint(self, root: bytes, deepest: bytes, entry: object) -> None:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    ops=st.lists(
        st.tuples(
            st.integers(0, 5),  # which request: its chain grows offer by offer
            st.integers(1, 4),  # blocks it offers now
            st.sampled_from(["none", "pin", "finish", "drop"]),
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_the_hint_changes_the_work_never_the_victims(
    policy: str, ops: list[tuple[int, int, str]]
) -> None:
    """Requests growing their chains over many offers (a hint per chain),
    with pins, finished requests and dropped blocks (chains cut) between:
    every allocation evicts exactly what the walk from the policy's block
    evicts, in the same order."""
    a = TieredOffloadingManager(HostTier(None, 10, policy=policy))
    b = TieredOffloadingManager(_NoHints(None, 10, policy=policy))
    grown = [0] * 6
    pinned: list[bytes] = []
    for req, n, what in ops:
        ctx = SimpleNamespace(req_id=f"r{req}")
        keys = [K(req * 1000 + grown[req] + j) for j in range(n)]
        grown[req] += n
        outs = [m.prepare_store(keys, ctx) for m in (a, b)]
        assert [o and (o.keys_to_store, o.evicted_keys) for o in outs] == [
            o and (o.keys_to_store, o.evicted_keys) for o in outs[::-1]
        ]
        for m, o in zip((a, b), outs, strict=True):
            if o is not None:
                m.complete_store(o.keys_to_store, ctx)
            m.on_schedule_end()
        if what == "pin" and keys[0] in a.host.entries and a.host.entries[keys[0]].ref == 0:
            for m in (a, b):
                m.prepare_load([keys[0]])
            pinned.append(keys[0])
        elif what == "finish":
            for m in (a, b):
                m.on_request_finished(ctx)
        elif what == "drop" and keys[-1] in a.host.entries and a.host.entries[keys[-1]].ref == 0:
            # The middle of a chain leaves (a failed load drops it): a cut.
            for m in (a, b):
                m.host.drop(keys[-1] if n == 1 else keys[0])
        if len(pinned) > 2:
            k = pinned.pop(0)
            for m in (a, b):
                m.complete_load([k])
        assert a.host.entries.keys() == b.host.entries.keys()


def test_one_long_chain_walks_a_bounded_number_of_blocks_per_allocation() -> None:
    """One request offering 5,000 blocks one at a time into 2,500 slots (as
    `kvtier bench vllm` does): each allocation takes the chain's tail, found
    from where the last walk ended, not by walking the chain from its oldest
    block (2,500 blocks a time before the hint). The Python tier, whose
    walks can be counted (the native index's hints: csrc/tests)."""
    m = TieredOffloadingManager(HostTier(None, 2500, policy="lru"))
    host = m.host
    walks: list[int] = []
    take = host._take_chain

    def counted(*args: object) -> int:
        n = take(*args)  # type: ignore[arg-type]
        walks.append(n)
        return n

    host._take_chain = counted  # type: ignore[method-assign]
    ctx = SimpleNamespace(req_id="long")
    for i in range(5000):
        evicted = store(m, [K(i)], ctx)
        if i >= 2500:
            assert evicted == [K(4999 - i)]  # the tail of the chain left behind
    # The first walk goes down from the oldest block; each later one starts
    # where the last ended (the last allocation takes K(0), a chain of one).
    assert walks[0] == 2500 and len(walks) == 2499
    assert max(walks[1:]) == 1


@pytest.mark.parametrize("cut", ["drop", "evicted in the policy's order"])
def test_a_cut_chain_is_walked_again_from_the_block_the_policy_names(cut: str) -> None:
    """A hint left below a block that leaves with blocks after it (a failed
    load drops it, or a block after it could not go) no longer lies on the named
    block's chain: the walk starts from that block again."""

    def run(tier: HostTier) -> list[bytes]:
        for i in range(7):  # K0 <- K1 <- ... <- K6, K0 the oldest
            got = tier.allocate(1)
            assert got is not None
            tier.add_writing(K(i), got[0][0], parent=K(i - 1) if i else None)
            tier.mark_ready(K(i))

        def evict(n: int, protected: set[bytes] | None = None) -> list[bytes]:
            got = tier.allocate(n, protected or set())
            assert got is not None
            return got[1]

        gone = evict(1)  # the tail, K6; the walk from K0 ended at K5
        if cut == "drop":
            tier.drop(K(3))
            gone += evict(2)  # K3's slot and one evicted
        else:
            # K0-K2 offered and K5 cannot go: from K3 the walk passes over
            # K5 and takes K4, cutting K5 off; the hint left for K0 (at K5)
            # lies off K0's chain now: the next walk from K0 takes K3.
            gone += evict(1, {K(0), K(1), K(2), K(5)})
            gone += evict(1)
        return gone

    hinted, walked = run(HostTier(None, 7)), run(_NoHints(None, 7))
    assert walked == ([K(6), K(2)] if cut == "drop" else [K(6), K(4), K(3)])
    assert hinted == walked


def test_a_branch_below_the_named_block_is_walked_whole() -> None:
    """A second block after one between the named block and the hint (a
    request that shared part of the prefix): the walk covers both branches
    again, and a block still followed by the other branch never goes first."""

    def run(tier: HostTier) -> list[bytes]:
        def put(key: bytes, parent: bytes | None) -> None:
            got = tier.allocate(1)
            assert got is not None
            tier.add_writing(key, got[0][0], parent=parent)
            tier.mark_ready(key)

        for i in range(6):  # K0 <- ... <- K5
            put(K(i), K(i - 1) if i else None)
        got = tier.allocate(1)  # K5 goes; the walk from K0 ended at K4
        assert got is not None
        (slot,), gone = got
        tier.add_writing(K(99), slot, parent=K(2))  # K2 <- K99 beside K2 <- K3 <- K4
        tier.mark_ready(K(99))
        got = tier.allocate(3)
        assert got is not None
        return gone + got[1]

    hinted, walked = run(HostTier(None, 6)), run(_NoHints(None, 6))
    assert set(walked[1:]) == {K(3), K(4), K(99)}  # K2 stays while a block after it does
    assert hinted == walked


def test_a_block_taken_from_its_own_chain_is_not_taken_again_from_its_roots() -> None:
    """A block after a chain's start, used longer ago than that start, goes
    first as the start of its own part of the chain; the walk from the start
    that follows, resumed from its hint below that block, must not take it a
    second time (it did: the same key twice among the victims, and
    prepare_store failed with a KeyError)."""
    host = HostTier(None, 4, policy="lru")
    keys = [K(i) for i in range(4)]
    slots, _ = host.allocate(4)  # type: ignore[misc]
    host.add_writing_many(keys, slots, [None, *keys[:-1]])  # K0 <- K1 <- K2 <- K3
    host.mark_ready_many(keys, [host.entries[k] for k in keys])
    got = host.allocate(1)  # the tail goes; the next walk from K0 starts at K2
    assert got is not None and got[1] == [keys[3]]
    host.pin_many([keys[2]])  # K2 cannot go
    host.touch_many([keys[0]])  # K0 used last: K1 comes first
    assert host.allocate(2) == ([slots[0], slots[1]], [keys[1], keys[0]])
    assert set(host.entries) == {keys[2]}


def _parents_by_rule(
    offer: list[bytes], last: dict[bytes, bytes], miss: dict[bytes, bytes]
) -> list[bytes | None]:
    """Each key's parent as _parents' docstring says, one key at a time."""
    out: list[bytes | None] = []
    prev: dict[bytes, bytes] = {}
    for k in offer:
        g = k[-4:] if len(k) >= 12 else b""
        if out and g == (offer[len(out) - 1][-4:] if len(offer[len(out) - 1]) >= 12 else b""):
            out.append(offer[len(out) - 1])
        else:
            p = prev.get(g) or last.get(g) or miss.pop(k, None)
            out.append(p)
        prev[g] = k
        last[g] = k
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 30), st.sampled_from([0, 0, 0, 1, 2, -1])), max_size=12),
        min_size=1,
        max_size=4,
    )
)
def test_an_offers_parents_follow_the_rule_with_one_group_or_many(
    offers: list[list[tuple[int, int]]],
) -> None:
    """_parents' one-group path and its general loop give what the rule
    says, over a request's offers in turn (-1: a key too short for a group)."""
    m = make(64, "lru")
    req = SimpleNamespace(req_id="r")
    last: dict[bytes, bytes] = {}
    for offer in offers:
        keys = [bytes([i]) * 8 if g < 0 else K(i, g) for i, g in offer]
        assert m._parents(keys, "r") == _parents_by_rule(keys, last, {})
    m.on_request_finished(req)
