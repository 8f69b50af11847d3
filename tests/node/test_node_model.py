"""Seeded random runs of several engines on one small node (a thread of the
test): stores that end well, badly or a few steps later, loads held while
other engines' stores evict around them, engines that crash mid-store
(their copies landing after the crash) and come back under the same name
a few steps later, and an engine of another model whose keys
are the same bytes. Whatever the interleaving, every block an engine loads
holds its model's bytes for its key, byte for byte; afterwards the node
holds no pin and no write, and fresh engines of both models find exactly
the node's blocks, each with its bytes. With a disk tier under the node
(``disk``), evicted blocks cascade to it and come back by promotion while
all of that goes on."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from kvtier.node.client import NodeManager
from kvtier.options.tiers import DiskOptions
from kvtier.pool import HostPool
from kvtier.tiers.base import LookupResult
from test_node import BLOCK, NS_A, NS_B, Node, _remove_pools, content, key

BLOCKS = 128  # the node's pool: a few requests' worth, so stores evict all the time
UNIVERSE = 480  # the keys requests draw from: some come back, most were evicted
# Two engines of one model, one of another; the same key bytes in both,
# different block bytes (content()'s salt): they must never meet.
ENGINES = (("e0", NS_A, 0), ("e1", NS_A, 0), ("e2", NS_B, 3))
STEPS = 250
GARBAGE = 7  # content()'s salt for bytes that are not a key's block
RESTART_STEPS = 5  # a crashed engine is back this many steps later


class _Req:
    __slots__ = ("req_id",)

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


@dataclass
class _Engine:
    name: str
    ns: str
    salt: int  # content()'s salt for its model's blocks
    m: NodeManager
    # Stores prepared, not ended: (block ids, slots, whether the copy goes well).
    writing: list[tuple[list[int], list[int], bool]] = field(default_factory=list)
    # Loads prepared, not ended: (block ids, slots).
    loading: list[tuple[list[int], list[int]]] = field(default_factory=list)


class _Run:
    def __init__(self, node: Node, seed: int) -> None:
        self.node = node
        self.rng = random.Random(seed)
        self.engines = [self._start(*e) for e in ENGINES]
        self.pool: HostPool = self.engines[0].m.attach_pool()
        self.loaded = self.stored = self.failed = self.crashes = 0
        self.reqs = self.steps = 0
        # The dead engines' copies still in flight: (the step they land, slots).
        self.late: list[tuple[int, list[int]]] = []
        self.down: dict[int, int] = {}  # crashed engines: the step they start again

    def _start(self, name: str, ns: str, salt: int) -> _Engine:
        return _Engine(name, ns, salt, self.node.engine(ns, engine=name))

    def view(self, slot: int) -> np.ndarray:
        """A slot's block (with a disk tier, a slot has room for a disk
        record's trailer after it)."""
        return self.pool.view(slot)[:BLOCK]

    def check(self, ids: list[int], slots: list[int], salt: int) -> None:
        for i, s in zip(ids, slots):
            got = self.view(s)
            assert np.array_equal(got, content(i, salt)), f"block {i} in slot {s}: not its bytes"

    def end_store(self, e: _Engine, ids: list[int], slots: list[int], good: bool) -> None:
        for i, s in zip(ids, slots):
            self.view(s)[:] = content(i, e.salt if good else GARBAGE)
        e.m.complete_store([key(i) for i in ids], None, good)
        if good:
            self.stored += len(ids)
        else:
            self.failed += len(ids)

    def end_load(self, e: _Engine, ids: list[int], slots: list[int]) -> None:
        self.check(ids, slots, e.salt)  # still its bytes, whatever was stored since
        e.m.complete_load([key(i) for i in ids])
        self.loaded += len(ids)

    def step(self, e: _Engine) -> None:
        rng = self.rng
        keep_w, keep_l = [], []
        for w in e.writing:
            if rng.random() < 0.5:
                self.end_store(e, *w)
            else:
                keep_w.append(w)
        for ld in e.loading:
            if rng.random() < 0.5:
                self.end_load(e, *ld)
            else:
                keep_l.append(ld)
        e.writing, e.loading = keep_w, keep_l
        # A request: a run of consecutive blocks, as a prompt's prefix chain.
        start = rng.randrange(UNIVERSE)
        ids = list(range(start, min(UNIVERSE, start + rng.randint(1, 12))))
        self.reqs += 1
        req = _Req(f"{e.name}-{self.reqs}")
        e.m.on_new_request(req)
        hits: list[int] = []
        first = LookupResult.MISS
        for i in ids:  # vLLM's scan: up to the first block that is not a HIT
            first = e.m.lookup(key(i), req)
            if first is not LookupResult.HIT:
                break
            hits.append(i)
        if hits:  # in the step of its lookup, as vLLM loads
            spec = e.m.prepare_load([key(i) for i in hits], req)
            slots = spec.slots.tolist()
            self.check(hits, slots, e.salt)
            e.loading.append((hits, slots))
        rest = ids[len(hits) :]
        if rest and first is LookupResult.MISS:
            out = e.m.prepare_store([key(i) for i in rest], req)
            if out is not None and out.keys_to_store:
                of = {key(i): i for i in rest}
                stored = [of[k] for k in out.keys_to_store]
                e.writing.append((stored, out.store_spec.slots.tolist(), rng.random() > 0.1))
        e.m.on_request_finished(req)
        e.m.on_schedule_end()
        e.m.take_events()

    def crash(self, j: int) -> None:
        """Engine j dies: what it had queued is never sent, and its copies
        in flight land in their slots anyway (garbage), after its connection
        closed and within the node's grace. It starts again, same name,
        RESTART_STEPS later (after its copies: a restart takes seconds)."""
        e = self.engines[j]
        e.m._client.close()
        for _, slots, _ in e.writing:  # a worker's copy lands up to 3 steps later
            self.late.append((self.steps + self.rng.randint(0, 3), slots))
        e.writing, e.loading = [], []
        self.down[j] = self.steps + RESTART_STEPS
        self.crashes += 1

    def land_late(self) -> None:
        """The dead engines' copies due by now land: bytes no key owns."""
        due = [slots for at, slots in self.late if at <= self.steps]
        self.late = [(at, slots) for at, slots in self.late if at > self.steps]
        for slots in due:
            for s in slots:
                self.view(s)[:] = content(s, GARBAGE)

    def run(self) -> None:
        for self.steps in range(STEPS):
            self.land_late()
            for j, e in enumerate(self.engines):
                if j in self.down:
                    if self.steps < self.down[j]:
                        continue
                    del self.down[j]
                    e = self.engines[j] = self._start(e.name, e.ns, e.salt)
                # (The draw first, so that a run that crashed by mid-run keeps
                # its stream: one seed in a few hundred never crashed at all.)
                none_yet = j == 0 and self.steps == STEPS // 2 and self.crashes == 0
                if self.rng.random() < 0.01 or none_yet:
                    self.crash(j)
                    continue
                self.step(e)
        self.steps += 4
        self.land_late()
        for j in list(self.down):
            e = self.engines[j]
            self.engines[j] = self._start(e.name, e.ns, e.salt)
        self.down.clear()
        for e in self.engines:  # every store and load ended, every step with them
            for w in e.writing:
                self.end_store(e, *w)
            for ld in e.loading:
                self.end_load(e, *ld)
            e.writing, e.loading = [], []
            e.m.on_schedule_end()
            e.m.take_events()


