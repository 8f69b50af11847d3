"""``kvtier bench sglang``: kvtier's SGLang HiCache backend against SGLang's
own file backend (``HiCacheFile``) on the same directory, and against a
redis-py + hiredis backend (pipelined GET/SET/EXISTS of SGLang's flat data
pages: the usual Python approach; SGLang ships no Redis backend) on the same
Redis; same host pool, page size and batch size for every contender.

Each contender is driven by SGLang's own cache-controller code
(:func:`kvtier.bench.sglang_standin.controller`: its backup, hit query and
prefetch transfer, in SGLang's batches of ``STORAGE_BATCH_SIZE`` pages):
kvtier through the zero-copy calls SGLang picks for a dynamic backend with
``interface_v1`` (``batch_set_v1``, ``batch_get_v1``), ``HiCacheFile`` and
the redis-py backend through the generic ones (``batch_set`` of
``get_data_page`` pages; ``batch_get`` into ``get_dummy_flat_data_page``
pages, then ``set_from_flat_data_page``); ``exists`` is the hit query
(``batch_exists`` per batch; the page hashes, the same work for every
backend, computed beforehand). A repeat backs up fresh pages, finds
them, reads them back (verified byte for byte); contenders take turns in a
rotating order.

kvtier runs twice: its disk tier alone (direct I/O: reads from the device)
and with its memory tier in front (``kvtier_host_bytes``, twice a run's
pages: reads of pages just stored from memory). ``vs_hicache_file`` pairs
the memory tier with HiCacheFile as SGLang runs it (its reads from the page
cache), ``vs_hicache_file_device`` the disk alone with HiCacheFile synced and
dropped from the page cache (both from the device), and
``disk_vs_hicache_file`` the disk alone with the page cache.

A command-line tool: runs in the ``kvtier`` process. Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.harness import PAIRED, paired_ratio
from kvtier.bench.node import start_node
from kvtier.bench.sglang_standin import (
    controller,
    fill,
    hicache_file,
    host_pool,
    open_storage,
    page_bytes,
    page_hashes,
    sglang_version,
    storage_batch_pages,
    token_indices,
)
from kvtier.tiers.records import record_bytes

OPS = ("set", "exists", "get")
#: Page geometries measured by default: (name, pool kwargs, pages per run).
SHAPES = (
    ("32KiB pages", {"page_size": 16, "layers": 4, "heads": 2, "head_dim": 64}, 1024),
    ("1MiB pages", {"page_size": 64, "layers": 8, "heads": 4, "head_dim": 128}, 128),
)


class RedisPyPages:
    """The redis-py baseline: SGLang's generic storage calls over one
    connection, pipelines of one batch."""

    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)
        self.prefix = b"sglang-py:"

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> bool:
        p = self.r.pipeline(transaction=False)
        for k, v in zip(keys, values):
            p.set(self.prefix + k.encode(), v.contiguous().view(torch.uint8).numpy().tobytes())
        return all(p.execute())

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[torch.Tensor | None]:
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.get(self.prefix + k.encode())
        out: list[torch.Tensor | None] = []
        for v, t in zip(p.execute(), targets):
            if v is None:
                out.append(None)
                continue
            t.view(torch.uint8).copy_(torch.frombuffer(bytearray(v), dtype=torch.uint8))
            out.append(t)
        return out

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.exists(self.prefix + k.encode())
        hits = p.execute()
        return hits.index(0) if 0 in hits else len(hits)

    def close(self) -> None:
        self.r.flushall()
        self.r.close()


def _drop_cached(directory: Path) -> None:
    """Evict ``directory``'s files from the page cache (they are clean after
    a sync): later reads come from the device, as kvtier's direct reads do."""
    for path in directory.glob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_once(
    ctl: Any, tokens: list[int], pool: Any, device: Path | None = None
) -> dict[str, float]:
    """Seconds per op for the pages of ``tokens`` through SGLang's controller
    ``ctl``: ``set`` backs up pages ``[0, n)``, ``exists`` is the prefetch's
    hit query, ``get`` its transfer into pages ``[n, 2 n)`` (verified byte
    for byte). ``device``: the contender's files in that directory go to the
    device before ``set`` ends (a sync, timed) and leave the page cache
    before ``get`` (untimed), so both come from the device as kvtier's do."""
    n = len(tokens) // pool.page_size
    hashes = page_hashes(tokens, pool.page_size)
    # Each contender starts on a quiet device: the file backend's writes of
    # the run before would otherwise be written back during this one.
    os.sync()
    secs: dict[str, float] = {}
    backup = ctl.StorageOperation(token_indices(pool, 0, n), tokens, hash_value=hashes)
    t0 = time.perf_counter()
    ctl._page_backup(backup)
    if device is not None:
        os.sync()
    secs["set"] = time.perf_counter() - t0
    op = ctl.PrefetchOperation("bench", tokens)
    # The hit query hashes the tokens first, the same work for every
    # backend (most of the query at 1 MiB pages): hashed beforehand here.
    scope = ctl._storage_hit_query.__globals__
    original = scope["get_storage_hash_str"]
    scope["get_storage_hash_str"] = lambda *_, **__: hashes
    try:
        t0 = time.perf_counter()
        found, hit_tokens = ctl._storage_hit_query(op)
        secs["exists"] = time.perf_counter() - t0
    finally:
        scope["get_storage_hash_str"] = original
    if device is not None:
        _drop_cached(device)
    op.hash_value, op.host_indices = found, token_indices(pool, n, n)
    t0 = time.perf_counter()
    loaded = ctl._page_transfer(op)
    secs["get"] = time.perf_counter() - t0
    while not ctl.prefetch_sync_queue.empty():
        ctl.prefetch_sync_queue.get_nowait()
    if (backup.completed_tokens, hit_tokens, loaded) != (len(tokens), len(tokens), n):
        raise RuntimeError(f"stored {backup.completed_tokens}, found {hit_tokens}, read {loaded}")
    if [page_bytes(pool, n + i) for i in range(n)] != [page_bytes(pool, i) for i in range(n)]:
        raise RuntimeError("a page read back differs from the page stored")
    return secs


