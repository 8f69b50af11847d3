"""A hybrid (attention + Mamba) model's KV cache built from vLLM's own
classes, and the checks of kvtier's shim on it, free of pytest so that the
engine's Python (vLLM 0.32, no pytest there) runs them too:
``python tests/integration/vllm_hybrid_case.py`` prints ``ok``.

The layout is vLLM's for such a model with prefix caching on: one attention
group and one Mamba group (``mamba_cache_mode`` "align": a state per block,
taken at the block's last token), each of two layers, the attention layer
and the Mamba layer of a pair sharing one tensor (vLLM pads the Mamba page
to the attention page so both groups draw blocks from one pool).

Who calls: tests/integration/test_vllm_hybrid.py, in-process (vLLM 0.33)
and as a child process of the engine's Python (0.32). Blocks: the copies.
"""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

BLOCK = 32  # tokens per block, both groups (align mode: mamba_block_size = block_size)
NUM_BLOCKS = 24
ATTN = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
PAGE = ATTN.page_size_bytes  # 32 KiB
# Mamba2 state of one layer: conv (conv_dim x (kernel - 1)) and SSM (heads x head_dim x state).
MAMBA = MambaSpec(
    block_size=BLOCK,
    shapes=((288, 3), (8, 32, 16)),
    dtypes=(torch.float32, torch.float32),
    page_size_padded=PAGE,
    mamba_cache_mode="align",
)
STATE = dataclasses.replace(MAMBA, page_size_padded=None).page_size_bytes  # 19,840 B
ATTN_LAYERS = ("model.layers.2.mixer", "model.layers.6.mixer")
MAMBA_LAYERS = ("model.layers.0.mixer", "model.layers.4.mixer")
# One rank, no parallelism of any kind.
ONE_RANK: dict[str, Any] = {
    **dict.fromkeys(("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size"), 1),
    **dict.fromkeys(("rank", "data_parallel_index"), 0),
    "data_parallel_size": 1, "data_parallel_rank_local": None, "is_parallelism_agnostic": False,
}  # fmt: skip
SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}


def kv_cache_config() -> KVCacheConfig:
    """vLLM's KVCacheConfig of the hybrid model: two groups overlaying one
    allocation (layer-outermost), a block owned by one group at a time."""
    size = len(ATTN_LAYERS) * PAGE * NUM_BLOCKS
    tensors = [
        KVCacheTensor(
            size=size, layers=list(names), layer_stride=PAGE * NUM_BLOCKS, block_stride=PAGE
        )
        for names in (ATTN_LAYERS, MAMBA_LAYERS)
    ]
    groups = [
        KVCacheGroupSpec(layer_names=list(ATTN_LAYERS), kv_cache_spec=ATTN),
        KVCacheGroupSpec(layer_names=list(MAMBA_LAYERS), kv_cache_spec=MAMBA),
    ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups)


def mamba_window_in_chunks(tokens_per_chunk: int) -> int | None:
    """vLLM's window of the Mamba group in offloaded chunks (0.33 keeps the
    function in the connector's config module, 0.32 in its scheduler)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_sliding_window_size_in_chunks,
        )
    except ImportError:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            get_sliding_window_size_in_chunks,
        )
    return get_sliding_window_size_in_chunks(MAMBA, tokens_per_chunk)  # type: ignore[no-any-return]


def offloading_config(extra: dict[str, Any]) -> OffloadingConfig:
    """vLLM's OffloadingConfig of the hybrid model, as build_offloading_config
    makes it (0.33 also names each group's window: 1 chunk for Mamba)."""
    has_window = "sliding_window_size_in_chunks" in {
        f.name for f in dataclasses.fields(OffloadingGroupConfig)
    }
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=BLOCK,
            layer_names=names,
            group_id=gid,
            **({"sliding_window_size_in_chunks": window} if has_window else {}),
        )
        for gid, names, window in ((0, ATTN_LAYERS, None), (1, MAMBA_LAYERS, 1))
    )
    cfg = kv_cache_config()
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=cfg.kv_cache_tensors[0].size // cfg.num_blocks,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"hybrid-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny-hybrid", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(**ONE_RANK),
    )


