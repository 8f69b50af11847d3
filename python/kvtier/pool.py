"""The shared-memory host pool, as seen from Python.

Who calls: the scheduler-side tiers (they own the pool) and the worker-side
device transfers (they attach to it by name). Nothing here blocks except
creation, attach and populate, which map and pre-fault memory with the GIL
released.

Runs in the scheduler process (the owner creates the pool) and in the
worker processes (they attach).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier import _native
from kvtier.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

# Bytes entered a call of HostPool.populate: a closed pool stops it within
# one (about 15 ms of a core: 428 MB took about 100 ms, bench/first_touch.py).
POPULATE_CHUNK = 64 << 20


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
    def attach(cls, name: str, slot_bytes: int | None = None) -> HostPool:
        """Map the pool another process created under ``name`` (validates its
        header). ``slot_bytes``: see its data area as slots of that size
        instead (as many as fit; a *view*, without fences): a kvtier node's
        block sizes share one region so."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"pool name must be a non-empty str, got {name!r}")
        if slot_bytes is not None and (type(slot_bytes) is not int or slot_bytes <= 0):
            raise InvalidArgument(f"slot_bytes must be a positive int, got {slot_bytes!r}")
        return cls(0, 0, _native_pool=_native.HostPool.attach(name, slot_bytes or 0))

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

    # -- fences: slots a load may copy from while a lower tier still fills them
    @property
    def fence_address(self) -> int:
        """Address of slot 0's fence word in this process (one uint32 per slot)."""
        return int(self._pool.fence_address)

    @property
    def fence_bytes(self) -> int:
        return int(self._pool.fence_bytes)

    def arm_fences(self, slots: Sequence[int]) -> np.ndarray:
        """Start fenced writes into ``slots`` (the scheduler's tiers, under the
        manager's lock): their armed values, int64, for the writer and for
        every copy that waits for them. Non-blocking."""
        return np.asarray(self._pool.arm_fences(list(slots)), np.int64)

    def settle_fence(self, slot: int, armed: int, ok: bool) -> bool:
        """End the write armed as ``armed`` (ready or failed) and wake its
        waiters; False when it had ended already. The remote tier settles its
        own; this ends writes that never ran (a job cancelled or timed out)."""
        return bool(self._pool.settle_fence(slot, armed, ok))

    def fence_word(self, slot: int) -> int:
        """The raw fence word of ``slot`` (generation << 2 | state; tests)."""
        return int(self._pool.fence_word(slot))

    def fences(self, slots: np.ndarray, armed: np.ndarray) -> np.ndarray:
        """``(N, 2)`` int64 (fence word address, armed value) for native jobs;
        rows whose ``armed`` is 0 get address 0 (no fence)."""
        s = np.asarray(slots, np.int64)
        a = np.asarray(armed, np.int64)
        addr = np.where(a != 0, self.fence_address + 4 * s, 0)
        return np.stack([addr, a], axis=1)

    def view(self, slot: int, count: int = 1) -> np.ndarray:
        """Zero-copy ``uint8`` array: shape ``(slot_bytes,)`` for one slot, else ``(count, slot_bytes)``."""
        arr: np.ndarray = self._pool.array(slot, count)
        return arr[0] if count == 1 else arr

    def tensor(self, slot: int, count: int = 1) -> torch.Tensor:
        """Zero-copy ``torch.uint8`` tensor over the same bytes as :meth:`view`."""
        import torch

        return torch.from_numpy(self.view(slot, count))

    def populate(self, chunk_bytes: int = POPULATE_CHUNK) -> int:
        """Enter every page of this process's mapping (header, slots,
        fences) in its page tables without writing a byte, as CUDA's host
        registration does for a GPU worker: a copy into or out of a slot this
        process never touched then pays no page fault. Why: a worker that
        attaches to a pool other processes filled (a node's, after an engine
        restart) faulted once a 64 KiB (the kernel's fault-around) in its
        first copies: a 4,000-token load of 16 MiB out of a 428 MB pool took
        2.6-2.8 ms (1.25x) longer (``bench/first_touch.py``). Who calls: a CPU worker's transfers, in the background
        (:meth:`populate_in_background`); blocks, in ``chunk_bytes`` steps
        with the GIL released, and stops early once the pool is closed.
        Returns the bytes entered (fewer where the kernel refused some)."""
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise InvalidArgument(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        done = 0
        for offset in range(0, int(self._pool.map_bytes), chunk_bytes):
            if self.closed:
                break
            done += int(self._pool.populate(offset, chunk_bytes))
        return done

    def populate_in_background(self) -> threading.Thread:
        """:meth:`populate` on a daemon thread (started, returned): an engine
        starts serving meanwhile, its copies at worst faulting as before.
        The thread runs on the CPUs of the thread that calls this."""
        t = threading.Thread(target=self.populate, name="kvtier-pool-populate", daemon=True)
        t.start()
        return t

    def disown(self) -> None:
        """Keep the name when this creator closes or exits: the pool then
        outlives its creator (a node's pool, adopted by the next node so the
        engines that map it go on). Who removes it then: whoever knows that
        no process maps it any more (``os.unlink`` of ``/dev/shm/<name>``)."""
        self._pool.disown()

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
