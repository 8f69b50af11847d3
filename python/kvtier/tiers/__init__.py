"""Tiers: the host tier (owns the shared pool's slots) and lower tiers (disk,
remote, in-memory) that move bytes between their medium and host slots."""

from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent
from kvtier.tiers.host import HostEntry, HostTier
from kvtier.tiers.memory import MemoryTier

__all__ = [
    "HostEntry",
    "HostTier",
    "LookupResult",
    "LowerTier",
    "MemoryTier",
    "TierCompletion",
    "TierEvent",
]
