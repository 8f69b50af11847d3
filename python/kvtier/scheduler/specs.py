"""What the scheduler hands the engine's worker for one load or store.

Process: made in the scheduler (by the manager), read in the engine's worker
(the vLLM shim pickles them into its connector metadata). Who calls: the
manager makes them, the shim's worker reads them. Plain data; nothing here
blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class StreamSpec:
    """Keys of a load read (or of a store written) by the engine's worker
    straight from a lower tier (their slot in :class:`HostSpec` is -1):
    ``index[i]`` is the key's position in the call, read from tier
    ``tiers[i]`` at ``locations[i]`` (record, file, offset) and checked
    against ``digests`` (16 bytes each); ``readers`` maps each tier's name to
    what opens its reader in the worker (the tier's ``reader_spec()``)."""

    index: np.ndarray  # int64
    tiers: list[str]
    locations: np.ndarray  # int64 (n, 3)
    digests: bytes
    readers: dict[str, Any]


@dataclass
class HostSpec:
    """Host pool slots, co-indexed with the keys of the call that made it;
    -1 for keys the worker streams from a lower tier (``stream``)."""

    slots: np.ndarray  # int64
    stream: StreamSpec | None = None
    # Per key, the armed fence of a slot a lower tier is still filling (the
    # worker's copy waits for it: HostPool.arm_fences), 0 when filled; None
    # when every slot is filled.
    fences: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class PrepareStoreResult:
    """:meth:`~kvtier.scheduler.manager.TieredOffloadingManager.prepare_store`'s
    answer; unpacks as ``(keys_to_store, store_spec, evicted_keys)``."""

    keys_to_store: list[bytes]
    store_spec: HostSpec
    evicted_keys: list[bytes]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.keys_to_store, self.store_spec, self.evicted_keys))
