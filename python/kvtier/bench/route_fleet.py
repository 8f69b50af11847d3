"""The simulated fleet of ``kvtier bench route``: N engines, each a
:class:`~kvtier.scheduler.manager.TieredOffloadingManager` over its own host tier and
disk tier, all sharing one pool.

The model (no data: indexes only, no bytes move):

- **host**: each engine's :class:`~kvtier.tiers.host.HostTier` of
  ``host_blocks`` (LRU), as ``kvtier replay --no-data`` runs it.
- **disk**: each engine's own lower tier of ``disk_blocks`` (LRU), the
  reference :class:`~kvtier.tiers.memory.MemoryTier` named ``disk``: it
  reports every store and every eviction, as issue 35 item 1 asks of the
  real disk tier, so the router is told no more and no less than a
  complete tier would tell it.
- **pool**: one :class:`SharedPool` of ``pool_blocks`` (LRU over every
  engine's reads and writes), the index a Redis/Valkey pool holds. Each
  engine's manager holds a thin :class:`PoolView` of it as its last lower
  tier: a lookup asks the one shared index, so a block one engine stored is
  a hit for every other; the cascade skips blocks the pool already holds
  (one write per block in the pool, whoever wrote it). The pool reports its
  own stored/removed events once, as the pool-wide stream of issue 35 item
  3 does; the views report none (a router would otherwise hear each pool
  block once per engine).

A command-line tool's module (never imported by the library): runs in the
``kvtier`` process, every engine's manager on the calling thread, one
request at a time in arrival order. Who calls: :mod:`kvtier.bench.route`
and its tests. Nothing here blocks but a whole replay.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.replay import Replayer
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent, check_slots
from kvtier.tiers.events import EventLog
from kvtier.tiers.host_native import make_host_tier
from kvtier.tiers.memory import MemoryTier

BLOCK_TOKENS = 512  # the Mooncake trace's block: one hash id per 512 prompt tokens
TIERS = ("host", "disk", "pool")


class SharedPool:
    """One pool's index, shared by every engine: LRU over ``capacity``
    blocks, touched by every engine's reads and writes; blocks being read
    are not evicted. Its events name the engine that stored a block
    (``extra["engine"]``)."""

    name = "pool"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.reading: dict[bytes, int] = {}
        self._events = EventLog()
        self.stored = 0  # blocks written, whoever wrote them
        self.evicted = 0

    def holds(self, key: bytes) -> bool:
        return key in self.blocks

    def store(self, keys: Sequence[bytes], engine: int) -> list[bool]:
        """Write ``keys`` (those held already are touched); per key, stored or held."""
        out, new, gone = [], [], []
        for k in keys:
            if k in self.blocks:
                self.blocks.move_to_end(k)
                out.append(True)
                continue
            if len(self.blocks) >= self.capacity:
                victim = next((v for v in self.blocks if v not in self.reading), None)
                if victim is None:
                    out.append(False)
                    continue
                del self.blocks[victim]
                gone.append(victim)
            self.blocks[k] = None
            new.append(k)
            out.append(True)
        self.stored += len(new)
        self.evicted += len(gone)
        # Removals first: a block evicted to make room for a new one is gone before it arrives.
        if gone:
            self._events.append(TierEvent(gone, self.name, removed=True))
        if new:
            self._events.append(TierEvent(new, self.name, removed=False, extra={"engine": engine}))
        return out

    def begin_read(self, key: bytes) -> bool:
        if key not in self.blocks:
            return False
        self.blocks.move_to_end(key)
        self.reading[key] = self.reading.get(key, 0) + 1
        return True

    def end_read(self, key: bytes) -> None:
        n = self.reading.pop(key, 0) - 1
        if n > 0:
            self.reading[key] = n

    def take_events(self) -> list[TierEvent]:
        """The pool-wide stream: every store (by any engine) and eviction, oldest first."""
        return self._events.take()


class PoolView(LowerTier):
    """One engine's tier over the :class:`SharedPool`: lookups and writes go
    to the shared index; a batch completes at the engine's next poll."""

    name = "pool"

    def __init__(self, pool: SharedPool, engine: int) -> None:
        self.shared = pool
        self.engine = engine
        self._tokens = itertools.count(1)
        self._done: list[TierCompletion] = []

    def lookup(self, key: bytes) -> LookupResult:
        return LookupResult.HIT if self.shared.holds(key) else LookupResult.MISS

    def admit(self, key: bytes) -> bool:
        return True

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        check_slots(keys, slots, None)
        token = next(self._tokens)
        ok = self.shared.store(keys, self.engine)
        self._done.append(TierCompletion(token, all(ok), "store", list(keys), key_ok=ok))
        return token

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        check_slots(keys, slots, None)
        token = next(self._tokens)
        ok = [self.shared.begin_read(k) for k in keys]
        self._done.append(TierCompletion(token, all(ok), "load", list(keys), key_ok=ok))
        return token

    def poll(self) -> list[TierCompletion]:
        out, self._done = self._done, []
        for c in out:
            if c.kind == "load":
                for k, ok in zip(c.keys, c.key_ok or []):
                    if ok:
                        self.shared.end_read(k)
        return out

    def has_pending_work(self) -> bool:
        return bool(self._done)


