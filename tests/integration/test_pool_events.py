"""The pool's own event stream over real redis-server processes: two remote
tiers (two engines) storing into one pool and one subscriber seeing both,
in order; removals the server makes itself (expiry, maxmemory eviction, a
deletion) turned into removed entries by keyspace notifications or, where
they are off, by a reconciling check; the stream bounded; ``kvtier events``
in kvtier's and vLLM's shapes, with a snapshot. Standalone and cluster."""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from conftest import block_content, finish
from kvtier.bench.redis_server import RedisServer
from kvtier.cli import build_parser
from kvtier.events_cli import main_events, vllm_batch
from kvtier.pool import HostPool
from kvtier.pool_watch import BlockNames, PoolReader, Watcher, connect, find_streams
from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.records import key_digest
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote.stream import ENTRY_BLOCKS, PoolEvent, decode_entry, xadd_commands

BLOCK = 16384


def K(i: int) -> bytes:
    """A vLLM-shaped key: a 32-byte block hash, then group 0 (its event id
    is the hash's last 8 bytes: vLLM's int block hash)."""
    return (i + 1).to_bytes(32, "big") + bytes(4)


def D(i: int) -> bytes:
    return key_digest(K(i))


def I(i: int) -> bytes:  # noqa: E743
    return vllm_event_id(K(i))


def store(t: RemoteTier, pool: HostPool, ids: list[int]) -> None:
    for j, i in enumerate(ids):
        pool.view(j)[:BLOCK] = block_content(i, BLOCK)
    assert all(finish(t, t.submit_store([K(i) for i in ids], list(range(len(ids))))))
    settle(t)


def settle(t: RemoteTier, timeout: float = 15.0) -> None:
    """Until the tier's stream entries were answered."""
    deadline = time.monotonic() + timeout
    while t.has_pending_work() and time.monotonic() < deadline:
        t.poll()
        time.sleep(0.002)
    assert not t.has_pending_work()


def summary(events: list[PoolEvent]) -> list[tuple[Any, ...]]:
    return [(e.op, e.engine, e.reason, e.digests, e.ids) for e in events if e.op]


def read_all(reader: PoolReader, position: str = "0-0") -> list[PoolEvent]:
    out = []
    while batch := reader.read(position):
        out += batch
        position = batch[-1].position
    return out


def wait_for(cond: Any, timeout: float = 20.0, every: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if every is not None:
            every()
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path)
    yield s
    s.stop()


@pytest.fixture(params=["redis_standalone", "redis_cluster", "valkey_standalone"])
def pool_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(request.param).url)


def tier(url: str, ns: str, engine: str, **kw: Any) -> RemoteTier:
    return RemoteTier(url, BLOCK, namespace=ns, engine_id=engine, **kw)


def test_two_engines_one_subscriber_in_order(pool_url: str) -> None:
    ns = str(uuid.uuid4())
    with HostPool(8, BLOCK) as pool:
        a, b = tier(pool_url, ns, "engine-a"), tier(pool_url, ns, "engine-b")
        a.attach(pool)
        b.attach(pool)
        assert a.stream == b.stream
        store(a, pool, [0, 1, 2])
        store(b, pool, [3, 4])
        store(b, pool, [1])  # stored again by another engine: said again
        a.close()
        b.close()
    client = connect(pool_url)
    assert a.stream in find_streams(client)
    reader = PoolReader(client, a.stream or b"")
    assert summary(read_all(reader)) == [
        ("stored", "engine-a", "", [D(0), D(1), D(2)], [I(0), I(1), I(2)]),
        ("stored", "engine-b", "", [D(3), D(4)], [I(3), I(4)]),
        ("stored", "engine-b", "", [D(1)], [I(1)]),
    ]
    assert a.stats()["pool_events"] == 1 and b.stats()["pool_events"] == 2
    # A subscriber that resynchronizes: what the pool holds, named.
    held = sorted(x for chunk in reader.snapshot() for x in chunk)
    assert held == sorted((D(i), I(i)) for i in range(5))
    client.close()


