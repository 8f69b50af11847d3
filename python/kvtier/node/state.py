"""The node's sessions: one per attached engine, and what each one leases
(the slot classes they use: :mod:`kvtier.node.classes`).

Process: the node (``kvtier node``). Who calls: :mod:`kvtier.node.server`,
from its one event-loop thread, one request at a time; nothing here blocks
(lower-tier I/O is the native engine's). Engines of every namespace share a
class's host tier; a key is stored under its namespace's 8-byte prefix, so
two namespaces never share a block.

Leases: a session holds what the node handed it until it gives it back or
its connection closes (:meth:`Session.release_all`): the HIT keys of this
step's lookups (pinned until its step ends, so another engine cannot evict
them between the lookup and the load), the keys of its loads (until
complete_load) and its writes (until complete_store; a write never
completed is dropped, so a half-written slot never becomes readable).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier._native import adopt_stores, prefixed, unprefixed
from kvtier.errors import InvalidArgument
from kvtier.node.classes import SlotClass
from kvtier.node.protocol import ProtocolError
from kvtier.tiers.base import LookupResult

log = logging.getLogger("kvtier.node")

# Events a session keeps for its engine between two step ends: an engine
# that stops asking loses the oldest (counted), never the node's memory.
MAX_EVENTS = 1 << 16
_CODE = {LookupResult.MISS: 0, LookupResult.HIT: 1, LookupResult.HIT_PENDING: 2}
# A host block's code by the tier's answer (HostTier.answer: 1 ready, 2 being
# written, 3 a failed fill, 4 a fill under way), as the manager would answer.
_HELD_CODE = {1: 1, 2: 2, 3: 0, 4: 1}
# Free slots an engine with the shared index keeps for its stores, which it
# takes without a round trip (STORE_BEGIN); topped up in the replies of
# PREPARE_STORE and STEP_END. RESERVE at first, grown up to RESERVE_MAX for
# an engine that takes more than a quarter of its reservation between two
# top-ups: the offers of the steps between two step ends and of the ends
# owed (client.py's STEPS_PER_END, OWED_STEPS) must be in hand, 16 keys a
# step, 16 steps an end and 2 owed are 768. An engine whose steps end one
# at a time (a model's steps take milliseconds: END_AFTER_S) keeps RESERVE.
RESERVE, RESERVE_MAX = 512, 1024


@dataclass
class _Ctx:
    """The request context the class's manager sees: request ids of
    different engines never collide (its chains are kept per request)."""

    req_id: Any


_session_ids = itertools.count(1)


class Session:
    """One attached engine (its scheduler process's connection)."""

    def __init__(
        self, cls: SlotClass, namespace: str, engine: str, pid: int, uid: int, events: bool = True
    ) -> None:
        self.id = next(_session_ids)
        self.cls = cls
        self.namespace = namespace
        self.prefix = bytes.fromhex(namespace)[:8]
        self.engine = engine
        self.pid = pid
        self.started = time.monotonic()  # attached (the quarantine's restarts)
        self.uid = uid
        self.scan_pins: list[bytes] = []  # node keys pinned by this step's lookups
        self.scan_set: set[bytes] = set()
        # Node key -> loads of it this session holds. A dict with counts
        # kept by hand, not a Counter: a Counter's update, subtract and
        # dropping of zeros were the node's costliest per-key calls
        # (callgrind, kvtier bench manager --node, 16-key offers).
        self.load_pins: dict[bytes, int] = {}
        self.writes: set[bytes] = set()
        self.events: list[list[Any]] = []
        self.events_dropped = 0
        self.calls = 0
        # Whether the engine takes KV events (vLLM's enable_kv_cache_events;
        # SGLang takes none): the class makes them only while one does.
        self.wants_events = events
        self.engine_index = cls.engine_index() if cls.shared is not None else None
        self.reserved: set[int] = set()  # slots reserved for this engine's stores
        self.reserve_to = RESERVE  # the reservation's size, grown by top_up
        self._topped = 0  # len(reserved) after the last top-up
        self.spare: dict[bytes, list[int]] = {}  # node key -> slots its writes free
        # A STORES frame in one native pass (adopt_stores) where the class's
        # tier is the native index taking every offer; else in Python.
        host: Any = cls.manager.host
        self._native_stores = hasattr(host, "_ix") and host.admission.threshold <= 1
        cls.sessions.add(self)
        cls.events_wanted()

    # -- keys ----------------------------------------------------------
    def _node_keys(self, keys: list[bytes]) -> list[bytes]:
        return prefixed(self.prefix, keys)  # in C: twice a store, 0.8 us a 16-key list here

    def _ctx(self, req: Any) -> _Ctx | None:
        return None if req is None else _Ctx((self.id, req))

    def _req(self, req: Any) -> tuple[int, Any] | None:
        """The request id the class's manager knows ``req`` by (its _Ctx's)."""
        return None if req is None else (self.id, req)

    def add_event(
        self, tier: str, removed: bool, keys: list[bytes], ids: list[bytes], meta: bool
    ) -> None:
        if not self.wants_events:
            return
        if len(self.events) >= MAX_EVENTS:
            self.events_dropped += 1
            del self.events[0]
        self.events.append([tier, removed, keys, ids, meta])

    # -- the manager's calls, one request each --------------------------
    def lookup(self, keys: list[bytes], req: Any) -> list[list[int]]:
        """Each key's answer and host slot (-1 unless HIT), in order, up to
        and including the first MISS (the engine stops there). A HIT is
        pinned for this session until its step ends."""
        m = self.cls.manager
        host = m.host
        ctx = self._ctx(req)
        if self.cls.last_scan != (self.id, req):
            self.cls.last_scan = (self.id, req)
            m.on_new_request(ctx)
        out: list[list[int]] = []
        for nk in self._node_keys(keys):
            r = m.lookup(nk, ctx)
            if r is LookupResult.HIT:
                (slot,) = host.load_slots([nk])
                if slot < 0:  # not readable as a host block: ask again
                    out.append([2, -1])
                    continue
                host.pin(nk)
                self.scan_pins.append(nk)
                self.scan_set.add(nk)
                out.append([1, slot])
                continue
            out.append([_CODE.get(r, 3), -1])
            if r is LookupResult.MISS:
                break
        return out

    def contains(self, keys: list[bytes]) -> list[int]:
        """Each key's answer code, in order, every key asked (not up to the
        first MISS), nothing pinned: whether the node holds it (a lower-tier
        hit starts its promotion, HIT_PENDING), for an engine that asks
        before it loads (SGLang's existence checks, per page). A block the
        host tier holds is answered from its entry, without the manager's
        lookup: 128 such keys took 144 us a round trip against 232 (three
        runs each, `NodeManager.contains` against a node child)."""
        m = self.cls.manager
        answer = m.host.answer
        out: list[int] = []
        asked: list[bytes] = []
        held = [0, 0, 0]  # answered here: miss (a failed fill), hit, hit_pending
        for nk in self._node_keys(keys):
            a = answer(nk)
            if a == 0:
                # Only the manager knows the lower tiers (and starts a promotion).
                asked.append(nk)
                out.append(_CODE.get(m.lookup(nk), 3))
            else:  # a block in the host tier, answered as the manager would
                code = _HELD_CODE[a]
                held[code] += 1
                out.append(code)
        counts = m.stats.lookups
        for n, name in zip(held, ("miss", "hit", "hit_pending")):
            if n:
                counts[name] += n
        if asked:
            m._core.scanned.difference_update(asked)
        return out

    def _unscan(self, nks: list[bytes]) -> None:
        """The lookups of ``nks`` (node keys) protect nothing until the
        class's step ends: a session pins what it will load instead, and an
        engine that never ends steps (SGLang) would otherwise keep every key
        it asked about from eviction until another engine's step end."""
        scanned = self.cls.manager._core.scanned
        if scanned:
            scanned.difference_update(nks)

    def load_present(self, keys: list[bytes], req: Any) -> list[list[int]]:
        """Each key's answer and host slot (-1 unless HIT), every key asked,
        in order; the HITs are pinned as loads of this session (given back
        by complete_load): a lookup and a prepare_load in one request, for
        an engine that loads whatever it finds (SGLang's prefetch)."""
        m = self.cls.manager
        host = m.host
        nks = self._node_keys(keys)
        out: list[list[int]] = []
        hits: list[bytes] = []
        for nk in nks:
            r = m.lookup(nk)
            if r is LookupResult.HIT:
                (slot,) = host.load_slots([nk])
                if slot >= 0:
                    hits.append(nk)
                    out.append([1, slot])
                    continue
                r = LookupResult.HIT_PENDING  # not readable as a host block yet
            out.append([_CODE.get(r, 3), -1])
        self._unscan(nks)
        if hits:
            self._pin_loads(hits, req)
        return out

    def prepare_load(self, keys: list[bytes], req: Any) -> list[int]:
        return self._pin_loads(self._node_keys(keys), req)

    def _pin_loads(self, nks: list[bytes], req: Any) -> list[int]:
        spec = self.cls.manager.prepare_load(nks, self._ctx(req))
        pins = self.load_pins
        for k in nks:
            pins[k] = pins.get(k, 0) + 1
        return spec.slots.tolist()  # type: ignore[no-any-return]

    def load_pinned(self, keys: list[bytes], req: Any) -> None:
        """:meth:`prepare_load` of keys this session's lookups pinned this
        step: the engine took their slots from the lookup's reply and did not
        wait for this one (a claim on a key it holds no pin of is refused)."""
        nks = self._node_keys(keys)
        if not self.scan_set.issuperset(nks):
            raise ProtocolError("load of keys this engine's lookups did not pin")
        self._pin_loads(nks, req)

    def complete_load(self, keys: list[bytes], req: Any) -> None:
        nks = self._node_keys(keys)
        pins = self.load_pins
        distinct = set(nks)
        if len(distinct) != len(nks):  # rare: a key twice in one load
            need = Counter(nks)
            if any(pins.get(k, 0) < n for k, n in need.items()):
                raise ProtocolError("complete_load of keys this engine does not hold")
        elif not pins.keys() >= distinct:
            raise ProtocolError("complete_load of keys this engine does not hold")
        for k in nks:
            n = pins[k] - 1
            if n:
                pins[k] = n
            else:
                del pins[k]
        self.cls.manager.complete_load(nks, self._ctx(req))

    def load_failed(self, slots: list[int]) -> None:
        """A worker's failed loads from ``slots``: their blocks are dropped,
        those of this engine's namespace only. vLLM reports a failure after
        the load's end, so the slot may hold another model's block by then
        (evicted and reused), and a slot named wrongly is a fault of this
        engine's: neither costs another model a block."""
        from kvtier.scheduler.specs import HostSpec

        cap = self.cls.pool.num_slots
        if any(not -1 <= s < cap for s in slots):
            raise ProtocolError("load_failed names slots outside the pool")
        owner, prefix = self.cls.manager.host.owner, self.prefix
        ours = [s for s in slots if s < 0 or (k := owner(s)) is None or k[:8] == prefix]
        self.cls.manager.load_failed(HostSpec(np.asarray(ours, np.int64)))

    def touch(self, keys: list[bytes]) -> None:
        self.cls.manager.touch(self._node_keys(keys))

    def prepare_store(self, keys: list[bytes], req: Any) -> tuple[Any, ...] | None:
        """(keys to store, their slots, evicted keys of this namespace) or
        None; with the shared index, and slots added to the reservation."""
        out = self.cls.manager.prepare_store(self._node_keys(keys), self._ctx(req))
        if out is None:
            return None
        self.writes.update(out.keys_to_store)
        evicted = self._ours(out.evicted_keys) if self.wants_events else []
        stored = [k[8:] for k in out.keys_to_store]
        if self.engine_index is None:
            return stored, out.store_spec.slots.tolist(), evicted
        more, gone = self.top_up()
        return stored, out.store_spec.slots.tolist(), evicted + gone, more

    def _ours(self, node_keys: list[bytes]) -> list[bytes]:
        """The keys of this namespace among ``node_keys``, prefix stripped."""
        return unprefixed(self.prefix, node_keys)

    def top_up(self) -> tuple[list[int], list[bytes]]:
        """Reserve slots for this engine's stores up to its reservation
        (evicting as a store would; grown as RESERVE says): the slots added
        and this namespace's evicted keys (for the engine to report with its
        next offer, if it takes KV events: vLLM reads them from no offer)."""
        m = self.cls.manager
        took = self._topped - len(self.reserved)  # stores take slots out, nothing else
        if 4 * took > self.reserve_to:
            self.reserve_to = min(RESERVE_MAX, max(self.reserve_to, 4 * took))
        # At most 1/32 of the class's slots: a small tier's blocks are not
        # all evicted to hold room for stores that may not come.
        n = min(self.reserve_to, self.cls.pool.num_slots // 32) - len(self.reserved)
        got = m.host.allocate(n, partial=True) if n > 0 else None
        if got is None:
            self._topped = len(self.reserved)
            return [], []
        slots, evicted = got
        m._core.removed(evicted)
        self.reserved.update(slots)
        self._topped = len(self.reserved)
        return slots, self._ours(evicted) if self.wants_events else []

    def stores(
        self, keys: list[bytes], slots: list[int], reqs: list[Any], counts: list[int]
    ) -> None:
        """Stores of this engine, in the order it began and ended them:
        ``counts[i]`` > 0, request ``reqs[i]`` began storing the next
        ``counts[i]`` keys into the next as many ``slots`` (of its
        reservation, written already without waiting); < 0, the writes of the
        next ``-counts[i]`` keys ended well. A begun offer's keys are
        adopted (adopt_store; chains are kept per request), its other slots
        freed when their writes end. One request for all a flush holds
        (STORES); STORE_BEGIN is one offer of it."""
        m = self.cls.manager
        host: Any = m.host
        if self._native_stores:
            m._check_open()
            state = (m._last_offer, m._miss_prev, self.reserved, self.writes, self.spare)
            got = adopt_stores(host._ix, self.prefix, keys, slots, reqs, counts, self.id, *state)
            if isinstance(got, str):
                raise ProtocolError(got)
            if got is not None:
                stored, ends, taken = got
                host.stored_again(stored)  # regret, on a node of several block sizes
                if taken:  # out of self.writes already
                    m.complete_store(ends, None, True)
                elif ends:
                    self._complete(ends, None, True)
                return None
            # else a key begun again after its end in this frame: in order, below
        if len(reqs) != len(counts) or sum(map(abs, counts)) != len(keys) or 0 in counts:
            raise ProtocolError("stores needs a nonzero count per request, one per key")
        if sum(n for n in counts if n > 0) != len(slots):
            raise ProtocolError("store_begin needs one slot per key")
        reserved = self.reserved
        if not reserved.issuperset(slots):
            raise ProtocolError("store_begin of slots not reserved for this engine")
        left = len(reserved) - len(slots)
        reserved.difference_update(slots)
        if len(reserved) != left:  # a slot named twice: all were reserved, they stay so
            reserved.update(slots)
            raise ProtocolError("store_begin needs one distinct slot per key")
        nks = self._node_keys(keys)
        if counts == [len(keys)]:  # one offer (STORE_BEGIN's)
            return self._adopt(nks, slots, [self._req(reqs[0])], counts)
        begun: list[bytes] = []
        done: list[bytes] = []
        ended: set[bytes] = set()  # a key begun after its end here needs the order
        ctxs, begins, i, again = [], [], 0, False
        for req, n in zip(reqs, counts):
            if n > 0:
                part = nks[i : i + n]
                again = again or (bool(ended) and not ended.isdisjoint(part))
                begun += part
                ctxs.append(self._req(req))
                begins.append(n)
            else:
                done += nks[i : i - n]
                ended.update(nks[i : i - n])
            i += abs(n)
        if not again:  # the begins, then the ends, a call each
            if begun:
                self._adopt(begun, slots, ctxs, begins)
            if done:
                self._complete(done, None, True)
            return None
        i = j = 0
        for req, n in zip(reqs, counts):  # in order: a key begun after its end is kept twice
            if n < 0:
                self._complete(nks[i : i - n], None, True)
            else:
                self._adopt(nks[i : i + n], slots[j : j + n], [self._req(req)], [n])
                j += n
            i += abs(n)
        return None

    def _adopt(
        self, nks: list[bytes], slots: list[int], ctxs: list[Any], counts: list[int]
    ) -> None:
        stored, _, unused = self.cls.manager.adopt_store(nks, slots, ctxs, counts)
        self.writes.update(stored)
        if unused:
            key_of = dict(zip(slots, nks))
            for s in unused:
                self.spare.setdefault(key_of[s], []).append(s)

    def complete_store(self, keys: list[bytes], req: Any, success: bool) -> None:
        self._complete(self._node_keys(keys), req, success)

    def _complete(self, nks: list[bytes], req: Any, success: bool) -> None:
        if self.spare:
            nks = self._free_spare(nks)
        if not self.writes.issuperset(nks):
            raise ProtocolError("complete_store of keys this engine is not writing")
        self.writes.difference_update(nks)
        self.cls.manager.complete_store(nks, self._ctx(req), success)

    def _free_spare(self, nks: list[bytes]) -> list[bytes]:
        """Writes into slots the node did not keep (their keys held already
        or refused) ended: the slots are free again. Returns the other keys."""
        spare, rest = self.spare, []
        for k in nks:
            held = spare.get(k)
            if not held:
                rest.append(k)
                continue
            self.cls.manager.host.release_slot(held.pop())
            if not held:
                del spare[k]
        return rest

    def request_finished(self, req: Any) -> None:
        self.cls.manager.on_request_finished(self._ctx(req))

    def step_end(self, finished: list[Any], loaded: list[int]) -> list[Any]:
        """Requests ``finished`` since the last step end are done; blocks in
        slots ``loaded`` (through the shared index, no lease here) are used
        and counted. Release this step's lookup pins, run the class's step
        end, and hand over this engine's events (oldest first), whether the
        class has work in flight, and its blocks held (every engine's)."""
        m = self.cls.manager
        if finished:
            m.on_requests_finished([(self.id, r) for r in finished])
        if loaded:
            if self.engine_index is None:
                raise ProtocolError("loads through a shared index this engine was not given")
            # A slot evicted and reused since holds a block stored since:
            # most recently used already, touched again, no harm.
            try:
                m.host.touch_slots(loaded)  # type: ignore[attr-defined]
            except (InvalidArgument, TypeError):  # none touched; TypeError: past int64
                # (It checks the range itself: a min and a max here were 2.5%.)
                raise ProtocolError("step_end names loaded slots outside the pool") from None
            m.stats.loads += len(loaded)
            m.stats.loaded_from["host"] = m.stats.loaded_from.get("host", 0) + len(loaded)
        self._release_scan()
        self.cls.manager.on_schedule_end()
        self.cls.distribute_events()
        ev, self.events = self.events, []
        out = [ev, self.cls.manager.has_pending_work(), len(self.cls.manager.host)]
        if self.engine_index is not None:
            out += self.top_up()  # the slots added, this namespace's evicted keys
        return out

    def reset(self) -> int:
        """Drop every block of this namespace that no engine holds (vLLM's
        reset_prefix_cache: e.g. after new weights). Returns how many."""
        self._release_scan()
        host = self.cls.manager.host
        gone = [k for k, e in host.entries.items() if k[:8] == self.prefix and e.evictable]
        for k in gone:
            host.drop(k)
        self.cls.manager._core.removed(gone)
        self.cls.distribute_events()
        return len(gone)

    # -- leases ----------------------------------------------------------
    def _release_scan(self) -> None:
        if self.scan_pins:
            self.cls.manager.complete_load(self.scan_pins)
            self.scan_pins = []
            self.scan_set.clear()

    def release_all(
        self, writers: list[int] | tuple[()] = (), misbehaved: bool = False, hold: bool = True
    ) -> dict[str, int]:
        """Give back what this session holds (its engine exited or was killed).
        Writes it never completed are dropped, never made readable; slots it may
        still write are held until ``writers`` (its workers' pidfds) exit too;
        ``misbehaved``: the node closed it for bad input (its hold may go
        first past the quarantine's cap). ``hold`` False: the node is stopping
        and holds nothing (a node started over its region waits out its adopt
        grace instead), so it does not warn of holds past the cap."""
        released = {
            "scan_pins": len(self.scan_pins),
            "load_pins": sum(self.load_pins.values()),
            "writes": len(self.writes),
        }
        if self.engine_index is not None and self.cls.shared is not None:
            released["shared_pins"] = self.cls.shared.unpin_all(self.engine_index)
        m = self.cls.manager
        done: list[bytes] = []
        torn: list[bytes] = []
        for k in self.writes:  # finished in the shared index: whole (said once its bytes are in)
            (done if self._finished(k) else torn).append(k)
        # Slots it may still be writing: held a while (node/quarantine.py).
        spare = [s for held in self.spare.values() for s in held]
        writing = [e.slot for k in torn if (e := m.host.get(k)) is not None]
        cap = self.cls.pool.num_slots // 8
        slots = [*writing, *self.reserved, *spare]
        if hold:
            q = self.cls.quarantine
            q.hold(m.host, slots, cap, writers, self.engine, misbehaved, self.started)
        else:
            for fd in writers:
                os.close(fd)
        self._release_scan()
        if self.load_pins:
            m.complete_load([k for k, n in self.load_pins.items() for _ in range(n)])
            self.load_pins.clear()
        if done:
            m.complete_store(done, None, True)
        if torn:
            m.complete_store(torn, None, False)
        self.writes.clear()
        for s in [*self.reserved, *spare]:
            m.host.release_slot(s)
        released["reserved"] = len(self.reserved)
        self.reserved.clear()
        self.spare.clear()
        self.cls.sessions.discard(self)
        self.cls.events_wanted()
        m.on_schedule_end()
        self.cls.distribute_events()
        return released

    def _finished(self, nk: bytes) -> bool:
        """Whether the block of node key ``nk`` is ready in the shared
        index (its writer finished it there)."""
        shared = self.cls.shared
        e = self.cls.manager.host.get(nk) if shared is not None else None
        return e is not None and shared.state(e.slot) == 2

    def leases(self) -> dict[str, int]:
        out = {
            "scan_pins": len(self.scan_pins),
            "load_pins": sum(self.load_pins.values()),
            "writes": len(self.writes),
        }
        if self.engine_index is not None and self.cls.shared is not None:
            # Slots this engine pins in the shared index itself (its
            # lookups' and loads' pins there, counted once per slot).
            out["shared_slots"] = self.cls.shared.engine_pins(self.engine_index)
        return out
