"""SGLang on the node cache: kvtier's HiCache backend with ``kvtier_node``
keeps its pages in the node (no tiers of the rank's own), shared with other
SGLang ranks and engines of the same model and with vLLM engines beside
it, never across models; a node that goes away fails pages, not the caller.

Against SGLang's own storage classes and stand-in host pools whose page
methods are SGLang's code (kvtier.bench.sglang_standin); the node runs in a
thread of the test, or as ``kvtier node`` in a child when it is killed."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (make venv installs sglang==0.5.23 --no-deps)",
)
torch = pytest.importorskip("torch")

from kvtier.bench.sglang_standin import fill, host_pool, page_bytes, token_indices  # noqa: E402
from kvtier.errors import InvalidArgument  # noqa: E402
from kvtier.node import client_link as node_link  # noqa: E402
from kvtier.node.client import NodeManager  # noqa: E402
from kvtier.node.connection import NodeUnavailable  # noqa: E402
from kvtier.tiers.base import LookupResult  # noqa: E402
from test_node import BLOCK, NS_A, Node, _node_proc, _remove_pools, content, store  # noqa: E402

MHA_PAGE = 32768  # bytes of a stand-in MHA page (16 tokens)
PAGES = 32  # the node's room, in MHA pages


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, blocks=PAGES * MHA_PAGE // BLOCK)
    yield n
    n.stop()
    _remove_pools(n.name)


def _engine(sglang_open: Any, path: str, seed: int, pages: int = 48, **config: Any) -> Any:
    """(pool, backend): a stand-in SGLang rank's host pool of random pages
    (``seed``) and kvtier's backend on the node at ``path``."""
    pool = host_pool("mla" if config.get("mla") else "mha", "page_first", pages=pages)
    fill(pool, seed)
    return pool, sglang_open({"backend_name": "kvtier", "interface_v1": 1, "kvtier_node": path},
                             pool, **config)  # fmt: skip


def test_engine_b_loads_byte_for_byte_the_pages_engine_a_stored(
    node: Node, sglang_open: Any
) -> None:
    pa, a = _engine(sglang_open, node.path, 1)
    pb, b = _engine(sglang_open, node.path, 2)
    keys = [f"p{i}" for i in range(8)]
    assert a.batch_set_v1(keys, token_indices(pa, 0, 8)) == [True] * 8
    assert b.batch_exists(keys) == 8 and b.batch_exists(["nope", *keys]) == 0
    assert page_bytes(pb, 20) != page_bytes(pa, 2)
    assert b.batch_get_v1(keys[2:], token_indices(pb, 20, 6)) == [True] * 6
    assert [page_bytes(pb, 20 + i) for i in range(6)] == [page_bytes(pa, i) for i in range(2, 8)]
    # The key-value fallback reads the same page; a store of it again holds.
    got = b.get("p3", pb.get_dummy_flat_data_page())
    assert bytes(got.view(torch.uint8).numpy()) == page_bytes(pa, 3)
    assert a.batch_set_v1(keys[:4], token_indices(pa, 0, 4)) == [True] * 4
    st = b.kvtier_stats()["kv"]
    assert (st["pages_stored"], st["pages_loaded"], st["attached"]) == (0, 6, True)
    occ = node.status()["classes"][str(MHA_PAGE)]["occupancy"]
    assert (occ["blocks"], occ["pinned"], occ["writing"]) == (8, 0, 0)


def test_existence_is_per_page_and_a_missing_page_stays_untouched(
    node: Node, sglang_open: Any
) -> None:
    pa, a = _engine(sglang_open, node.path, 3)
    assert a.batch_set_v1(["k0", "k2"], torch_pages(pa, [0, 2])) == [True, True]
    assert a._mover().exists([b"k0", b"k1", b"k2"]) == [True, False, True]
    assert a.batch_exists(["k0", "k1", "k2"]) == 1
    before = page_bytes(pa, 31)
    got = a.batch_get_v1(["k0", "k1", "k2"], torch_pages(pa, [30, 31, 32]))
    assert got == [True, False, True]
    assert page_bytes(pa, 30) == page_bytes(pa, 0) and page_bytes(pa, 32) == page_bytes(pa, 2)
    assert page_bytes(pa, 31) == before


def test_the_mover_populates_the_node_pool_in_the_background(node: Node, sglang_open: Any) -> None:
    """Its first copies fault no page of the node's pool (untouched, one
    fault a 16 pages): the mover entered them in the background when it
    attached."""
    import resource

    _, a = _engine(sglang_open, node.path, 3)
    m = a._mover()
    m.populating.join(30)
    data = m.pool.view(0, m.pool.num_slots)
    pages = data.nbytes // 4096
    assert pages >= 256
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    data[:, ::4096] = data[:, ::4096].copy()  # a byte a page, as a copy touches
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < pages // 32, faults


