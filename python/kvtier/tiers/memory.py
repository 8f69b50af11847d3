"""An in-memory lower tier: the reference implementation of the tier
interface, used by the manager's tests and the conformance suite.

Bytes are copied with numpy on submit; a batch completes on the
``delay_polls``-th poll after it was submitted. Faults are injected per key
(``fail_loads``, ``fail_stores``) or by making the tier ``busy``.

Process: the test's (or the replay's) scheduler. Who calls: the manager,
under its lock; batches are queued at once, nothing blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.policy import AdmissionFilter, make_policy
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent, check_slots
from kvtier.tiers.events import EVENT_LOG_KEYS, EventLog


class MemoryTier(LowerTier):
    def __init__(
        self,
        capacity: int | None = None,
        name: str = "memory",
        delay_polls: int = 1,
        policy: str = "lru",
        admit_after: int = 1,
        event_log_keys: int = EVENT_LOG_KEYS,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.delay_polls = delay_polls
        self.policy = make_policy(policy, capacity or (1 << 62))
        self.admission = AdmissionFilter(admit_after)
        self.data: dict[bytes, np.ndarray | None] = {}
        self.loading: dict[bytes, int] = {}  # key -> loads in flight (not evictable)
        self.fail_loads: set[bytes] = set()
        self.fail_stores: set[bytes] = set()
        self.busy = False
        self.pool = None
        self._tokens = itertools.count(1)
        self._queue: list[tuple[int, TierCompletion]] = []  # (polls left, completion)
        self._events = EventLog(event_log_keys)
        self.counters = {"stores": 0, "loads": 0, "load_failures": 0, "evictions": 0}

    def lookup(self, key: bytes) -> LookupResult:
        return LookupResult.HIT if key in self.data else LookupResult.MISS

    def admit(self, key: bytes) -> bool:
        return self.admission.offer(key)

    def _slot_bytes(self, slot: int) -> np.ndarray | None:
        return None if self.pool is None else self.pool.view(slot)

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        check_slots(keys, slots, self.pool)
        if self.busy:
            return None
        token = next(self._tokens)
        key_ok = []
        stored = []
        for key, slot in zip(keys, slots):
            ok = key not in self.fail_stores and self._make_room(key)
            if ok:
                view = self._slot_bytes(slot)
                self.data[key] = None if view is None else view.copy()
                self.policy.insert(key)
                stored.append(key)
            key_ok.append(ok)
        self.counters["stores"] += len(stored)
        if stored:
            self._events.append(TierEvent(stored, self.name, removed=False))
        done = TierCompletion(token, all(key_ok), "store", list(keys), key_ok=key_ok)
        self._queue.append((self.delay_polls, done))
        return token

    def _make_room(self, key: bytes) -> bool:
        if key in self.data:
            self.policy.remove(key)
            return True
        if self.capacity is None or len(self.data) < self.capacity:
            return True
        for victim in self.policy.victims():
            if victim not in self.loading:
                break
        else:
            return False
        self.policy.remove(victim, evicted=True)
        del self.data[victim]
        self.counters["evictions"] += 1
        self._events.append(TierEvent([victim], self.name, removed=True))
        return True

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        check_slots(keys, slots, self.pool)
        if self.busy:
            return None
        token = next(self._tokens)
        key_ok = []
        for key, slot in zip(keys, slots):
            src = self.data.get(key, None)
            ok = key in self.data and key not in self.fail_loads
            if ok:
                view = self._slot_bytes(slot)
                if view is not None and src is not None:
                    view[:] = src
                self.policy.touch(key)
            else:
                self.counters["load_failures"] += 1
                if key in self.data:  # a failed read drops the record, as disk does
                    del self.data[key]
                    self.policy.remove(key)
                    self._events.append(TierEvent([key], self.name, removed=True))
            key_ok.append(ok)
            self.loading[key] = self.loading.get(key, 0) + 1
        self.counters["loads"] += sum(key_ok)
        self._queue.append(
            (
                self.delay_polls,
                TierCompletion(token, all(key_ok), "load", list(keys), key_ok=key_ok),
            )
        )
        return token

    def poll(self) -> list[TierCompletion]:
        out, keep = [], []
        for left, c in self._queue:
            if left <= 1:
                out.append(c)
                if c.kind == "load":
                    for k in c.keys:
                        n = self.loading.get(k, 0) - 1
                        if n <= 0:
                            self.loading.pop(k, None)
                        else:
                            self.loading[k] = n
            else:
                keep.append((left - 1, c))
        self._queue = keep
        return out

    def take_events(self) -> list[TierEvent]:
        return self._events.take()

    def has_pending_work(self) -> bool:
        return bool(self._queue)

    def reset(self) -> None:
        self.data.clear()
        self.policy = make_policy("lru", self.capacity or (1 << 62))

    def stats(self) -> dict[str, Any]:
        return {"blocks": len(self.data), "events_dropped": self._events.dropped, **self.counters}
