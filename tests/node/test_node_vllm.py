"""Two vLLM 0.33 engines' kvtier shims attached to one node (``kvtier_node``):
engine B's worker loads into its own KV cache what engine A's worker stored
from its own, through the node's pool, byte for byte; another model shares
the node's memory but never a key."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base")
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).parent))
from kvtier.errors import InvalidArgument
from test_node import Node, _remove_pools
from test_vllm import CTX, END, PAGE, SPEC, K, _kv_caches, config
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult
from vllm.v1.kv_offload.factory import OffloadingSpecFactory


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, blocks=64)
    yield n
    n.stop()
    _remove_pools(n.name)


def _engine(node: Node, model_dtype: str = "bfloat16") -> tuple[object, object, list, object]:
    cfg = config({**SPEC, "kvtier_node": node.path})
    if model_dtype != "bfloat16":
        import dataclasses

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=model_dtype))
    spec = OffloadingSpecFactory.create_spec(cfg)
    m = spec.get_manager()
    caches, layers = _kv_caches(32)
    w = spec.get_worker(caches)
    return spec, m, layers, w


def test_engine_b_loads_into_its_kv_cache_what_engine_a_stored(node: Node) -> None:
    _, ma, la, wa = _engine(node)
    _, mb, lb, wb = _engine(node)
    keys = [K(i) for i in range(3)]
    assert mb.lookup(keys[0], CTX) is LookupResult.MISS
    out = ma.prepare_store(keys, CTX)
    assert out is not None and list(out.keys_to_store) == keys
    src = [5, 9, 11]
    assert wa.submit_store(1, GPULoadStoreSpec(src, [3], [0]), out.store_spec)
    wa.wait({1})
    ma.complete_store(keys, CTX)
    ma.on_schedule_end(END)
    assert [mb.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 3
    dst = [1, 2, 3]
    load = mb.prepare_load(keys, CTX)
    assert wb.submit_load(2, load, GPULoadStoreSpec(dst, [3], [0]))
    wb.wait({2})
    (r,) = wb.get_finished()
    assert r.success and r.transfer_size == 3 * PAGE
    for a, b in zip(la, lb):
        assert torch.equal(b[dst], a[src])
    mb.complete_load(keys, CTX)
    mb.on_schedule_end(END)
    st = node.status()
    assert len(st["engines"]) == 2 and len(st["namespaces"]) == 1
    for w, m in ((wa, ma), (wb, mb)):
        w.shutdown()
        m.shutdown()


def test_another_model_on_the_node_never_sees_a_key(node: Node) -> None:
    _, ma, _, wa = _engine(node)
    _, mb, _, wb = _engine(node, model_dtype="float16")
    keys = [K(7)]
    out = ma.prepare_store(keys, CTX)
    assert wa.submit_store(1, GPULoadStoreSpec([4], [1], [0]), out.store_spec)
    wa.wait({1})
    ma.complete_store(keys, CTX)
    ma.on_schedule_end(END)
    assert mb.lookup(keys[0], CTX) is LookupResult.MISS
    assert len(node.status()["namespaces"]) == 2
    for w, m in ((wa, ma), (wb, mb)):
        w.shutdown()
        m.shutdown()


def test_tiers_belong_to_the_node_not_the_engine(node: Node, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="node owns the disk"):
        OffloadingSpecFactory.create_spec(
            config({**SPEC, "kvtier_node": node.path, "kvtier_disk_path": str(tmp_path / "d")})
        )
