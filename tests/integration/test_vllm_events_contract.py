"""Issue 49 item 1: failed writes through vLLM's own KV-event tracker, in
each vLLM kvtier supports. The checks are in vllm_events_case.py (free of
pytest): in-process here under vLLM 0.33, and as a child of the engine's
Python (vLLM 0.32, ``KVTIER_ENGINE_PYTHON``, which ``make test`` sets).

- 0.33: a failed store or promotion that a lookup saw is a metadata-only
  removal; the tracker forgets the key and publishes nothing, and a store or
  promotion that owns the key again before the drain keeps its payload.
- 0.32: no metadata-only removal exists (its OffloadingEvent has no such
  field, its CPU manager announces nothing for a failed store): nothing is
  published for a block that was never announced.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_under_engine_vllm

pytest.importorskip("vllm.v1.kv_offload.base")
from integration import vllm_events_case as case

HERE = Path(__file__).resolve().parent


def test_this_vllm_has_metadata_only_removals() -> None:
    """The in-process vLLM is 0.33's (the route these checks are for)."""
    assert case.METADATA_ONLY


@pytest.mark.parametrize("check", case.CHECKS, ids=lambda c: c.__name__)
def test_failed_writes_through_vllms_events_tracker(check: Callable[[], None]) -> None:
    check()


def test_the_same_under_the_engines_vllm() -> None:
    """The same checks under vLLM 0.32 (its tracker, its OffloadingEvent)."""
    out = run_under_engine_vllm(HERE / "vllm_events_case.py")
    assert out.strip().endswith("no metadata_only ok"), out[-2000:]