def test_server_removals_become_removed_entries(pool_url: str) -> None:
    """Expiry and a deletion, seen through keyspace notifications (turned on
    by the watcher), each reported once, named by the ids the stream gave."""
    ns = str(uuid.uuid4())
    with HostPool(8, BLOCK) as pool:
        t = tier(pool_url, ns, "engine-a")
        t.attach(pool)
        client = connect(pool_url)
        w = Watcher(client, t.stream or b"", maxlen=1000, enable=True, reconcile_s=3600)
        assert w.notifying
        store(t, pool, [0, 1, 2])
        w.step()  # learns the stored entry's names
        # Not 1 ms: Redis 7.0 compares the deadline with a second clock
        # reading, and a millisecond that ticks between the two makes it a
        # deletion (a ``del`` notification), not an expiry.
        client.pexpire(t.server_key(K(0)), 50)
        client.delete(t.server_key(K(2)))
        wait_for(lambda: w.counters["removed"] == 2, every=w.step)
        t.close()
    events = summary(read_all(PoolReader(client, t.stream or b"")))
    assert events[0] == ("stored", "engine-a", "", [D(0), D(1), D(2)], [I(0), I(1), I(2)])
    assert sorted(events[1:]) == [
        ("removed", w.engine_id, "deleted", [D(2)], [I(2)]),
        ("removed", w.engine_id, "expired", [D(0)], [I(0)]),
    ]
    w.close()
    client.close()


def test_ttl_and_maxmemory_evictions_leave_the_stream_telling_what_the_pool_holds(
    tmp_path: Path,
) -> None:
    """Values with a TTL and a server under maxmemory: after the watcher
    caught up, stored minus removed is exactly what the pool holds, and
    every removal has a reason the server gave. volatile-lru, as the README
    advises: the stream (no TTL) is never evicted (under allkeys-lru it can
    be, its history then lost, and Redis's LRU clock ticks once a second)."""
    srv = RedisServer(tmp_path, maxmemory="6mb")
    srv.cli("CONFIG", "SET", "maxmemory-policy", "volatile-lru")
    try:
        with HostPool(16, BLOCK) as pool:
            t = tier(srv.url, "evict", "engine-a", ttl_s=3600)
            t.attach(pool)
            client = connect(srv.url)
            w = Watcher(client, t.stream or b"", maxlen=100_000, enable=True, reconcile_s=3600)
            for first in range(0, 640, 16):
                store(t, pool, list(range(first, first + 16)))
                w.step()
            short = tier(srv.url, "evict", "engine-b", ttl_s=0.05)
            short.attach(pool)
            store(short, pool, [1000, 1001])
            held = {x for chunk in PoolReader(client, t.stream or b"").snapshot() for x, _ in chunk}
            wait_for(lambda: not client.exists(short.server_key(K(1000))))
            wait_for(lambda: not client.exists(short.server_key(K(1001))))

            def caught_up() -> bool:
                w.step()
                events = read_all(PoolReader(client, t.stream or b""))
                said: set[bytes] = set()
                for e in events:
                    (said.difference_update if e.removed else said.update)(e.digests)
                now = {x for chunk in PoolReader(client, t.stream or b"").snapshot()
                       for x, _ in chunk}  # fmt: skip
                return said == now

            wait_for(caught_up)
            short.close()
            t.close()
        events = read_all(PoolReader(client, t.stream or b""))
        reasons = {e.reason for e in events if e.removed}
        assert reasons == {"evicted", "expired"}
        assert len(held) < 640  # the server did evict
        assert all(i is not None for e in events for i in e.ids)  # every removal named
        assert w.counters["stream_lost"] == 0
        w.close()
        client.close()
    finally:
        srv.stop()


