"""What a block carries on disk and in the remote pool: the one owner of the
record format's Python side and of the namespace and key digests.

Process: any (the scheduler's tiers, the worker's readers, the shim).

Every stored block carries its key digest, its namespace digest, its length
and a crc32c (DESIGN.md, hard rules 3 and 4). The native core writes and
checks the trailer (disk: a 4 KiB trailer after the 4 KiB-padded payload;
remote: a 64-byte header before it); Python computes the digests it is given
and sizes host slots and disk records.

Who calls: the disk and remote tiers, the tier factory, the vLLM shim (which
names its namespace from the engine's configuration) and the benchmarks.
Pure functions: nothing blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

#: Bytes after the payload of a disk record (magic, version, digests, length, crc32c).
TRAILER_BYTES = 4096
#: Direct I/O alignment: disk payloads are padded to it.
ALIGN = 4096


def record_bytes(block_bytes: int) -> int:
    """Bytes a block takes on disk and in a host slot the disk tier reads into."""
    return -(-block_bytes // ALIGN) * ALIGN + TRAILER_BYTES


def namespace_digest(namespace: str | bytes, block_bytes: int) -> bytes:
    """The 16-byte digest a tier stamps on every record: ``namespace`` plus
    the block size, so two layouts never read each other's bytes."""
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return hashlib.blake2b(
        b"kvtier-ns-v1\0" + ns + struct.pack("<Q", block_bytes), digest_size=16
    ).digest()


def key_digest(key: bytes) -> bytes:
    """The 16-byte digest under which a tier indexes and stores an engine key."""
    return hashlib.blake2b(key, digest_size=16).digest()


def namespace_name(parts: Iterable[object]) -> str:
    """A namespace from what makes bytes compatible (model, dtype, layout,
    block size, topology, a user's extra tag): 32 hex digits, the same for the
    same parts in the same order. ``None`` and ``""`` count as given values."""
    text = "\0".join(str(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
