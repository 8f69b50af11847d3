"""kvtier as SGLang HiCache's storage backend, through the disk tier:
against SGLang's own storage classes (HiCacheStorageConfig, the
HiCacheStorage base, its pool names and hit policies) and its host KV pools
on CPU tensors, whose page methods are SGLang's own code
(kvtier.bench.sglang_standin)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

hs = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (make venv installs sglang==0.5.23 --no-deps)",
)
torch = pytest.importorskip("torch")

from kvtier.bench.sglang_standin import (  # noqa: E402
    CLASSES,
    STANDIN_ATTRIBUTES,
    class_def,
    defined_attributes,
    fill,
    host_pool,
    page_bytes,
    storage_config,
    token_indices,
)
from kvtier.errors import InvalidArgument  # noqa: E402
from kvtier.integrations.sglang import KVTierStorage, parse_extra_config  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# (kind, layout): every host pool layout SGLang keeps flat data pages of
# (page_head is MHA's only).
POOLS = [(k, lay) for k in ("mha", "mla") for lay in LAYOUTS] + [("mha", "page_head")]


@pytest.fixture
def disk(tmp_path: Path) -> dict[str, Any]:
    return {"backend_name": "kvtier", "interface_v1": 1,
            "kvtier_disk_path": str(tmp_path / "kv"), "kvtier_disk_bytes": "64MiB"}  # fmt: skip


def set_pages(s: Any, pool: Any, prefix: str, n: int) -> list[str]:
    """Store pages 0..n-1 of ``pool`` as keys ``prefix``0.. (every one must
    be stored); their keys."""
    keys = [f"{prefix}{i}" for i in range(n)]
    assert s.batch_set_v1(keys, token_indices(pool, 0, n)) == [True] * n
    return keys


def test_importing_the_integration_loads_neither_sglang_nor_the_native_core() -> None:
    code = (
        "import sys, kvtier.integrations.sglang as m\n"
        "print(any(k.startswith('sglang') for k in sys.modules), 'kvtier._native' in sys.modules)\n"
        "m.KVTierStorage\n"
        "print('sglang.srt.mem_cache.hicache_storage' in sys.modules, 'kvtier._native' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True", "False"]


def test_the_stand_in_pools_set_only_what_sglangs_classes_set() -> None:
    base = defined_attributes(class_def("base.py", "HostKVCache"))
    for kind, (file, name) in CLASSES.items():
        real = defined_attributes(class_def(file, name)) | base
        assert set(STANDIN_ATTRIBUTES[kind]) <= real, set(STANDIN_ATTRIBUTES[kind]) - real
        pool = host_pool(kind, "page_first", pages=4)
        assert {a for a in STANDIN_ATTRIBUTES[kind] if hasattr(pool, a)} == set(
            STANDIN_ATTRIBUTES[kind]
        )
    # SGLang's HiCacheStorage methods the backend overrides exist there.
    tree = ast.parse(Path(hs.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HiCacheStorage")
    theirs = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    ours = {"batch_exists_v2", "batch_get_v1", "batch_set_v1", "batch_get_v2", "batch_set_v2",
            "get", "set", "exists", "batch_get", "batch_set", "batch_exists", "clear",
            "get_stats", "register_mem_pool_host", "register_mem_host_pool_v2"}  # fmt: skip
    assert ours <= theirs
    assert {k for k in vars(KVTierStorage) if k in theirs} == ours


def test_extra_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="needs kvtier_disk_path or kvtier_remote_url"):
        parse_extra_config({"backend_name": "kvtier"})
    with pytest.raises(InvalidArgument, match="unknown hicache extra config key 'kvtier_disk'"):
        parse_extra_config({"kvtier_disk": "/x"})
    with pytest.raises(InvalidArgument, match="kvtier_disk_bytes"):
        parse_extra_config({"kvtier_disk_path": "/x", "kvtier_disk_bytes": "lots"})
    s = parse_extra_config({"kvtier_disk_path": "/x", "kvtier_disk_bytes": "1GiB",
                            "enable_metadata_cache": True, "interface_v1": 1})  # fmt: skip
    assert s.disk is not None and s.disk.capacity_bytes == 1 << 30 and s.remote is None


@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_pages_round_trip_byte_for_byte(
    kind: str, layout: str, disk: dict[str, Any], sglang_filled: Any
) -> None:
    pool, s = sglang_filled(disk, 1, kind=kind, layout=layout, pages=24, mla=kind == "mla")
    want = [page_bytes(pool, i) for i in range(8)]
    keys = set_pages(s, pool, "h", 8)
    assert s.batch_exists(keys) == 8 and s.batch_exists(["nope", *keys]) == 0
    assert s.batch_get_v1(keys[2:], token_indices(pool, 10, 6)) == [True] * 6
    assert [page_bytes(pool, 10 + i) for i in range(6)] == want[2:]
    # The key-value fallback reads the same records (SGLang's flat data page).
    got = s.get("h3", pool.get_dummy_flat_data_page())
    assert bytes(got.view(torch.uint8).numpy()) == want[3]
    st = s.kvtier_stats()["kv"]
    assert (st["pages_stored"], st["pages_loaded"], st["tiers"]["disk"]["loads"]) == (8, 6, 7)
    assert st["staging_slots"] == 2 * 128  # SGLang's storage batch, each way


def test_generic_and_zero_copy_paths_read_each_others_pages(
    disk: dict[str, Any], sglang_filled: Any
) -> None:
    pool, s = sglang_filled(disk, 2, layout="layer_first")
    # SGLang's generic path: flat data pages in, dummy pages out.
    assert s.batch_set(["a", "b"], [pool.get_data_page(i * pool.page_size) for i in (0, 1)])
    assert s.batch_get_v1(["a", "b"], token_indices(pool, 5, 2)) == [True, True]
    assert [page_bytes(pool, 5), page_bytes(pool, 6)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
    assert s.batch_set_v1(["c"], token_indices(pool, 2, 1)) == [True]
    out = s.batch_get(["c", "zz"], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert bytes(out[0].view(torch.uint8).numpy()) == page_bytes(pool, 2) and out[1] is None
    with pytest.raises(InvalidArgument, match="value of 8 B for pages of"):
        s.set("x", torch.zeros(4, dtype=torch.int16))


def test_exists_is_the_longest_stored_prefix(disk: dict[str, Any], sglang_filled: Any) -> None:
    pool, s = sglang_filled(disk, 3)
    assert s.batch_set_v1(["p0", "p1", "p3"], token_indices(pool, 0, 3)) == [True] * 3
    keys = ["p0", "p1", "p2", "p3"]
    assert s.batch_exists(keys) == 2
    r = s.batch_exists_v2(keys)
    assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == (
        2, {"kv": 2}, [1, 2])  # fmt: skip
    assert s.exists("p3") and not s.exists("p2")


def test_extra_pools_shorten_the_prefix_by_their_hit_policy(
    disk: dict[str, Any], sglang_open: Any
) -> None:
    pool = host_pool("mha", "page_first", pages=16)
    side = host_pool("mla", "page_first", pages=16, layers=1, kv_lora_rank=32, qk_rope_head_dim=0)
    fill(pool, 4)
    fill(side, 5)
    s = sglang_open(disk, pool)
    s.register_mem_host_pool_v2(pool, hs.PoolName.KV)
    s.register_mem_host_pool_v2(side, hs.PoolName.MAMBA)
    keys = [f"q{i}" for i in range(6)]
    kv = hs.PoolTransfer(name=hs.PoolName.KV, keys=keys, host_indices=token_indices(pool, 0, 6))
    # State for pages 0, 1 and 4 only.
    st = hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=[keys[i] for i in (0, 1, 4)],
                         host_indices=torch.cat([token_indices(side, i, 1) for i in (0, 1, 4)]))  # fmt: skip
    assert s.batch_set_v2([kv, st]) == {"kv": [True] * 6, "mamba": [True] * 3}
    all_pages = hs.PoolTransfer(name=hs.PoolName.MAMBA, hit_policy=hs.PoolHitPolicy.ALL_PAGES)
    r = s.batch_exists_v2(keys, [all_pages])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (2, {"kv": 6, "mamba": 2})
    trailing = hs.PoolTransfer(
        name=hs.PoolName.MAMBA, keys=["x"], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES
    )
    r = s.batch_exists_v2(keys, [trailing])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (5, [1, 2, 5])
    # The sidecar's pages come back into its own pool, byte for byte.
    back = hs.PoolTransfer(
        name=hs.PoolName.MAMBA, keys=[keys[4]], host_indices=token_indices(side, 9, 1)
    )
    assert s.batch_get_v2([back]) == {"mamba": [True]}
    # The sidecar's disk tier: the KV tier's 64 MiB scaled by page sizes
    # (1 KiB / 32 KiB: 2 MiB), records of 1 KiB + a 4 KiB trailer, 4 KiB aligned.
    caps = {n: st["tiers"]["disk"]["capacity_blocks"] for n, st in s.kvtier_stats().items()}
    assert caps == {"kv": (64 << 20) // (36 << 10), "mamba": (2 << 20) // (8 << 10)}
    assert page_bytes(side, 9) == page_bytes(side, 4)


def test_a_corrupt_record_is_a_miss_and_its_page_untouched(
    disk: dict[str, Any], sglang_filled: Any, tmp_path: Path
) -> None:
    pool, s = sglang_filled(disk, 6)
    keys = set_pages(s, pool, "c", 4)
    # Flip one byte in every record's payload but the first: which record
    # holds which page is the tier's business, so damage all but one.
    slab = next((tmp_path / "kv").glob("kvtier-*/slab-000.dat"))
    rec = s.movers["kv"].tiers[0].record_bytes
    with open(slab, "r+b") as f:
        for r in range(1, 4):
            f.seek(r * rec + 100)
            b = f.read(1)
            f.seek(r * rec + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    before = [page_bytes(pool, 8 + i) for i in range(4)]
    got = s.batch_get_v1(keys, token_indices(pool, 8, 4))
    assert sum(got) == 1
    good = got.index(True)
    assert page_bytes(pool, 8 + good) == page_bytes(pool, good)
    # No byte of a page that failed its check reached the pool.
    assert all(
        page_bytes(pool, 8 + i) == before[i] != page_bytes(pool, i) for i in range(4) if not got[i]
    )
    tier = s.kvtier_stats()["kv"]["tiers"]["disk"]
    assert (tier["corrupt"], tier["blocks"]) == (3, 1)
    assert s.batch_exists([keys[good]]) == 1 and sum(s.exists(k) for k in keys) == 1


def test_pages_survive_a_restart_and_clear_drops_them(
    disk: dict[str, Any], sglang_open: Any, sglang_filled: Any
) -> None:
    pool, s = sglang_filled(disk, 7)
    keys = set_pages(s, pool, "r", 5)
    s.close()
    s.close()  # idempotent
    s2 = sglang_open(disk, pool)
    assert s2.batch_exists(keys) == 5
    assert s2.batch_get_v1(keys, token_indices(pool, 8, 5)) == [True] * 5
    assert [page_bytes(pool, 8 + i) for i in range(5)] == [page_bytes(pool, i) for i in range(5)]
    s2.clear()
    assert s2.batch_exists(keys) == 0


def test_namespaces_keep_models_layouts_and_ranks_apart(
    disk: dict[str, Any], sglang_open: Any, sglang_filled: Any
) -> None:
    pool, a = sglang_filled(disk, 8, pages=8)
    assert a.batch_set_v1(["k"], token_indices(pool, 0, 1)) == [True]
    a.close()
    for kw in ({"model": "org/other"}, {"tp_rank": 1, "tp_size": 2}):
        b = sglang_open(disk, pool, **kw)
        assert b.batch_exists(["k"]) == 0
        b.close()
    lf = host_pool("mha", "layer_first", pages=8)
    c = sglang_open(disk, lf)
    assert c.batch_exists(["k"]) == 0
    c.close()
    assert sglang_open(disk, pool).batch_exists(["k"]) == 1


def test_metrics_count_pages_per_call(disk: dict[str, Any], sglang_open: Any) -> None:
    pool = host_pool("mha", "page_first", pages=8)
    s = sglang_open(disk, pool)
    s.batch_set_v1(["m0", "m1", "m2"], token_indices(pool, 0, 3))
    s.batch_get_v1(["m0", "m1"], token_indices(pool, 4, 2))
    assert s.metrics["backup_pgs"] == [3] and s.metrics["prefetch_pgs"] == [2]
    m = s.get_stats()
    if m is not None:  # SGLang's metrics module imports (its full dependencies)
        assert (m.backup_pgs, m.prefetch_pgs) == ([3], [2])
    else:
        assert s.metrics["backup_pgs"] == [3]


def test_stores_and_loads_from_two_threads_at_once(
    disk: dict[str, Any], sglang_filled: Any
) -> None:
    """SGLang's backup thread stores while its prefetch thread loads."""
    import threading

    pool, s = sglang_filled(disk, 9, layout="layer_first", pages=64)
    first = [f"t{i}" for i in range(16)]
    assert s.batch_set_v1(first, token_indices(pool, 0, 16)) == [True] * 16
    results: dict[str, list[list[bool]]] = {"set": [], "get": []}

    def writer() -> None:
        for r in range(8):
            keys = [f"w{r}-{i}" for i in range(16)]
            results["set"].append(s.batch_set_v1(keys, token_indices(pool, 16, 16)))

    def reader() -> None:
        for _ in range(8):
            results["get"].append(s.batch_get_v1(first, token_indices(pool, 32, 16)))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"set": [[True] * 16] * 8, "get": [[True] * 16] * 8}
    assert [page_bytes(pool, 32 + i) for i in range(16)] == [page_bytes(pool, i) for i in range(16)]
    assert s.batch_exists([f"w7-{i}" for i in range(16)]) == 16


