"""A server's process tree read from /proc: its processes (the server and
every descendant) and the resources they hold together and each: RSS, open
fds, threads and the shared-memory regions they hold open or mapped.

Who calls: the serving soak's sampler (:mod:`kvtier.bench.soak_server`) and
``bench/soak_rss_control.py``. Runs in their process; reads /proc, blocks
for milliseconds, never raises for a process that ends meanwhile.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_resources(pid: int) -> dict[str, Any]:
    """RSS (KiB), open fds and threads summed over the server's processes,
    and the shared-memory regions (/dev/shm files and memfds) they hold
    open or mapped: how many and their MiB. Per process too, by name."""
    rss = fds = threads = 0
    shm: dict[str, int] = {}
    procs: dict[str, dict[str, int]] = {}
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            r = int(fields.get("VmRSS", "0 kB").split()[0])
            t = int(fields["Threads"])
            links = []
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    links.append((fd, os.readlink(f"/proc/{p}/fd/{fd}")))
            for fd, link in links:
                if link.startswith(("/dev/shm/", "/memfd:")):
                    with contextlib.suppress(OSError):
                        shm[link] = os.stat(f"/proc/{p}/fd/{fd}").st_size
            with open(f"/proc/{p}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/") and path not in shm:
                        with contextlib.suppress(OSError):
                            shm[path] = os.stat(path).st_size
        except (OSError, KeyError, ValueError):
            continue  # the process ended meanwhile
        rss, fds, threads = rss + r, fds + len(links), threads + t
        name = fields.get("Name", "?").strip()
        procs[f"{name}-{p}"] = {
            "rss_kib": r,
            # RSS split: private (heap), file-backed, shared memory (kvtier's pools).
            **{
                f"{k[3:].lower()}_kib": int(fields.get(k, "0 kB").split()[0])
                for k in ("RssAnon", "RssFile", "RssShmem")
            },
            "fds": len(links),
            "threads": t,
        }
    return {
        "rss_kib": rss,
        "fds": fds,
        "threads": threads,
        "shm": len(shm),
        "shm_mib": round(sum(shm.values()) / 2**20, 2),
        "processes": procs,
    }


__all__ = ["process_tree", "tree_resources"]
