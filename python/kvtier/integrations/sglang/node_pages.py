"""SGLang HiCache shim: the pages of one SGLang host pool kept by a kvtier
node (``kvtier_node`` in the extra config) instead of tiers of the rank's own.

The node owns the host memory, the index and policy, and the disk and
Redis tiers of every engine on the machine (vLLM and SGLang alike); this
rank maps the node's pool and copies each page between SGLang's host pool
and a node slot itself, with one native copy job per batch: one copy, no
staging pool of its own. A store asks the node for slots (leased to this
rank until it says the copy ended), a load pins the pages it found until
its copy ended, so another engine cannot evict a page being read or read
one being written. Pages of different models, layouts or ranks never meet:
the node keys them under this pool's namespace
(:func:`~kvtier.integrations.sglang.config.storage_namespace`).

A node that is gone is the same degradation as a failed Redis: pages are
absent, stores fail (both counted, nothing raised), and the backend attaches
again by itself once the node answers with the same pool.

Runs in each SGLang scheduler process (one per TP/PP rank). Who calls:
:class:`kvtier.integrations.sglang.storage.KVTierStorage`, from SGLang's
storage threads, possibly at once: the node connection is used under one
short lock, the copies run outside it. Every public method blocks until its
pages moved; results are per page, in the order of the keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.integrations.sglang.mover import PageCopies
from kvtier.integrations.sglang.pages import PagePlan
from kvtier.tiers.base import LookupResult

_HIT, _PENDING, _RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY
# A page's key at the node: SGLang's key and a 4-byte chain tag of zeros, so
# that the node chains the consecutive pages of a store (its prefix-aware
# eviction takes a prefix's tail first), as it chains a vLLM group's blocks.
_CHAIN = bytes(4)
#: How long a load waits for pages the node is still reading from its disk
#: or Redis tier (HIT_PENDING) before it loads the prefix it has.
PENDING_WAIT_S = 2.0


class NodePageMover(PageCopies):
    """Pages of one SGLang host pool (``plan``) to and from the node at
    ``path``, under ``namespace``. ``writes``: this rank stores (an MLA rank
    that is not the writer only reads: another rank's pages serve it).
    Raises :class:`~kvtier.node.client.NodeUnavailable` when no node answers
    at construction, :class:`~kvtier.errors.InvalidArgument` when it serves
    no more block sizes. Closing detaches (the node keeps the pages)."""

    def __init__(
        self,
        plan: PagePlan,
        path: str,
        namespace: str,
        engine: str,
        writes: bool = True,
        pending_wait_s: float = PENDING_WAIT_S,
    ) -> None:
        from kvtier.engine import Engine
        from kvtier.node.client import NodeManager

        self.plan = plan
        self.writes = writes
        self.pending_wait_s = pending_wait_s
        # SGLang asks, it is not told: no KV events.
        self.node = NodeManager(path, namespace, plan.page_bytes, engine=engine, events=False)
        self._lock = threading.Lock()  # the node connection, the copies' results
        self._copied: dict[int, bool] = {}
        try:
            self.pool = self.node.attach_pool()
            self.slot_bytes = self.pool.slot_bytes
            # Host copies on two threads; the pool and SGLang's tensor are its
            # regions, and its budget holds every slot at once.
            self.copier = Engine(2, [(self.pool.nbytes + 1, False)])
            self.copier.register_memory(plan.base, plan.nbytes, owner=plan.buffer)
            self.copier.register_pool(self.pool)
            # Its pages in this process's page tables now, not at the first
            # copies (a restarted engine's first loads: HostPool.populate).
            self.populating = self.pool.populate_in_background()
        except BaseException:
            self.node.shutdown()
            raise
        self.counters = dict.fromkeys(
            ("pages_stored", "pages_loaded", "store_failures", "load_failures", "copy_failures"), 0
        )
        self._closed = False

    # -- the node, under the lock ------------------------------------------------
    def _reattach(self) -> None:
        """Ask a node that went away again (at most once a second: the
        client's step end does). SGLang subscribes to no events: dropped."""
        if not self.node.attached:
            self.node.on_schedule_end()
            self.node.take_events()

    def _pin(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Pins the pages of ``keys`` the node holds for loading, in one
        round trip: (their positions, their slots). Pages the node is still
        reading from a lower tier are asked for again (the lock let go
        meanwhile), for at most ``pending_wait_s``; then it loads what it has."""
        deadline = time.monotonic() + self.pending_wait_s
        hits: dict[int, int] = {}
        ask = list(range(len(keys)))
        while ask:
            with self._lock:
                self._reattach()
                answers = self.node.load_present([keys[i] for i in ask])
            for i, (a, slot) in zip(ask, answers):
                if a is _HIT:
                    hits[i] = slot
            ask = [i for i, (a, _) in zip(ask, answers) if a is _PENDING or a is _RETRY]
            if not ask or time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        pos = sorted(hits)
        return pos, [hits[i] for i in pos]

    def _unpin(self, keys: list[bytes]) -> None:
        if keys:
            with self._lock:
                self.node.complete_load(keys)

    # -- copies, outside the lock -----------------------------------------------
    def _copy(self, pages: np.ndarray, slots: Sequence[int], to_slots: bool) -> bool:
        """Copy between SGLang's pages at ``pages`` and node ``slots``; True
        when every copy succeeded. Blocks."""
        addr = self.pool.address + np.asarray(slots, np.int64) * self.slot_bytes
        descs = self.plan.descriptors(pages, addr, to_slots)
        return self._copy_wait(self._copy_submit(descs))

    # -- pages ----------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: does the node hold it (in memory, or in a lower tier it
        is reading from now)? One round trip; nothing pinned."""
        nks = [bytes(k) + _CHAIN for k in keys]
        with self._lock:
            self._reattach()
            answers = self.node.contains(nks)
        return [a is _HIT or a is _PENDING for a in answers]

    def store(self, keys: Sequence[bytes], pages: np.ndarray) -> list[bool]:
        """Write the pages at addresses ``pages`` as ``keys`` into node slots;
        per key True when the node holds it now (it did already, or this
        write succeeded). Blocks until copied."""
        if not self.writes:  # another rank writes these pages
            return [True] * len(keys)
        nks = [bytes(k) + _CHAIN for k in keys]
        ok = [False] * len(keys)
        with self._lock:
            self._reattach()
            out = self.node.prepare_store(nks)
            stored = out.keys_to_store if out is not None else []
            slot_of = dict(zip(stored, out.store_spec.slots.tolist())) if out is not None else {}
            # Offered again (SGLang backs a prefix up more than once): held
            # already, or refused for want of room; one round trip says which.
            rest = [i for i, k in enumerate(nks) if k not in slot_of]
            if rest and self.node.attached:
                for i, a in zip(rest, self.node.contains([nks[i] for i in rest])):
                    ok[i] = a is _HIT or a is _PENDING
        if stored:
            pos = [i for i, k in enumerate(nks) if k in slot_of]
            first: dict[bytes, int] = {}
            for i in pos:
                first.setdefault(nks[i], i)
            order = list(first.values())
            copied = self._copy(pages[order], [slot_of[nks[i]] for i in order], True)
            with self._lock:
                self.node.complete_store(stored, success=copied)
            if copied:
                for i in pos:
                    ok[i] = True
        self._count("pages_stored", sum(ok), "store_failures", len(ok) - sum(ok))
        return ok

    def load(self, keys: Sequence[bytes], pages: np.ndarray) -> list[bool]:
        """Read ``keys`` into the pages at addresses ``pages``: per key True
        when the node held it and its bytes were copied in; a page it does
        not hold is False and its page in the pool untouched. Blocks."""
        nks = [bytes(k) + _CHAIN for k in keys]
        ok = [False] * len(keys)
        hits, slots = self._pin(nks)
        if hits:
            try:
                copied = self._copy(pages[hits], slots, False)
            finally:
                self._unpin([nks[i] for i in hits])
            if copied:
                for i in hits:
                    ok[i] = True
        self._count("pages_loaded", sum(ok), "load_failures", len(ok) - sum(ok))
        return ok

    def read_slot(self, key: bytes) -> np.ndarray | None:
        """One page's bytes (a copy), None when the node does not hold it.
        Blocks. For the key-value fallbacks (SGLang's generic path)."""
        nk = bytes(key) + _CHAIN
        hits, slots = self._pin([nk])
        if not hits:
            return None
        try:
            data: np.ndarray = self.pool.view(slots[0])[: self.plan.page_bytes].copy()
        finally:
            self._unpin([nk])
        return data

    def write_slot(self, key: bytes, data: np.ndarray) -> bool:
        """Store one page given as bytes (SGLang's generic path: one copy in
        Python). Blocks."""
        if not self.writes:
            return True
        nk = bytes(key) + _CHAIN
        with self._lock:
            self._reattach()
            out = self.node.prepare_store([nk])
            if out is None:
                return False
            if not out.keys_to_store:  # held already, or not admitted
                return self.node.contains([nk])[0] in (_HIT, _PENDING)
            slot = int(out.store_spec.slots[0])
        self.pool.view(slot)[: self.plan.page_bytes] = data
        with self._lock:
            self.node.complete_store([nk])
        return True

    def clear(self, wipe: Callable[[Any], None] | None = None) -> None:
        """Drop this namespace's pages from the node's memory (those no
        engine is reading or writing). The node's disk and Redis tiers keep
        theirs: they are the node's, shared with every engine of the
        namespace. ``wipe`` is for tiers of the rank's own: unused. Blocks."""
        with self._lock:
            self.node.reset_cache()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            cs = self.node.client_stats
            return {
                "page_bytes": self.plan.page_bytes,
                "node": self.node.path,
                "attached": self.node.attached,
                **self.counters,
                "node_down_lookups": cs.node_down_lookups,
                "node_dropped_stores": cs.node_dropped_stores,
                "node_failures": cs.node_failures,
                "reattaches": cs.reattaches,
                "round_trips": cs.round_trips,
            }

    def close(self) -> None:
        """Detach from the node (it releases whatever this rank still
        leases) and close the copy engine. Blocks; idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self.node.shutdown()
            self.copier.close()
            self.pool.close()
