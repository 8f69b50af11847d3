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


def config(
    extra: dict[str, Any],
    bpc: int = 1,
    world: int = 1,
    rank: int = 0,
    pp: int = 1,
    kv_bytes: int = PAGE,
    engine_id: str | None = None,
    events: bool = True,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=kv_bytes,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id or f"test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world,
            tp_size=world // pp,
            pp_size=pp,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


@pytest.fixture(autouse=True)
def _no_leftover_vllm_regions() -> Any:
    """vLLM's tiering spec maps its primary region from /dev/shm and leaves the
    file behind; remove what a test created."""
    shm = Path("/dev/shm")
    before = set(shm.glob("vllm_offload_test-*"))
    yield
    for f in set(shm.glob("vllm_offload_test-*")) - before:
        f.unlink(missing_ok=True)


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
        ({"kvtier_host_bytes": "1MiB", "kvtier_scan_wait_ms": -1}, "kvtier_scan_wait_ms"),
        ({"kvtier_host_bytes": "1MiB", "kvtier_scan_bytes": "lots"}, "cannot parse size"),
        ({"kvtier_host_bytes": "1MiB", "kvtier_remote_probe": 1}, "kvtier_remote_probe"),
        (
            {"kvtier_host_bytes": "1MiB", "kvtier_lower_writes": "later"},
            "must be one of on_store, on_reuse",
        ),
    ],
)
def test_bad_config_keys_are_clear_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(kvtier.InvalidArgument, match=match):
        OffloadingSpecFactory.create_spec(config({**SPEC, **extra})).get_manager()


@pytest.mark.parametrize("writes", ["on_store", "on_reuse"])
def test_lower_writes_on_reuse_writes_to_disk_on_the_first_reuse(
    tmp_path: Path, writes: str
) -> None:
    """kvtier_lower_writes: on_store writes a block to the disk tier when it
    is stored; on_reuse only once the engine loads it from the host tier."""
    extra = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_disk_path": str(tmp_path / "disk"),
             "kvtier_disk_bytes": "4MiB", "kvtier_lower_writes": writes}  # fmt: skip
    m = OffloadingSpecFactory.create_spec(config(extra)).get_manager()
    inner = m.m
    disk = inner.lower[0]

    def drained() -> int:
        for _ in range(3):  # the step end submits; a later one reaps
            inner.on_schedule_end()
            ids = sorted(disk.jobs.in_flight())
            if ids:
                disk.engine.wait(ids, 5.0)
        return int(disk.stats()["stores"])

    key = b"\1" * 32 + b"\0\0\0\0"
    out = inner.prepare_store([key])
    assert out is not None
    inner.complete_store(out.keys_to_store)
    stored = drained()
    inner.prepare_load([key])
    inner.complete_load([key])
    assert (stored, drained()) == ((1, 1) if writes == "on_store" else (0, 1))
    m.shutdown()


@pytest.mark.parametrize("events", [True, False])
def test_an_engine_without_kv_events_gets_none_from_the_host_tier(
    tmp_path: Path, events: bool
) -> None:
    """vLLM drains the manager's events every step and drops them when the
    engine publishes none (its own manager then makes none): the host tier
    records none, nothing accumulates; the disk tier's are drained as ever."""
    extra = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_disk_path": str(tmp_path),
             "kvtier_disk_bytes": "4MiB"}  # fmt: skip
    m = OffloadingSpecFactory.create_spec(config(extra, events=events)).get_manager()
    inner = m.m
    disk = inner.lower[0]
    for i in range(6):
        out = inner.prepare_store([i.to_bytes(32, "big") + b"\0\0\0\0"])
        assert out is not None
        inner.complete_store(out.keys_to_store)
    for _ in range(3):  # the step end submits the cascade; a later one reaps
        inner.on_schedule_end()
        ids = sorted(disk.jobs.in_flight())
        if ids:
            disk.engine.wait(ids, 5.0)
    assert len(inner._core.events) == (6 if events else 0)
    tiers = [(e.tier, e.removed, len(e.keys)) for e in inner.take_events()]
    assert [t for t in tiers if t[0] == "host"] == ([("host", False, 1)] * 6 if events else [])
    assert sum(n for t, removed, n in tiers if t == "disk" and not removed) == 6
    assert list(m.take_events()) == [] and inner._core.events == []
    m.shutdown()


def test_following_keys_come_from_vllm_req_context_in_prefix_order() -> None:
    """What read-ahead reads: the keys of the same KV-cache group recorded
    after the looked-up one, by end-token position (vLLM fills the positions
    before its first lookup of a request)."""
    from kvtier.integrations.vllm import following_keys

    ctx = ReqContext(req_id="r9")
    other = make_offload_key((5).to_bytes(32, "big"), 1)  # group 1
    for pos, k in [(96, K(3)), (32, K(1)), (64, K(2)), (64, other), (128, K(4))]:
        ctx.set_offload_key_position(k, pos)
    assert following_keys(bytes(K(1)), ctx) == [K(2), K(3), K(4)]
    assert following_keys(K(3), ctx) == [K(4)] and following_keys(K(4), ctx) == []
    assert following_keys(K(7), ctx) == [] and following_keys(K(1), object()) == []
    # Sorted once per request (kept on its context), again when vLLM adds keys.
    from kvtier.integrations.vllm.scheduler import _PrefixOrder

    assert ctx.get_state(_PrefixOrder) is not None
    ctx.set_offload_key_position(K(5), 160)
    assert following_keys(K(3), ctx) == [K(4), K(5)]


