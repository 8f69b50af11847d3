"""``kvtier bench remote``: the remote tier's store and load throughput against
redis-benchmark (same value size and connection count, same run) and against
redis-py + hiredis with a pipeline (the usual Python approach).

A command-line tool: runs in the ``kvtier`` process (the
baselines' clients as child processes or threads of it, the server local
unless ``--url``). Who calls: :mod:`kvtier.bench.commands`. Blocks for the
whole run.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.harness import (
    PAIRED,
    default_output_dir,
    drive_tier,
    paired_ratio,
    process_cpu_s,
)
from kvtier.bench.peers import (
    LMCACHE_BATCH,
    LMCACHE_VERSION,
    LMCACHE_WORKERS,
    LMCachePeer,
    RedisPyPeer,
    SlotBuffer,
    lmcache_redis,
)
from kvtier.errors import InvalidArgument
from kvtier.options.tiers import RemoteOptions
from kvtier.pool import HostPool
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.url import parse_url


def _populate(host: str, port: int, password: str, size: int, keys: int) -> bool:
    """The keys redis-benchmark's ``-r`` draws from (``key:%012d``), so that
    its random GETs all hit. False when redis-py is missing."""
    try:
        import redis
    except ImportError:
        return False
    r = redis.Redis(host=host, port=port, password=password or None)
    value = b"x" * size
    for i in range(0, keys, 64):
        p = r.pipeline(transaction=False)
        for k in range(i, min(keys, i + 64)):
            p.set(b"key:%012d" % k, value)
        p.execute()
    return True


def _server_cpu(host: str, port: int, password: str) -> Callable[[], float] | None:
    """The server's own CPU seconds so far (INFO cpu: user + sys), or None
    without redis-py or the right to run INFO. Per GB moved, it shows whose requests cost the single
    server thread, the bottleneck of every figure here, more."""
    try:
        import redis
    except ImportError:
        return None
    r = redis.Redis(host=host, port=port, password=password or None)

    def used() -> float:
        info = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    try:
        used()
    except redis.RedisError:  # INFO not allowed for this user, say: leave it out
        return None
    return used


def _redis_benchmark(
    host: str,
    port: int,
    password: str,
    size: int,
    conns: int,
    n: int,
    keyspace: int = 0,
    cpu: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Best of -P 1 and -P 16, SET and GET run apart; with ``cpu``, the
    server's CPU seconds per GB of that best run too. keyspace=0:
    redis-benchmark as shipped, one key overwritten and read again (its
    value stays in the server's cache); else random keys over ``keyspace``
    keys, like kvtier's run."""
    best: dict[str, float] = {"store_gbps": 0.0, "load_gbps": 0.0}
    for pipeline in (1, 16):
        for test, what in (("set", "store"), ("get", "load")):
            cmd = [
                "redis-benchmark",
                "-h",
                host,
                "-p",
                str(port),
                "-t",
                test,
                "-d",
                str(size),
                "-c",
                str(conns),
                "-P",
                str(pipeline),
                "-n",
                str(n),
                "--csv",
            ]
            if keyspace:
                cmd += ["-r", str(keyspace)]
            if password:
                cmd += ["-a", password]
            c0 = cpu() if cpu else 0.0
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
            used = (cpu() - c0) if cpu else 0.0
            for line in out.splitlines():
                cells = [c.strip('"') for c in line.split(",")]
                if len(cells) < 2 or cells[0] != test.upper():
                    continue
                gbps = float(cells[1]) * size / 1e9
                if gbps > best[f"{what}_gbps"]:
                    best[f"{what}_gbps"] = gbps
                    if cpu:
                        best[f"{what}_server_cpu_s_per_gb"] = used / (n * size / 1e9)
    return best


def _delete(host: str, port: int, password: str, cluster: bool, keys: list[bytes]) -> None:
    """Removes the benchmark's keys (a cluster's one by one: they live in
    many slots). Nothing when redis-py is missing."""
    try:
        import redis
        from redis.cluster import RedisCluster
    except ImportError:
        return
    if cluster:
        rc = RedisCluster(host=host, port=port, password=password or None)
        for k in keys:
            rc.delete(k)
        rc.close()
        return
    r = redis.Redis(host=host, port=port, password=password or None)
    for i in range(0, len(keys), 1024):
        r.delete(*keys[i : i + 1024])
    r.close()


