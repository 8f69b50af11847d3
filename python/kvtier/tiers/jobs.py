"""The tier-job layer: how every tier that moves data through the native
engine submits, polls, times out and accounts its work.

A tier's store or load of N keys is one :class:`Batch`. The tier splits its
I/O items into engine jobs through :meth:`TierJobs.submit` (its own callback
builds the medium's descriptors); :meth:`TierJobs.poll` drains the engine's
completions, writes each job's per-item codes into its batch, and hands back
the batches whose last job ended. What differs per medium (descriptors,
index, record states) stays in the tier; what is the same (job ids to
batches, Busy part way through a batch, cancelled and timed-out jobs, jobs
still holding memory after their deadline, byte counters) lives here once.

Who calls: :class:`kvtier.tiers.disk.DiskTier` and
:class:`kvtier.tiers.remote.tier.RemoteTier`, under the manager's lock. Nothing
here blocks except :meth:`TierJobs.close`.

Process: the engine's scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.codes import ItemStatus
from kvtier.errors import Busy, ClosedError, Timeout
from kvtier.jobs import Joined
from kvtier.tiers.base import LowerTier, TierEvent, check_slots
from kvtier.tiers.events import EVENT_LOG_KEYS, EventLog

COUNTERS = ("stores", "loads", "bytes_written", "bytes_read", "busy_drops", "timeouts")
"""Counters every data-moving tier keeps (a tier adds its own to these)."""


def new_counters(*extra: str) -> dict[str, int]:
    """Zeroed counters: the shared ones, then the tier's ``extra`` ones."""
    return dict.fromkeys((*COUNTERS, *extra), 0)


def count_moved(counters: dict[str, int], kind: str, n: int, unit_bytes: int) -> None:
    """Account ``n`` blocks of ``unit_bytes`` stored or loaded (``kind``)."""
    if kind == "store":
        counters["stores"] += n
        counters["bytes_written"] += n * unit_bytes
    else:
        counters["loads"] += n
        counters["bytes_read"] += n * unit_bytes


@dataclass(eq=False)
class Batch:
    """One store, load or existence check of a tier: ``n`` I/O items.

    ``items[i]`` is item i's code once the batch ended, a plain int to compare
    with :class:`kvtier.codes.ItemStatus` (0 ok, > 0 errno, < 0 integrity or
    protocol failure). ``held[i]`` is True when item i's job
    timed out while the device may still touch its memory. ``data`` is the
    tier's own bookkeeping for the batch.
    """

    token: int
    kind: str
    n: int
    data: dict[str, Any] = field(default_factory=dict)
    items: list[int] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.items = [0] * self.n
        self.held = [False] * self.n


@dataclass(frozen=True)
class Released:
    """Items ``[first, first + count)`` of ``batch`` whose timed-out job really
    ended: the memory they touched may be reused now."""

    batch: Batch
    first: int
    count: int