def run_shape(
    name: str,
    shape: dict[str, Any],
    num_pages: int,
    repeats: int,
    directory: str,
    url: str,
    layout: str = "page_first",
) -> dict[str, Any]:
    """One page geometry: every contender ``repeats`` times; rates and ratios."""
    pool = host_pool("mha", layout, pages=2 * num_pages, **shape)
    fill(pool, 0)
    nbytes = len(page_bytes(pool, 0))
    work = Path(tempfile.mkdtemp(prefix="sglang-", dir=directory))
    cap = (repeats + 2) * num_pages * (nbytes + 8192) + (64 << 20)
    disk = open_storage({"kvtier_disk_path": str(work), "kvtier_disk_bytes": cap}, pool)
    # kvtier's memory tier holds a run's pages (twice over), as the page
    # cache holds HiCacheFile's: both read back from memory.
    host_disk = open_storage(
        {
            "kvtier_disk_path": str(work / "host+disk"),
            "kvtier_disk_bytes": cap,
            "kvtier_host_bytes": 2 * num_pages * record_bytes(nbytes),
        },
        pool,
    )
    remote = open_storage({"kvtier_remote_url": url}, pool)
    # A node (its own process, as in production) holding as much memory as
    # kvtier's memory tier above, with a disk of its own below.
    node_dir = work / "node"
    node_dir.mkdir()
    sock_dir = tempfile.mkdtemp(prefix="kvn-")  # short: a socket's path is 107 bytes at most
    node_sock = str(Path(sock_dir) / "node.sock")
    node = start_node(
        node_sock,
        f"sgbench{os.getpid()}",
        ["--host-bytes", str(2 * num_pages * record_bytes(nbytes)), "--disk", f"{node_dir}:{cap}"],
    )
    on_node = open_storage({"kvtier_node": node_sock}, pool)
    hfile = hicache_file({"file_storage_path": str(work)}, layout=layout)
    pyredis = RedisPyPages(url)
    # SGLang picks the zero-copy calls for a dynamic backend with
    # interface_v1 (kvtier), the generic ones for its file backend.
    contenders = {
        "kvtier_disk": controller(disk, pool, zero_copy=True),
        "kvtier_host_disk": controller(host_disk, pool, zero_copy=True),
        "hicache_file": controller(hfile, pool, zero_copy=False),
        "hicache_file_device": controller(hfile, pool, zero_copy=False),
        "kvtier_redis": controller(remote, pool, zero_copy=True),
        "redis_py": controller(pyredis, pool, zero_copy=False),
        "kvtier_node": controller(on_node, pool, zero_copy=True),
    }
    runs: dict[str, dict[str, list[float]]] = {c: {op: [] for op in OPS} for c in contenders}
    try:
        for r in range(repeats):
            names = list(contenders)
            names = names[r % len(names) :] + names[: r % len(names)]
            for c in names:
                # Fresh pages: token ids of their own per repeat and contender.
                first = (r * len(contenders) + list(contenders).index(c)) * (1 << 24)
                tokens = list(range(first, first + num_pages * pool.page_size))
                device = work if c == "hicache_file_device" else None
                for op, s in _run_once(contenders[c], tokens, pool, device).items():
                    runs[c][op].append(num_pages / s)
            pyredis.r.flushall()
        st = host_disk.kvtier_stats()["kv"]
        # Share of the memory tier's reads that found their page in memory.
        from_memory = st["host_pages_loaded"] / max(1, st["pages_loaded"])
    finally:
        for backend in (disk, host_disk, remote, pyredis, on_node):
            backend.close()
        node.terminate()
        node.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
        for f in Path("/dev/shm").glob(f"kvnode-sgbench{os.getpid()}-*"):
            f.unlink()
        hfile.clear()
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    out: dict[str, Any] = {
        "shape": name,
        "layout": layout,
        "page_bytes": nbytes,
        "pages_per_run": num_pages,
        "batch_pages": storage_batch_pages(),
        "host_disk_get_from_memory": round(from_memory, 3),
    }
    for c, ops in runs.items():
        out[c] = {
            op: {
                "pages_per_s": round(med(v), 1),
                **({"gbps": round(med(v) * nbytes / 1e9, 3)} if op != "exists" else {}),
                "runs_pages_per_s": [round(x, 1) for x in v],
            }
            for op, v in ops.items()
        }
    out["vs_hicache_file"] = {
        op: paired_ratio(runs["kvtier_host_disk"][op], runs["hicache_file"][op]) for op in OPS
    }
    out["disk_vs_hicache_file"] = {
        op: paired_ratio(runs["kvtier_disk"][op], runs["hicache_file"][op]) for op in OPS
    }
    out["vs_hicache_file_device"] = {
        op: paired_ratio(runs["kvtier_disk"][op], runs["hicache_file_device"][op]) for op in OPS
    }
    out["node_vs_host_disk"] = {
        op: paired_ratio(runs["kvtier_node"][op], runs["kvtier_host_disk"][op]) for op in OPS
    }
    out["redis_vs_redis_py"] = {
        op: paired_ratio(runs["kvtier_redis"][op], runs["redis_py"][op]) for op in OPS
    }
    return out


