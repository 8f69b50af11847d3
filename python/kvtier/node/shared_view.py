"""An engine's view of the node's shared index (csrc/core/node/shared_index.h):
its scans find and pin HITs there without a round trip, its loads of them
keep the pins until complete_load, the step's end drops the rest.

Process: the engine's scheduler. Who calls: :class:`~kvtier.node.client.
NodeManager`, under its lock, when the node offered an index at HELLO.
Nothing here blocks (atomics on a shared mapping; opening maps a small
file). The node never sees these pins: they are this engine's bits in the
index, cleared by the node when the engine's connection closes.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier._native import key_digests
from kvtier.errors import KvtierError
from kvtier.pool import HostPool

log = logging.getLogger("kvtier.node")
# Digests kept for keys seen lately: a key is digested for its scan, its
# store and its return's scan; a dict hit costs 0.05 us a key, the native
# blake2b 0.3 (hashlib's from Python 1.2).
_MEMO_KEYS = 1 << 16


class SharedView:
    """The index mapped by one engine: ``prefix`` (its namespace's 8 bytes,
    as the node keys its blocks), ``lower``: whether the node has lower
    tiers to ask after a MISS here."""

    def __init__(self, pool: HostPool, index: Any, prefix: bytes, lower: bool) -> None:
        self.pool = pool
        self.index = index
        self.prefix = prefix
        self.lower = lower
        self.scan_pins: dict[int, int] = {}  # this step's lookup pins, by slot
        self.hits: set[bytes] = set()  # keys this step's scans found here
        self.loads: dict[bytes, list[int]] = {}  # key -> slots of its loads
        self.writing: dict[bytes, int] = {}  # key -> slot of this engine's stores
        self.reserved: list[int] = []  # free slots the node keeps for our stores
        self.evicted: list[bytes] = []  # evicted to fill them, not reported yet
        self._memo: dict[bytes, bytes] = {}  # key -> its digest here

    @classmethod
    def open(cls, ix: Any, prefix: bytes) -> SharedView | None:
        """The view HELLO's ``ix`` names (None when it names none or it
        cannot be mapped: the engine asks the node, as without one)."""
        if not isinstance(ix, dict):
            return None
        from kvtier._native import SharedIndex

        try:
            pool = HostPool.attach(str(ix["name"]))
            index = SharedIndex.attach(pool.native, int(ix["engine"]))
        except (KvtierError, KeyError, ValueError) as e:
            log.warning("kvtier: the node's shared index is not usable (%s): asking the node", e)
            return None
        return cls(pool, index, prefix, bool(ix.get("lower", True)))

    def close(self) -> None:
        """Unmap (the node is gone or the engine stops: its pins die with the
        connection, not here)."""
        self.scan_pins.clear()
        self.hits.clear()
        self.loads.clear()
        self.writing.clear()
        self.reserved.clear()
        self.evicted.clear()
        self.pool.close()

    def digests(self, keys: list[bytes]) -> bytes:
        """The keys' digests as the node indexes them, joined."""
        memo = self._memo
        out = list(map(memo.get, keys))
        if None in out:
            new = [k for k, d in zip(keys, out) if d is None]
            got = key_digests(new, self.prefix)
            if len(memo) + len(new) > _MEMO_KEYS:
                memo.clear()
            memo.update(zip(new, (got[i : i + 16] for i in range(0, len(got), 16))))
            out = list(map(memo.__getitem__, keys))
        return b"".join(out)  # type: ignore[arg-type]

    def scan(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """(code, slot) per key up to and including the first MISS: 0 MISS,
        1 HIT (pinned until it is loaded or the step ends), 2 HIT_PENDING."""
        out: list[tuple[int, int]] = self.index.lookup(self.digests(keys))
        pins = self.scan_pins
        for k, (_, slot) in zip(keys, out):
            if slot >= 0:
                pins[slot] = pins.get(slot, 0) + 1
                self.hits.add(k)
        return out

    def take_loads(self, keys: list[bytes], slots: dict[bytes, int]) -> list[bytes] | None:
        """The keys of ``keys`` found here, their lookup pins now their
        loads' (``slots``: each key's slot); None, changing nothing, when a
        key's lookup pin was taken by an earlier load of this step."""
        hits, pins = self.hits, self.scan_pins
        mine = [k for k in keys if k in hits]
        need: dict[int, int] = {}
        for k in mine:
            need[slots[k]] = need.get(slots[k], 0) + 1
        if any(pins.get(s, 0) < n for s, n in need.items()):
            return None
        for s, n in need.items():
            left = pins[s] - n
            if left:
                pins[s] = left
            else:
                del pins[s]
        for k in mine:
            self.loads.setdefault(k, []).append(slots[k])
        return mine

    def pin_present(self, keys: list[bytes]) -> list[int] | None:
        """Each key's slot, every key found ready here and pinned for its
        load until :meth:`complete` (a load of keys this step's scans did not
        find: blocks stored since); None, pinning nothing, unless all are."""
        out = self.index.lookup(self.digests(keys), False)
        slots = [slot for _, slot in out]
        if all(code == 1 for code, _ in out):
            for k, s in zip(keys, slots):
                self.loads.setdefault(k, []).append(s)
            return slots
        held = [s for s in slots if s >= 0]
        if held:
            self.index.unpin(held)
        return None

    def store_from_reserve(
        self, keys: list[bytes]
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """An offer stored into reserved slots: the keys to store (not
        here yet, each once, in order), their slots, and keys evicted since
        the last report; None, taking nothing, when the reservation is short
        (ask the node). Admission is the node's: it frees the slot of a key
        it refuses when its write ends."""
        states = self.index.states(self.digests(keys))
        seen: set[bytes] = set()
        new: list[bytes] = []
        for k, st in zip(keys, states):
            if st == 0 and k not in seen:
                seen.add(k)
                new.append(k)
        if len(new) > len(self.reserved):
            return None
        slots = [self.reserved.pop() for _ in new]
        self.writing.update(zip(new, slots))
        evicted, self.evicted = self.evicted, []
        return new, slots, evicted

    def finish(self, keys: list[bytes], success: bool) -> None:
        """This engine's stores of ``keys`` ended: when they succeeded, their
        blocks are ready here now (their bytes are complete; the node's
        COMPLETE_STORE follows), so any engine may load them at once."""
        writing = self.writing
        slots = [s for s in (writing.pop(k, -1) for k in keys) if s >= 0]
        if success and slots:
            self.index.finish_writes(slots)

    def complete(self, keys: list[bytes]) -> list[bytes]:
        """Loads of ``keys`` done: those loaded through this view unpinned;
        returns the others (loads the node pinned), in order."""
        loads = self.loads
        if not loads:
            return keys
        done: list[int] = []
        rest: list[bytes] = []
        for k in keys:
            held = loads.get(k)
            if held is None:
                rest.append(k)
                continue
            done.append(held.pop())
            if not held:
                del loads[k]
        if done:
            self.index.unpin(done)
        return rest

    def end_step(self) -> None:
        """The step's lookup pins that no load took end."""
        self.hits.clear()
        pins = self.scan_pins
        if pins:
            self.index.unpin([s for s, n in pins.items() for _ in range(n)])
            pins.clear()
