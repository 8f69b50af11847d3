"""PLFU and Belady against small reference implementations written here.

The references re-derive each policy from its description (the module
docstrings), by brute force: every eviction ranks all resident keys from
scratch. They share no code with kvtier.policy; a replay through the real
host tier and manager must give exactly their hit counts.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvtier
import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.policy import PLFUPolicy, make_policy
from kvtier.policy.belady import BeladyPolicy
from kvtier.replay import WORKLOADS, Replayer, key_of
from kvtier.tiers.host import HostTier

Trace = list[list[int]]


# -- the cache as kvtier replay drives it, with a pluggable ranking ------------
class RefCache:
    """What the manager does per request with no data: hit the resident
    prefix (touching each hit in order), touch resident keys after the first
    miss, evict for the new ones (never a key of the offer; stores as many
    as fit), insert the stored ones in order."""

    def __init__(self, capacity: int, ranker: Any) -> None:
        self.capacity = capacity
        self.r = ranker
        self.resident: set[int] = set()
        self.hits = 0

    def request(self, i: int, ids: list[int]) -> None:
        self.r.now = i
        n = 0
        while n < len(ids) and ids[n] in self.resident:
            n += 1
        self.hits += n
        for h in ids[:n]:
            self.r.touch(h)
        new = []
        for h in ids[n:]:
            if h in self.resident:
                self.r.touch(h)
            elif h not in new:
                new.append(h)
        free = self.capacity - len(self.resident)
        if len(new) > free:
            offer = set(ids[n:])
            out = [k for k in self.r.order() if k not in offer][: len(new) - free]
            for k in out:
                self.resident.discard(k)
                self.r.evict(k)
            new = new[: free + len(out)]
        for h in new:
            self.resident.add(h)
            self.r.insert(h)


class RefLRU:
    def __init__(self) -> None:
        self.t = 0
        self.last: dict[int, int] = {}

    def insert(self, h: int) -> None:
        self.t += 1
        self.last[h] = self.t

    touch = insert

    def evict(self, h: int) -> None:
        del self.last[h]

    def order(self) -> list[int]:
        return sorted(self.last, key=self.last.__getitem__)


class RefPLFU:
    """Priority = burst of last use + beta * capacity / rate * weight(class);
    lowest first, then the higher class, then the key put last."""

    def __init__(self, capacity: int, beta: float = 1.0, ghost_ratio: float = 16.0,
                 max_burst: int = 256) -> None:  # fmt: skip
        self.capacity, self.beta, self.max_burst = capacity, beta, max_burst
        self.w = [0.0, 1.0, 2.0, 3.0, -0.5]  # classes 0-3 by count, 4: last of a run
        self.ghost_cap = int(ghost_ratio * capacity)
        self.ghost: OrderedDict[int, int] = OrderedDict()
        self.state: dict[int, list[int]] = {}  # key -> [class, burst, count, put order]
        self.burst = self.run = self.inserts = self.puts = 0
        self.run_last: int | None = None
        self.rate = 0.0

    def _put(self, h: int, cls: int, burst: int, count: int) -> None:
        self.puts += 1
        self.state[h] = [cls, burst, count, self.puts]

    def _end_burst(self) -> None:
        k, self.run_last, self.run = self.run_last, None, 0
        if k is not None and k in self.state and self.state[k][0] == 0 and self.state[k][2] == 0:
            self._put(k, 4, self.state[k][1], 0)
        self.rate += (self.inserts - self.rate) * (1.0 / 100)
        self.inserts = 0
        self.burst += 1

    def insert(self, h: int) -> None:
        if self.run >= self.max_burst:
            self._end_burst()
        count = self.ghost.pop(h, 0)
        self._put(h, min(count, 3), self.burst, count)
        self.run += 1
        self.inserts += 1
        self.run_last = h if count == 0 else None

    def touch(self, h: int) -> None:
        if self.run:
            self._end_burst()
        count = self.state[h][2] + 1
        self._put(h, min(count, 3), self.burst, count)

    def evict(self, h: int) -> None:
        count = self.state.pop(h)[2]
        if h == self.run_last:
            self.run_last = None
        self.ghost[h] = count + 1
        while len(self.ghost) > self.ghost_cap:
            self.ghost.popitem(last=False)

    def order(self) -> list[int]:
        horizon = self.capacity / max(self.rate, 1e-3)

        def rank(h: int) -> tuple[float, int, int]:
            cls, burst, _, put = self.state[h]
            return (burst + self.beta * horizon * self.w[cls], -cls, -put)

        return sorted(self.state, key=rank)


class RefBelady:
    """Furthest next use first (never used again: first of all), then deepest."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.now = 0
        self.resident: set[int] = set()

    def insert(self, h: int) -> None:
        self.resident.add(h)

    def touch(self, h: int) -> None:
        pass

    def evict(self, h: int) -> None:
        self.resident.discard(h)

    def order(self) -> list[int]:
        def nxt(h: int) -> tuple[int, int]:
            for j in range(self.now + 1, len(self.trace)):
                if h in self.trace[j]:
                    return (j, self.trace[j].index(h))
            return (1 << 62, 0)

        return sorted(self.resident, key=nxt, reverse=True)


