"""The host tier over the native index (``kvtier._native.HostIndex``,
``csrc/core/policy/host_index.h``): :class:`~kvtier.tiers.host.HostTier`'s
interface and choices under LRU, each block's state a record in the core
rather than a Python object.

Process: the engine's scheduler (or the node). Nothing here blocks. Who
calls: the manager, under its lock; :func:`make_host_tier` (what the library
builds) makes one for a bounded LRU tier, and :class:`HostTier` itself is
the Python tier, for every policy.

Why: the Python tier's per-block objects and dict work were 53% of ``kvtier
bench manager``'s 16-key cycle; the index does the same work 5.0x faster at
16 keys a call and 2.8x at 1 (bench/results/host-index/). The manager's
per-key calls (:meth:`answer`, :meth:`load_slots`, :meth:`complete_writes`,
the batch calls) go to the core in one call each; ``entries`` gives a live
view of one block (:class:`NativeEntry`) for the rarer callers that read or
change a block's fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvtier._native import HostIndex, SharedIndex
from kvtier.errors import InvalidArgument
from kvtier.options.tiers import HostOptions
from kvtier.policy import AdmissionFilter, EvictionPolicy
from kvtier.pool import HostPool
from kvtier.tiers.host import HostTier, checked_capacity
from kvtier.tiers.host_entry import Fill, HostEntry

_FILLS = (Fill.NONE, Fill.FILLING, Fill.FAILED)


class _Sources:
    """The tiers a block's bytes came from, by number: 0 is the host tier."""

    def __init__(self) -> None:
        self.names = ["host"]
        self._ids = {"host": 0}

    def id_of(self, name: str) -> int:
        i = self._ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.names)
            self.names.append(name)
        return i


class NativeEntry:
    """One resident block's fields, read from and written to the index as
    they are used (a view, not a copy: valid while the block is resident).
    Detached blocks come back as :class:`HostEntry` copies instead."""

    # The index and the source names, not the tier: a view held by the
    # tier's ``entries`` would otherwise make the tier a reference cycle,
    # freed only by the collector (never, once a heap is frozen).
    __slots__ = ("_ix", "_sources", "key", "slot")

    def __init__(self, ix: HostIndex, sources: _Sources, key: bytes, slot: int) -> None:
        self._ix, self._sources, self.key, self.slot = ix, sources, key, slot

    def _state(self) -> tuple[int, int, int, int, int]:
        return self._ix.state(self.slot)

    @property
    def ref(self) -> int:
        return self._state()[0]

    @ref.setter
    def ref(self, value: int) -> None:
        self._ix.set_ref(self.slot, value)

    @property
    def cascading(self) -> int:
        return self._state()[1]

    @cascading.setter
    def cascading(self, value: int) -> None:
        self._ix.add_cascading(self.slot, value - self._state()[1])

    @property
    def source(self) -> str:
        return self._sources.names[self._state()[2]]

    @source.setter
    def source(self, value: str) -> None:
        self._ix.set_source(self.slot, self._sources.id_of(value))

    @property
    def fill(self) -> Fill:
        return _FILLS[self._state()[3]]

    @fill.setter
    def fill(self, value: Fill) -> None:
        self._ix.set_fill(self.slot, value.value, self._state()[4])

    @property
    def fence(self) -> int:
        return self._state()[4]

    @fence.setter
    def fence(self, value: int) -> None:
        self._ix.set_fill(self.slot, self._state()[3], value)

    @property
    def parent(self) -> bytes | None:
        return self._ix.parent_key(self.key)

    @property
    def kids(self) -> bytes | set[bytes] | None:
        kids = self._ix.kids(self.key)
        return None if not kids else kids[0] if len(kids) == 1 else set(kids)

    @property
    def evictable(self) -> bool:
        ref, cascading, _, fill, _ = self._state()
        return ref == 0 and cascading == 0 and fill == 0 and not self._ix.engine_pinned(self.slot)

    def copy(self) -> HostEntry:
        """The block's fields now, as a :class:`HostEntry`."""
        ref, cascading, source, fill, fence = self._state()
        return HostEntry(
            self.slot,
            ref,
            cascading,
            self._sources.names[source],
            _FILLS[fill],
            fence,
            self.parent,
            self.kids,
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NativeEntry):
            return self.key == other.key and self.copy() == other.copy()
        return isinstance(other, HostEntry) and self.copy() == other

    __hash__ = None  # type: ignore[assignment]  # mutable, as HostEntry

    def __repr__(self) -> str:
        return f"NativeEntry({self.copy()!r})"