def run_remote(
    url: str | None,
    block_bytes: int,
    total_bytes: int = 512 << 20,
    repeats: int = 3,
    connections: int | None = None,
    tls: dict[str, Any] | None = None,
    peers: Sequence[str] = (),
    peer_cache: Path | None = None,
) -> dict[str, Any]:
    """kvtier against the baselines on ``url`` (default: a local server).

    kvtier runs with the remote tier's defaults (``connections`` overrides its
    worker threads). Each repeat runs, in an order rotating between repeats,
    kvtier, redis-py + hiredis and each of ``peers`` (``"lmcache"``: LMCache's
    native client, its wheel cached in ``peer_cache``): the same number of
    values of ``block_bytes`` (each client's written once untimed first, so
    that every timed store overwrites), stored then loaded into cleared slots
    and compared byte for byte; then redis-benchmark. ``tls``: the tier's TLS files
    and name for a rediss:// URL; the other clients speak plain TCP only and
    are left out over TLS. Blocks for the whole run."""
    server = None
    if url is None:  # a local server of our own, on loopback
        if shutil.which("redis-server") is None:
            raise InvalidArgument("no --url given and redis-server is not installed")
        from kvtier.bench.redis_server import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-")))
        url = server.url
    cfg = parse_url(url)
    host, port = cfg["seeds"][0]
    password = cfg["password"]
    tls = tls or {}
    n = max(16, total_bytes // block_bytes)
    slots = min(n, max(16, (256 << 20) // block_bytes))
    pool = HostPool(slots, block_bytes)
    own = SlotBuffer(pool.view(0, slots), seed=0)
    t = RemoteTier(
        url,
        block_bytes,
        namespace="bench",
        options=replace(RemoteOptions(url, num_threads=connections), **tls),
    )
    t.attach(pool)
    batch = max(1, min(256, (16 << 20) // block_bytes))
    keys = [b"bench-%d" % i for i in range(n)]
    plain = not cfg["tls"]  # redis-benchmark and the other clients speak plain TCP only
    cpu = None if cfg["cluster"] or not plain else _server_cpu(host, port, password)
    per_gb: dict[str, list[float]] = {}  # the server's CPU seconds per GB, per run
    busy: dict[str, list[float]] = {}  # the server thread's share of the run's time
    client_gb: dict[str, list[float]] = {}  # this process's CPU seconds per GB (every client)
    runs: dict[str, dict[str, list[float]]] = {}
    skipped: dict[str, str] = {}

    class Kvtier:
        name = "kvtier"

        def move(self, store: bool) -> None:
            # Polled every millisecond, as an engine's scheduler steps would
            # (its queue holds 4 batches, tens of milliseconds of work).
            drive_tier(t, store, keys, batch, poll_s=0.001)

        def server_keys(self) -> list[bytes]:
            return [t.server_key(k) for k in keys]

        def close(self) -> None:
            pass

    # Every client moves bytes from and to the same kind of memory: a host
    # pool's shared memory, as an engine's host tier. (numpy's own buffers
    # get transparent huge pages here and shared memory does not, which
    # changes what the copies into and out of the kernel cost.)
    peer_pools: list[HostPool] = []

    def peer_slots() -> np.ndarray:
        peer_pools.append(HostPool(slots, block_bytes))
        return peer_pools[-1].view(0, slots)

    clients: list[Any] = [Kvtier()]
    if plain and not cfg["cluster"]:
        try:
            clients.append(RedisPyPeer(host, port, password, SlotBuffer(peer_slots(), seed=1), n))
        except ImportError:
            skipped["redis-py"] = "redis-py is not installed"
        for peer in peers:
            if peer != "lmcache":
                raise InvalidArgument(f"unknown peer {peer!r} (known: lmcache)")
            mod, why = lmcache_redis(peer_cache or default_output_dir("bench-peers"))
            if mod is None:
                skipped[LMCachePeer.name] = why
                print(f"kvtier bench remote: {LMCachePeer.name} left out: {why}", file=sys.stderr)
                continue
            clients.append(
                LMCachePeer(mod, host, port, password, SlotBuffer(peer_slots(), seed=2), n)
            )
    elif peers:
        skipped["peers"] = "the other clients speak plain TCP to one server only"

    def turn(c: Any) -> None:
        """One client's store then load, timed apart (with the server's CPU),
        the load into cleared slots and verified; its keys deleted after."""
        buf = own if c.name == "kvtier" else c.buf
        r = runs.setdefault(c.name, {"store": [], "load": []})
        for what in ("store", "load"):
            if what == "load":
                buf.clear()
            c0 = cpu() if cpu else 0.0
            own0 = process_cpu_s()
            t0 = time.perf_counter()
            c.move(what == "store")
            secs = time.perf_counter() - t0
            r[what].append(round(n * block_bytes / secs / 1e9, 3))
            client_gb.setdefault(f"{c.name} {what}", []).append(
                (process_cpu_s() - own0) / (n * block_bytes / 1e9)
            )
            if cpu:
                used = cpu() - c0
                per_gb.setdefault(f"{c.name} {what}", []).append(used / (n * block_bytes / 1e9))
                busy.setdefault(f"{c.name} {what}", []).append(used / secs)
        buf.verify(c.name)

    bench: dict[str, tuple[list[float], list[float]]] = {}

    def baseline(name: str, keyspace: int) -> None:
        b = _redis_benchmark(
            host, port, password, block_bytes, t.num_threads, max(64, n // 2), keyspace, cpu
        )
        out = bench.setdefault(name, ([], []))
        out[0].append(b["store_gbps"])
        out[1].append(b["load_gbps"])
        for k in ("store", "load"):
            if f"{k}_server_cpu_s_per_gb" in b:
                per_gb.setdefault(f"{name} {k}", []).append(b[f"{k}_server_cpu_s_per_gb"])

    populated = False
    try:
        # Every timed store overwrites values of the same size, as an engine's
        # pool does at steady state: the server's memory for them is already
        # faulted in (filling it for the first time cost the server 2-3x the
        # CPU per GB here, whoever the client).
        for c in clients:
            c.move(True)
        for rep in range(repeats):
            for i in range(len(clients)):
                turn(clients[(rep + i) % len(clients)])
            if shutil.which("redis-benchmark") and not cfg["cluster"] and plain:
                baseline("redis-benchmark", 0)
                populated = populated or _populate(host, port, password, block_bytes, n)
                if populated:
                    baseline(f"redis-benchmark -r {n}", n)
        # Leave a user's server as it was: without any client's keys, nor the
        # keys redis-benchmark wrote.
        gone = [k for c in clients for k in c.server_keys()]
        gone += [b"key:__rand_int__"] if bench else []
        if populated:
            gone += [b"key:%012d" % k for k in range(n)]
        if plain:
            _delete(host, port, password, cfg["cluster"], gone)
    finally:
        for c in clients:
            c.close()
        t.close()
        pool.close()
        for p in peer_pools:
            p.close()
        if server is not None:
            server.stop()
    med = statistics.median
    ks, kl = runs["kvtier"]["store"], runs["kvtier"]["load"]
    out: dict[str, Any] = {
        "component": "remote",
        "block_bytes": block_bytes,
        "store_gbps": round(med(ks), 3),
        "load_gbps": round(med(kl), 3),
        "connections": t.num_threads,
        "values": n,
        "checksums": "crc32c on every value",
        "verified": "every loaded byte compared with what was stored, every client",
        "runs": runs["kvtier"],
    }
    if "redis-benchmark" in bench:
        bs, bl = bench["redis-benchmark"]
        out["baseline"] = {
            "name": "redis-benchmark",
            "store_gbps": round(med(bs), 3),
            "load_gbps": round(med(bl), 3),
            "note": "best of -P 1 and -P 16, same value size and -c",
            "runs": {"store": bs, "load": bl},
        }
        out["ratio"] = {"store": paired_ratio(ks, bs), "load": paired_ratio(kl, bl)}
        out["ratio_method"] = PAIRED
    same = next((k for k in bench if k.startswith("redis-benchmark -r")), None)
    if same:
        # Reported beside the baseline, not instead of it: the same tool over
        # as many distinct keys as kvtier's run, so neither side's values sit
        # in the server's cache.
        rs, rl = bench[same]
        out["baseline_same_keyspace"] = {
            "name": same,
            "store_gbps": round(med(rs), 3),
            "load_gbps": round(med(rl), 3),
            "runs": {"store": rs, "load": rl},
            # the repeats before the keyspace could be populated have no pair
            "ratio": {
                "store": paired_ratio(ks[-len(rs) :], rs),
                "load": paired_ratio(kl[-len(rl) :], rl),
            },
        }
    if per_gb:
        # Why the baselines differ: the single server thread is the limit, and
        # rewriting one cached value costs it less than filling many keys.
        out["server_cpu_s_per_gb"] = {k: round(med(v), 3) for k, v in per_gb.items()}
    # The clients' own cost (all threads of this process; each runs alone).
    out["client_cpu_s_per_gb"] = {k: round(med(v), 3) for k, v in client_gb.items()}
    if busy:
        # Near 1.0: the server's one thread was busy all the run long, so no
        # client can go faster on this server, whatever it does.
        out["server_thread_busy"] = {k: round(med(v), 2) for k, v in busy.items()}
    for c in clients[1:]:
        r = runs[c.name]
        vs = {w: paired_ratio(runs["kvtier"][w], r[w]) for w in ("store", "load")}
        summary = {
            "name": c.name,
            "store_gbps": round(med(r["store"]), 3),
            "load_gbps": round(med(r["load"]), 3),
            "runs": r,
        }
        if isinstance(c, RedisPyPeer):
            out["redis_py"], out["vs_redis_py"] = summary, vs
        else:
            out.setdefault("peers", {})[c.name] = {**summary, "ratio": vs}
    if len(clients) > 1:
        out["peers_method"] = "median over repeats of kvtier / client, the order rotating"
    if skipped:
        out["peers_left_out"] = skipped
    if any(isinstance(c, LMCachePeer) for c in clients):
        out["lmcache"] = {
            "version": LMCACHE_VERSION,
            "workers": LMCACHE_WORKERS,
            "batch": LMCACHE_BATCH,
        }
    return out


def run_remote_tls(
    block_bytes: int,
    total_bytes: int = 512 << 20,
    repeats: int = 3,
    connections: int | None = None,
) -> dict[str, Any]:
    """What TLS costs the remote tier: a local redis-server serving a plain
    and a TLS port (certificates made for the run, a client certificate
    asked for), kvtier's store and load through each port in turn, the order
    alternating between repeats. The ratio is TLS over plain, paired per
    repeat. Blocks for the whole run."""
    from kvtier.bench.redis_server import RedisServer, make_certificates

    if shutil.which("redis-server") is None:
        raise InvalidArgument("bench remote --tls starts a local redis-server: it is not installed")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-tls-"))
    certs = make_certificates(work / "certs")
    server = RedisServer(work, tls=certs)
    n = max(16, total_bytes // block_bytes)
    slots = min(n, max(16, (256 << 20) // block_bytes))
    pool = HostPool(slots, block_bytes)
    pool.view(0, slots)[:] = 0x5A
    common: dict[str, Any] = {
        "namespace": "bench-tls",
        "num_threads": connections,
    }
    tiers: dict[str, RemoteTier] = {}
    runs: dict[str, dict[str, list[float]]] = {
        m: {"store": [], "load": []} for m in ("plain", "tls")
    }
    batch = max(1, min(256, (16 << 20) // block_bytes))
    try:
        tiers["plain"] = RemoteTier(server.url, block_bytes, **common)
        tiers["tls"] = RemoteTier(
            server.tls_url,
            block_bytes,
            tls_ca_file=str(certs.ca),
            tls_cert_file=str(certs.client_cert),
            tls_key_file=str(certs.client_key),
            **common,
        )
        for t in tiers.values():
            t.attach(pool)
        keys = [b"bench-tls-%d" % i for i in range(n)]
        for r in range(repeats):
            for mode in ("plain", "tls") if r % 2 == 0 else ("tls", "plain"):
                for what in ("store", "load"):
                    secs = drive_tier(tiers[mode], what == "store", keys, batch)
                    runs[mode][what].append(n * block_bytes / secs / 1e9)
    finally:
        for t in tiers.values():
            t.close()
        pool.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    return {
        "component": "remote-tls",
        "block_bytes": block_bytes,
        "connections": tiers["plain"].num_threads,
        "store_gbps": round(med(runs["tls"]["store"]), 3),
        "load_gbps": round(med(runs["tls"]["load"]), 3),
        "baseline": {
            "name": "kvtier without TLS, same server (its plain port)",
            "store_gbps": round(med(runs["plain"]["store"]), 3),
            "load_gbps": round(med(runs["plain"]["load"]), 3),
        },
        "ratio": {
            "store": paired_ratio(runs["tls"]["store"], runs["plain"]["store"]),
            "load": paired_ratio(runs["tls"]["load"], runs["plain"]["load"]),
        },
        "ratio_method": "median over repeats of TLS / plain, the order alternating",
        "tls": "TLS 1.3 (OpenSSL's default suite), EC P-256 certificates, client certificate",
        "runs": {m: {k: [round(x, 3) for x in v] for k, v in r.items()} for m, r in runs.items()},
    }