def test_without_notifications_a_reconciling_check_finds_removals(own_server: RedisServer) -> None:
    own_server.cli("CONFIG", "SET", "notify-keyspace-events", "")
    with HostPool(4, BLOCK) as pool:
        t = tier(own_server.url, "quiet", "engine-a")
        t.attach(pool)
        client = connect(own_server.url)
        w = Watcher(client, t.stream or b"", maxlen=1000, enable=False, reconcile_s=60)
        assert not w.notifying
        store(t, pool, [0, 1])
        w.step()
        client.delete(t.server_key(K(1)))
        assert w.step() == 0  # nothing heard, not due
        assert w.step(now=time.monotonic() + 61) == 1  # the check is due: found
        t.close()
    events = summary(read_all(PoolReader(client, t.stream or b"")))
    assert events == [
        ("stored", "engine-a", "", [D(0), D(1)], [I(0), I(1)]),
        ("removed", w.engine_id, "missing", [D(1)], [I(1)]),
    ]
    # A second watcher stands by: one appends at a time.
    w2 = Watcher(client, t.stream or b"", maxlen=1000, reconcile_s=60)
    client.delete(t.server_key(K(0)))
    assert w2.step(now=time.monotonic() + 61) == 0 and w2.counters["not_leader"] == 1
    w.close()
    assert w2.step(now=time.monotonic() + 122) == 1  # the lease is free again
    w2.close()
    client.close()


def test_the_stream_and_the_subscriber_stay_bounded(own_server: RedisServer) -> None:
    own_server.cli("CONFIG", "SET", "stream-node-max-entries", "8")
    with HostPool(4, BLOCK) as pool:
        t = tier(own_server.url, "bounded", "engine-a", pool_events=16)
        t.attach(pool)
        for i in range(200):
            store(t, pool, [i])
        t.close()
    client = connect(own_server.url)
    stream = t.stream or b""
    # MAXLEN ~ trims whole nodes of the stream: at most one node more.
    assert 16 <= client.xlen(stream) <= 16 + 8
    events = read_all(PoolReader(client, stream))
    assert [e.digests for e in events] == [[D(i)] for i in range(200 - len(events), 200)]
    # A subscriber names at most max_keys blocks.
    names = BlockNames(max_keys=4)
    for e in events:
        names.learn(e)
    assert len(names) == 4 and names.forgotten == len(events) - 4
    assert names.digests() == [D(i) for i in range(196, 200)]
    client.close()


