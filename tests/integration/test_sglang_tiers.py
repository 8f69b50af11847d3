"""kvtier as SGLang HiCache's storage backend through a real redis-server
(and disk + Redis): byte for byte in both layouts, pages shared between
engines and MLA ranks, damaged values and a lost disk record."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

hs = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (make venv installs sglang==0.5.23 --no-deps)",
)
torch = pytest.importorskip("torch")
redis = pytest.importorskip("redis")

from kvtier.bench.sglang_standin import (  # noqa: E402
    fill,
    host_pool,
    page_bytes,
    token_indices,
)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_through_redis_byte_for_byte_and_shared_by_engines(
    layout: str, redis_standalone: Any, sglang_open: Any
) -> None:
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    pool_a, pool_b = host_pool("mha", layout, pages=16), host_pool("mha", layout, pages=16)
    fill(pool_a, 1)
    a, b = sglang_open(extra, pool_a), sglang_open(extra, pool_b)
    keys = [f"s{i}" for i in range(6)]
    assert a.batch_set_v1(keys[:5], token_indices(pool_a, 0, 5)) == [True] * 5
    # Another engine on the same Redis sees the prefix and reads it.
    assert b.batch_exists(keys) == 5
    assert b.batch_get_v1(keys, token_indices(pool_b, 3, 6)) == [True] * 5 + [False]
    assert [page_bytes(pool_b, 3 + i) for i in range(5)] == [
        page_bytes(pool_a, i) for i in range(5)
    ]
    # One EXISTS round for the six keys; the one known absent is not read.
    tier = b.kvtier_stats()["kv"]["tiers"]["remote"]
    assert (tier["exists_checks"], tier["loads"], tier["probes"]) == (6, 5, 5)


def test_mla_pages_are_written_once_for_every_tp_rank(
    redis_standalone: Any, sglang_open: Any
) -> None:
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    p0, p1 = host_pool("mla", "page_first", pages=8), host_pool("mla", "page_first", pages=8)
    fill(p0, 2)
    fill(p1, 3)
    r0 = sglang_open(extra, p0, mla=True, tp_rank=0, tp_size=2)
    r1 = sglang_open(extra, p1, mla=True, tp_rank=1, tp_size=2)
    # Rank 1 is not the writer: it reports success and writes nothing.
    assert r1.batch_set_v1(["m0", "m1"], token_indices(p1, 0, 2)) == [True, True]
    assert r0.batch_exists(["m0"]) == 0
    assert r0.batch_set_v1(["m0", "m1"], token_indices(p0, 0, 2)) == [True, True]
    assert r1.batch_exists(["m0", "m1"]) == 2
    assert r1.batch_get_v1(["m0", "m1"], token_indices(p1, 4, 2)) == [True, True]
    assert [page_bytes(p1, 4), page_bytes(p1, 5)] == [page_bytes(p0, 0), page_bytes(p0, 1)]
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)
    ns_keys = client.keys(r0.movers["kv"].tiers[0].server_key(b"m0"))
    assert len(ns_keys) == 1  # one value, not one per rank


def test_damaged_values_are_misses_and_their_pages_untouched(
    redis_standalone: Any, sglang_filled: Any
) -> None:
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    pool, s = sglang_filled(extra, 4)
    keys = [f"d{i}" for i in range(4)]
    assert s.batch_set_v1(keys, token_indices(pool, 0, 4)) == [True] * 4
    tier = s.movers["kv"].tiers[0]
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)
    client.setrange(tier.server_key(b"d1"), 300, b"\x00\xff")  # payload bytes changed
    client.set(tier.server_key(b"d2"), client.get(tier.server_key(b"d3")))  # another page's value
    before = [page_bytes(pool, 8 + i) for i in range(4)]
    assert s.batch_get_v1(keys, token_indices(pool, 8, 4)) == [True, False, False, True]
    assert [page_bytes(pool, 8), page_bytes(pool, 11)] == [page_bytes(pool, 0), page_bytes(pool, 3)]
    assert [page_bytes(pool, 9), page_bytes(pool, 10)] == before[1:3]
    assert s.kvtier_stats()["kv"]["tiers"]["remote"]["corrupt"] == 2


def test_a_page_the_disk_lost_comes_from_redis(
    redis_standalone: Any, sglang_filled: Any, tmp_path: Path
) -> None:
    extra = {"kvtier_disk_path": str(tmp_path / "kv"), "kvtier_disk_bytes": "64MiB",
             "kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}  # fmt: skip
    pool, s = sglang_filled(extra, 5, layout="layer_first")
    keys = [f"l{i}" for i in range(3)]
    assert s.batch_set_v1(keys, token_indices(pool, 0, 3)) == [True] * 3
    disk, remote = s.movers["kv"].tiers
    assert (disk.name, remote.name) == ("disk", "remote")
    slab = next((tmp_path / "kv").glob("kvtier-*/slab-000.dat"))
    with open(slab, "r+b") as f:  # every record's first payload byte flipped
        for r in range(3):
            f.seek(r * disk.record_bytes)
            b = f.read(1)
            f.seek(r * disk.record_bytes)
            f.write(bytes([b[0] ^ 1]))
    assert s.batch_get_v1(keys, token_indices(pool, 8, 3)) == [True] * 3
    assert [page_bytes(pool, 8 + i) for i in range(3)] == [page_bytes(pool, i) for i in range(3)]
    st = s.kvtier_stats()["kv"]["tiers"]
    assert (st["disk"]["corrupt"], st["remote"]["loads"]) == (3, 3)


def test_a_dead_server_fails_pages_not_the_caller_then_recovers(
    tmp_path: Path, sglang_filled: Any
) -> None:
    from kvtier.bench.redis_server import RedisServer

    server = RedisServer(tmp_path)
    try:
        extra = {"kvtier_remote_url": server.url, "kvtier_remote_timeout_s": 0.5}
        pool, s = sglang_filled(extra, 6)
        keys = [f"x{i}" for i in range(3)]
        assert s.batch_set_v1(keys, token_indices(pool, 0, 3)) == [True] * 3
        server.kill()
        before = [page_bytes(pool, 8 + i) for i in range(3)]
        assert s.batch_get_v1(keys, token_indices(pool, 8, 3)) == [False] * 3
        assert [page_bytes(pool, 8 + i) for i in range(3)] == before
        assert s.batch_set_v1(["y0", "y1"], token_indices(pool, 3, 2)) == [False, False]
        server.start()  # same port, empty (no persistence)
        # Each of the tier's connections finds the restart on its next
        # request (which fails: a miss) and reconnects.
        deadline = time.monotonic() + 10
        while s.batch_set_v1(["y0", "y1"], token_indices(pool, 3, 2)) != [
            True,
            True,
        ] or s.batch_get_v1(["y0", "y1"], token_indices(pool, 8, 2)) != [True, True]:
            assert time.monotonic() < deadline, "no recovery after the server came back"
            time.sleep(0.2)
        assert [page_bytes(pool, 8), page_bytes(pool, 9)] == [
            page_bytes(pool, 3),
            page_bytes(pool, 4),
        ]
    finally:
        server.stop()


def test_clear_empties_the_namespace_on_redis(redis_standalone: Any, sglang_open: Any) -> None:
    ns = str(uuid.uuid4())
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": ns}
    other = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": ns + "-other"}
    pool = host_pool("mha", "page_first", pages=8)
    fill(pool, 7)
    a, b, c = (
        sglang_open(extra, pool),
        sglang_open(extra, pool),
        sglang_open(other, pool),
    )
    keys = ["c0", "c1", "c2"]
    assert a.batch_set_v1(keys, token_indices(pool, 0, 3)) == [True] * 3
    assert c.batch_set_v1(keys, token_indices(pool, 0, 3)) == [True] * 3
    assert b.batch_exists(keys) == 3
    a.clear()
    assert a.batch_exists(keys) == 0
    # b remembers what it saw for the remote tier's known_ttl_s (2 s), then
    # asks again: waited for as a condition, not a margin over the 2 s.
    deadline = time.monotonic() + 60
    while b.batch_exists(keys) != 0:
        assert time.monotonic() < deadline, "b still sees the cleared pages after 60 s"
        time.sleep(0.05)
    assert c.batch_exists(keys) == 3  # another namespace keeps its pages


def test_a_store_announced_after_the_clear_does_not_bring_its_pages_back(
    redis_standalone: Any, sglang_open: Any
) -> None:
    """Issue 58's item 6, its ordering injected: engine w's stores were
    acknowledged before a's clear deleted them, and their entry in the
    pool's event stream goes out at w's next call (STREAM_DELAY_S after the
    SETs at the earliest; the XADD of a's own stores, sent as the clear
    begins, can land after it on a loaded machine), so it recreates the
    stream the clear deleted, naming deleted pages. Before the fix b's pool
    index took them as present for good: the recreated stream had as many
    entries as the deleted one, so no reset was seen. b must forget them
    through the clear itself, not a TTL: its memory of present keys here
    outlives the test."""
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    pool = host_pool("mha", "page_first", pages=8)
    fill(pool, 8)
    a, b, w = (sglang_open(extra, pool) for _ in range(3))
    wt, bt = (s.movers["kv"].tiers[0] for s in (w, b))
    bt.known.ttl_s = 3600.0
    keys = ["r0", "r1", "r2"]
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)

    def announce() -> None:
        """w's calls until its stores' entry went out (STREAM_DELAY_S on)."""
        deadline = time.monotonic() + 30
        while wt.has_pending_work():
            assert time.monotonic() < deadline, "w never sent its stores' entry"
            w.batch_exists(["elsewhere"])
            time.sleep(0.01)

    assert w.batch_set_v1(keys, token_indices(pool, 0, 3)) == [True] * 3
    announce()
    deadline = time.monotonic() + 30
    while b.batch_exists(keys) != 3:
        assert time.monotonic() < deadline, "b never saw w's pages"
        time.sleep(0.01)
    assert w.batch_set_v1(keys, token_indices(pool, 0, 3)) == [True] * 3  # written again
    assert wt.has_pending_work()  # its entry waits for w's next call
    a.clear()
    assert [client.exists(wt.server_key(k.encode())) for k in keys] == [0, 0, 0]
    assert not client.exists(wt.stream)
    announce()  # after the clear: the entry names deleted pages
    assert client.xlen(wt.stream) == 1
    # Each engine forgets at its own next look at the namespace's epoch
    # (within 2 s): w's may come after b's (CI: w still saw them right after).
    start = time.monotonic()
    for engine, name in ((b, "b"), (w, "w")):
        while engine.batch_exists(keys) != 0:
            assert time.monotonic() < start + 30, f"{name} still sees the cleared pages after 30 s"
            time.sleep(0.05)


def test_a_key_whose_check_is_already_in_flight_is_answered(
    redis_standalone: Any, sglang_open: Any
) -> None:
    """An existence check an earlier call started (and nobody polled since)
    answers a later exists, which must wait for it rather than say absent."""
    extra = {"kvtier_remote_url": redis_standalone.url, "kvtier_namespace": str(uuid.uuid4())}
    pool = host_pool("mha", "page_first", pages=8)
    writer, reader = sglang_open(extra, pool), sglang_open(extra, pool)
    assert writer.batch_set_v1(["f0", "f1"], token_indices(pool, 0, 2)) == [True, True]
    tier = reader.movers["kv"].tiers[0]
    with reader.movers["kv"]._lock:  # as a call that asked and left
        assert [tier.lookup(b"f0").name, tier.lookup(b"f1").name] == ["RETRY", "RETRY"]
        assert tier.submit_checks() is not None
    assert reader.batch_exists(["f0", "f1"]) == 2