def torch_pages(pool: Any, pages: list[int]) -> Any:
    return torch.cat([token_indices(pool, p, 1) for p in pages])


def test_models_and_block_sizes_never_share_a_page(tmp_path: Path, sglang_open: Any) -> None:
    n = Node(tmp_path, blocks=2 * PAGES * MHA_PAGE // BLOCK, max_classes=2)
    try:
        pa, a = _engine(sglang_open, n.path, 4)
        po, other = _engine(sglang_open, n.path, 5, model="org/other")
        keys = [f"s{i}" for i in range(4)]
        assert a.batch_set_v1(keys, token_indices(pa, 0, 4)) == [True] * 4
        assert other.batch_exists(keys) == 0
        assert other.batch_get_v1(keys, token_indices(po, 0, 4)) == [False] * 4
        # A vLLM engine on the same node: a block size of its own, and
        # SGLang's page keys are never its keys.
        v = NodeManager(n.path, NS_A, BLOCK, engine="vllm")
        vpool = v.attach_pool()
        # One region, each block size its own slots of it.
        assert v.pool["pool"] == a._mover().pool.name
        assert (vpool.slot_bytes, a._mover().pool.slot_bytes) == (BLOCK, MHA_PAGE)
        vkeys = store(v, vpool, [0, 1])
        assert [v.lookup(k + b"\0\0\0\0") for k in (b"s0", b"s1")] == [LookupResult.MISS] * 2
        assert a.batch_exists(["s0", "s1", "s2", "s3"]) == 4
        v.on_schedule_end()
        assert v.lookup(vkeys[0]) is LookupResult.HIT
        spec = v.prepare_load(vkeys[:1])
        assert np.array_equal(vpool.view(int(spec.slots[0])), content(0))
        v.complete_load(vkeys[:1])
        v.shutdown()
        with pytest.raises(InvalidArgument, match="serves 2 block size"):
            _engine(sglang_open, n.path, 6, mla=True)  # a third block size
    finally:
        n.stop()
        _remove_pools(n.name)


def test_mla_pages_are_written_by_one_rank_for_every_rank(node: Node, sglang_open: Any) -> None:
    p0, r0 = _engine(sglang_open, node.path, 7, mla=True, tp_rank=0, tp_size=2)
    p1, r1 = _engine(sglang_open, node.path, 8, mla=True, tp_rank=1, tp_size=2)
    keys = [f"m{i}" for i in range(4)]
    assert r1.batch_set_v1(keys, token_indices(p1, 0, 4)) == [True] * 4  # the writer's job
    assert r1.batch_exists(keys) == 0
    assert r0.batch_set_v1(keys, token_indices(p0, 0, 4)) == [True] * 4
    assert r1.batch_get_v1(keys, token_indices(p1, 10, 4)) == [True] * 4
    assert [page_bytes(p1, 10 + i) for i in range(4)] == [page_bytes(p0, i) for i in range(4)]


def test_stores_and_loads_from_two_threads_at_once(node: Node, sglang_open: Any) -> None:
    """SGLang's backup thread stores while its prefetch thread loads."""
    pool, s = _engine(sglang_open, node.path, 9, pages=64)
    first = [f"t{i}" for i in range(8)]
    assert s.batch_set_v1(first, token_indices(pool, 0, 8)) == [True] * 8
    results: dict[str, list[list[bool]]] = {"set": [], "get": []}

    def writer() -> None:
        # 16 keys of its own, stored twice: with the reader's 8, 24 pages in
        # the node's 32 (nothing evicted whichever thread runs first).
        for r in range(8):
            keys = [f"w{r % 4}-{i}" for i in range(4)]
            results["set"].append(s.batch_set_v1(keys, token_indices(pool, 16, 4)))

    def reader() -> None:
        for _ in range(8):
            results["get"].append(s.batch_get_v1(first, token_indices(pool, 32, 8)))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"set": [[True] * 4] * 8, "get": [[True] * 8] * 8}
    assert [page_bytes(pool, 32 + i) for i in range(8)] == [page_bytes(pool, i) for i in range(8)]
    assert s.batch_exists([f"w{r}-{i}" for r in range(4) for i in range(4)]) == 16
    occ = node.status()["classes"][str(MHA_PAGE)]["occupancy"]
    assert (occ["pinned"], occ["writing"]) == (0, 0)


def test_the_node_owns_the_tiers_and_must_be_there(tmp_path: Path, sglang_open: Any) -> None:
    pool = host_pool("mha", "page_first", pages=4)
    bad = {"kvtier_node": str(tmp_path / "n.sock"), "kvtier_disk_path": str(tmp_path / "d"),
           "kvtier_disk_bytes": "64MiB"}  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"kvtier_node: the node owns .*\(kvtier_disk_path\)"):
        sglang_open(bad, pool)
    with pytest.raises(NodeUnavailable, match="no kvtier node at"):
        sglang_open({"kvtier_node": str(tmp_path / "n.sock")}, pool)


