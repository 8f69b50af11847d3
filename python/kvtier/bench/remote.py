"""``kvtier bench remote``: the remote tier's store and load throughput against
redis-benchmark (same value size and connection count, same run) and against
redis-py + hiredis with a pipeline (the usual Python approach)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.harness import PAIRED, drive_tier, paired_ratio
from kvtier.errors import InvalidArgument
from kvtier.pool import HostPool
from kvtier.tiers.remote import RemoteTier, parse_url


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
            cmd = ["redis-benchmark", "-h", host, "-p", str(port), "-t", test, "-d", str(size),
                   "-c", str(conns), "-P", str(pipeline), "-n", str(n), "--csv"]  # fmt: skip
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


def _redis_py(host: str, port: int, password: str, size: int, n: int) -> dict[str, Any]:
    import redis

    r = redis.Redis(host=host, port=port, password=password or None)
    value = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    keys = [f"kvtier-bench-py:{i}" for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, 64):
        p = r.pipeline(transaction=False)
        for k in keys[i : i + 64]:
            p.set(k, value)
        p.execute()
    ts = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, 64):
        p = r.pipeline(transaction=False)
        for k in keys[i : i + 64]:
            p.get(k)
        p.execute()
    tl = time.perf_counter() - t0
    r.delete(*keys)
    parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python"
    return {
        "store_gbps": round(n * size / ts / 1e9, 3),
        "load_gbps": round(n * size / tl / 1e9, 3),
        "parser": parser,
    }


def run_remote(
    url: str | None,
    block_bytes: int,
    total_bytes: int = 512 << 20,
    repeats: int = 3,
    connections: int = 2,
    tls: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """kvtier against the baselines on ``url`` (default: a local server);
    ``tls``: the tier's TLS files and name (tls_ca, tls_cert, tls_key,
    tls_server_name) for a rediss:// URL. The baselines speak plain TCP only:
    over TLS they are left out. Blocks for the whole run."""
    server = None
    if url is None:  # a local server of our own, on loopback
        if shutil.which("redis-server") is None:
            raise InvalidArgument("no --url given and redis-server is not installed")
        from kvtier.bench.redis_server import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-")))
        url = server.url
    cfg = parse_url(url)
    host, port = cfg["seeds"][0]
    tls = tls or {}
    n = max(16, total_bytes // block_bytes)
    slots = min(n, max(16, (256 << 20) // block_bytes))
    pool = HostPool(slots, block_bytes)
    pool.view(0, slots)[:] = 0x5A
    t = RemoteTier(
        url,
        block_bytes,
        namespace="bench",
        num_threads=connections,
        inflight_bytes=1 << 40,
        job_items=max(1, (8 << 20) // block_bytes),
        tls_ca_file=tls.get("tls_ca"),
        tls_cert_file=tls.get("tls_cert"),
        tls_key_file=tls.get("tls_key"),
        tls_server_name=tls.get("tls_server_name"),
    )
    t.attach(pool)
    batch = max(1, min(256, (16 << 20) // block_bytes))
    ks: list[float] = []
    kl: list[float] = []
    bs: list[float] = []
    bl: list[float] = []
    rs: list[float] = []
    rl: list[float] = []
    populated = False
    keys: list[bytes] = []
    py: dict[str, Any]
    plain = not cfg["tls"]  # redis-benchmark and redis-py are run over plain TCP only
    cpu = None if cfg["cluster"] or not plain else _server_cpu(host, port, cfg["password"])
    per_gb: dict[str, list[float]] = {}  # the server's CPU seconds per GB, per run

    def timed(what: str, store: bool) -> float:
        c0 = cpu() if cpu else 0.0
        gbps = n * block_bytes / drive_tier(t, store, keys, batch) / 1e9
        if cpu:
            per_gb.setdefault(what, []).append((cpu() - c0) / (n * block_bytes / 1e9))
        return gbps

    def baseline(name: str, keyspace: int, out: tuple[list[float], list[float]]) -> None:
        b = _redis_benchmark(
            host, port, cfg["password"], block_bytes, connections, max(64, n // 2), keyspace, cpu
        )
        out[0].append(b["store_gbps"])
        out[1].append(b["load_gbps"])
        for k in ("store", "load"):
            if f"{k}_server_cpu_s_per_gb" in b:
                per_gb.setdefault(f"{name} {k}", []).append(b[f"{k}_server_cpu_s_per_gb"])

    try:
        for _ in range(repeats):
            keys = [
                b"bench-%d" % i for i in range(n)
            ]  # overwritten each run, as redis-benchmark does
            ks.append(timed("kvtier store", True))
            kl.append(timed("kvtier load", False))
            if shutil.which("redis-benchmark") and not cfg["cluster"] and plain:
                baseline("redis-benchmark", 0, (bs, bl))
                populated = populated or _populate(host, port, cfg["password"], block_bytes, n)
                if populated:
                    baseline("redis-benchmark -r", n, (rs, rl))
        # Leave a user's server as it was: without kvtier's values, and
        # without the keys redis-benchmark -r wrote.
        gone = [t.server_key(k) for k in keys]
        if bs:
            gone.append(b"key:__rand_int__")  # what redis-benchmark writes without -r
        if populated:
            gone += [b"key:%012d" % k for k in range(n)]
        if plain:
            _delete(host, port, cfg["password"], cfg["cluster"], gone)
            try:
                py = _redis_py(host, port, cfg["password"], block_bytes, min(n, 2048))
            except Exception as e:
                py = {"error": str(e)}
        else:
            py = {"error": "not run over TLS"}
    finally:
        t.close()
        pool.close()
        if server is not None:
            server.stop()
    med = statistics.median
    out: dict[str, Any] = {
        "component": "remote",
        "block_bytes": block_bytes,
        "store_gbps": round(med(ks), 3),
        "load_gbps": round(med(kl), 3),
        "connections": connections,
        "checksums": "crc32c on every value",
        "runs": {"store": ks, "load": kl},
    }
    if bs:
        out["baseline"] = {
            "name": "redis-benchmark",
            "store_gbps": round(med(bs), 3),
            "load_gbps": round(med(bl), 3),
            "note": "best of -P 1 and -P 16, same value size and -c",
            "runs": {"store": bs, "load": bl},
        }
        out["ratio"] = {"store": paired_ratio(ks, bs), "load": paired_ratio(kl, bl)}
        out["ratio_method"] = PAIRED
    if rs:
        # Reported beside the baseline, not instead of it: the same tool over
        # as many distinct keys as kvtier's run, so neither side's values sit
        # in the server's cache.
        out["baseline_same_keyspace"] = {
            "name": f"redis-benchmark -r {n}",
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
    if "store_gbps" in py:
        out["redis_py"] = py
        out["vs_redis_py"] = {
            "store": round(med(ks) / float(py["store_gbps"]), 3),
            "load": round(med(kl) / float(py["load_gbps"]), 3),
        }
    return out


def run_remote_tls(
    block_bytes: int,
    total_bytes: int = 512 << 20,
    repeats: int = 3,
    connections: int = 2,
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
        "inflight_bytes": 1 << 40,
        "job_items": max(1, (8 << 20) // block_bytes),
    }
    tiers: dict[str, RemoteTier] = {}
    runs: dict[str, dict[str, list[float]]] = {
        m: {"store": [], "load": []} for m in ("plain", "tls")
    }
    batch = max(1, min(256, (16 << 20) // block_bytes))
    try:
        tiers["plain"] = RemoteTier(server.url, block_bytes, **common)
        tiers["tls"] = RemoteTier(
            server.tls_url, block_bytes, tls_ca_file=str(certs.ca),
            tls_cert_file=str(certs.client_cert), tls_key_file=str(certs.client_key), **common,
        )  # fmt: skip
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
        "connections": connections,
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