def test_a_layout_without_flat_pages_is_refused_at_registration(
    disk: dict[str, Any], sglang_open: Any
) -> None:
    from kvtier.errors import UnsupportedEngine

    pool = host_pool("mha", "page_first", pages=4)
    pool.layout = "page_unified"  # SGLang's get_data_page raises for it
    with pytest.raises(UnsupportedEngine, match="page_unified layout: Unsupported layout"):
        sglang_open(disk, pool)


def test_sglangs_dynamic_factory_builds_the_backend_from_one_line(tmp_path: Path) -> None:
    """The extra config of the README's launch line, through SGLang's own
    StorageBackendFactory (what --hicache-storage-backend dynamic runs)."""
    import json
    import re

    from sglang.srt.mem_cache.storage import StorageBackendFactory

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = re.search(r"'(\{\"backend_name\": \"kvtier\".*?\})'", readme)
    assert line is not None, "the README's SGLang launch line"
    extra = json.loads(line.group(1))
    extra.pop("kvtier_remote_url")
    # The line's sizes are a deployment's (16 GiB of memory tier): small ones here.
    extra.update(kvtier_disk_path=str(tmp_path / "kv"), kvtier_disk_bytes="16MiB")
    assert "kvtier_host_bytes" in extra
    extra["kvtier_host_bytes"] = "1MiB"
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    try:
        assert type(backend) is KVTierStorage
        pool = host_pool("mha", "page_first", pages=4)
        fill(pool, 10)
        backend.register_mem_pool_host(pool)
        assert backend.batch_set_v1(["a"], token_indices(pool, 0, 1)) == [True]
        assert backend.batch_get_v1(["a"], token_indices(pool, 2, 1)) == [True]
        assert page_bytes(pool, 2) == page_bytes(pool, 0)
        assert backend.kvtier_stats()["kv"]["host_pages_loaded"] == 1  # from its memory tier
    finally:
        backend.close()


