"""The remote tier's index of the pool (kvtier.tiers.remote.index) over a real
redis-server: lookups answered from the pool's event stream with no round
trip, what another engine stored learnt from the stream, and every case
where the index must not answer a miss (a trimmed stream, a flushed server)
falling back to the server's own answer; a value the index names that is
gone is a counted miss, never bytes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import block_content as content
from conftest import block_key as K
from conftest import finish, store_blocks
from kvtier.bench.redis_server import RedisServer
from kvtier.errors import InvalidArgument
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.records import key_digest
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote.index import STALE_S
from kvtier.tiers.remote.stream import epoch_key, xadd_commands

BLOCK = 16384
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def appended(t: RemoteTier) -> None:
    """Polls writer ``t`` until its stores' stream entries are appended (the
    first poll STREAM_DELAY_S after the stores does it)."""
    until(lambda: t.poll() == [] and not t.has_pending_work(), "the stream append")


def reader(url: str, ns: str) -> RemoteTier:
    """A tier as in another engine, its index caught up with the stream."""
    t = RemoteTier(url, BLOCK, namespace=ns)
    assert t.index is not None
    until(t.index.authoritative, "the index to read the stream")
    return t


def written(url: str, pool: HostPool, ids: list[int]) -> tuple[RemoteTier, RemoteTier]:
    """A writer that stored blocks ``ids`` (in a new namespace) and a reader
    whose index learnt them from the stream."""
    ns = str(uuid.uuid4())
    t = RemoteTier(url, BLOCK, namespace=ns)
    t.attach(pool)
    assert all(store_blocks(t, pool, ids))
    appended(t)
    b = reader(url, ns)
    b.attach(pool)
    until(lambda: all(key_digest(K(i)) in b.index for i in ids), "the stores' entry")  # type: ignore[operator]
    return t, b


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path)
    yield s
    s.stop()


@pytest.mark.parametrize(
    "which", ["server", "redis_cluster", "valkey_standalone", "valkey_cluster"]
)
def test_another_engines_blocks_are_hits_and_the_rest_misses_with_no_round_trip(
    which: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(which)
    ns = str(uuid.uuid4())
    with HostPool(8, BLOCK) as pool:
        writer = RemoteTier(server.url, BLOCK, namespace=ns)
        writer.attach(pool)
        b = reader(server.url, ns)
        b.attach(pool)
        assert b.lookup(K(1)) is MISS  # an empty pool: no EXISTS asked
        assert all(store_blocks(writer, pool, [1, 2, 3]))
        appended(writer)
        until(lambda: key_digest(K(3)) in b.index, "the stored blocks' entry")  # type: ignore[operator]
        assert [b.lookup(K(i)) for i in (1, 2, 3, 4)] == [HIT, HIT, HIT, MISS]
        assert b.stats()["exists_checks"] == 0 and not b.has_pending_work()
        pool.view(5)[:] = 0
        assert all(finish(b, b.submit_load([K(2)], [5])))
        assert np.array_equal(pool.view(5)[:BLOCK], content(2))
        assert b.stats()["index"]["size"] == 3 and b.stats()["index"]["entries"] == 1
        writer.close()
        b.close()


def test_a_block_the_index_names_but_the_pool_lost_is_a_counted_miss(server: RedisServer) -> None:
    """Deleted with no watcher to say so: the index still names it, the load
    fails its check (no bytes), and the block is a miss from then on."""
    with HostPool(4, BLOCK) as pool:
        t, b = written(server.url, pool, [1])
        redis.Redis(port=server.port).delete(t.server_key(K(1)))
        assert b.lookup(K(1)) is HIT
        pool.view(2)[:] = 7
        assert finish(b, b.submit_load([K(1)], [2])) == [False]
        assert b.stats()["vanished"] == 1 and key_digest(K(1)) not in b.index  # type: ignore[operator]
        assert b.lookup(K(1)) is MISS
        t.close()
        b.close()


def test_a_block_the_index_names_is_a_miss_while_the_server_is_down(
    server: RedisServer,
) -> None:
    """A load that failed because the server is gone: the block is a miss
    for ``negative_ttl_s`` though the index (fresh for STALE_S) names it, not
    a HIT whose load fails again at once, step after step."""
    ns = str(uuid.uuid4())
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(server.url, BLOCK, namespace=ns)
        t.attach(pool)
        assert all(store_blocks(t, pool, [1]))
        appended(t)
        b = RemoteTier(server.url, BLOCK, namespace=ns, negative_ttl_s=30.0)
        b.attach(pool)
        index = b.index
        assert index is not None
        until(lambda: key_digest(K(1)) in index, "the index to learn the store")
        assert b.lookup(K(1)) is HIT
        server.stop()
        pool.view(2)[:] = 7
        assert finish(b, b.submit_load([K(1)], [2])) == [False]
        assert (pool.view(2) == 7).all()
        s = b.stats()
        assert s["load_failures"] == 1 and s["io_errors"] == 1 and s["vanished"] == 0
        assert b.lookup(K(1)) is MISS
        assert key_digest(K(1)) in index  # the value may still be there
        t.close()
        b.close()


def test_removals_in_the_stream_leave_the_index(server: RedisServer) -> None:
    with HostPool(4, BLOCK) as pool:
        t, b = written(server.url, pool, [1, 2])
        assert t.stream is not None
        client = redis.Redis(port=server.port)
        digs = [key_digest(K(1))]
        (cmd,) = xadd_commands(t.stream, 100, "removed", "watcher", "remote", digs, [b"\xff" * 12])
        client.execute_command(*cmd)
        # A foreign, malformed entry in the shared stream is skipped.
        client.xadd(t.stream, {b"op": b"stored", b"keys": b"short"})
        until(lambda: key_digest(K(1)) not in b.index, "the removal")  # type: ignore[operator]
        assert b.lookup(K(1)) is MISS and b.lookup(K(2)) is HIT
        assert b.stats()["index"]["errors"] == 0
        t.close()
        b.close()


def test_a_trimmed_stream_answers_no_misses(server: RedisServer) -> None:
    """What fell out of the stream may still be in the pool: unknown keys
    are asked of the server, as without an index."""
    ns = str(uuid.uuid4())
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(server.url, BLOCK, namespace=ns)
        t.attach(pool)
        for i in (1, 2, 3):
            assert all(store_blocks(t, pool, [i]))
            appended(t)
        assert t.stream is not None
        client = redis.Redis(port=server.port)
        until(lambda: client.xlen(t.stream) == 3, "three entries")  # type: ignore[arg-type]
        client.xtrim(t.stream, maxlen=1, approximate=False)  # type: ignore[arg-type]
        b = RemoteTier(server.url, BLOCK, namespace=ns)
        assert b.index is not None
        until(lambda: b.index.read_at > 0, "a first read")  # type: ignore[union-attr]
        assert not b.index.complete and not b.index.authoritative()
        assert b.lookup(K(3)) is HIT  # in the stream's last entry
        assert b.lookup(K(1)) is RETRY and b.lookup(K(9)) is RETRY
        until(lambda: b.poll() == [] and not b.has_pending_work(), "the EXISTS check")
        assert b.lookup(K(1)) is HIT and b.lookup(K(9)) is MISS
        assert b.stats()["exists_checks"] == 2
        t.close()
        b.close()


def test_a_flushed_server_resets_the_index(server: RedisServer) -> None:
    with HostPool(4, BLOCK) as pool:
        t, b = written(server.url, pool, [1])
        redis.Redis(port=server.port).flushall()
        until(lambda: b.stats()["index"]["resets"] == 1, "the reset")
        until(b.index.authoritative, "the index to read the new history")  # type: ignore[union-attr]
        assert len(b.index) == 0 and b.lookup(K(1)) is MISS  # type: ignore[arg-type]
        t.close()
        b.close()


def clear(client: redis.Redis, t: RemoteTier) -> int:
    """A clear of ``t``'s namespace as SGLang's backend does it: its values,
    then its stream, then its epoch up by one (the new epoch)."""
    assert t.stream is not None
    for key in client.scan_iter(match=t.server_key(b"")[:-32] + b"*"):
        client.unlink(key)
    client.unlink(t.stream)
    return int(client.incr(epoch_key(t.stream)))


def test_a_clear_is_seen_though_a_late_entry_recreated_the_stream(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer's entry for stores acknowledged before the clear lands after
    it: the recreated stream has as many entries as the deleted one, so the
    entry count shows no reset. Every index must forget the deleted blocks
    (and b what it learnt itself) by the epoch, and skip the late entry."""
    ns = str(uuid.uuid4())
    with HostPool(8, BLOCK) as pool:
        t = RemoteTier(server.url, BLOCK, namespace=ns)
        # A writer with no index knows no later epoch than its first.
        late = RemoteTier(server.url, BLOCK, namespace=ns, pool_index=False)
        t.attach(pool)
        late.attach(pool)
        assert all(store_blocks(t, pool, [1, 2]))
        appended(t)
        b = reader(server.url, ns)
        b.attach(pool)
        until(lambda: key_digest(K(2)) in b.index, "the stores' entry")  # type: ignore[operator]
        monkeypatch.setattr("kvtier.tiers.remote.announce.STREAM_DELAY_S", 3600.0)
        assert all(store_blocks(late, pool, [3]))
        assert late.has_pending_work()  # acknowledged, not announced yet
        b.known.ttl_s = 3600.0  # what b learnt itself outlives the test
        assert all(finish(b, b.submit_load([K(1)], [5])))
        client = redis.Redis(port=server.port)
        assert clear(client, t) == 1
        late._unannounced.due = 0.0  # its next poll announces the stores: after the clear
        appended(late)
        assert client.xlen(t.stream) == 1  # type: ignore[arg-type]

        def forgot() -> bool:
            b.poll()  # what it learnt (the clear is seen here) and EXISTS answers
            return [b.lookup(K(i)) for i in (1, 2, 3)] == [MISS, MISS, MISS]

        until(forgot, "b to forget the cleared blocks", timeout=30)
        assert b.index is not None and b.epoch == 1
        until(lambda: b.index.stats()["stale_entries"] == 1, "the late entry skipped")  # type: ignore[union-attr]
        until(b.index.authoritative, "the index to read the new history")
        assert (b.index.epoch, len(b.index)) == (1, 0)
        for x in (t, b, late):
            x.close()


