"""Slots that a job which timed out may still read or write.

Process: the engine's scheduler (or the node). Who calls: the owner of a
free list of pool slots (the host tier, SGLang's host pages), under its
lock. Nothing here blocks.
"""

from __future__ import annotations


class SlotHolds:
    """Slots a timed-out job may still read or write: a slot released while
    held goes back to ``free`` (the owner's free list) only when its last
    hold ends. Who calls: the owner of ``free``, under its lock."""

    def __init__(self, free: list[int]) -> None:
        self.free = free
        self._held: dict[int, list[int]] = {}  # slot -> [holds, release asked]

    def __contains__(self, slot: int) -> bool:
        return slot in self._held

    def __len__(self) -> int:
        return len(self._held)

    def release(self, slot: int) -> None:
        """``slot`` is no longer used: free now, or when its last hold ends."""
        h = self._held.get(slot)
        if h is not None:
            h[1] = 1
        else:
            self.free.append(slot)

    def hold(self, slot: int) -> None:
        """A job that timed out may still touch ``slot``: never hand it out
        again until :meth:`unhold`."""
        self._held.setdefault(slot, [0, 0])[0] += 1

    def unhold(self, slot: int) -> None:
        """The job that held ``slot`` ended; freed now if released meanwhile."""
        h = self._held.get(slot)
        if h is None:
            return
        h[0] -= 1
        if h[0] <= 0:
            del self._held[slot]
            if h[1]:
                self.free.append(slot)
