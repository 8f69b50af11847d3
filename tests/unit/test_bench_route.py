"""``kvtier bench route``: the saved tokens of each routing on a small trace,
worked out by hand; the events router routes from events alone, and a
removal moves requests away; the shared pool is one index for every engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvtier.bench.route import EventsRouter, replay_routing, run_route, sessions
from kvtier.bench.route_fleet import Fleet, LoadModel
from kvtier.replay import key_of
from kvtier.tiers.base import TierEvent

# Two sessions of two turns under a common system block 0, spaced far apart
# in time so that no engine has a request in flight when the next arrives.
TRACE = [[0, 1, 2], [0, 1, 2, 3], [0, 4, 5], [0, 4, 5, 6]]
# The turns interleaved (s1, s2, s1, s2): what round robin spreads worst.
INTERLEAVED = [TRACE[0], TRACE[2], TRACE[1], TRACE[3]]


def records(traces: list[list[int]]) -> list[dict[str, Any]]:
    return [
        {"timestamp": 100_000 * i, "input_length": 512 * len(t), "output_length": 1,
         "hash_ids": t}
        for i, t in enumerate(traces)
    ]  # fmt: skip


def run(name: str, traces: list[list[int]], host: int, disk: int = 0, pool: int = 0) -> Any:
    return replay_routing(name, records(traces), Fleet(2, host, disk, pool))


def test_sessions_are_the_first_block_past_the_common_prefix() -> None:
    assert sessions(TRACE) == [1, 1, 4, 4]
    assert sessions([[7, 8], [7, 8, 9]]) == [8, 9]  # [7, 8]: nothing past it, its last block
    assert sessions([]) == []


def test_saved_tokens_without_lower_tiers_by_hand() -> None:
    """2 engines, a host tier of 8 blocks each (no eviction), no disk, no pool.

    round robin (E0, E1, E0, E1): [0,1,2] E0 misses; [0,1,2,3] E1 misses;
    [0,4,5] E0 hits [0]; [0,4,5,6] E1 hits [0]: 2 blocks.
    session (s1 -> E0, s2 -> E1): 0 + 3 ([0,1,2] on E0) + 0 + 3 ([0,4,5]
    on E1): 6 blocks.
    events: [0,1,2] E0 (all equal; E0 chosen least recently); [0,1,2,3] E0
    (prefix 3); [0,4,5] E0 (prefix 1 against 0): hits [0]; [0,4,5,6] E0
    (prefix 3): 3 + 1 + 3 = 7 blocks.
    """
    rr, ss, ev = (run(n, TRACE, host=8) for n in ("round_robin", "session", "events"))
    assert (rr["saved_tokens"], ss["saved_tokens"], ev["saved_tokens"]) == (
        2 * 512, 6 * 512, 7 * 512,
    )  # fmt: skip
    assert rr["choices"] == [0, 1, 0, 1] and ss["choices"] == [0, 0, 1, 1]
    assert ev["choices"] == [0, 0, 0, 0]
    assert ev["hit_blocks"] == {"host": 7, "disk": 0, "pool": 0}
    assert ev["block_refs"] == 14 and ev["hit_rate"] == round(7 / 14, 6)
    assert ev["router_view_exact"] is True
    # Written to host: every block not hit (each engine stores what it computed).
    assert rr["written_blocks"] == {"host": 12, "disk": 0, "pool": 0}
    assert ev["written_blocks"] == {"host": 7, "disk": 0, "pool": 0}


def test_saved_tokens_through_the_shared_pool_by_hand() -> None:
    """Round robin over the interleaved turns, with a pool of 100 blocks.

    [0,1,2] E0 misses (stored in E0's host and the pool); [0,4,5] E1: [0]
    from the pool, then misses; [0,1,2,3] E0: 3 from its host; [0,4,5,6]
    E1: 3 from its host. Without the pool [0,4,5] would hit nothing, so one
    engine's store is another's hit. The pool is written once per block:
    0,1,2 then 4,5 then 3 then 6.
    """
    rr = run("round_robin", INTERLEAVED, host=8, pool=100)
    assert rr["hit_blocks"] == {"host": 6, "disk": 0, "pool": 1}
    assert rr["saved_tokens"] == 7 * 512
    assert rr["written_blocks"]["pool"] == 7
    alone = run("round_robin", INTERLEAVED, host=8)
    assert alone["saved_tokens"] == 6 * 512
    # The same with the turns in order (E0, E1, E0, E1): [0,1,2,3] on E1
    # takes 0,1,2 from the pool; [0,4,5,6] on E1 takes 0 from its host, 4,5 from the pool.
    rr = run("round_robin", TRACE, host=8, pool=100)
    assert rr["hit_blocks"] == {"host": 2, "disk": 0, "pool": 5}


def test_disk_hits_are_counted_after_host_eviction() -> None:
    """A host tier of 3 blocks and a disk of 100: [0,1,2] then [7,8,9]
    (evicts 0,1,2 from the host; the disk keeps them) then [0,1,2,3] on one
    engine hits 3 blocks from disk."""
    ev = replay_routing(
        "round_robin", records([[0, 1, 2], [7, 8, 9], [0, 1, 2, 3]]), Fleet(1, 3, 100, 0)
    )
    assert ev["hit_blocks"] == {"host": 0, "disk": 3, "pool": 0}
    assert ev["saved_tokens"] == 3 * 512


def K(i: int) -> bytes:
    return key_of(i)


def test_events_router_moves_requests_away_after_removals() -> None:
    r = EventsRouter(2)
    loads = [0, 0]
    r.observe(
        [[TierEvent([K(1), K(2), K(3)], "host", False)], [TierEvent([K(1)], "disk", False)]], []
    )
    want = [K(1), K(2), K(3)]
    assert r.choose(want, 0, loads) == 0  # prefix 3 against 1
    r.observe([[TierEvent([K(1)], "host", True)], []], [])
    assert r.choose(want, 0, loads) == 1  # E0's prefix is gone at its first block
    # The pool's blocks count for every engine; its removals too.
    r.observe([[], []], [TierEvent([K(1)], "pool", False, {"engine": 1})])
    assert r.score(0, want) == (3, 0, 0) and r.score(1, want) == (1, 1, 0)
    assert r.choose(want, 0, loads) == 0
    r.observe([[], []], [TierEvent([K(1)], "pool", True)])
    assert r.score(0, want) == (0, 0, 0)
    # Load: one block of prefix is worth one request in flight. E1's prefix
    # is 1 block (its disk), E0's none: a request more in flight on E1 ties
    # (its own tiers hold more: E1), two send the request to E0.
    assert r.choose(want, 0, [0, 0]) == 1 and r.choose(want, 0, [0, 1]) == 1
    assert r.choose(want, 0, [0, 2]) == 0


def test_events_router_follows_evictions_in_a_real_fleet() -> None:
    """Host tiers of 3 blocks, no lower tier: [10,11,12] E0, [20,21,22] E1,
    [30,31,32] E0 (chosen least recently; evicts 10,11,12), then
    [10,11,12,13]: a router that missed the removals would send it to E0;
    this one sees no engine holding it and sends it to E1 (least recent)."""
    traces = [[10, 11, 12], [20, 21, 22], [30, 31, 32], [10, 11, 12, 13]]
    ev = run("events", traces, host=3)
    assert ev["choices"] == [0, 1, 0, 1]
    assert ev["router_view_exact"] is True
    # Sticky: one session, host of 3: the second turn still finds its first on E0.
    ev = run("events", [[10, 11, 12], [10, 11, 12, 13]], host=8)
    assert ev["choices"] == [0, 0] and ev["saved_tokens"] == 3 * 512


def test_run_route_is_deterministic_and_its_json(tmp_path: Path) -> None:
    from kvtier.bench.traces import synthetic_trace

    traces = synthetic_trace(300, seed=3)
    recs = [{"timestamp": 500 * i, "input_length": 512 * len(t), "output_length": 50,
             "hash_ids": t} for i, t in enumerate(traces)]  # fmt: skip
    a = run_route(recs, 4, 60, 200, 100, 1 << 20, seed=1, load=LoadModel(time_scale=0.5))
    b = run_route(recs, 4, 60, 200, 100, 1 << 20, seed=1, load=LoadModel(time_scale=0.5))
    for r in (a, b):
        for routing in r["routings"].values():
            del routing["wall_s"]  # the only figure that is not simulated
    assert json.dumps(a) == json.dumps(b)
    assert set(a["routings"]) == {"round_robin", "session", "events"}
    for r in a["routings"].values():
        assert isinstance(r["saved_tokens"], int) and 0 <= r["hit_rate"] <= 1
        assert r["saved_tokens"] <= a["bound_saved_tokens"]
        assert sum(r["requests_per_engine"]) == 300
    assert a["routings"]["events"]["router_view_exact"] is True
    assert a["routings"]["events"]["saved_tokens"] > a["routings"]["round_robin"]["saved_tokens"]


def test_the_command(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvtier.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records(INTERLEAVED * 3)))
    out = tmp_path / "out"
    rc = main(["bench", "route", "--trace", str(trace), "--engines", "2", "--host-blocks", "8",
               "--disk-blocks", "0", "--pool-blocks", "0", "--max-requests", "4",
               "--out", str(out), "--json", str(tmp_path / "r.json")])  # fmt: skip
    assert rc == 0
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["requests"] == 4
    assert {n: r["saved_tokens"] for n, r in got["routings"].items()} == {
        "round_robin": 6 * 512, "session": 6 * 512, "events": 7 * 512,
    }  # fmt: skip
    assert len(list(out.glob("route-*.png"))) == 1 and len(list(out.glob("route-*.json"))) == 1
