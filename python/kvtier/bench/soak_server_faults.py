"""The serving soak's faults on a running server: :class:`Faults` injects
each kind of :data:`~kvtier.bench.soak_server.SERVER_FAULT_KINDS` (Redis
killed or stopped, the disk tier's file system filled, its records
corrupted, its directory made read-only, clients hanging up, a burst that
makes vLLM preempt) and restores the medium later.

A command-line tool's module: runs in the ``kvtier bench soak --server``
driver process. Who calls: :func:`kvtier.bench.soak_server.run_server_soak`,
from its one loop thread. Blocks briefly: signals, a ballast file written
until the file system is full, ``mount``, reads and writes of the slab files.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.soak_faults import Fault, Tmpfs, fill_disk
from kvtier.bench.soak_server_client import OpenLoop, Workload

if TYPE_CHECKING:
    from kvtier.bench.soak_server import ServerSoakConfig

# Between a corruption fault's passes: a record written since the last pass
# reads clean, so the shorter, the fewer reads the fault misses (a pass over
# the soak's 124 records reads 124 trailers and writes 16 bytes into each).
CORRUPT_PERIOD_S = 0.2


class Faults:
    """Injects each fault kind and restores the medium later. Who calls: the
    driver's loop, one thread."""

    def __init__(
        self,
        cfg: ServerSoakConfig,
        redis: Any,
        fs: Tmpfs,
        disk_root: Path,
        client: OpenLoop,
        workload: Workload,
        record_bytes: int,
    ) -> None:
        self.cfg, self.redis, self.fs, self.disk_root = cfg, redis, fs, disk_root
        self.client, self.workload, self.record_bytes = client, workload, record_bytes
        self.rng = random.Random(cfg.seed + 1)
        self.pending: list[tuple[float, Callable[[], None], Fault]] = []
        self.corrupted: list[tuple[str, int]] = []  # (slab file, record) flipped
        self.abort_ids: list[int] = []

    def undo_later(self, f: Fault, after_s: float, undo: Callable[[], None]) -> None:
        def run() -> None:
            undo()
            f.end = time.time()

        self.pending.append((time.time() + after_s, run, f))

    def due(self, force: bool = False) -> None:
        for item in [x for x in self.pending if force or time.time() >= x[0]]:
            item[1]()
            self.pending.remove(item)

    def ns_dirs(self) -> list[Path]:
        return sorted(self.disk_root.glob("kvtier-*"))

    def inject(self, kind: str, gap: float) -> Fault:
        f = Fault(kind, time.time())
        hold = max(2.0, min(8.0, gap / 2))
        if kind == "redis_kill":
            self.redis.kill()
            f.detail = f"redis-server SIGKILL, restarted empty on port {self.redis.port} after 2 s"
            self.undo_later(f, 2.0, self.redis.start)
        elif kind == "redis_stall":
            pid = self.redis.proc.pid
            os.kill(pid, signal.SIGSTOP)
            stall = min(5.0, hold)
            f.detail = f"redis-server SIGSTOP for {stall:.1f} s, then SIGCONT"
            self.undo_later(f, stall, lambda: os.kill(pid, signal.SIGCONT))
        elif kind == "disk_full":
            if self.fs.path is None:
                f.skipped, f.end = self.fs.reason, f.start
                return f
            ballast = self.fs.path / "ballast"
            n = fill_disk(ballast)
            f.detail = f"{n >> 20} MiB ballast filled the tmpfs for {hold:.1f} s"
            self.undo_later(f, hold, ballast.unlink)
        elif kind == "corrupt_disk":
            # Longer than the other faults: reads of the disk tier come a
            # few a second, and each must find its record still corrupt.
            self._corrupt_for(f, max(hold, min(0.9 * gap, 20.0)))
        elif kind == "disk_readonly":
            self._readonly(f, hold)
        elif kind in ("abort_prefill", "abort_decode"):
            for _ in range(self.cfg.aborts):
                if kind == "abort_prefill":
                    r = self.workload.fresh(1536)
                    r.abort, r.abort_after_s = "prefill", self.rng.uniform(0.05, 0.2)
                else:
                    r = self.workload.fresh(512, max_tokens=64)
                    r.abort, r.abort_after_tokens = "decode", self.rng.randrange(2, 12)
                self.abort_ids.append(r.id)
                self.client.start(r)
            f.detail = f"{self.cfg.aborts} requests whose clients hang up during {kind[6:]}"
            f.end = f.start
        elif kind == "kv_pressure":
            for _ in range(self.cfg.burst):
                self.client.start(
                    self.workload.fresh(self.cfg.burst_tokens, "burst", self.cfg.burst_max_tokens)
                )
            f.detail = (
                f"{self.cfg.burst} prompts of {self.cfg.burst_tokens} tokens "
                f"({self.cfg.burst_max_tokens} out) at once into "
                f"{self.cfg.gpu_blocks * 32} tokens of KV cache"
            )
            f.end = f.start
        return f

    def _corrupt_for(self, f: Fault, hold: float) -> None:
        """Corruption passes every CORRUPT_PERIOD_S for ``hold`` seconds. One
        pass alone can go unread: the soak's small disk tier rewrites every
        record within seconds, and a 2-minute CI run once saw all 48 flipped
        records rewritten before any load reached one (disk counters: 0
        corrupt). So every pass flips every written record (by default): a
        disk read in the window finds its record corrupt unless it was
        written since the last pass."""
        end = f.start + hold
        passes, hit = [0], [0]

        def again() -> None:
            hits = self._corrupt()
            self.corrupted += hits
            passes[0] += 1
            hit[0] += len(hits)
            f.detail = (
                f"16 random bytes overwritten in the payload of {hit[0]} written records, "
                f"{passes[0]} passes over {hold:.1f} s"
            )
            if time.time() + CORRUPT_PERIOD_S < end:
                self.pending.append((time.time() + CORRUPT_PERIOD_S, again, f))
            else:
                f.end = time.time()

        again()

    def _corrupt(self) -> list[tuple[str, int]]:
        """Flip bytes in the payload of random records that hold a trailer (written)."""
        written: list[tuple[Path, int]] = []
        for d in self.ns_dirs():
            for p in sorted(d.glob("slab-*.dat")):
                with p.open("rb") as fh:
                    for rec in range(p.stat().st_size // self.record_bytes):
                        fh.seek((rec + 1) * self.record_bytes - 4096)
                        if fh.read(4) == b"KVTR":
                            written.append((p, rec))
        hits = []
        n = self.cfg.corrupt_records or len(written)
        for p, rec in self.rng.sample(written, min(n, len(written))):
            off = rec * self.record_bytes + self.rng.randrange(self.record_bytes - 8192)
            fd = os.open(p, os.O_WRONLY)
            try:
                os.pwrite(fd, self.rng.randbytes(16), off)
            finally:
                os.close(fd)
            hits.append((str(p), rec))
        return hits

    def _readonly(self, f: Fault, hold: float) -> None:
        """Root ignores a directory's mode: a read-only bind mount over the
        tier's directory instead (open files stay writable either way)."""
        dirs = self.ns_dirs()
        if not dirs:
            f.skipped, f.end = "no disk tier directory yet", f.start
            return
        d = str(dirs[0])
        if os.geteuid() == 0:
            ok = subprocess.run(["mount", "--bind", d, d], capture_output=True).returncode == 0
            ok = (
                ok
                and subprocess.run(
                    ["mount", "-o", "remount,bind,ro", d], capture_output=True
                ).returncode
                == 0
            )
            if not ok:
                subprocess.run(["umount", d], capture_output=True)
                f.skipped, f.end = "read-only bind mount failed", f.start
                return
            f.detail = f"a read-only bind mount over {Path(d).name} for {hold:.1f} s"
            self.undo_later(f, hold, lambda: _umount(d))
        else:
            os.chmod(d, 0o555)
            f.detail = f"chmod 0555 {Path(d).name} for {hold:.1f} s"
            self.undo_later(f, hold, lambda: os.chmod(d, 0o700))


def _umount(d: str) -> None:
    subprocess.run(["umount", d], capture_output=True)