def reference_hits(trace: Trace, capacity: int, ranker: Any) -> int:
    c = RefCache(capacity, ranker)
    for i, ids in enumerate(trace):
        c.request(i, ids)
    return c.hits


def kvtier_hits(trace: Trace, capacity: int, policy: Any,
                on_request: Callable[[int], None] | None = None) -> int:  # fmt: skip
    m = TieredOffloadingManager(HostTier(None, capacity, policy=policy))
    try:
        return Replayer(m, on_request=on_request).run(trace, progress=False).hits
    finally:
        m.shutdown()


CASES = [("chat", 400, 60), ("rag", 400, 120), ("agent", 250, 200), ("agent", 250, 700)]


# -- tests ----------------------------------------------------------------------
@pytest.mark.parametrize("workload,requests,capacity", CASES)
def test_reference_harness_agrees_on_lru(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefLRU())
    assert want > 0
    assert kvtier_hits(trace, capacity, "lru") == want


@pytest.mark.parametrize("workload,requests,capacity", CASES)
def test_plfu_exact_hits(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefPLFU(capacity))
    assert kvtier_hits(trace, capacity, "plfu") == want
    # and it is not LRU in disguise on at least one of these
    if workload == "agent":
        assert want != reference_hits(trace, capacity, RefLRU())


def test_plfu_exact_hits_with_small_ghosts_and_bursts() -> None:
    trace = WORKLOADS["agent"](250, 1)
    kw: dict[str, Any] = {"beta": 2.0, "ghost_ratio": 0.5, "max_burst": 8}
    want = reference_hits(trace, 150, RefPLFU(150, **kw))
    assert kvtier_hits(trace, 150, PLFUPolicy(150, **kw)) == want


@pytest.mark.parametrize("workload,requests,capacity", CASES[:3])
def test_belady_exact_hits(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefBelady(trace))
    pol = BeladyPolicy(trace, key_of)
    assert kvtier_hits(trace, capacity, pol, pol.advance) == want
    assert want >= reference_hits(trace, capacity, RefPLFU(capacity))


def test_plfu_is_deterministic() -> None:
    trace = WORKLOADS["chat"](300, 5)
    a, b = PLFUPolicy(50), PLFUPolicy(50)
    assert kvtier_hits(trace, 50, a) == kvtier_hits(trace, 50, b)
    assert list(a.victims()) == list(b.victims())


def test_plfu_evicts_the_deepest_blocks_of_a_request_first() -> None:
    p = PLFUPolicy(5)
    for k in "abcde":  # one request's new blocks, a prefix in order
        p.insert(k)
    assert list(p.victims())[:2] == ["e", "d"]  # e: the run's last (partial) block
    p.touch("a")  # the next request hits a, b and goes on elsewhere
    p.touch("b")
    p.insert("x")
    assert list(p.victims())[:3] == ["e", "d", "c"]  # old, never reused; parents a, b stay
    p.remove("c", evicted=True)
    assert p.ghosts() == 1 and len(p) == 5


def test_plfu_by_name_and_bad_arguments() -> None:
    assert isinstance(make_policy("plfu", 10), PLFUPolicy)
    assert isinstance(HostTier(None, 10, policy="PLFU").policy, PLFUPolicy)
    assert isinstance(HostTier(None, None, policy="plfu").policy, PLFUPolicy)  # unbounded
    with pytest.raises(kvtier.InvalidArgument, match="only kvtier replay"):
        make_policy("belady", 10)
    with pytest.raises(kvtier.InvalidArgument, match="plfu"):
        make_policy("nope", 10)
    with pytest.raises(kvtier.InvalidArgument, match="non-decreasing"):
        PLFUPolicy(10, weights=(0, 2, 1))
    with pytest.raises(kvtier.InvalidArgument, match="capacity"):
        PLFUPolicy(0)


@pytest.mark.parametrize("policy", ["plfu", "belady"])
def test_replay_cli_runs_new_policies_and_workloads(tmp_path: Path, policy: str) -> None:
    from kvtier.cli import main

    out = tmp_path / "r.json"
    args = ["replay", "--workload", "rag", "--no-data", "--host-blocks", "80",
            "--max-requests", "200", "--policy", policy, "--no-progress", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["policy"] == policy and r["trace"].startswith("synthetic(rag, 200")
    trace = WORKLOADS["rag"](200, 0)
    ranker = RefPLFU(80) if policy == "plfu" else RefBelady(trace)
    assert sum(r["hit_blocks"].values()) == reference_hits(trace, 80, ranker)