class TierJobs:
    """The engine jobs of one tier, each a part of its batch (an item range;
    :class:`kvtier.jobs.Joined` keeps them).

    ``engine`` is a :class:`kvtier.engine.Engine` the tier owns (its queues'
    budgets and deadlines are the tier's; None before the tier has one:
    batches then only end at once); ``counters`` the tier's counters
    (see :func:`new_counters`). Batches come back from
    :meth:`poll` in the order they ended.
    """

    def __init__(self, engine: Any, counters: dict[str, int]) -> None:
        self.engine = engine
        self.counters = counters  # the tier's; this layer counts "timeouts"
        self._tokens = itertools.count(1)
        self._batches: dict[int, Batch] = {}  # token -> batch, until it ended
        self._jobs: Joined[int, int, Any] = Joined()  # batch token -> engine jobs
        self._held_batches: dict[int, Batch] = {}  # ended batches with a held job

    def batch(self, kind: str, n: int, **data: Any) -> Batch:
        """A new batch of ``n`` I/O items with a fresh token (nothing submitted)."""
        return Batch(next(self._tokens), kind, n, dict(data))

    def end_now(self, batch: Batch) -> None:
        """A batch with nothing to submit: the next :meth:`poll` returns it."""
        self._batches[batch.token] = batch
        self._jobs.seal(batch.token)

    def submit(
        self,
        batch: Batch,
        per_job: int,
        submit_one: Callable[[int, int], int],
        item_bytes: int = 0,
    ) -> bool:
        """Submit ``batch``'s items as jobs of at most ``per_job`` items each.

        ``submit_one(first, count)`` queues items ``[first, first + count)``
        and returns the engine's job id, or raises :class:`kvtier.Busy`. When
        Busy comes before any job, nothing is queued and this returns False
        (the tier undoes its bookkeeping); after some jobs, the remaining items
        end with ``ItemStatus.BUSY`` and the batch goes on. With
        ``item_bytes`` (what one item counts against the engine's budget), a
        batch that would not fit beside the jobs in flight is Busy as a whole
        first: a batch spread over every worker thread would otherwise meet
        the budget part way (alone, a batch still goes, in part if need be).
        A batch of no items ends at once. Never blocks.
        """
        if item_bytes and self.engine is not None:
            used = self.engine.in_flight_bytes()
            if used and used + batch.n * item_bytes > self.engine.budget():
                return False
        per_job = max(1, per_job)
        missing_from = None
        for first in range(0, batch.n, per_job):
            count = min(per_job, batch.n - first)
            try:
                jid = submit_one(first, count)
            except Busy:
                if first == 0:
                    return False
                missing_from = first
                break
            self._jobs.add(batch.token, jid, first, count)
        self._batches[batch.token] = batch
        self._jobs.seal(batch.token, missing_from)
        return True

    def poll(self) -> tuple[list[Batch], list[Released]]:
        """Drain the engine: batches that ended since the last poll (in the
        order they ended) and the item ranges of timed-out jobs that really
        ended since then. Non-blocking."""
        released: list[Released] = []
        for r in self.engine.poll() if self.engine is not None else ():
            if r.released:  # a timed-out job really ended: its memory is free
                held = self._jobs.release(r.job_id)
                if held is not None:
                    token, part = held
                    released.append(Released(self._held_batch(token), part.first, part.count))
                continue
            owner = self._jobs.part(r.job_id)
            if owner is None:
                continue
            batch, part = self._batches[owner[0]], owner[1]
            first, count = part.first, part.count
            items = list(r.items)
            if not items and not r.ok:  # the whole job failed: every item with it
                code = ItemStatus.TIMED_OUT if r.timed_out else ItemStatus.CANCELLED
                items = [int(code)] * count
                if r.timed_out:
                    self.counters["timeouts"] += count
                if r.held:  # a late write or read may still land in its memory
                    batch.held[first : first + count] = [True] * count
            batch.items[first : first + len(items)] = items
            self._jobs.done(r.job_id, r, held=bool(r.held and not r.ok and not r.items))
        ended = []
        for e in self._jobs.take_ended():
            batch = self._batches.pop(e.parent)
            if e.missing_from is not None:
                rest = batch.n - e.missing_from
                batch.items[e.missing_from :] = [int(ItemStatus.BUSY)] * rest
            if any(batch.held):
                self._held_batches[batch.token] = batch
            ended.append(batch)
        return ended, released

    def _held_batch(self, token: int) -> Batch:
        """The batch of a held job; forgotten with its last held job."""
        batch = self._held_batches[token]
        if not any(p == token for p, _ in self._jobs.held_parts()):
            del self._held_batches[token]
        return batch

    def busy(self) -> bool:
        """True while a job is queued or running, a batch waits for
        :meth:`poll`, or a timed-out job still holds memory."""
        return self._jobs.busy()

    def wait(self, tokens: Sequence[int], timeout_s: float) -> bool:
        """Block until every engine job of the batches ``tokens`` ended, at
        most ``timeout_s`` (the GIL released): True if they did. Their
        results stay for :meth:`poll`."""
        jids = self.job_ids(tokens)
        if not jids or self.engine is None:
            return True
        try:
            self.engine.wait(jids, max(0.0, timeout_s))
        except Timeout:
            return False
        return True

    def job_ids(self, tokens: Sequence[int]) -> list[int]:
        """Engine job ids still queued or running for the batches ``tokens``
        (for a caller that waits on them itself, without holding the tier)."""
        return [j for t in tokens for j in self._jobs.subs(t)]

    def in_flight(self) -> set[int]:
        """Engine job ids queued or running (not yet drained by :meth:`poll`)."""
        return set(self._jobs.in_flight())

    @property
    def held_jobs(self) -> int:
        """Timed-out jobs that may still touch their memory."""
        return self._jobs.held

    def close(self) -> None:
        """Let queued jobs finish and join the engine's threads. Blocks; idempotent."""
        if self.engine is not None:
            self.engine.close()


class JobTier(LowerTier):
    """What a lower tier moving data through the native engine shares: its
    :class:`TierJobs`, counters, events, argument checks and closing.

    A subclass sets ``name``, ``counters`` and ``jobs`` in its constructor
    and says what its medium needs in ``submit_store``/``submit_load``/
    ``poll``; :meth:`_release` lets go of the medium's own handles at close.
    Who calls: the manager, under its lock. Only :meth:`close` blocks.
    """

    counters: dict[str, int]
    jobs: TierJobs
    _closed: bool = False

    def _tier_init(self, name: str, *counters: str, event_log_keys: int = EVENT_LOG_KEYS) -> None:
        """Called first by the subclass constructor: ``counters`` are the
        tier's own beyond the shared ones (:data:`COUNTERS`); its events
        not taken are bounded by ``event_log_keys`` keys (:class:`EventLog`)."""
        self.name = name
        self.pool = None
        self.counters = new_counters(*counters)
        self.jobs = TierJobs(None, self.counters)
        self._events = EventLog(event_log_keys)

    def _check(self, keys: Sequence[bytes], slots: Sequence[int], block_bytes: int = 0) -> None:
        """Clear errors at the boundary: closed tier, keys and slots of
        different lengths, a slot outside the pool or smaller than
        ``block_bytes``."""
        if self._closed:
            raise ClosedError(f"{self.name} tier is closed")
        no_data = getattr(self, "no_data", False)
        check_slots(keys, slots, None if no_data else self.pool, block_bytes)

    def take_events(self) -> list[TierEvent]:
        return self._events.take()

    def wait(self, tokens: Sequence[int], timeout_s: float) -> bool:
        return self.jobs.wait(tokens, timeout_s)

    def _release(self) -> None:
        """Let go of the medium's handles after the last job ended (close)."""

    def close(self) -> None:
        """Let every queued job finish, report them, release the medium.
        Blocks until the engine's threads are joined; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.jobs.close()
        self.poll()
        self._release()
