"""PLFU and Belady against small reference implementations written here.

The references re-derive each policy from its description (the module
docstrings), by brute force: every eviction ranks all resident keys from
scratch. They share no code with kvtier.policy; a replay through the real
host tier and manager must give exactly their hit counts, with the Python
PLFU and with the native one (csrc/core/disk/plfu.h), and the disk index's
``plfu`` driven by the same requests must too.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvtier
import pytest
from kvtier import _native
from kvtier.manager import TieredOffloadingManager
from kvtier.policy import PLFUPolicy, make_policy, native_plfu
from kvtier.policy.belady import BeladyPolicy
from kvtier.replay import WORKLOADS, Replayer, key_of
from kvtier.tiers.disk import key_digest
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


class RefRank:
    """One ranking: priority = burst of last use + beta * capacity / rate *
    weight(class), lowest first, then the higher class, then the key put
    last; classes 0-3 by count, 4: the last key of an insert run."""

    def __init__(self, capacity: int, beta: float, weights: list[float], ghost_cap: int) -> None:
        self.capacity, self.beta, self.w = capacity, beta, weights
        self.ghost_cap = ghost_cap
        self.ghost: OrderedDict[int, int] = OrderedDict()
        self.state: dict[int, list[int]] = {}  # key -> [class, burst, count, put order]
        self.rate = 0.0
        self.inserts = self.puts = 0
        self.score = 0.0  # as a miniature: decayed hits

    def put(self, h: int, cls: int, burst: int, count: int) -> None:
        self.puts += 1
        self.state[h] = [cls, burst, count, self.puts]

    def add(self, h: int, burst: int) -> int:
        count = self.ghost.pop(h, 0)
        self.put(h, min(count, 3), burst, count)
        self.inserts += 1
        return count

    def use(self, h: int, burst: int) -> None:
        count = self.state[h][2] + 1
        self.put(h, min(count, 3), burst, count)

    def mark_last(self, h: int) -> None:
        if h in self.state and self.state[h][0] == 0 and self.state[h][2] == 0:
            self.put(h, 4, self.state[h][1], 0)

    def end_burst(self) -> None:
        self.rate += (self.inserts - self.rate) * (1.0 / 100)
        self.inserts = 0

    def evict(self, h: int) -> None:
        count = self.state.pop(h)[2]
        if self.ghost_cap:
            self.ghost[h] = count + 1
        while len(self.ghost) > self.ghost_cap:
            self.ghost.popitem(last=False)

    def ranker(self) -> Callable[[int], tuple[float, int, int]]:
        """The rank of a key (the class's term computed once a ranking, the
        same float operations in the same order: a miniature's eviction
        ranks every key of it, 17 million ranks in the many-miniature test)."""
        horizon = self.capacity / max(self.rate, 1e-3)
        term = [self.beta * horizon * weight for weight in (*self.w, -0.5)]  # class 4: -0.5
        state = self.state

        def rank(h: int) -> tuple[float, int, int]:
            cls, burst, _, put = state[h]
            return (burst + term[cls], -cls, -put)

        return rank

    def order(self) -> list[int]:
        return sorted(self.state, key=self.ranker())


class RefPLFU:
    """Bursts (a touch after an insert, or max_burst inserts, ends one), the
    last key of each insert run, and miniature caches over a crc32 sample of
    the keys, one per (beta, weights), whose best sets the main ranking's."""

    def __init__(self, capacity: int, beta: float = 1.0, ghost_ratio: float = 16.0,
                 max_burst: int = 256, variants: Any = None, sample_keys: int = 512,
                 window: int = 2000) -> None:  # fmt: skip
        rising, once = [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 1.0]
        if variants is None:
            variants = [(b, rising) for b in (0.0, 0.5, 1.0, 2.0, 4.0)]
            variants += [(b, once) for b in (1.0, 2.0, 4.0)]
        ghost_cap = int(ghost_ratio * capacity)
        self.main = RefRank(capacity, beta, rising, ghost_cap)
        self.max_burst, self.decay = max_burst, 1.0 - 1.0 / window
        self.burst = self.run = 0
        self.run_last: int | None = None
        self.sample = 1
        while capacity // (self.sample * 2) >= sample_keys:
            self.sample *= 2
        self.minis = [
            RefRank(max(1, capacity // self.sample), b, list(w), ghost_cap // self.sample)
            for b, w in variants
        ]

    def sampled(self, h: int) -> bool:
        return bool(self.minis) and zlib.crc32(struct.pack(">qI", h, 0)) % self.sample == 0

    def reference_minis(self, h: int) -> None:
        if not self.sampled(h):
            return
        for mini in self.minis:
            if h in mini.state:
                mini.score += 1
                mini.use(h, self.burst)
            else:
                mini.add(h, self.burst)
                if len(mini.state) > mini.capacity:
                    mini.evict(min(mini.state, key=mini.ranker()))

    def end_burst(self) -> None:
        k, self.run_last, self.run = self.run_last, None, 0
        if k is not None:
            self.main.mark_last(k)
        self.main.end_burst()
        for mini in self.minis:
            if k is not None and self.sampled(k):
                mini.mark_last(k)
            mini.end_burst()
            mini.score *= self.decay
        if self.minis:
            best = max(self.minis, key=lambda m: m.score)  # the first of equals
            if best.score > 0:
                self.main.beta, self.main.w = best.beta, best.w
        self.burst += 1

    def insert(self, h: int) -> None:
        if self.run >= self.max_burst:
            self.end_burst()
        count = self.main.add(h, self.burst)
        self.run += 1
        self.run_last = h if count == 0 else None
        self.reference_minis(h)

    def touch(self, h: int) -> None:
        if self.run:
            self.end_burst()
        self.main.use(h, self.burst)
        self.reference_minis(h)

    def evict(self, h: int) -> None:
        self.main.evict(h)
        if h == self.run_last:
            self.run_last = None

    def order(self) -> list[int]:
        return self.main.order()


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
    # The ranking alone, as the reference models it: without the host
    # tier's prefix-aware choice among the policy's victims.
    m = TieredOffloadingManager(HostTier(None, capacity, policy=policy, prefix_aware=False))
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
def test_plfu_fixed_exact_hits(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefPLFU(capacity, variants=[]))
    assert kvtier_hits(trace, capacity, PLFUPolicy(capacity, variants=())) == want
    if workload == "agent":  # not LRU in disguise
        assert want != reference_hits(trace, capacity, RefLRU())


@pytest.mark.parametrize("workload,requests,capacity", CASES)
def test_plfu_adaptive_exact_hits(workload: str, requests: int, capacity: int) -> None:
    """Miniatures of 1/8 to 1/32 of the cache (sample_keys=16), default variants."""
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefPLFU(capacity, sample_keys=16, window=200))
    pol = PLFUPolicy(capacity, sample_keys=16, window=200)
    assert kvtier_hits(trace, capacity, pol) == want


def test_plfu_adaptive_exact_hits_over_many_bursts() -> None:
    """A short window: the miniatures' scores are rescaled (their units grow
    by 1/decay a burst) several times; the choice must not move."""
    trace = WORKLOADS["agent"](3000, 3)  # 1,348 bursts; a rescale every ~800
    want = reference_hits(trace, 120, RefPLFU(120, sample_keys=8, window=4))
    assert kvtier_hits(trace, 120, PLFUPolicy(120, sample_keys=8, window=4)) == want


def test_plfu_default_is_the_adaptive_one() -> None:
    trace = WORKLOADS["agent"](200, 2)
    want = reference_hits(trace, 150, RefPLFU(150))  # miniatures as large as the cache
    assert kvtier_hits(trace, 150, "plfu") == want


def test_plfu_exact_hits_with_small_ghosts_and_bursts() -> None:
    trace = WORKLOADS["agent"](250, 1)
    kw: dict[str, Any] = {"beta": 2.0, "ghost_ratio": 0.5, "max_burst": 8}
    want = reference_hits(trace, 150, RefPLFU(150, variants=[], **kw))
    assert kvtier_hits(trace, 150, PLFUPolicy(150, variants=(), **kw)) == want


@pytest.mark.parametrize("workload,requests,capacity", CASES[:3])
def test_belady_exact_hits(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefBelady(trace))
    pol = BeladyPolicy(trace, key_of)
    assert kvtier_hits(trace, capacity, pol, pol.advance) == want
    assert want >= reference_hits(trace, capacity, RefPLFU(capacity, variants=[]))


def test_plfu_is_deterministic() -> None:
    trace = WORKLOADS["chat"](300, 5)
    a, b = PLFUPolicy(50), PLFUPolicy(50)
    assert kvtier_hits(trace, 50, a) == kvtier_hits(trace, 50, b)
    assert list(a.victims()) == list(b.victims())


def test_plfu_evicts_the_deepest_blocks_of_a_request_first() -> None:
    p = PLFUPolicy(5, variants=())
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
    py_path = "kvtier.policy.plfu.PLFUPolicy"  # the Python one, by its path
    assert isinstance(make_policy(py_path, 10), PLFUPolicy)
    assert isinstance(HostTier(None, None, policy=py_path).policy, PLFUPolicy)  # unbounded
    with pytest.raises(kvtier.InvalidArgument, match="only kvtier replay"):
        make_policy("belady", 10)
    with pytest.raises(kvtier.InvalidArgument, match="plfu"):
        make_policy("nope", 10)
    for make in (PLFUPolicy, native_plfu):  # the same refusals, native or not
        with pytest.raises(kvtier.InvalidArgument, match="non-decreasing"):
            make(10, weights=(0, 2, 1))
        with pytest.raises(kvtier.InvalidArgument, match="as many as"):
            make(10, variants=[(1.0, (0, 1))])
        with pytest.raises(kvtier.InvalidArgument, match="capacity"):
            make(0)


@pytest.mark.parametrize("policy", ["plfu", "belady"])
def test_replay_cli_runs_new_policies_and_workloads(tmp_path: Path, policy: str) -> None:
    from kvtier.cli import main

    out = tmp_path / "r.json"
    args = ["replay", "--workload", "rag", "--no-data", "--host-blocks", "80",
            "--max-requests", "200", "--policy", policy, "--no-progress", "--json", str(out),
            "--no-prefix-eviction"]  # fmt: skip
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["policy"] == policy and r["trace"].startswith("synthetic(rag, 200")
    trace = WORKLOADS["rag"](200, 0)
    ranker = RefPLFU(80) if policy == "plfu" else RefBelady(trace)  # type: Any
    assert sum(r["hit_blocks"].values()) == reference_hits(trace, 80, ranker)


def test_replay_lower_admit_after_gates_the_disk_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The baseline of lower-tier admission: write on the N-th offer."""
    from kvtier.cli import main

    stats = []
    for n in (1, 2):
        out = tmp_path / f"r{n}.json"
        args = ["replay", "--max-requests", "300", "--no-data", "--host-blocks", "40",
                "--disk", f"{tmp_path}/d{n}:8MiB", "--lower-admit-after", str(n),
                "--no-progress", "--json", str(out)]  # fmt: skip
        assert main(args) == 0
        stats.append(json.loads(out.read_text())["tiers"]["disk"])
    assert stats[0]["not_admitted"] == 0 < stats[1]["not_admitted"]
    assert 0 < stats[1]["stores"] < stats[0]["stores"]
    assert main(["replay", "--max-requests", "5", "--no-data", "--lower-admit-after", "0"]) != 0
    assert "--lower-admit-after: must be >= 1" in capsys.readouterr().err


# -- the native ranking (csrc/core/disk/plfu.h): the host tier's "plfu" --------
@pytest.mark.parametrize("workload,requests,capacity", CASES)
def test_native_plfu_exact_hits(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    fixed = reference_hits(trace, capacity, RefPLFU(capacity, variants=[]))
    assert kvtier_hits(trace, capacity, native_plfu(capacity, variants=())) == fixed
    want = reference_hits(trace, capacity, RefPLFU(capacity, sample_keys=16, window=200))
    pol = native_plfu(capacity, sample_keys=16, window=200)
    assert kvtier_hits(trace, capacity, pol) == want


def test_native_plfu_exact_hits_over_many_bursts_and_small_ghosts() -> None:
    trace = WORKLOADS["agent"](3000, 3)
    want = reference_hits(trace, 120, RefPLFU(120, sample_keys=8, window=4))
    assert kvtier_hits(trace, 120, native_plfu(120, sample_keys=8, window=4)) == want
    trace = WORKLOADS["agent"](250, 1)
    kw: dict[str, Any] = {"beta": 2.0, "ghost_ratio": 0.5, "max_burst": 8}
    want = reference_hits(trace, 150, RefPLFU(150, variants=[], **kw))
    assert kvtier_hits(trace, 150, native_plfu(150, variants=(), **kw)) == want


def test_native_plfu_names_the_python_policys_victims() -> None:
    """Random calls (any hashable keys: the native one samples a non-bytes
    key by its repr, as plfu.py does), unbounded capacity (ids grow past
    the first 1,025): the same victims in the same order after every call."""
    import random

    rng = random.Random(4)
    for capacity in (64, 1 << 62):
        py_pol, nat = PLFUPolicy(capacity, sample_keys=4), native_plfu(capacity, sample_keys=4)
        resident: list[Any] = []
        for step in range(6000):
            op = rng.random()
            key: Any = rng.randrange(3000) if step % 2 else b"k%d" % rng.randrange(3000)
            if op < 0.55 and key not in resident:
                if capacity < 1 << 40 and len(resident) >= capacity:
                    victim = next(iter(py_pol.victims()))
                    assert next(iter(nat.victims())) == victim
                    for p in (py_pol, nat):
                        p.remove(victim, evicted=True)
                    resident.remove(victim)
                for p in (py_pol, nat):
                    p.insert(key)
                resident.append(key)
            elif op < 0.9 and resident:
                key = rng.choice(resident)
                for p in (py_pol, nat):
                    p.touch(key)
            elif resident:
                key = resident.pop(rng.randrange(len(resident)))
                for p in (py_pol, nat):
                    p.remove(key)
            if step % 500 == 0:
                assert list(nat.victims()) == list(py_pol.victims())
        assert list(nat.victims()) == list(py_pol.victims())
        assert len(nat) == len(py_pol) == len(resident)
        assert nat.ghosts() == py_pol.ghosts()
        assert (nat.beta, nat.weights, nat.horizon) == (py_pol.beta, py_pol.weights, py_pol.horizon)
    assert len(resident) > 1025


def test_native_plfu_by_name_and_its_guards() -> None:
    from kvtier import _native

    assert isinstance(make_policy("plfu", 10), _native.PlfuPolicy)
    assert isinstance(HostTier(None, 10, policy="PLFU").policy, _native.PlfuPolicy)
    assert isinstance(HostTier(None, None, policy="plfu").policy, _native.PlfuPolicy)
    assert _native.PlfuPolicy.bytes_per_key == 14
    with pytest.raises(TypeError):
        _native.PlfuPolicy()
    p = native_plfu(10)
    for k in (b"a", b"b", b"c"):
        p.insert(k)
    p.remove(b"zz", evicted=True)  # not resident: nothing
    p.touch(b"zz")
    with pytest.raises(TypeError):
        p.insert([1])  # unhashable, as a dict key would be
    it = p.victims()
    assert next(it) == b"c"
    p.touch(b"a")
    with pytest.raises(RuntimeError, match="changed while"):
        next(it)  # the caller broke base.py's contract: caught, not walked into
    assert sorted(p.victims()) == [b"a", b"b", b"c"] and len(p) == 3


def test_native_plfu_is_deterministic() -> None:
    trace = WORKLOADS["chat"](300, 5)
    a, b = native_plfu(50), native_plfu(50)
    assert kvtier_hits(trace, 50, a) == kvtier_hits(trace, 50, b)
    assert list(a.victims()) == list(b.victims())


# -- the disk index's "plfu" -------------------------------------------------------
class RefDiskPLFU(RefPLFU):
    """The disk index knows keys by their digest: it samples a key for the
    miniatures by digest bytes 12-15 (little-endian) instead of crc32."""

    def sampled(self, h: int) -> bool:
        dig = key_digest(key_of(h))
        return bool(self.minis) and int.from_bytes(dig[12:16], "little") % self.sample == 0


def disk_index_hits(trace: Trace, capacity: int) -> int:
    """RefCache's requests on a DiskIndex: hit the ready prefix (touching
    each), touch ready keys after the first miss, pin the ready keys of the
    offer, claim records for the new ones (evicting as needed), then make
    them ready in order."""
    ix = _native.DiskIndex(capacity, "plfu")
    hits = 0
    for ids in trace:
        digs = [key_digest(key_of(h)) for h in ids]
        n = 0
        while n < len(digs) and ix.ready(digs[n]):
            n += 1
        hits += n
        for d in digs[:n]:
            ix.touch(ix[d])
        new: list[bytes] = []
        for d in digs[n:]:
            if ix.ready(d):
                ix.touch(ix[d])
            elif d not in new:
                new.append(d)
        pinned = [r for r in (ix.pin_ready(d) for d in set(digs[n:])) if r >= 0]
        recs = []
        for d in new:
            rec, _ = ix.claim(d)
            if rec < 0:
                break
            recs.append(rec)
        for rec in recs:
            ix.set_ready(rec)
        for rec in pinned:
            ix.unpin(rec)
    return hits


@pytest.mark.parametrize("workload,requests,capacity", CASES)
def test_disk_index_plfu_exact_hits(workload: str, requests: int, capacity: int) -> None:
    trace = WORKLOADS[workload](requests, 0)
    want = reference_hits(trace, capacity, RefDiskPLFU(capacity))
    assert disk_index_hits(trace, capacity) == want
    if workload == "agent":  # not LRU in disguise
        assert want != reference_hits(trace, capacity, RefLRU())


def test_disk_index_plfu_exact_hits_with_many_miniatures() -> None:
    """1,100 records: miniatures of 550 keys over a 1/2 sample of the digests."""
    trace = WORKLOADS["agent"](1500, 2)
    want = reference_hits(trace, 1100, RefDiskPLFU(1100))
    assert disk_index_hits(trace, 1100) == want
    assert _native.DiskIndex(1100, "plfu").plfu == {
        "beta": 1.0, "weights": [0.0, 1.0, 2.0, 3.0], "horizon": 1100 / 1e-3, "ghosts": 0,
        "miniatures": 8, "sample_mask": 1,
    }  # fmt: skip


def test_disk_index_policy_bytes_per_record() -> None:
    by = _native.DiskIndex.policy_bytes_per_record
    assert (by("clock"), by("lru"), by("plfu")) == (1, 8, 14)  # CLOCK: its reference count
    # With the 7.5-byte table share and the 23 bytes every record has (csrc/core/disk/index.h).
    every = _native.DiskIndex.bytes_per_record
    assert (every("clock"), every("lru"), every("plfu")) == (31.5, 38.5, 44.5)
    assert _native.DiskIndex(4, "lru").plfu is None


def test_replay_with_the_disk_tier_on_plfu(tmp_path: Path) -> None:
    from kvtier.cli import main

    runs = []
    for n in (1, 2):
        out = tmp_path / f"r{n}.json"
        args = ["replay", "--workload", "agent", "--max-requests", "300", "--no-data",
                "--host-blocks", "60", "--policy", "plfu", "--disk", f"{tmp_path}/d{n}:4MiB",
                "--disk-policy", "plfu", "--no-progress", "--json", str(out)]  # fmt: skip
        assert main(args) == 0
        runs.append(json.loads(out.read_text()))
    assert runs[0]["disk_policy"] == "plfu"
    assert runs[0]["hit_blocks"]["disk"] > 0 and runs[0]["tiers"]["disk"]["evictions"] > 0
    assert runs[0]["hit_blocks"] == runs[1]["hit_blocks"]  # deterministic