def test_lookup_order_reads_a_sliding_window_group_backwards() -> None:
    """vLLM scans a sliding-window group from its last chunk back until a
    window of hits: read-ahead reads the window before the key (and one
    more), nearest first, in one batch; a full-attention group reads on."""
    from kvtier.integrations.vllm.scheduler import LookupOrder

    ctx = ReqContext(req_id="r10")
    swa = [make_offload_key(i.to_bytes(32, "big"), 1) for i in range(8)]
    for i, k in enumerate(swa):
        ctx.set_offload_key_position(k, 32 * (i + 1))
    for i in range(1, 5):
        ctx.set_offload_key_position(K(i), 32 * i)
    order = LookupOrder({(1).to_bytes(4, "big"): 3})
    assert order(swa[6], ctx) == [swa[5], swa[4], swa[3]]
    assert order(swa[1], ctx) == [swa[0]] and order(swa[0], ctx) == []
    assert order(K(2), ctx) == [K(3), K(4)]  # group 0 has no window
    assert order(make_offload_key((99).to_bytes(32, "big"), 1), ctx) == []


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
        # 1 free slot; K(2), K(3) pinned, K(1) in the offer: room for the first new key
        part = m.prepare_store([K(1), K(7), K(8)], CTX)
        assert part is not None and part.keys_to_store == [K(7)] and part.evicted_keys == []
        m.complete_load([K(2), K(3)], CTX)
        out2 = m.prepare_store([K(7), K(8)], CTX)
        assert out2 is not None and len(out2.evicted_keys) == 1
        events = list(m.take_events())
        assert events[0].medium is Medium.CPU and not events[0].removed
        assert any(e.removed for e in events)
        stats = m.get_stats()
        assert stats is not None and "vllm:kv_offload_kvtier_host_busy" in stats.reduce()
        # Nothing changed: no payload for vLLM to ship to the API server.
        assert m.get_stats() is None
        m.m.stats.promotions += 2
        assert m.get_stats().reduce() == {"vllm:kv_offload_kvtier_promotions": 2}
        assert m.get_stats() is None
        # Every reported counter ends get_stats' "nothing changed" shortcut,
        # within the gauges' refresh period too.
        s = m.m.stats
        for name in ("cascades", "cascades_dropped", "allocation_failures", "scan_reads",
                     "fenced_reads", "fenced_failures", "scan_timeouts", "load_failures"):  # fmt: skip
            setattr(s, name, getattr(s, name) + 1)
            assert m.get_stats().reduce() == {f"vllm:kv_offload_kvtier_{name}": 1}, name
        s.scan_waits += 1
        s.scan_wait_s += 0.002
        assert m.get_stats().reduce() == {
            "vllm:kv_offload_kvtier_scan_waits": 1, "vllm:kv_offload_kvtier_scan_wait_us": 2000,
        }  # fmt: skip
        s.loaded_from["disk"] = s.loaded_from.get("disk", 0) + 3
        s.loads += 3
        assert m.get_stats().reduce() == {"vllm:kv_offload_kvtier_loaded_disk": 3}
        assert m.get_stats() is None
        # The disk's and Redis's own reads, failed ones included: a read moves
        # a promotion's counter, or only promotion_failures when it failed.
        from kvtier.integrations.vllm import KVTIER_METRICS

        disk, remote = _CountingTier("disk"), _CountingTier("remote")
        lower, m.m.lower = m.m.lower, [disk, remote]
        try:
            assert m.get_stats() is None
            disk.counters.update(loads=2, load_failures=1)
            s.promotions += 2
            assert m.get_stats().reduce() == {
                "vllm:kv_offload_kvtier_promotions": 2, "vllm:kv_offload_kvtier_disk_reads": 3,
            }  # fmt: skip
            remote.counters["load_failures"] = 1
            s.promotion_failures += 1
            assert m.get_stats().reduce() == {"vllm:kv_offload_kvtier_remote_reads": 1}
            assert set(KVTIER_METRICS) >= {
                "vllm:kv_offload_kvtier_disk_reads", "vllm:kv_offload_kvtier_remote_reads",
            }  # fmt: skip
        finally:
            m.m.lower = lower
    m.shutdown()