def test_an_index_that_did_not_check_the_epoch_lately_answers_nothing(
    server: RedisServer,
) -> None:
    """A reader late by STALE_S (its thread starved) may have missed a clear:
    the tier asks the server, for blocks the index names too."""
    with HostPool(4, BLOCK) as pool:
        t, b = written(server.url, pool, [1])
        assert b.lookup(K(1)) is HIT and b.lookup(K(9)) is MISS
        assert b.index is not None
        b.index.close()
        b.index.checked_at = time.monotonic() - STALE_S
        assert b.lookup(K(1)) is RETRY and b.lookup(K(9)) is RETRY
        t.close()
        b.close()


def test_what_started_before_a_clear_is_not_learnt_present(server: RedisServer) -> None:
    """A store or a worker's write that ends after the clear may have written
    before the clear deleted: the tier neither remembers nor announces it."""
    ns = str(uuid.uuid4())
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(server.url, BLOCK, namespace=ns, worker_io=True)
        t.attach(pool)
        token = t.submit_store([K(1)], [0])
        ((_, loc, _),) = t.reserve_for_write([K(2)])
        t.cleared(clear(redis.Redis(port=server.port), t))  # as the SGLang backend's clear does
        assert finish(t, token) == [True]
        t.commit_write(K(2), int(loc[0]), True)
        assert not t.has_pending_work() and t.stats()["stores"] == 2
        assert t.lookup(K(1)) is RETRY and t.lookup(K(2)) is RETRY
        # What starts in the new epoch is learnt and announced as before.
        assert all(store_blocks(t, pool, [3]))
        assert t.lookup(K(3)) is HIT and t.has_pending_work()
        t.close()


def test_the_index_needs_the_stream(server: RedisServer) -> None:
    with pytest.raises(InvalidArgument, match="pool_index reads the pool's event stream"):
        RemoteTier(server.url, BLOCK, pool_events=0, pool_index=True)
    t = RemoteTier(server.url, BLOCK, pool_events=0)
    assert t.index is None and t.stats()["index"] is None
    t.close()