def test_foreign_and_unnamed_entries() -> None:
    assert decode_entry(b"1-0", {b"op": b"other"}) is None
    assert decode_entry(b"1-0", {b"op": b"stored", b"keys": b"123"}) is None
    cmd = xadd_commands(b"s", 10, "removed", "w", "remote", [D(0), D(1)], [I(0), b"\xff" * 12], "x")
    fields = dict(zip(cmd[0][6::2], cmd[0][7::2]))
    ev = decode_entry(b"1-0", fields)
    assert ev is not None and ev.ids == [I(0), None] and ev.reason == "x"
    many = xadd_commands(b"s", 10, "stored", "e", "remote", [D(0)] * 300, [I(0)] * 300)
    assert [len(c[c.index(b"keys") + 1]) // 16 for c in many] == [ENTRY_BLOCKS, 300 - ENTRY_BLOCKS]


def run_cli(*argv: str) -> list[dict[str, Any]]:
    args = build_parser().parse_args(["events", *argv])
    out = io.StringIO()
    assert main_events(args, out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_kvtier_events_json_vllm_and_snapshot(pool_url: str) -> None:
    ns = str(uuid.uuid4())
    with HostPool(4, BLOCK) as pool:
        t = tier(pool_url, ns, "engine-a")
        t.attach(pool)
        store(t, pool, [0, 1])
        store(t, pool, [2])
        t.close()
    stream = (t.stream or b"").decode()
    lines = run_cli(pool_url, "--stream", stream, "--from-start", "--count", "2")
    assert [(x["op"], x["engine"], x["keys"], x["ids"]) for x in lines] == [
        ("stored", "engine-a", [D(0).hex(), D(1).hex()], [I(0).hex(), I(1).hex()]),
        ("stored", "engine-a", [D(2).hex()], [I(2).hex()]),
    ]
    vllm = run_cli(pool_url, "--stream", stream, "--from", lines[0]["position"], "--count", "1",
                   "--format", "vllm")  # fmt: skip
    hashes = [int.from_bytes(K(2)[-12:-4], "big")]
    assert vllm[0]["events"] == [{
        "type": "BlockStored", "block_hashes": hashes, "medium": "CPU", "group_idx": 0,
        "locality": "REMOTE", "ownership": "remote", "parent_block_hash": None, "token_ids": [],
        "block_size": 0, "lora_id": None, "lora_name": None,
    }]  # fmt: skip
    snap = run_cli(pool_url, "--stream", stream, "--snapshot", "--idle-exit", "0")
    assert snap[-1] == {"op": "snapshot_end", "position": lines[1]["position"], "blocks": 3}
    assert sorted(k for x in snap[:-1] for k in x["keys"]) == sorted(D(i).hex() for i in range(3))
    assert sorted(i for x in snap[:-1] for i in x["ids"]) == sorted(I(i).hex() for i in range(3))


def test_worker_writes_are_appended_too(redis_standalone: Any) -> None:
    """Stores a worker made (commit_write) reach the stream like the tier's own."""
    with HostPool(4, BLOCK) as pool:
        t = tier(redis_standalone.url, str(uuid.uuid4()), "engine-w", worker_io=True)
        t.attach(pool)
        r = redis.Redis.from_url(redis_standalone.url)
        for i in (5, 6):
            r.set(t.server_key(K(i)), np.zeros(8, np.uint8).tobytes())  # what a worker wrote
            t.commit_write(K(i), 0, True)
        t.commit_write(K(7), 0, False)  # a failed write is not announced
        t.poll()
        settle(t)
        t.close()
    client = connect(redis_standalone.url)
    assert summary(read_all(PoolReader(client, t.stream or b""))) == [
        ("stored", "engine-w", "", [D(5), D(6)], [I(5), I(6)]),
    ]
    client.close()
    r.close()


def test_a_store_never_acknowledged_is_not_announced(own_server: RedisServer) -> None:
    """The server killed: the stores fail and nothing reaches the stream;
    once it is back, the next stores are announced as usual."""
    with HostPool(4, BLOCK) as pool:
        t = tier(own_server.url, "killed", "engine-a", timeout_s=0.5)
        t.attach(pool)
        own_server.kill()
        pool.view(0)[:BLOCK] = block_content(0, BLOCK)
        assert finish(t, t.submit_store([K(0)], [0])) == [False]
        settle(t)
        own_server.start()
        pool.view(1)[:BLOCK] = block_content(1, BLOCK)
        for _ in range(100):  # until the tier reconnected (failures: never announced)
            if finish(t, t.submit_store([K(1)], [1])) == [True]:
                break
            time.sleep(0.05)
        settle(t)
        t.close()
    client = connect(own_server.url)
    assert summary(read_all(PoolReader(client, t.stream or b""))) == [
        ("stored", "engine-a", "", [D(1)], [I(1)]),
    ]
    client.close()


def test_vllm_shape_one_event_per_group_and_unnamed_left_out() -> None:
    g1 = (7).to_bytes(8, "big") + (1).to_bytes(4, "big")
    ev = PoolEvent("5-0", "removed", "w", "remote", 1500, [D(0), D(1), D(2)], [I(0), g1, None])
    batch = vllm_batch(ev)
    assert batch is not None and batch["ts"] == 1.5
    assert [(e["type"], e["group_idx"], e["block_hashes"]) for e in batch["events"]] == [
        ("BlockRemoved", 0, [1]),
        ("BlockRemoved", 1, [7]),
    ]
    assert vllm_batch(PoolEvent("6-0", "removed", "w", "remote", 0, [D(0)], [None])) is None
