"""The engine's side of the node: the offloading manager that forwards to it
(:class:`NodeManager`), over its link to the node (:class:`~kvtier.node.
client_link.NodeLink`: one connection and the node's shared index). With
the shared index its usual calls are one native call each
(``kvtier._native.node_front``), its methods here the fallback.

Process: the engine's scheduler. Who calls: the vLLM shim's
:class:`~kvtier.integrations.vllm.scheduler.KVTierManager` (in place of an
in-process :class:`~kvtier.scheduler.manager.TieredOffloadingManager`),
SGLang's node backend, tests and ``kvtier bench manager --node``. A manager
call that needs the node is one request and blocks for its reply (a
Unix-socket round trip), at most ``timeout_s``; lookups and loads of HITs
through the shared index need none.

A node that is gone (killed, restarting) is the same degradation as a
failed Redis: lookups miss, offers are not stored, both counted; the
client tries to reattach at most once a second, at a step end, and goes on
as before once the node answers with the same pool.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection
from typing import Any

import numpy as np

from kvtier._native import frame_keys_ok, node_front, scan_answers
from kvtier.errors import ClosedError, InvalidArgument
from kvtier.node import protocol as P
from kvtier.node.client_link import NodeLink
from kvtier.node.connection import SPIN_S, STORES_KEYS, NodeUnavailable
from kvtier.node.protocol import Op
from kvtier.scheduler.specs import HostSpec, PrepareStoreResult
from kvtier.scheduler.stats import ManagerStats
from kvtier.tiers.base import LookupResult, TierEvent

_ANSWER = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)
_NAME = {id(r): r.name.lower() for r in LookupResult}  # stats' keys, without enum lookups
_BYTES = {bytes}
# Keys of a request's scan sent with its first lookup: the node answers up to
# the first MISS, so a long prompt is one round trip, not one per key.
SCAN_KEYS = 4096
# Finished requests go with the step end (the node forgets their chain ends),
# this many at once if steps are rare (SGLang): a frame each was 7% of the
# node's time a key (bench manager --node --shared-index, 16 keys a call).
FINISHED_BATCH = 64
# Step ends posted, unanswered, before the next waits (events and reservation
# arrive at most this many late). Quiet steps (shared index, nothing asked of
# the node) end there STEPS_PER_END at a time, one frame; sooner when the
# reservation is under what the steps since the last end took from it (the
# reply that tops it up comes about that late), or LOW_RESERVE, or END_AFTER_S
# after the last end sent (a real model's steps end each). 8 and 2 against 4
# and 4: node CPU a key 2.6 -> 2.2-2.4 us (docs/benchmarks/node.md, 5
# December); 16 steps against 8, the node growing the reservation to match
# (state.py's RESERVE_MAX): see docs/benchmarks/node.md, 7 December (session
# 36). More owed let a store's frame reach the node after the store's keys
# come back (kvtier bench manager --node: 64 calls later): they missed.
OWED_STEPS, STEPS_PER_END, LOW_RESERVE, END_AFTER_S = 2, 16, 32, 0.005
# NodeManager's methods that node_front's fall back to, in its order, and
# those the instance takes from it.
_FALLBACKS = (
    *("prepare_store", "complete_store", "prepare_load", "complete_load"),
    *("on_request_finished", "_complete_at_node", "_scan", "on_schedule_end"),
)
_NATIVE = (*_FALLBACKS[:5], "on_schedule_end", "on_new_request")


class NodeManager(NodeLink):
    """The offloading manager of an engine attached to a node: the interface
    of :class:`~kvtier.scheduler.manager.TieredOffloadingManager`, each call
    one request to the node. ``namespace`` (32 hex digits) and
    ``payload_bytes`` choose what this engine shares; ``key_order`` (as the
    in-process manager's) lists the keys a request looks up after a key;
    ``events``: whether this engine takes KV events (the node makes none for
    engines that do not)."""

    def __init__(
        self,
        path: str,
        namespace: str,
        payload_bytes: int,
        engine: str = "engine",
        key_order: Any = None,
        timeout_s: float = 5.0,
        spin_s: float = SPIN_S,
        events: bool = True,
    ) -> None:
        self.key_order = key_order
        self._lock = threading.Lock()
        self.stats = ManagerStats()
        self.lower: list[Any] = []
        # The node's answers for keys a scan has not asked yet (each used
        # once, dropped at a change or the step's end); this step's HITs' slots.
        self._answers: dict[bytes, tuple[LookupResult, int]] = {}
        self._hit_slots: dict[bytes, int] = {}
        # Steps ended here, not yet at the node (STEPS_PER_END); slots stores took
        # from the reservation since the last step end sent.
        self._unsent_steps = self._taken = 0
        self._sent_at = 0.0
        self._closed = False
        # Raises when no node answers at start.
        super().__init__(path, namespace, payload_bytes, engine, timeout_s, spin_s, events)
        # The usual calls with the shared index in one native call each, this
        # class's methods else (csrc/bindings/node_front.cc: why).
        cls = NodeManager
        usual = node_front(
            self,
            tuple(getattr(cls, c) for c in _FALLBACKS),
            PrepareStoreResult,
            HostSpec,
            _ANSWER,
            globals(),
            self._client,
            self._client.stores_frame,
            STORES_KEYS,
            FINISHED_BATCH,
            P.MAX_KEYS,
            P.MAX_KEY_BYTES,
        )
        for name in _NATIVE:
            setattr(self, name, getattr(usual, name))
        names = tuple(r.name.lower() for r in _ANSWER)  # csrc/bindings/scan_answers.cc: why
        front = scan_answers(self._answers, self.stats.lookups, _ANSWER, names, usual.scan)
        self.lookup = front.lookup  # type: ignore[method-assign]

    # -- the manager interface -----------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def lookup(self, key: bytes, req_context: Any = None) -> LookupResult:
        """One key's answer (a scan's first asks for the keys after it too): what
        an instance's lookup, its ScanAnswers' set in __init__, does in C."""
        r = (self._answers.pop(key, None) or self._scan(key, req_context))[0]
        self.stats.lookups[_NAME[id(r)]] += 1
        return r

    def _scan(self, key: bytes, req_context: Any) -> tuple[LookupResult, int]:
        answers, slots, order = self._answers, self._hit_slots, self.key_order
        if self._fast is None:
            if self._closed:  # (shutdown empties the answers: every lookup comes here)
                raise ClosedError("manager is shut down")
            self._index()
        fast, view = self._fast, self._view
        if fast is not None and view is not None and not view.lower:  # the index answers alone
            # The key alone first: a new request's first key misses, and its
            # following keys' list was 0.09 of a store's 0.22 us a key in scans.
            if fast.scan_into([key], answers, slots, _ANSWER)[1] != 0 and order is not None:
                fast.scan_into(order(key, req_context)[: SCAN_KEYS - 1], answers, slots, _ANSWER)
            return answers.pop(key)
        ask = [key] if order is None else [key, *order(key, req_context)[: SCAN_KEYS - 1]]
        if view is not None:
            # HITs found and pinned in the shared index, stored as answers; its MISS
            # goes to the node (a HIT in its lower tiers promotes).
            n, last = view.scan_into(ask, answers, slots, _ANSWER)
            ask = ask[n - 1 :] if last == 0 else []
            if ask:
                del answers[ask[0]]
        if ask and not self.attached:
            self.client_stats.node_down_lookups += 1
        elif ask:
            try:
                req = getattr(req_context, "req_id", None)
                for k, (code, slot) in zip(ask, self._call(Op.LOOKUP, ask, req)):
                    answers[k] = (_ANSWER[code], slot)
                    if slot >= 0:
                        slots[k] = slot
            except NodeUnavailable as e:
                self._down(e)
                self.client_stats.node_down_lookups += 1
        return answers.pop(key, (LookupResult.MISS, -1))

    def contains(self, keys: list[bytes]) -> list[LookupResult]:
        """Each key's answer (every key, in order; nothing pinned): one
        round trip. Not a call of vLLM's interface: for engines that ask
        before they load (SGLang's existence checks). All MISS while the
        node is gone."""
        if self._closed:
            raise ClosedError("manager is shut down")
        if self.attached and keys:
            try:
                return [_ANSWER[c] for c in self._call(Op.CONTAINS, keys)]
            except NodeUnavailable as e:
                self._down(e)
        self.client_stats.node_down_lookups += len(keys)
        return [LookupResult.MISS] * len(keys)

    def load_present(self, keys: list[bytes]) -> list[tuple[LookupResult, int]]:
        """Each key's answer and host slot (-1 unless HIT), every key, in
        order, the HITs pinned for loading until :meth:`complete_load` of
        them: a lookup and a prepare_load in one round trip. Not a call of
        vLLM's interface: for engines that load whatever is there (SGLang's
        prefetch). All MISS while the node is gone."""
        if self._closed:
            raise ClosedError("manager is shut down")
        if self.attached and keys:
            try:
                out = self._call(Op.LOAD_PRESENT, keys, None)
                hits = sum(1 for code, _ in out if code == 1)
                self.stats.loads += hits
                self.stats.loaded_from["host"] = self.stats.loaded_from.get("host", 0) + hits
                return [(_ANSWER[code], slot) for code, slot in out]
            except NodeUnavailable as e:
                self._down(e)
        self.client_stats.node_down_lookups += len(keys)
        return [(LookupResult.MISS, -1)] * len(keys)

    def may_fail_to_load(self, key: bytes) -> bool:
        """False: a HIT is a host block the node pinned for this engine."""
        return False

    def get_load_source(self, key: bytes, req_context: Any = None) -> str:
        return "host"

    def prepare_load(self, keys: Collection[bytes], req_context: Any = None) -> HostSpec:
        keys = list(keys)
        self.stats.loads += len(keys)
        self.stats.loaded_from["host"] = self.stats.loaded_from.get("host", 0) + len(keys)
        fast = self._fast
        if fast is not None and self.attached:  # the usual load: every key a HIT here
            got = fast.take_all_loads(keys, self._loaded)
            if got is not None:
                return HostSpec(got)
        req = getattr(req_context, "req_id", None)
        view = self._index()
        hit = self._hit_slots
        found = all(map(hit.__contains__, keys))  # this step's lookups named every slot
        if view is not None and view.hits and found and self.attached:
            mine = view.take_loads(keys)
            if mine is not None:
                # Told by slot with the step end; a promotion's (node-pinned) as before.
                self._loaded += map(hit.__getitem__, mine)
                if len(mine) < len(keys):
                    taken = set(mine)
                    rest = [k for k in keys if k not in taken]
                    self._send(Op.LOAD_PINNED, rest, req)
                return HostSpec(np.fromiter(map(hit.__getitem__, keys), np.int64, len(keys)))
        if view is not None and not found and self.attached:
            slots = view.pin_present(keys)
            if slots is not None:
                self._loaded += slots
                return HostSpec(np.asarray(slots, np.int64))
        if found and self.attached:
            # This step's lookups pinned them at the node and named their slots:
            # no need to wait for it (vLLM loads in the step it looked up).
            self._send(Op.LOAD_PINNED, keys, req)
            if self.attached:
                return HostSpec(np.asarray([hit[k] for k in keys], np.int64))
        if self.attached:
            try:
                slots = self._call(Op.PREPARE_LOAD, keys, req)
                return HostSpec(np.asarray(slots, np.int64))
            except NodeUnavailable as e:
                self._down(e)
        # The node went after this step's lookup: nothing has reused its slots yet.
        slots = [self._hit_slots.get(k, -1) for k in keys]
        if any(s < 0 for s in slots):
            raise InvalidArgument("prepare_load of a key that is not a HIT")
        return HostSpec(np.asarray(slots, np.int64))

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        rest = list(keys)
        if self._view is not None:
            rest = self._view.complete(rest)
            if not rest:
                return
        self._complete_at_node(rest, req_context)

    def _complete_at_node(self, keys: list[bytes], req_context: Any) -> None:
        """Loads the node pinned (not through the shared index) ended."""
        self._send(Op.COMPLETE_LOAD, keys, getattr(req_context, "req_id", None))

    def load_failed(self, spec: HostSpec) -> None:
        self.stats.load_failures += len(spec.slots)
        self._send(Op.LOAD_FAILED, [int(s) for s in spec.slots.tolist()])

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        self._send(Op.TOUCH, list(keys))

    def prepare_store(
        self, keys: Collection[bytes], req_context: Any = None
    ) -> PrepareStoreResult | None:
        fast = self._fast  # (an offer of plain bytes: not bytearrays or subclasses)
        if fast is not None and frame_keys_ok(keys, P.MAX_KEYS, P.MAX_KEY_BYTES) and self.attached:
            got = fast.store_from_reserve(keys)
            if got is not None:
                return self._stored(got[0], got[1], req_context)
        keys = list(keys)
        if keys and set(map(type, keys)) != _BYTES:  # the types in C, not a check a key
            keys = P.plain_keys(keys)
        self._answers.clear()
        if not self.attached:
            self.client_stats.node_dropped_stores += len(keys)
            return None
        req = getattr(req_context, "req_id", None)
        view = self._index()
        if view is not None and self.attached:
            got = view.native.store_from_reserve(keys)
            if got is not None:
                return self._stored(got[0], got[1], req_context)
        try:
            out = self._call(Op.PREPARE_STORE, keys, req)
        except NodeUnavailable as e:
            self._down(e)
            self.client_stats.node_dropped_stores += len(keys)
            return None
        if out is None:
            self.stats.allocation_failures += 1
            return None
        stored, slots, evicted = out[:3]
        if view is not None:
            view.add_writing(stored, slots)
            if len(out) > 3:
                view.reserve(out[3])
        if len(stored) < len(keys):
            self.stats.not_admitted += len(keys) - len(stored)
        return PrepareStoreResult(stored, HostSpec(np.asarray(slots, np.int64)), evicted)

    def _stored(
        self, stored: list[bytes], slots: list[int], req_context: Any
    ) -> PrepareStoreResult:
        """An offer's keys in this engine's reserved slots (no round trip): their
        writes posted, with the keys the node evicted since the last offer."""
        self._answers.clear()
        self._taken += len(slots)
        view = self._view
        assert view is not None
        evicted, view.evicted = view.evicted, []
        if stored:
            self._send(Op.STORES, stored, slots, getattr(req_context, "req_id", None))
        return PrepareStoreResult(stored, HostSpec(np.asarray(slots, np.int64)), evicted)

    def complete_store(
        self, keys: Collection[bytes], req_context: Any = None, success: bool = True
    ) -> None:
        keys = list(keys)
        if not keys:
            return
        self._answers.clear()
        if success:
            self.stats.stores += len(keys)
        else:
            self.stats.store_failures += len(keys)
        if self._view is not None:
            self._view.finish(keys, success)
            if success:  # with the flush's other stores (STORES)
                return self._send(Op.STORES, keys, None)
        self._send(Op.COMPLETE_STORE, keys, getattr(req_context, "req_id", None), bool(success))

    def on_new_request(self, req_context: Any = None) -> None:
        return None

    def on_request_finished(self, req_context: Any = None) -> None:
        """Told with the next step end (or the next FINISHED_BATCH at once)."""
        fin = self._finished
        fin.append(getattr(req_context, "req_id", None))
        if len(fin) >= FINISHED_BATCH:
            self._finished = []
            for req in fin:
                self._send(Op.REQUEST_FINISHED, req)

    def on_schedule_end(self, context: Any = None) -> None:
        """Ends the step at the node: this step's lookup pins are released
        and the events since the last step end come back. With a shared
        index and nothing asked of the node, STEPS_PER_END steps end there
        in one posted frame, its reply (events, reservation, pending work)
        taken at a later call: no round trip, events a few steps later."""
        if self._closed:
            raise ClosedError("manager is shut down")
        self._answers.clear()
        self._hit_slots.clear()
        view = self._view
        if view is not None:
            view.end_step()
        if not self.attached:
            self._reattach()
            if not self.attached:
                self._pending = False
                return
        asked, self._asked = self._asked, False
        client = self._client
        quiet = view is not None and not (asked or self._pending)
        if quiet:
            self._unsent_steps += 1
            stocked = view is not None and view.native.reserved >= max(LOW_RESERVE, self._taken)
            soon = time.monotonic() < self._sent_at + END_AFTER_S
            if self._unsent_steps < STEPS_PER_END and stocked and soon:
                return  # ended with the next one: nothing here waits on the node
        self._unsent_steps = self._taken = 0
        self._sent_at = time.monotonic()
        self._alive = False
        self._fast = None
        fin, self._finished = self._finished, []
        loads, self._loaded = self._loaded, []
        try:
            if quiet:
                client.post_call(Op.STEP_END, fin, loads)
                client.flush()
                replies = client.replies(client.owed > OWED_STEPS, OWED_STEPS)
            else:
                out = self._call(Op.STEP_END, fin, loads)
                replies = [*client.replies(), out]
        except NodeUnavailable as e:
            self._down(e)
            self._pending = False
            return
        for r in replies:
            self._step_reply(r)

    def take_events(self) -> list[TierEvent]:
        """The events up to the last step end, oldest first. Blocks for a
        posted step end's reply when it has not come (vLLM takes events
        after the step's model run: it has)."""
        self._settle(True)
        ev, self._events = self._events, []
        return ev

    def has_pending_work(self) -> bool:
        """As of the last step end answered (a step that asked the node to
        look, or followed pending work, waits for its step end's answer)."""
        self._settle(False)
        return self._pending

    def reset_cache(self) -> None:
        """Drop this namespace's blocks that no engine holds, at the node."""
        self._answers.clear()
        if self.attached:
            try:
                self._call(Op.RESET)
            except NodeUnavailable as e:
                self._down(e)

    def on_reset_flushed(self) -> None:
        return None

    def occupancy(self) -> dict[str, int]:
        """This engine's view: nothing of the node's is held here (its leases
        are the node's to count: ``kvtier node status``)."""
        idle = ("pinned", "writing", "cascading", "held", "stale", "streaming", "tier_jobs")
        return {"blocks": len(self.host), **dict.fromkeys(idle, 0)}

    def status(self) -> dict[str, Any]:
        """The node's status (one round trip)."""
        return dict(self._call(Op.STATUS))

    def shutdown(self) -> None:
        """Close the connection: the node releases whatever it still leases
        to this engine. Idempotent."""
        self._closed = True
        self._answers.clear()  # every lookup asks _scan now, which refuses
        with contextlib.suppress(NodeUnavailable):
            self._client.flush()
        self._client.close()
        self._drop_index()

    def __enter__(self) -> NodeManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