def test_a_killed_node_fails_pages_not_sglang_and_is_reattached(
    tmp_path: Path, sglang_open: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_link, "REATTACH_PERIOD_S", 0.05)
    path, name = str(tmp_path / "n.sock"), f"t{int(time.time() * 1e6)}-sg"
    p = _node_proc(path, name, PAGES * MHA_PAGE)
    try:
        pool, s = _engine(sglang_open, path, 10)
        keys = [f"r{i}" for i in range(4)]
        assert s.batch_set_v1(keys, token_indices(pool, 0, 4)) == [True] * 4
        p.send_signal(signal.SIGKILL)
        p.wait()
        before = page_bytes(pool, 20)
        assert s.batch_exists(keys) == 0
        assert s.batch_get_v1(keys, token_indices(pool, 20, 4)) == [False] * 4
        assert page_bytes(pool, 20) == before
        assert s.batch_set_v1(["x0"], token_indices(pool, 5, 1)) == [False]
        st = s.kvtier_stats()["kv"]
        assert st["attached"] is False and st["node_failures"] >= 1
        p = _node_proc(path, name, PAGES * MHA_PAGE)  # adopts the pool this rank maps
        time.sleep(0.06)
        assert s.batch_set_v1(keys, token_indices(pool, 0, 4)) == [True] * 4
        assert s.batch_get_v1(keys, token_indices(pool, 20, 4)) == [True] * 4
        assert [page_bytes(pool, 20 + i) for i in range(4)] == [
            page_bytes(pool, i) for i in range(4)
        ]
        assert s.kvtier_stats()["kv"]["reattaches"] == 1
    finally:
        p.kill()
        p.wait()
        _remove_pools(name)


def test_pages_asked_about_or_loaded_leave_nothing_held_at_the_node(
    node: Node, sglang_open: Any
) -> None:
    """SGLang never ends a scheduler step at the node: its existence checks
    and loads must leave nothing pinned or remembered for a step end that
    never comes (the node's room is PAGES pages)."""
    pool, s = _engine(sglang_open, node.path, 11, pages=2 * PAGES)
    old = [f"o{i}" for i in range(PAGES)]
    assert s.batch_set_v1(old, token_indices(pool, 0, PAGES)) == [True] * PAGES
    assert s.batch_exists(old) == PAGES
    assert s.batch_get_v1(old[:8], token_indices(pool, PAGES, 8)) == [True] * 8
    # The lookups' step-long protection (a vLLM scan's) is not kept for them.
    assert node.server.classes[MHA_PAGE].manager._core.scanned == set()
    new = [f"n{i}" for i in range(PAGES)]
    assert s.batch_set_v1(new, token_indices(pool, PAGES, PAGES)) == [True] * PAGES
    assert s.batch_exists(old) == 0 and s.batch_exists(new) == PAGES
    occ = node.status()["classes"][str(MHA_PAGE)]["occupancy"]
    assert (occ["blocks"], occ["pinned"], occ["writing"]) == (PAGES, 0, 0)


def test_clear_drops_the_namespaces_pages_from_the_node_only(node: Node, sglang_open: Any) -> None:
    pa, a = _engine(sglang_open, node.path, 12)
    po, other = _engine(sglang_open, node.path, 13, model="org/other")
    keys = [f"c{i}" for i in range(4)]
    assert a.batch_set_v1(keys, token_indices(pa, 0, 4)) == [True] * 4
    assert other.batch_set_v1(keys, token_indices(po, 0, 4)) == [True] * 4
    a.clear()
    assert a.batch_exists(keys) == 0 and other.batch_exists(keys) == 4
    occ = node.status()["classes"][str(MHA_PAGE)]["occupancy"]
    assert occ["blocks"] == 4


def test_an_sglang_only_node_keeps_no_events(node: Node, sglang_open: Any) -> None:
    """SGLang takes no KV events and never ends a step: the node makes none
    for it, where they would pile up (a store and an eviction each)."""
    pool, s = _engine(sglang_open, node.path, 14, pages=2 * PAGES)
    for r in range(3):  # 3 x 32 pages through a node of 32: two thirds evicted
        keys = [f"e{r}-{i}" for i in range(PAGES)]
        assert s.batch_set_v1(keys, token_indices(pool, 0, PAGES)) == [True] * PAGES
    cls = node.server.classes[MHA_PAGE]
    assert cls.manager.options.events is False and cls.manager._core.events == []
    (session,) = cls.sessions
    assert session.events == [] and session.events_dropped == 0
