"""The disk index's files: the journal and the checkpoint.

``index.journal`` is append-only, one entry per record that became readable
(:attr:`JournalOp.PUT`) or was dropped (:attr:`JournalOp.DROP`), with the
record's event id (what names it in the tier's events once its key is gone)
and its prefix link (the record before it in its chain), so a restart keeps
the chains. ``index.ckpt`` is a snapshot that bounds the journal: the
index's readable records in bulk, links included. Files of the earlier
formats are still read: ``KVJ2`` and ``KVC3`` (no links: chains start anew),
``KVJ1`` and ``KVC2`` (no event id either).

Every byte of both is encoded and decoded natively, in one place
(``csrc/core/disk/journal.h``, through ``kvtier._native``: ``disk_journal_entry``,
``DiskIndex.replay_journal``, ``encode_checkpoint`` and ``apply_checkpoint``);
this module opens, appends, fsyncs and renames the files. The record states
the native index reports are :class:`RecordState` (``RecState`` in
``csrc/core/disk/index.h``).

Runs in the scheduler process. Who calls: :class:`~kvtier.tiers.disk.DiskTier`,
under the manager's lock. :meth:`IndexJournal.recover`, :meth:`IndexJournal.flush`
and :meth:`IndexJournal.checkpoint` block on the file system; appending an
entry only buffers it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import mmap
import os
import warnings
from pathlib import Path
from typing import Any

from kvtier import _native
from kvtier.errors import IoError
from kvtier.tiers.disk.directory import os_call, write_all

__all__ = [
    "CHECKPOINT_ENTRY_BYTES",
    "CHECKPOINT_HEAD_BYTES",
    "CHECKPOINT_MAGIC",
    "JOURNAL_ENTRY_BYTES",
    "JOURNAL_MAGIC",
    "UNNAMED",
    "IndexJournal",
    "JournalOp",
    "RecordState",
    "journal_entry",
]


class RecordState(enum.IntEnum):
    """A record's state in the native index (``DiskIndex.state``): the values
    of ``RecState`` in ``csrc/core/disk/index.h``."""

    FREE = 0
    READY = 1  # readable
    WRITING = 2  # allocated to a store in flight
    HELD = 3  # out of use until a timed-out job ends


class JournalOp(enum.IntEnum):
    """What a journal entry says of its record: ``kJournalPut`` and
    ``kJournalDrop`` in ``csrc/core/disk/index.h``."""

    PUT = 1  # the record holds the digest and is readable
    DROP = 2  # the record was dropped


#: Bytes of one journal entry (the layout: ``csrc/core/disk/journal.h``).
JOURNAL_ENTRY_BYTES: int = _native.DISK_JOURNAL_ENTRY_BYTES
JOURNAL_MAGIC: bytes = _native.DISK_JOURNAL_MAGIC
#: A checkpoint: a head, then this many bytes per record.
CHECKPOINT_HEAD_BYTES: int = _native.DISK_CHECKPOINT_HEAD_BYTES
CHECKPOINT_ENTRY_BYTES: int = _native.DISK_CHECKPOINT_ENTRY_BYTES
CHECKPOINT_MAGIC: bytes = _native.DISK_CHECKPOINT_MAGIC
#: The group of a record without an event id (``kUnnamed`` in ``index.h``).
UNNAMED: int = _native.DISK_UNNAMED_GROUP

JOURNAL_FILE = "index.journal"
CHECKPOINT_FILE = "index.ckpt"


def journal_entry(
    op: JournalOp,
    record: int,
    digest: bytes,
    block_bytes: int,
    seq: int,
    event_id: bytes | None = None,
    parent: tuple[int, bytes] | None = None,
) -> bytes:
    """One whole journal entry, crc included. ``event_id``: 12 bytes (id,
    then group, big-endian; see :func:`kvtier.tiers.events.vllm_event_id`)
    or None. ``parent``: the record before it in its prefix chain and the
    digest that record holds, or None. Raises InvalidArgument for a digest
    that is not 16 bytes or an event id that is not one."""
    prec, pdig = parent if parent is not None else (-1, None)
    entry: bytes = _native.disk_journal_entry(
        op, record, digest, block_bytes, seq, event_id, prec, pdig
    )
    return entry


def _read(path: Path) -> Any:
    """``path``'s bytes: mapped (a checkpoint may be gigabytes: no copy, and
    its pages read ahead), or b"" when empty."""

    def read() -> Any:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)

    return os_call("read", path, read)


class IndexJournal:
    """The journal and checkpoint of the tier whose files are in ``directory``
    (records of ``block_bytes``, ``num_records`` of them; ``sync``: fdatasync
    every append).

    Entries are buffered by :meth:`append` and written by :meth:`flush`. A
    failed append (the file system full) is cut back to the last whole
    entry and every entry since is dropped (:attr:`lost`): the index in
    memory stays right and every load re-checks its record, so a restart
    would miss only recent blocks; a :meth:`checkpoint` written once there
    is room again brings the files up to date.
    """

    def __init__(self, directory: Path, block_bytes: int, num_records: int, sync: bool) -> None:
        self.dir = directory
        self.block_bytes = block_bytes
        self.num_records = num_records
        self.sync = sync
        self.fd = -1
        self.seq = 0
        self.entries = 0  # appended since the last checkpoint
        self.lost = False  # entries dropped: checkpoint when possible
        self._buf = bytearray()
        self._size = 0  # bytes known good: a failed append is cut back to it

    # -- warm restart ----------------------------------------------------------
    def recover(self, index: Any) -> None:
        """Apply the checkpoint, then the journal, to ``index`` (a native
        ``DiskIndex``; the caller rebuilds it once after), and open the
        journal for appending.

        Both are applied natively in their order (the journal entry by entry
        up to its first torn or foreign entry, which is cut off); of two
        records claiming one digest the later record number wins."""
        for fname in (CHECKPOINT_FILE, JOURNAL_FILE):
            p = self.dir / fname
            if not p.exists():
                continue
            data = _read(p)
            try:
                size = len(data)
                if fname == CHECKPOINT_FILE and self._apply_checkpoint(index, data):
                    continue
                # A journal, or a checkpoint in the journal's format (before KVC2).
                good, seq, _ = index.replay_journal(data, self.block_bytes)
                self.seq = max(self.seq, seq)
            finally:
                if isinstance(data, mmap.mmap):
                    data.close()
            if fname == JOURNAL_FILE and good < size:
                os_call("truncate", p, os.truncate, p, good)
        jpath = self.dir / JOURNAL_FILE
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self.fd = os_call("open", jpath, os.open, jpath, flags, 0o600)
        self._size = os.fstat(self.fd).st_size

    def _apply_checkpoint(self, index: Any, data: bytes) -> bool:
        """False when ``data`` is no checkpoint (the journal's format)."""
        status, seq, _ = index.apply_checkpoint(data, self.block_bytes)
        if status == "journal":
            return False
        if status in ("truncated", "damaged"):
            where = self.dir / CHECKPOINT_FILE
            warnings.warn(f"kvtier disk tier: {where} is {status}: ignored", stacklevel=3)
        else:  # applied, or "foreign": another block size, whose sequence still counts
            self.seq = max(self.seq, seq)
        return True

    # -- appending -------------------------------------------------------------
    def append(
        self,
        op: JournalOp,
        record: int,
        digest: bytes,
        event_id: bytes | None = None,
        parent: tuple[int, bytes] | None = None,
    ) -> None:
        """Buffer one entry (written by the next :meth:`flush`); ``parent``:
        see :func:`journal_entry`."""
        # Wraps: a journal from elsewhere may end at seq 2**64-1 (only order in the file counts).
        self.seq = (self.seq + 1) & 0xFFFF_FFFF_FFFF_FFFF
        self._buf += journal_entry(op, record, digest, self.block_bytes, self.seq, event_id, parent)
        self.entries += 1

    @property
    def pending(self) -> bool:
        """Entries appended since the last flush, or a failed append to retry."""
        return self.lost or bool(self._buf)

    def discard(self) -> None:
        """Drop the buffered entries (they are lost already: see :attr:`lost`)."""
        self._buf = bytearray()

    def flush(self) -> bool:
        """Append the buffered entries: False when that failed (the entries
        are dropped and :attr:`lost` is set)."""
        if not self._buf:
            return True
        try:
            n = os.write(self.fd, self._buf)
            if n != len(self._buf):
                raise OSError(errno.ENOSPC, "short write")
            if self.sync:
                os.fdatasync(self.fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self._size)
            self._buf = bytearray()
            self.lost = True
            return False
        self._size += n
        self._buf = bytearray()
        return True

    def checkpoint(self, index: Any) -> None:
        """Snapshot ``index``'s readable records and truncate the journal
        (crash safe at every point). Raises NoSpace or IoError, leaving the
        files as they were. Blocks while it writes and fsyncs 29 bytes per
        record."""
        tmp = self.dir / "index.ckpt.tmp"
        data = index.encode_checkpoint(self.block_bytes, self.seq)

        def write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.dir / CHECKPOINT_FILE)

        try:
            os_call("checkpoint", tmp, write)
        except IoError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.ftruncate(self.fd, 0)
        self._size = 0
        self.entries = 0
        self.lost = False

    def close(self) -> None:
        """Close the journal file (flush first). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
