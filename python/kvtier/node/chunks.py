"""The node's host memory: one shared-memory region for every block size,
divided between them by use.

Process: the node. Who calls: :mod:`kvtier.node.server` (the region, one
tier per block size) and, through each block size's manager, its host tier;
all on the node's one thread. Nothing blocks.

The region is cut into chunks of equal size. Each block size (a *slot
class*) sees the whole region as slots of its own size (a view of the pool:
engines map it and copy into those slots) and may use the slots that lie
wholly inside chunks it owns, so the block sizes never overlap. A class
gets a free chunk when it needs room; when none is free it takes a chunk
from a class that holds more of the region than its share of recent use
(bytes stored and loaded, halved each time the node has moved a region's
worth), evicting that chunk's blocks, provided none of them is in use.
Otherwise it evicts its own, as a tier of fixed size does. A chunk loses at
most one block's bytes to a block size that does not divide it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.errors import InvalidArgument
from kvtier.options.tiers import HostOptions
from kvtier.pool import HostPool
from kvtier.tiers.host import HostTier

#: The default chunk: what one block size gives up or gets at a time.
CHUNK_BYTES = 64 << 20
#: At least this many chunks in a region (smaller chunks for a small node).
MIN_CHUNKS = 16
# Blocks of a class whose chunk is looked at before it gives up none: the
# least recently used ones, so the chunk it gives is a cold one.
_RECLAIM_SCAN = 256


def chunk_bytes_for(region_bytes: int, wanted: int = CHUNK_BYTES) -> int:
    """The chunk size of a region of ``region_bytes``: ``wanted``, smaller
    for a region of fewer than :data:`MIN_CHUNKS` such chunks; 4 KiB-aligned."""
    c = min(wanted, region_bytes // MIN_CHUNKS)
    return max(4096, c // 4096 * 4096)


class Region:
    """The chunks of the node's region (``pool``: the region as created, one
    header slot per chunk) and the tiers that own them."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.chunk_bytes = pool.slot_bytes
        self.owner: list[ChunkedHostTier | None] = [None] * pool.num_slots
        self._free = list(range(pool.num_slots - 1, -1, -1))  # chunk 0 first
        self.tiers: list[ChunkedHostTier] = []
        self._moved = 0.0  # bytes of use counted since the last halving
        self.reassigned = 0  # chunks taken from one block size for another

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

    def used(self, tier: ChunkedHostTier, nbytes: int) -> None:
        """``tier`` stored or loaded ``nbytes``: its use, decayed by halving."""
        tier.use += nbytes
        self._moved += nbytes
        if self._moved > self.bytes:
            self._moved /= 2
            for t in self.tiers:
                t.use /= 2

    def grow(self, tier: ChunkedHostTier, short: int) -> None:
        """Give ``tier`` chunks until it has ``short`` more free slots, free
        chunks first, then chunks of tiers that hold more than their share
        of use; stops when none can be had."""
        while short > 0:
            c = self._free.pop() if self._free else self._reclaim_for(tier)
            if c is None:
                return
            self.owner[c] = tier
            tier.chunks.add(c)
            slots = tier.slots_of(c)
            tier.add_free(slots)
            short -= len(slots)

    def _reclaim_for(self, tier: ChunkedHostTier) -> int | None:
        total = sum(t.use for t in self.tiers)
        if total <= 0:
            return None
        n = len(self.owner)

        def excess(t: ChunkedHostTier) -> float:
            return len(t.chunks) / n - t.use / total

        if excess(tier) >= 0:
            return None  # it holds its share already: it evicts its own
        for other in sorted(self.tiers, key=excess, reverse=True):
            if other is tier or excess(other) <= 0 or len(other.chunks) <= 1:
                continue
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

    def occupancy(self, tier: ChunkedHostTier) -> dict[str, int]:
        return {"chunks": len(tier.chunks), "chunk_bytes": self.chunk_bytes}


class ChunkedHostTier(HostTier):
    """A block size's host tier over its view of the :class:`Region`: it
    starts with no slots and gets them a chunk at a time as it needs room."""

    def __init__(self, pool: HostPool, options: HostOptions, region: Region) -> None:
        super().__init__(
            pool,
            pool.num_slots,
            options.policy,
            options.admit_after,
            options.max_tracked,
            options.prefix_eviction,
        )
        self._free.clear()  # (the list the slot holds free into: kept)
        self.region = region
        self.chunks: set[int] = set()
        self.use = 0.0
        # Who is told of blocks evicted to give a chunk away (the manager's
        # removal events): set by the node once the manager exists.
        self.on_evicted: Callable[[list[bytes]], None] = lambda keys: None
        region.tiers.append(self)

    def slots_of(self, chunk: int) -> list[int]:
        """This view's slots wholly inside ``chunk``."""
        c, s = self.region.chunk_bytes, self.pool.slot_bytes  # type: ignore[union-attr]
        lo, hi = -(-chunk * c // s), (chunk + 1) * c // s
        return list(range(lo, min(hi, self.capacity or 0)))

    def add_free(self, slots: Iterable[int]) -> None:
        self._free.extend(sorted(slots, reverse=True))

    def allocate(
        self, n: int, protected: Iterable[bytes] = (), partial: bool = False
    ) -> tuple[list[int], list[bytes]] | None:
        # The demand counts, met or not: a block size that holds nothing yet
        # must be able to claim its share.
        self.region.used(self, n * self.pool.slot_bytes)  # type: ignore[union-attr]
        short = n - len(self._free)
        if short > 0:
            self.region.grow(self, short)
        return super().allocate(n, protected, partial)

    def pin_many(self, keys: list[bytes]) -> list[str]:
        self.region.used(self, len(keys) * self.pool.slot_bytes)  # type: ignore[union-attr]
        return super().pin_many(keys)

    def give_chunk(self) -> int | None:
        """Give up one chunk: one with no block in it, else the chunk of a
        least recently used block whose blocks can all go now (evicted, and
        announced through ``on_evicted``); None when none can."""
        owner, held = self._owner, self._held
        best = None
        for c in self.chunks:
            if not any(s in owner or s in held for s in self.slots_of(c)):
                best = c
                break
        if best is None:
            seen: set[int] = set()
            entries = self.entries
            for i, key in enumerate(self.policy.victims()):
                e = entries.get(key)
                if i >= _RECLAIM_SCAN:
                    break
                if e is None:
                    continue
                c = e.slot * self.pool.slot_bytes // self.region.chunk_bytes  # type: ignore[union-attr]
                if c in seen:
                    continue
                seen.add(c)
                slots = self.slots_of(c)
                keys = [owner[s] for s in slots if s in owner]
                if all(entries[k].evictable for k in keys) and not any(s in held for s in slots):
                    for k in keys:
                        self.drop(k)
                    self.on_evicted(keys)
                    best = c
                    break
        if best is None:
            return None
        gone = set(self.slots_of(best))
        self._free[:] = [s for s in self._free if s not in gone]
        self.chunks.discard(best)
        self.region.owner[best] = None
        return best
