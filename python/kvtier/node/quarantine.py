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
their keys are dropped. Past an eighth of a class's slots held, only
holds that no engine's copy can still reach are freed early
(:meth:`Quarantine.hold`). Who calls: the node's sessions when a
connection closes (:meth:`Quarantine.hold`), and its serving loop once a second
(:meth:`Quarantine.expire`). Non-blocking.

A worker stuck for longer than the grace (a hung GPU, a stopped process)
could still write late. So the node also knows an engine's workers: each
names its engine when it asks for the pool (:class:`Writers`, a pidfd a
process), and a dead engine's slots stay held past the grace until every
worker of it that was alive when it died has exited (a process's copies
end with it: its CUDA context is torn down first), MAX_HOLD_S at most.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

log = logging.getLogger("kvtier.node")

# A worker's copy in flight ends within milliseconds, a queued one once its
# fence or budget lets it; a worker whose scheduler died finds it gone at
# its next step. 5 s covers both with room, and costs the node a dead
# engine's few slots for that long.
GRACE_S = 5.0
# Worker processes the node tracks at most (a pidfd each): past it the
# oldest are forgotten (their engines' slots then wait out the grace only).
MAX_WRITERS = 4096
# The longest slots wait for live workers: an engine whose connection
# closed while it lives on (it timed out on a stalled node and reattached)
# keeps its workers, whose copies of that time are long over.
MAX_HOLD_S = 60.0


def _exited(fd: int) -> bool:
    """Whether the process of pidfd ``fd`` has exited (it polls readable).
    poll(2), not select(2): a busy node's descriptors pass FD_SETSIZE."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class Writers:
    """The processes that asked for an engine's pool (its workers, which
    write node slots), each as a pidfd: a pid that exits and is reused never
    stands for another process. Who calls: the node's POOL handler
    (:meth:`add`), its drop of a connection (:meth:`alive`) and its serving
    loop once a second (:meth:`prune`)."""

    def __init__(self) -> None:
        self._fds: OrderedDict[tuple[str, int], int] = OrderedDict()

    def add(self, engine: str, pid: int) -> None:
        """Track ``pid`` as a writer of ``engine``'s (nothing when the pid is
        not visible here: 0 from another pid namespace, or no pidfds)."""
        if pid <= 0 or (engine, pid) in self._fds:
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return
        self._fds[(engine, pid)] = fd
        while len(self._fds) > MAX_WRITERS:
            os.close(self._fds.popitem(last=False)[1])

    def alive(self, engine: str, but: int) -> list[int]:
        """Pidfds (new ones, the caller's to close) of ``engine``'s writers
        that are alive, the process ``but`` left out (the dead connection's)."""
        out = []
        for (e, pid), fd in self._fds.items():
            if e == engine and pid != but and not _exited(fd):
                with contextlib.suppress(OSError):
                    out.append(os.dup(fd))
        return out

    def prune(self) -> None:
        """Forget the writers that have exited."""
        for k in [k for k, fd in self._fds.items() if _exited(fd)]:
            os.close(self._fds.pop(k))

    def __len__(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Hold(NamedTuple):
    due: float  # its grace ends
    host: Any
    slots: list[int]
    writers: list[int]  # pidfds of the processes to outlive
    engine: str  # the dead connection's engine name
    misbehaved: bool  # the node closed it for bad input
    started: float  # when that connection attached
    held_at: float


class Quarantine:
    """Slots held for :data:`GRACE_S` and until given processes exited, in
    the order they were held."""

    def __init__(self) -> None:
        self._due: list[_Hold] = []  # oldest first
        self.slots = 0  # held now
        self._over = False  # past the cap at the last hold (warned)

    def hold(
        self,
        host: Any,
        slots: Iterable[int],
        cap: int,
        writers: Sequence[int] = (),
        engine: str = "",
        misbehaved: bool = False,
        started: float = 0.0,
    ) -> None:
        """Hold ``slots`` of ``host`` (before they are released or dropped:
        a release then leaves them allocated until :meth:`expire`), for the
        grace and until every process of ``writers`` (pidfds, owned from
        here on) has exited. ``engine``: the dead connection's engine name;
        ``misbehaved``: the node closed it for bad input; ``started``: when
        it attached (time.monotonic()).

        Past ``cap`` slots held, older holds are freed early, oldest first,
        only where no honest engine's copy can still land: the connection
        sent bad input (no engine of ours does; a client that maps the
        pool could write any slot anyway), or its engine's writers are
        known and have all exited, or the same engine name attached again
        after this hold and died too (a restart takes seconds, its copies
        milliseconds; two engines that share a name and die together are
        not that). The rest stay held past the cap,
        logged. Freeing the oldest whatever they were let one engine's late
        copy land in a slot handed to another when two engines died a step
        apart on a small node: a HIT with the wrong bytes (found by
        tests/node/test_node_model.py over more seeds, 7 December 2026)."""
        held = list(dict.fromkeys(slots))
        if not held:
            for fd in writers:
                os.close(fd)
            return
        for s in held:
            host.hold(s)
        now = time.monotonic()
        hold = _Hold(now + GRACE_S, host, held, list(writers), engine, misbehaved, started, now)
        self._due.append(hold)
        self.slots += len(held)
        i = 0
        while self.slots > cap and i < len(self._due) - 1:
            h = self._due[i]
            later = any(n.engine == h.engine and n.started > h.held_at for n in self._due[i + 1 :])
            if h.misbehaved or later or (h.writers and all(_exited(fd) for fd in h.writers)):
                self._free(i)
            else:
                i += 1
        if self.slots > cap and not self._over:  # once a crossing, not a hold
            why = "dead engines' writes may still land: stores can fail until their grace ends"
            log.warning("kvtier node: %d slots held, past the cap of %d (%s)", self.slots, cap, why)
        self._over = self.slots > cap

    def _free(self, i: int) -> int:
        _, host, held, writers, *_ = self._due.pop(i)
        for s in held:
            host.unhold(s)
        for fd in writers:
            os.close(fd)
        self.slots -= len(held)
        return len(held)

    def held(self) -> set[int]:
        """The slots held now (status reports their count, :attr:`slots`)."""
        return {s for h in self._due for s in h.slots}

    def waiting(self) -> int:
        """Slots held past their grace: a writer of their engine still runs."""
        now = time.monotonic()
        return sum(len(h.slots) for h in self._due if h.due <= now)

    def expire(self, now: float | None = None) -> int:
        """Free the slots whose grace has passed and whose engine's writers
        have all exited (or that waited MAX_HOLD_S for them). Returns how many."""
        now = time.monotonic() if now is None else now
        n, i = 0, 0
        while i < len(self._due) and self._due[i][0] <= now:
            due, writers = self._due[i].due, self._due[i].writers
            for fd in [fd for fd in writers if _exited(fd)]:
                writers.remove(fd)
                os.close(fd)
            if writers and now < due + MAX_HOLD_S:
                i += 1
            else:
                n += self._free(i)
        return n
