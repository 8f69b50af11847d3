"""Which blocks to write to the disk tier: online admission rules against
oracles (issue 36, item 3).

A command-line tool (its own process, one core, blocks for about ten
seconds, three minutes with ``--grid``); run by hand from the repository
root:

    nice -n 19 .venv/bin/python bench/admission_bound.py [--grid] [--workload rag]

A standalone model of ``kvtier replay --no-data --host-blocks 10000
--policy lru --disk DIR:2GiB --lower-admit-after N``: an LRU host tier, an
LRU disk of 30,840 records, a prefix lookup that stops at the first miss, a
disk hit promoted into the host, every stored block offered to the disk.
It reproduces the real replay's figures within 0.05 points of hit rate and
to the record on disk writes (README, "With a disk tier behind the host"),
and runs a rule in under a second, so rules the tiers' gate cannot express
today (write at host eviction, frequency against the disk's victim,
oracles) can be measured before any is built. Deterministic.

Modes: ``wt`` writes through at the store into the host (the product);
``victim`` writes a block when the host evicts it (a victim cache).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
RECORD_BYTES = 69_632  # a 64 KiB block plus the disk record's 4 KiB trailer


class Sim:
    """Host LRU over disk LRU; ``admit(sim, key)`` decides each write."""

    def __init__(self, trace: list[list[int]], host: int, disk: int, mode: str, admit: Any):
        self.trace, self.hc, self.dc, self.mode, self.admit = trace, host, disk, mode, admit
        self.host: OrderedDict[int, None] = OrderedDict()
        self.disk: OrderedDict[int, None] = OrderedDict()
        self.host_hits = self.disk_hits = self.writes = self.refs = self.t = 0
        self.req_len = 0  # blocks in the request being served
        self.offers: Counter[int] = Counter()  # stores into the host (misses)
        self.hhits: Counter[int] = Counter()  # hits in the host
        self.reads: Counter[int] = Counter()  # hits on disk
        self.parent: dict[int, int] = {}
        self.first: dict[int, int] = {}  # request of first and last sighting
        self.last: dict[int, int] = {}
        self.depth: dict[int, int] = {}
        self.children: defaultdict[int, set[int]] = defaultdict(set)
        self.written: set[int] = set()

    def sights(self, k: int) -> int:
        return self.offers[k] + self.hhits[k] + self.reads[k]

    def _host_put(self, k: int) -> None:
        if len(self.host) >= self.hc:
            v, _ = self.host.popitem(last=False)
            if self.mode == "victim" and v not in self.disk and self.admit(self, v):
                self._write(v)
        self.host[k] = None

    def _write(self, k: int) -> None:
        if len(self.disk) >= self.dc:
            self.disk.popitem(last=False)
        self.disk[k] = None
        self.writes += 1
        self.written.add(k)

    def run(self) -> Sim:
        for t, keys in enumerate(self.trace):
            self.t, self.req_len = t, len(keys)
            self.refs += len(keys)
            for i, k in enumerate(keys):
                if k not in self.first:
                    self.first[k], self.depth[k] = t, i
                    if i:
                        self.parent[k] = keys[i - 1]
                if i:
                    self.children[keys[i - 1]].add(k)
            hit = 0
            for k in keys:
                if k in self.host:
                    self.host.move_to_end(k)
                    self.host_hits += 1
                    self.hhits[k] += 1
                elif k in self.disk:
                    self.disk.move_to_end(k)
                    self.disk_hits += 1
                    self.reads[k] += 1
                    self._host_put(k)
                else:
                    break
                hit += 1
            for k in keys[hit:]:
                if k in self.host:
                    self.host.move_to_end(k)
                    continue
                self.offers[k] += 1
                self._host_put(k)
                if self.mode == "wt" and k not in self.disk and self.admit(self, k):
                    self._write(k)
            for k in keys:
                self.last[k] = t
        return self

    def row(self, name: str) -> dict[str, Any]:
        hits = self.host_hits + self.disk_hits
        read = sum(1 for k in self.written if self.reads[k])
        return {
            "rule": name,
            "hit_pct": round(100 * hits / self.refs, 2),
            "host_hits": self.host_hits,
            "disk_hits": self.disk_hits,
            "writes": self.writes,
            "gb_written": round(self.writes * RECORD_BYTES / 1e9, 2),
            "writes_per_hit": round(self.writes / hits, 3),
            "kb_per_hit": round(self.writes * RECORD_BYTES / hits / 1e3, 1),
            "written_ever_read": read,
        }


Rule = Callable[[Sim, int], bool]


def nth_offer(n: int) -> Rule:
    return lambda s, k: s.offers[k] >= n


def chain(rule: Rule) -> Rule:
    """``rule``, and the block's parent is in the host or on disk (else the
    block could never hit: the lookup stops at the parent)."""

    def admit(s: Sim, k: int) -> bool:
        p = s.parent.get(k)
        return (p is None or p in s.host or p in s.disk) and rule(s, k)

    return admit


class TinyLFU:
    """Reference counts halved every ``window`` references; a candidate with
    at least ``min_count`` is written while the disk has room, and after that
    only when its count beats the count of the disk's LRU victim."""

    def __init__(self, window: int, min_count: int) -> None:
        self.window, self.min_count = window, min_count
        self.count: Counter[int] = Counter()
        self.n, self.upto = 0, -1

    def __call__(self, s: Sim, k: int) -> bool:
        while self.upto < s.t:  # count the requests seen so far
            self.upto += 1
            for key in s.trace[self.upto]:
                self.count[key] += 1
                self.n += 1
                if self.n >= self.window:
                    self.n = 0
                    self.count = Counter({x: c // 2 for x, c in self.count.items() if c > 1})
        c = self.count[k]
        if c < self.min_count:
            return False
        return len(s.disk) < s.dc or c > self.count[next(iter(s.disk))]


def features(s: Sim, k: int) -> tuple[int, ...]:
    """What an online rule could know of a block when it is offered."""

    def b(x: int) -> int:
        return min(int(math.log2(x + 1)), 14)

    return (
        min(s.sights(k), 6),
        min(s.hhits[k], 3),
        min(s.offers[k], 3),
        b(s.depth[k]),
        b(s.t - s.first[k]),
        b(s.t - s.last.get(k, s.t)),
        min(len(s.children[k]), 3),
        b(s.req_len),
    )


def load(workload: str) -> list[list[int]]:
    if workload == "conversation":
        with open(TRACE) as f:
            return [json.loads(line)["hash_ids"] for line in f]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    from kvtier.replay import WORKLOADS

    return [list(r) for r in WORKLOADS[workload](4000, 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="conversation", help="conversation, rag, agent, ...")
    ap.add_argument("--host-blocks", type=int, default=10_000)
    ap.add_argument("--disk-records", type=int, default=30_840)  # 2 GiB of 69,632 B records
    ap.add_argument("--grid", action="store_true", help="also a * offers + b * host hits >= c")
    a = ap.parse_args()
    tr = load(a.workload)
    last: dict[int, int] = {}
    for t, keys in enumerate(tr):
        for k in keys:
            last[k] = t

    def run(mode: str, rule: Rule) -> Sim:
        return Sim(tr, a.host_blocks, a.disk_records, mode, rule).run()

    def weighted(x: int, y: int, c: int) -> Rule:
        return lambda s, k: x * s.offers[k] + y * s.hhits[k] >= c

    def kept(keep: set[tuple[int, ...]]) -> Rule:
        return lambda s, k: s.offers[k] >= 2 and features(s, k) in keep

    rows: list[dict[str, Any]] = []
    rules: list[tuple[str, str, Rule]] = [
        ("wt", "1st offer", nth_offer(1)),
        ("wt", "2nd offer (baseline)", nth_offer(2)),
        ("wt", "3rd offer", nth_offer(3)),
        ("wt", "2nd offer, parent in host or on disk", chain(nth_offer(2))),
        (
            "wt",
            "2nd offer, request of >= 24 blocks",
            lambda s, k: s.offers[k] >= 2 and s.req_len >= 24,
        ),
        (
            "wt",
            "2nd offer, request of >= 32 blocks",
            lambda s, k: s.offers[k] >= 2 and s.req_len >= 32,
        ),
        ("wt", "TinyLFU, window 200k, count >= 2", TinyLFU(200_000, 2)),
        ("wt", "TinyLFU, window 50k, count >= 2", TinyLFU(50_000, 2)),
        ("victim", "2nd offer", nth_offer(2)),
        ("victim", "2nd offer, parent in host or on disk", chain(nth_offer(2))),
        ("victim", "hit while in the host", lambda s, k: s.hhits[k] >= 1),
        ("victim", "sighted twice", lambda s, k: s.sights(k) >= 2),
        ("victim", "sighted 3 times", lambda s, k: s.sights(k) >= 3),
        ("victim", "TinyLFU, window 50k, count >= 2", TinyLFU(50_000, 2)),
    ]
    for mode, name, rule in rules:
        rows.append(run(mode, rule).row(f"{mode}: {name}"))
    base = run("wt", nth_offer(2))
    read = {k for k in base.written if base.reads[k]}
    rows.append(
        run("wt", lambda s, k: s.offers[k] >= 2 and k in read).row("oracle: 2nd offer, later read")
    )
    first = run("wt", nth_offer(1))
    read1 = {k for k in first.written if first.reads[k]}
    rows.append(run("wt", lambda s, k: k in read1).row("oracle: 1st offer, later read"))
    rows.append(run("victim", lambda s, k: last[k] > s.t).row("oracle: at eviction, used again"))

    # Hindsight: the baseline's candidates grouped by their features, each
    # group scored with its read rate over this whole trace (no online rule
    # knows it); keep the groups above a cut.
    cands: list[tuple[int, tuple[int, ...]]] = []

    def record(s: Sim, k: int) -> bool:
        if s.offers[k] < 2:
            return False
        cands.append((k, features(s, k)))
        return True

    b2 = run("wt", record)
    n: Counter[tuple[int, ...]] = Counter()
    pos: Counter[tuple[int, ...]] = Counter()
    for k, f in cands:
        n[f] += 1
        pos[f] += b2.reads[k] > 0
    for cut in (0.2, 0.25, 0.3):
        keep = {f for f in n if pos[f] / n[f] >= cut}
        rows.append(run("wt", kept(keep)).row(f"hindsight feature groups, read rate >= {cut}"))
    ranked = sorted(n, key=lambda f: -pos[f] / n[f])
    tot = sum(pos.values())
    cw = cp = 0
    frontier = []
    for f in ranked:
        cw, cp = cw + n[f], cp + pos[f]
        frontier.append((cp / tot, cp / cw))
    print(f"{a.workload}: {len(tr)} requests; baseline candidates {len(cands)}, later read {tot}")
    for r in (0.5, 0.82, 0.9):
        prec = max(pr for rc, pr in frontier if rc >= r)
        print(f"  hindsight groups ({len(n)}): precision {prec:.2f} at recall >= {r}")

    if a.grid:
        pts = [
            run(mode, weighted(x, y, c)).row(f"{mode}: {x} * offers + {y} * host hits >= {c}")
            for mode in ("wt", "victim")
            for x in (1, 2, 3)
            for y in (0, 1, 2, 3)
            for c in range(2, 9)
        ]
        best = -1.0
        for p in sorted(pts, key=lambda r: (r["writes_per_hit"], -r["hit_pct"])):
            if p["hit_pct"] > best:
                best = p["hit_pct"]
                rows.append(p)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    for row in rows:
        print(
            "| "
            + " | ".join(f"{row[c]:,}" if isinstance(row[c], int) else str(row[c]) for c in cols)
            + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
