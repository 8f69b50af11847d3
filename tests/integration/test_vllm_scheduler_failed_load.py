"""Issue 58 item 1: a failed load under vLLM's own scheduler, built
in-process on CPU with KVTierConnector (the case, and why, in
vllm_scheduler_case.py and connector._keep_risky_hits_async).

Request A's hit is streamed from disk and its load fails; C shares A's
prefix. vLLM 0.33 loaded A's hit within the step and cached its blocks at
allocation: C found them in its local prefix hit and read them before A
recomputed them, so C's first token was computed on blocks the load never
filled (under asynchronous scheduling, vLLM 0.33's default; and, without
it, when A's client hangs up after the failure). Such a hit now loads a
step ahead, and hits in ready host slots still load within the step.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_under_engine_vllm

pytest.importorskip("vllm.v1.kv_offload.base")
import kvtier
from integration import vllm_scheduler_case as case

HERE = Path(__file__).resolve().parent
BLOCKS = len(case.PREFIX) // case.BS  # 4


@pytest.mark.parametrize(
    ("async_scheduling", "a_first_token", "steps"),
    [
        # A's load fails, A recomputes its prompt while C computes on top of
        # the blocks A writes in the same step.
        (True, [case.RIGHT], [("A", 0, 72, True), ("C", 64, 8, True)]),
        # A's client hangs up: C misses (kvtier forgot the failed keys) and
        # computes its whole prompt.
        (False, [], [("C", 0, 72, True)]),
    ],
    ids=["async-scheduling", "aborted-after-the-failure"],
)
def test_a_request_sharing_a_failed_loads_prefix_gets_the_right_first_token(
    tmp_path: Path, async_scheduling: bool, a_first_token: list[int], steps: list[tuple]
) -> None:
    """Before: A's load was synchronous ([("A", True)]), the steps were
    [("A", 64, 8, False), ("C", 64, 8, False), ...] and C's first token
    WRONG, under vLLM 0.33 either way."""
    r = case.shared_prefix(tmp_path, async_scheduling, abort_a=not async_scheduling)
    assert r["load_failures"] == BLOCKS  # A's load did fail, and was told to kvtier
    assert r["first_tokens"] == {"A": a_first_token, "C": [case.RIGHT]}
    assert r["loads"] == [("A", False)]  # a streamed hit: loaded a step ahead
    assert r["steps"] == steps


def test_a_hit_in_ready_host_slots_still_loads_within_the_step(tmp_path: Path) -> None:
    """A load that cannot fail keeps vLLM 0.33's synchronous load: A computes
    the rest of its prompt in the step that loads its 64 tokens, and C,
    a step later, shares the loaded blocks (the stand-in finds them right)."""
    assert case.shared_prefix(tmp_path, on_disk=False, a_fails=False) == case.HOST_HIT


def test_the_same_under_the_engines_vllm() -> None:
    """The same cases under the engine's vLLM (0.32: KVTierConnector's own
    synchronous loads, issue 52's fix)."""
    out = run_under_engine_vllm(HERE / "vllm_scheduler_case.py")
    assert out.strip().endswith("ok"), out[-2000:]


def test_a_vllm_whose_sync_loads_cannot_be_steered_is_refused() -> None:
    """A vLLM loading hits within the step without ``_reserve_sync_load``
    could not keep them to hits that cannot fail: refused at start-up, with
    the setting that avoids it."""
    from kvtier.integrations.vllm.connector import _keep_risky_hits_async

    with pytest.raises(kvtier.UnsupportedEngine, match="Set sync_load_budget_bytes: 0"):
        _keep_risky_hits_async(SimpleNamespace(), set())
