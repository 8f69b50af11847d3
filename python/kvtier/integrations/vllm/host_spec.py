"""vLLM shim: :class:`KVTierSpec`, the load/store spec the scheduler's
manager hands the engine's workers (host slots in kvtier's pool).

Process: vLLM's engine core, where the manager makes it (who calls:
:class:`~kvtier.integrations.vllm.scheduler.KVTierManager`), and its workers,
which read it (:class:`~kvtier.integrations.vllm.worker.KVTierWorker`).
Plain data: nothing blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec

if TYPE_CHECKING:
    from kvtier.scheduler.specs import StreamSpec

__all__ = ["KVTierSpec"]


class KVTierSpec(LoadStoreSpec):
    """Host pool slots, co-indexed with the keys of the manager call that
    made it; -1 for keys the worker streams from a lower tier (``stream``);
    ``fences``: armed fences of slots still being filled (see
    :class:`~kvtier.scheduler.specs.HostSpec`)."""

    def __init__(
        self,
        slots: np.ndarray,
        stream: StreamSpec | None = None,
        fences: np.ndarray | None = None,
    ) -> None:
        self.slots = np.asarray(slots, np.int64)
        self.block_ids = self.slots  # vLLM's BlockIDsLoadStoreSpec spelling
        self.stream = stream
        self.fences = fences

    def __len__(self) -> int:
        return len(self.slots)
