"""Slots an engine that died may still be writing: held after its
connection closes, and handed out again only after a grace period.

Why: an engine's leases end when its connection to the node closes, which
is when the process holding that connection dies. A vLLM engine's
connection lives in its scheduler process, and its copies run in its
worker processes. So the scheduler can be gone while a worker's copy into
a node slot is still in flight, or still queued behind a fence. If the
node handed such a slot to another engine at once, that engine's block
could be overwritten after it finished writing it: a HIT with another
key's bytes.

The node therefore holds these slots: the slots of stores that never
completed, the dead engine's reserved slots, and the slots it was writing
for keys the node already had. They stay held (``held`` in the class's
occupancy) for :data:`GRACE_S`, then are freed. Everything else the engine
held is released at once, and none of these slots is readable meanwhile:
their keys are dropped. At most an eighth of a class's slots are held
(the oldest go first past that). Who calls: the node's sessions when a
connection closes (:meth:`Quarantine.hold`), and its serving loop once a second
(:meth:`Quarantine.expire`). Non-blocking.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

# A worker's copy in flight ends within milliseconds, a queued one once its
# fence or budget lets it; a worker whose scheduler died finds it gone at
# its next step. 5 s covers both with room, and costs the node a dead
# engine's few slots for that long.
GRACE_S = 5.0


class Quarantine:
    """Slots held for :data:`GRACE_S`, in the order they were held."""

    def __init__(self) -> None:
        self._due: deque[tuple[float, Any, list[int]]] = deque()
        self.slots = 0  # held now

    def hold(self, host: Any, slots: Iterable[int], cap: int) -> None:
        """Hold ``slots`` of ``host`` (before they are released or dropped:
        a release then leaves them allocated until :meth:`expire`). At most
        ``cap`` slots stay held: past it the oldest are freed early, so a
        flood of clients that die mid-store (or a fuzzer) cannot take the
        class's memory from the engines that run."""
        held = list(dict.fromkeys(slots))
        if not held:
            return
        for s in held:
            host.hold(s)
        self._due.append((time.monotonic() + GRACE_S, host, held))
        self.slots += len(held)
        while self.slots > cap and len(self._due) > 1:
            self._free_oldest()

    def _free_oldest(self) -> int:
        _, host, held = self._due.popleft()
        for s in held:
            host.unhold(s)
        self.slots -= len(held)
        return len(held)

    def held(self) -> set[int]:
        """The slots held now (status reports their count, :attr:`slots`)."""
        return {s for _, _, slots in self._due for s in slots}

    def expire(self, now: float | None = None) -> int:
        """Free the slots whose grace has passed. Returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        while self._due and self._due[0][0] <= now:
            n += self._free_oldest()
        return n
