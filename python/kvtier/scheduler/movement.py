"""Moving blocks between the host tier and the lower tiers: the
write-through cascade (host -> disk/remote) and promotion (disk/remote ->
host), and what their completions do to the host tier.

Process: the engine's scheduler, under the manager's lock. Who calls: the
manager facade (stores, lookups, step ends) and the read-ahead. Nothing here
blocks: batches are submitted at the step end (or once
:data:`~kvtier.scheduler.options.EAGER_PROMOTE` promotions are queued for a
tier) and their completions drained by :meth:`Movement.poll`.

Under backpressure a cascade is dropped (the block stays in the host tier
only) and promotions stay queued until the next step end.
"""

from __future__ import annotations

from kvtier.scheduler.core import Core
from kvtier.scheduler.fences import Fills
from kvtier.scheduler.options import EAGER_PROMOTE
from kvtier.scheduler.slots import JobKind
from kvtier.tiers.base import LookupResult, TierCompletion


class Movement:
    """Per lower tier, the cascades and promotions queued this step."""

    def __init__(self, core: Core, fills: Fills) -> None:
        self.core = core
        self.fills = fills
        self._cascade: list[list[bytes]] = [[] for _ in core.lower]
        self._promote: list[list[bytes]] = [[] for _ in core.lower]
        self._busy: set[int] = set()  # tiers that refused a promotion this step

    def cascade(self, key: bytes) -> None:
        """``key`` was just stored in the host tier, or reused there
        (``cascade_on_hit``): copy it to every lower tier that lacks it and
        admits it (its slot held until each copy ends)."""
        host = self.core.host
        if host.entries[key].cascading:
            return  # on its way down already
        for i, tier in enumerate(self.core.lower):
            if tier.lookup(key) is LookupResult.HIT or not tier.admit(key):
                continue
            host.begin_cascade(key)
            self._cascade[i].append(key)

    def promote(self, i: int, keys: list[bytes], eager: bool = True) -> None:
        """Queue promotions of ``keys`` (host entries being written) from
        tier ``i``; with ``eager``, a long queue starts at once."""
        queue = self._promote[i]
        queue.extend(keys)
        if eager and len(queue) >= EAGER_PROMOTE and i not in self._busy:
            self.submit_promotions(i)

    def flush(self) -> bool:
        """Step end: submit every queued cascade and promotion. True when
        something was queued (most decode steps queue nothing)."""
        if not any(self._cascade) and not any(self._promote):
            self._busy.clear()
            return False
        core = self.core
        entries = core.host.entries
        for i, tier in enumerate(core.lower):
            batch, self._cascade[i] = self._cascade[i], []
            live = [(k, entries[k]) for k in batch if k in entries]
            if live:
                keys = [k for k, _ in live]
                slots = [e.slot for _, e in live]
                hints = getattr(tier, "chain_hints", None)
                if hints is not None:  # the tier keeps prefix chains too (disk)
                    hints({k: e.parent for k, e in live if e.parent is not None})
                token = tier.submit_store(keys, slots)
                if token is None:  # backpressure: drop this cascade, unhold the blocks
                    core.stats.cascades_dropped += len(keys)
                    for k in keys:
                        core.host.end_cascade(k)
                else:
                    core.slots.start(i, token, JobKind.STORE, keys, slots)
                    core.stats.cascades += len(keys)
            if self._promote[i]:
                self.submit_promotions(i)
        self._busy.clear()
        return True

    def submit_promotions(self, i: int) -> None:
        """Start the promotions queued for tier ``i``. Under backpressure
        they stay queued (and lookups stop trying until the step ends)."""
        core = self.core
        entries = core.host.entries
        live = [k for k in self._promote[i] if k in entries]
        if live:
            slots = [entries[k].slot for k in live]
            token = core.lower[i].submit_load(live, slots)
            if token is None:
                self._busy.add(i)
                return
            core.slots.start(i, token, JobKind.LOAD, live, slots)
        self._promote[i] = []

    def poll(self) -> None:
        """Drain every lower tier's completions and released slots."""
        host = self.core.host
        for i, tier in enumerate(self.core.lower):
            for c in tier.poll():
                self._complete(i, c)
            for slot in tier.take_released_slots():
                host.unhold(slot)

    def pending(self) -> bool:
        """Work queued here or in flight in a tier."""
        return bool(
            len(self.core.slots)
            or any(self._cascade)
            or any(self._promote)
            or any(t.has_pending_work() for t in self.core.lower)
        )

    def reset(self) -> None:
        """A reset dropped every host entry: forget what was queued."""
        self._cascade = [[] for _ in self.core.lower]
        for queue in self._promote:
            queue.clear()

    def _complete(self, i: int, c: TierCompletion) -> None:
        core = self.core
        job = core.slots.end(i, c.token)
        if job is None:  # not a batch of ours: only a failed store is counted
            if c.kind == "store":
                oks = c.key_ok if c.key_ok is not None else [c.ok] * len(c.keys)
                core.stats.cascade_failures += sum(1 for ok in oks if not ok)
            return
        keys, slots = job.keys, job.slots
        oks = c.key_ok if c.key_ok is not None else [c.ok] * len(keys)
        held = c.held or [False] * len(keys)
        for idx, (k, ok) in enumerate(zip(keys, oks)):
            slot = slots[idx]
            if held[idx]:
                core.host.hold(slot)  # before anything below may free it
                core.stats.held_slots += 1
            if job.kind is JobKind.FENCED:
                self.fills.done(k, slot, ok)
            elif job.kind is JobKind.STORE:
                self._cascaded(k, slot, ok)
            else:
                self._promoted(k, slot, ok, c.missing is not None and c.missing[idx])

    def _cascaded(self, key: bytes, slot: int, ok: bool) -> None:
        core = self.core
        if not ok:
            core.stats.cascade_failures += 1
        e = core.host.get(key)
        if e is not None and e.slot == slot:
            core.host.end_cascade(key)
        else:
            core.slots.release_if_unused(slot)  # detached by a reset: free it now

    def _promoted(self, key: bytes, slot: int, ok: bool, missing: bool) -> None:
        core = self.core
        e = core.host.get(key)
        if e is None or e.slot != slot:
            core.slots.release_if_unused(slot)
        elif ok:
            core.host.mark_ready(key)
            core.stats.promotions += 1
            core.readable([key])
        else:
            # Never announced, but a lookup may have reported it HIT_PENDING
            # (or the read-ahead's probe held it): a metadata-only removal.
            core.host.drop(key)
            core.unannounced([key])
            if missing:
                core.stats.probe_misses += 1  # not there: a plain miss
            else:
                core.stats.promotion_failures += 1