def run_sglang(
    directory: str,
    url: str | None = None,
    repeats: int = 3,
    shapes: tuple[tuple[str, dict[str, Any], int], ...] | None = None,
    layout: str = "page_first",
) -> dict[str, Any]:
    """Every shape (default :data:`SHAPES`) against the baselines (a local
    redis-server unless ``url``); ``vs_hicache_file`` and
    ``redis_vs_redis_py``: per op, the median over shapes of the paired ratios."""
    # One torch thread: the baselines' page copies are torch ops, and on a
    # small machine shared with kvtier's threads (and anything else) torch's
    # OpenMP pool waits on busy cores: a 1 MiB copy took 4-7 ms with 2
    # threads, 0.15-0.25 ms with 1 (2 cores, under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = None
    if url is None:
        from kvtier.bench.redis_server import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-")))
        url = server.url
    try:
        results = [
            run_shape(n, s, p, repeats, directory, url, layout) for n, s, p in shapes or SHAPES
        ]
    finally:
        torch.set_num_threads(threads)
        if server is not None:
            server.stop()
    return {
        "component": "sglang",
        "sglang": sglang_version(),
        "contenders": {
            "kvtier_disk": "kvtier's disk tier (direct I/O: reads come from the device)",
            "kvtier_host_disk": "kvtier's memory tier (kvtier_host_bytes: twice a run's pages) "
            "in front of its disk tier: reads of pages just stored come from memory",
            "kvtier_redis": "kvtier's Redis tier",
            "kvtier_node": "a kvtier node (its own process; memory as kvtier_host_disk's, its "
            "disk below written behind): the rank copies pages to and from the node's slots",
        },
        "baselines": {
            "hicache_file": "SGLang's HiCacheFile on the same directory (generic calls), as "
            "SGLang runs it: writes end in the page cache, reads of them come from it",
            "hicache_file_device": "the same, its writes synced before set ends and its files "
            "dropped from the page cache before get: both from the device, as kvtier's",
            "redis_py": "redis-py + hiredis, one pipeline per batch (generic calls), same Redis",
        },
        # Like for like: kvtier's memory tier against the page cache, its
        # disk tier against HiCacheFile's device reads; and kvtier's disk
        # against the page cache.
        "vs_hicache_file": {op: _med(r["vs_hicache_file"][op] for r in results) for op in OPS},
        "disk_vs_hicache_file": {
            op: _med(r["disk_vs_hicache_file"][op] for r in results) for op in OPS
        },
        "vs_hicache_file_device": {
            op: _med(r["vs_hicache_file_device"][op] for r in results) for op in OPS
        },
        "redis_vs_redis_py": {op: _med(r["redis_vs_redis_py"][op] for r in results) for op in OPS},
        "node_vs_host_disk": {op: _med(r["node_vs_host_disk"][op] for r in results) for op in OPS},
        "ratio_method": PAIRED + "; medians over page shapes; contenders rotate between repeats",
        "repeats": repeats,
        "shapes": results,
    }


