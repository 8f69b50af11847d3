"""The disk tier, split by job: :mod:`~kvtier.tiers.disk.directory` (who owns
the directory, its size, its slab files and their rollback),
:mod:`~kvtier.tiers.disk.journal` (the index's journal and checkpoint, the
one owner of their format), :mod:`~kvtier.tiers.disk.tier` (the tier itself,
in the scheduler process) and :mod:`~kvtier.tiers.disk.worker` (its records
read and written by an engine worker).

This package re-exports what code outside it imports. Nothing here runs or
blocks at import.

Process: the scheduler (the tier) and the engine's workers (``worker``).
Who calls: the manager and the tier factory; the shim's stream loader.
"""

from __future__ import annotations

from kvtier.tiers.disk.directory import (
    OwnerLock,
    check_directory,
    directory_mode_ok,
    resolve_capacity,
)
from kvtier.tiers.disk.journal import JournalOp, RecordState
from kvtier.tiers.disk.tier import DISK_POLICIES, DiskTier
from kvtier.tiers.disk.worker import DiskIO, DiskReaderSpec
from kvtier.tiers.records import TRAILER_BYTES, key_digest, namespace_digest, record_bytes

__all__ = [
    "DISK_POLICIES",
    "TRAILER_BYTES",
    "DiskIO",
    "DiskReaderSpec",
    "DiskTier",
    "JournalOp",
    "OwnerLock",
    "RecordState",
    "check_directory",
    "directory_mode_ok",
    "key_digest",
    "namespace_digest",
    "record_bytes",
    "resolve_capacity",
]
