"""The node's host memory: one shared-memory region for every block size,
divided between them by use.

Process: the node. Who calls: :mod:`kvtier.node.server` (the region, one
tier per block size) and, through each block size's manager, its host tier;
all on the node's one thread. Nothing blocks.

The region is cut into chunks of equal size. Each block size (a *slot
class*) sees the whole region as slots of its own size (a view of the pool:
engines map it and copy into those slots) and may use the slots that lie
wholly inside chunks it owns, so the block sizes never overlap. A class
gets a free chunk when it needs room. When none is free, memory goes where
it would have saved the most: each class remembers the keys it evicted last
(a ghost list), and a store of one of them is *regret*, bytes that more
memory would have kept. A class that needs room takes a chunk from the
class with the least regret, if that is a quarter of its own or less
(evicting that chunk's blocks, provided none of them is in use); otherwise
it evicts its own, as a tier of fixed size does. A class without a chunk
gets one whatever its regret (it has nothing to evict yet). Regret is halved
each time a region's worth has been counted. ``bench/node_memory_split.py``
(two models' multi-turn streams, hit bytes against a fixed even split,
medians of 3): 1.52x when one model is nearly idle, 1.05x when the
large-block model needs a quarter of the memory, 0.97-1.00x where the even
split is about the best fixed one (bench/results/node-memory/). The bytes stored
and loaded as the measure of use instead moved memory to whoever stored most
and churned: 0.68x on a workload where the even split is near the best. The
ghost list spans 4 chunks: a class whose working set exceeds what it holds by
more than that sees no regret and does not grow (it evicts its own). A chunk
loses at most one block's bytes to a block size that does not divide it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.options.tiers import HostOptions
from kvtier.pool import HostPool
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_native import NativeHostTier

#: The default chunk: what one block size gives up or gets at a time.
CHUNK_BYTES = 64 << 20
#: At least this many chunks in a region (smaller chunks for a small node).
MIN_CHUNKS = 16
# Blocks of a class whose chunk is looked at before it gives up none: the
# least recently used ones, so the chunk it gives is a cold one.
_RECLAIM_SCAN = 256
# A class takes a chunk from another only when its regret is this many
# times the other's: chunks do not go back and forth between near equals
# (margins of 1-2 moved hundreds of chunks a run, each move evicting a
# chunk's blocks, hot ones included: bench/results/node-memory/).
_MARGIN = 4
# The keys a class remembers having evicted: as many as this many chunks
# hold of its blocks (its regret is then what that much more memory would
# have kept), at most _GHOST_MAX.
GHOST_CHUNKS = 4
_GHOST_MAX = 1 << 16


def chunk_bytes_for(region_bytes: int, wanted: int = CHUNK_BYTES) -> int:
    """The chunk size of a region of ``region_bytes``: ``wanted``, smaller
    for a region of fewer than :data:`MIN_CHUNKS` such chunks; 4 KiB-aligned."""
    c = min(wanted, region_bytes // MIN_CHUNKS)
    return max(4096, c // 4096 * 4096)


class Region:
    """The chunks of the node's region (``pool``: the region as created, one
    header slot per chunk) and the tiers that own them."""

    def __init__(self, pool: HostPool, regret: bool = True) -> None:
        self.pool = pool
        # Whether its tiers count regret (remember what they evicted): only
        # where another block size may come to share it. The ghost list's
        # upkeep was 4% of the node's time with one size (cProfile, bench
        # manager --node --shared-index, 16 keys a call).
        self.counts_regret = regret
        self.chunk_bytes = pool.slot_bytes
        self.owner: list[ChunkOwner | None] = [None] * pool.num_slots
        self._free = list(range(pool.num_slots - 1, -1, -1))  # chunk 0 first
        self.tiers: list[ChunkOwner] = []
        self._moved = 0.0  # bytes of regret counted since the last halving
        self.reassigned = 0  # chunks taken from one block size for another
        # Left by an earlier node (open_region): engines' copies prepared
        # against that node may still land in its chunks or read them.
        self.adopted = False
        # No chunk is handed out before this (time.monotonic()): an adopted
        # region's, for the grace a dead engine's slots get (the server's).
        self.closed_until = 0.0

    @property
    def bytes(self) -> int:
        return self.pool.num_slots * self.chunk_bytes

    def view(self, slot_bytes: int) -> HostPool:
        """The region as slots of ``slot_bytes`` (a block size's pool)."""
        if slot_bytes > self.chunk_bytes:
            raise InvalidArgument(
                f"a block of {slot_bytes} B is larger than the node's chunks of "
                f"{self.chunk_bytes} B: start it with a larger --chunk-bytes"
            )
        return HostPool.attach(self.pool.name, slot_bytes=slot_bytes)

    def regret(self, tier: ChunkOwner, nbytes: int) -> None:
        """``tier`` stored again ``nbytes`` of blocks it had evicted: decayed
        by halving every region's worth counted."""
        tier.regret += nbytes
        self._moved += nbytes
        if self._moved > self.bytes:
            self._moved /= 2
            for t in self.tiers:
                t.regret /= 2

    def grow(self, tier: ChunkOwner, short: int) -> None:
        """Give ``tier`` chunks until it has ``short`` more free slots, free
        chunks first, then chunks of tiers with far less regret (see the
        module); stops when none can be had, and gives none while the
        region is closed (adopted from a node that died, for its grace)."""
        if self.closed_until and time.monotonic() < self.closed_until:
            return
        while short > 0:
            c = self._free.pop() if self._free else self._reclaim_for(tier)
            if c is None:
                return
            self.owner[c] = tier
            tier.chunks.add(c)
            slots = tier.slots_of(c)
            tier.add_free(slots)
            short -= len(slots)

    def _reclaim_for(self, tier: ChunkOwner) -> int | None:
        mine = tier.regret
        if mine <= 0 and tier.chunks:
            return None  # nothing says more room would have helped: it evicts its own
        for other in sorted(self.tiers, key=lambda t: t.regret):
            if other is tier or len(other.chunks) <= 1:
                continue
            # A class without a chunk gets one whatever its regret: it can
            # have none until it holds blocks to evict.
            if tier.chunks and other.regret * _MARGIN >= mine:
                return None
            c = other.give_chunk()
            if c is not None:
                self.reassigned += 1
                return c
        return None

    def status(self) -> dict[str, int | str]:
        """The region as ``kvtier node status`` shows it."""
        return {
            "pool": self.pool.name,
            "chunks": len(self.owner),
            "chunk_bytes": self.chunk_bytes,
            "free_chunks": len(self._free),
            "reassigned": self.reassigned,
        }

    def occupancy(self, tier: ChunkOwner) -> dict[str, int]:
        return {"chunks": len(tier.chunks), "chunk_bytes": self.chunk_bytes}


class ChunkOwner(HostTier):
    """A block size's host tier over its view of the :class:`Region`: it
    starts with no slots and gets them a chunk at a time as it needs room.
    The chunks' part of either host tier: :class:`ChunkedHostTier` (the
    Python tier, every policy) and :class:`NativeChunkedHostTier` (the
    native index, LRU); :func:`chunked_host_tier` picks."""

    def _init_chunks(self, region: Region) -> None:
        """Called by the subclass's ``__init__`` once its tier exists (with
        no free slot yet)."""
        self.region = region
        self.chunks: set[int] = set()
        self.regret = 0.0
        slot = self.pool.slot_bytes  # type: ignore[union-attr]
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._ghost_max = max(1, min(_GHOST_MAX, GHOST_CHUNKS * region.chunk_bytes // slot))
        # Who is told of blocks evicted to give a chunk away (the manager's
        # removal events): set by the node once the manager exists.
        self.on_evicted: Callable[[list[bytes]], None] = lambda keys: None
        region.tiers.append(self)

    # The free list and held slots, as each tier keeps them.
    def _free_list(self) -> list[int]:
        raise NotImplementedError

    def _set_free(self, slots: list[int]) -> None:
        raise NotImplementedError

    def _is_held(self, slot: int) -> bool:
        raise NotImplementedError

    def _coldest(self, n: int) -> list[bytes]:
        """The ``n`` least recently used ready keys (or fewer)."""
        raise NotImplementedError

    def slots_of(self, chunk: int) -> list[int]:
        """This view's slots wholly inside ``chunk``."""
        c, s = self.region.chunk_bytes, self.pool.slot_bytes  # type: ignore[union-attr]
        lo, hi = -(-chunk * c // s), (chunk + 1) * c // s
        return list(range(lo, min(hi, self.capacity or 0)))

    def add_free(self, slots: Iterable[int]) -> None:
        self._set_free(self._free_list() + sorted(slots, reverse=True))

    def allocate(
        self, n: int, protected: Iterable[bytes] = (), partial: bool = False
    ) -> tuple[list[int], list[bytes]] | None:
        short = n - self.free_slots
        if short > 0:
            self.region.grow(self, short)
        got = super().allocate(n, protected, partial)
        if got is not None and got[1] and self.region.counts_regret:
            self._forget(got[1])
        return got

    def _forget(self, evicted: list[bytes]) -> None:
        """Remember ``evicted``; trimmed by :meth:`_trim` once the store
        that evicted them has been checked (it may bring back the oldest)."""
        ghost = self._ghost
        for k in evicted:
            ghost[k] = None

    def _trim(self) -> None:
        ghost = self._ghost
        while len(ghost) > self._ghost_max:
            ghost.popitem(last=False)

    def add_writing_many(
        self, keys: list[bytes], slots: list[int], parents: list[bytes | None] | None = None
    ) -> None:
        self.stored_again(keys)
        super().add_writing_many(keys, slots, parents)

    def stored_again(self, keys: list[bytes]) -> None:
        """``keys`` are being stored (not resident before): those this tier
        evicted lately count as regret. Called by :meth:`add_writing_many`,
        and by the node's native store path after it added them."""
        ghost = self._ghost
        back = [k for k in keys if k in ghost] if ghost else None
        if back:
            for k in back:
                del ghost[k]
            self.region.regret(self, len(back) * self.pool.slot_bytes)  # type: ignore[union-attr]
        self._trim()

    def add_writing(
        self, key: bytes, slot: int, source: str = "host", parent: bytes | None = None
    ) -> None:
        # A promotion: a block read back from a lower tier after its eviction
        # here is regret too.
        if key in self._ghost:
            del self._ghost[key]
            self.region.regret(self, self.pool.slot_bytes)  # type: ignore[union-attr]
        self._trim()
        super().add_writing(key, slot, source, parent)

    def give_chunk(self) -> int | None:
        """Give up one chunk: one whose slots are all free, else the chunk of
        a least recently used block whose slots are each free or hold a
        block that can go now (evicted, and announced through
        ``on_evicted``); None when none can. A slot neither free nor held by
        a block (a detached block's, still under a job) keeps its chunk."""
        owner, held, entries = self.owner, self._is_held, self.entries
        free_list = self._free_list()
        free = set(free_list)
        best = None
        for c in self.chunks:
            if all(s in free for s in self.slots_of(c)):
                best = c
                break
        if best is None:
            seen: set[int] = set()
            for key in self._coldest(_RECLAIM_SCAN):
                e = entries.get(key)
                if e is None:
                    continue
                c = e.slot * self.pool.slot_bytes // self.region.chunk_bytes  # type: ignore[union-attr]
                if c in seen:
                    continue
                seen.add(c)
                slots = self.slots_of(c)
                keys = [k for k in map(owner, slots) if k is not None]
                if any(held(s) for s in slots) or not all(
                    s in free or ((k := owner(s)) is not None and entries[k].evictable)
                    for s in slots
                ):
                    continue
                # An engine may pin one of them in the node's shared index
                # between the check above and its drop: that block stays,
                # and so does its chunk.
                dropped: list[bytes] = []
                for k in keys:
                    try:
                        self.drop(k)
                    except InvalidArgument:
                        break
                    dropped.append(k)
                self._forget(dropped)
                self._trim()
                self.on_evicted(dropped)
                if len(dropped) < len(keys):
                    continue
                best = c
                break
        if best is None:
            return None
        gone = set(self.slots_of(best))
        self._set_free([s for s in self._free_list() if s not in gone])
        self.chunks.discard(best)
        self.region.owner[best] = None
        return best


def _tier_args(pool: HostPool, options: HostOptions) -> tuple[Any, ...]:
    """A host tier's arguments for the whole of ``pool`` as ``options`` say."""
    o = options
    return (pool, pool.num_slots, o.policy, o.admit_after, o.max_tracked, o.prefix_eviction)


class ChunkedHostTier(ChunkOwner):
    """:class:`ChunkOwner` over the Python host tier (any policy)."""

    def __init__(self, pool: HostPool, options: HostOptions, region: Region) -> None:
        HostTier.__init__(self, *_tier_args(pool, options))
        self._free.clear()  # (the list the slot holds free into: kept)
        self._init_chunks(region)

    def _free_list(self) -> list[int]:
        return list(self._free)

    def _set_free(self, slots: list[int]) -> None:
        self._free[:] = slots

    def _is_held(self, slot: int) -> bool:
        return slot in self._held

    def _coldest(self, n: int) -> list[bytes]:
        return list(itertools.islice(self.policy.victims(), n))


class NativeChunkedHostTier(ChunkOwner, NativeHostTier):
    """:class:`ChunkOwner` over the native index (LRU): the node's per-key
    work in the core, as an engine's in-process tier."""

    def __init__(self, pool: HostPool, options: HostOptions, region: Region) -> None:
        NativeHostTier.__init__(self, *_tier_args(pool, options))
        self._ix.set_free([])
        self._init_chunks(region)

    def _free_list(self) -> list[int]:
        return self._ix.free_list()

    def _set_free(self, slots: list[int]) -> None:
        self._ix.set_free(slots)

    def _is_held(self, slot: int) -> bool:
        return self._ix.is_held(slot)

    def _coldest(self, n: int) -> list[bytes]:
        return self._ix.lru(n)


def chunked_host_tier(pool: HostPool, options: HostOptions, region: Region) -> ChunkOwner:
    """A block size's tier over ``region``: the native index under LRU (the
    default), the Python tier under any other policy."""
    if options.policy == "lru":
        return NativeChunkedHostTier(pool, options, region)
    return ChunkedHostTier(pool, options, region)


def open_region(name: str, region_bytes: int, chunk_bytes: int, classes: int = 2) -> Region:
    """The node's region of ``region_bytes`` (whole chunks of
    ``chunk_bytes``) for up to ``classes`` block sizes: created, or adopted
    when a node before this one left it (engines' workers keep their
    mapping of it across a node restart). Blocks while the region is
    created and pre-faulted."""
    from kvtier.errors import IoError

    chunks = region_bytes // chunk_bytes
    if chunks < 1:
        raise InvalidArgument(
            f"--host-bytes {region_bytes} is less than one chunk of {chunk_bytes} B"
        )
    try:
        pool = HostPool(chunks, chunk_bytes, name=name)
    except IoError as e:
        import errno

        if e.errno != errno.EEXIST:
            raise
        pool = HostPool.attach(name)
        if (pool.num_slots, pool.slot_bytes) != (chunks, chunk_bytes):
            got = (pool.num_slots, pool.slot_bytes)
            pool.close()
            raise InvalidArgument(
                f"region {name} left by an earlier node is {got[0]} x {got[1]} B, this node "
                f"wants {chunks} x {chunk_bytes} B: remove /dev/shm/{name} once no engine uses it"
            ) from None
        region = Region(pool, regret=classes > 1)
        region.adopted = True
        return region
    return Region(pool, regret=classes > 1)
