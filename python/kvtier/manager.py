"""The public path of the manager (``kvtier.manager``): it lives in
:mod:`kvtier.scheduler` now, split into a facade and its rooms.

Process: the engine's scheduler. Who calls: users and the vLLM shim build a
manager through this path. Importing this module blocks on nothing and
loads neither the native core nor vLLM.
"""

from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.scheduler.options import EAGER_PROMOTE, SCAN_BACKOFF_S, KeyOrder, ManagerOptions
from kvtier.scheduler.specs import HostSpec, PrepareStoreResult, StreamSpec
from kvtier.scheduler.stats import ManagerStats
from kvtier.tiers.base import LookupResult, TierEvent

OffloadEvent = TierEvent

__all__ = [
    "EAGER_PROMOTE",
    "SCAN_BACKOFF_S",
    "HostSpec",
    "KeyOrder",
    "LookupResult",
    "ManagerOptions",
    "ManagerStats",
    "OffloadEvent",
    "PrepareStoreResult",
    "StreamSpec",
    "TieredOffloadingManager",
]
