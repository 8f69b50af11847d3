"""The pool's own event stream: what every engine sharing a Redis/Valkey pool
stored there, and what left it, as entries of one bounded Redis Stream per
namespace. This module is the format (stream key, entry fields, encoding and
decoding); :mod:`kvtier.tiers.remote` appends stores, :mod:`kvtier.pool_events`
reads the stream, watches the server's own removals and appends them.

Process: any. Who calls: the remote tier (scheduler process), the ``kvtier
events`` command. Pure: no I/O, never blocks.

An entry names up to :data:`ENTRY_BLOCKS` blocks, all of one operation:

``op``       ``stored`` (the writer's SETs were acknowledged: readable now) or
             ``removed`` (the server evicted or expired them, they were
             deleted, or a reconciling check found them gone)
``engine``   who wrote the entry: an engine's instance id, or the watcher's
``tier``     the writing tier's name (``remote``)
``ts``       the writer's wall clock, milliseconds since the Unix epoch (the
             entry id is the server's)
``keys``     16-byte key digests, concatenated: the server key of digest d is
             ``kvt:<ns>:<hex(d)>``
``ids``      12-byte event ids, same order (:func:`kvtier.tiers.events.vllm_event_id`:
             an 8-byte id then a 4-byte group, big-endian); :data:`UNNAMED`
             where the writer does not know it
``reason``   removed only: ``evicted``, ``expired``, ``deleted`` or ``missing``
``epoch``    stored only, absent for 0: the namespace's clear count
             (:func:`epoch_key`) the writer knew before it sent the SETs. A
             clear (SGLang's) deletes the values, then the stream, then
             increments the count; a reader drops a stored entry of an
             older epoch, which may name values the clear deleted (its XADD
             goes :data:`~kvtier.tiers.remote.tier.STREAM_DELAY_S` or more
             after the SETs, so it can land after the clear)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ENTRY_BLOCKS",
    "STREAM_MAXLEN",
    "UNNAMED",
    "PoolEvent",
    "decode_entry",
    "epoch_key",
    "lease_key",
    "stream_key",
    "xadd_commands",
]

#: Blocks one entry names at most (a larger batch is several entries). Why
#: this many: the server's cost is mostly per command (with 64, its CPU grew
#: by 3.5% of what the stores of 16 KiB blocks took, bench/pool_events_cost.py).
ENTRY_BLOCKS = 256

#: Entries the stream keeps by default (``XADD MAXLEN ~``): at most about
#: 4,096 x (256 x 28 + 100) bytes, 28 MiB, of the server's memory, naming
#: up to a million blocks.
STREAM_MAXLEN = 4_096

#: The event id of a block whose writer did not know it (group 0xffffffff is
#: never a real one: groups are below :data:`kvtier.tiers.events.EVENT_GROUPS`).
UNNAMED = b"\xff" * 12

_STREAM_PREFIX = b"kvt-events:"


def stream_key(key_prefix: bytes) -> bytes:
    """The stream of the namespace whose server keys start with
    ``key_prefix`` (``kvt:<16 hex>:``): ``kvt-events:<16 hex>``.

    Why not under ``kvt:``: tools that walk a namespace's values with
    ``SCAN kvt:<ns>:*`` (SGLang's ``clear``, a test corrupting values) must
    not meet a stream among them."""
    return _STREAM_PREFIX + key_prefix.split(b":")[1]


def lease_key(stream: bytes) -> bytes:
    """The key a watcher holds while it appends removals (one at a time)."""
    return stream + b":watcher"


def epoch_key(stream: bytes) -> bytes:
    """The counter a clear of ``stream``'s namespace increments (absent: 0),
    kept beside the stream: a clear deletes the values under ``kvt:<ns>:``
    and the stream, never this."""
    return stream + b":epoch"


def value_prefix(stream: bytes) -> bytes:
    """The prefix of the values a stream names (inverse of :func:`stream_key`)."""
    return b"kvt:" + stream[len(_STREAM_PREFIX) :] + b":"


def xadd_commands(
    stream: bytes,
    maxlen: int,
    op: str,
    engine: str,
    tier: str,
    digests: Sequence[bytes],
    ids: Sequence[bytes],
    reason: str = "",
    epoch: int = 0,
) -> list[list[bytes]]:
    """``XADD stream MAXLEN ~ maxlen * field value ...`` commands naming
    ``digests`` (with their ``ids``, 12 bytes each or :data:`UNNAMED`),
    :data:`ENTRY_BLOCKS` at most per entry; ``epoch``: the namespace's
    epoch the writer knew (0: no field)."""
    head = [b"XADD", stream, b"MAXLEN", b"~", str(maxlen).encode(), b"*"]
    common = [b"op", op.encode(), b"engine", engine.encode(), b"tier", tier.encode()]
    if reason:
        common += [b"reason", reason.encode()]
    if epoch:
        common += [b"epoch", str(epoch).encode()]
    ts = str(int(time.time() * 1000)).encode()
    out = []
    for first in range(0, len(digests), ENTRY_BLOCKS):
        end = first + ENTRY_BLOCKS
        out.append(
            [
                *head,
                *common,
                b"ts",
                ts,
                b"keys",
                b"".join(digests[first:end]),
                b"ids",
                b"".join(ids[first:end]),
            ]
        )
    return out


@dataclass(frozen=True)
class PoolEvent:
    """One decoded stream entry (see the module's docstring): ``position``
    is its stream id (``ms-seq``), ``ids[i]`` is ``None`` when unnamed,
    ``epoch`` 0 where the entry has none."""

    position: str
    op: str
    engine: str
    tier: str
    ts_ms: int
    digests: list[bytes]
    ids: list[bytes | None]
    reason: str = ""
    epoch: int = 0

    @property
    def removed(self) -> bool:
        return self.op == "removed"


def _text(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def decode_entry(position: bytes | str, fields: Mapping[bytes, bytes]) -> PoolEvent | None:
    """The event of one entry as redis-py returns it, or None for an entry
    that is not one of ours (a malformed or foreign entry is skipped, not
    fatal: the stream is shared)."""
    keys, ids = fields.get(b"keys", b""), fields.get(b"ids", b"")
    op = _text(fields.get(b"op"))
    if op not in ("stored", "removed") or len(keys) % 16:
        return None
    n = len(keys) // 16
    named: list[bytes | None] = [None] * n
    if len(ids) == 12 * n:
        named = [ids[12 * i : 12 * i + 12] for i in range(n)]
        named = [None if i == UNNAMED else i for i in named]
    ts, epoch = _int(fields.get(b"ts")), _int(fields.get(b"epoch"))
    return PoolEvent(
        _text(position),
        op,
        _text(fields.get(b"engine")),
        _text(fields.get(b"tier")),
        ts,
        [keys[16 * i : 16 * i + 16] for i in range(n)],
        named,
        _text(fields.get(b"reason")),
        epoch,
    )


def _int(v: bytes | None) -> int:
    """A decimal field, 0 where absent or not a number (a foreign entry)."""
    try:
        return int(v or b"0")
    except ValueError:
        return 0


def digest_of(server_key: bytes, prefix: bytes) -> bytes | None:
    """The 16-byte digest a server key of ``prefix`` names, or None for any
    other key (the stream, a foreign key)."""
    if not server_key.startswith(prefix) or len(server_key) != len(prefix) + 32:
        return None
    try:
        return bytes.fromhex(server_key[len(prefix) :].decode())
    except ValueError:
        return None


def chunks(items: Sequence[bytes], n: int) -> Iterator[Sequence[bytes]]:
    for first in range(0, len(items), n):
        yield items[first : first + n]
