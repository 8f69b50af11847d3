"""The disk tier: a slab store on local NVMe, read and written by C++ worker
threads through io_uring (or pread/pwrite), never under the GIL.

Who calls: the manager, under its lock, once per step (``poll``) and when it
cascades or promotes. Nothing here blocks except construction (directory
checks, preallocation, index recovery) and :meth:`DiskTier.close`.

Layout of ``DIR/kvtier-<namespace>/``: ``slab-NNN.dat`` extent files of
fixed-size records (payload + 4 KiB trailer holding magic, version, namespace
and key digests, length and crc32c), ``index.journal`` (append-only, one
entry per committed or dropped record) and ``index.ckpt`` (a snapshot that
bounds the journal). A record enters the journal only after its data write
completed, and every load re-checks the trailer, so a crash can lose recent
blocks but never serve wrong bytes.

The index (digest -> record, each record's state and eviction state) is
native (``_native.DiskIndex``, 30-38 bytes per record): a disk holds
hundreds of millions of records, too many for a Python object each. Its
eviction policy (``lru`` or ``clock``) is chosen here; admission stays a
Python decision per offered key (:class:`WriteGate`). The checkpoint is the
index's readable records in bulk (record numbers, then digests, one crc32),
so a warm restart reads it in one go; the journal since then is replayed
natively.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvtier.codes import ItemStatus
from kvtier.errors import ClosedError, InUse, InvalidArgument, IoError, NoSpace
from kvtier.policy.admission import WriteGate
from kvtier.tiers.base import LookupResult, TierCompletion, TierEvent
from kvtier.tiers.jobs import Batch, JobTier, count_moved
from kvtier.tiers.records import TRAILER_BYTES, key_digest, namespace_digest, record_bytes
from kvtier.units import FreeFraction, format_size, to_capacity

__all__ = [
    "TRAILER_BYTES",
    "DiskIO",
    "DiskTier",
    "OwnerLock",
    "check_directory",
    "directory_mode_ok",
    "key_digest",
    "namespace_digest",
    "record_bytes",
    "resolve_capacity",
]

_JOURNAL = struct.Struct("<4sBxxxQ16sQQI")  # magic, op, record, digest, length, seq, crc
_J_BODY = struct.Struct(_JOURNAL.format[:-1])  # all but the crc, which covers it
_J_CRC = struct.Struct("<I")
_J_MAGIC = b"KVJ1"
_PUT, _DEL = 1, 2
# Checkpoint: magic, format, block bytes, records of the tier, entries, seq,
# crc32 of the body; the body is the entries' record numbers (uint32), then
# their digests (16 bytes each), least valuable first (LRU order).
_CKPT = struct.Struct("<4sIQQQQI4x")
_C_MAGIC = b"KVC2"
_EXTENT_MAX = 8 << 30
_READY, _WRITING, _HELD = 1, 2, 3  # record states of the native index
_LOCK_FILE = "owner.lock"
_SIZE_OPTIONS = "DiskTier(capacity_bytes=...), --disk DIR:SIZE or kvtier_disk_bytes"
_T = TypeVar("_T")


def _sys(what: str, path: Path | str, call: Callable[..., _T], *args: Any) -> _T:
    """``call(*args)`` with an OSError turned into the error a user reads:
    :class:`NoSpace` for ENOSPC/EDQUOT, else :class:`IoError`, naming ``path``."""
    try:
        return call(*args)
    except OSError as e:
        code = e.errno or errno.EIO
        cls = NoSpace if code in (errno.ENOSPC, errno.EDQUOT) else IoError
        raise cls(code, f"disk tier: {what} {path}: {os.strerror(code)}") from None


def _allocated(path: Path) -> int:
    """Bytes the file system has allocated to ``path`` (0 when missing)."""
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _fs_space(path: Path) -> tuple[int, int]:
    """(bytes free to unprivileged users, total bytes) of ``path``'s file system."""
    st = _sys("statvfs", path, os.statvfs, path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def resolve_capacity(
    value: int | str | FreeFraction, path: str | os.PathLike[str], own: Iterable[Path] = ()
) -> int:
    """A disk capacity in bytes: ``value`` as is, or a share of the free space
    of ``path``'s file system (``"80%"``). The files in ``own`` (the tier's
    slabs from an earlier run) count as free, so a restart asks for the same
    capacity again. Who calls: :class:`DiskTier`, the vLLM shim (pipeline
    stages share one capacity). Blocks on one ``statvfs``.
    """
    cap = to_capacity("disk capacity", value)
    if not isinstance(cap, FreeFraction):
        return cap
    free, _ = _fs_space(Path(path))
    return int(cap.fraction * (free + sum(_allocated(p) for p in own)))


class OwnerLock:
    """One owner per directory: an exclusive ``flock`` on ``DIR/owner.lock``
    holding the owner's pid, taken without waiting.

    The kernel drops an flock when its holder dies (kill -9 included), so a
    directory left by a killed process is simply taken over. Who calls:
    :class:`DiskTier` at construction and close. Never blocks.
    """

    fd = -1

    def __init__(self, directory: Path, what: str = "disk tier directory") -> None:
        self.path = directory / _LOCK_FILE
        while True:
            fd = _sys(
                "open", self.path, os.open, self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise InUse(
                    errno.EBUSY,
                    f"{what} {directory} is in use by pid {holder} (it holds {self.path}); "
                    "give each process its own directory, or close the other first",
                ) from None
            except OSError as e:
                os.close(fd)
                raise IoError(e.errno or errno.EIO, f"flock {self.path}: {e.strerror}") from None
            # An owner that failed while creating the directory unlinks the
            # file it locked: hold the file that is on the path, not that one.
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full file system: the lock holds without the pid in it

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        return text if text.isdigit() else "unknown"

    def release(self, unlink: bool = False) -> None:
        """Let go (idempotent); ``unlink``: remove the file first (the
        directory is being removed)."""
        if self.fd < 0:
            return
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1

    def __del__(self) -> None:
        # A tier dropped without close (its constructor's caller failed
        # later) must not keep the directory locked for the process's life.
        with contextlib.suppress(Exception):
            self.release()


#: Eviction policies of the disk tier (native): ``lru``, or ``clock`` /
#: ``clock:N`` (a record used k times survives k sweeps of the hand, k <= N).
DISK_POLICIES = ("lru", "clock")


def _parse_policy(spec: str) -> tuple[str, int]:
    name, _, arg = spec.lower().partition(":")
    if name not in DISK_POLICIES or (arg and (name != "clock" or not arg.isdigit())):
        raise InvalidArgument(
            f"disk tier policy must be lru, clock or clock:N (N in 1..255), not {spec!r}"
        )
    n = int(arg) if arg else 1
    if not 1 <= n <= 255:
        raise InvalidArgument(f"disk tier policy {spec!r}: N must be in 1..255")
    return name, n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def check_directory(path: Path) -> None:
    """Clear errors for a missing, foreign or read-only directory."""
    if not path.exists():
        raise IoError(errno.ENOENT, f"disk tier directory {path} does not exist")
    if not path.is_dir():
        raise IoError(errno.ENOTDIR, f"disk tier path {path} is not a directory")
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise IoError(
            errno.EPERM,
            f"disk tier directory {path} is owned by uid {st.st_uid}, not by us "
            f"(uid {os.geteuid()}): refusing to share it",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise IoError(errno.EACCES, f"disk tier directory {path} is not writable")


class DiskTier(JobTier):
    """Disk tier over ``capacity_bytes`` of preallocated slab files in ``path``.

    ``capacity_bytes``: bytes, a size string (``"100GiB"``) or a share of the
    file system's free space (``"80%"``, see :func:`resolve_capacity`). The
    slabs are allocated here, at construction, and only when the file system
    keeps ``reserve_bytes`` free beside them (default: 5% of its size, at
    most 4 GiB); else :class:`~kvtier.errors.NoSpace`, with nothing left
    behind. ``namespace`` names what makes bytes compatible (model, dtype,
    layout, rank); two namespaces sharing ``path`` never read each other's
    blocks. One process at a time owns a namespace's directory (an ``flock``
    held until :meth:`close`; a second opener gets :class:`~kvtier.errors.InUse`
    naming the owner's pid).
    ``policy``: ``lru``, ``clock`` or ``clock:N`` (see :data:`DISK_POLICIES`).
    ``event_keys``: how many of the keys this process stored most recently
    are remembered for eviction events (the index keeps only digests: an
    eviction of an older key, or of one recovered at restart, is not
    reported).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | str | FreeFraction,
        block_bytes: int,
        *,
        reserve_bytes: int | None = None,
        namespace: str | bytes = "default",
        name: str = "disk",
        policy: str = "lru",
        admit_after: int = 1,
        write_budget_bps: float | None = None,
        backend: str = "auto",
        queue_depth: int = 32,
        max_io_bytes: int = 1 << 20,
        num_threads: int = 2,
        inflight_bytes: int = 512 << 20,
        job_bytes: int = 8 << 20,
        sync: bool = False,
        no_data: bool = False,
        timeout_s: float = 30.0,
        event_keys: int = 4096,
    ) -> None:
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        if backend not in ("auto", "io_uring", "pread"):
            raise InvalidArgument(f"backend must be auto, io_uring or pread, not {backend!r}")
        self._tier_init(
            name, "load_failures", "corrupt", "io_errors", "evictions", "budget_skips",
            "not_admitted", "nospace", "recovered",
        )  # fmt: skip
        self.block_bytes = block_bytes
        self.record_bytes = record_bytes(block_bytes)
        root = Path(path)
        check_directory(root)
        self.ns = namespace_digest(namespace, block_bytes)
        self.dir = root / f"kvtier-{self.ns.hex()[:16]}"
        self.no_data = no_data
        self._journal_fd = -1
        self._owner: OwnerLock | None = None
        # What this constructor creates, removed again if it fails.
        self._created: list[Path] = []
        self._grown: list[tuple[Path, int]] = []
        try:
            self._open_directory(capacity_bytes, reserve_bytes)
            self.opts: dict[str, Any] = dict(
                backend=backend,
                queue_depth=queue_depth,
                max_io_bytes=max_io_bytes,
                sync=sync,
                num_threads=num_threads,
                inflight_bytes=inflight_bytes,
                timeout_s=timeout_s,
            )
            self.job_records = max(1, job_bytes // self.record_bytes)
            self.policy, clock_max = _parse_policy(policy)
            if self.num_records >= 1 << 32:
                raise InvalidArgument(f"disk tier of {self.num_records} records: at most 2^32 - 1")
            self.gate = WriteGate(admit_after, write_budget_bps)
            from kvtier import _native

            self.index = _native.DiskIndex(self.num_records, self.policy, clock_max)
            self._ready = self.index.ready_fn()  # lookup's test, without pybind11's dispatch
            # digest -> key of the last event_keys stores, to name evicted keys
            self._event_keys: OrderedDict[bytes, bytes] = OrderedDict()
            self._event_keys_max = max(0, event_keys)
            self._held = 0  # records out of use until a timed-out write ends
            self._ended_early: set[int] = set()  # such writes that ended before their batch
            self._released: list[int] = []  # host slots of timed-out jobs that ended
            self._seq = 0
            self._journal_buf = bytearray()
            self._journal_entries = 0
            self._journal_size = 0  # bytes known good: a failed append is cut back to it
            self._journal_lost = False  # entries dropped (disk full): checkpoint when possible
            self._nospace_until = 0.0
            self.engine: Any = None
            self.store: Any = None
            self._recover()
            jpath = self.dir / "index.journal"
            self._journal_fd = _sys(
                "open",
                jpath,
                os.open,
                jpath,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                0o600,
            )
            self._journal_size = os.fstat(self._journal_fd).st_size
        except BaseException:
            self._undo_open()
            raise
        self._created, self._grown = [], []

    # -- construction helpers ------------------------------------------------
    def _open_directory(self, capacity: int | str | FreeFraction, reserve: int | None) -> None:
        """Make and own ``self.dir``, size the tier, allocate its slabs.

        Every path it creates is listed in ``_created`` (files grown, with
        their old size, in ``_grown``) for :meth:`_undo_open`.
        """
        if not self.dir.exists():
            _sys("mkdir", self.dir, self.dir.mkdir, 0o700)
            self._created.append(self.dir)
        _sys("chmod", self.dir, os.chmod, self.dir, 0o700)
        if self.dir.stat().st_uid != os.geteuid():
            raise IoError(errno.EPERM, f"{self.dir} is owned by another user: refusing it")
        self._owner = OwnerLock(self.dir)
        own = sorted(self.dir.glob("slab-*.dat"))
        capacity_bytes = resolve_capacity(capacity, self.dir, own)
        self.num_records = capacity_bytes // self.record_bytes
        if self.num_records < 1:
            raise InvalidArgument(
                f"disk capacity {capacity_bytes} B holds no record of {self.record_bytes} B"
            )
        self.per_file = max(1, _EXTENT_MAX // self.record_bytes)
        nfiles = -(-self.num_records // self.per_file)
        self.paths = [str(self.dir / f"slab-{i:03d}.dat") for i in range(nfiles)]
        self.file_bytes = min(self.num_records, self.per_file) * self.record_bytes
        if not self.no_data:  # an index-only tier moves no bytes: no slabs
            self._preallocate(capacity, reserve)

    def _preallocate(self, capacity: int | str | FreeFraction, reserve: int | None) -> None:
        """Allocate every slab now, after checking the file system has room.

        Why preallocate rather than grow slabs as records arrive: the write
        path then never allocates extents (direct I/O into allocated space,
        no ENOSPC in the middle of a record, no per-write free-space check),
        and the one check here, at start, refuses a capacity the machine
        cannot give before anything is written. The reserve keeps other
        programs (and this tier's own journal) running beside a full tier.
        """
        paths = [Path(p) for p in self.paths]
        need = sum(max(0, self.file_bytes - _allocated(p)) for p in paths)
        if reserve is not None and reserve < 0:
            raise InvalidArgument(f"reserve_bytes must be >= 0, got {reserve}")
        free, total = _fs_space(self.dir)
        keep = min(total // 20, 4 << 30) if reserve is None else reserve
        if need > free - keep:
            raise NoSpace(
                errno.ENOSPC,
                f"disk tier in {self.dir}: capacity "
                f"{f'{capacity} B' if isinstance(capacity, int) else capacity} "
                f"({format_size(self.num_records * self.record_bytes)}) needs "
                f"{format_size(need)} more, but the file system has {format_size(free)} free "
                f"and {format_size(keep)} of it stays free: give a smaller capacity "
                f"({_SIZE_OPTIONS}; e.g. '80%' of the free space)",
            )
        for p in paths:
            existed = p.exists()
            fd = _sys("create", p, os.open, p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if not existed:
                    self._created.append(p)
                size = os.fstat(fd).st_size
                if existed and size < self.file_bytes:
                    self._grown.append((p, size))
                _sys("preallocate", p, os.posix_fallocate, fd, 0, self.file_bytes)
            finally:
                os.close(fd)

    def _undo_open(self) -> None:
        """Remove what a failed construction created (newest first), shrink
        what it grew, let go of the directory."""
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1
        for p, size in self._grown:
            with contextlib.suppress(OSError):
                os.truncate(p, size)
        made_dir = self.dir in self._created
        owned = self._owner is not None
        if made_dir and owned:  # ours alone: nothing of anyone else's can be inside
            for p in self.dir.iterdir():
                if p.name != _LOCK_FILE:
                    with contextlib.suppress(OSError):
                        p.unlink()
        elif owned:
            for p in reversed(self._created):
                with contextlib.suppress(OSError):
                    p.unlink()
        # Not owned (another process took the directory we had just made):
        # everything in it is that process's; at most the empty directory goes.
        if self._owner is not None:
            self._owner.release(unlink=made_dir)
            self._owner = None
        if made_dir:
            with contextlib.suppress(OSError):
                self.dir.rmdir()
        self._created, self._grown = [], []

    @staticmethod
    def slot_bytes_for(block_bytes: int) -> int:
        """Host slot size a pool needs for this tier (payload + trailer)."""
        return record_bytes(block_bytes)

    def attach(self, pool: Any) -> None:
        self.pool = pool
        if pool is None or self.no_data:
            self.no_data = True
            return
        # Slots with room for the trailer give one request per record (and
        # coalescing); slots of exactly a 4 KiB-multiple block (vLLM's primary
        # region) send the trailer from a buffer as a second request.
        trailer_in_slot = pool.slot_bytes >= self.record_bytes
        if not trailer_in_slot and (pool.slot_bytes < self.block_bytes or self.block_bytes % 4096):
            raise InvalidArgument(
                f"host slots of {pool.slot_bytes} B cannot hold a disk record of "
                f"{self.record_bytes} B (block + 4 KiB trailer), and the block is not a "
                f"multiple of 4 KiB: size the pool with DiskTier.slot_bytes_for({self.block_bytes})"
            )
        if pool.slot_bytes % 4096 or pool.address % 4096:
            raise InvalidArgument("host slots must be 4 KiB aligned for direct I/O")
        from kvtier import _native
        from kvtier.engine import Engine

        o = self.opts
        self.store = _native.DiskStore(
            self.paths,
            self.file_bytes,
            o["backend"],
            o["queue_depth"],
            o["max_io_bytes"],
            True,
            o["sync"],
            self.ns,
            [(pool.address, pool.nbytes)],
            trailer_in_slot,
        )
        if self.store.note:
            warnings.warn(f"kvtier disk tier: {self.store.note}", stacklevel=2)
        self._backend, self._direct = str(self.store.backend), bool(self.store.direct)
        # Every job ends within timeout_s: a hung device fails it (the
        # records and host slots it touches stay out of use until it ends).
        self.engine = Engine(o["num_threads"], [(o["inflight_bytes"], False, o["timeout_s"])])
        self.engine.register_pool(pool)
        self.jobs.engine = self.engine

    @property
    def free_records(self) -> int:
        """Records neither indexed nor held by a timed-out job."""
        return self.num_records - len(self.index) - self._held

    @property
    def rec_loading(self) -> np.ndarray:
        """Loads in flight per record (a copy, for tests and diagnostics: O(records))."""
        return self.index.loading_counts()

    @property
    def backend(self) -> str:
        return getattr(self, "_backend", "none (no data)")

    # -- index and journal ---------------------------------------------------
    def _recover(self) -> None:
        """Rebuild the index from the checkpoint and the journal (warm restart).

        Both are applied natively in their order (the journal entry by entry
        up to its first torn or foreign entry, which is cut off), then the
        table is built once; of two records claiming one digest the later
        record number wins."""
        for fname in ("index.ckpt", "index.journal"):
            p = self.dir / fname
            if not p.exists():
                continue
            data = _sys("read", p, p.read_bytes)
            if fname == "index.ckpt" and data[:4] == _C_MAGIC:
                self._apply_checkpoint(data)
                continue
            # A journal, or a checkpoint in the journal's format (before KVC2).
            good, seq, _ = self.index.replay_journal(data, self.block_bytes)
            self._seq = max(self._seq, seq)
            if fname == "index.journal" and good < len(data):
                _sys("truncate", p, os.truncate, p, good)
        self.counters["recovered"] = self.index.rebuild()

    def _apply_checkpoint(self, data: bytes) -> None:
        where = self.dir / "index.ckpt"
        if len(data) < _CKPT.size:
            warnings.warn(f"kvtier disk tier: {where} is truncated: ignored", stacklevel=3)
            return
        _, _fmt, block_bytes, _, count, seq, crc = _CKPT.unpack_from(data)
        body = memoryview(data)[_CKPT.size :]
        if len(body) != 20 * count or zlib.crc32(body) != crc:
            warnings.warn(f"kvtier disk tier: {where} is damaged: ignored", stacklevel=3)
            return
        self._seq = max(self._seq, seq)
        if block_bytes != self.block_bytes:
            return  # from a different configuration
        recs = np.frombuffer(body, np.uint32, count)
        digs = np.frombuffer(body, np.uint8, 16 * count, 4 * count).reshape(count, 16)
        keep = recs < self.num_records  # from a larger configuration
        if not keep.all():
            recs, digs = recs[keep], digs[keep]
        self.index.apply(recs, digs)

    def _journal(self, op: int, rec: int, dig: bytes) -> None:
        # Wraps: a journal from elsewhere may end at seq 2**64-1 (only order in the file counts).
        self._seq = (self._seq + 1) & 0xFFFF_FFFF_FFFF_FFFF
        body = _J_BODY.pack(_J_MAGIC, op, rec, dig, self.block_bytes, self._seq)
        self._journal_buf += body
        self._journal_buf += _J_CRC.pack(zlib.crc32(body))
        self._journal_entries += 1

    def _flush_journal(self) -> None:
        """Append the buffered entries. A failed append (the file system
        full) is cut back to the last whole entry and the entries dropped:
        the index in memory stays right and every load re-checks its record,
        so what a restart would miss is only recent blocks; a checkpoint
        written once there is room again brings the files up to date."""
        if self._journal_lost:
            self._journal_buf = bytearray()
            if time.monotonic() >= self._nospace_until or self._closed:
                with contextlib.suppress(NoSpace, IoError):
                    self.checkpoint()  # clears _journal_lost once it is written
                self._nospace_until = time.monotonic() + 1.0
            return
        if not self._journal_buf:
            return
        try:
            n = os.write(self._journal_fd, self._journal_buf)
            if n != len(self._journal_buf):
                raise OSError(errno.ENOSPC, "short write")
            if self.opts["sync"]:
                os.fdatasync(self._journal_fd)
        except OSError:
            self.counters["nospace"] += 1
            with contextlib.suppress(OSError):
                os.ftruncate(self._journal_fd, self._journal_size)
            self._journal_buf = bytearray()
            self._journal_lost = True
            self._nospace_until = time.monotonic() + 1.0  # stop admitting for a while
            return
        self._journal_size += n
        self._journal_buf = bytearray()
        if self._journal_entries > max(100_000, 4 * self.num_records):
            with contextlib.suppress(NoSpace, IoError):
                self.checkpoint()

    def checkpoint(self) -> None:
        """Snapshot the index and truncate the journal (crash safe at every
        point). Raises NoSpace or IoError, leaving the files as they were.

        Who calls: the tier itself when the journal grows past a bound, and
        users. Blocks while it writes and fsyncs about 20 bytes per record."""
        tmp = self.dir / "index.ckpt.tmp"
        recs = self.index.ready_records()
        body = recs.tobytes() + self.index.digests(recs).tobytes()
        head = _CKPT.pack(
            _C_MAGIC, 1, self.block_bytes, self.num_records, len(recs), self._seq, zlib.crc32(body)
        )

        def write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, head)
                _write_all(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.dir / "index.ckpt")

        try:
            _sys("checkpoint", tmp, write)
        except IoError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.ftruncate(self._journal_fd, 0)
        self._journal_size = 0
        self._journal_entries = 0
        self._journal_lost = False

    # -- tier interface --------------------------------------------------------
    def lookup(self, key: bytes) -> LookupResult:
        return LookupResult.HIT if self._ready(key_digest(key)) else LookupResult.MISS

    def admit(self, key: bytes) -> bool:
        if time.monotonic() < self._nospace_until:
            self.counters["nospace"] += 1
            return False
        return self.gate.admit(key, self.record_bytes, self.counters)

    def _claim(self, dig: bytes, key: bytes, evicted: list[bytes]) -> int:
        """A record being written for ``dig``: a free one, else the policy's
        first victim neither being written nor read (its key appended to
        ``evicted`` when this process stored it recently). -2 when ``dig``
        is stored or being stored, -1 when no record can be had."""
        rec, gone = self.index.claim(dig)
        if rec < 0:
            return int(rec)
        names = self._event_keys
        if gone is not None:
            self.counters["evictions"] += 1
            name = names.pop(gone, None)
            if name is not None:  # older keys (and recovered ones) are not known
                evicted.append(name)
        if self._event_keys_max:
            names[dig] = key
            if len(names) > self._event_keys_max:
                names.popitem(last=False)
        return int(rec)

    def _forget(self, dig: bytes, rec: int, hold: bool = False) -> None:
        """``rec`` leaves the index: free at once, or (``hold``) when its
        timed-out job ends."""
        self.index.remove(rec, hold)
        self._held += hold
        self._event_keys.pop(dig, None)

    def _locate(self, rec: int) -> tuple[int, int]:
        return rec // self.per_file, (rec % self.per_file) * self.record_bytes

    def _submit(self, write: bool, batch: Batch) -> bool:
        """Engine jobs for one batch, split so both worker threads get work."""
        assert self.pool is not None
        d = batch.data
        n = batch.n
        arr = np.empty((n, 4), np.int64)
        r = np.asarray(d["io_recs"], np.int64)
        arr[:, 0] = self.pool.address + np.asarray(d["io_slots"], np.int64) * self.pool.slot_bytes
        arr[:, 1] = r // self.per_file
        arr[:, 2] = (r % self.per_file) * self.record_bytes
        arr[:, 3] = self.block_bytes
        digs = d["digs"]
        keys = np.frombuffer(b"".join(digs[i] for i in d["io_idx"]), np.uint8).reshape(n, 16)
        per = min(self.job_records, -(-n // self.opts["num_threads"]))
        disk = self.engine._engine

        def submit_one(first: int, count: int) -> int:
            end = first + count
            return int(disk.submit_disk(self.store, write, arr[first:end], keys[first:end], 0))

        return self.jobs.submit(batch, per, submit_one, self.record_bytes)

    def _launch(
        self,
        kind: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        digs: list[bytes],
        recs: list[int | None],
        io_idx: list[int],
        ok: list[bool],
    ) -> Batch | None:
        """One batch over ``keys``: items ``io_idx`` move data (record
        ``recs[i]`` <-> host slot ``slots[i]``); it ends at once when there
        is no I/O. None when the engine was busy: nothing queued, the caller
        undoes its bookkeeping."""
        batch = self.jobs.batch(
            kind, 0 if self.no_data else len(io_idx),
            keys=list(keys), digs=digs, recs=recs, slots=list(slots), ok=ok, io_idx=io_idx,
            io_recs=[recs[i] for i in io_idx], io_slots=[slots[i] for i in io_idx],
        )  # fmt: skip
        if batch.n == 0:
            self.jobs.end_now(batch)
            return batch
        return batch if self._submit(kind == "store", batch) else None

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        self._check(keys, slots)
        digs = [key_digest(k) for k in keys]
        ok = [False] * len(keys)
        recs: list[int | None] = [None] * len(keys)
        io_idx: list[int] = []
        evicted: list[bytes] = []
        for i, d in enumerate(digs):
            rec = self._claim(d, keys[i], evicted)
            if rec < 0:
                ok[i] = rec == -2  # already stored (or being stored)
                continue
            recs[i] = rec
            io_idx.append(i)
        if evicted:
            self._events.append(TierEvent(evicted, self.name, removed=True))
        batch = self._launch("store", keys, slots, digs, recs, io_idx, ok)
        if batch is None:
            for i in io_idx:  # backpressure: undo, nothing was queued
                undo = recs[i]
                assert undo is not None
                self._forget(digs[i], undo)
            self.counters["busy_drops"] += len(keys)
            return None
        return batch.token

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        self._check(keys, slots)
        digs = [key_digest(k) for k in keys]
        recs: list[int | None] = [None] * len(keys)
        io_idx: list[int] = []
        for i, d in enumerate(digs):
            rec = self.index.pin_ready(d)  # pinned: not evicted while it loads
            if rec < 0:
                continue
            recs[i] = rec
            io_idx.append(i)
        batch = self._launch("load", keys, slots, digs, recs, io_idx, [False] * len(keys))
        if batch is None:
            for i in io_idx:
                pinned = recs[i]
                assert pinned is not None
                self.index.unpin(pinned)
            return None
        return batch.token

    # -- reads by another process (an engine worker streaming a hit) ----------
    def reader_spec(self) -> dict[str, Any] | None:
        """What a :class:`DiskReader` in another process needs to read this
        tier's records (None without data: nothing to read)."""
        if self.no_data or self.store is None:
            return None
        return {"kind": "disk", "paths": list(self.paths), "file_bytes": self.file_bytes,
                "ns": self.ns, "block_bytes": self.block_bytes, "backend": self.opts["backend"],
                "timeout_s": self.opts["timeout_s"]}  # fmt: skip

    def pin_for_read(self, keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
        """Locations of ``keys`` (all HIT) as ``(n, 3)`` int64 of record,
        file, offset, and their digests (16 bytes each, concatenated). The
        records are neither evicted nor reused until :meth:`unpin_read` of the
        same record numbers. Counts as a use for the eviction policy."""
        out = np.empty((len(keys), 3), np.int64)
        digs = [key_digest(k) for k in keys]
        for i, d in enumerate(digs):
            rec = self.index.get(d)
            if rec is None or self.index.state(rec) != _READY:
                raise InvalidArgument(f"pin_for_read of a key that is not a HIT: {d.hex()[:16]}")
            out[i] = (rec, *self._locate(rec))
        for rec in out[:, 0].tolist():
            self.index.pin(rec)
            self.index.touch(rec)
        return out, b"".join(digs)

    def unpin_read(self, records: Sequence[int]) -> None:
        """The reads of ``records`` pinned by :meth:`pin_for_read` ended."""
        for rec in records:
            self.index.unpin(int(rec))

    def read_failed(self, locations: np.ndarray, digests: bytes) -> None:
        for i, loc in enumerate(locations):
            self._drop_unreadable(int(loc[0]), digests[16 * i : 16 * i + 16])

    def _drop_unreadable(self, rec: int, dig: bytes, key: bytes | None = None) -> None:
        """A read of ``rec`` (holding ``dig``: ``key``, when known) failed:
        counted, and the record dropped unless another read still has it or
        it was reused since."""
        self.counters["load_failures"] += 1
        ix = self.index
        if ix.state(rec) == _READY and ix.loading(rec) == 0 and ix.digest(rec) == dig:
            key = key if key is not None else self._event_keys.get(dig)
            self._forget(dig, rec)
            self._journal(_DEL, rec, dig)
            if key is not None:
                self._events.append(TierEvent([key], self.name, removed=True))

    def reserve_for_write(self, keys: Sequence[bytes]) -> list[tuple[int, np.ndarray, bytes]]:
        """Records for ``keys`` that another process writes itself (an engine
        worker storing blocks the host tier has no room for): per key that
        is admitted, not stored yet and gets a record, ``(position in keys,
        location (record, file, offset), digest)``. Each stays unreadable
        until :meth:`commit_write`; may evict (reported as events)."""
        out: list[tuple[int, np.ndarray, bytes]] = []
        evicted: list[bytes] = []
        for i, k in enumerate(keys):
            d = key_digest(k)
            if d in self.index or not self.admit(k):
                continue
            rec = self._claim(d, k, evicted)
            if rec < 0:
                break
            out.append((i, np.array([rec, *self._locate(rec)], np.int64), d))
        if evicted:
            self._events.append(TierEvent(evicted, self.name, removed=True))
        return out

    def commit_write(self, key: bytes, record: int, ok: bool) -> None:
        """The write of ``record`` reserved for ``key`` ended: readable (and
        journaled) when ``ok``, else the record is free again."""
        d = key_digest(key)
        if self.index.state(record) != _WRITING or self.index.digest(record) != d:
            return  # not ours any more (reset)
        if ok:
            self.index.set_ready(record)
            self._journal(_PUT, record, d)
            count_moved(self.counters, "store", 1, self.record_bytes)
            self._events.append(TierEvent([key], self.name, removed=False))
        else:
            self.counters["io_errors"] += 1
            self._forget(d, record)

    def poll(self) -> list[TierCompletion]:
        ended, released = self.jobs.poll()
        for rel in released:  # a timed-out job really ended: its memory is free
            d = rel.batch.data
            idx = d["io_idx"][rel.first : rel.first + rel.count]
            if rel.batch.kind == "store":  # a late write may have landed in these records
                for i in idx:
                    rec = d["recs"][i]
                    state = self.index.state(rec)
                    if state == _HELD:
                        self.index.release(rec)
                        self._held -= 1
                    elif state == _WRITING:  # its batch has not ended: free it then
                        self._ended_early.add(rec)
            self._released.extend(d["slots"][i] for i in idx)
        out = [self._finish(b) for b in ended]
        self._flush_journal()
        return out

    def _finish(self, b: Batch) -> TierCompletion:
        d = b.data
        keys, digs, recs, ok = d["keys"], d["digs"], d["recs"], d["ok"]
        held = [False] * len(keys)
        stored: list[bytes] = []
        loaded = 0
        for k, i in enumerate(d["io_idx"]):
            rec, dig = recs[i], digs[i]
            code = b.items[k] if b.n else 0  # no-data mode: the index only
            held[i] = b.held[k] if b.n else False
            if b.kind == "store":
                if code == 0:
                    self.index.set_ready(rec)
                    self._journal(_PUT, rec, dig)
                    ok[i] = True
                    stored.append(keys[i])
                else:
                    if code == ItemStatus.NO_SPACE:  # stop admitting for a while
                        self._nospace_until = time.monotonic() + 1.0
                    self.counters["io_errors"] += 1
                    hold = held[i] and rec not in self._ended_early  # freed when the job ends
                    self._ended_early.discard(rec)
                    self._forget(dig, rec, hold=hold)
            else:
                self.index.unpin(rec)
                if code == 0:
                    ok[i] = True
                    self.index.touch(rec)
                    loaded += 1
                else:
                    # Torn, foreign or unreadable: a miss, counted, and dropped.
                    self.counters["corrupt" if code < 0 else "io_errors"] += 1
                    self._drop_unreadable(rec, dig, keys[i])
        count_moved(self.counters, "store", len(stored), self.record_bytes)
        count_moved(self.counters, "load", loaded, self.record_bytes)
        if stored:
            self._events.append(TierEvent(stored, self.name, removed=False))
        return TierCompletion(
            b.token, all(ok), b.kind, keys, key_ok=list(ok), held=held if any(held) else None
        )

    def has_pending_work(self) -> bool:
        return self.jobs.busy()

    def take_released_slots(self) -> list[int]:
        out, self._released = self._released, []
        return out

    def reset(self) -> None:
        for rec in self.index.ready_records().tolist():
            if self.index.loading(rec) == 0:
                dig = self.index.digest(rec)
                self._forget(dig, rec)
                self._journal(_DEL, rec, dig)
        self._flush_journal()

    def _release(self) -> None:
        self._flush_journal()
        os.close(self._journal_fd)
        self._journal_fd = -1
        # The native store holds the extent files open: let go of them now,
        # not whenever the tier object is collected (an unmount waits on it).
        self.store = None
        if self._owner is not None:  # after the files: the next owner may start now
            self._owner.release()
            self._owner = None

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "direct": getattr(self, "_direct", None),
            "blocks": len(self.index),
            "capacity_blocks": self.num_records,
            "held_jobs": self.jobs.held_jobs,
            **self.counters,
        }


class DiskIO:
    """Reads and writes records of a :class:`DiskTier` owned by another
    process (the engine's scheduler) from and to slots of ``pool``: an engine
    worker streaming blocks between its KV cache and the disk. The owner pins
    the records (:meth:`DiskTier.pin_for_read`, :meth:`DiskTier.reserve_for_write`)
    for as long as the I/O may run; every read re-checks the record's
    trailer (namespace, key digest, length, crc32c), so a record that changed
    under it fails rather than serving wrong bytes; a write builds the
    trailer in the slot.

    Who calls: one thread of the worker. :meth:`submit` never blocks; results
    come from ``engine.poll()`` in completion order, one status per record.
    """

    def __init__(self, spec: dict[str, Any], pool: Any, num_threads: int = 2) -> None:
        from kvtier import _native
        from kvtier.engine import Engine

        if pool.slot_bytes < record_bytes(int(spec["block_bytes"])) or pool.slot_bytes % 4096:
            raise InvalidArgument(
                f"reader slots of {pool.slot_bytes} B cannot hold a record of "
                f"{record_bytes(int(spec['block_bytes']))} B"
            )
        self.block_bytes = int(spec["block_bytes"])
        self.pool = pool
        self.store: _native.DiskStore | None = _native.DiskStore(
            list(spec["paths"]), int(spec["file_bytes"]), str(spec["backend"]), 32, 1 << 20,
            True, False, bytes(spec["ns"]), [(pool.address, pool.nbytes)], True,
        )  # fmt: skip
        self.engine = Engine(num_threads, [(256 << 20, False, float(spec["timeout_s"]))])
        self.engine.register_pool(pool)

    def submit(
        self, slots: Sequence[int], locations: np.ndarray, digests: bytes, write: bool = False
    ) -> int:
        """One job reading record ``locations[i]`` (record, file, offset)
        into slot ``slots[i]`` (or writing it from there); returns its engine job id."""
        n = len(slots)
        arr = np.empty((n, 4), np.int64)
        arr[:, 0] = self.pool.address + np.asarray(slots, np.int64) * self.pool.slot_bytes
        arr[:, 1:3] = locations[:, 1:3]
        arr[:, 3] = self.block_bytes
        keys = np.frombuffer(digests, np.uint8).reshape(n, 16)
        if self.store is None:
            raise ClosedError("disk reader is closed")
        return int(self.engine._engine.submit_disk(self.store, write, arr, keys, 0))

    def close(self) -> None:
        """Drain the reads in flight and let go of the files. Blocks."""
        self.engine.close()
        self.store = None


def directory_mode_ok(path: Path) -> bool:
    """True when ``path`` is private to its owner (0700)."""
    return stat.S_IMODE(path.stat().st_mode) == 0o700
