"""The interface every eviction policy implements.

Process: the engine's scheduler (or ``kvtier replay``); nothing blocks.

Who calls: a tier, always under the manager's lock, never concurrently. The
tier decides *whether* a key may be evicted (pinned, being written, part of
the current offer); the policy only orders the candidates.

A policy may also define ``insert_many(keys)``, ``touch_many(keys)`` and
``evict_many(keys)``: the same as ``insert``, ``touch`` and
``remove(key, evicted=True)`` of each key in order. The host tier calls them
once per offer where they exist (the LRU has them), the per-key calls
otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    def insert(self, key: Any) -> None:
        """A key became resident (readable)."""

    def touch(self, key: Any) -> None:
        """A resident key was used (hit, load, re-offered)."""

    def remove(self, key: Any, evicted: bool = False) -> None:
        """A resident key left; ``evicted`` says the policy's victim was taken."""

    def victims(self) -> Iterator[Any]:
        """Resident keys, best victim first. The caller must not change the
        policy while iterating: it collects the keys it takes, then calls
        :meth:`remove` (``evicted=True``) for each."""
        ...

    def __len__(self) -> int: ...
