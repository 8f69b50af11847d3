"""Fenced fills: a lower tier's read into a host slot that loads may copy
from before it ends.

Process: the engine's scheduler, under the manager's lock. Who calls: the
read-ahead (to start fills), the movement room (when a fill's job ends) and
the manager facade (loads and step ends). Nothing here blocks: the waiting
happens in the worker's copies, slot by slot, on the pool's fence words.

With the ``fenced`` option, the read-ahead of keys a tier is known to hold is
not waited for: their slots are armed (:meth:`HostPool.arm_fences`) and the
keys are HIT at once; each load's copy waits for its slot's fence, so the
copy into the engine overlaps the reads. A read that fails makes its key a
MISS from then on, fails the loads already waiting on it (the engine
recomputes those blocks) and is dropped once no load holds it. An entry's
state is :class:`~kvtier.tiers.host.Fill`; its ``fence`` is the armed value.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

from kvtier.scheduler.core import Core
from kvtier.scheduler.slots import JobKind
from kvtier.tiers.host_entry import Fill, HostEntry


class Fills:
    """The host entries whose fill is not settled (FILLING or FAILED)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.count = 0  # entries whose fill is not NONE (fast paths skip all when 0)
        self._failed: set[bytes] = set()  # entries whose fill is FAILED

    def start(self, i: int, keys: list[bytes], slots: list[int]) -> bool:
        """Read ``keys`` from lower tier ``i`` into ``slots`` under fences and
        make them HIT now; False (nothing changed) when the tier cannot or is
        busy."""
        core = self.core
        pool = core.host.pool
        if pool is None:
            return False
        armed = pool.arm_fences(slots)
        token = core.lower[i].submit_fenced_load(keys, slots, armed)
        if token is None:
            for slot, a in zip(slots, armed.tolist()):
                pool.settle_fence(slot, a, False)
            return False
        core.slots.start(i, token, JobKind.FENCED, keys, slots)
        entries = core.host.entries
        for k, a in zip(keys, armed.tolist()):
            e = entries[k]
            e.fill, e.fence = Fill.FILLING, a
            core.host.mark_ready(k)
        self.count += len(keys)
        core.stats.fenced_reads += len(keys)
        return True

    def done(self, key: bytes, slot: int | None, ok: bool) -> None:
        """The fenced read of ``key`` into ``slot`` ended (``ok``: read and
        checked by the tier, which settled the fence itself)."""
        core = self.core
        e = core.host.get(key)
        if e is None or slot is None or e.slot != slot or e.fill is not Fill.FILLING:
            if slot is not None:
                core.slots.release_if_unused(slot)  # detached by a reset: free it now
            return
        if ok:
            self._settled(e)
            core.stats.promotions += 1
            core.readable([key])
            return
        pool = core.host.pool
        if pool is not None:  # a job cancelled or timed out never settled its fence
            pool.settle_fence(slot, e.fence, False)
        core.stats.fenced_failures += 1
        if e.ref > 0 or key in core.scanned:
            # A load holds it, or may still be prepared this step: MISS from
            # now on, its loads fail on the fence, dropped once none holds it.
            e.fill = Fill.FAILED
            self._failed.add(key)
        else:
            self._drop([key])

    def fences(self, keys: list[bytes], slots: list[int]) -> np.ndarray | None:
        """Per key of a load, the fence its copy waits for (0: none); None
        when no key has one. A failed read's value too: that copy then fails
        on its fence."""
        if not self.count:
            return None
        entries = self.core.host.entries
        armed = [entries[k].fence if s >= 0 else 0 for k, s in zip(keys, slots)]
        return np.asarray(armed, np.int64) if any(armed) else None

    def before_unpins(self, keys: Collection[bytes]) -> None:
        """Before a load's unpins: a block whose fenced read failed is dropped
        when this load was its last."""
        failed = self._failed
        if failed:
            entries = self.core.host.entries
            self._drop([k for k in keys if k in failed and entries[k].ref <= 1])

    def step_end(self) -> None:
        """Drop failed reads of blocks HIT last step and never loaded."""
        if self._failed:
            entries = self.core.host.entries
            self._drop([k for k in self._failed if entries[k].ref == 0])

    def forget(self, key: bytes, e: HostEntry) -> None:
        """``key``'s entry was detached by a reset."""
        if e.fill is not Fill.NONE:
            self.count -= 1
            self._failed.discard(key)

    def _settled(self, e: HostEntry) -> None:
        e.fill, e.fence = Fill.NONE, 0
        self.count -= 1

    def _drop(self, keys: Iterable[bytes]) -> None:
        """Drop blocks whose fenced read failed. Lookups reported them HIT
        but they were never announced stored (a fill is announced when its
        read ends well): a metadata-only removal."""
        gone = []
        for k in list(keys):
            if self.core.host.drop(k) is not None:
                self.count -= 1
                gone.append(k)
            self._failed.discard(k)
        self.core.unannounced(gone)