def test_a_pool_registered_again_takes_over_the_pages(
    disk: dict[str, Any], sglang_filled: Any
) -> None:
    """SGLang re-attaching storage registers a (new) host pool again: the
    old pool's tiers let go of the directory and the pages stay readable."""
    a, s = sglang_filled(disk, 11, pages=8)
    assert s.batch_set_v1(["g0", "g1"], token_indices(a, 0, 2)) == [True, True]
    b = host_pool("mha", "page_first", pages=8)
    s.register_mem_pool_host(b)
    assert s.batch_get_v1(["g0", "g1"], token_indices(b, 3, 2)) == [True, True]
    assert [page_bytes(b, 3), page_bytes(b, 4)] == [page_bytes(a, 0), page_bytes(a, 1)]


def test_bad_host_indices_are_clear_errors(disk: dict[str, Any], sglang_open: Any) -> None:
    pool = host_pool("mha", "page_first", pages=4)  # 5 pages with SGLang's padding page
    s = sglang_open(disk, pool)
    with pytest.raises(InvalidArgument, match="beyond the pool's 5 pages"):
        s.batch_set_v1(["a"], token_indices(pool, 5, 1))
    with pytest.raises(InvalidArgument, match="on page boundaries"):
        s.batch_get_v1(["a"], token_indices(pool, 0, 1) + 1)
    with pytest.raises(InvalidArgument, match="16 host indices for 3 pages"):
        s.batch_get_v1(["a", "b", "c"], token_indices(pool, 0, 1))
    assert s.batch_exists(["a"]) == 0  # nothing was written


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "generic"])
def test_sglangs_controller_backs_up_finds_and_prefetches_pages(
    zero_copy: bool, disk: dict[str, Any], sglang_filled: Any
) -> None:
    """SGLang's own cache-controller code (its backup, hit query and
    prefetch transfer, kvtier.bench.sglang_standin.controller) over the backend:
    a prompt's pages backed up, found as a prefix, read back byte for byte."""
    from kvtier.bench.sglang_standin import controller
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pool, s = sglang_filled(disk, 12, layout="layer_first", pages=24)
    ctl = controller(s, pool, zero_copy=zero_copy)
    tokens = list(range(1000, 1000 + 10 * pool.page_size))  # 10 pages
    hashes = get_storage_hash_str(tokens, None, page_size=pool.page_size)
    backup = ctl.StorageOperation(token_indices(pool, 0, 10), tokens, hash_value=hashes)
    ctl._page_backup(backup)
    assert backup.completed_tokens == 10 * pool.page_size
    # A request whose prompt shares the first 7 pages.
    asked = tokens[: 7 * pool.page_size] + list(range(5000, 5000 + 3 * pool.page_size))
    op = ctl.PrefetchOperation("r1", asked)
    hashes, hit_tokens = ctl._storage_hit_query(op)
    assert (len(hashes), hit_tokens) == (7, 7 * pool.page_size)
    op.hash_value, op.host_indices = hashes, token_indices(pool, 12, 7)
    assert ctl._page_transfer(op) == 7
    assert [page_bytes(pool, 12 + i) for i in range(7)] == [page_bytes(pool, i) for i in range(7)]
    ack = ctl.prefetch_sync_queue.get_nowait()
    assert (ack.rid, ack.completed_tokens) == ("r1", 7 * pool.page_size)


