"""kvtier: tiered KV-cache offloading for LLM inference engines.

Process: any (the engine's scheduler and workers, tools). Who calls: users and
the engine integrations import it; importing never blocks.

Importing ``kvtier`` is cheap: the native core (``kvtier._native``) is loaded
on first use of a name that needs it, so engine processes that only import the
vLLM shim never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_getattr
from kvtier.errors import (
    Busy,
    ClosedError,
    CudaError,
    InUse,
    InvalidArgument,
    IoError,
    KvtierError,
    NoSpace,
    Timeout,
    TlsError,
    UnsupportedEngine,
)

__version__ = "0.1.0"

_LAZY = {
    "HostPool": "kvtier.pool",
    "Engine": "kvtier.engine",
    "JobResult": "kvtier.engine",
    "crc32c": "kvtier.engine",
    "TieredOffloadingManager": "kvtier.scheduler.manager",
    "LookupResult": "kvtier.tiers.base",
    "DeviceTransfer": "kvtier.worker.transfer",
}

if TYPE_CHECKING:
    from kvtier.engine import Engine, JobResult, crc32c
    from kvtier.pool import HostPool
    from kvtier.scheduler.manager import TieredOffloadingManager
    from kvtier.tiers.base import LookupResult
    from kvtier.worker.transfer import DeviceTransfer


__getattr__ = lazy_getattr("kvtier", _LAZY)


__all__ = [
    "Busy",
    "ClosedError",
    "CudaError",
    "DeviceTransfer",
    "Engine",
    "HostPool",
    "InUse",
    "InvalidArgument",
    "IoError",
    "JobResult",
    "KvtierError",
    "LookupResult",
    "NoSpace",
    "TieredOffloadingManager",
    "Timeout",
    "TlsError",
    "UnsupportedEngine",
    "crc32c",
]
