"""Admission: store a key only after it was offered N times.

Process: the engine's scheduler (or ``kvtier replay``). Who calls: a tier's
``admit``, under the manager's lock, once per offered block. Never blocks.

One-off prefixes (a unique user message) are the bulk of a chat workload's
blocks; writing them costs bandwidth and evicts blocks that would be reused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.policy.rate import TokenBucket


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


class WriteGate:
    """What a lower tier asks before it takes a block of the cascade: the
    admission filter (seen often enough?) and then the write budget (bytes
    per second), each refusal counted in the tier's counters
    (``not_admitted``, ``budget_skips``).

    Who calls: the disk and remote tiers' ``admit``, under the manager's
    lock. Never blocks.
    """

    def __init__(self, admit_after: int = 1, write_budget_bps: float | None = None) -> None:
        self.admission = AdmissionFilter(admit_after)
        self.budget = TokenBucket(write_budget_bps)

    def admit(self, key: Any, nbytes: int, counters: dict[str, int]) -> bool:
        """True when ``key`` (``nbytes`` to write) may be stored now."""
        if not self.admission.offer(key):
            counters["not_admitted"] += 1
            return False
        if not self.budget.take(nbytes):
            counters["budget_skips"] += 1
            return False
        return True
