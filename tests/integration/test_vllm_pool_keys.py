"""The vLLM shim's keys for the pool's own event stream (issue 35 item 3):
``kvtier_pool_events`` and ``kvtier_engine_id`` reach the remote tier the
spec builds, and bad values are clear errors at start-up."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
import kvtier
from kvtier.integrations.vllm import parse_extra_config
from kvtier.tiers.remote import RemoteTier
from test_vllm import SPEC, config
from vllm.v1.kv_offload.factory import OffloadingSpecFactory


def remote_tier(extra: dict[str, Any]) -> Any:
    """The shim's manager for ``extra`` and the remote tier it built."""
    m = OffloadingSpecFactory.create_spec(config(extra)).get_manager()
    (tier,) = m.m.lower  # type: ignore[attr-defined]
    assert isinstance(tier, RemoteTier)
    return m, tier


@pytest.mark.parametrize(
    "keys,stream,engine,index",
    [
        ({}, True, f"{socket.gethostname()}:{os.getpid()}", True),
        ({"kvtier_pool_events": True, "kvtier_engine_id": "prefill-7"}, True, "prefill-7", True),
        ({"kvtier_pool_events": False}, False, None, False),
        ({"kvtier_pool_index": False}, True, None, False),
    ],
)
def test_pool_event_keys_reach_the_remote_tier(
    redis_standalone: Any, keys: dict[str, Any], stream: bool, engine: str | None, index: bool
) -> None:
    extra = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 8,
             "kvtier_remote_url": redis_standalone.url,
             "kvtier_namespace": uuid.uuid4().hex, **keys}  # fmt: skip
    m, tier = remote_tier(extra)
    try:
        assert (tier.stream is not None) == stream
        assert (tier.pool_events > 0) == stream
        assert (tier.index is not None) == index
        if engine is not None:
            assert tier.engine_id == engine
    finally:
        m.shutdown()


@pytest.mark.parametrize(
    "keys,match",
    [
        ({"kvtier_pool_events": "yes"}, "kvtier_pool_events"),
        ({"kvtier_pool_events": -1}, "kvtier_pool_events: must be >= 0"),
        ({"kvtier_engine_id": 7}, "kvtier_engine_id"),
        ({"kvtier_pool_index": "on"}, "kvtier_pool_index"),
        ({"kvtier_engine_id": ""}, "kvtier_engine_id: must be a non-blank name"),
        ({"kvtier_engine_id": "  "}, "kvtier_engine_id: must be a non-blank name"),
        ({"kvtier_engine_id": "x" * 257}, "at most 256 characters"),
    ],
)
def test_bad_pool_event_keys_are_clear_errors(keys: dict[str, Any], match: str) -> None:
    with pytest.raises(kvtier.InvalidArgument, match=match):
        parse_extra_config({"kvtier_host_bytes": "1MiB", **keys})
    with pytest.raises(kvtier.InvalidArgument, match=match):
        OffloadingSpecFactory.create_spec(
            config({**SPEC, "kvtier_host_bytes": "1MiB", **keys})
        ).get_manager()
