"""``kvtier doctor``: what this build and this machine give kvtier (the
backends in use, native core and how it was built, crc32c, shared memory,
io_uring and O_DIRECT, CUDA runtime, limits, the kvtier node it sees).

Every check runs in isolation: one failing check is reported, not raised.

A command-line tool: runs in the ``kvtier`` process. Who calls: ``kvtier
doctor`` (:mod:`kvtier.cli`). Blocks while the checks run (a few disk and
pool operations in ``--dir``, default the temporary directory).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _check(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": True, **fn()}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _native() -> dict[str, Any]:
    from kvtier import __version__, _native

    return {
        "version": __version__,
        "module": _native.__file__,
        # How this build got its optional libraries, e.g. "liburing 2.3, static"
        # or "not built (liburing not found)".
        "build": _native.build_info(),
        "crc32c": _native.crc32c_backend(),
        "io_uring_compiled_in": bool(_native.uring_compiled_in()),
        # Which copy of a shared optional library the loader mapped (a wheel's
        # own in kvtier.libs/, or the system's).
        "loaded": _mapped_libraries(("libisal", "liburing")),
    }


def _mapped_libraries(prefixes: tuple[str, ...]) -> list[str]:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(prefixes))


def _backends(report: dict[str, Any]) -> dict[str, Any]:
    """What this build on this machine uses: the disk backend ``auto`` picks
    (with io_uring's refusal when it is pread) and the crc32c kernel."""
    native, disk = report["native"], report["disk"]
    if not native["ok"]:
        raise RuntimeError("the native core did not load")
    out: dict[str, Any] = {"crc32c": native["crc32c"]}
    if not disk["ok"]:
        out["disk"] = "unknown (the disk check failed)"
    elif disk["backend"] == "io_uring":
        out["disk"] = "io_uring"
    else:
        out["disk"] = f"pread ({disk['io_uring'].get('error', 'io_uring refused')})"
    return out


def _crc() -> dict[str, Any]:
    import numpy as np

    from kvtier.engine import crc32c

    buf = np.ones(64 << 20, np.uint8)
    crc32c(buf)
    t0 = time.perf_counter()
    for _ in range(4):
        crc32c(buf)
    return {"gbps": round(4 * buf.nbytes / (time.perf_counter() - t0) / 1e9, 2)}


def _pool() -> dict[str, Any]:
    from kvtier.pool import HostPool

    reaped = HostPool.reap_stale()  # before creating one, which would reap them silently
    with HostPool(4, 1 << 20) as p:
        q = HostPool.attach(p.name)
        ok = q.num_slots == 4
    return {
        "shared_memory": ok,
        "shm_dir": "/dev/shm",
        "shm_free_bytes": shutil.disk_usage("/dev/shm").free,
        "stale_pools_removed": reaped,
    }


def _disk(directory: str) -> dict[str, Any]:
    from kvtier.pool import HostPool
    from kvtier.tiers.disk import DiskTier, record_bytes

    d = Path(tempfile.mkdtemp(prefix="kvtier-doctor-", dir=directory))
    try:
        out: dict[str, Any] = {"dir": directory}
        for backend in ("io_uring", "pread"):
            try:
                t = DiskTier(d, 16 * record_bytes(65536), 65536, backend=backend)
                try:
                    with HostPool(2, record_bytes(65536)) as p:
                        t.attach(p)
                        out[backend] = {
                            "ok": True,
                            "direct": bool(t.store.direct),
                            "note": t.store.note,
                        }
                finally:
                    t.close()  # the next backend opens the same directory
            except Exception as e:
                out[backend] = {"ok": False, "error": str(e)}
        out["backend"] = "io_uring" if out["io_uring"]["ok"] else "pread"
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _cuda() -> dict[str, Any]:
    """The CUDA runtime kvtier loads (where from, its version) and each GPU:
    its name, PCI bus id, and whether registered host memory is usable
    through its host pointer (what the host pool's copies rely on)."""
    from kvtier import _native
    from kvtier.worker import cuda_runtime

    path, version, batch, found = cuda_runtime.load()
    facts = _native.cuda_devices()
    return {
        "runtime": path,
        "found": found,
        "version": version,
        "driver_version": facts["driver_version"],
        "batch_copies": batch,
        "gpus": facts["devices"],
        **({"error": facts["error"]} if "error" in facts else {}),
    }


def _limits() -> dict[str, Any]:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    uring = Path("/proc/sys/kernel/io_uring_disabled")
    return {
        "memlock_soft": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "thp": thp.read_text().strip() if thp.exists() else "n/a",
        "io_uring_disabled": uring.read_text().strip() if uring.exists() else "n/a",
        "cores": os.cpu_count(),
        "redis_server": shutil.which("redis-server"),
        "fio": shutil.which("fio"),
    }


def _node(socket_path: str | None) -> dict[str, Any]:
    """Which kvtier node this machine's engines would attach to: its socket
    (``--node``, else $KVTIER_NODE, else the default path), whether it
    answers, and what it serves. Not finding one is no failure (in-process
    tiers are the default): ``ok`` says whether one answers."""
    from kvtier.node.connection import node_status
    from kvtier.node.server import DEFAULT_SOCKET

    path = socket_path or os.environ.get("KVTIER_NODE") or DEFAULT_SOCKET
    if not os.path.exists(path):
        return {"ok": False, "socket": path, "node": None, "note": "no node (in-process tiers)"}
    st = node_status(path)
    return {
        "socket": path,
        "node": st["node"],
        "engines": len(st["engines"]),
        "namespaces": len(st["namespaces"]),
        "classes": {b: c["occupancy"] for b, c in st["classes"].items()},
    }


def main_doctor(
    directory: str | None = None, *, as_json: bool = False, node: str | None = None
) -> int:
    """Run every check and print the report (a JSON line with ``as_json``).

    Who calls: ``kvtier doctor``. Blocks for the checks (a few disk and pool
    operations in ``directory``, default the temporary directory). Returns
    the exit status: 0 when the native core loads.
    """
    report = {
        "native": _check(_native),
        "crc32c": _check(_crc),
        "host_pool": _check(_pool),
        "disk": _check(lambda: _disk(directory or tempfile.gettempdir())),
        "cuda": _check(_cuda),
        "limits": _check(_limits),
        "node": _check(lambda: _node(node)),
    }
    report = {"backends": _check(lambda: _backends(report)), **report}
    if as_json:
        print(json.dumps(report))
        return 0 if report["native"]["ok"] else 1
    for name, r in report.items():
        mark = "ok " if r.get("ok") else "-- "
        body = {k: v for k, v in r.items() if k != "ok"}
        print(f"{mark} {name:<10} {json.dumps(body)}")
    return 0 if report["native"]["ok"] else 1
