"""The node's region divided between block sizes (kvtier.node.chunks),
on its tier code alone: which chunks a block size may give up."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kvtier.node.chunks import (
    ChunkedHostTier,
    NativeChunkedHostTier,
    Region,
    chunk_bytes_for,
    open_region,
)
from kvtier.options.tiers import HostOptions
from kvtier.scheduler.manager import TieredOffloadingManager


@pytest.fixture
def region() -> Iterator[Region]:
    r = open_region(f"kvtest-chunks-{os.getpid()}", 16 * 4096, 4096)  # 16 chunks of 4 KiB
    yield r
    r.pool.close()


# Both host tiers a block size can have: the Python one (any policy) and
# the native index (LRU, the default).
TIERS = pytest.mark.parametrize("tier", [ChunkedHostTier, NativeChunkedHostTier])


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def test_chunk_sizes_follow_the_region() -> None:
    assert chunk_bytes_for(64 << 30) == 64 << 20
    assert chunk_bytes_for(1 << 20) == 64 << 10  # 16 chunks at least
    assert chunk_bytes_for(8192) == 4096  # never under a page


@TIERS
def test_a_chunk_with_a_slot_still_in_use_is_never_given(region: Region, tier: type) -> None:
    t = tier(region.view(1024), HostOptions(), region)  # 4 slots a chunk
    m = TieredOffloadingManager(t, events=False)
    out = m.prepare_store([key(i) for i in range(64)])  # the whole region
    assert out is not None and len(t.chunks) == 16
    m.complete_store(out.keys_to_store)
    chunk = {k: t.entries[k].slot // 4 for k in out.keys_to_store}
    # One block detached but still under a job (its slot neither free nor a
    # block's), another pinned by a load: their chunks stay.
    limbo, pinned = chunk[key(0)], chunk[key(40)]
    limbo_slot = t.entries[key(0)].slot
    t.detach(key(0))
    m.prepare_load([key(40)])
    # The least recently used block's chunk goes, past those two.
    want = next(chunk[key(i)] for i in range(1, 64) if chunk[key(i)] not in (limbo, pinned))
    assert t.give_chunk() == want
    assert all(k not in t.entries for k, c in chunk.items() if c == want)
    assert len(t.chunks) == 15 and region.owner[want] is None
    assert not any(s // 4 == want for s in t._free_list())
    assert t.entries[key(40)].ref == 1
    m.complete_load([key(40)])
    t.release_slot(limbo_slot)  # the job ended: its slot free again
    assert limbo in {t.give_chunk() for _ in range(14)}  # it may go now


@TIERS
def test_regret_is_a_block_stored_or_promoted_again_after_its_eviction(
    region: Region, tier: type
) -> None:
    t = tier(region.view(4096), HostOptions(), region)  # 16 slots at most
    other = tier(region.view(2048), HostOptions(), region)
    m = TieredOffloadingManager(t, events=False)
    for i in range(20):  # the region has 16 slots: 4 evicted, none regretted yet
        out = m.prepare_store([key(i)])
        assert out is not None
        m.complete_store(out.keys_to_store)
    assert (len(t.chunks), t.regret) == (16, 0)
    out = m.prepare_store([key(0), key(1)])  # evicted before: stored again
    assert out is not None and t.regret == 2 * 4096
    slot = out.store_spec.slots.tolist()[0]
    m.complete_store(out.keys_to_store)
    t.drop(key(0))  # as if gone, then promoted back from a lower tier
    t._forget([key(0)])
    t.add_writing(key(0), slot, source="disk")
    assert t.regret == 3 * 4096 and other.regret == 0


def test_the_memory_split_benchmark_reports_both_configurations(tmp_path: object) -> None:
    """bench/node_memory_split.py on a tiny run: every scenario, both
    configurations, the region's chunks all held at the end."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "node_memory_split.py"
    spec = importlib.util.spec_from_file_location("node_memory_split", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    out = Path(str(tmp_path)) / "split.json"
    assert (
        mod.main(["--region-mib", "16", "--turns", "400", "--seeds", "1", "--json", str(out)]) == 0
    )
    r = json.loads(out.read_text())
    assert set(r["scenarios"]) == {"balanced", "skewed", "idle"}
    for sc in r["scenarios"].values():
        (run,) = sc["runs"]
        assert run["fixed"]["hit_bytes"] > 0 and run["by_use"]["hit_bytes"] > 0
        assert sum(run["by_use"]["chunks"]) == 16
        assert run["ratio"] == round(run["by_use"]["hit_bytes"] / run["fixed"]["hit_bytes"], 3)


@TIERS
def test_a_region_for_one_block_size_counts_no_regret(tier: type) -> None:
    """Regret only moves chunks between block sizes: a node of one
    (--max-classes 1) remembers none of its evictions; one of two does."""
    for classes, remembered in ((1, 0), (2, 8)):
        r = open_region(f"kvtest-chunks1-{os.getpid()}", 4 * 4096, 4096, classes)
        try:
            t = tier(r.view(1024), HostOptions(), r)  # 16 slots in all
            m = TieredOffloadingManager(t, events=False)
            for i in range(0, 24, 8):  # the third offer evicts 8 blocks
                out = m.prepare_store([key(j) for j in range(i, i + 8)])
                assert out is not None
                m.complete_store(out.keys_to_store)
            assert len(t._ghost) == remembered
            out = m.prepare_store([key(0)])  # stored again: regret, with two
            assert out is not None
            assert (t.regret > 0) == (classes > 1)
            m.shutdown()
        finally:
            r.pool.close()


def test_the_nodes_list_of_writers_is_bounded_and_knows_who_exited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvtier.node.quarantine.Writers: at most MAX_WRITERS pidfds (the
    oldest forgotten), an exited process is not alive, the dead
    connection's own process is left out, and prune forgets the exited."""
    import subprocess
    import sys

    from kvtier.node import quarantine as Q

    monkeypatch.setattr(Q, "MAX_WRITERS", 3)
    w = Q.Writers()
    try:
        for i in range(5):
            w.add(f"e{i}", os.getpid())
        assert len(w) == 3 and w.alive("e0", 0) == []
        fds = w.alive("e4", 0)  # new pidfds, the caller's to close
        assert len(fds) == 1
        os.close(fds[0])
        assert w.alive("e4", os.getpid()) == []
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        w.add("gone", p.pid)
        p.wait()
        assert w.alive("gone", 0) == []
        w.prune()
        assert len(w) == 2  # e3 and e4 (this process); "gone" forgotten
        w.add("x", 0)  # a pid not visible here: not tracked
        assert len(w) == 2
    finally:
        w.close()


class _HeldSlots:
    """A host's hold and unhold, as the quarantine calls them."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def hold(self, s: int) -> None:
        self.held.add(s)

    def unhold(self, s: int) -> None:
        self.held.remove(s)


def test_past_its_cap_the_quarantine_frees_only_slots_no_honest_copy_can_reach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over the cap, older holds go early only where no honest engine's
    copy can still land: its writers all exited, its connection closed for
    bad input, or the same engine attached again after it and died too.
    Another engine's hold with writers unknown (the grace only) or alive
    stays, past the cap, and so does one whose namesake attached before
    it died (two engines sharing a name): a late copy must not land in a
    slot handed to another engine."""
    import subprocess
    import time

    from kvtier.node import quarantine as Q

    p = subprocess.Popen(["true"])
    gone = os.pidfd_open(p.pid)
    p.wait()
    host, q = _HeldSlots(), Q.Quarantine()
    q.hold(host, [1, 2, 3], cap=100, writers=[gone], engine="a")
    q.hold(host, [4, 5, 6], cap=100, engine="b")  # no writer known
    q.hold(host, [7], cap=100, engine="fuzz", misbehaved=True)
    t = time.monotonic()
    q.hold(host, [8], cap=100, engine="c", started=t)  # to be followed by c's next life
    q.hold(host, [9, 10], cap=100, writers=[os.pidfd_open(os.getpid())], engine="d")  # alive
    q.hold(host, [13], cap=100, engine="f", started=t)  # its namesake attached before it died
    assert q.slots == 11 and not caplog.records
    q.hold(host, [11], cap=4, engine="c", started=time.monotonic())
    q.hold(host, [14], cap=4, engine="f", started=t)
    assert host.held == {4, 5, 6, 9, 10, 11, 13, 14} and q.slots == 8  # past the cap, safely
    q.hold(host, [12], cap=4, engine="e")
    assert host.held == {4, 5, 6, 9, 10, 11, 12, 13, 14} and q.slots == 9
    past = [r.getMessage() for r in caplog.records if "past the cap" in r.getMessage()]
    why = "dead engines' writes may still land: stores can fail until their grace ends"
    assert past == [f"kvtier node: 7 slots held, past the cap of 4 ({why})"]  # once a crossing


def test_slots_wait_for_a_live_writer_at_most_max_hold() -> None:
    """A dead engine's slots outlive the grace while a writer of it lives,
    but not MAX_HOLD_S longer (an engine that reattached keeps its workers)."""
    import time

    from kvtier.node import quarantine as Q

    host, q = _HeldSlots(), Q.Quarantine()
    t = time.monotonic()
    q.hold(host, [3, 4], cap=100, writers=[os.pidfd_open(os.getpid())])  # alive: this process
    assert q.expire(t + Q.GRACE_S + 1) == 0 and host.held == {3, 4}
    assert q.waiting() == 0  # counted from now: not past the grace yet
    assert q.expire(t + Q.GRACE_S + Q.MAX_HOLD_S + 1) == 2 and host.held == set()
    q.hold(host, [5], cap=100)  # no writers: the grace only
    assert q.expire(time.monotonic() + Q.GRACE_S + 0.1) == 1
