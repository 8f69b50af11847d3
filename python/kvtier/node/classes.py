"""The node's slot classes: one per block size, each its view of the
node's region, its host tier and lower tiers under one manager, the
sessions of the engines that store blocks of that size, and the shared
index those engines read without a round trip.

Process: the node (``kvtier node``). Who calls: :mod:`kvtier.node.server`
(building a class at an engine's first HELLO of a block size) and the
sessions of :mod:`kvtier.node.state`, from the node's one event-loop
thread; nothing here blocks but creating a class's shared index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier._native import unprefixed
from kvtier.node.chunks import ChunkOwner, Region, chunked_host_tier
from kvtier.node.quarantine import Quarantine
from kvtier.pool import HostPool
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.base import LowerTier

if TYPE_CHECKING:
    from kvtier.node.state import Session

log = logging.getLogger("kvtier.node")


@dataclass
class SlotClass:
    """The pool, host tier and lower tiers of one block size."""

    payload_bytes: int
    pool: HostPool
    manager: TieredOffloadingManager
    sessions: set[Session] = field(default_factory=set)
    # The shared index engines read without a round trip, in its own small
    # shared-memory file (open_shared_index); None: engines ask the node.
    index_pool: HostPool | None = None
    shared: Any = None
    # The (session, request) of the last scan: the manager's scan hints
    # (a MISS's parent is the HIT before it) must not chain one request's
    # MISS to another's HITs, another engine's least of all.
    last_scan: Any = None
    quarantine: Quarantine = field(default_factory=Quarantine)  # a dead engine's slots

    @property
    def name(self) -> str:
        return f"class-{self.payload_bytes}"

    def open_shared_index(self, name: str) -> None:
        """Give engines this class's host index in shared memory (named
        ``name``): its blocks are published there as they are added. Only
        over the native host index (LRU), before any block is added; other
        tiers keep round trips."""
        from kvtier._native import SharedIndex
        from kvtier.tiers.host_native import NativeHostTier

        host = self.manager.host
        if not isinstance(host, NativeHostTier) or len(host):
            return
        n = self.pool.num_slots
        remove_dead_indexes(name.rpartition("-")[0] + "-")
        self.index_pool = HostPool(1, SharedIndex.bytes_for(n), name=name)
        self.shared = SharedIndex.create(self.index_pool.native, n)
        host.mirror_into(self.shared)

    def engine_index(self) -> int | None:
        """The lowest engine index no session of this class holds (its
        pin bit in the shared index); None when all 32 are taken."""
        used = {s.engine_index for s in self.sessions}
        return next((i for i in range(32) if i not in used), None)

    def events_wanted(self) -> None:
        """The class's manager makes host events only while an attached
        engine takes them (the options are read at each call)."""
        m = self.manager
        want = any(s.wants_events for s in self.sessions)
        if m.options.events != want:
            m.options = m._core.options = dataclasses.replace(m.options, events=want)

    def distribute_events(self) -> None:
        """Hand the manager's events to the sessions of the namespace each
        key belongs to (prefix stripped); removals named only by event id
        (the disk tier's) go to every session of the class."""
        events = self.manager.take_events()
        if not events or not self.sessions:
            return
        prefixes = {s.prefix for s in self.sessions if s.wants_events}
        if not prefixes:  # no engine takes them (vLLM's default)
            return
        only = next(iter(prefixes)) if len(prefixes) == 1 else None
        for e in events:
            if e.ids:
                for s in self.sessions:
                    s.add_event(e.tier, e.removed, [], list(e.ids), e.metadata_only)
            if not e.keys:
                continue
            if only is not None:  # a dict of lists was a tenth of the node's time (cProfile)
                by_ns = {only: unprefixed(only, e.keys)}
            else:
                by_ns = {}
                for k in e.keys:
                    by_ns.setdefault(k[:8], []).append(k[8:])
            for s in self.sessions:
                keys = by_ns.get(s.prefix)
                if keys:
                    s.add_event(e.tier, e.removed, keys, [], e.metadata_only)

    def occupancy(self) -> dict[str, int]:
        occ = self.manager.occupancy()
        host = self.manager.host
        occ["capacity"] = int(host.capacity or 0)
        if isinstance(host, ChunkOwner):
            occ.update(host.region.occupancy(host))
        return occ


def remove_dead_indexes(prefix: str) -> None:
    """Removes the index files named ``prefix`` + a pid of nodes that died
    without removing them (SIGKILL, OOM). An engine that still maps one
    keeps its mapping until it sees its node gone; a file of a live
    process is left alone."""
    for f in Path("/dev/shm").glob(f"{prefix}*"):
        pid = f.name[len(prefix) :]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                f.unlink()
                log.info("kvtier node: removed %s (its node is gone)", f.name)
        except PermissionError:  # another user's live process
            continue


def build_class(
    payload_bytes: int,
    slot_bytes: int,
    region: Region,
    host_options: Any,
    lower: list[LowerTier],
) -> SlotClass:
    """A slot class: its view of the region (slots of ``slot_bytes``), its
    host tier (slots a chunk at a time, as it needs room) and a manager
    over them."""
    pool = region.view(slot_bytes)
    host = chunked_host_tier(pool, host_options, region)
    manager = TieredOffloadingManager(host, lower, promote=True)
    host.on_evicted = manager._core.removed
    return SlotClass(payload_bytes, pool, manager)
