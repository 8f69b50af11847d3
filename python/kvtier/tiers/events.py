"""A tier's events not taken yet, bounded: :class:`EventLog`; and what names
a block whose key a tier no longer has: :func:`vllm_event_id`.

Runs wherever its tier runs (the scheduler process). Who calls: the tiers
that report stored/removed keys (:class:`~kvtier.tiers.jobs.JobTier` and so
the disk and remote tiers, :class:`~kvtier.tiers.memory.MemoryTier`,
:class:`~kvtier.tiers.staged.StagedTier`), under the manager's lock. Never
blocks.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from hashlib import blake2b

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import TierEvent

__all__ = ["EVENT_GROUPS", "EVENT_LOG_KEYS", "EventLog", "vllm_event_id"]

#: Keys a tier's :class:`EventLog` holds, by default, before it drops the oldest.
EVENT_LOG_KEYS = 65_536

#: Event ids name groups below this (the disk index keeps a group in 6 bits).
EVENT_GROUPS = 63
_GROUP_LIMIT = EVENT_GROUPS.to_bytes(4, "big")
_GROUP_0 = bytes(4)


def vllm_event_id(key: bytes) -> bytes:
    """The default event id of ``key`` (:attr:`TierEvent.ids`): 12 bytes, an
    8-byte id then a 4-byte group index, both big-endian.

    A vLLM OffloadKey (block hash, then its KV-cache group index as 4 bytes)
    with a group below :data:`EVENT_GROUPS` is named by its last 12 bytes:
    the block hash's last 8 bytes, which are vLLM's int block hash
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: ``int.from_bytes(hash, "big")``
    masked to 64 bits), and the group. Any other key is named by an 8-byte
    blake2b of it, group 0. Pure; any process."""
    if len(key) >= 12 and key[-4:] < _GROUP_LIMIT:
        return key[-12:]
    return blake2b(key, digest_size=8).digest() + _GROUP_0


class EventLog:
    """A tier's stored/removed events not taken yet (:meth:`LowerTier.take_events`),
    bounded by the blocks they name (keys and ids): beyond ``max_keys`` the
    oldest are dropped, and counted in :attr:`dropped` (a tier's stats report
    it as ``events_dropped``).

    Why bounded: the manager takes every tier's events each step, but a tier
    driven without it (a benchmark, a tool, a test) has nobody taking them
    and would otherwise keep every key it ever stored. Holds at most about
    twice ``max_keys`` key references (the oldest event is cut lazily).
    """

    def __init__(self, max_keys: int = EVENT_LOG_KEYS) -> None:
        if max_keys < 0:
            raise InvalidArgument(f"event log of {max_keys} keys: must be >= 0")
        self.max_keys = max_keys
        self.dropped = 0  # keys dropped unseen, since the log was made
        self._events: deque[TierEvent] = deque()
        self._skip = 0  # keys at the front of the oldest event already dropped
        self._keys = 0  # keys held (not counting skipped ones)

    def __len__(self) -> int:
        """Keys held."""
        return self._keys

    def append(self, event: TierEvent) -> None:
        """Log ``event``; drop the oldest keys beyond the bound."""
        n = _size(event)
        if n == 0:
            return
        if n > self.max_keys:  # cut now, so that no event holds more than the bound
            cut = n - self.max_keys
            self.dropped += cut
            if self.max_keys == 0:
                return
            event = _cut(event, cut)
            n = self.max_keys
        self._events.append(event)
        self._keys += n
        over = self._keys - self.max_keys
        while over > 0:
            left = _size(self._events[0]) - self._skip
            cut = min(left, over)
            if cut == left:
                self._events.popleft()
                self._skip = 0
            else:
                self._skip += cut
            self.dropped += cut
            self._keys -= cut
            over -= cut

    def take(self) -> list[TierEvent]:
        """Every event held, oldest first; the log is empty after."""
        out = list(self._events)
        if self._skip:
            out[0] = _cut(out[0], self._skip)
        self._events.clear()
        self._skip = self._keys = 0
        return out


def _size(event: TierEvent) -> int:
    return len(event.keys) + len(event.ids)


def _cut(event: TierEvent, n: int) -> TierEvent:
    """``event`` without its first ``n`` blocks (keys first, then ids)."""
    k = len(event.keys)
    return dataclasses.replace(event, keys=event.keys[n:], ids=event.ids[max(0, n - k) :])
