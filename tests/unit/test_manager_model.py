"""Random sequences of manager calls against a simple reference model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.manager import TieredOffloadingManager
from kvtier.tiers import HostTier, LookupResult

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
