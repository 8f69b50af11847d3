"""The public path of :class:`DeviceTransfer` (``kvtier.transfer``): it lives
in :mod:`kvtier.worker.transfer`.

Process: the engine's worker. Who calls: users and the shim import through
this path; importing blocks on nothing.
"""

from kvtier.worker.transfer import (
    EXPEDITED_QUEUE,
    LOAD_QUEUE,
    STORE_QUEUE,
    DeviceTransfer,
    KVLayout,
    TransferResult,
    layout_from_tensors,
)

__all__ = [
    "EXPEDITED_QUEUE",
    "LOAD_QUEUE",
    "STORE_QUEUE",
    "DeviceTransfer",
    "KVLayout",
    "TransferResult",
    "layout_from_tensors",
]
