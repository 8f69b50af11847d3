"""SGLang HiCache shim: kvtier's memory tier in front of disk and Redis, for
the pages SGLang stored most recently.

kvtier's disk tier reads and writes with direct I/O, so nothing it wrote is
served from the page cache the way SGLang's own file backend is served; a
page read back soon after SGLang backed it up comes from the device. With
``kvtier_host_bytes`` the backend keeps each page it stores in a slot of
its shared-memory staging pool, bounded and evicted least recently used
first; the lower tiers write the page from that slot, and loads and hit
queries look there before the lower tiers. The index is an ordered dict, not
the vLLM host tier's :class:`~kvtier.tiers.host.HostTier`: with that one
(pins, cascades, pluggable policies SGLang's calls never need) a store of
32 KiB pages spent 2.5 us a page on bookkeeping and ran 15-20% under the
disk tier alone (2 cores); this one keeps it to a few percent. It is write-allocate only: a page SGLang loads goes
into SGLang's own host pool, which is where SGLang looks next, so a page
read from disk is not copied here too.

Runs in each SGLang scheduler process (one per TP/PP rank). Who calls:
:class:`kvtier.integrations.sglang.mover.PageMover`, holding its lock for
every method (nothing here blocks or waits on native work); the copies into
and out of the slots are the mover's copy jobs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.pool import HostPool
from kvtier.tiers.slot_holds import SlotHolds


class HostPages:
    """``num_slots`` slots of ``pool`` from slot ``first`` on (the mover's
    staging pool: the lower tiers write a page straight from its slot here,
    so a store copies each page once), keyed like the lower tiers (one
    mover, one namespace). Slot numbers given and taken are the pool's. A
    slot is being written (invisible to loads, never evicted) from
    :meth:`reserve` until :meth:`commit` or :meth:`abort`, pinned by a load
    from :meth:`pin` until :meth:`unpin` (never evicted either)."""

    def __init__(self, num_slots: int, pool: HostPool, first: int) -> None:
        self.pool, self.first, self.num_slots = pool, first, num_slots
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._writing: dict[bytes, int] = {}
        self._pins: dict[bytes, int] = {}
        self._free = list(range(first + num_slots - 1, first - 1, -1))
        # Slots a timed-out tier job may still touch. The mover notes holds
        # of its staging slots here too: those are never released, so they
        # never reach this free list.
        self.held = SlotHolds(self._free)
        self.counters = dict.fromkeys(
            ("host_pages_stored", "host_pages_loaded", "host_evictions"), 0
        )

    def __len__(self) -> int:
        return len(self._ready) + len(self._writing)

    def keys(self) -> list[bytes]:
        """The keys held or being written, least recently used first."""
        return [*self._ready, *self._writing]

    def holds(self, key: bytes) -> bool:
        """Is ``key`` here, its bytes complete?"""
        return key in self._ready

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Slots for the positions of ``keys`` not held yet, as ``(position,
        slot)``, evicting ready unpinned pages least recently used first; as
        many as can be had. Each is invisible until :meth:`commit` or
        :meth:`abort` of its key."""
        first: dict[bytes, int] = {}  # a batch may name a key twice: one slot for it
        ready, writing = self._ready, self._writing
        for i, k in enumerate(keys):
            if k not in ready and k not in writing:
                first.setdefault(k, i)
        want = list(first.values())  # in the batch's order: the order they age in
        free = self._free
        if len(free) < len(want):
            self._evict(len(want) - len(free))
        n = min(len(want), len(free))
        slots = sorted(free.pop() for _ in range(n))
        # Ascending, so pages stored together lie in adjacent slots when they
        # can (the disk tier coalesces adjacent slots into one write).
        for i, slot in zip(want, slots):
            writing[keys[i]] = slot
        return list(zip(want, slots))

    def _evict(self, n: int) -> None:
        """Free ``n`` slots (fewer when the rest are pinned), least recently
        used pages first; pinned ones keep their place."""
        pinned: list[tuple[bytes, int]] = []
        while n > 0 and self._ready:
            key, slot = self._ready.popitem(last=False)
            if key in self._pins:
                pinned.append((key, slot))
                continue
            self.held.release(slot)
            self.counters["host_evictions"] += 1
            n -= 1
        for key, slot in reversed(pinned):
            self._ready[key] = slot
            self._ready.move_to_end(key, last=False)

    def commit(self, keys: Sequence[bytes]) -> None:
        """The bytes of ``keys`` (reserved) are in their slots and no tier
        still writes from them: readable and evictable now, most recently
        used last."""
        for k in keys:
            self._ready[k] = self._writing.pop(k)
        self.counters["host_pages_stored"] += len(keys)

    def abort(self, keys: Sequence[bytes]) -> None:
        """The copy into the slots of ``keys`` (reserved) failed: forget them."""
        for k in keys:
            self.held.release(self._writing.pop(k))

    def pin(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key: its pool slot, pinned against eviction until :meth:`unpin`
        and now the most recently used; None when it is not here whole."""
        out: list[int | None] = []
        for k in keys:
            slot = self._ready.get(k)
            if slot is not None:
                self._ready.move_to_end(k)
                self._pins[k] = self._pins.get(k, 0) + 1
            out.append(slot)
        return out

    def unpin(self, keys: Sequence[bytes], loaded: int) -> None:
        """End the pins of ``keys`` (those :meth:`pin` found); ``loaded`` of
        their pages were copied out."""
        for k in keys:
            n = self._pins.get(k, 0) - 1
            if n > 0:
                self._pins[k] = n
            else:
                self._pins.pop(k, None)
        self.counters["host_pages_loaded"] += loaded

    def reset(self) -> None:
        """Forget every page (no copy or write may be in flight: the mover
        holds both of its direction locks; a slot a timed-out job holds is
        freed when the job ends)."""
        for slot in [*self._ready.values(), *self._writing.values()]:
            self.held.release(slot)
        self._ready.clear()
        self._writing.clear()
        self._pins.clear()

    def stats(self) -> dict[str, Any]:
        return {"host_slots": self.num_slots, "host_pages": len(self), **self.counters}
