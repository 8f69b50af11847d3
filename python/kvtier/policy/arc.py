"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

Process: the engine's scheduler (or ``kvtier replay``). Who calls: the host
tier, under the manager's lock, never concurrently. Never blocks.

Two resident lists, T1 (seen once recently) and T2 (seen at least twice), and
two ghost lists of evicted keys, B1 and B2. A hit in a ghost list moves the
target size ``p`` of T1 toward the list that would have kept the key, so the
cache adapts between recency and frequency. Compared with LRU it resists
scans: a long one-off prefix does not flush the reused system prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

_Ordered = OrderedDict[Any, None]


class ARCPolicy:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self.p = 0.0  # target size of T1
        self.t1: _Ordered = OrderedDict()
        self.t2: _Ordered = OrderedDict()
        self.b1: _Ordered = OrderedDict()
        self.b2: _Ordered = OrderedDict()

    def insert(self, key: Any) -> None:
        c = self.capacity
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Any) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Any, evicted: bool = False) -> None:
        if key in self.t1:
            del self.t1[key]
            if evicted:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if evicted:
                self.b2[key] = None
        else:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
        if evicted:
            self._trim_ghosts()

    def victims(self) -> Iterator[Any]:
        # ARC's REPLACE: take from T1 while it is above its target, else T2;
        # the other list follows when every key of the first is protected.
        if self.t1 and len(self.t1) > self.p:
            yield from self.t1
            yield from self.t2
        else:
            yield from self.t2
            yield from self.t1

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
