"""Admission: store a key only after it was offered N times.

One-off prefixes (a unique user message) are the bulk of a chat workload's
blocks; writing them costs bandwidth and evicts blocks that would be reused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvtier.errors import InvalidArgument


class AdmissionFilter:
    """Counts offers per key in a bounded LRU map of ``max_tracked`` keys."""

    def __init__(self, threshold: int = 1, max_tracked: int = 1 << 20) -> None:
        if threshold < 1:
            raise InvalidArgument(f"admission threshold must be >= 1, got {threshold}")
        if max_tracked < 1:
            raise InvalidArgument(f"admission max_tracked must be >= 1, got {max_tracked}")
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._seen: OrderedDict[Any, int] = OrderedDict()

    def offer(self, key: Any) -> bool:
        """Record one sighting; True when the key may be stored now."""
        if self.threshold == 1:
            return True
        n = self._seen.pop(key, 0) + 1
        if n >= self.threshold:
            return True  # admitted: stop tracking it
        self._seen[key] = n
        if len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        return False

    def forget(self, key: Any) -> None:
        self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)
