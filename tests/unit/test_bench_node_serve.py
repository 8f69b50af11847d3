"""``kvtier bench node``'s pure logic: the router's alternation, the trace's
prompts, the configurations' engine settings, the summaries and the
targets' ratios (the servers themselves run only in the benchmark)."""

from __future__ import annotations

from typing import Any

import pytest
from kvtier.bench.node_serve import (
    RoundRobin,
    block_tokens,
    distinct_blocks,
    engine_extra,
    plan_requests,
    restart_figures,
    servers_of,
    summarize,
    verdict,
)
from kvtier.errors import InvalidArgument


def test_round_robin_alternates_and_one_server_takes_everything() -> None:
    two = RoundRobin(2)
    assert [two.pick() for _ in range(5)] == [0, 1, 0, 1, 0]
    one = RoundRobin(1)
    assert [one.pick() for _ in range(3)] == [0, 0, 0]
    with pytest.raises(InvalidArgument, match="at least one server, got 0"):
        RoundRobin(0)


def test_a_trace_block_is_the_same_tokens_everywhere() -> None:
    a = block_tokens(7, 2048)
    assert a == block_tokens(7, 2048) and a != block_tokens(8, 2048)
    assert len(a) == 512 and min(a) >= 16 and max(a) < 2048


def test_plan_requests_numbers_turns_and_shares_prefixes() -> None:
    rows = [
        {"input_length": 600, "output_length": 50, "hash_ids": [0, 1]},
        {"input_length": 300, "output_length": 2, "hash_ids": [0, 2]},
        {"input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 3]},
        {"input_length": 100, "output_length": 9, "hash_ids": [5]},
    ]
    reqs = plan_requests(rows, 2048, max_tokens=4)
    assert [r["turn"] for r in reqs] == [1, 1, 2, 1]
    assert [r["conv"] for r in reqs] == [[0, 1], [0, 2], [0, 1], [-1, 3]]
    assert [len(r["prompt"]) for r in reqs] == [600, 300, 1100, 100]
    assert [r["max_tokens"] for r in reqs] == [4, 2, 4, 4]
    assert reqs[2]["prompt"][:600] == reqs[0]["prompt"]  # the returning turn's prefix
    assert reqs[1]["prompt"] == reqs[0]["prompt"][:300]  # inside the shared system block
    # 32-token blocks: 18 + 9 + 34 + 3 full, less request 1's 9 (all inside the
    # system block, request 0's) and turn 1's 18 again in turn 2.
    assert distinct_blocks(reqs, 32) == 18 + 9 + 34 + 3 - 9 - 18


def test_engine_extra_splits_the_same_host_memory() -> None:
    assert engine_extra("none", 1000, "/s", 32) is None
    assert engine_extra("split", 1000, "/s", 32) == {"kvtier_host_bytes": 500, "block_size": 32}
    assert engine_extra("split-restart", 1001, "/s", 32)["kvtier_host_bytes"] == 500  # type: ignore[index]
    assert engine_extra("single", 1000, "/s", 32) == {"kvtier_host_bytes": 1000, "block_size": 32}
    assert engine_extra("node", 1000, "/s", 16) == {"kvtier_node": "/s", "block_size": 16}
    assert [servers_of(c) for c in ("none", "split", "node", "single")] == [2, 2, 2, 1]


def _req(i: int, turn: int, ttft_ms: float, cached: int, **kw: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"id": i, "turn": turn, "ttft_s": ttft_ms / 1e3, "cached_tokens": cached}
    r.update({"prompt_tokens": 100, "moved": False, "after_restart": False, "output": "x"})
    r.update(kw)
    return r


def test_summarize_counts_returning_turns_only_where_it_says_so() -> None:
    none = [_req(0, 1, 100, 0), _req(1, 2, 90, 0), _req(2, 3, 110, 0)]
    node = [_req(0, 1, 100, 0), _req(1, 2, 20, 64, moved=True), _req(2, 3, 40, 96, output="y")]
    s = summarize(node, none)
    assert s["hit_tokens"] == s["returning_hit_tokens"] == 160
    assert (s["prompt_tokens"], s["returning_prompt_tokens"]) == (300, 200)
    assert (s["ttft_returning_p50_ms"], s["ttft_returning_p90_ms"]) == (30.0, 40.0)
    assert s["ttft_first_p50_ms"] == 100.0
    assert s["moved_share"] == 0.5
    assert s["identical_outputs"] is False  # request 2's output differs


def test_restart_compares_only_the_restarted_servers_later_turns() -> None:
    plain = [_req(0, 2, 10, 64), _req(1, 2, 10, 64), _req(2, 2, 20, 64), _req(3, 1, 50, 0)]
    restarted = [
        _req(0, 2, 10, 64),  # before the restart
        _req(1, 2, 12, 32, after_restart=True),
        _req(2, 2, 22, 64, after_restart=True),
        _req(3, 1, 50, 0, after_restart=True),  # a first turn: not compared
    ]
    r = restart_figures(restarted, plain)
    assert (r["turns"], r["hit_tokens"], r["hit_tokens_without_restart"]) == (2, 96, 128)
    assert r["hit_ratio"] == 0.75
    assert (r["ttft_p50_ms"], r["ttft_p50_without_restart_ms"]) == (17.0, 15.0)
    assert r["ttft_p50_ratio"] == round(17 / 15, 3)


def test_verdict_takes_ratios_within_the_run() -> None:
    s = {
        "none": {"ttft_returning_p50_ms": 100.0, "hit_tokens": 0},
        "split": {"ttft_returning_p50_ms": 80.0, "hit_tokens": 500},
        "node": {"ttft_returning_p50_ms": 40.0, "hit_tokens": 960},
        "single": {"ttft_returning_p50_ms": 38.0, "hit_tokens": 1000},
    }
    restarts = {"node-restart": {"hit_ratio": 0.96, "ttft_p50_ratio": 1.2}}
    v = verdict(s, restarts)
    assert v["node_hits_vs_single"] == {"ratio": 0.96, "met": True}
    # Cuts: none - node = 60 ms, none - split = 20 ms.
    assert v["node_cut_vs_split_cut"] == {
        "ratio": 3.0,
        "met": True,
        "speedup_node": 2.5,
        "speedup_split": 1.25,
    }
    assert v["node_restart"] == {"hit_ratio": 0.96, "ttft_p50_ratio": 1.2, "met": False}
    assert verdict({"none": s["none"]}, {}) == {}
