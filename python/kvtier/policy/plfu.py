"""PLFU: prefix-consistent LRU weighted by how often a key came back.

Who calls: the host tier (``HostTier(policy="plfu")``, ``kvtier_policy``,
``kvtier replay --policy plfu``), under the manager's lock, never
concurrently. Pure bookkeeping: no call blocks or does I/O. Deterministic:
the same sequence of calls gives the same victims (no randomness, no clock).

Why (measured on the Mooncake conversation trace, README's policy section):
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

Per-key state: resident keys 3 ints (class, burst, count) in a dict plus an
entry in one ordered group; ghosts one int per key, at most
``min(ghost_ratio * capacity, ghost_max)`` keys.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.errors import InvalidArgument

_Group = OrderedDict[Any, None]


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
    ) -> None:
        if not capacity >= 1:
            raise InvalidArgument(f"plfu capacity must be >= 1, got {capacity}")
        w = [float(x) for x in weights]
        if not w or any(b < a for a, b in itertools.pairwise(w)):
            raise InvalidArgument(f"plfu weights must be non-empty and non-decreasing, got {w}")
        if beta < 0 or last_weight > w[0] or ghost_ratio < 0 or ghost_max < 0:
            raise InvalidArgument(
                "plfu: beta, ghost_ratio, ghost_max >= 0, last_weight <= weights[0]"
            )
        if rate_window < 1 or max_burst < 1:
            raise InvalidArgument("plfu: rate_window and max_burst must be >= 1")
        self.capacity = int(capacity)
        self.beta = float(beta)
        self.weights = w
        self.last_weight = float(last_weight)
        self.max_burst = int(max_burst)
        self._alpha = 1.0 / rate_window
        self._last_cls = len(w)  # the class of "last key of an insert run"
        # class -> burst -> keys in the order they were put there
        self._groups: list[OrderedDict[int, _Group]] = [OrderedDict() for _ in range(len(w) + 1)]
        self._meta: dict[Any, list[int]] = {}  # key -> [class, burst, count]
        self._ghost: OrderedDict[Any, int] = OrderedDict()  # evicted key -> count
        self._ghost_cap = int(min(ghost_ratio * capacity, ghost_max))
        self.burst = 0
        self._run = 0  # inserts since the last touch (0: last call was a touch)
        self._run_last: Any = None  # last key inserted in the current run
        self._inserts = 0  # in the current burst
        self.insert_rate = 0.0  # inserts per burst (moving average)

    # -- bookkeeping ----------------------------------------------------------
    def _class(self, count: int) -> int:
        return min(count, len(self.weights) - 1)

    def _put(self, key: Any, m: list[int]) -> None:
        per = self._groups[m[0]]
        g = per.get(m[1])
        if g is None:
            g = per[m[1]] = OrderedDict()
        g[key] = None

    def _take(self, key: Any, m: list[int]) -> None:
        per = self._groups[m[0]]
        g = per[m[1]]
        del g[key]
        if not g:
            del per[m[1]]

    def _end_burst(self) -> None:
        k = self._run_last
        self._run_last = None
        self._run = 0
        if k is not None:
            m = self._meta.get(k)
            if m is not None and m[0] == 0 and m[2] == 0:
                self._take(k, m)
                m[0] = self._last_cls
                self._put(k, m)
        self.insert_rate += (self._inserts - self.insert_rate) * self._alpha
        self._inserts = 0
        self.burst += 1

    @property
    def horizon(self) -> float:
        """Bursts the cache holds at the current insert rate."""
        return self.capacity / max(self.insert_rate, 1e-3)

    def bonus(self, cls: int) -> float:
        w = self.last_weight if cls == self._last_cls else self.weights[cls]
        return self.beta * self.horizon * w

    # -- EvictionPolicy ----------------------------------------------------------
    def insert(self, key: Any) -> None:
        """A key became resident (the manager's ``complete_store``)."""
        if key in self._meta:
            self.touch(key)
            return
        if self._run >= self.max_burst:
            self._end_burst()
        count = self._ghost.pop(key, 0)
        m = [self._class(count), self.burst, count]
        self._meta[key] = m
        self._put(key, m)
        self._run += 1
        self._inserts += 1
        self._run_last = key if count == 0 else None

    def touch(self, key: Any) -> None:
        """A resident key was used (a load's pin, or offered again)."""
        m = self._meta.get(key)
        if m is None:
            return
        if self._run:
            self._end_burst()
        self._take(key, m)
        m[2] += 1
        m[0] = self._class(m[2])
        m[1] = self.burst
        self._put(key, m)

    def remove(self, key: Any, evicted: bool = False) -> None:
        """A key left; an evicted key's count is remembered as a ghost."""
        m = self._meta.pop(key, None)
        if m is None:
            return
        self._take(key, m)
        if key == self._run_last:
            self._run_last = None
        if evicted and self._ghost_cap:
            self._ghost[key] = m[2] + 1
            if len(self._ghost) > self._ghost_cap:
                self._ghost.popitem(last=False)

    def victims(self) -> Iterator[Any]:
        """Resident keys, lowest priority first (see the module docstring)."""
        heads: dict[int, tuple[int, _Group]] = {}
        its = [iter(per.items()) for per in self._groups]
        for c, it in enumerate(its):
            h = next(it, None)
            if h is not None:
                heads[c] = h
        bonus = [self.bonus(c) for c in range(len(its))]
        while heads:
            c = min(heads, key=lambda c: (heads[c][0] + bonus[c], -c))
            yield from reversed(list(heads[c][1]))
            h = next(its[c], None)
            if h is None:
                del heads[c]
            else:
                heads[c] = h

    def __len__(self) -> int:
        return len(self._meta)

    def ghosts(self) -> int:
        """Evicted keys remembered (for tests and stats)."""
        return len(self._ghost)
