"""kvtier: tiered KV-cache offloading for LLM inference engines.

Importing ``kvtier`` is cheap: the native core (``kvtier._native``) is loaded
on first use of a name that needs it, so engine processes that only import the
vLLM shim never load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.errors import (
    Busy,
    ClosedError,
    CudaError,
    InvalidArgument,
    IoError,
    KvtierError,
    Timeout,
)

__version__ = "0.1.0"

_LAZY = {
    "HostPool": "kvtier.pool",
    "Engine": "kvtier.engine",
    "JobResult": "kvtier.engine",
    "crc32c": "kvtier.engine",
    "TieredOffloadingManager": "kvtier.manager",
    "LookupResult": "kvtier.manager",
    "DeviceTransfer": "kvtier.transfer",
}

if TYPE_CHECKING:
    from kvtier.engine import Engine, JobResult, crc32c
    from kvtier.manager import LookupResult, TieredOffloadingManager
    from kvtier.pool import HostPool
    from kvtier.transfer import DeviceTransfer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Busy",
    "ClosedError",
    "CudaError",
    "DeviceTransfer",
    "Engine",
    "HostPool",
    "InvalidArgument",
    "IoError",
    "JobResult",
    "KvtierError",
    "LookupResult",
    "Timeout",
    "TieredOffloadingManager",
    "crc32c",
]
