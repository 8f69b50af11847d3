"""The disk index's files: the journal and the checkpoint, the one owner of
their format on the Python side.

``index.journal`` is append-only, one :data:`JOURNAL_ENTRY` per record that
became readable (:attr:`JournalOp.PUT`) or was dropped
(:attr:`JournalOp.DROP`), with the record's event id (what names it in the
tier's events once its key is gone). Python writes it; the native index parses it at a
warm restart (``DiskIndex.replay_journal`` in ``csrc/bindings/disk_index.cc``,
whose ``kJournal*`` constants name the same layout, and ``kJournalPut`` /
``kJournalDrop`` in ``csrc/core/disk/index.h``). ``index.ckpt`` is a
snapshot that bounds the journal: the index's readable records in bulk
(record numbers, digests, event ids and groups, one crc32), written and read
here. Files of the earlier formats (``KVJ1`` entries, ``KVC2``) are still
read; their records have no event id. The record
states the native index reports are :class:`RecordState` (``RecState`` in
``index.h``). ``tests/integration/test_disk_index.py`` fails when the two
sides drift.

Runs in the scheduler process. Who calls: :class:`~kvtier.tiers.disk.DiskTier`,
under the manager's lock. :meth:`IndexJournal.recover`, :meth:`IndexJournal.flush`
and :meth:`IndexJournal.checkpoint` block on the file system; appending an
entry only buffers it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import IoError
from kvtier.tiers.disk.directory import os_call, write_all

__all__ = [
    "CHECKPOINT_HEAD",
    "CHECKPOINT_MAGIC",
    "JOURNAL_ENTRY",
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


#: One journal entry: magic, op, event group (u8), 2 pad bytes, record (u64),
#: key digest (16 bytes), block length (u64), sequence (u64), event id (8
#: bytes as in the 12-byte event id: big-endian), then a zlib crc32 of all
#: before it. Its offsets are ``kJournal*`` in
#: ``csrc/bindings/disk_index.cc``.
JOURNAL_ENTRY = struct.Struct("<4sBBxxQ16sQQ8sI")
JOURNAL_ENTRY_BYTES = 60  # kJournalEntryBytes
JOURNAL_MAGIC = b"KVJ2"  # kJournalMagic
#: The group of a record without an event id (``kUnnamed`` in ``index.h``).
UNNAMED = 63
_NO_ID = bytes(8)
_J_BODY = struct.Struct(JOURNAL_ENTRY.format[:-1])  # all but the crc, which covers it
_J_CRC = struct.Struct("<I")
assert JOURNAL_ENTRY.size == JOURNAL_ENTRY_BYTES

#: Checkpoint head: magic, format, block bytes, records of the tier, entries,
#: seq, crc32 of the body; the body is the entries' record numbers (uint32),
#: then their digests (16 bytes each), event ids (uint64) and event groups
#: (uint8), least valuable first (LRU order). ``KVC2`` had no ids or groups.
CHECKPOINT_HEAD = struct.Struct("<4sIQQQQI4x")
CHECKPOINT_MAGIC = b"KVC3"
_CKPT_V2_MAGIC = b"KVC2"
_CKPT_ENTRY_BYTES = 4 + 16 + 8 + 1
_CKPT_V2_ENTRY_BYTES = 4 + 16

JOURNAL_FILE = "index.journal"
CHECKPOINT_FILE = "index.ckpt"


def journal_entry(
    op: JournalOp,
    record: int,
    digest: bytes,
    block_bytes: int,
    seq: int,
    event_id: bytes | None = None,
) -> bytes:
    """One whole journal entry, crc included. ``event_id``: 12 bytes (id,
    then group, big-endian; see :func:`kvtier.tiers.events.vllm_event_id`)
    or None."""
    # An event id's group is below UNNAMED: its last byte is all of it.
    ident, group = (event_id[:8], event_id[11]) if event_id is not None else (_NO_ID, UNNAMED)
    body = _J_BODY.pack(JOURNAL_MAGIC, op, group, record, digest, block_bytes, seq, ident)
    return body + _J_CRC.pack(zlib.crc32(body))


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
            data = os_call("read", p, p.read_bytes)
            if fname == CHECKPOINT_FILE and data[:4] in (CHECKPOINT_MAGIC, _CKPT_V2_MAGIC):
                self._apply_checkpoint(index, data)
                continue
            # A journal, or a checkpoint in the journal's format (before KVC2).
            good, seq, _ = index.replay_journal(data, self.block_bytes)
            self.seq = max(self.seq, seq)
            if fname == JOURNAL_FILE and good < len(data):
                os_call("truncate", p, os.truncate, p, good)
        jpath = self.dir / JOURNAL_FILE
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self.fd = os_call("open", jpath, os.open, jpath, flags, 0o600)
        self._size = os.fstat(self.fd).st_size

    def _apply_checkpoint(self, index: Any, data: bytes) -> None:
        where = self.dir / CHECKPOINT_FILE
        if len(data) < CHECKPOINT_HEAD.size:
            warnings.warn(f"kvtier disk tier: {where} is truncated: ignored", stacklevel=3)
            return
        magic, _fmt, block_bytes, _, count, seq, crc = CHECKPOINT_HEAD.unpack_from(data)
        named = magic == CHECKPOINT_MAGIC
        body = memoryview(data)[CHECKPOINT_HEAD.size :]
        per = _CKPT_ENTRY_BYTES if named else _CKPT_V2_ENTRY_BYTES
        if len(body) != per * count or zlib.crc32(body) != crc:
            warnings.warn(f"kvtier disk tier: {where} is damaged: ignored", stacklevel=3)
            return
        self.seq = max(self.seq, seq)
        if block_bytes != self.block_bytes:
            return  # from a different configuration
        recs = np.frombuffer(body, np.uint32, count)
        digs = np.frombuffer(body, np.uint8, 16 * count, 4 * count).reshape(count, 16)
        ids = groups = None
        if named:
            ids = np.frombuffer(body, "<u8", count, 20 * count).astype(np.uint64)
            groups = np.frombuffer(body, np.uint8, count, 28 * count)
        keep = recs < self.num_records  # from a larger configuration
        if not keep.all():
            recs, digs = recs[keep], digs[keep]
            if ids is not None and groups is not None:
                ids, groups = ids[keep], groups[keep]
        index.apply(recs, digs, ids, groups)

    # -- appending -------------------------------------------------------------
    def append(
        self, op: JournalOp, record: int, digest: bytes, event_id: bytes | None = None
    ) -> None:
        """Buffer one entry (written by the next :meth:`flush`)."""
        # Wraps: a journal from elsewhere may end at seq 2**64-1 (only order in the file counts).
        self.seq = (self.seq + 1) & 0xFFFF_FFFF_FFFF_FFFF
        self._buf += journal_entry(op, record, digest, self.block_bytes, self.seq, event_id)
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
        files as they were. Blocks while it writes and fsyncs about 29 bytes
        per record."""
        tmp = self.dir / "index.ckpt.tmp"
        recs = index.ready_records()
        ids, groups = index.event_ids(recs)
        body = (
            recs.tobytes() + index.digests(recs).tobytes() + ids.astype("<u8").tobytes()
            + groups.tobytes()
        )  # fmt: skip
        head = CHECKPOINT_HEAD.pack(
            CHECKPOINT_MAGIC, 1, self.block_bytes, self.num_records, len(recs), self.seq,
            zlib.crc32(body),
        )  # fmt: skip

        def write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, head)
                write_all(fd, body)
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
