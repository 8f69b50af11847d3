"""The serving soak's pure parts: its seeded fault schedule, its workload
(returning conversations share their prefixes, fresh prompts do not) and
the judge's token comparison."""

from __future__ import annotations

from collections import Counter

import pytest
from kvtier.bench.soak_server import (
    SERVER_FAULT_KINDS,
    ServerSoakConfig,
    server_env,
    server_fault_schedule,
)
from kvtier.bench.soak_server_client import Workload


def test_schedule_runs_every_kind_once_in_two_minutes_and_at_least_twice_in_thirty() -> None:
    for minutes, least in ((2.0, 1), (30.0, 2)):
        cfg = ServerSoakConfig(minutes=minutes)
        s = server_fault_schedule(cfg.total_s, cfg.warmup_s, cfg.seed)
        counts = Counter(k for _, k in s)
        assert set(counts) == set(SERVER_FAULT_KINDS)
        assert min(counts.values()) >= least
        times = [t for t, _ in s]
        assert times == sorted(times) and times[0] > cfg.warmup_s and times[-1] < cfg.total_s
    a = server_fault_schedule(600, 120, seed=1)
    assert a == server_fault_schedule(600, 120, seed=1) != server_fault_schedule(600, 120, seed=2)
    assert server_fault_schedule(120, 30, 0, kinds=()) == []


def test_a_conversations_turns_extend_its_prompt_and_fresh_prompts_are_new() -> None:
    w = Workload(seed=3, fresh_share=0.0)
    first = w.next(set())
    again = [w.next(set()) for _ in range(200)]
    later = next(r for r in again if r.conversation == first.conversation)
    assert later.turn == first.turn + 1
    assert later.prompt[: len(first.prompt)] == first.prompt
    assert first.prompt[: w.system_tokens] in [s for s in w.system]
    assert w.next(set(w.convs)).kind == "fresh"  # every conversation in flight: a fresh prompt
    assert all(r.max_tokens == w.max_tokens for r in again)
    assert Workload(seed=3).next(set()).prompt == Workload(seed=3).next(set()).prompt


def test_the_servers_bound_the_cpu_builds_memory_unless_the_caller_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = server_env()
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert env["PYTHONHASHSEED"] == "0"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert server_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
