"""kvtier as SGLang HiCache's storage backend through a real redis-server
(and disk + Redis): byte for byte in both layouts, pages shared between
engines and MLA ranks, damaged values and a lost disk record."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

hs = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (make venv installs sglang==0.5.23 --no-deps)",
)
torch = pytest.importorskip("torch")
redis = pytest.importorskip("redis")

from kvtier.bench.sglang_pool import host_pool  # noqa: E402
from kvtier.integrations.sglang import KVTierStorage  # noqa: E402


def config(extra: dict[str, Any], layout: str, *, mla: bool = False, tp_rank: int = 0,
           tp_size: int = 1) -> Any:  # fmt: skip
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first", model_name="org/m", extra_config=extra,
    )  # fmt: skip


def fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page(pool: Any, i: int) -> bytes:
    return bytes(pool.get_data_page(i * pool.page_size).contiguous().view(torch.uint8).numpy())


def indices(pool: Any, first: int, n: int) -> Any:
    return torch.arange(first * pool.page_size, (first + n) * pool.page_size)


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    out: list[Any] = []
    yield out
    for s in out:
        s.close()


def backend(opened: list[Any], extra: dict[str, Any], pool: Any, **kw: Any) -> Any:
    s = KVTierStorage(config(extra, pool.layout, **kw), {})
    opened.append(s)
    s.register_mem_pool_host(pool)
    return s


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_through_redis_byte_for_byte_and_shared_by_engines(
    layout: str, redis_standalone: Any, opened: list[Any]
) -> None:
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    pool_a, pool_b = host_pool("mha", layout, pages=16), host_pool("mha", layout, pages=16)
    fill(pool_a, 1)
    a, b = backend(opened, extra, pool_a), backend(opened, extra, pool_b)
    keys = [f"s{i}" for i in range(6)]
    assert a.batch_set_v1(keys[:5], indices(pool_a, 0, 5)) == [True] * 5
    # Another engine on the same Redis sees the prefix and reads it.
    assert b.batch_exists(keys) == 5
    assert b.batch_get_v1(keys, indices(pool_b, 3, 6)) == [True] * 5 + [False]
    assert [page(pool_b, 3 + i) for i in range(5)] == [page(pool_a, i) for i in range(5)]
    # One EXISTS round for the six keys; the one known absent is not read.
    tier = b.kvtier_stats()["kv"]["tiers"]["remote"]
    assert (tier["exists_checks"], tier["loads"], tier["probes"]) == (6, 5, 5)


def test_mla_pages_are_written_once_for_every_tp_rank(
    redis_standalone: Any, opened: list[Any]
) -> None:
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    p0, p1 = host_pool("mla", "page_first", pages=8), host_pool("mla", "page_first", pages=8)
    fill(p0, 2)
    fill(p1, 3)
    r0 = backend(opened, extra, p0, mla=True, tp_rank=0, tp_size=2)
    r1 = backend(opened, extra, p1, mla=True, tp_rank=1, tp_size=2)
    # Rank 1 is not the writer: it reports success and writes nothing.
    assert r1.batch_set_v1(["m0", "m1"], indices(p1, 0, 2)) == [True, True]
    assert r0.batch_exists(["m0"]) == 0
    assert r0.batch_set_v1(["m0", "m1"], indices(p0, 0, 2)) == [True, True]
    assert r1.batch_exists(["m0", "m1"]) == 2
    assert r1.batch_get_v1(["m0", "m1"], indices(p1, 4, 2)) == [True, True]
    assert [page(p1, 4), page(p1, 5)] == [page(p0, 0), page(p0, 1)]
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)
    ns_keys = client.keys(r0.movers["kv"].tiers[0].server_key(b"m0"))
    assert len(ns_keys) == 1  # one value, not one per rank


def test_damaged_values_are_misses_and_their_pages_untouched(
    redis_standalone: Any, opened: list[Any]
) -> None:
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    pool = host_pool("mha", "page_first", pages=16)
    fill(pool, 4)
    s = backend(opened, extra, pool)
    keys = [f"d{i}" for i in range(4)]
    assert s.batch_set_v1(keys, indices(pool, 0, 4)) == [True] * 4
    tier = s.movers["kv"].tiers[0]
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)
    client.setrange(tier.server_key(b"d1"), 300, b"\x00\xff")  # payload bytes changed
    client.set(tier.server_key(b"d2"), client.get(tier.server_key(b"d3")))  # another page's value
    before = [page(pool, 8 + i) for i in range(4)]
    assert s.batch_get_v1(keys, indices(pool, 8, 4)) == [True, False, False, True]
    assert [page(pool, 8), page(pool, 11)] == [page(pool, 0), page(pool, 3)]
    assert [page(pool, 9), page(pool, 10)] == before[1:3]
    assert s.kvtier_stats()["kv"]["tiers"]["remote"]["corrupt"] == 2


def test_a_page_the_disk_lost_comes_from_redis(
    redis_standalone: Any, opened: list[Any], tmp_path: Path
) -> None:
    extra = {"kvtier_disk_path": str(tmp_path / "kv"), "kvtier_disk_bytes": "64MiB",
             "kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}  # fmt: skip
    pool = host_pool("mha", "layer_first", pages=16)
    fill(pool, 5)
    s = backend(opened, extra, pool)
    keys = [f"l{i}" for i in range(3)]
    assert s.batch_set_v1(keys, indices(pool, 0, 3)) == [True] * 3
    disk, remote = s.movers["kv"].tiers
    assert (disk.name, remote.name) == ("disk", "remote")
    slab = next((tmp_path / "kv").glob("kvtier-*/slab-000.dat"))
    with open(slab, "r+b") as f:  # every record's first payload byte flipped
        for r in range(3):
            f.seek(r * disk.record_bytes)
            b = f.read(1)
            f.seek(r * disk.record_bytes)
            f.write(bytes([b[0] ^ 1]))
    assert s.batch_get_v1(keys, indices(pool, 8, 3)) == [True] * 3
    assert [page(pool, 8 + i) for i in range(3)] == [page(pool, i) for i in range(3)]
    st = s.kvtier_stats()["kv"]["tiers"]
    assert (st["disk"]["corrupt"], st["remote"]["loads"]) == (3, 3)


def test_a_dead_server_fails_pages_not_the_caller_then_recovers(
    tmp_path: Path, opened: list[Any]
) -> None:
    from kvtier.bench.redis_server import RedisServer

    server = RedisServer(tmp_path)
    try:
        extra = {"kvtier_remote_url": server.url, "kvtier_remote_timeout_s": 0.5}
        pool = host_pool("mha", "page_first", pages=16)
        fill(pool, 6)
        s = backend(opened, extra, pool)
        keys = [f"x{i}" for i in range(3)]
        assert s.batch_set_v1(keys, indices(pool, 0, 3)) == [True] * 3
        server.kill()
        before = [page(pool, 8 + i) for i in range(3)]
        assert s.batch_get_v1(keys, indices(pool, 8, 3)) == [False] * 3
        assert [page(pool, 8 + i) for i in range(3)] == before
        assert s.batch_set_v1(["y0", "y1"], indices(pool, 3, 2)) == [False, False]
        server.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 10
        while s.batch_set_v1(["y0", "y1"], indices(pool, 3, 2)) != [True, True]:
            assert time.monotonic() < deadline, "no recovery after the server came back"
            time.sleep(0.2)
        assert s.batch_get_v1(["y0", "y1"], indices(pool, 8, 2)) == [True, True]
        assert [page(pool, 8), page(pool, 9)] == [page(pool, 3), page(pool, 4)]
    finally:
        server.stop()


def test_clear_empties_the_namespace_on_redis(redis_standalone: Any, opened: list[Any]) -> None:
    ns = str(uuid.uuid4())
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": ns}
    other = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": ns + "-other"}
    pool = host_pool("mha", "page_first", pages=8)
    fill(pool, 7)
    a, b, c = (
        backend(opened, extra, pool),
        backend(opened, extra, pool),
        backend(opened, other, pool),
    )
    keys = ["c0", "c1", "c2"]
    assert a.batch_set_v1(keys, indices(pool, 0, 3)) == [True] * 3
    assert c.batch_set_v1(keys, indices(pool, 0, 3)) == [True] * 3
    assert b.batch_exists(keys) == 3
    a.clear()
    assert a.batch_exists(keys) == 0
    time.sleep(2.1)  # b remembers what it saw for 2 s (the remote tier's known_ttl_s)
    assert b.batch_exists(keys) == 0
    assert c.batch_exists(keys) == 3  # another namespace keeps its pages