class _Entries(Mapping[bytes, NativeEntry]):
    """The tier's ``entries``: resident keys (in the order they were
    written; in slot order once mirrored into a node's shared index) to
    views of their blocks."""

    def __init__(self, ix: HostIndex, sources: _Sources) -> None:
        self._ix, self._sources = ix, sources
        self._slots: Mapping[bytes, int] = ix.slots

    def __getitem__(self, key: bytes) -> NativeEntry:
        return NativeEntry(self._ix, self._sources, key, self._slots[key])

    def get(self, key: bytes, default: Any = None) -> Any:
        s = self._slots.get(key)
        return default if s is None else NativeEntry(self._ix, self._sources, key, s)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)


class _LruOrder:
    """The tier's ``policy`` as far as callers read it: the ready keys,
    least recently used first."""

    def __init__(self, ix: HostIndex) -> None:
        self._ix = ix

    def victims(self) -> Iterator[bytes]:
        return iter(self._ix.lru())

    def touch(self, key: bytes) -> None:
        self._ix.touch_many((key,))

    def __len__(self) -> int:
        return len(self._ix.lru())


class NativeHostTier(HostTier):
    """:class:`~kvtier.tiers.host.HostTier` under LRU over a bounded pool,
    its blocks kept by the native index. The same calls, slots and victims
    (tests/unit/test_host_index.py)."""

    def __init__(
        self,
        pool: HostPool | None = None,
        capacity: int | None = None,
        policy: str | EvictionPolicy = "lru",
        admit_after: int = 1,
        max_tracked: int = 1 << 20,
        prefix_aware: bool = True,
    ) -> None:
        cap = checked_capacity(pool, capacity)
        if cap is None or policy != "lru":
            raise InvalidArgument(
                f"the native host index keeps LRU order over a bounded tier, not {policy!r}"
                + ("" if cap is not None else " unbounded")
            )
        self.pool = pool
        self.capacity = cap
        self.prefix_aware = prefix_aware
        self.admission = AdmissionFilter(admit_after, max_tracked)
        self._ix = ix = HostIndex(cap, prefix_aware)
        self._sources = _Sources()
        self.entries = _Entries(ix, self._sources)  # type: ignore[assignment]
        self.resident = ix.slots
        self.policy = _LruOrder(ix)  # type: ignore[assignment]

    def mirror_into(self, shared: SharedIndex | None) -> None:
        """The node's shared index, which engines read and pin without a
        round trip (csrc/core/node/shared_index.h): each block added here is
        published there by its key's digest, ready there when ready here,
        retired there when it leaves; a block an engine pins there is not
        evicted; keys are found there by digest from then on (no dict:
        ``resident`` becomes a mapping in slot order). Called by the node
        once, before any block is added (InvalidArgument after)."""
        self._ix.set_mirror(shared)
        entries: Any = self.entries  # _Entries
        self.resident = entries._slots = self._ix.slots

    def offered(self, keys: list[bytes]) -> tuple[list[bytes], set[bytes], int]:
        """As :meth:`HostTier.offered`, in one native pass when admission
        takes every offer (the default): the Python loop was a fifth of the
        node's STORE_BEGIN (``kvtier bench manager --node --shared-index``,
        16-key offers)."""
        if self.admission.threshold > 1:
            return super().offered(keys)
        to_store, seen = self._ix.offered(keys)
        return to_store, seen, 0

    def _slot(self, key: bytes) -> int:
        s = self._ix.slot(key)
        if s < 0:
            raise KeyError(key)
        return s

    # -- queries ---------------------------------------------------------
    def get(self, key: bytes) -> NativeEntry | None:  # type: ignore[override]
        s = self._ix.slots.get(key)
        return None if s is None else NativeEntry(self._ix, self._sources, key, s)

    def owner(self, slot: int) -> bytes | None:
        return self._ix.owner(slot)

    def __len__(self) -> int:
        return len(self._ix)

    @property
    def free_slots(self) -> int:
        return self._ix.free_slots

    @property
    def held_slots(self) -> int:
        return self._ix.held_slots

    def census(self) -> tuple[int, int, int]:
        # One native pass over the records: through the entry views (three
        # passes) 4,096 blocks took 11.7 ms, every half second on vLLM's
        # scheduler thread (the shim's gauges), 3 December 2026.
        return self._ix.census()

    def answer(self, key: bytes) -> int:
        return self._ix.answer(key)

    def load_slots(self, keys: list[bytes]) -> list[int]:
        return self._ix.load_slots(keys)

    def complete_writes(self, keys: Iterable[bytes], ready: bool) -> list[bytes]:
        return self._ix.complete_writes(keys, ready)

    # -- allocation --------------------------------------------------------
    def allocate(
        self, n: int, protected: Iterable[bytes] = (), partial: bool = False
    ) -> tuple[list[int], list[bytes]] | None:
        return self._ix.allocate(n, protected or None, partial)

    def add_writing(
        self, key: bytes, slot: int, source: str = "host", parent: bytes | None = None
    ) -> None:
        self._ix.add_writing(key, slot, self._sources.id_of(source), parent)

    def add_writing_many(
        self, keys: list[bytes], slots: list[int], parents: list[bytes | None] | None = None
    ) -> None:
        self._ix.add_writing_many(keys, slots, parents)

    # -- references ----------------------------------------------------------
    def pin(self, key: bytes) -> str:
        return self._sources.names[self._ix.pin_many([key])[0]]

    def pin_many(self, keys: list[bytes]) -> list[str]:
        ids = self._ix.pin_many(keys)
        if not any(ids):
            return ["host"] * len(ids)
        names = self._sources.names
        return [names[i] for i in ids]

    def unpin_many(self, keys: Iterable[bytes]) -> None:
        self._ix.unpin_many(keys)

    def unpin(self, key: bytes) -> None:
        self._ix.unpin_many((key,))

    def touch_many(self, keys: Iterable[bytes]) -> None:
        self._ix.touch_many(keys)  # skips keys that are not resident

    def touch_slots(self, slots: list[int]) -> None:
        """The ready blocks in ``slots`` become the most recently used, in
        order (the node's engines name their shared-index loads by slot).
        InvalidArgument, touching nothing, for a slot out of range."""
        self._ix.touch_slots(slots)

    def begin_cascade(self, key: bytes) -> None:
        self._ix.add_cascading(self._slot(key), 1)

    def end_cascade(self, key: bytes) -> None:
        self._ix.add_cascading(self._slot(key), -1)

    def mark_ready(self, key: bytes) -> None:
        self._ix.mark_ready_many((key,))

    def mark_ready_many(self, keys: list[bytes], entries: list[Any]) -> None:
        self._ix.mark_ready_many(keys)

    def release_slot(self, slot: int) -> None:
        self._ix.release(slot)

    def hold(self, slot: int) -> None:
        self._ix.hold(slot)

    def unhold(self, slot: int) -> None:
        self._ix.unhold(slot)

    def detach(self, key: bytes) -> HostEntry | None:
        s = self._ix.slots.get(key)
        if s is None:
            return None
        e = NativeEntry(self._ix, self._sources, key, s).copy()
        self._ix.detach(key)
        return e

    def drop(self, key: bytes) -> HostEntry | None:
        e = self.detach(key)
        if e is not None:
            self._ix.release(e.slot)
        return e


def make_host_tier(
    pool: HostPool | None = None,
    capacity: int | None = None,
    policy: str | EvictionPolicy = "lru",
    admit_after: int = 1,
    max_tracked: int = 1 << 20,
    prefix_aware: bool = True,
    native: bool | None = None,
) -> HostTier:
    """The host tier for these arguments (:class:`HostTier`'s): the native
    one for LRU over a bounded tier unless ``native`` is False, the Python
    one otherwise (``native=True`` where the native one cannot serve:
    InvalidArgument)."""
    can = policy == "lru" and (pool is not None or capacity is not None)
    if native or (can and native is None):
        return NativeHostTier(pool, capacity, policy, admit_after, max_tracked, prefix_aware)
    return HostTier(pool, capacity, policy, admit_after, max_tracked, prefix_aware)


def host_tier_from_options(
    pool: HostPool | None, capacity: int | None, options: HostOptions
) -> HostTier:
    """:func:`make_host_tier` as ``options`` say (its ``bytes`` sized the
    pool: not read here)."""
    return make_host_tier(
        pool,
        capacity,
        options.policy,
        options.admit_after,
        options.max_tracked,
        options.prefix_eviction,
    )