def test_batches_larger_than_the_staging_slots_move_in_parts(
    disk: dict[str, Any], sglang_open: Any
) -> None:
    pool = host_pool("mha", "layer_first", pages=24)
    fill(pool, 13)
    s = sglang_open({**disk, "kvtier_staging_bytes": "100KiB"}, pool)
    assert s.kvtier_stats()["kv"]["staging_slots"] == 4  # 2 for stores, 2 for loads
    keys = set_pages(s, pool, "s", 7)
    assert s.batch_get_v1(keys, token_indices(pool, 10, 7)) == [True] * 7
    assert [page_bytes(pool, 10 + i) for i in range(7)] == [page_bytes(pool, i) for i in range(7)]
    assert s.get("s6", pool.get_dummy_flat_data_page()) is not None


def test_another_sglang_release_is_used_with_a_warning(
    disk: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sglang
    from kvtier.integrations.sglang import SUPPORTED_SGLANG

    assert sglang.__version__ == SUPPORTED_SGLANG == "0.5.23"
    with caplog.at_level("WARNING", logger="kvtier"):
        KVTierStorage(storage_config(disk)).close()
        assert caplog.records == []
        monkeypatch.setattr(sglang, "__version__", "0.6.0")
        KVTierStorage(storage_config(disk)).close()
    assert [r.getMessage() for r in caplog.records] == [
        "kvtier: SGLang 0.6.0; this backend is tested with SGLang 0.5.23"
    ]


def test_a_block_groups_pool_gets_no_verdict_and_does_not_gate(
    disk: dict[str, Any], sglang_open: Any
) -> None:
    pool = host_pool("mha", "page_first", pages=8)
    s = sglang_open(disk, pool)
    assert s.batch_set_v1(["b0", "b1"], token_indices(pool, 0, 2)) == [True, True]
    groups = hs.PoolTransfer(
        name=hs.PoolName.KV, hit_policy=hs.PoolHitPolicy.BLOCK_GROUPS, block_pages=1, group_pages=1
    )
    r = s.batch_exists_v2(["b0", "b1"], [groups])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == (
        2, {"kv": 2}, [1, 2])  # fmt: skip


def test_exists_v2_answers_as_sglangs_file_backend(
    disk: dict[str, Any], sglang_open: Any, tmp_path: Path
) -> None:
    """The same pages stored in kvtier and in SGLang's HiCacheFile: the same
    PoolTransferResult for every prefix query and hit policy (seeded cases)."""
    import random

    rng = random.Random(0)
    kv = host_pool("mha", "page_first", pages=12)
    side = host_pool("mla", "page_first", pages=12, layers=1, kv_lora_rank=32, qk_rope_head_dim=0)
    ours = sglang_open(disk, kv)
    theirs = hs.HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "hf")}))
    for backend in (ours, theirs):
        backend.register_mem_host_pool_v2(kv, hs.PoolName.KV)
        backend.register_mem_host_pool_v2(side, hs.PoolName.MAMBA)
    seen = set()
    for case in range(12):
        keys = [f"e{case}-{i}" for i in range(8)]
        kv_pages = [i for i in range(8) if rng.random() < 0.85]
        side_pages = [i for i in range(8) if rng.random() < 0.6]
        for backend in (ours, theirs):
            writes = [
                hs.PoolTransfer(name=hs.PoolName.KV, keys=[keys[i] for i in kv_pages],
                                host_indices=torch.cat([token_indices(kv, i, 1) for i in kv_pages])),
                hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=[keys[i] for i in side_pages],
                                host_indices=torch.cat([token_indices(side, i, 1) for i in side_pages])),
            ]  # fmt: skip
            backend.batch_set_v2([w for w in writes if w.keys])
        policy = rng.choice([hs.PoolHitPolicy.ALL_PAGES, hs.PoolHitPolicy.TRAILING_PAGES])
        query = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["x"] * rng.randint(1, 3),
                                 hit_policy=policy)]  # fmt: skip
        for pools in ([], query):
            a, b = ours.batch_exists_v2(keys, pools), theirs.batch_exists_v2(keys, pools)
            assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == (
                b.kv_hit_pages,
                b.extra_pool_hit_pages,
                b.restorable_prefix_pages,
            ), (case, policy, kv_pages, side_pages)
            seen.add((a.kv_hit_pages, bool(pools)))
        assert ours.batch_exists(keys) == theirs.batch_exists(keys)
    theirs.clear()
    assert len(seen) >= 6  # the cases cover short, long and gated prefixes
