"""The shared-memory host pool, as seen from Python.

Who calls: the scheduler-side tiers (they own the pool) and the worker-side
device transfers (they attach to it by name). Nothing here blocks except
creation and attach, which map and pre-fault memory with the GIL released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier import _native
from kvtier.errors import InvalidArgument

if TYPE_CHECKING:
    import torch


class HostPool:
    """``num_slots`` x ``slot_bytes`` of shared memory, one block per slot.

    ``HostPool(slots, slot_bytes, name=None)`` creates a region (a unique name
    is chosen when none is given); ``HostPool.attach(name)`` maps one that
    another process created. The creator removes the name on :meth:`close`;
    views handed out earlier stay valid until they are garbage collected.
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        name: str | None = None,
        *,
        mlock: bool = False,
        prefault: bool = True,
        _native_pool: Any = None,
    ) -> None:
        if _native_pool is not None:
            self._pool = _native_pool
            return
        for field, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"{field} must be a positive int, got {value!r}")
        self._pool = _native.HostPool.create(num_slots, slot_bytes, name or "", mlock, prefault)

    @classmethod
    def attach(cls, name: str) -> HostPool:
        """Map the pool another process created under ``name`` (validates its header)."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"pool name must be a non-empty str, got {name!r}")
        return cls(0, 0, _native_pool=_native.HostPool.attach(name))

    @staticmethod
    def reap_stale() -> int:
        """Unlink the names of pools whose creating process died without
        closing them (SIGKILL, the OOM killer); returns how many. Creating a
        pool does this already; ``kvtier doctor`` reports it. Non-blocking."""
        return int(_native.HostPool.reap_stale())

    @property
    def name(self) -> str:
        return str(self._pool.name)

    @property
    def num_slots(self) -> int:
        return int(self._pool.num_slots)

    @property
    def slot_bytes(self) -> int:
        return int(self._pool.slot_bytes)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def address(self) -> int:
        """Address of slot 0 in this process (slots are contiguous)."""
        return int(self._pool.address)

    @property
    def closed(self) -> bool:
        return bool(self._pool.closed)

    @property
    def native(self) -> Any:
        """The ``kvtier._native.HostPool`` handle (for the engine and tiers)."""
        return self._pool

    def slot_address(self, slot: int) -> int:
        return int(self._pool.slot_address(slot))

    def view(self, slot: int, count: int = 1) -> np.ndarray:
        """Zero-copy ``uint8`` array: shape ``(slot_bytes,)`` for one slot, else ``(count, slot_bytes)``."""
        arr: np.ndarray = self._pool.array(slot, count)
        return arr[0] if count == 1 else arr

    def tensor(self, slot: int, count: int = 1) -> torch.Tensor:
        """Zero-copy ``torch.uint8`` tensor over the same bytes as :meth:`view`."""
        import torch

        return torch.from_numpy(self.view(slot, count))

    def close(self) -> None:
        """Remove the name (creator) and refuse further use. Idempotent."""
        self._pool.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"HostPool(name={self.name!r}, num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, {state})"
