"""PLFU: prefix-consistent LRU weighted by how often a key came back.

Process: the engine's scheduler (or ``kvtier replay``).

Who calls: the host tier (``HostTier(policy="plfu")``, ``kvtier_policy``,
``kvtier replay --policy plfu``), under the manager's lock, never
concurrently. Pure bookkeeping: no call blocks or does I/O. Deterministic:
the same sequence of calls gives the same victims (no randomness, no clock;
keys are sampled by crc32).

Why (measured on the Mooncake conversation trace, bench/results/policy/):
a key that was used again is more likely to be used again (blocks referenced
once: 23% are reused within 2,000 requests; twice: 40%; four times: 56%), but
most such reuse comes after LRU has already evicted the key, so counting hits
of resident keys only misses it. PLFU keeps a bounded ghost map of evicted
keys and their counts, and orders the resident keys by

    priority = burst of last use + beta * horizon * weight[min(count, 3)]

lowest first, where ``horizon`` is how many bursts the cache holds at the
current insert rate (capacity / inserts per burst, an average over about 100
bursts), so that the bonus scales with the cache. A *burst* is one request's
calls as the manager makes them: touches of the prefix it hit (in prefix
order), then inserts of the new keys (in prefix order). A burst ends at the
first touch after an insert (or after ``max_burst`` inserts in a row).

Prefix consistency: a block is useful only while every block before it is
resident. Keys used in one burst share its number; a parent is used whenever
its child is, so its count and its burst are never below the child's, and
with weights that grow with the count the parent's priority is never below
its child's: the child goes first. Keys of equal priority leave deepest first
(last put first). The last key of an insert run (for a trace: the request's
partial last block, reused under 1% of the time) gets ``last_weight``.

How much frequency is worth depends on the workload (chat sessions that end
after a few quick turns: none; a production trace whose conversations come
back minutes later: a lot), so ``beta`` and ``weights`` adapt: one miniature
cache per pair in ``variants`` (:data:`VARIANTS`; beta 0 is LRU) replays
the keys whose crc32 falls in a 1/M sample
(M a power of two, so that each holds about 512 keys or more), with capacity
capacity/M, driven by the same bursts; every burst the policy takes the beta
and weights of the miniature with the most hits over about the last
``window`` bursts (the first such on a tie; ``variants=()``: fixed)
(spatial sampling after Waldspurger et al., "Cache Modeling and Optimization
using Miniature Simulations", USENIX ATC'17).

Per-key state: resident keys 3 ints (class, burst, count) in a dict plus an
entry in one ordered group; ghosts one int per key, at most
``min(ghost_ratio * capacity, ghost_max)`` keys; the miniatures hold about
``len(variants)`` / M as much again.
"""

from __future__ import annotations

import itertools
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.errors import InvalidArgument

_Group = OrderedDict[Any, None]
_UNBOUNDED = 1 << 40  # capacities from here on never evict: no miniatures
_RISING = (0.0, 1.0, 2.0, 3.0)  # each use counts
_ONCE = (0.0, 1.0, 1.0, 1.0)  # used again or not
#: (beta, weights) the miniatures try: beta 0 is LRU (deepest block first).
VARIANTS: tuple[tuple[float, tuple[float, ...]], ...] = (
    (0.0, _RISING),
    (0.5, _RISING),
    (1.0, _RISING),
    (2.0, _RISING),
    (4.0, _RISING),
    (1.0, _ONCE),
    (2.0, _ONCE),
    (4.0, _ONCE),
)


