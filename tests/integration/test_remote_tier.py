"""Remote tier against real redis-server and valkey-server processes: faults,
bad input, sharing."""

from __future__ import annotations

import contextlib
import errno
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import kvtier
import numpy as np
import pytest
import redis
from conftest import block_content as content
from conftest import block_key as K
from conftest import finish, store_blocks, valkey_binary
from kvtier.bench.redis_server import RedisCluster, RedisServer, free_port
from kvtier.engine import IO_NICE
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.remote import RemoteTier, parse_url, redact_url

BLOCK = 16384
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


SERVERS = ["redis", "valkey"]


def binary(server: str) -> str:
    return "redis-server" if server == "redis" else valkey_binary()


def look(t: RemoteTier, key: bytes) -> LookupResult:
    for _ in range(5000):
        r = t.lookup(key)
        if r is not RETRY:
            return r
        t.poll()
        time.sleep(0.001)
    raise AssertionError("lookup stayed RETRY")


def test_url_parsing() -> None:
    assert parse_url("redis://u:p%40ss@h:1234/2") == {
        "seeds": [("h", 1234)],
        "cluster": False,
        "user": "u",
        "password": "p@ss",
        "db": 2,
        "tls": False,
    }
    assert parse_url("redis://:secret@h:1")["password"] == "secret"
    assert parse_url("redis-cluster://a:1,b:2")["seeds"] == [("a", 1), ("b", 2)]
    tls = parse_url("rediss://kv:pw@h:6380")
    assert (tls["tls"], tls["cluster"], tls["user"], tls["password"]) == (True, False, "kv", "pw")
    tls = parse_url("rediss-cluster://a:1,b:2")
    assert (tls["tls"], tls["cluster"], tls["seeds"]) == (True, True, [("a", 1), ("b", 2)])
    assert redact_url("rediss://kv:p%40ss@h:1/2") == "rediss://kv:***@h:1/2"
    assert redact_url("redis://secret@h:1") == "redis://***@h:1"
    assert redact_url("redis-cluster://a:1,b:2") == "redis-cluster://a:1,b:2"
    for bad in ("http://h:1", "redis://h:port", "redis://h:1/db", "redisss://h:1"):
        with pytest.raises(kvtier.InvalidArgument):
            parse_url(bad)


