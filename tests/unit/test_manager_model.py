"""Random sequences of manager calls against a simple reference model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import HostTier, LookupResult
from kvtier.tiers.memory import MemoryTier

CAP = 6
KEYS = [bytes([i]) * 8 for i in range(14)]


class ManagerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = TieredOffloadingManager(HostTier(None, CAP, policy="arc"))
        self.state: dict[bytes, str] = {}  # "writing" | "ready"
        self.pins: dict[bytes, int] = {}
        self.writing_batches: list[list[bytes]] = []
        self.load_batches: list[list[bytes]] = []

    @rule(offer=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def prepare_store(self, offer: list[bytes]) -> None:
        new = list(dict.fromkeys(k for k in offer if k not in self.state))
        evictable = [
            k
            for k, s in self.state.items()
            if s == "ready" and not self.pins.get(k) and k not in offer
        ]
        free = CAP - len(self.state)
        out = self.m.prepare_store(offer)
        if out is None:
            assert new and free + len(evictable) == 0
            return
        new = new[: free + len(evictable)]  # what fits: the first new keys
        assert out.keys_to_store == new
        assert len(out.store_spec.slots) == len(new)
        for k in out.evicted_keys:
            assert k in evictable, "evicted a pinned, written or offered key"
            del self.state[k]
        for k in new:
            self.state[k] = "writing"
        if new:
            self.writing_batches.append(new)

    @precondition(lambda self: self.writing_batches)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        batch = self.writing_batches.pop(data.draw(st.integers(0, len(self.writing_batches) - 1)))
        self.m.complete_store(batch, success=success)
        for k in batch:
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = [k for k, s in self.state.items() if s == "ready"]
        if not ready:
            return
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True))
        spec = self.m.prepare_load(keys)
        assert [self.m.host.get(k).slot for k in keys] == spec.slots.tolist()  # type: ignore[union-attr]
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1
        self.load_batches.append(keys)

    @precondition(lambda self: self.load_batches)
    @rule()
    def complete_load(self) -> None:
        keys = self.load_batches.pop(0)
        self.m.complete_load(keys)
        for k in keys:
            self.pins[k] -= 1

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: bytes) -> None:
        want = {
            None: LookupResult.MISS,
            "writing": LookupResult.HIT_PENDING,
            "ready": LookupResult.HIT,
        }[self.state.get(key)]
        assert self.m.lookup(key) is want

    @invariant()
    def slots_unique_and_capacity_kept(self) -> None:
        slots = [e.slot for e in self.m.host.entries.values()]
        assert len(slots) == len(set(slots)), "a slot is used twice"
        assert len(slots) <= CAP
        assert len(slots) + self.m.host.free_slots == CAP
        assert set(self.m.host.entries) == set(self.state)

    @invariant()
    def pinned_are_present(self) -> None:
        for k, n in self.pins.items():
            if n:
                e = self.m.host.get(k)
                assert e is not None and e.ref == n


TestManagerModel = ManagerModel.TestCase
TestManagerModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


TIERED_CAP = 4
TIERED_KEYS = KEYS[:9]


class TieredModel(RuleBasedStateMachine):
    """The manager over a small host tier with real bytes and a lower tier
    (write-through cascade, promotions, resets): whatever the order of
    calls, a HIT loads its own key's bytes, a key no tier holds is a MISS,
    no slot is used twice and none is lost once the work is drained."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HostPool(TIERED_CAP, 64)
        self.tier = MemoryTier(capacity=6)
        self.m = TieredOffloadingManager(HostTier(self.pool, policy="lru"), [self.tier])
        self.writing: list[list[bytes]] = []
        self.loads: list[list[bytes]] = []
        self.resets = 0

    def teardown(self) -> None:
        self.m.shutdown()
        self.pool.close()

    @rule(offer=st.lists(st.sampled_from(TIERED_KEYS), min_size=1, max_size=4))
    def store(self, offer: list[bytes]) -> None:
        out = self.m.prepare_store(offer)
        if out is None:
            return
        for k, s in zip(out.keys_to_store, out.store_spec.slots.tolist()):
            self.pool.view(s)[:] = k[0]  # what the engine's worker would copy in
        if out.keys_to_store:
            self.writing.append(out.keys_to_store)

    @precondition(lambda self: self.writing)
    @rule(success=st.booleans())
    def complete_store(self, success: bool) -> None:
        self.m.complete_store(self.writing.pop(0), success=success)

    @rule(key=st.sampled_from(TIERED_KEYS), steps=st.integers(0, 2))
    def lookup(self, key: bytes, steps: int) -> None:
        for _ in range(steps):  # steps may end between the engine's lookups
            self.m.on_schedule_end()
        e = self.m.host.get(key)
        anywhere = e is not None or key in self.tier.data
        r = self.m.lookup(key)
        if not anywhere:
            assert r is LookupResult.MISS
        elif e is not None:
            assert r is (LookupResult.HIT if e.ref >= 0 else LookupResult.HIT_PENDING)
        else:
            assert r in (LookupResult.HIT_PENDING, LookupResult.MISS)
        if r is LookupResult.HIT:
            spec = self.m.prepare_load([key])
            assert (self.pool.view(int(spec.slots[0])) == key[0]).all(), "a HIT loaded other bytes"
            self.loads.append([key])

    @precondition(lambda self: self.loads)
    @rule()
    def complete_load(self) -> None:
        self.m.complete_load(self.loads.pop(0))

    @rule()
    def step_end(self) -> None:
        self.m.on_schedule_end()

    @precondition(lambda self: not self.loads and not self.writing)
    @rule()
    def reset(self) -> None:
        self.m.reset_cache()
        self.m.on_reset_flushed()
        self.resets += 1

    @invariant()
    def slots_are_owned_once_and_none_is_lost(self) -> None:
        host = self.m.host
        slots = [e.slot for e in host.entries.values()]
        assert len(slots) == len(set(slots)), "a slot is used twice"
        for k, e in host.entries.items():
            assert host.owner(e.slot) == k
        if not self.loads and not self.writing:
            for _ in range(3):  # drain: tier jobs end on the next polls
                self.m.on_schedule_end()
            assert not self.m.has_pending_work()
            assert len(host.entries) + host.free_slots == TIERED_CAP, "a slot was lost"


TestTieredModel = TieredModel.TestCase
TestTieredModel.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
