"""What a remote tier learnt about the server's keys: per key digest, whether
it exists and when that was learnt (an EXISTS answer, a store or load that
just ended), so that a prefix scan asks the server once, not once per step.

Process: the engine's scheduler. Who calls:
:class:`~kvtier.tiers.remote.tier.RemoteTier`, under the manager's lock.
Nothing blocks; memory is bounded by ``capacity`` entries (about 230 B of
the process's heap each).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from kvtier.tiers.base import LookupResult


class KnownKeys(OrderedDict[bytes, tuple[bool, float]]):
    """digest -> (exists, when learnt), oldest first. A key found present is
    believed ``ttl_s``, one found absent ``negative_ttl_s``; at most
    ``capacity`` entries, the oldest forgotten first."""

    def __init__(self, ttl_s: float, negative_ttl_s: float, capacity: int) -> None:
        super().__init__()
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.capacity = capacity

    def answer(self, dig: bytes) -> LookupResult | None:
        """HIT or MISS while what was learnt of ``dig`` holds, else None (ask)."""
        hit = self.get(dig)
        if hit is None:
            return None
        exists, when = hit
        age = time.monotonic() - when
        if exists and age < self.ttl_s:
            return LookupResult.HIT
        if not exists and age < self.negative_ttl_s:
            return LookupResult.MISS
        return None

    def remember(self, digs: Iterable[bytes], exists: bool) -> None:
        """``digs`` were just found to exist (or not)."""
        now = time.monotonic()
        for dig in digs:
            self[dig] = (exists, now)
            self.move_to_end(dig)
        self.expire(now)

    def learnt_after(self, dig: bytes, when: float) -> bool:
        """Whether ``dig``'s entry is newer than ``when`` (an answer to a check
        sent at ``when`` is then stale: a store or load that ended since knows better)."""
        seen = self.get(dig)
        return seen is not None and seen[1] > when

    def expire(self, now: float | None = None) -> None:
        """Drop what no live request needs any more (entries are in time order)."""
        if not self:
            return
        horizon = (time.monotonic() if now is None else now) - max(self.ttl_s, self.negative_ttl_s)
        while self and (len(self) > self.capacity or next(iter(self.values()))[1] < horizon):
            self.popitem(last=False)
