"""Other clients of the same Redis server, for ``kvtier bench remote --peer``:
LMCache's native RESP client (the ``lmcache_redis`` extension of its PyPI
wheel) and redis-py with hiredis. Each moves the same number of values of the
same size as kvtier's run, from and into a buffer of as many slots as kvtier's
pool, and every loaded byte is compared with what was stored.

Who calls: :mod:`kvtier.bench.remote`. Everything here blocks.

A command-line tool's module: runs in the ``kvtier`` process.
"""

from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

LMCACHE_VERSION = "0.5.6"
# As LMCache's own Redis adapter runs it (its default worker count), and the
# batch size the issue that asked for this comparison measured.
LMCACHE_WORKERS = 8
LMCACHE_BATCH = 16


def lmcache_redis(cache: Path) -> tuple[Any, str]:
    """LMCache's ``lmcache_redis`` extension, loaded on its own: importing the
    ``lmcache`` package would pull in far more than its client (and needs a
    GPU build of its other extensions). The wheel comes from
    ``$KVTIER_LMCACHE_WHEEL``, else from ``cache`` (``pip download`` puts it
    there when missing). Returns (module, '') or (None, why not)."""
    tag = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    so = cache / f"lmcache-{LMCACHE_VERSION}" / f"lmcache_redis{tag}"
    if not so.exists():
        wheel = os.environ.get("KVTIER_LMCACHE_WHEEL")
        wheels = [Path(wheel)] if wheel else sorted(cache.glob(f"lmcache-{LMCACHE_VERSION}-*.whl"))
        if not wheels:
            cache.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    f"lmcache=={LMCACHE_VERSION}",
                    "-d",
                    str(cache),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            wheels = sorted(cache.glob(f"lmcache-{LMCACHE_VERSION}-*.whl"))
            if not wheels:
                why = (r.stderr.strip().splitlines() or ["no wheel for this Python"])[-1]
                return None, f"pip download lmcache=={LMCACHE_VERSION} failed: {why}"
        member = f"lmcache/lmcache_redis{tag}"
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                data = z.read(member)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            return None, f"{wheels[0]} has no {member}: {e}"
        so.parent.mkdir(parents=True, exist_ok=True)
        so.write_bytes(data)
    try:
        import torch  # noqa: F401  (the extension links libc10 and libtorch)
    except ImportError:
        return None, "LMCache's client needs torch's libraries (pip install torch)"
    try:
        spec = importlib.util.spec_from_file_location("lmcache_redis", so)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as e:
        return None, f"cannot load {so}: {e}"
    return mod, ""


class SlotBuffer:
    """Slots of random bytes (``data``: slots x value size, e.g. a host pool's
    view), value ``i`` moved from and into slot ``i % slots`` (as kvtier's
    bench driver uses its pool)."""

    def __init__(self, data: np.ndarray, seed: int) -> None:
        self.data = data
        data[:] = np.random.default_rng(seed).integers(0, 256, data.shape, dtype=np.uint8)
        self.ref = data.copy()

    def clear(self) -> None:
        self.data[:] = 0

    def verify(self, who: str) -> None:
        """Raises RuntimeError naming the first slot whose bytes differ."""
        bad = np.flatnonzero((self.data != self.ref).any(axis=1))
        if bad.size:
            raise RuntimeError(f"{who}: {bad.size} loaded values differ (first: slot {bad[0]})")


class LMCachePeer:
    """LMCache's native client on one server: ``workers`` connections, batches
    of ``batch`` keys, every batch submitted at once and completions drained
    from its event fd (its own asyncio adapter does the same)."""

    name = "LMCache native client"

    def __init__(
        self, mod: Any, host: str, port: int, password: str, buf: SlotBuffer, n: int
    ) -> None:
        self.client = mod.LMCacheRedisClient(host, port, LMCACHE_WORKERS, "", password)
        self.buf, self.n = buf, n
        self.keys = [f"kvtier-bench-lmcache:{i}" for i in range(n)]
        self.views = [memoryview(buf.data[i]) for i in range(buf.data.shape[0])]

    def move(self, store: bool) -> None:
        slots = len(self.views)
        submit = self.client.submit_batch_set if store else self.client.submit_batch_get
        pending: set[int] = set()
        for i in range(0, self.n, LMCACHE_BATCH):
            ks = self.keys[i : i + LMCACHE_BATCH]
            pending.add(int(submit(ks, [self.views[(i + j) % slots] for j in range(len(ks))])))
        fd = int(self.client.event_fd())
        while pending:
            select.select([fd], [], [], 1.0)
            for fid, ok, err, _ in self.client.drain_completions():
                if not ok:
                    raise RuntimeError(f"{self.name}: {'SET' if store else 'GET'} failed: {err}")
                pending.discard(int(fid))

    def server_keys(self) -> list[bytes]:
        return [k.encode() for k in self.keys]

    def close(self) -> None:
        self.client.close()


class RedisPyPeer:
    """redis-py (hiredis when installed) over one connection, pipelines of 64."""

    def __init__(self, host: str, port: int, password: str, buf: SlotBuffer, n: int) -> None:
        import redis

        self.r = redis.Redis(host=host, port=port, password=password or None)
        self.name = "redis-py + " + ("hiredis" if redis.utils.HIREDIS_AVAILABLE else "python")
        self.buf, self.n = buf, n
        self.keys = [b"kvtier-bench-py:%d" % i for i in range(n)]

    def move(self, store: bool) -> None:
        slots = self.buf.data.shape[0]
        for i in range(0, self.n, 64):
            p = self.r.pipeline(transaction=False)
            for j, k in enumerate(self.keys[i : i + 64]):
                if store:
                    p.set(k, self.buf.data[(i + j) % slots].tobytes())
                else:
                    p.get(k)
            if store:
                p.execute()
                continue
            for j, v in enumerate(p.execute()):
                if v is not None:  # a missing value stays zero and fails verify()
                    self.buf.data[(i + j) % slots] = np.frombuffer(v, np.uint8)

    def server_keys(self) -> list[bytes]:
        return list(self.keys)

    def close(self) -> None:
        self.r.close()
