"""The soak's faults: when each is injected and how a medium is broken.

:func:`fault_schedule` spaces whole rounds of :data:`FAULT_KINDS` over a
run; :class:`Fault` is one entry of the fault log; :func:`corrupt_files`
overwrites bytes inside records of the disk tier's slab files,
:func:`fill_disk` fills a file system with a ballast file and
:class:`Tmpfs` mounts the small file system that fill is aimed at.

A command-line tool's module: runs in the ``kvtier bench soak`` driver
process. Who calls: :func:`kvtier.bench.soak.run_soak` and the tests.
:func:`fault_schedule` is pure; the rest blocks on file I/O and ``mount``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULT_KINDS = ("corrupt_disk", "redis_kill", "corrupt_redis", "disk_full", "process_kill")
"""Every fault the soak injects, in the order of each round."""


def fault_schedule(total_s: float, warmup_s: float) -> list[tuple[float, str]]:
    """(seconds from the start, kind) of every fault: whole rounds of
    :data:`FAULT_KINDS` (one round per 5 minutes after warm-up, at least one),
    evenly spaced between the end of warm-up and a tail left to watch the
    last recovery."""
    tail = max(15.0, 0.05 * total_s)
    span = total_s - warmup_s - tail
    if span <= 0:
        raise ValueError(f"a soak of {total_s:.0f} s leaves no time for faults")
    rounds = max(1, int(span // 300))
    n = rounds * len(FAULT_KINDS)
    gap = span / n
    return [(warmup_s + (i + 0.5) * gap, FAULT_KINDS[i % len(FAULT_KINDS)]) for i in range(n)]


@dataclass
class Fault:
    """One injected fault: when it began and ended (the medium restored),
    what was done, and what the verdict found."""

    kind: str
    start: float
    end: float = 0.0
    detail: str = ""
    skipped: str = ""
    recovered_s: float | None = None
    felt: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def corrupt_files(paths: Sequence[Path], record_bytes: int, count: int, rng: random.Random) -> int:
    """Overwrite 16 random bytes inside ``count`` random records of the slab
    files (a bad sector, a stray writer). Returns the records hit."""
    hit = 0
    for _ in range(count):
        p = rng.choice(list(paths))
        size = p.stat().st_size
        records = size // record_bytes
        if records < 1:
            continue
        off = rng.randrange(records) * record_bytes + rng.randrange(record_bytes - 16)
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, rng.randbytes(16), off)
        finally:
            os.close(fd)
        hit += 1
    return hit


def fill_disk(path: Path) -> int:
    """Write a ballast file until the file system says ENOSPC; returns its size."""
    n = 0
    chunk = b"\xa5" * (1 << 20)
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                w = f.write(chunk)
            except OSError:
                break
            n += w or 0
            if not w:
                break
    return n


class Tmpfs:
    """A tmpfs of ``size`` bytes mounted on a new temporary directory (root
    only); :attr:`path` is None when it could not be mounted (``reason`` says why)."""

    def __init__(self, size: int) -> None:
        self.path: Path | None = None
        self.reason = ""
        if os.geteuid() != 0:
            self.reason = "not root: cannot mount a small file system to fill"
            return
        d = Path(tempfile.mkdtemp(prefix="kvtier-soak-fs-"))
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            d.rmdir()
            self.reason = f"mount -t tmpfs failed: {r.stderr.strip()}"
            return
        self.path = d

    def close(self) -> None:
        if self.path is not None:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.path = None