@dataclass(frozen=True)
class LoadModel:
    """How long a request keeps its engine busy, for the routers' load:
    its prefill of the tokens not hit at ``prefill_tps``, then its output at
    ``decode_tps`` (one sequence of a batch). Arrival times are the trace's
    times multiplied by ``time_scale``."""

    prefill_tps: float = 10_000.0
    decode_tps: float = 30.0
    time_scale: float = 1.0


@dataclass
class Engine:
    """One simulated engine: its manager, the replayer driving it, and the
    finish times of the requests it is serving (its load)."""

    index: int
    manager: TieredOffloadingManager
    replayer: Replayer
    busy_until: list[float] = field(default_factory=list)  # a heap
    requests: int = 0

    def load(self, now: float) -> int:
        """Requests still in flight at ``now``."""
        while self.busy_until and self.busy_until[0] <= now:
            heapq.heappop(self.busy_until)
        return len(self.busy_until)


class Fleet:
    """``engines`` managers and their shared pool; :meth:`serve` runs one
    request on one engine and returns the blocks it hit per tier."""

    def __init__(
        self,
        engines: int,
        host_blocks: int,
        disk_blocks: int,
        pool_blocks: int,
        load: LoadModel | None = None,
    ) -> None:
        self.pool = SharedPool(pool_blocks) if pool_blocks > 0 else None
        self.load_model = load or LoadModel()
        self.engines: list[Engine] = []
        for i in range(engines):
            lower: list[LowerTier] = []
            if disk_blocks > 0:
                lower.append(MemoryTier(disk_blocks, name="disk"))
            if self.pool is not None:
                lower.append(PoolView(self.pool, i))
            m = TieredOffloadingManager(make_host_tier(None, host_blocks), lower)
            self.engines.append(Engine(i, m, Replayer(m, series_every=1 << 62)))

    def loads(self, now: float) -> list[int]:
        return [e.load(now) for e in self.engines]

    def serve(self, engine: int, req: dict[str, Any], now: float) -> dict[str, int]:
        """Run ``req`` (a trace record) on ``engine`` arriving at ``now``:
        its hits per tier (a contiguous prefix, as the engine loads)."""
        e = self.engines[engine]
        res = e.replayer.result
        before = dict(res.hit_blocks)
        e.replayer.run_request(req["hash_ids"])
        hits = {t: res.hit_blocks[t] - before[t] for t in res.hit_blocks}
        e.requests += 1
        lm = self.load_model
        computed = max(0, int(req.get("input_length", 0)) - BLOCK_TOKENS * sum(hits.values()))
        busy = computed / lm.prefill_tps + int(req.get("output_length", 0)) / lm.decode_tps
        heapq.heappush(e.busy_until, now + busy)
        return hits

    def take_events(self) -> tuple[list[list[TierEvent]], list[TierEvent]]:
        """Each engine's events (its host and disk), and the pool's stream."""
        per_engine = [e.manager.take_events() for e in self.engines]
        return per_engine, (self.pool.take_events() if self.pool is not None else [])

    def written(self) -> dict[str, int]:
        """Blocks written per tier: host (stores from the GPU and promotions
        into it), disk (cascades), pool (new blocks, whoever wrote them)."""
        out = dict.fromkeys(TIERS, 0)
        for e in self.engines:
            st = e.manager.stats
            out["host"] += st.stores + st.promotions
            for t in e.manager.lower:
                if isinstance(t, MemoryTier):
                    out["disk"] += t.counters["stores"]
        out["pool"] = self.pool.stored if self.pool is not None else 0
        return out

    def holdings(self) -> tuple[list[dict[str, set[bytes]]], set[bytes]]:
        """What each engine's tiers and the pool really hold (the bench's
        check of the router's view; routers never call it)."""
        per = []
        for e in self.engines:
            d: dict[str, set[bytes]] = {"host": set(e.manager.host.entries), "disk": set()}
            for t in e.manager.lower:
                if isinstance(t, MemoryTier):
                    d["disk"] = set(t.data)
            per.append(d)
        return per, set(self.pool.blocks) if self.pool is not None else set()

    def finish(self) -> None:
        """Let every cascade and promotion end, then shut the managers down."""
        for e in self.engines:
            m = e.manager
            for _ in range(1000):
                with m.lock:
                    if not m.has_pending_work():
                        break
                    m.on_schedule_end()
            m.shutdown()


__all__ = ["BLOCK_TOKENS", "TIERS", "Engine", "Fleet", "LoadModel", "PoolView", "SharedPool"]
