"""A synchronous load that fails under KVTierConnector: vLLM recomputes the
request, but the step already computed the rest of its prompt on top of the
engine blocks the load never filled, and built stores of those blocks. The
serving soak (issue 52) measured what storing them does: later turns got
wrong tokens (4-6 of about 245 requests in two minutes while Redis evicted,
0 once those stores were dropped). Here, below vLLM's engine: the stores of
the failed load's request are dropped when they complete; other requests'
stores are kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")
from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.scheduler import KVTierManager
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.tiers import HostTier
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

CTX = ReqContext(req_id="r1")


def _key(i: int) -> OffloadKey:
    return OffloadKey(b"%032d" % i + b"\0\0\0\0")


def _stored(m: KVTierManager, keys: list[OffloadKey]) -> list[str]:
    with m.lock:
        return [m.lookup(k, CTX).name for k in keys]


def test_stores_built_on_a_failed_synchronous_load_are_dropped() -> None:
    pool = HostPool(16, 4096)
    m = KVTierManager(TieredOffloadingManager(HostTier(pool, 16)))
    try:
        loaded = [_key(i) for i in range(2)]
        with m.lock:
            out = m.prepare_store(loaded, CTX)
            assert out is not None
            m.complete_store(loaded, CTX)
            spec = m.prepare_load(loaded, CTX)
        ours, theirs = [_key(10), _key(11)], [_key(20)]
        with m.lock:
            assert m.prepare_store(ours + theirs, CTX) is not None
        # vLLM 0.32's scheduler-side state, as KVTierConnector reads it.
        jobs = {
            3: SimpleNamespace(is_store=True, req_id="r1", keys=set(ours)),
            4: SimpleNamespace(is_store=True, req_id="r2", keys=set(theirs)),
        }
        cs = SimpleNamespace(_jobs=jobs, manager=m, update_connector_output=lambda out: None)
        c = KVTierConnector.__new__(KVTierConnector)
        c.connector_scheduler = cs  # type: ignore[assignment]
        c._sync = None
        c._loads = {7: [spec, [5, 6], 1, False, "r1"]}
        output = SimpleNamespace(
            kv_connector_worker_meta=SimpleNamespace(completed_jobs={7: 1}),
            invalid_block_ids={6},  # the worker could not fill engine block 6
        )
        with m.lock:
            m.complete_load(loaded, CTX)
        c.update_connector_output(output)
        assert c._loads == {}
        with m.lock:  # the store jobs complete a step later, reported successful
            m.complete_store(ours, CTX)
            m.complete_store(theirs, CTX)
        assert _stored(m, ours) == ["MISS", "MISS"]  # computed on the unfilled block
        assert _stored(m, theirs) == [LookupResult.HIT.name]
        assert _stored(m, loaded) == ["MISS", "MISS"]  # the failed load's keys are forgotten
        assert m.m.stats.store_failures == 2
    finally:
        m.shutdown()
        pool.close()


def test_only_hits_that_cannot_fail_to_load_are_loaded_within_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM caches a synchronous hit's blocks when it allocates them; when
    the load fails, a request sharing those blocks counts them as computed
    until the failed request recomputes them. The 30-minute serving soak
    (issue 52) measured it: 7 of 3,622 requests got a wrong first token,
    each beside a failed synchronous load (a fenced read whose Redis value
    was gone). A hit that can still fail to load (a fenced fill, a stream)
    is marked for its request, and KVTierConnector loads it asynchronously
    (``_SyncLoads.reserve``'s ``may_fail``); hits in ready host slots are not."""
    pool = HostPool(16, 4096)
    core = TieredOffloadingManager(HostTier(pool, 16))
    m = KVTierManager(core)
    try:
        keys = [_key(i) for i in range(3)]
        with m.lock:
            out = m.prepare_store(keys, CTX)
            assert out is not None
            m.complete_store(keys, CTX)
        assert _stored(m, keys) == ["HIT"] * 3
        assert m.risky_hits == set()  # ready host slots: nothing left to fail
        assert not any(core.may_fail_to_load(bytes(k)) for k in keys)
        monkeypatch.setattr(core, "may_fail_to_load", lambda k: k == bytes(keys[2]))
        with m.lock:
            assert m.lookup(keys[2], CTX) is LookupResult.HIT
        assert m.risky_hits == set()  # kept only while KVTierConnector asks
        m.track_risky = True
        other = ReqContext(req_id="r2")
        with m.lock:
            assert m.lookup(keys[1], other) is LookupResult.HIT
            assert m.risky_hits == set()
            assert m.lookup(keys[2], other) is LookupResult.HIT
            assert m.risky_hits == {"r2"}
            assert m.lookup(_key(9), CTX) is LookupResult.MISS
        assert m.risky_hits == {"r2"}
    finally:
        m.shutdown()
        pool.close()
