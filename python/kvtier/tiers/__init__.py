"""Tiers: the host tier (owns the shared pool's slots) and lower tiers (disk,
remote, in-memory) that move bytes between their medium and host slots.

Process: the engine's scheduler (each tier's ``*_worker`` module: the
engine's worker). Who calls: the manager, under its lock; see each module
for what blocks.

What each module owns: ``base`` the manager/tier interface, ``host`` the host
tier (Python, every policy), ``host_native`` the host tier over the native
index (LRU) and :func:`make_host_tier`, which picks one of them,
``memory``/``disk``/``remote`` one medium each, ``staged`` one tier over
pipeline stages, ``jobs`` the native-engine job machinery every data-moving
tier shares, ``events`` the bounded log of a tier's stored/removed keys,
``records`` the record format and namespace/key digests, ``factory`` tiers
built from one configuration shape.

The names below are imported on first use: ``kvtier.tiers.records`` (which
the vLLM shim imports in every engine process) must not load the native core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_getattr

if TYPE_CHECKING:
    from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent
    from kvtier.tiers.host import HostTier
    from kvtier.tiers.host_entry import HostEntry
    from kvtier.tiers.host_native import NativeHostTier, make_host_tier
    from kvtier.tiers.memory import MemoryTier

_LAZY = {
    "HostEntry": "kvtier.tiers.host_entry",
    "HostTier": "kvtier.tiers.host",
    "NativeHostTier": "kvtier.tiers.host_native",
    "make_host_tier": "kvtier.tiers.host_native",
    "LookupResult": "kvtier.tiers.base",
    "LowerTier": "kvtier.tiers.base",
    "MemoryTier": "kvtier.tiers.memory",
    "TierCompletion": "kvtier.tiers.base",
    "TierEvent": "kvtier.tiers.base",
}


__getattr__ = lazy_getattr("kvtier.tiers", _LAZY)


__all__ = [
    "HostEntry",
    "HostTier",
    "LookupResult",
    "LowerTier",
    "MemoryTier",
    "NativeHostTier",
    "TierCompletion",
    "TierEvent",
    "make_host_tier",
]
