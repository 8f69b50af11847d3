"""The disk tier's prefix-aware eviction through the manager: a chain the
host tier cascades keeps its links on disk (the manager hands each block's
predecessor to the tier's index), and the disk evicts it tail first under
every policy it offers, though each policy's own order would take the head
(written first) first; the links survive a warm restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers.disk import DiskTier, key_digest, record_bytes
from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.host import HostTier

BLOCK = 4096


def K(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def settle(m: TieredOffloadingManager) -> None:
    m.on_schedule_end()
    deadline = time.monotonic() + 30
    while m.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not end"
        time.sleep(0.002)
        m.on_schedule_end()


def store(m: TieredOffloadingManager, keys: list[bytes]) -> None:
    out = m.prepare_store(keys)
    assert out is not None and out.keys_to_store == keys
    m.complete_store(keys)
    m.on_request_finished()
    settle(m)


# PLFU keeps this chain here (the newcomers go); the index's own test
# (csrc/tests/test_disk_index.cc, DiskIndexChains) covers its order.
@pytest.mark.parametrize("policy", ["lru", "clock"])
def test_a_chain_on_disk_leaves_tail_first(tmp_path: Path, policy: str) -> None:
    pool = HostPool(16, record_bytes(BLOCK))
    disk = DiskTier(tmp_path, 5 * record_bytes(BLOCK), BLOCK, policy=policy, reserve_bytes=0)
    m = TieredOffloadingManager(HostTier(pool, 16), [disk])
    try:
        chain = [K(i) for i in range(4)]
        store(m, chain)  # one offer: a chain, cascaded head first
        store(m, [K(50)])
        m.take_events()
        for i in range(12):  # unrelated blocks, one at a time: the disk evicts
            store(m, [K(100 + i)])
        gone = [
            i
            for e in m.take_events()
            if e.tier == disk.name and e.removed
            for i in [*e.ids, *(vllm_event_id(k) for k in e.keys)]
        ]
        names = {vllm_event_id(c): n for n, c in enumerate(chain)}
        left = [names[i] for i in gone if i in names]
        # When the policy takes the chain, it takes it from the tail.
        assert left and left == [3, 2, 1, 0][: len(left)], left
    finally:
        m.shutdown()
        pool.close()


# The links are journaled and checkpointed: after a warm restart the chain
# still leaves tail first (before, a restart forgot them and the policy's
# order took the head first, stranding the rest).
@pytest.mark.parametrize("via", ["journal", "checkpoint"])
@pytest.mark.parametrize("policy", ["lru", "clock"])
def test_a_chain_on_disk_keeps_its_links_across_a_restart(
    tmp_path: Path, policy: str, via: str
) -> None:
    def open_tier() -> DiskTier:
        return DiskTier(tmp_path, 6 * record_bytes(BLOCK), BLOCK, no_data=True, policy=policy)

    chain = [K(i) for i in range(4)]
    t = open_tier()
    t.chain_hints(dict(zip(chain[1:], chain)))
    assert t.submit_store(chain, [0, 1, 2, 3]) is not None and t.poll()[0].ok
    assert t.submit_store([K(50), K(51)], [0, 1]) is not None and t.poll()[0].ok
    if via == "checkpoint":
        t.checkpoint()
    t.close()
    t = open_tier()
    try:
        assert t.stats()["recovered"] == 6
        recs = [t.index.find(key_digest(k)) for k in chain]
        assert [t.index.child(r) for r in recs] == [*recs[1:], -1]
        for i in range(6):  # unrelated blocks, one at a time: the disk evicts
            assert t.submit_store([K(100 + i)], [0]) is not None and t.poll()[0].ok
        gone = [i for e in t.take_events() if e.removed for i in e.ids]
        names = {vllm_event_id(c): n for n, c in enumerate(chain)}
        left = [names[i] for i in gone if i in names]
        # LRU takes the whole chain; CLOCK's hand moves on after its tail.
        assert left == ([3, 2, 1, 0] if policy == "lru" else [3, 2])
    finally:
        t.close()


def test_replay_restart_strands_no_more_disk_blocks(tmp_path: Path) -> None:
    # kvtier replay --restart-after: the tiers reopened halfway (an empty host
    # tier, the disk's warm restart). With the chains journaled the disk
    # strands what it strands without a restart (0 here); before, a restart
    # forgot them and this run ended with 2 stranded blocks.
    import json

    from kvtier.cli import main

    runs = []
    for restart in (None, 600):
        out = tmp_path / f"r{restart}.json"
        args = ["replay", "--workload", "rag", "--synthetic-requests", "1200", "--host-blocks",
                "100", "--disk", f"{tmp_path}/d{restart}:4MiB", "--no-data", "--block-bytes",
                "16KiB", "--disk-policy", "clock", "--no-progress", "--json", str(out)]  # fmt: skip
        if restart:
            args += ["--restart-after", str(restart)]
        assert main(args) == 0
        runs.append(json.loads(out.read_text()))
    plain, restarted = runs
    assert restarted["restart_after"] == 600 and plain["restart_after"] is None
    assert restarted["tiers"]["disk"]["recovered"] > 0  # the second half reopened the disk
    assert plain["tiers"]["disk"]["recovered"] == 0
    assert restarted["stranded_blocks"]["disk"] == plain["stranded_blocks"]["disk"] == 0
