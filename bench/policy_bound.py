"""How much of Belady's lead an online host-tier policy could take (issue 36).

A command-line tool (its own process, one core, blocks for about a minute);
run by hand from the repository root:

    nice -n 19 .venv/bin/python bench/policy_bound.py [--capacity 10000]

Three measurements on the Mooncake conversation trace, every replay through
the real manager and host tier with no data (``kvtier replay --no-data``):

1. Belady's hits that LRU and PLFU miss, by how many times the block had been
   referenced before: a block seen once before can only be kept for its
   first reuse by a predictor of what it does not know yet (no count, no
   reuse history), only by what its request looked like.
2. How well the features a policy sees when a block is first stored separate
   the blocks referenced again within ``--horizon`` requests from the rest.
   The cells (the conversation's turn, the request's new blocks, the gap
   since the turn before, the request's last block, depth among the new
   blocks) are scored with their reuse rate over the *whole* trace: an
   oracle no online policy has.
3. PLFU with fixed beta plus a bonus for a first-sighting block from that
   oracle reuse rate of its cell: an upper bound on what those features add;
   and the same bonus from the block's own future (perfect prediction of
   the first reuse), what a predictor of that one bit would be worth.

Deterministic: the trace as stored; no randomness.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import sys
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.manager import TieredOffloadingManager
from kvtier.policy.belady import BeladyPolicy
from kvtier.replay import Replayer, key_of, read_trace
from kvtier.tiers.host_native import make_host_tier

TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
Trace = list[list[int]]


def per_request_hits(trace: Trace, capacity: int, policy: Any) -> list[int]:
    """Prefix hits of each request, replayed through the manager."""
    advance = policy.advance if isinstance(policy, BeladyPolicy) else None
    m = TieredOffloadingManager(make_host_tier(None, capacity, policy=policy))
    marks: list[int] = []
    rep: Replayer | None = None

    def hook(i: int) -> None:
        assert rep is not None
        marks.append(rep.result.hits)
        if advance is not None:
            advance(i)

    rep = Replayer(m, on_request=hook)
    res = rep.run(trace, progress=False)
    m.shutdown()
    marks.append(res.hits)
    return [b - a for a, b in itertools.pairwise(marks)]


def extra_hits_by_sightings(trace: Trace, base: list[int], best: list[int]) -> Counter[int]:
    """Hits of ``best`` that ``base`` missed, by prior references of the block (4: 4 or more)."""
    seen: Counter[int] = Counter()
    out: Counter[int] = Counter()
    for ids, hb, hx in zip(trace, base, best, strict=True):
        for d in range(hb, hx):
            out[min(seen[ids[d]], 4)] += 1
        seen.update(ids)
    return out


Cells = dict[tuple[Any, ...], list[int]]


def first_sighting_cells(
    trace: Trace, horizon: int
) -> tuple[dict[int, tuple[Any, ...]], Cells, dict[int, bool]]:
    """Each block's feature cell at its first sighting, per cell [blocks,
    blocks referenced again within ``horizon`` requests], and each block's
    own answer (referenced again within ``horizon``)."""
    uses: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(trace):
        for h in ids:
            uses[h].append(i)
    owner: dict[int, int] = {}
    turn = [0] * len(trace)
    cell_of: dict[int, tuple[Any, ...]] = {}
    live_of: dict[int, bool] = {}
    cells: Cells = defaultdict(lambda: [0, 0])
    for i, ids in enumerate(trace):
        j = 0
        while j < len(ids) and ids[j] in owner:
            j += 1
        prev = owner.get(ids[j - 1]) if j > 1 else None
        turn[i] = turn[prev] + 1 if prev is not None else 0
        gap = i - prev if prev is not None else -1
        new = len(ids) - j
        new_b = 0 if new <= 1 else 1 if new <= 3 else 2 if new <= 8 else 3 if new <= 20 else 4
        gap_b = -1 if gap < 0 else min(int(math.log2(gap + 1)) // 2, 5)
        for d in range(j, len(ids)):
            h = ids[d]
            if h in owner or h in cell_of:
                continue
            nxt = next((x for x in uses[h] if x > i), None)
            live = nxt is not None and nxt - i <= horizon
            c = (min(turn[i], 3), new_b, gap_b, d == len(ids) - 1, min((d - j) * 4 // new, 3))
            cell_of[h] = c
            live_of[h] = live
            cells[c][0] += 1
            cells[c][1] += int(live)
        for h in ids:
            owner.setdefault(h, i)
    return cell_of, cells, live_of


class OracleBonusPLFU:
    """PLFU with fixed beta (weights 0, 1, 2, 3 by prior uses, kept for evicted
    keys in a ghost map of 16x capacity; the last key of an insert run at
    -0.5) as a lazy heap of static priorities, plus ``gamma * horizon *
    (p - mean)`` for a key stored for the first time whose cell's oracle
    reuse rate is ``p``. Within one burst a key's priority is capped by the
    previous key's (a child never outlives its parent)."""

    def __init__(self, capacity: int, beta: float, gamma: float, p: dict[bytes, float],
                 mean: float) -> None:  # fmt: skip
        self.capacity, self.beta, self.gamma, self.p, self.mean = capacity, beta, gamma, p, mean
        self.meta: dict[Any, list[float]] = {}  # key -> [burst, count, token]
        self.ghost: OrderedDict[Any, float] = OrderedDict()
        self.heap: list[tuple[float, int, Any]] = []
        self.seq = self.burst = self.run = self.inserts = 0
        self.rate = 0.0
        self.run_last: Any = None
        self.cap_prio: float | None = None

    def _horizon(self) -> float:
        return self.capacity / max(self.rate, 1e-3)

    def _end_burst(self) -> None:
        k, self.run_last, self.run = self.run_last, None, 0
        if k is not None and k in self.meta:
            self._push(k, self.burst - 0.5 * self.beta * self._horizon(), cap=False)
        self.rate += (self.inserts - self.rate) / 100
        self.inserts, self.cap_prio = 0, None
        self.burst += 1

    def _push(self, key: Any, prio: float, cap: bool = True) -> None:
        if cap:
            if self.cap_prio is not None:
                prio = min(prio, self.cap_prio)
            self.cap_prio = prio
        self.seq += 1
        self.meta[key][2] = self.seq
        heapq.heappush(self.heap, (prio, -self.seq, key))

    def _prio(self, key: Any, count: float) -> float:
        prio = self.burst + self.beta * self._horizon() * min(count - 1, 3)
        if count == 1:
            prio += self.gamma * self._horizon() * (self.p.get(key, self.mean) - self.mean)
        return prio

    def insert(self, key: Any) -> None:
        if key in self.meta:
            self.touch(key)
            return
        if self.run >= 256:
            self._end_burst()
        count = self.ghost.pop(key, 0.0) + 1
        self.meta[key] = [self.burst, count, 0]
        self._push(key, self._prio(key, count))
        self.run += 1
        self.inserts += 1
        self.run_last = key if count == 1 else None

    def touch(self, key: Any) -> None:
        m = self.meta.get(key)
        if m is None:
            return
        if self.run:
            self._end_burst()
        m[0], m[1] = self.burst, m[1] + 1
        self._push(key, self._prio(key, m[1]))

    def remove(self, key: Any, evicted: bool = False) -> None:
        m = self.meta.pop(key, None)
        if m is not None and evicted:
            self.ghost[key] = m[1]
            if len(self.ghost) > 16 * self.capacity:
                self.ghost.popitem(last=False)
        if key == self.run_last:
            self.run_last = None

    def victims(self) -> Iterator[Any]:
        popped = []
        try:
            while self.heap:
                e = heapq.heappop(self.heap)
                m = self.meta.get(e[2])
                if m is None or m[2] != -e[1]:
                    continue
                popped.append(e)
                yield e[2]
        finally:
            for e in popped:
                heapq.heappush(self.heap, e)

    def __len__(self) -> int:
        return len(self.meta)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="how much of Belady's lead features could take")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--capacity", type=int, default=10000)
    ap.add_argument("--horizon", type=int, default=2500, help="requests (default 2500)")
    args = ap.parse_args(argv)
    trace, cap = read_trace(args.trace), args.capacity
    refs = sum(map(len, trace))

    def pct(n: int) -> str:
        return f"{100 * n / refs:.2f}%"

    runs = {
        "lru": per_request_hits(trace, cap, "lru"),
        "plfu": per_request_hits(trace, cap, "plfu"),
        "belady": per_request_hits(trace, cap, BeladyPolicy(trace, key_of)),
    }
    for name, hits in runs.items():
        print(f"{name:7s} {cap} blocks: {sum(hits):,} hits, {pct(sum(hits))}")
    for base in ("lru", "plfu"):
        ex = extra_hits_by_sightings(trace, runs[base], runs["belady"])
        tot = sum(ex.values())
        parts = ", ".join(f"{k if k < 4 else '4+'}: {v:,}" for k, v in sorted(ex.items()))
        print(f"Belady's hits {base} misses: {tot:,}; by prior references of the block: {parts}; "
              f"seen once before: {ex[1] / tot:.0%}")  # fmt: skip

    cell_of, cells, live_of = first_sighting_cells(trace, args.horizon)
    total = sum(c[0] for c in cells.values())
    live = sum(c[1] for c in cells.values())
    print(f"first-sighting blocks {total:,}, referenced again within {args.horizon} requests "
          f"{live:,} ({live / total:.1%}), {len(cells)} feature cells")  # fmt: skip
    dead_cut = live_cut = 0
    marks = [0.25, 0.5, 0.75]
    for n, k in sorted(cells.values(), key=lambda c: c[1] / c[0]):
        dead_cut += n - k
        live_cut += k
        while marks and dead_cut >= marks[0] * (total - live):
            print(f"  oracle cells dropping {dead_cut / (total - live):.0%} of the dead blocks "
                  f"drop {live_cut / live:.0%} of the live ones")  # fmt: skip
            marks.pop(0)
    mean = live / total
    p = {key_of(h): cells[c][1] / cells[c][0] for h, c in cell_of.items()}
    for beta, gamma in [(0.5, 0.0), (0.5, 2.0), (0.5, 4.0), (1.0, 4.0), (1.0, 8.0)]:
        got = sum(per_request_hits(trace, cap, OracleBonusPLFU(cap, beta, gamma, p, mean)))
        print(f"PLFU beta {beta} + oracle cell bonus gamma {gamma}: {pct(got)}")
    # The same bonus from each block's own future instead of its cell's rate.
    exact = {key_of(h): float(v) for h, v in live_of.items()}
    for beta, gamma in [(0.5, 2.0), (1.0, 8.0)]:
        got = sum(per_request_hits(trace, cap, OracleBonusPLFU(cap, beta, gamma, exact, mean)))
        print(f"PLFU beta {beta} + the block's own future, gamma {gamma}: {pct(got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
