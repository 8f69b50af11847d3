"""Slot lifecycle: the tier jobs in flight and who owns a host slot.

Process: the engine's scheduler, under the manager's lock. Who calls: the
manager's rooms. Nothing here blocks.

A host slot is in use while an entry of the host tier holds it, while a tier
job (cascade, promotion, probe, fenced fill) reads or writes it, or while it
is stale (its entry was dropped by a reset while a GPU job may still use it).
A slot whose entry went away is freed by whoever ends its last use; every
question "is it still in use?" is answered in O(1).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from kvtier.tiers.host import HostTier


class JobKind(enum.Enum):
    """What a lower-tier job does with its host slots."""

    STORE = "store"  # cascade: host slot -> lower tier
    LOAD = "load"  # promotion: lower tier -> host slot
    PROBE = "probe"  # read-ahead probe: "exists?" and the bytes in one read
    FENCED = "fenced"  # fenced fill: the keys are HIT before the bytes arrive


@dataclass(eq=False)
class TierJob:
    """One batch submitted to lower tier ``tier``: ``keys[i]`` in ``slots[i]``."""

    tier: int
    kind: JobKind
    keys: list[bytes]
    slots: list[int]


class Slots:
    """Tier jobs in flight by ``(tier, token)`` and the slots they use."""

    def __init__(self, host: HostTier) -> None:
        self.host = host
        self._jobs: dict[tuple[int, int], TierJob] = {}
        self._under_job: Counter[int] = Counter()  # slot -> tier jobs using it
        self.stale: set[int] = set()  # freed by a reset, a GPU job may still use them

    def start(
        self, tier: int, token: int, kind: JobKind, keys: list[bytes], slots: list[int]
    ) -> None:
        """Track a job a tier accepted (its token) until :meth:`end`."""
        self._jobs[(tier, token)] = TierJob(tier, kind, keys, slots)
        self._under_job.update(slots)

    def end(self, tier: int, token: int) -> TierJob | None:
        """The job ``token`` of ``tier`` completed: stop tracking it (None:
        not one of ours, e.g. an existence check)."""
        job = self._jobs.pop((tier, token), None)
        if job is not None:
            under = self._under_job
            for s in job.slots:
                under[s] -= 1
                if not under[s]:
                    del under[s]
        return job

    def under_job(self, slot: int) -> bool:
        """A tier job still reads or writes ``slot``."""
        return slot in self._under_job

    def in_use(self, slot: int) -> bool:
        """An entry, a tier job or a GPU job (stale) still uses ``slot``."""
        return slot in self.stale or slot in self._under_job or self.host.owner(slot) is not None

    def release_if_unused(self, slot: int) -> None:
        """Free ``slot`` unless something still uses it (its entry went away
        while a job used it: the job's end frees it)."""
        if not self.in_use(slot):
            self.host.release_slot(slot)

    def reset_flushed(self) -> None:
        """Every GPU job in flight at the last reset ended: free the stale
        slots no tier job still uses (those are freed when it ends)."""
        stale, self.stale = self.stale, set()
        for s in stale:
            if s not in self._under_job:
                self.host.release_slot(s)

    def __len__(self) -> int:
        return len(self._jobs)
