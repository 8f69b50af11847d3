"""The disk tier's prefix-aware eviction through the manager: a chain the
host tier cascades keeps its links on disk (the manager hands each block's
predecessor to the tier's index), and the disk evicts it tail first under
every policy it offers, though each policy's own order would take the head
(written first) first."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers.disk import DiskTier, record_bytes
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