class _CountingTier:
    """A lower tier's name and own counters, as the disk and Redis tiers keep them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counters = {"loads": 0, "load_failures": 0}


@pytest.mark.parametrize("int_hashes", [True, False])
def test_removals_named_by_event_id_publish_vllms_block_hash(
    monkeypatch: pytest.MonkeyPatch, int_hashes: bool
) -> None:
    # A disk eviction names its block by event id (the index keeps no key):
    # vLLM's publisher turns it into the same int block hash, and group, as
    # the BlockStored of the full key; in bytes mode, the hash's last 8 bytes.
    from kvtier.integrations.vllm.scheduler import KVTierManager
    from kvtier.tiers.base import TierEvent
    from kvtier.tiers.events import vllm_event_id
    from vllm import envs
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if int_hashes else "0")
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    block_hash = bytes(range(200, 232))
    key = make_offload_key(block_hash, 3)

    class Events:
        def take_events(self) -> list[TierEvent]:
            return [
                TierEvent([key], "disk", False),
                TierEvent([], "disk", True, ids=[vllm_event_id(key)]),
            ]

    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    stored, removed = tracker.take_events(KVTierManager(Events()).take_events())  # type: ignore[arg-type]
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.medium == removed.medium and removed.group_idx == stored.group_idx == 3
    if int_hashes:
        assert removed.block_hashes == stored.block_hashes
        assert removed.block_hashes == [int.from_bytes(block_hash, "big") & (2**64 - 1)]
    else:
        assert removed.block_hashes == [block_hash[-8:]] and stored.block_hashes == [block_hash]


def _steps_until(m: Any, cond: Any, what: str) -> None:
    """Scheduler step ends until ``cond()`` holds (checked under the
    manager's lock); fails after 20 s naming ``what`` it waited for."""
    deadline = time.monotonic() + 20
    while True:
        with m.lock:
            if cond():
                return
            m.on_schedule_end(END)
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _kv_caches(num_blocks: int, n_layers: int = 2) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    # Layers as vLLM hands them over: int8 views (num_blocks, page) per layer.
    layers = [
        torch.randint(-128, 127, (num_blocks, PAGE // 2), dtype=torch.int8) for _ in range(n_layers)
    ]
    tensors = [CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE // 2) for t in layers]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE // 2) for i in range(n_layers)]]
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


def test_a_load_the_forward_pass_waits_for_is_split_and_waited_for_layer_by_layer() -> None:
    spec = OffloadingSpecFactory.create_spec(
        config({**SPEC, "kvtier_host_bytes": 64 * 4096}, kv_bytes=3 * (PAGE // 2))
    )
    m = spec.get_manager()
    caches, layers = _kv_caches(32, n_layers=3)
    w = spec.get_worker(caches)
    # 3 tensors, one per layer; a name the map does not know waits whole.
    w.map_layers([["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]])
    assert w.layers["model.layers.2.attn"] == (0, 2)
    keys = [K(i) for i in range(4)]
    out = m.prepare_store(keys, CTX)
    assert out is not None
    src = [5, 9, 11, 2]
    before = [t[src].clone() for t in layers]
    assert w.submit_store(1, GPULoadStoreSpec(src, [4], [0]), out.store_spec)
    w.wait({1})
    assert [r.job_id for r in w.get_finished()] == [1]
    m.complete_store(keys, CTX)
    for t in layers:
        t.zero_()
    dst = [1, 2, 3, 4]
    w.expedite.add(2)  # KVTierConnector's synchronous load
    assert w.submit_load(2, m.prepare_load(keys, CTX), GPULoadStoreSpec(dst, [4], [0]))
    ours = w._ours[2]
    assert sorted(w._layer_parts[ours]) == [(0, 0), (0, 1), (0, 2)]  # one copy job per layer
    w.wait_layer({2}, "model.layers.0.attn")
    assert torch.equal(layers[0][dst], before[0])
    w.wait_layer({2}, "model.layers.2.attn")
    assert torch.equal(layers[2][dst], before[2])
    w.wait_layer({2}, "lm_head")  # unknown: the whole load
    (r,) = w.get_finished()  # one result for vLLM's job, all its parts' bytes
    assert r.job_id == 2 and r.success and r.transfer_size == len(dst) * 3 * (PAGE // 2)
    for t, b in zip(layers, before):
        assert torch.equal(t[dst], b)
    assert ours not in w._layer_parts
    m.complete_load(keys, CTX)
    # A load nobody waits for layer by layer stays whole.
    assert w.submit_load(3, m.prepare_load(keys, CTX), GPULoadStoreSpec(dst, [4], [0]))
    assert w._ours[3] not in w._layer_parts
    w.wait({3})
    w.get_finished()
    m.complete_load(keys, CTX)
    w.shutdown()
    m.shutdown()


def test_layers_that_do_not_map_one_run_each_keep_whole_loads() -> None:
    spec = OffloadingSpecFactory.create_spec(
        config({**SPEC, "kvtier_host_bytes": 64 * 4096}, kv_bytes=3 * (PAGE // 2))
    )
    w = spec.get_worker(_kv_caches(8, n_layers=3)[0])
    w.map_layers([["a", "b"]])  # 3 tensors over 2 layers
    assert w.layers == {}
    w.shutdown()
    spec = OffloadingSpecFactory.create_spec(config({**SPEC, "kvtier_host_bytes": 64 * 4096}))
    # Two layers aliasing one tensor (copied once): not split either.
    caches, _ = _kv_caches(8, n_layers=2)
    caches.group_data_refs[0].append(caches.group_data_refs[0][0])
    w = spec.get_worker(caches)
    w.map_layers([["a", "b", "c"]])
    assert w.layers == {}
    w.shutdown()
    off = OffloadingSpecFactory.create_spec(
        config({**SPEC, "kvtier_host_bytes": 64 * 4096, "kvtier_layered_loads": False})
    )
    w = off.get_worker(_kv_caches(8, n_layers=2)[0])
    assert w.layered_loads is False
    w.shutdown()


@pytest.mark.timeout(60)
def test_a_load_that_never_lands_is_an_error_naming_vllms_job() -> None:
    """kvtier_transfer_wait_s bounds the worker's waits for its copies: a
    load from a slot whose lower-tier write nobody settles raises
    kvtier.Timeout naming vLLM's job (and the layer the forward pass waited
    for) instead of hanging the worker; once the write settles, it lands."""
    from kvtier.integrations.vllm.host_spec import KVTierSpec

    extra = {**SPEC, "kvtier_host_bytes": 64 * 4096, "kvtier_transfer_wait_s": 0.2}
    spec = OffloadingSpecFactory.create_spec(config(extra))
    caches, layers = _kv_caches(8)
    w = spec.get_worker(caches)
    assert [t.wait_timeout_s for t in w.transfers] == [0.2]
    w.map_layers([["model.layers.0.attn", "model.layers.1.attn"]])
    pool = spec.host_pool()
    pool.view(4)[:] = 9
    armed = pool.arm_fences([4])
    w.expedite.add(41)
    assert w.submit_load(
        41, KVTierSpec(np.array([4]), fences=armed), GPULoadStoreSpec([3], [1], [0])
    )
    late = r"DeviceTransfer: expedited load job \d+ \(host slots 4\) not finished within 0.2 s"
    with pytest.raises(kvtier.Timeout, match=rf"^vLLM's transfer job 41: {late}"):
        w.wait({41})
    with pytest.raises(
        kvtier.Timeout, match=rf"^vLLM's transfer job 41, layer model.layers.1.attn: {late}"
    ):
        w.wait_layer({41}, "model.layers.1.attn")
    assert w.get_finished() == []
    assert pool.settle_fence(4, int(armed[0]), True)
    w.wait({41})
    (r,) = w.get_finished()
    assert r.job_id == 41 and r.success
    assert all(int(t[3].min()) == int(t[3].max()) == 9 for t in layers)
    w.shutdown()


def test_pipeline_stages_get_their_own_pools_sized_by_their_layers() -> None:
    """PP=2 with an uneven split (stage 1 holds twice the layers): each stage
    opens its own pool with slots of its own KV bytes and the same slot count,
    the scheduler's manager hands out slot numbers valid in both, and both
    stages round-trip their bytes through the same slots."""
    eid = f"test-pp-{uuid.uuid4().hex[:8]}"
    extra = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 16}
    specs = [
        OffloadingSpecFactory.create_spec(
            config(extra, world=2, rank=r, pp=2, kv_bytes=PAGE * (r + 1), engine_id=eid)
        )
        for r in (0, 1)
    ]
    assert [s.stage for s in specs] == [0, 1]
    assert [s.slot_bytes for s in specs] == [PAGE, 2 * PAGE]
    assert specs[0].pool_name != specs[1].pool_name
    pools = [s.host_pool() for s in specs]
    assert [(p.num_slots, p.slot_bytes) for p in pools] == [(16, PAGE), (16, 2 * PAGE)]
    m = specs[0].get_manager()  # the scheduler's
    kv = [_kv_caches(8, n_layers=2 * (r + 1)) for r in (0, 1)]
    workers = [s.get_worker(c) for s, (c, _) in zip(specs, kv)]
    keys = [K(i) for i in range(3)]
    out = m.prepare_store(keys, CTX)
    assert out is not None
    before = [[t[[1, 4, 6]].clone() for t in layers] for _, layers in kv]
    for w in workers:
        assert w.submit_store(1, GPULoadStoreSpec([1, 4, 6], [3], [0]), out.store_spec)
        w.wait({1})
        assert [r.success for r in w.get_finished()] == [True]
    m.complete_store(keys, CTX)
    for _, layers in kv:
        for t in layers:
            t.zero_()
    load = m.prepare_load(keys, CTX)
    for w in workers:
        assert w.submit_load(2, load, GPULoadStoreSpec([0, 2, 3], [3], [0]))
        w.wait({2})
        assert [r.success for r in w.get_finished()] == [True]
    for (_, layers), b in zip(kv, before):
        for t, want in zip(layers, b):
            assert torch.equal(t[[0, 2, 3]], want)
    m.complete_load(keys, CTX)
    for w in workers:
        w.shutdown()
    m.shutdown()
    bad = {**SPEC, "kvtier_host_bytes": "1MiB"}
    with pytest.raises(kvtier.InvalidArgument, match="kvtier_num_slots"):
        OffloadingSpecFactory.create_spec(config(bad, world=2, rank=1, pp=2))


@pytest.mark.parametrize(
    ("which", "pp", "promote", "scan"),
    [("disk", 1, True, False), ("disk", 1, False, False), ("disk", 2, True, False),
     ("redis", 1, True, False), ("redis", 2, True, False), ("redis-tls", 1, True, False),
     ("redis-tls", 2, True, False), ("disk", 1, True, True), ("disk", 2, True, True),
     ("redis", 1, True, True), ("redis", 2, True, True)],
)  # fmt: skip
def test_whole_spec_with_a_lower_tier_round_trips_every_stage(
    tmp_path: Path, pp: int, which: str, promote: bool, scan: bool,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """kvtier as the whole spec with a disk or Redis tier, without and with
    pipeline parallelism (uneven stages): store through the workers, cascade,
    reset_cache, lookup gives HIT_PENDING until the promotion lands in every
    stage's pool, then the workers load the original bytes back. Without
    promotion (disk, one stage) the lookup is a HIT at once and the worker
    reads the blocks from disk itself. With read-ahead (``scan``, the default
    kvtier_scan_wait_ms) and vLLM's ReqContext recording the request's keys,
    the first scan reads them all into every stage's pool and answers HIT:
    for Redis, the tier having forgotten them, with GETs straight away (one
    stage) or after an EXISTS check (stages)."""
    eid = f"test-{which}-{uuid.uuid4().hex[:8]}"
    # A namespace of its own: the cases store different bytes under the same
    # keys, which the pool's index (read from the shared server's stream)
    # would otherwise take for one another's.
    extra: dict[str, Any] = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 8,
                             "kvtier_promote": promote, "kvtier_namespace": eid}  # fmt: skip
    if not scan:
        extra["kvtier_scan_wait_ms"] = 0
    else:  # the tier forgets the keys below: no index may know them either
        extra["kvtier_pool_index"] = False
    if which == "disk":
        extra.update(kvtier_disk_path=str(tmp_path / "disk"), kvtier_disk_bytes="4MiB")
    elif which == "redis":
        extra.update(kvtier_remote_url=request.getfixturevalue("redis_standalone").url)
    else:
        srv = request.getfixturevalue("redis_tls")
        extra.update(
            kvtier_remote_url=srv.tls_url,
            kvtier_remote_tls_ca_file=str(srv.tls.ca),
            kvtier_remote_tls_cert_file=str(srv.tls.client_cert),
            kvtier_remote_tls_key_file=str(srv.tls.client_key),
            kvtier_remote_tls_server_name="localhost",
        )
    specs = [
        OffloadingSpecFactory.create_spec(
            config(extra, world=pp, rank=r, pp=pp, kv_bytes=PAGE * (r + 1), engine_id=eid)
        )
        for r in range(pp)
    ]
    kv = [_kv_caches(8, n_layers=2 * (r + 1)) for r in range(pp)]
    workers = [s.get_worker(c) for s, (c, _) in zip(specs, kv)]  # each stage makes its pool
    m = specs[0].get_manager()
    disk = m.m.lower[0]
    keys = [K(i) for i in range(3)]

    def run(job: int, fn: Any) -> None:
        for w in workers:
            assert fn(w)
            w.wait({job})
            assert [r.success for r in w.get_finished()] == [True]

    with m.lock:
        out = m.prepare_store(keys, CTX)
    assert out is not None
    before = [[t[[1, 4, 6]].clone() for t in layers] for _, layers in kv]
    run(1, lambda w: w.submit_store(1, GPULoadStoreSpec([1, 4, 6], [3], [0]), out.store_spec))
    with m.lock:
        m.complete_store(keys, CTX)
    _steps_until(m, lambda: all(disk.lookup(bytes(k)).name == "HIT" for k in keys), "cascade")
    for _, layers in kv:
        for t in layers:
            t.zero_()
    with m.lock:
        m.reset_cache()
        m.on_reset_flushed()
        m.on_schedule_end(END)
        if scan:
            ctx = ReqContext(req_id="r2")
            for n, k in enumerate(keys):
                ctx.set_offload_key_position(k, 32 * (n + 1))
            for t in getattr(disk, "tiers", [disk]):
                if which == "redis":
                    t.known.clear()  # as in another engine: nothing known, RETRY without a check
            assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
            assert m.m.stats.scan_reads == 3 and m.m.stats.lookups["hit"] == 3
            # Redis probes (one round trip); a staged tier checks first (two)
            assert m.m.stats.scan_waits == (2 if which == "redis" and pp > 1 else 1)
            seen = m.get_stats().reduce()  # the engine's counters: waits and time waited
            assert seen["vllm:kv_offload_kvtier_scan_waits"] == m.m.stats.scan_waits
            waited_us = int(m.m.stats.scan_wait_s * 1e6)
            assert seen["vllm:kv_offload_kvtier_scan_wait_us"] == waited_us > 0
        else:
            want = LookupResult.HIT_PENDING if promote else LookupResult.HIT
            assert m.lookup(keys[0], CTX) is want
    _steps_until(m, lambda: all(m.lookup(k, CTX) is LookupResult.HIT for k in keys), "promotion")
    with m.lock:
        load = m.prepare_load(keys, CTX)
        assert (load.stream is None) == promote
        assert m.m.stats.loaded_from == {("disk" if which == "disk" else "remote"): 3}
    run(2, lambda w: w.submit_load(2, load, GPULoadStoreSpec([0, 2, 3], [3], [0])))
    for (_, layers), b in zip(kv, before):
        for t, want in zip(layers, b):
            assert torch.equal(t[[0, 2, 3]], want)
    with m.lock:
        m.complete_load(keys, CTX)
        assert m.m.occupancy()["streaming"] == 0 and m.m.occupancy()["pinned"] == 0
    for w in workers:
        w.shutdown()
    m.shutdown()
    if pp > 1 and which == "disk":
        assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["stage0", "stage1"]


def test_secondary_tier_that_cannot_attach_is_closed(tmp_path: Path) -> None:
    """A kvtier tier built for vLLM's tiering spec that cannot use vLLM's
    primary region is closed (its directory lock let go) before the error
    reaches vLLM: another tier can take the directory at once."""
    from kvtier.integrations.vllm.secondary import _KVTierSecondary
    from kvtier.tiers.disk import DiskTier

    disk = DiskTier(tmp_path, 1 << 20, 4096)
    s = object.__new__(_KVTierSecondary)
    # Rows of 4,000 bytes: too small for a 4 KiB block and its record trailer.
    s._primary_kv_view = memoryview(np.zeros((8, 4000), np.uint8))
    with pytest.raises(kvtier.InvalidArgument, match="cannot hold a disk record"):
        s._attach(disk)
    DiskTier(tmp_path, 1 << 20, 4096).close()  # the directory is free again


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


@pytest.mark.parametrize("which", ["disk", "redis", "redis-tls"])
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
        srv = request.getfixturevalue("redis_standalone" if which == "redis" else "redis_tls")
        tier = {
            "type": "KVTierRedisTier",
            "module_path": "kvtier.integrations.vllm",
            "url": srv.url,
            "namespace": str(uuid.uuid4()),
        }
        if which == "redis-tls":
            tier.update(
                url=srv.tls_url, tls_ca_file=str(srv.tls.ca),
                tls_cert_file=str(srv.tls.client_cert), tls_key_file=str(srv.tls.client_key),
            )  # fmt: skip
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
    _steps_until(m, lambda: not m.has_pending_work(), "cascades")
    with m.lock:
        m.reset_cache()
        m.on_reset_flushed()
    results: list[LookupResult] = []
    ctx2 = ReqContext(req_id="r2")
    with m.lock:
        m.on_new_request(ctx2)
    deadline = time.monotonic() + 20
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


def _namespaces(tmp_path: Path, cfg: OffloadingConfig, tag: str = "ns") -> tuple[str, str]:
    """The namespace of ``cfg``'s blocks in both routes, with the same user
    tag: kvtier as the whole spec (kvtier_namespace) and a KVTierDiskTier
    under vLLM's TieringOffloadingSpec (its ``namespace``; as the tier
    factory is given it)."""
    from dataclasses import replace

    from kvtier.tiers import factory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    given: list[str] = []
    build = factory.build_tier

    def record(options: Any, block_bytes: int, namespace: str, name: Any = None) -> Any:
        given.append(namespace)
        return build(options, block_bytes, namespace, name)

    extra = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 16, "kvtier_namespace": tag}
    whole = OffloadingSpecFactory.create_spec(replace(cfg, extra_config=extra)).namespace
    tier = {"type": "KVTierDiskTier", "module_path": "kvtier.integrations.vllm",
            "path": str(tmp_path / "kv"), "capacity_bytes": "1MiB", "namespace": tag}  # fmt: skip
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * PAGE,
             "tier_poll_interval_s": 0, "secondary_tiers": [tier]}  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(factory, "build_tier", record)
        TieringOffloadingSpec(replace(cfg, extra_config=extra)).get_manager().shutdown()
    (secondary,) = given
    return whole, secondary


def test_one_namespace_for_both_routes_covers_topology_and_group_structure(
    tmp_path: Path,
) -> None:
    """Issue 33: the namespace of the whole spec and of the secondary tiers is
    one function of the same configuration. TP=2 and PP=2 with equal bytes per
    block (different layers in them) never share a disk directory or a Redis,
    in either route; nor do models whose KV-cache groups differ (tokens per
    block, layers per group) though their bytes per block are equal."""
    from dataclasses import replace

    def group(
        tokens: int, layers: int, gid: int = 0, window: int | None = None
    ) -> OffloadingGroupConfig:
        names = tuple(f"g{gid}l{i}" for i in range(layers))
        return OffloadingGroupConfig(tokens_per_block=tokens, layer_names=names, group_id=gid,
                                     sliding_window_size_in_chunks=window)  # fmt: skip

    base = config({})
    cfgs = {
        "tp2": config({}, world=2, pp=1),
        "pp2": config({}, world=2, pp=2),
        "tp1": base,
        "16x3": replace(base, groups=(group(16, 3),)),
        "32x2": replace(base, groups=(group(32, 2),)),
        "16x1+16x1": replace(base, groups=(group(16, 1), group(16, 1, gid=1))),
        # The same groups, the second a sliding window (issue 34): of another model.
        "16x1+16x1w4": replace(base, groups=(group(16, 1), group(16, 1, gid=1, window=4))),
        "16x1+16x1w8": replace(base, groups=(group(16, 1), group(16, 1, gid=1, window=8))),
    }
    got = {name: _namespaces(tmp_path, c) for name, c in cfgs.items()}
    for route in (0, 1):  # whole spec, secondary tier
        assert len({ns[route] for ns in got.values()}) == len(cfgs), (route, got)
    for name, (whole, secondary) in got.items():
        assert whole == secondary, f"{name}: the two routes name the same bytes differently"
    # The same config again: the same namespace; another user tag: another.
    assert _namespaces(tmp_path, config({}, world=2, pp=2)) == got["pp2"]
    assert _namespaces(tmp_path, base, tag="other")[0] != got["tp1"][0]


@pytest.mark.parametrize(
    ("pp", "failure"), [(1, "redis down"), (2, "redis down"), (1, "bad host policy")]
)
def test_get_manager_closes_the_tiers_it_built_when_one_fails(
    tmp_path: Path, pp: int, failure: str
) -> None:
    """Issue 33: building the lower tiers is all or nothing. With a disk tier
    built (holding its directory's lock, one per stage) and then Redis
    refusing the connection, or the host tier's policy unknown, get_manager
    raises that error and the disk tiers are closed: the same directories are
    taken again at once, while the error (and with it the failed call's
    frames) is still alive."""
    import errno

    from kvtier.bench.redis_server import free_port

    def specs(extra: dict[str, Any]) -> list[Any]:
        eid = f"test-build-{uuid.uuid4().hex[:8]}"
        out = [
            OffloadingSpecFactory.create_spec(
                config(extra, world=pp, rank=r, pp=pp, kv_bytes=PAGE * (r + 1), engine_id=eid)
            )
            for r in range(pp)
        ]
        for s in out[1:]:
            s.host_pool()  # the other stage's workers make their pools
        return out

    extra: dict[str, Any] = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 8,
                             "kvtier_disk_path": str(tmp_path / "disk"),
                             "kvtier_disk_bytes": "4MiB"}  # fmt: skip
    bad = dict(extra)
    if failure == "redis down":
        bad["kvtier_remote_url"] = f"redis://127.0.0.1:{free_port()}"
        failed = specs(bad)  # held: a stage's pool lives as long as its spec
        with pytest.raises(kvtier.IoError) as e:
            failed[0].get_manager()
        assert e.value.errno == errno.ECONNREFUSED
    else:
        bad["kvtier_policy"] = "nope"
        failed = specs(bad)
        with pytest.raises(kvtier.InvalidArgument, match="unknown policy") as e:
            failed[0].get_manager()
    again = specs(extra)
    m = again[0].get_manager()  # InUse (EBUSY) while a failed build holds a directory
    assert [t.name for t in m.m.lower] == ["disk"]
    m.shutdown()
    assert e.value is not None  # the failed call's frames lived until here


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    """An 8 MiB tmpfs mounted for this test alone (root only): no test fills a real disk."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_disk_capacity_as_a_share_of_free_space_split_over_stages(small_fs: Path) -> None:
    """``kvtier_disk_bytes: "50%"`` with two pipeline stages: one share of the
    free space, taken before either stage allocates, split by their part of a
    block; a size the file system cannot give is refused before anything is
    allocated."""
    from kvtier.tiers.disk import DiskTier

    eid = f"test-pct-{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {**SPEC, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 4,
                             "kvtier_disk_path": str(small_fs), "kvtier_disk_bytes": "50%"}  # fmt: skip
    specs = [
        OffloadingSpecFactory.create_spec(
            config(extra, world=2, rank=r, pp=2, kv_bytes=PAGE * (r + 1), engine_id=eid)
        )
        for r in range(2)
    ]
    kv = [_kv_caches(4, n_layers=2 * (r + 1)) for r in range(2)]
    workers = [s.get_worker(c) for s, (c, _) in zip(specs, kv)]
    m = specs[0].get_manager()
    tiers = m.m.lower[0].tiers
    assert all(isinstance(t, DiskTier) for t in tiers)
    total = sum(t.num_records * t.record_bytes for t in tiers)
    assert (4 << 20) - 2 * tiers[1].record_bytes < total <= 4 << 20
    assert tiers[1].num_records * tiers[1].block_bytes > tiers[0].num_records * tiers[0].block_bytes
    m.shutdown()
    for w in workers:
        w.shutdown()
    too_big = {**extra, "kvtier_disk_bytes": "64MiB", "kvtier_disk_path": str(small_fs / "b")}
    spec = OffloadingSpecFactory.create_spec(config(too_big))
    worker = spec.get_worker(_kv_caches(4, n_layers=2)[0])
    with pytest.raises(kvtier.NoSpace, match=r"capacity 67108864 B .* 4\.0 MiB free"):
        spec.get_manager()
    worker.shutdown()
    assert list((small_fs / "b").iterdir()) == []


def _store_below(
    m: Any, w: Any, layers: list[torch.Tensor], keys: list[OffloadKey], src: list[int]
) -> list[torch.Tensor]:
    """Store blocks ``src`` as ``keys`` through the worker, wait until the
    first lower tier holds them, then empty vLLM's and the host tier's
    caches; the stored bytes, per layer."""
    with m.lock:
        out = m.prepare_store(keys, CTX)
    assert out is not None
    assert w.submit_store(1, GPULoadStoreSpec(src, [len(src)], [0]), out.store_spec)
    w.wait({1})
    assert [r.success for r in w.get_finished()] == [True]
    before = [t[src].clone() for t in layers]
    lower = m.m.lower[0]
    with m.lock:
        m.complete_store(keys, CTX)
    _steps_until(m, lambda: all(lower.lookup(bytes(k)).name == "HIT" for k in keys), "cascade")
    with m.lock:
        m.reset_cache()
        m.on_reset_flushed()
        m.on_schedule_end(END)
    return before


def _spoil_record(disk: Any, key: OffloadKey) -> None:
    """Change bytes 1000-1003 of ``key``'s record in its slab file, behind
    the disk tier's back."""
    rec, f, off = (int(x) for x in disk.pin_for_read([bytes(key)])[0][0])
    disk.unpin_read([rec])
    with open(disk.paths[f], "r+b") as fh:
        fh.seek(off + 1000)
        fh.write(b"XXXX")


def _streamed_load(m: Any, keys: list[OffloadKey]) -> Any:
    """Look ``keys`` up (all HIT) and prepare their load, every chunk streamed."""
    with m.lock:
        assert [m.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * len(keys)
        load = m.prepare_load(keys, CTX)
    assert load.stream is not None and len(load.stream.index) == len(keys)
    return load


@pytest.mark.parametrize(
    ("which", "reporting"), [("redis", True), ("redis", False), ("disk", True)]
)
def test_reporting_spec_streams_and_reports_a_failed_load_as_its_blocks(
    which: str, reporting: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Under KVTierConnector's spec a Redis or disk hit that finds no
    promotion is read by the worker itself (a HIT at once, streamed); a
    value corrupted on the server (a record on disk) fails its load, which
    finishes with its engine blocks reported for recomputing rather than as
    a failed job (vLLM asserts success); told so, the manager forgets them.
    kvtier's plain spec never lets the worker read Redis."""
    name = "KVTierReportingSpec" if reporting else "KVTierOffloadingSpec"
    extra = {**SPEC, "spec_name": name, "kvtier_host_bytes": "1MiB", "kvtier_num_slots": 8,
             "kvtier_promote": False, "kvtier_scan_wait_ms": 0}  # fmt: skip
    if which == "redis":
        srv = request.getfixturevalue("redis_standalone")
        srv.cli("FLUSHALL")
        extra["kvtier_remote_url"] = srv.url
    else:
        extra.update(kvtier_disk_path=str(tmp_path / "disk"), kvtier_disk_bytes="4MiB")
    spec = OffloadingSpecFactory.create_spec(config(extra))
    caches, layers = _kv_caches(8)
    w = spec.get_worker(caches)
    m = spec.get_manager()
    remote = m.m.lower[0]
    keys = [K(i) for i in range(3)]
    before = _store_below(m, w, layers, keys, [1, 4, 6])
    with m.lock:
        first = m.lookup(keys[0], CTX)
    if not reporting:
        assert first is LookupResult.HIT_PENDING  # promoted through the host tier
        w.shutdown()
        m.shutdown()
        return
    assert first is LookupResult.HIT
    for job, dst, corrupt in ((2, [0, 2, 3], False), (3, [5, 6, 7], True)):
        for t in layers:
            t.zero_()
        if corrupt and which == "redis":  # one value's payload changed: its crc fails
            srv.cli("SETRANGE", remote.server_key(bytes(keys[1])), "1000", "XXXX")
        elif corrupt:  # one record's payload changed in its slab file
            _spoil_record(remote, keys[1])
        load = _streamed_load(m, keys)
        assert w.submit_load(job, load, GPULoadStoreSpec(dst, [3], [0]))
        w.wait({job})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(job, True)]
        assert w.take_load_errors() == (set(dst) if corrupt else set())
        assert w.take_load_errors() == set()  # taken once
        if not corrupt:
            for t, want in zip(layers, before):
                assert torch.equal(t[dst], want)
        with m.lock:
            m.complete_load(keys, CTX)
            if corrupt:  # what KVTierConnector does next: the keys miss from now on
                m.load_failed(load)
                assert m.lookup(keys[0], CTX) is LookupResult.MISS
                assert m.m.stats.load_failures == 3 and remote.counters["load_failures"] == 3
                if which == "disk":  # the records went from the index
                    assert [remote.lookup(bytes(k)).name for k in keys] == ["MISS"] * 3
    w.shutdown()
    m.shutdown()


def test_kvtier_connector_names_its_own_spec() -> None:
    """KVTierConnector fills in kvtier's reporting spec and refuses another."""
    from types import SimpleNamespace

    from kvtier.errors import InvalidArgument
    from kvtier.integrations.vllm.connector import _use_kvtier_spec

    def cfg(extra: dict[str, Any]) -> Any:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    c = cfg({"kvtier_host_bytes": "1GiB"})
    _use_kvtier_spec(c)
    extra = c.kv_transfer_config.kv_connector_extra_config
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "KVTierReportingSpec", "kvtier.integrations.vllm",
    )  # fmt: skip
    _use_kvtier_spec(c)  # again (scheduler and worker each build one): unchanged
    with pytest.raises(InvalidArgument, match="drop spec_name and spec_module_path"):
        _use_kvtier_spec(cfg({"spec_name": "CPUOffloadingSpec", "spec_module_path": "vllm.x"}))


def test_sync_loads_budget_and_fresh_blocks() -> None:
    """KVTierConnector's loads within the step (its own under vLLM 0.32): the
    budget as bytes, a step's reservations, and the blocks 0.32's load
    planning is shown (past what the engine computed itself: no hash)."""
    from types import SimpleNamespace

    from kvtier.errors import InvalidArgument
    from kvtier.integrations.vllm.connector import _FreshBlocks, _SyncLoads, sync_load_budget

    assert sync_load_budget({}) == 64 << 20
    assert sync_load_budget({"sync_load_budget_bytes": "1MiB"}) == 1 << 20
    assert sync_load_budget({"sync_load_budget_bytes": 0}) == 0
    for bad in ("lots", -1, True):
        with pytest.raises(InvalidArgument, match="sync_load_budget_bytes"):
            sync_load_budget({"sync_load_budget_bytes": bad})

    def req(rid: str, tokens: int) -> Any:
        return SimpleNamespace(request_id=rid, num_tokens=tokens)

    s = _SyncLoads(budget=1000, bytes_per_token=2)
    assert s.reserve(req("a", 400), 0, 300)  # 600 bytes
    assert not s.reserve(req("b", 400), 0, 300)  # 1,200 would pass the budget
    assert not s.reserve(req("c", 300), 0, 300)  # nothing left to compute
    assert not s.reserve(req("e", 400), 0, 10, may_fail=True)  # a fenced fill or a stream
    assert s.reserve(req("d", 300), 32, 150)  # 300 more: 900
    assert s.requests == {"a", "d"}
    s.jobs.update({7, 9})
    assert s.end_step() == {7, 9}
    assert (s.requests, s.jobs, s.used) == (set(), set(), 0)
    assert s.reserve(req("b", 400), 0, 300)  # a new step's budget

    def block(i: int) -> Any:
        return SimpleNamespace(block_id=i, is_null=i == 0, block_hash=b"h%d" % i)

    blocks = SimpleNamespace(
        blocks=([block(i) for i in (1, 2, 3, 4)], [block(i) for i in (0, 5, 6, 7)])
    )
    groups = [SimpleNamespace(group_idx=0, tokens_per_block=32),
              SimpleNamespace(group_idx=1, tokens_per_block=32)]  # fmt: skip
    fresh = _FreshBlocks(blocks, 64, groups)
    assert [b.block_hash for b in fresh.blocks[0]] == [b"h1", b"h2", None, None]
    assert [(b.block_id, b.is_null, b.block_hash) for b in fresh.blocks[1][2:]] == [
        (6, False, None), (7, False, None)
    ]  # fmt: skip
    assert fresh.blocks[1][0].is_null


def test_reporting_spec_a_failed_streamed_store_to_redis_finishes(tmp_path: Path) -> None:
    """Under KVTierConnector's spec blocks that find no host slot are written
    to Redis by the worker itself; with the server gone that write fails,
    and the store still finishes (nothing of it is readable: a later read
    misses or fails its check and is recomputed) instead of failing a job
    vLLM asserts never fails. No load error is reported for it."""
    from kvtier.bench.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis")
    try:
        extra = {**SPEC, "spec_name": "KVTierReportingSpec", "kvtier_host_bytes": "1MiB",
                 "kvtier_num_slots": 1, "kvtier_scan_wait_ms": 0,
                 "kvtier_remote_url": srv.url}  # fmt: skip
        spec = OffloadingSpecFactory.create_spec(config(extra))
        caches, _ = _kv_caches(8)
        w = spec.get_worker(caches)
        m = spec.get_manager()
        keys = [K(i) for i in range(3)]
        with m.lock:
            out = m.prepare_store(keys, CTX)
        assert out is not None and len(out.keys_to_store) == 3
        assert list(out.store_spec.slots) == [0, -1, -1]  # two go straight to Redis
        srv.kill()
        assert w.submit_store(1, GPULoadStoreSpec([1, 4, 6], [3], [0]), out.store_spec)
        w.wait({1})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
        assert w.take_load_errors() == set()
        w.shutdown()
    finally:
        srv.stop()


def test_replicated_mla_layout_is_stored_once_written_by_rank0_read_by_every_rank() -> None:
    """MLA under tensor parallelism (emulated: two ranks of one engine in
    this process): every rank holds the same latent, so a slot holds one
    cell, only rank 0's bytes are written, and rank 1 loads rank 0's bytes;
    the blocks' namespace is the one a TP=1 engine uses."""
    from dataclasses import replace

    engine = f"test-{uuid.uuid4().hex[:8]}"
    extra = {**SPEC, "kvtier_host_bytes": 64 * PAGE}
    specs = [
        OffloadingSpecFactory.create_spec(
            replace(config(dict(extra), world=2, rank=r, engine_id=engine), replicated_layout=True)
        )
        for r in (0, 1)
    ]
    tp1 = OffloadingSpecFactory.create_spec(replace(config(dict(extra)), replicated_layout=True))
    per_rank = OffloadingSpecFactory.create_spec(config(dict(extra), world=2))
    assert specs[0].namespace == specs[1].namespace == tp1.namespace != per_rank.namespace
    assert specs[0].slot_bytes == PAGE and per_rank.slot_bytes == 2 * PAGE
    m = specs[0].get_manager()
    (c0, l0), (c1, l1) = _kv_caches(16), _kv_caches(16)
    w0, w1 = specs[0].get_worker(c0), specs[1].get_worker(c1)
    keys = [K(i) for i in range(3)]
    out = m.prepare_store(keys, CTX)
    assert out is not None
    blocks = [3, 7, 9]
    want = [t[blocks].clone() for t in l0]
    for job, w in ((1, w0), (2, w1)):
        assert w.submit_store(job, GPULoadStoreSpec(blocks, [3], [0]), out.store_spec)
        w.wait({job})
        assert [r.success for r in w.get_finished()] == [True]
    m.complete_store(keys, CTX)
    for t in l0 + l1:
        t.zero_()
    load = m.prepare_load(keys, CTX)
    dst = [1, 2, 4]
    for job, w in ((3, w0), (4, w1)):
        assert w.submit_load(job, load, GPULoadStoreSpec(dst, [3], [0]))
        w.wait({job})
        assert [r.success for r in w.get_finished()] == [True]
    for layers in (l0, l1):
        for t, b in zip(layers, want):
            assert torch.equal(t[dst], b)
    m.complete_load(keys, CTX)
    for w in (w0, w1):
        w.shutdown()
    m.shutdown()


@pytest.mark.parametrize(
    ("mla", "cpu", "prefix_caching", "refused"),
    [(True, True, False, True), (True, True, True, False), (True, False, False, False),
     (False, True, False, False)],
)  # fmt: skip
def test_check_engine_refuses_mla_only_where_vllm_turned_prefix_caching_off(
    monkeypatch: pytest.MonkeyPatch, mla: bool, cpu: bool, prefix_caching: bool, refused: bool
) -> None:
    from types import SimpleNamespace

    import vllm.platforms
    from kvtier.integrations.vllm import check_engine

    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: cpu))
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )
    if refused:
        with pytest.raises(kvtier.UnsupportedEngine, match="cannot use offloaded KV for an MLA"):
            check_engine(cfg)
    else:
        check_engine(cfg)


def test_a_streamed_disk_load_waited_for_by_layer_reads_ranges_and_reports_a_bad_record(
    tmp_path: Path,
) -> None:
    """A disk hit streamed by the worker within the step (KVTierConnector's
    synchronous load, ``expedite``) is read range by range in layer order:
    each layer's wait returns once that layer's bytes are in, byte for
    byte. A record changed on disk has its first layer copied before the
    record's check (by its last range) fails: the load finishes with its
    engine blocks reported for recomputing (vLLM then drops that step's
    output of the request)."""
    extra = {**SPEC, "spec_name": "KVTierReportingSpec", "kvtier_host_bytes": "1MiB",
             "kvtier_num_slots": 8, "kvtier_promote": False, "kvtier_scan_wait_ms": 0,
             "kvtier_disk_path": str(tmp_path / "disk"), "kvtier_disk_bytes": "8MiB"}  # fmt: skip
    spec = OffloadingSpecFactory.create_spec(config(extra, bpc=8))
    caches, layers = _kv_caches(64)
    w = spec.get_worker(caches)
    w.map_layers([["l0", "l1"]])
    m = spec.get_manager()
    disk = m.m.lower[0]
    keys = [K(i) for i in range(3)]
    before = _store_below(m, w, layers, keys, list(range(40, 64)))
    for job, corrupt in ((2, False), (3, True)):
        for t in layers:
            t.zero_()
        if corrupt:  # the second record's first layer changed in its slab file
            _spoil_record(disk, keys[1])
        load = _streamed_load(m, keys)
        dst = list(range(24))
        w.expedite.add(job)
        assert w.submit_load(job, load, GPULoadStoreSpec(dst, [24], [0]))
        for i, name in enumerate(("l0", "l1")):
            w.wait_layer({job}, name)
            if not corrupt:
                assert torch.equal(layers[i][dst], before[i])
        w.wait({job})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(job, True)]
        assert w.take_load_errors() == (set(dst) if corrupt else set())
        assert w._stream is not None
        assert [len(p.ranges) for p in w._stream._plans.values()] == [2]  # read by ranges
        if not corrupt:
            for t, want in zip(layers, before):
                assert torch.equal(t[dst], want)
        with m.lock:
            m.complete_load(keys, CTX)
            if corrupt:
                m.load_failed(load)
    w.shutdown()
    m.shutdown()