def _med(values: Any) -> float:
    return round(float(statistics.median(values)), 3)


def table(result: dict[str, Any]) -> str:
    """Pages/s and GB/s per contender and op, then the ratios."""
    lines = []
    for r in result["shapes"]:
        lines.append(
            f"{r['shape']} ({r['page_bytes']} B, {r['layout']}, batches of {r['batch_pages']})"
        )
        for c in (
            "kvtier_host_disk",
            "kvtier_disk",
            "hicache_file",
            "hicache_file_device",
            "kvtier_redis",
            "redis_py",
            "kvtier_node",
        ):
            cells = "  ".join(
                f"{op} {r[c][op]['pages_per_s']:>9.0f} p/s"
                + (f" {r[c][op]['gbps']:6.3f} GB/s" if op != "exists" else "")
                for op in OPS
            )
            lines.append(f"  {c:<19} {cells}")
        lines.append(
            f"  kvtier host+disk/HiCacheFile {r['vs_hicache_file']}  kvtier disk/HiCacheFile "
            f"{r['disk_vs_hicache_file']}  from the device {r['vs_hicache_file_device']}  "
            f"kvtier/redis-py {r['redis_vs_redis_py']}  node/host+disk {r['node_vs_host_disk']}"
        )
    lines.append(
        f"vs_hicache_file {result['vs_hicache_file']}  disk_vs_hicache_file "
        f"{result['disk_vs_hicache_file']}  vs_hicache_file_device "
        f"{result['vs_hicache_file_device']}  redis_vs_redis_py {result['redis_vs_redis_py']}  "
        f"node_vs_host_disk {result['node_vs_host_disk']}"
    )
    return "\n".join(lines)
