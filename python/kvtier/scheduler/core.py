"""What every room of the manager shares: the tiers, options, counters,
events, this step's scanned keys and the slots in use.

Process: the engine's scheduler, under the manager's lock. Who calls: the
manager and its rooms. Nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.scheduler.options import ManagerOptions
from kvtier.scheduler.slots import Slots
from kvtier.scheduler.stats import ManagerStats
from kvtier.tiers.base import LowerTier, TierEvent
from kvtier.tiers.host import HostTier


@dataclass(eq=False)
class Core:
    """The state the rooms share (each room keeps its own beside it)."""

    host: HostTier
    lower: list[LowerTier]
    options: ManagerOptions
    stats: ManagerStats = field(default_factory=ManagerStats)
    events: list[TierEvent] = field(default_factory=list)
    # Metadata-only removals among ``events``: take_events filters those only
    # (most steps have none, and a scan of every event would be per step).
    unannounced_events: int = 0
    # Keys some lookup reported HIT or HIT_PENDING since the last step end: a
    # promotion or read-ahead must not evict them, or a prefix longer than
    # the host tier would evict its own head while its tail is promoted (and
    # the engine would never see the whole prefix readable). They become
    # pinned by prepare_load, or are looked up again next step.
    scanned: set[bytes] = field(default_factory=set)
    slots: Slots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = Slots(self.host)

    def removed(self, keys: Sequence[bytes]) -> None:
        """Host blocks went away (evicted, dropped, reset): tell the engine."""
        if keys and self.options.events:
            self.events.append(TierEvent(list(keys), self.host.name, removed=True))

    def unannounced(self, keys: Sequence[bytes]) -> None:
        """Host blocks that were never announced readable went away (a
        failed store, promotion or fenced read): a metadata-only removal,
        so that an engine forgets what a lookup of them (HIT_PENDING, or
        HIT for a fenced read) told it, and nothing public is removed."""
        if keys and self.options.events:
            self.events.append(
                TierEvent(list(keys), self.host.name, removed=True, metadata_only=True)
            )
            self.unannounced_events += 1

    def readable(self, keys: Sequence[bytes]) -> None:
        """Host blocks became readable (stored, promoted): tell the engine."""
        if keys and self.options.events:
            self.events.append(TierEvent(list(keys), self.host.name, removed=False))

    def worker_reads(self, tier: LowerTier) -> bool:
        """The engine's worker can read ``tier``'s hits itself (streaming)."""
        return self.options.streaming and tier.reader_spec() is not None
