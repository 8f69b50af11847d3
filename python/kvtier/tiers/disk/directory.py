"""The disk tier's directory: who owns it, how big the tier may be, and the
slab files allocated in it (removed again when construction fails).

Runs in the scheduler process (where the :class:`~kvtier.tiers.disk.DiskTier`
lives). Who calls: the disk tier's constructor and close, the vLLM shim
(:func:`resolve_capacity`), ``kvtier doctor`` (:func:`check_directory`,
:func:`directory_mode_ok`). Everything here blocks on the file system
(``statvfs``, ``mkdir``, ``fallocate``), briefly; :class:`OwnerLock` never
waits for another owner.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from kvtier.errors import InUse, InvalidArgument, IoError, NoSpace
from kvtier.units import FreeFraction, format_size, to_capacity

__all__ = [
    "LOCK_FILE",
    "OwnerLock",
    "SlabFiles",
    "check_directory",
    "directory_mode_ok",
    "os_call",
    "resolve_capacity",
    "write_all",
]

#: Largest slab file: a tier of more records spreads them over several.
EXTENT_MAX = 8 << 30
LOCK_FILE = "owner.lock"
_SIZE_OPTIONS = "DiskTier(capacity_bytes=...), --disk DIR:SIZE or kvtier_disk_bytes"
_T = TypeVar("_T")


def os_call(what: str, path: Path | str, call: Callable[..., _T], *args: Any) -> _T:
    """``call(*args)`` with an OSError turned into the error a user reads:
    :class:`NoSpace` for ENOSPC/EDQUOT, else :class:`IoError`, naming ``path``."""
    try:
        return call(*args)
    except OSError as e:
        code = e.errno or errno.EIO
        cls = NoSpace if code in (errno.ENOSPC, errno.EDQUOT) else IoError
        raise cls(code, f"disk tier: {what} {path}: {os.strerror(code)}") from None


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _allocated(path: Path) -> int:
    """Bytes the file system has allocated to ``path`` (0 when missing)."""
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _fs_space(path: Path) -> tuple[int, int]:
    """(bytes free to unprivileged users, total bytes) of ``path``'s file system."""
    st = os_call("statvfs", path, os.statvfs, path)
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


def directory_mode_ok(path: Path) -> bool:
    """True when ``path`` is private to its owner (0700)."""
    return stat.S_IMODE(path.stat().st_mode) == 0o700


class OwnerLock:
    """One owner per directory: an exclusive ``flock`` on ``DIR/owner.lock``
    holding the owner's pid, taken without waiting.

    The kernel drops an flock when its holder dies (kill -9 included), so a
    directory left by a killed process is simply taken over. Who calls:
    :class:`DiskTier` at construction and close. Never blocks.
    """

    fd = -1

    def __init__(self, directory: Path, what: str = "disk tier directory") -> None:
        self.path = directory / LOCK_FILE
        while True:
            fd = os_call(
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


class SlabFiles:
    """The slab files of one tier in ``directory``, records of ``record_bytes``.

    :meth:`open` makes and owns the directory, sizes the tier and allocates
    its slabs; every path it creates is remembered (files grown, with their
    old size) so that :meth:`undo` can take back a construction that failed
    later, and :meth:`keep` forgets them once it succeeded. ``owner`` is the
    directory's :class:`OwnerLock` while held.
    """

    def __init__(self, directory: Path, record_bytes: int) -> None:
        self.dir = directory
        self.record_bytes = record_bytes
        self.owner: OwnerLock | None = None
        self.num_records = 0
        self.per_file = 1
        self.paths: list[str] = []
        self.file_bytes = 0
        self._created: list[Path] = []
        self._grown: list[tuple[Path, int]] = []

    def open(self, capacity: int | str | FreeFraction, reserve: int | None, no_data: bool) -> None:
        """Make and own the directory, size the tier, allocate its slabs
        (none when ``no_data``: an index-only tier moves no bytes)."""
        if not self.dir.exists():
            os_call("mkdir", self.dir, self.dir.mkdir, 0o700)
            self._created.append(self.dir)
        os_call("chmod", self.dir, os.chmod, self.dir, 0o700)
        if self.dir.stat().st_uid != os.geteuid():
            raise IoError(errno.EPERM, f"{self.dir} is owned by another user: refusing it")
        self.owner = OwnerLock(self.dir)
        own = sorted(self.dir.glob("slab-*.dat"))
        capacity_bytes = resolve_capacity(capacity, self.dir, own)
        self.num_records = capacity_bytes // self.record_bytes
        if self.num_records < 1:
            raise InvalidArgument(
                f"disk capacity {capacity_bytes} B holds no record of {self.record_bytes} B"
            )
        self.per_file = max(1, EXTENT_MAX // self.record_bytes)
        nfiles = -(-self.num_records // self.per_file)
        self.paths = [str(self.dir / f"slab-{i:03d}.dat") for i in range(nfiles)]
        self.file_bytes = min(self.num_records, self.per_file) * self.record_bytes
        if not no_data:
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
            fd = os_call("create", p, os.open, p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if not existed:
                    self._created.append(p)
                size = os.fstat(fd).st_size
                if existed and size < self.file_bytes:
                    self._grown.append((p, size))
                os_call("preallocate", p, os.posix_fallocate, fd, 0, self.file_bytes)
            finally:
                os.close(fd)

    def keep(self) -> None:
        """Construction succeeded: nothing is undone any more."""
        self._created, self._grown = [], []

    def undo(self) -> None:
        """Remove what a failed construction created (newest first), shrink
        what it grew, let go of the directory."""
        for p, size in self._grown:
            with contextlib.suppress(OSError):
                os.truncate(p, size)
        made_dir = self.dir in self._created
        owned = self.owner is not None
        if made_dir and owned:  # ours alone: nothing of anyone else's can be inside
            for p in self.dir.iterdir():
                if p.name != LOCK_FILE:
                    with contextlib.suppress(OSError):
                        p.unlink()
        elif owned:
            for p in reversed(self._created):
                with contextlib.suppress(OSError):
                    p.unlink()
        # Not owned (another process took the directory we had just made):
        # everything in it is that process's; at most the empty directory goes.
        if self.owner is not None:
            self.owner.release(unlink=made_dir)
            self.owner = None
        if made_dir:
            with contextlib.suppress(OSError):
                self.dir.rmdir()
        self.keep()

    def release(self) -> None:
        """Let go of the directory (close: the next owner may start now)."""
        if self.owner is not None:
            self.owner.release()
            self.owner = None