class _Ranking:
    """The resident keys' order and the ghosts: what the policy and each of
    its miniature caches keep. Bursts are given by the caller."""

    def __init__(
        self, capacity: int, beta: float, weights: list[float], last_weight: float,
        ghost_cap: int, alpha: float,
    ) -> None:  # fmt: skip
        self.capacity = capacity
        self.beta = beta
        self.weights = weights
        self.last_weight = last_weight
        self.last_cls = len(weights)
        self.groups: list[OrderedDict[int, _Group]] = [
            OrderedDict() for _ in range(len(weights) + 1)
        ]
        self.meta: dict[Any, list[int]] = {}  # key -> [class, burst, count]
        self.ghost: OrderedDict[Any, int] = OrderedDict()  # evicted key -> count
        self.ghost_cap = ghost_cap
        self.alpha = alpha
        self.insert_rate = 0.0  # inserts per burst (moving average)
        self.inserts = 0  # in the current burst

    def _put(self, key: Any, m: list[int]) -> None:
        per = self.groups[m[0]]
        g = per.get(m[1])
        if g is None:
            g = per[m[1]] = OrderedDict()
        g[key] = None

    def _take(self, key: Any, m: list[int]) -> None:
        per = self.groups[m[0]]
        g = per[m[1]]
        del g[key]
        if not g:
            del per[m[1]]

    def add(self, key: Any, burst: int) -> int:
        """``key`` became resident in ``burst``; returns its count (from its ghost)."""
        count = self.ghost.pop(key, 0)
        m = [min(count, len(self.weights) - 1), burst, count]
        self.meta[key] = m
        self._put(key, m)
        self.inserts += 1
        return count

    def use(self, key: Any, burst: int) -> None:
        """Resident ``key`` was used in ``burst``."""
        m = self.meta[key]
        self._take(key, m)
        m[2] += 1
        m[0] = min(m[2], len(self.weights) - 1)
        m[1] = burst
        self._put(key, m)

    def mark_last(self, key: Any) -> None:
        """``key`` was the last of an insert run: class ``last`` if never used since."""
        m = self.meta.get(key)
        if m is not None and m[0] == 0 and m[2] == 0:
            self._take(key, m)
            m[0] = self.last_cls
            self._put(key, m)

    def end_burst(self) -> None:
        self.insert_rate += (self.inserts - self.insert_rate) * self.alpha
        self.inserts = 0

    def remove(self, key: Any, evicted: bool) -> bool:
        m = self.meta.pop(key, None)
        if m is None:
            return False
        self._take(key, m)
        if evicted and self.ghost_cap:
            self.ghost[key] = m[2] + 1
            if len(self.ghost) > self.ghost_cap:
                self.ghost.popitem(last=False)
        return True

    def bonus(self, cls: int) -> float:
        w = self.last_weight if cls == self.last_cls else self.weights[cls]
        return self.beta * (self.capacity / max(self.insert_rate, 1e-3)) * w

    def first_victim(self) -> Any:
        """``next(self.victims())`` without the generator (the miniatures' hot path)."""
        best: tuple[float, int] | None = None
        group: _Group | None = None
        horizon = self.capacity / max(self.insert_rate, 1e-3)
        for c, per in enumerate(self.groups):
            if per:
                burst, g = next(iter(per.items()))
                w = self.last_weight if c == self.last_cls else self.weights[c]
                rank = (burst + self.beta * horizon * w, -c)
                if best is None or rank < best:
                    best, group = rank, g
        assert group is not None, "first_victim of an empty ranking"
        return next(reversed(group))

    def victims(self) -> Iterator[Any]:
        heads: dict[int, tuple[int, _Group]] = {}
        its = [iter(per.items()) for per in self.groups]
        for c, it in enumerate(its):
            h = next(it, None)
            if h is not None:
                heads[c] = h
        bonus = [self.bonus(c) for c in range(len(its))]
        while heads:
            c = min(heads, key=lambda c: (heads[c][0] + bonus[c], -c))
            yield from reversed(heads[c][1])
            h = next(its[c], None)
            if h is None:
                del heads[c]
            else:
                heads[c] = h


class _Miniature:
    """A cache of ``ranking.capacity`` keys replaying the sampled keys."""

    def __init__(self, ranking: _Ranking, decay: float) -> None:
        self.r = ranking
        self.score = 0.0  # hits, decayed by ``decay`` every burst
        self.decay = decay

    def reference(self, key: Any, burst: int) -> None:
        r = self.r
        if key in r.meta:
            self.score += 1.0
            r.use(key, burst)
            return
        r.add(key, burst)
        if len(r.meta) > r.capacity:
            r.remove(r.first_victim(), evicted=True)


