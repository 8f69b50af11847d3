"""Read-ahead: a request's lower-tier reads waited for within its scan.

Process: the engine's scheduler, under the manager's lock. Who calls: the
manager's ``lookup`` (the first lookup of a request that misses the host
tier) and its step end. Blocks: :meth:`ReadAhead.read` waits for the reads
(the GIL released in the tiers' waits), at most what is left of the step's
``scan_wait_s``.

With ``scan_wait_s`` > 0, the first lookup of a request that misses the
host tier reads that key and the request's following keys (``key_order``)
from the lower tiers into host slots at once, in one batch per tier, up to
the first key no tier holds: keys a tier knows by a promotion; keys it does
not know yet (RETRY) after its existence check (waited for), or with
``probe`` by a probe (for Redis one GET answers "exists?" and brings the
bytes; a new prompt's probes take host slots for a moment). It then waits
and the lookup answers from the host tier, so a returning prefix is HIT in
the step it is first looked up rather than RETRY, then HIT_PENDING, then HIT.
Bounded per scheduler step: ``scan_wait_s`` of waiting and ``scan_bytes``
read (a request whose reads would exceed what is left takes the
asynchronous path). A HIT is given only for bytes in a host slot whose read
was checked; a read that fails is a MISS, counted; what the deadline cuts
short stays HIT_PENDING and ends as a promotion. With ``fenced``, reads of
keys a tier holds are not waited for (:mod:`kvtier.scheduler.fences`).
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.scheduler.core import Core
from kvtier.scheduler.fences import Fills
from kvtier.scheduler.movement import Movement
from kvtier.scheduler.options import SCAN_BACKOFF_S
from kvtier.scheduler.slots import JobKind
from kvtier.tiers.base import LookupResult


class ReadAhead:
    """This step's read-ahead budget and the keys already read ahead."""

    def __init__(self, core: Core, movement: Movement, fills: Fills) -> None:
        self.core = core
        self.movement = movement
        self.fills = fills
        self._ahead: set[bytes] = set()
        self.wait_left_s = core.options.scan_wait_s
        self.bytes_left = core.options.scan_bytes
        self._no_wait_until = 0.0

    def wanted(self, key: bytes) -> bool:
        """A lookup of ``key`` should read ahead first."""
        return (
            self.core.options.scan_wait_s > 0
            and key not in self._ahead
            and key not in self.core.host.entries
        )

    def new_step(self) -> None:
        """Step end: the budget comes back, keys may be read ahead again."""
        self._ahead.clear()
        self.wait_left_s = self.core.options.scan_wait_s
        self.bytes_left = self.core.options.scan_bytes

    def reset(self) -> None:
        self._ahead.clear()

    def read(self, key: bytes, req_context: Any) -> None:
        """Read ``key`` and the request's following keys that miss the host
        tier into host slots, and wait for them (see the module docstring)."""
        core = self.core
        order = core.options.key_order
        run = [key, *(order(key, req_context) if order else ())]
        self._ahead.update(run)
        if self.wait_left_s <= 0 or time.monotonic() < self._no_wait_until:
            return
        picks = self._pick_reads(run)
        tiers = sorted({i for i, unknown, _ in picks if unknown and not self._probes(i)})
        if tiers:
            # Existence first (one round trip of small replies), so that no
            # slot is taken, nor block evicted, for a key no tier holds.
            checks = {i: core.lower[i].submit_checks() for i in tiers}
            if not self._wait({i: [t] for i, t in checks.items() if t is not None}):
                return
            self.movement.poll()
            picks = self._pick_reads(run)
            cut = (n for n, (i, unknown, _) in enumerate(picks) if unknown and not self._probes(i))
            picks = picks[: next(cut, len(picks))]
        pool = core.host.pool
        slot_bytes = pool.slot_bytes if pool is not None else 0
        if not picks or len(picks) * slot_bytes > self.bytes_left:
            return  # nothing to read, or too much to wait for: the asynchronous path
        # Never evict a key of this request (a later one may be a host hit)
        # or a hit of this step.
        got = core.host.allocate(len(picks), protected=core.scanned.union(run), partial=True)
        if got is None:
            return
        slots, evicted = got
        core.removed(evicted)
        picks = picks[: len(slots)]
        self.bytes_left -= len(picks) * slot_bytes
        groups: dict[tuple[int, bool], tuple[list[bytes], list[int]]] = {}
        for (i, probe, k), slot in zip(picks, slots):
            core.host.add_writing(k, slot, source=core.lower[i].name)
            ks, ss = groups.setdefault((i, probe), ([], []))
            ks.append(k)
            ss.append(slot)
        self._wait(self._submit(groups))
        before = core.stats.promotions
        self.movement.poll()
        core.stats.scan_reads += core.stats.promotions - before

    def _submit(
        self, groups: dict[tuple[int, bool], tuple[list[bytes], list[int]]]
    ) -> dict[int, list[int]]:
        """Start each (tier, probe) group's reads; the tokens to wait for."""
        core = self.core
        waits: dict[int, list[int]] = {}
        # Probes first: on the same connections, a probe queued behind the
        # fenced reads would make the lookup wait for those reads after all.
        for (i, probe), (ks, ss) in sorted(groups.items(), key=lambda g: not g[0][1]):
            tier = core.lower[i]
            if not probe and core.options.fenced and tier.can_fence and self.fills.start(i, ks, ss):
                continue
            token = tier.submit_probe(ks, ss) if probe else tier.submit_load(ks, ss)
            if token is not None:
                core.slots.start(i, token, JobKind.PROBE if probe else JobKind.LOAD, ks, ss)
                waits.setdefault(i, []).append(token)
            elif probe:  # busy: back to the asynchronous existence check
                for k in ks:
                    core.host.drop(k)
            else:
                self.movement.promote(i, ks, eager=False)  # started at the step end
        return waits

    def _wait(self, waits: dict[int, list[int]]) -> bool:
        """Wait for tier batches (tier -> tokens) within what is left of this
        step's ``scan_wait_s``; False (and no more waiting for a while) when
        the deadline came first."""
        if not waits:
            return True
        core = self.core
        start = time.monotonic()
        deadline = start + self.wait_left_s
        core.stats.scan_waits += 1
        done = True
        for i, tokens in waits.items():
            if not core.lower[i].wait(tokens, deadline - time.monotonic()):
                core.stats.scan_timeouts += 1
                self._no_wait_until = time.monotonic() + SCAN_BACKOFF_S
                done = False
                break
        now = time.monotonic()
        core.stats.scan_wait_s += now - start
        self.wait_left_s = max(0.0, deadline - now)
        return done

    def _probes(self, tier: int) -> bool:
        """Keys lower tier ``tier`` does not know yet are probed (rather than
        checked first)."""
        return self.core.options.probe and self.core.lower[tier].can_probe

    def _pick_reads(self, run: list[bytes]) -> list[tuple[int, bool, bytes]]:
        """``(tier, unknown, key)`` for the keys of ``run`` that miss the
        host tier, in order, up to the first key no tier holds (the engine
        stops its scan there); ``unknown``: the tier said RETRY."""
        core = self.core
        picks: list[tuple[int, bool, bytes]] = []
        entries = core.host.entries
        for k in run:
            if k in entries:
                continue
            for i, tier in enumerate(core.lower):
                r = tier.lookup(k)
                if r is LookupResult.MISS:
                    continue
                if r is LookupResult.HIT:
                    if core.options.promote or not core.worker_reads(tier):
                        picks.append((i, False, k))
                    # else the worker reads it itself: nothing to read ahead
                elif r is LookupResult.RETRY:
                    picks.append((i, True, k))
                else:
                    return picks
                break
            else:
                return picks
        return picks
