"""PLFU: prefix-consistent LRU weighted by how often a key came back.

Process: the engine's scheduler (or ``kvtier replay``).

Who calls: the host tier (``HostTier(policy="plfu")``, ``kvtier_policy``,
``kvtier replay --policy plfu``), under the manager's lock, never
concurrently. By name (``"plfu"``) the tier gets the native ranking,
:func:`native_plfu` (``csrc/core/disk/plfu.h``, also the disk index's
``plfu``): the same victims for the same calls, at a fraction of the cost;
:class:`PLFUPolicy` here is its reference, kept in Python for studies.
Pure bookkeeping: no call blocks or does I/O. Deterministic: the same
sequence of calls gives the same victims (no randomness, no clock; keys are
sampled by crc32).

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

Per-key state: resident keys 4 ints (class, burst, count, sampled) in a dict
plus an entry in their class's ordered dict (by burst, then put order); ghosts one int per key, at most
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
_END = object()  # the end of an iteration
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
        self,
        capacity: int,
        beta: float,
        weights: list[float],
        last_weight: float,
        ghost_cap: int,
        alpha: float,
    ) -> None:
        self.capacity = capacity
        self.beta = beta
        self.weights = weights
        self.last_weight = last_weight
        self.last_cls = len(weights)
        self.top = len(weights) - 1  # the class of the highest counts
        # Per class, keys in the order they were put: by burst, then prefix order.
        self.groups: list[_Group] = [OrderedDict() for _ in range(len(weights) + 1)]
        self.meta: dict[Any, list[int]] = {}  # key -> [class, burst, count, sampled]
        self.ghost: OrderedDict[Any, int] = OrderedDict()  # evicted key -> count
        self.ghost_cap = ghost_cap
        self.alpha = alpha
        self.insert_rate = 0.0  # inserts per burst (moving average)
        self.rate_burst = 0  # the burst ``inserts`` counts
        self.inserts = 0  # in the current burst
        self._run_of: tuple[int, int] = (-1, -1)  # (class, burst) of ``_run``
        self._run: list[Any] = []  # first_victim's last burst run

    def add(self, key: Any, burst: int, sampled: int = 0) -> int:
        """``key`` became resident in ``burst``; returns its count (from its ghost)."""
        count = self.ghost.pop(key, 0)
        c = count if count < self.top else self.top
        self.meta[key] = [c, burst, count, sampled]
        self.groups[c][key] = None
        self.inserts += 1
        return count

    def use(self, key: Any, burst: int) -> list[int]:
        """Resident ``key`` was used in ``burst``; returns its state."""
        m = self.meta[key]
        count = m[2] = m[2] + 1
        c = count if count < self.top else self.top
        if c == m[0]:
            self.groups[c].move_to_end(key)
        else:
            del self.groups[m[0]][key]
            self.groups[c][key] = None
            m[0] = c
        m[1] = burst
        return m

    def mark_last(self, key: Any) -> None:
        """``key`` was the last of an insert run: class ``last`` if never used since."""
        m = self.meta.get(key)
        if m is not None and m[0] == 0 and m[2] == 0:
            del self.groups[0][key]
            self.groups[self.last_cls][key] = None
            m[0] = self.last_cls

    def end_burst(self) -> None:
        self.insert_rate += (self.inserts - self.insert_rate) * self.alpha
        self.inserts = 0
        self.rate_burst += 1

    def catch_up(self, burst: int) -> None:
        """End the bursts before ``burst`` not ended yet (a miniature's are
        ended lazily: most bursts carry no sampled key, and then the insert
        rate only decays)."""
        gap = burst - self.rate_burst
        if gap > 0:
            self.end_burst()
            if gap > 1:
                self.insert_rate *= (1.0 - self.alpha) ** (gap - 1)
            self.rate_burst = burst

    def remove(self, key: Any, evicted: bool) -> bool:
        m = self.meta.pop(key, None)
        if m is None:
            return False
        del self.groups[m[0]][key]
        if evicted and self.ghost_cap:
            self.ghost[key] = m[2] + 1
            if len(self.ghost) > self.ghost_cap:
                self.ghost.popitem(last=False)
        return True

    def _bonuses(self) -> list[float]:
        horizon = self.capacity / max(self.insert_rate, 1e-3)
        b = self.beta * horizon
        return [b * w for w in self.weights] + [b * self.last_weight]

    def first_victim(self) -> Any:
        """``next(self.victims())`` without the generator (the miniatures' hot path)."""
        meta, ws = self.meta, self.weights
        b = self.beta * (self.capacity / max(self.insert_rate, 1e-3))
        best, c = 0.0, -1
        for i, g in enumerate(self.groups):
            if g:
                # Lowest rank first; of equal ranks, the higher class.
                rank = meta[next(iter(g))][1] + b * (
                    ws[i] if i < self.last_cls else self.last_weight
                )
                if c < 0 or rank <= best:
                    best, c = rank, i
        assert c >= 0, "first_victim of an empty ranking"
        group = self.groups[c]
        head = next(iter(group))
        burst = meta[head][1]
        # The run of an older burst only shrinks (keys put now take the current
        # burst): keep it for the next calls, deepest key still in it first.
        if self._run_of == (c, burst) and burst < self.rate_burst:
            run = self._run
            while True:
                m = meta.get(run[-1])
                if m is not None and m[0] == c and m[1] == burst:
                    return run[-1]
                run.pop()
        self._run_of, self._run = (c, burst), _burst_run(group, meta)
        return self._run[-1]

    def victims(self) -> Iterator[Any]:
        meta = self.meta
        its = [iter(g) for g in self.groups]
        heads: dict[int, Any] = {}  # class -> its next key
        for c, it in enumerate(its):
            h = next(it, _END)
            if h is not _END:
                heads[c] = h
        bonus = self._bonuses()
        while heads:
            c = min(heads, key=lambda c: (meta[heads[c]][1] + bonus[c], -c))
            # The keys of the head's burst, deepest (put last) first.
            run = [heads[c]]
            burst = meta[run[0]][1]
            h = next(its[c], _END)
            while h is not _END and meta[h][1] == burst:
                run.append(h)
                h = next(its[c], _END)
            if h is _END:
                del heads[c]
            else:
                heads[c] = h
            yield from reversed(run)


def _burst_run(group: _Group, meta: dict[Any, list[int]]) -> list[Any]:
    """The first keys of ``group`` that share the first one's burst."""
    it = iter(group)
    run = [next(it)]
    burst = meta[run[0]][1]
    for k in it:
        if meta[k][1] != burst:
            break
        run.append(k)
    return run


class _Miniature:
    """A cache of ``ranking.capacity`` keys replaying the sampled keys."""

    def __init__(self, ranking: _Ranking) -> None:
        self.r = ranking
        # Hits decayed by ``decay`` every burst, kept as score * decay**-(burst - base)
        # by the policy (a hit adds decay**-(burst - base)): a burst costs nothing.
        self.score = 0.0

    def reference(self, key: Any, burst: int, hit_value: float) -> None:
        r = self.r
        r.catch_up(burst)
        if key in r.meta:
            self.score += hit_value
            r.use(key, burst)
            return
        r.add(key, burst)
        if len(r.meta) > r.capacity:
            r.remove(r.first_victim(), evicted=True)


def native_plfu(capacity: int, **options: Any) -> Any:
    """:class:`PLFUPolicy` (same arguments, same victims for the same calls)
    ranked natively: 14 bytes per key plus a dict entry, no Python object per
    call. Keys are known by a 64-bit hash in ghosts and miniatures (a
    collision could differ from the Python policy's). Who calls:
    :func:`kvtier.policy.make_policy` for ``"plfu"``. Never blocks."""
    from kvtier import _native

    if "variants" in options:
        options["variants"] = [(b, tuple(w)) for b, w in options["variants"]]
    return _native.plfu_policy(capacity, **options)


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
            lw, cap_m = float(last_weight), max(1, self.capacity // m)
            self._minis = [
                _Miniature(_Ranking(cap_m, b, vw, lw, ghost_cap // m, alpha)) for b, vw in vs
            ]
        self._decay = 1.0 - 1.0 / window
        self._hit_value = 1.0  # a miniature's hit now, in its score's units
        self._scored = False  # a miniature hit in this burst: the best may change

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

    def _sampled(self, key: Any) -> int:
        if not self._minis:
            return 0
        raw = key if isinstance(key, bytes) else repr(key).encode()
        return 1 if zlib.crc32(raw) & self._mask == 0 else 0

    def _end_burst(self) -> None:
        k = self._run_last
        self._run_last = None
        self._run = 0
        main = self._main
        if k is not None:
            main.mark_last(k)
        main.end_burst()
        if self._minis:
            if k is not None and self._sampled(k):
                for mini in self._minis:
                    mini.r.mark_last(k)
            if self._scored:  # a uniform decay keeps the order: only hits change it
                self._scored = False
                best = self._minis[0]
                for mini in self._minis:
                    if mini.score > best.score:
                        best = mini
                if best.score > 0:
                    main.beta, main.weights = best.r.beta, best.r.weights
            self._hit_value /= self._decay
            if self._hit_value > 1e100:  # rescale before floats overflow
                for mini in self._minis:
                    mini.score /= self._hit_value
                self._hit_value = 1.0
        self.burst += 1

    def _reference_minis(self, key: Any) -> None:
        for mini in self._minis:
            mini.reference(key, self.burst, self._hit_value)
        self._scored = True

    def insert(self, key: Any) -> None:
        """A key became resident (the manager's ``complete_store``)."""
        main = self._main
        if key in main.meta:
            self.touch(key)
            return
        if self._run >= self.max_burst:
            self._end_burst()
        sampled = self._sampled(key)
        count = main.add(key, self.burst, sampled)
        self._run += 1
        self._run_last = key if count == 0 else None
        if sampled:
            self._reference_minis(key)

    def touch(self, key: Any) -> None:
        """A resident key was used (a load's pin, or offered again)."""
        if key not in self._main.meta:
            return
        if self._run:
            self._end_burst()
        if self._main.use(key, self.burst)[3]:
            self._reference_minis(key)

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