class PLFUPolicy:
    """See the module docstring. ``capacity`` in keys (the host tier's slots)."""

    def __init__(
        self,
        capacity: int,
        beta: float = 1.0,
        weights: Sequence[float] = (0.0, 1.0, 2.0, 3.0),
        last_weight: float = -0.5,
        ghost_ratio: float = 16.0,
        ghost_max: int = 1 << 21,
        rate_window: int = 100,
        max_burst: int = 256,
        variants: Sequence[tuple[float, Sequence[float]]] = VARIANTS,
        window: int = 2000,
        sample_keys: int = 512,
    ) -> None:
        if not capacity >= 1:
            raise InvalidArgument(f"plfu capacity must be >= 1, got {capacity}")
        w = [float(x) for x in weights]
        if not w or any(b < a for a, b in itertools.pairwise(w)):
            raise InvalidArgument(f"plfu weights must be non-empty and non-decreasing, got {w}")
        vs = [(float(b), [float(x) for x in vw]) for b, vw in variants]
        for b, vw in [(float(beta), w), *vs]:
            if b < 0 or len(vw) != len(w) or any(y < x for x, y in itertools.pairwise(vw)):
                raise InvalidArgument(
                    "plfu: betas must be >= 0, variant weights non-decreasing and as many as "
                    f"weights ({len(w)}), got {b}, {vw}"
                )
            if last_weight > vw[0]:
                raise InvalidArgument("plfu: last_weight must be <= every weights[0]")
        if ghost_ratio < 0 or ghost_max < 0:
            raise InvalidArgument("plfu: ghost_ratio and ghost_max must be >= 0")
        if rate_window < 1 or max_burst < 1 or window < 1 or sample_keys < 1:
            raise InvalidArgument("plfu: rate_window, max_burst, window, sample_keys must be >= 1")
        self.capacity = int(capacity)
        self.max_burst = int(max_burst)
        alpha = 1.0 / rate_window
        ghost_cap = int(min(ghost_ratio * capacity, ghost_max))
        self._main = _Ranking(self.capacity, float(beta), w, float(last_weight), ghost_cap, alpha)
        self.burst = 0
        self._run = 0  # inserts since the last touch (0: last call was a touch)
        self._run_last: Any = None  # last key inserted in the current run
        # Miniatures: sample 1 key in M (a power of two), capacity / M each.
        self._minis: list[_Miniature] = []
        self._mask = 0
        if vs and self.capacity < _UNBOUNDED:
            m = 1
            while m * 2 <= 1 << 16 and self.capacity // (m * 2) >= sample_keys:
                m *= 2
            self._mask = m - 1
            decay = 1.0 - 1.0 / window
            lw, cap_m = float(last_weight), max(1, self.capacity // m)
            self._minis = [
                _Miniature(_Ranking(cap_m, b, vw, lw, ghost_cap // m, alpha), decay) for b, vw in vs
            ]

    # -- what the host tier sees -------------------------------------------------
    @property
    def beta(self) -> float:
        """The weight of frequency now (the best miniature's, when adapting)."""
        return self._main.beta

    @property
    def weights(self) -> list[float]:
        """Weights by count now (the best miniature's, when adapting)."""
        return self._main.weights

    @property
    def horizon(self) -> float:
        """Bursts the cache holds at the current insert rate."""
        return self.capacity / max(self._main.insert_rate, 1e-3)

    def _sampled(self, key: Any) -> bool:
        if not self._minis:
            return False
        raw = key if isinstance(key, (bytes, bytearray, memoryview)) else repr(key).encode()
        return zlib.crc32(raw) & self._mask == 0

    def _end_burst(self) -> None:
        k = self._run_last
        self._run_last = None
        self._run = 0
        main = self._main
        if k is not None:
            main.mark_last(k)
        main.end_burst()
        if self._minis:
            sampled_last = k is not None and self._sampled(k)
            best = None
            for mini in self._minis:
                if sampled_last:
                    mini.r.mark_last(k)
                mini.r.end_burst()
                mini.score *= mini.decay
                if best is None or mini.score > best.score:
                    best = mini
            if best is not None and best.score > 0:
                main.beta, main.weights = best.r.beta, best.r.weights
        self.burst += 1

    def insert(self, key: Any) -> None:
        """A key became resident (the manager's ``complete_store``)."""
        if key in self._main.meta:
            self.touch(key)
            return
        if self._run >= self.max_burst:
            self._end_burst()
        count = self._main.add(key, self.burst)
        self._run += 1
        self._run_last = key if count == 0 else None
        if self._sampled(key):
            for mini in self._minis:
                mini.reference(key, self.burst)

    def touch(self, key: Any) -> None:
        """A resident key was used (a load's pin, or offered again)."""
        if key not in self._main.meta:
            return
        if self._run:
            self._end_burst()
        self._main.use(key, self.burst)
        if self._sampled(key):
            for mini in self._minis:
                mini.reference(key, self.burst)

    def remove(self, key: Any, evicted: bool = False) -> None:
        """A key left; an evicted key's count is remembered as a ghost."""
        if self._main.remove(key, evicted) and key == self._run_last:
            self._run_last = None

    def victims(self) -> Iterator[Any]:
        """Resident keys, lowest priority first (see the module docstring)."""
        return self._main.victims()

    def __len__(self) -> int:
        return len(self._main.meta)

    def ghosts(self) -> int:
        """Evicted keys remembered (for tests and stats)."""
        return len(self._main.ghost)