# 26: with the quarantine's cap freeing the oldest holds whoever could still
# write them (before 7 December), its rpc run loaded a dead engine's bytes:
# one seed in 120 found it. KVTIER_MODEL_SEEDS=FIRST-LAST sweeps more (about
# 0.6 s a seed and mode): `make test` keeps these.
_FIRST, _, _LAST = os.environ.get("KVTIER_MODEL_SEEDS", "").partition("-")
SEEDS = range(int(_FIRST), int(_LAST) + 1) if _LAST else [1, 2, 3, 26]


@pytest.mark.parametrize("lower", ["", "disk"])
@pytest.mark.parametrize("shared", [False, True], ids=["rpc", "shared"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_engines_only_ever_load_their_keys_bytes(
    tmp_path: Path, shared: bool, seed: int, lower: str
) -> None:
    if lower:  # the same 128 slots, each with room for a disk record's trailer
        disk = DiskOptions(str(tmp_path / "disk"), 64 << 20)
        node = Node(
            tmp_path, blocks=2 * BLOCKS, shared_index=shared, disk=disk, chunk_bytes=8 * 2 * BLOCK
        )
    else:
        node = Node(tmp_path, blocks=BLOCKS, shared_index=shared)
    try:
        r = _Run(node, seed)
        r.run()
        # The run exercised what it claims to: loads, evictions, failed
        # stores and crashes, not a quiet path.
        assert r.loaded > 50 and r.stored > BLOCKS and r.failed > 0 and r.crashes > 0
        for e in r.engines:
            e.m.shutdown()
        deadline = time.monotonic() + 10
        while node.status()["engines"]:  # their connections' ends taken in
            assert time.monotonic() < deadline, "engines still attached 10 s after shutdown"
            time.sleep(0.01)
        occ = node.status()["classes"][str(BLOCK)]["occupancy"]
        # With a disk, the promotions the last lookups began are the node's
        # to finish (it drives them every few ms); without one, nothing is.
        while lower and occ["writing"] and time.monotonic() < deadline:
            time.sleep(0.01)
            occ = node.status()["classes"][str(BLOCK)]["occupancy"]
        assert (occ["pinned"], occ["writing"]) == (0, 0), occ
        # The fresh engines' reservations (shared index) may evict: taken
        # before the node's blocks are counted.
        fresh_of = {
            ns: node.engine(ns, engine=f"fresh-{salt}") for ns, salt in ((NS_A, 0), (NS_B, 3))
        }
        for fresh in fresh_of.values():
            fresh.on_schedule_end()
            fresh.take_events()
        occ = node.status()["classes"][str(BLOCK)]["occupancy"]
        found = {}
        for ns, salt in ((NS_A, 0), (NS_B, 3)):
            fresh = fresh_of[ns]
            found[ns] = 0
            for i in range(UNIVERSE):
                k = key(i)
                got = fresh.lookup(k)
                for _ in range(2000):  # a disk block: promoted, then a HIT
                    if got is not LookupResult.HIT_PENDING:
                        break
                    fresh.on_schedule_end()
                    time.sleep(0.001)
                    got = fresh.lookup(k)
                if got is LookupResult.HIT:
                    spec = fresh.prepare_load([k])
                    r.check([i], spec.slots.tolist(), salt)
                    fresh.complete_load([k])
                    found[ns] += 1
                fresh.on_schedule_end()
            fresh.shutdown()
        assert sum(found.values()) > 0
        if not lower:
            assert found[NS_A] + found[NS_B] == occ["blocks"]
        else:  # each promotion evicts: more than the host holds came back
            assert found[NS_A] + found[NS_B] > occ["capacity"], (found, occ)
    finally:
        node.stop()
        _remove_pools(node.name)
