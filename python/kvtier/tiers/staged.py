"""A lower tier for pipeline parallelism: one tier per pipeline stage, moved
in lockstep.

With pipeline parallelism each stage keeps the KV cache of its own layers in
its own host pool (slot sizes differ when the layer split is uneven; the slot
count is the same, so a slot number means the same block in every stage).
:class:`StagedTier` puts one lower tier (a disk or remote tier sized for that
stage's blocks) over each stage's pool and presents them to the manager as
one tier: a block is in it only when every stage holds its part.

Who calls: the manager, under its lock, like any lower tier. Nothing blocks.
Completions come in the order the last stage finishes each batch.

Process: the engine's scheduler (stage 0's, which holds the index).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.jobs import Ended, Joined
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent
from kvtier.tiers.events import EVENT_LOG_KEYS, EventLog


class StagedTier(LowerTier):
    """``tiers[i]`` moves stage ``i``'s part of each block between
    ``pools[i]`` and its medium; a pool given as None is the one the manager
    attaches (its own stage's). The pools must have the same slot count.
    ``event_log_keys``: see :class:`~kvtier.tiers.events.EventLog`."""

    def __init__(
        self,
        tiers: Sequence[LowerTier],
        pools: Sequence[Any | None],
        name: str,
        event_log_keys: int = EVENT_LOG_KEYS,
    ) -> None:
        if not tiers or len(tiers) != len(pools):
            raise InvalidArgument("a staged tier needs one tier and one pool per stage")
        self.tiers = list(tiers)
        self.stage_pools = list(pools)
        self.name = name
        self._tokens = itertools.count(1)
        # token -> (kind, keys, slots); its parts are the stages' batches,
        # (stage, stage token), each part's ``first`` its stage.
        self._batches: dict[int, tuple[str, list[bytes], list[int]]] = {}
        self._parts: Joined[int, tuple[int, int], TierCompletion] = Joined()
        self._held: dict[int, list[int]] = {}  # slot -> stages still holding it
        self._released: list[int] = []
        self._events = EventLog(event_log_keys)
        self._checks: dict[int, list[tuple[int, int]]] = {}  # token -> (stage, sub token)
        self.pool = None

    def attach(self, pool: Any) -> None:
        self.pool = pool
        if pool is None:  # no-data mode: indexes only
            for t in self.tiers:
                t.attach(None)
            return
        pools = [pool if p is None else p for p in self.stage_pools]
        counts = {p.num_slots for p in pools}
        if len(counts) != 1:
            raise InvalidArgument(f"stage pools must have the same slot count, got {counts}")
        for t, p in zip(self.tiers, pools):
            t.attach(p)

    def lookup(self, key: bytes) -> LookupResult:
        results = [t.lookup(key) for t in self.tiers]
        if any(r is LookupResult.MISS for r in results):
            return LookupResult.MISS
        if all(r is LookupResult.HIT for r in results):
            return LookupResult.HIT
        return LookupResult.RETRY

    def admit(self, key: bytes) -> bool:
        # Every stage sees every offer, so their filters and budgets stay in step.
        return all([t.admit(key) for t in self.tiers])

    def _submit(self, store: bool, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        token = next(self._tokens)
        busy_from = None
        for i, t in enumerate(self.tiers):
            tok = t.submit_store(keys, slots) if store else t.submit_load(keys, slots)
            if tok is None:
                if i == 0:
                    return None
                # Some stages took the batch, a later one was busy: the batch
                # fails as a whole once the stages that took it are done.
                busy_from = i
                break
            self._parts.add(token, (i, tok), first=i)
        self._batches[token] = ("store" if store else "load", list(keys), list(slots))
        self._parts.seal(token, busy_from)
        return token

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        return self._submit(True, keys, slots)

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        return self._submit(False, keys, slots)

    def submit_checks(self) -> int | None:
        subs = [
            (i, tok) for i, t in enumerate(self.tiers) if (tok := t.submit_checks()) is not None
        ]
        if not subs:
            return None
        token = next(self._tokens)
        self._checks[token] = subs
        return token

    def wait(self, tokens: Sequence[int], timeout_s: float) -> bool:
        """Every stage's part of the batches (or checks) ``tokens``, within
        one deadline."""
        deadline = time.monotonic() + timeout_s
        per: list[list[int]] = [[] for _ in self.tiers]
        for tok in set(tokens):
            for i, sub in self._parts.subs(tok) + self._checks.pop(tok, []):
                per[i].append(sub)
        return all(
            not subs or t.wait(subs, deadline - time.monotonic())
            for t, subs in zip(self.tiers, per)
        )

    def poll(self) -> list[TierCompletion]:
        self._checks.clear()  # a check's token serves only the wait of its step
        for i, t in enumerate(self.tiers):
            for c in t.poll():
                owner = self._parts.part((i, c.token))
                if owner is None:
                    continue
                slots = self._batches[owner[0]][2]
                for k, h in enumerate(c.held or []):  # before this stage's release can come
                    if h:
                        self._held.setdefault(slots[k], []).append(i)
                self._parts.done((i, c.token), c)
            for slot in t.take_released_slots():
                left = self._held.get(slot)
                if left is not None:
                    left.remove(i)
                    if not left:
                        del self._held[slot]
                        self._released.append(slot)
        return [self._merge(e) for e in self._parts.take_ended()]

    def _merge(self, ended: Ended[int, tuple[int, int], TierCompletion]) -> TierCompletion:
        token = ended.parent
        kind, keys, _ = self._batches.pop(token)
        done = ended.results
        if ended.missing_from is not None:  # a stage was busy: nothing of it is there
            done.append(TierCompletion(0, False, kind, keys))
        n = len(keys)
        ok = [all(c.ok if c.key_ok is None else c.key_ok[k] for c in done) for k in range(n)]
        held = [any(c.held[k] for c in done if c.held) for k in range(n)]
        if kind == "store" and any(ok):
            self._events.append(TierEvent([k for k, o in zip(keys, ok) if o], self.name, False))
        return TierCompletion(
            token, all(ok), kind, keys, key_ok=ok, held=held if any(held) else None
        )

    def take_events(self) -> list[TierEvent]:
        ev = self._events.take()
        removed: dict[bytes, None] = {}  # a block gone from any stage is gone, once
        ids: dict[bytes, None] = {}  # those a stage named by event id
        for t in self.tiers:
            for e in t.take_events():
                if e.removed:
                    removed.update(dict.fromkeys(e.keys))
                    ids.update(dict.fromkeys(e.ids))
        if removed or ids:
            ev.append(TierEvent(list(removed), self.name, True, ids=list(ids)))
        return ev

    def has_pending_work(self) -> bool:
        return self._parts.busy() or any(t.has_pending_work() for t in self.tiers)

    def take_released_slots(self) -> list[int]:
        out, self._released = self._released, []
        return out

    def reset(self) -> None:
        for t in self.tiers:
            t.reset()

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def stats(self) -> dict[str, Any]:
        """Counters summed over the stages, and each stage's own."""
        per: list[dict[str, Any]] = [getattr(t, "stats", dict)() for t in self.tiers]
        out: dict[str, Any] = {}
        for st in per:
            for k, v in st.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        # Its own log's drops beside the stages' (a block a stage dropped
        # unseen may still be reported by this tier's own events).
        out["events_dropped"] = out.get("events_dropped", 0) + self._events.dropped
        out["stages"] = per
        return out
