"""kvtier's vLLM 0.33 shim against the real vLLM classes (CPU only)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base")
import kvtier  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

PAGE = 4096  # bytes per block per worker
CTX = ReqContext(req_id="r1")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def config(extra: dict[str, Any], bpc: int = 1, world: int = 1, rank: int = 0) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=PAGE,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id=f"test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world,
            tp_size=world,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def K(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}


def test_import_is_cheap_and_does_not_load_the_native_core() -> None:
    code = (
        "import sys, kvtier.integrations.vllm as v\n"
        "print('kvtier._native' in sys.modules, 'kvtier.manager' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


def test_spec_loads_through_the_factory() -> None:
    extra = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_policy": "arc"}
    cls = OffloadingSpecFactory.get_spec_cls(extra)
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    assert cls is KVTierOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(config(extra))
    assert isinstance(spec, KVTierOffloadingSpec)
    assert spec.num_slots == (1 << 20) // 4096
    assert set(cls.build_metric_definitions(extra)) >= {"vllm:kv_offload_kvtier_promotions"}


@pytest.mark.parametrize(
    "extra,match",
    [
        ({}, "kvtier_host_bytes"),
        ({"kvtier_host_bytes": "1MiB", "kvtier_hots": 1}, "unknown kv_connector_extra_config key"),
        ({"kvtier_host_bytes": "lots"}, "cannot parse size"),
        ({"kvtier_host_bytes": 100}, "holds no chunk"),
        ({"kvtier_host_bytes": "1MiB", "kvtier_admit_after": "2"}, "kvtier_admit_after"),
        ({"kvtier_host_bytes": "1MiB", "kvtier_policy": "nope"}, "unknown policy"),
    ],
)
def test_bad_config_keys_are_clear_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(kvtier.InvalidArgument, match=match):
        OffloadingSpecFactory.create_spec(config({**SPEC, **extra})).get_manager()


def test_manager_semantics_through_vllm_types() -> None:
    spec = OffloadingSpecFactory.create_spec(config({**SPEC, "kvtier_host_bytes": 4 * 4096}))
    m = spec.get_manager()
    with m.lock:
        assert m.lookup(K(1), CTX) is LookupResult.MISS
        out = m.prepare_store([K(3), K(1), K(2)], CTX)
        assert out is not None and out.keys_to_store == [K(3), K(1), K(2)]
        assert m.lookup(K(1), CTX) is LookupResult.HIT_PENDING
        m.complete_store(out.keys_to_store, CTX)
        assert m.lookup(K(1), CTX) is LookupResult.HIT
        spec_load = m.prepare_load([K(2), K(3)], CTX)
        slot = dict(zip(out.keys_to_store, out.store_spec.slots.tolist()))
        assert spec_load.slots.tolist() == [slot[K(2)], slot[K(3)]]
        # 1 free slot; K(2), K(3) pinned, K(1) in the offer: no room for two new keys
        assert m.prepare_store([K(1), K(7), K(8)], CTX) is None
        m.complete_load([K(2), K(3)], CTX)
        out2 = m.prepare_store([K(7), K(8)], CTX)
        assert out2 is not None and len(out2.evicted_keys) == 1
        events = list(m.take_events())
        assert events[0].medium is Medium.CPU and not events[0].removed
        assert any(e.removed for e in events)
        stats = m.get_stats()
        assert stats is not None
    m.shutdown()


def _kv_caches(num_blocks: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    # Two layers as vLLM hands them over: int8 views (num_blocks, page) per layer.
    layers = [torch.randint(-128, 127, (num_blocks, PAGE // 2), dtype=torch.int8) for _ in range(2)]
    tensors = [CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE // 2) for t in layers]
    refs = [
        [
            CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE // 2),
            CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=PAGE // 2),
        ]
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs), layers


@pytest.mark.parametrize("bpc", [1, 2])
def test_worker_round_trip_with_canonical_kv_caches(bpc: int) -> None:
    spec = OffloadingSpecFactory.create_spec(
        config({**SPEC, "kvtier_host_bytes": 64 * 4096 * bpc}, bpc=bpc)
    )
    m = spec.get_manager()
    caches, layers = _kv_caches(32)
    w = spec.get_worker(caches)
    keys = [K(i) for i in range(3)]
    out = m.prepare_store(keys, CTX)
    assert out is not None
    blocks = [5, 9, 11, 2, 30, 7][: 3 * bpc]
    before = [t[blocks].clone() for t in layers]
    assert w.submit_store(1, GPULoadStoreSpec(blocks, [len(blocks)], [0]), out.store_spec)
    w.wait({1})
    assert [r.job_id for r in w.get_finished()] == [1]
    m.complete_store(keys, CTX)
    for t in layers:
        t.zero_()
    dst = [1, 2, 3, 4, 5, 6][: 3 * bpc]
    load = m.prepare_load(keys, CTX)
    assert w.submit_load(2, load, GPULoadStoreSpec(dst, [len(dst)], [0]))
    w.wait({2})
    (r,) = w.get_finished()
    assert r.success and r.transfer_size == len(dst) * PAGE
    for t, b in zip(layers, before):
        assert torch.equal(t[dst], b)
    m.complete_load(keys, CTX)
    w.shutdown()
    m.shutdown()


def _tiering(tmp_path: Path, tier: dict[str, Any]) -> Any:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * PAGE,
        "tier_poll_interval_s": 0,
        "secondary_tiers": [tier],
    }
    spec = TieringOffloadingSpec(config(extra))
    return spec, spec.get_manager()


@pytest.mark.parametrize("which", ["disk", "redis"])
def test_vllm_tiering_with_kvtier_secondary_tiers(
    which: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if which == "disk":
        tier = {
            "type": "KVTierDiskTier",
            "module_path": "kvtier.integrations.vllm",
            "path": str(tmp_path / "kv"),
            "capacity_bytes": "16MiB",
        }
    else:
        srv = request.getfixturevalue("redis_standalone")
        tier = {
            "type": "KVTierRedisTier",
            "module_path": "kvtier.integrations.vllm",
            "url": srv.url,
            "namespace": str(uuid.uuid4()),
        }
    spec, m = _tiering(tmp_path, tier)
    view = np.frombuffer(m.primary_tier.get_kv_memoryview(), np.uint8)
    row = len(view) // spec.num_chunks
    keys = [K(i) for i in range(4)]
    with m.lock:
        m.on_new_request(CTX)
        out = m.prepare_store(keys, CTX)
        assert out is not None
        want = {}
        for k, chunk in zip(out.keys_to_store, out.store_spec.block_ids):
            data = np.random.default_rng(int(chunk)).integers(0, 256, row, dtype=np.uint8)
            view[int(chunk) * row : (int(chunk) + 1) * row] = data
            want[k] = data
        m.complete_store(keys, CTX)  # cascades to the kvtier tier
        m.on_request_finished(CTX)
    deadline = time.monotonic() + 20
    while m.has_pending_work() and time.monotonic() < deadline:
        with m.lock:
            m.on_schedule_end(END)
        time.sleep(0.005)
    with m.lock:
        m.reset_cache()
        m.on_reset_flushed()
    results: list[LookupResult] = []
    ctx2 = ReqContext(req_id="r2")
    with m.lock:
        m.on_new_request(ctx2)
    while time.monotonic() < deadline:
        with m.lock:
            results = [m.lookup(k, ctx2) for k in keys]
            m.on_schedule_end(END)
        if all(r is LookupResult.HIT for r in results):
            break
        assert all(
            r in (LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY) for r in results
        ), results
        time.sleep(0.005)
    assert results == [LookupResult.HIT] * 4
    with m.lock:
        load = m.prepare_load(keys, ctx2)
        for k, chunk in zip(keys, load.block_ids):
            got = view[int(chunk) * row : (int(chunk) + 1) * row]
            assert np.array_equal(got, want[k]), "promoted bytes differ"
        m.complete_load(keys, ctx2)
    m.shutdown()