def test_unreachable_server_is_a_clear_error_or_a_degraded_tier(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(kvtier.IoError) as e:
        RemoteTier(f"redis://127.0.0.1:{port}", BLOCK, timeout_s=0.5)
    assert e.value.errno == errno.ECONNREFUSED and f"127.0.0.1:{port}" in str(e.value)
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(
            f"redis://127.0.0.1:{port}", BLOCK, timeout_s=0.5, degraded_ok=True, negative_ttl_s=0.05
        )
        t.attach(pool)
        assert look(t, K(1)) is MISS  # down: a miss, never a hang
        server = RedisServer(tmp_path, port=port)
        try:
            # Stores fail until the reconnect backoff (2 s) ends: waited for
            # as conditions with a deadline, never as a margin over a delay.
            deadline = time.monotonic() + 30
            while not all(store_blocks(t, pool, [1])):
                assert time.monotonic() < deadline, "no store succeeded after the restart"
                time.sleep(0.1)
            while look(t, K(1)) is not HIT:  # recovered (once the negative answer expires)
                assert time.monotonic() < deadline, "the stored block never became a hit"
                time.sleep(0.02)
        finally:
            t.close()
            server.stop()


@pytest.mark.parametrize("server", SERVERS)
def test_wrong_password_is_a_clear_error(server: str, tmp_path: Path) -> None:
    s = RedisServer(tmp_path, password="right", binary=binary(server))
    try:
        with pytest.raises(kvtier.IoError, match=r"WRONGPASS|invalid password") as e:
            RemoteTier(f"redis://:wrong@127.0.0.1:{s.port}", BLOCK)
        assert e.value.errno == errno.EACCES
        t = RemoteTier(f"redis://:right@127.0.0.1:{s.port}", BLOCK)
        t.close()
        s.cli("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all")
        t = RemoteTier(f"redis://kv:pw@127.0.0.1:{s.port}", BLOCK)  # ACL user
        t.close()
    finally:
        s.stop()


def test_worker_threads_yield_the_cpu_unless_told(
    redis_standalone, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    t = RemoteTier(redis_standalone.url, BLOCK, num_threads=2)
    assert t.engine.nice == IO_NICE == 10
    t.close()
    t = RemoteTier(redis_standalone.url, BLOCK, num_threads=2, worker_nice=0)
    assert t.engine.nice == 0
    t.close()
    # Refused before connecting: the port has no server, yet no IoError.
    with pytest.raises(kvtier.InvalidArgument, match=r"^worker_nice must be in 0\.\.19, got 20$"):
        RemoteTier(f"redis://127.0.0.1:{free_port()}", BLOCK, worker_nice=20)
    monkeypatch.setenv("KVTIER_IO_NICE", "3")  # a whole process's default
    t = RemoteTier(redis_standalone.url, BLOCK, num_threads=2)
    assert t.engine.nice == 3
    t.close()
    for bad in ("-1", "20", "low"):
        monkeypatch.setenv("KVTIER_IO_NICE", bad)
        with pytest.raises(
            kvtier.InvalidArgument,
            match=rf"^KVTIER_IO_NICE must be an integer in 0\.\.19, got '{bad}'$",
        ):
            RemoteTier(redis_standalone.url, BLOCK, num_threads=2)


def test_async_lookup_retry_then_answer(redis_standalone) -> None:  # type: ignore[no-untyped-def]
    with HostPool(4, BLOCK) as pool:
        ns = str(uuid.uuid4())
        t = RemoteTier(redis_standalone.url, BLOCK, namespace=ns, pool_index=False)
        t.attach(pool)
        assert all(store_blocks(t, pool, [1]))
        t.known.clear()  # as another engine: nothing known locally
        assert t.lookup(K(1)) is RETRY and t.lookup(K(2)) is RETRY
        assert t.has_pending_work()
        assert look(t, K(1)) is HIT and look(t, K(2)) is MISS
        assert t.stats()["exists_checks"] == 2
        t.close()


def test_an_existence_check_answered_after_a_store_does_not_undo_it(redis_standalone) -> None:  # type: ignore[no-untyped-def]
    # Seen as a flaky cluster test: an EXISTS sent before the block's SET ran
    # ("absent") was reported after the SET's completion and made the block a
    # miss. Here the engine reports the check last on purpose (no pool
    # events: their XADD job would be in flight after the store).
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(redis_standalone.url, BLOCK, namespace=str(uuid.uuid4()), pool_events=0)
        t.attach(pool)
        assert t.lookup(K(7)) is RETRY
        t.poll()  # sends the EXISTS
        check = t.jobs.in_flight()
        t.engine.wait(check)  # answered "absent": the SET was not sent yet
        real_poll = t.engine.poll
        t.engine.poll = lambda: sorted(real_poll(), key=lambda r: r.job_id in check)
        pool.view(0)[:BLOCK] = content(7)
        token = t.submit_store([K(7)], [0])
        t.engine.wait(t.jobs.in_flight() - check)  # both answered: one poll reports both
        assert [c.token for c in t.poll()] == [token]
        assert not t.jobs.in_flight() and t.lookup(K(7)) is HIT
        assert look(t, K(8)) is MISS  # checks still answer for keys nothing stored
        t.engine.poll = real_poll
        t.close()


@pytest.mark.parametrize(
    "block,window_bytes",
    [(BLOCK, 1), (BLOCK, 3 * (BLOCK + 64)), (BLOCK, 1 << 30), (600_000, 1 << 20),
     # Loads of values of a quarter of a window are pipelined too (a vLLM
     # block of a small model); a larger one goes one at a time.
     (128 << 10, 512 << 10), (256 << 10, 512 << 10)],
)  # fmt: skip
def test_pipelined_windows_round_trip_and_detect_damage(  # type: ignore[no-untyped-def]
    redis_standalone, block: int, window_bytes: int
) -> None:
    """Windows of one, three and all the job's values (and values bigger than
    the client's 256 KiB receive piece, so the checksum is extended over
    several pieces) carry every byte; a flipped byte in the middle of a
    window is caught by the checksum computed while receiving, and a value
    gone from the server (a nil reply in a window) fails only its own key."""
    client = redis.Redis(host="127.0.0.1", port=redis_standalone.port)
    rng = np.random.default_rng(block + window_bytes)
    with HostPool(40, block) as pool:
        t = RemoteTier(
            redis_standalone.url,
            block,
            namespace=str(uuid.uuid4()),
            window_bytes=window_bytes,
            job_items=20,
            num_threads=2,  # ten values per connection: several windows each
        )
        t.attach(pool)
        data = rng.integers(0, 256, (20, block), dtype=np.uint8)
        for j in range(20):
            pool.view(j)[:block] = data[j]
        keys = [K(i) for i in range(20)]
        assert finish(t, t.submit_store(keys, list(range(20)))) == [True] * 20
        sk, at = t.server_key(keys[9]), block - 3  # a payload byte (the header follows it)
        client.setrange(sk, at, bytes(b ^ 0xFF for b in client.getrange(sk, at, at + 1)))
        client.delete(t.server_key(keys[14]))
        oks = finish(t, t.submit_load(keys, list(range(20, 40))))
        assert oks == [True] * 9 + [False] + [True] * 4 + [False] + [True] * 5
        for j in range(20):
            if j not in (9, 14):
                assert np.array_equal(pool.view(20 + j)[:block], data[j]), j
        assert t.stats()["corrupt"] == 1 and t.stats()["vanished"] == 1
        t.close()
    with pytest.raises(kvtier.InvalidArgument):
        RemoteTier(redis_standalone.url, block, window_bytes=0)


@pytest.mark.parametrize("fixture", ["redis_standalone", "valkey_standalone"])
def test_vanished_and_corrupted_values_are_misses(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(fixture)
    client = redis.Redis(host="127.0.0.1", port=server.port)
    with HostPool(18, BLOCK) as pool:
        t = RemoteTier(server.url, BLOCK, namespace=str(uuid.uuid4()))
        t.attach(pool)
        ids = list(range(9))
        assert all(store_blocks(t, pool, ids))
        sk = [t.server_key(K(i)) for i in ids]
        # A value is its payload (BLOCK bytes) then a 64-byte header.
        client.delete(sk[0])  # vanished (as maxmemory eviction would)
        client.setrange(sk[1], BLOCK + 5, b"\xff")  # header byte flipped
        client.setrange(sk[2], 777, b"\x00\x01")  # payload bytes flipped
        client.set(sk[3], client.get(sk[3])[:100])  # truncated
        client.set(sk[4], b"not a kvtier value at all")  # foreign
        client.set(sk[5], client.get(t.server_key(K(7))))  # another key's value
        client.setrange(sk[6], BLOCK + 63, b"\x01")  # the header's last reserved byte
        oks = finish(t, t.submit_load([K(i) for i in ids], list(range(9, 18))))
        assert oks == [False] * 7 + [True] * 2
        for j in (7, 8):
            assert np.array_equal(pool.view(9 + j)[:BLOCK], content(j))
        s = t.stats()
        assert s["load_failures"] == 7 and s["vanished"] == 1 and s["corrupt"] == 6
        assert all(look(t, K(i)) is MISS for i in range(7))
        t.close()


def test_ttl_expires_values(redis_standalone) -> None:  # type: ignore[no-untyped-def]
    with HostPool(4, BLOCK) as pool:
        t = RemoteTier(redis_standalone.url, BLOCK, namespace=str(uuid.uuid4()), ttl_s=0.3)
        t.attach(pool)
        assert all(store_blocks(t, pool, [1]))
        ttl = redis.Redis(port=redis_standalone.port).pttl(t.server_key(K(1)))
        assert 0 < ttl <= 300
        time.sleep(0.5)
        assert finish(t, t.submit_load([K(1)], [2])) == [False]
        assert t.stats()["vanished"] == 1
        t.close()


@pytest.mark.parametrize("server", SERVERS)
def test_maxmemory_eviction_means_misses_not_errors(server: str, tmp_path: Path) -> None:
    s = RedisServer(tmp_path, maxmemory="3mb", binary=binary(server))
    try:
        with HostPool(64, BLOCK) as pool:
            t = RemoteTier(s.url, BLOCK)
            t.attach(pool)
            for start in range(0, 256, 64):  # 4 MiB of values into 3 MiB
                store_blocks(t, pool, list(range(start, start + 64)))
            ids = list(range(0, 256, 4))
            oks = finish(t, t.submit_load([K(i) for i in ids], list(range(64))))
            assert 0 < sum(oks) < 64  # the server evicted some of them
            for j, (i, ok) in enumerate(zip(ids, oks)):
                if ok:
                    assert np.array_equal(pool.view(j)[:BLOCK], content(i))
            assert t.stats()["vanished"] == 64 - sum(oks)
            t.close()
    finally:
        s.stop()


def _storm(t: RemoteTier, pool: HostPool, n: int, kill, seconds: float) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Loads in a loop; `kill` runs mid-way. Returns (ok, failed); asserts no hang."""
    ok = failed = 0
    outstanding: dict[int, float] = {}
    t0 = time.monotonic()
    killed = False
    while time.monotonic() - t0 < seconds or outstanding:
        if time.monotonic() - t0 < seconds and len(outstanding) < 4:
            tok = t.submit_load([K(i) for i in range(n)], list(range(n)))
            if tok is not None:
                outstanding[tok] = time.monotonic()
        if not killed and time.monotonic() - t0 > seconds / 3:
            kill()
            killed = True
        for c in t.poll():
            outstanding.pop(c.token, None)
            for j, good in enumerate(c.key_ok or []):
                if good:
                    ok += 1
                    assert np.array_equal(pool.view(j)[:BLOCK], content(j)), "wrong bytes served"
                else:
                    failed += 1
        for since in outstanding.values():
            assert time.monotonic() - since < 10, "a job outlived its timeout"
        time.sleep(0.001)
    return ok, failed


@contextlib.contextmanager
def _stormed(url: str, n: int, kill: Callable[[], object]) -> Iterator[tuple[RemoteTier, HostPool]]:
    """A tier (1 s timeout) holding blocks 0..n-1, through a 1.5 s storm of
    loads with ``kill`` run mid-way: some loads served, some failed, none
    hung. The tier is closed after the test's block."""
    with HostPool(n, BLOCK) as pool:
        t = RemoteTier(url, BLOCK, timeout_s=1.0)
        t.attach(pool)
        assert all(store_blocks(t, pool, list(range(n))))
        ok, failed = _storm(t, pool, n, kill, 1.5)
        assert ok > 0 and failed > 0
        yield t, pool
        t.close()


@pytest.mark.parametrize("server", SERVERS)
def test_server_killed_mid_storm_no_hang_then_recovery(server: str, tmp_path: Path) -> None:
    s = RedisServer(tmp_path, binary=binary(server))
    try:
        with _stormed(s.url, 32, s.kill) as (t, pool):
            s.start()  # same port, empty (no persistence)
            deadline = time.monotonic() + 30  # past the reconnect backoff (2 s)
            while not all(store_blocks(t, pool, list(range(32)))) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(finish(t, t.submit_load([K(i) for i in range(32)], list(range(32)))))
    finally:
        s.stop()


@pytest.mark.parametrize("server", SERVERS)
def test_cluster_master_killed_mid_storm(server: str, tmp_path: Path) -> None:
    c = RedisCluster(tmp_path, binary=binary(server))
    try:
        with _stormed(c.url, 48, c.nodes[1].kill) as (t, _):
            # keys on the two live masters still load
            oks = finish(t, t.submit_load([K(i) for i in range(48)], list(range(48))))
            assert 0 < sum(oks) < 48
    finally:
        c.stop()


CHILD = textwrap.dedent("""
    import sys, time, numpy as np
    from kvtier.pool import HostPool
    from kvtier.tiers.remote import RemoteTier
    BLOCK = 16384
    def content(i):
        return ((np.arange(BLOCK, dtype=np.uint32) * 2654435761 + i * 97) >> 7).astype(np.uint8)
    p = HostPool(16, BLOCK)
    t = RemoteTier(sys.argv[1], BLOCK, namespace="shared-model")
    t.attach(p)
    for i in range(16):
        p.view(i)[:] = content(i)
    tok = t.submit_store([b"blk-%010d" % i for i in range(16)], list(range(16)))
    while True:
        done = [c for c in t.poll() if c.token == tok]
        if done:
            print(sum(done[0].key_ok))
            break
        time.sleep(0.001)
""")


@pytest.mark.parametrize(
    "server", ["redis_standalone", "redis_cluster", "valkey_standalone", "valkey_cluster"]
)
def test_two_processes_share_a_prefix(
    server: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    srv = request.getfixturevalue(server)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run(
        [sys.executable, str(script), srv.url], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "16", out.stderr
    with HostPool(16, BLOCK) as pool:
        t = RemoteTier(srv.url, BLOCK, namespace="shared-model")
        t.attach(pool)
        assert all(look(t, K(i)) is HIT for i in range(16))
        assert all(finish(t, t.submit_load([K(i) for i in range(16)], list(range(16)))))
        for i in range(16):
            assert np.array_equal(pool.view(i)[:BLOCK], content(i))
        other = RemoteTier(srv.url, BLOCK, namespace="another-model")
        assert look(other, K(0)) is MISS  # namespaces never mix
        other.close()
        t.close()


def test_replay_through_host_and_remote(redis_standalone, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "replay",
            "--max-requests",
            "400",
            "--host-blocks",
            "64",
            "--block-bytes",
            "16KiB",
            "--remote",
            redis_standalone.url,
            "--no-progress",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    import json

    js = json.loads((tmp_path / "r.json").read_text())
    assert js["verify_failures"] == 0
    assert js["hit_blocks"]["remote"] > 0 and js["hit_blocks"]["host"] > 0
    assert js["tiers"]["remote"]["corrupt"] == 0


def test_a_server_that_stops_answering_fails_jobs_at_the_timeout_then_recovers(
    tmp_path: Path,
) -> None:
    """SIGSTOP: connections stay open and silent (a hung server, not a dead
    one). Plain-TCP connections block in recv() with the I/O timeout as the
    socket's own timeout: the load fails by then, never hangs, never serves
    other bytes; after SIGCONT the same tier loads again."""
    import signal

    s = RedisServer(tmp_path)
    try:
        with HostPool(8, BLOCK) as pool:
            t = RemoteTier(s.url, BLOCK, timeout_s=0.5, num_threads=2)
            t.attach(pool)
            assert all(store_blocks(t, pool, list(range(8))))
            pool.view(0, 8)[:] = 0
            assert s.proc is not None
            s.proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                token = t.submit_load([K(i) for i in range(8)], list(range(8)))
                done = None
                while done is None and time.monotonic() - t0 < 10:
                    done = next((c for c in t.poll() if c.token == token), None)
                    time.sleep(0.005)
                waited = time.monotonic() - t0
            finally:
                s.proc.send_signal(signal.SIGCONT)
            assert done is not None, "the load hung on a silent server"
            assert not done.ok and done.key_ok == [False] * 8
            assert "timed out" in done.error.lower(), done.error
            assert 0.4 < waited < 5, waited
            assert not pool.view(0, 8).any(), "a failed load wrote into its slots"
            deadline = time.monotonic() + 10
            ok: list[bool] = [False]
            while not all(ok) and time.monotonic() < deadline:
                time.sleep(0.2)
                ok = finish(t, t.submit_load([K(i) for i in range(8)], list(range(8))))
            assert all(ok)
            for i in range(8):
                assert np.array_equal(pool.view(i)[:BLOCK], content(i))
            t.close()
    finally:
        s.stop()