def _vllm_config() -> Any:
    """What vLLM's connector worker reads of the engine's config (one rank)."""
    par = SimpleNamespace(
        tensor_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1,
        cp_kv_cache_interleave_size=1, world_size=1, rank=0,
    )  # fmt: skip
    model = SimpleNamespace(get_total_num_kv_heads=lambda: ATTN.num_kv_heads, use_mla=False)
    return SimpleNamespace(parallel_config=par, model_config=model)


def check_groups() -> None:
    """vLLM offloads the Mamba group (its state per block is prefix-cacheable)
    as a window of one chunk: a prefix needs the state at its last block."""
    assert get_offloading_group_ids(kv_cache_config()) == (0, 1)
    assert mamba_window_in_chunks(BLOCK) == 1
    assert STATE < PAGE  # the padded tail is not state


def check_round_trip() -> None:
    """A three-chunk prefix through kvtier's host tier as vLLM's offloading
    connector hands it over: every attention block and the Mamba group's
    last block (its window), registered by vLLM's own connector worker
    (the two groups alias one allocation). Loaded into other blocks, the
    attention pages and each Mamba layer's state are bitwise those stored,
    and nothing past the state (the padding) is written."""
    spec = OffloadingSpecFactory.create_spec(
        offloading_config({**SPEC, "kvtier_host_bytes": "4MiB"})
    )
    backing = torch.randint(-128, 127, (len(ATTN_LAYERS) * PAGE * NUM_BLOCKS,), dtype=torch.int8)
    views = [backing[i * PAGE * NUM_BLOCKS : (i + 1) * PAGE * NUM_BLOCKS].view(NUM_BLOCKS, PAGE)
             for i in range(len(ATTN_LAYERS))]  # fmt: skip
    kv_caches = {**dict(zip(ATTN_LAYERS, views)), **dict(zip(MAMBA_LAYERS, views))}
    cw = OffloadingConnectorWorker(spec, _vllm_config(), kv_cache_config())
    cw.register_kv_caches(kv_caches)  # type: ignore[arg-type]
    worker, manager = cw.worker, spec.get_manager()
    assert worker is not None
    ctx = ReqContext(req_id="r1")
    hashes = [i.to_bytes(32, "big") for i in (11, 12, 13)]
    keys = [make_offload_key(h, 0) for h in hashes] + [make_offload_key(hashes[-1], 1)]
    src_attn, src_mamba = [5, 9, 11], 13
    src = GPULoadStoreSpec(src_attn + [src_mamba], [3, 1], [0, 2])
    stored = manager.prepare_store(keys, ctx)
    assert stored is not None and list(stored.keys_to_store) == keys
    want_attn = [v[src_attn].clone() for v in views]
    want_state = [v[src_mamba, :STATE].clone() for v in views]
    assert worker.submit_store(1, src, stored.store_spec)
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_store(keys, ctx)
    backing.zero_()
    dst_attn, dst_mamba = [1, 2, 3], 4
    load = manager.prepare_load(keys, ctx)
    assert worker.submit_load(2, load, GPULoadStoreSpec(dst_attn + [dst_mamba], [3, 1], [0, 2]))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    for v, attn, state in zip(views, want_attn, want_state):
        assert torch.equal(v[dst_attn], attn)
        assert torch.equal(v[dst_mamba, :STATE], state)
        assert not v[dst_mamba, STATE:].any(), "bytes past the Mamba state were written"
    manager.complete_load(keys, ctx)
    worker.shutdown()
    manager.shutdown()


if __name__ == "__main__":
    check_groups()
    check_round_trip()
    print("ok")
