"""Belady's MIN for prefix lookups: the offline bound policies are measured against.

Process: ``kvtier replay`` (a command-line tool), never an engine.

Who calls: ``kvtier replay --policy belady`` only (it knows the whole trace
and calls :meth:`BeladyPolicy.advance` before each request); the host tier
calls the rest, under the manager's lock. Never blocks.

Evicts the key whose next use is furthest away (never used again first).
Among keys next used by the same request, the deepest block goes first: a
parent appears in every request its child does, so its next use is never
later than its child's, and the cache never keeps a child without its parent
for want of a tie-break.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

_NEVER = 1 << 62


class BeladyPolicy:
    """``trace``: the requests' block ids in order; ``key_of`` maps an id to
    the key the tier sees (:func:`kvtier.replay.key_of`)."""

    def __init__(self, trace: Sequence[Sequence[Hashable]], key_of: Callable[[Any], Any]) -> None:
        self._uses: dict[Any, list[tuple[int, int]]] = {}
        for i, ids in enumerate(trace):
            for d, h in enumerate(ids):
                self._uses.setdefault(key_of(h), []).append((i, d))
        self.now = -1
        self._token: dict[Any, int] = {}
        self._heap: list[tuple[int, int, int, Any]] = []
        self._seq = 0

    def advance(self, request: int) -> None:
        """The replay is about to run request number ``request`` (0-based)."""
        self.now = request

    def _push(self, key: Any) -> None:
        uses = self._uses.get(key, [])
        j = bisect.bisect_right(uses, (self.now, _NEVER))
        nxt, depth = uses[j] if j < len(uses) else (_NEVER, 0)
        self._seq += 1
        self._token[key] = self._seq
        heapq.heappush(self._heap, (-nxt, -depth, -self._seq, key))

    def insert(self, key: Any) -> None:
        self._push(key)

    def touch(self, key: Any) -> None:
        if key in self._token:
            self._push(key)

    def remove(self, key: Any, evicted: bool = False) -> None:
        self._token.pop(key, None)

    def victims(self) -> Iterator[Any]:
        popped: list[tuple[int, int, int, Any]] = []
        try:
            while self._heap:
                e = heapq.heappop(self._heap)
                if self._token.get(e[3]) != -e[2]:
                    continue  # stale: touched again or removed
                popped.append(e)
                yield e[3]
        finally:  # the caller stops early: put back what it did not take
            for e in popped:
                heapq.heappush(self._heap, e)

    def __len__(self) -> int:
        return len(self._token)
