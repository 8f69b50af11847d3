"""The host tier: the slots of the shared host pool, indexed by key.

Process: the engine's scheduler. Nothing here blocks.

Who calls: the manager, under its lock. A slot's reference count is -1 while
bytes are being written into it (a GPU store or a promotion from a lower
tier), 0 when ready and evictable, > 0 while pinned by loads; a block is also
held while lower tiers copy it (``cascading``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Iterator
from dataclasses import dataclass

from kvtier.errors import InvalidArgument
from kvtier.options.tiers import HostOptions
from kvtier.policy import AdmissionFilter, EvictionPolicy, make_policy
from kvtier.pool import HostPool
from kvtier.tiers.host_entry import FILL_NONE, Fill, HostEntry
from kvtier.tiers.slot_holds import SlotHolds


@dataclass(slots=True)
class _Taking:
    """One allocation's search for victims (:meth:`HostTier._victims`): how
    many it needs, those taken so far (in order and as a set), and the
    protected keys."""

    need: int
    victims: list[bytes]
    taken: set[bytes]
    prot: Container[bytes]


def _per_key(call: Callable[[bytes], object]) -> Callable[[list[bytes]], None]:
    """A policy's per-key call over a list, for policies without the batch
    form (the LRU has it: one call per offer instead of one per key)."""

    def many(keys: list[bytes]) -> None:
        for k in keys:
            call(k)

    return many


def _drop_kid(pe: HostEntry, key: bytes) -> None:
    """``key`` is no longer resident after ``pe``; a branch left with one
    block after it is a plain chain again."""
    kids = pe.kids
    if type(kids) is set:
        kids.discard(key)
        if len(kids) <= 1:
            pe.kids = next(iter(kids)) if kids else None
    elif kids == key:
        pe.kids = None


def _kid_list(kids: bytes | set[bytes] | None) -> Iterable[bytes]:
    if kids is None:
        return ()
    return kids if type(kids) is set else (kids,)  # type: ignore[return-value]


def checked_capacity(pool: HostPool | None, capacity: int | None) -> int | None:
    """The host tier's capacity in blocks: ``capacity``, else all of
    ``pool`` (None: unbounded, without a pool); InvalidArgument when it is
    not > 0 or exceeds the pool."""
    if pool is not None:
        capacity = pool.num_slots if capacity is None else capacity
        if capacity > pool.num_slots:
            raise InvalidArgument(f"capacity {capacity} exceeds the pool's {pool.num_slots} slots")
    if capacity is not None and capacity <= 0:
        raise InvalidArgument(f"host capacity must be > 0 blocks, got {capacity}")
    return capacity


class HostTier:
    """Slot allocation, eviction and admission over a :class:`HostPool`.

    ``pool=None`` is the no-data mode used by policy studies: ``capacity``
    counts blocks (``None``: unbounded) and slots are just numbers.

    Prefix-aware eviction (``prefix_aware``, under every policy): a block
    written with its chain predecessor (:meth:`add_writing`'s ``parent``)
    goes before that parent. Lookups walk a prefix from its start, so a
    block whose parent is gone can never hit again: when the policy names a
    victim, the blocks after it in its chains go first, deepest first, then
    the victim itself. A block after it that cannot go now (pinned by a
    load, being written, offered) is passed over and does not keep the
    victim: keeping such parents until nothing else could go cost ARC and
    PLFU 0.1-0.4 points of hit rate with 16 requests in flight (agent
    workload, 1,000 blocks; bench/results/prefix-eviction/), where passing
    over gains 0.4-0.8.
    """

    name = "host"

    @classmethod
    def from_options(
        cls, pool: HostPool | None, capacity: int | None, options: HostOptions
    ) -> HostTier:
        """The host tier over ``pool`` (``capacity`` slots of it, None: all)
        as ``options`` say (its ``bytes`` sized the pool: not read here)."""
        return cls(
            pool,
            capacity,
            options.policy,
            options.admit_after,
            options.max_tracked,
            options.prefix_eviction,
        )

    def __init__(
        self,
        pool: HostPool | None = None,
        capacity: int | None = None,
        policy: str | EvictionPolicy = "lru",
        admit_after: int = 1,
        max_tracked: int = 1 << 20,
        prefix_aware: bool = True,
    ) -> None:
        capacity = checked_capacity(pool, capacity)
        self.pool = pool
        self.capacity = capacity
        self.policy = make_policy(policy, capacity or (1 << 62))
        # The policy's batch calls where it has them (see _per_key).
        pol = self.policy
        self._insert_many = getattr(pol, "insert_many", None) or _per_key(pol.insert)
        self._touch_many = getattr(pol, "touch_many", None) or _per_key(pol.touch)
        self._evict_many = getattr(pol, "evict_many", None) or _per_key(
            lambda k: pol.remove(k, evicted=True)
        )
        self.admission = AdmissionFilter(admit_after, max_tracked)
        self.entries: dict[bytes, HostEntry] = {}
        # The resident keys, for membership tests (the native tier's is
        # its index's dict).
        self.resident: Container[bytes] = self.entries
        # slot -> key of the entry that owns it: who owns a slot is asked on
        # every tier completion and reset, so it must not scan the entries.
        self._owner: dict[int, bytes] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1)) if capacity else []
        self._next_virtual = 0  # unbounded mode
        # Slots a timed-out device job may still read or write.
        self._held = SlotHolds(self._free)
        self.prefix_aware = prefix_aware
        # Resident blocks written with a resident parent: with none, no chain
        # exists and eviction takes the policy's order as it is (the walk
        # for tails costs 3% of a plain caller's store, callgrind).
        self._links = 0
        # Where the last walk down a plain chain ended, per block it began at:
        # (that block's key and entry, the start's entry, _cuts then). A
        # request's chain grows at its tail and is evicted from it, so the
        # next walk starts there instead of the chain's oldest block (from the
        # oldest, every allocation under one 200,000-block chain walked all of
        # it: `kvtier bench vllm` ran for hours). _cuts counts the changes that
        # can put a hint off its start's chain: a block with resident blocks
        # after it removed, a second block after one.
        self._tail_hints: dict[bytes, tuple[bytes, HostEntry, HostEntry, int]] = {}
        self._cuts = 0

    # -- queries ---------------------------------------------------------
    def get(self, key: bytes) -> HostEntry | None:
        return self.entries.get(key)

    def census(self) -> tuple[int, int, int]:
        """Resident blocks pinned by loads, being written (or filled by a
        lower tier), and cascading, in that order: the manager's occupancy
        gauges, which vLLM's shim asks for every half second on the
        scheduler's thread. One pass; non-blocking."""
        pinned = writing = cascading = 0
        filling = Fill.FILLING
        for e in self.entries.values():
            ref = e.ref
            pinned += ref > 0
            writing += ref < 0 or e.fill is filling
            cascading += e.cascading > 0
        return pinned, writing, cascading

    def offered(self, keys: list[bytes]) -> tuple[list[bytes], set[bytes], int]:
        """Of an offer to store: the keys this tier would take (not held
        already, admitted, each once) in order, every key offered, and how
        many admission refused. Held ones count as used now. The manager
        calls it for each offer; non-blocking."""
        to_store: list[bytes] = []
        seen: set[bytes] = set()
        entries = self.resident
        touched: list[bytes] = []
        refused = 0
        # Admission's call skipped when it admits every offer (the default).
        offer = self.admission.offer if self.admission.threshold > 1 else None
        for k in keys:
            if k in seen:
                continue
            seen.add(k)
            if k in entries:
                touched.append(k)
            elif offer is not None and not offer(k):
                refused += 1
            else:
                to_store.append(k)
        if touched:
            self._touch_many(touched)  # all resident: no filter
        return to_store, seen, refused

    def answer(self, key: bytes) -> int:
        """What a lookup of ``key`` finds: 0 not resident, 1 ready, 2 being
        written, 3 a fenced fill that failed (a MISS), 4 a fenced fill under
        way (a HIT whose load may still fail)."""
        e = self.entries.get(key)
        if e is None:
            return 0
        if e.ref < 0:
            return 2
        fill = e.fill
        return 1 if fill is FILL_NONE else 3 if fill is Fill.FAILED else 4

    def load_slots(self, keys: list[bytes]) -> list[int]:
        """Each key's slot when it is ready to load, else -1, in order."""
        get = self.entries.get
        return [e.slot if (e := get(k)) is not None and e.ref >= 0 else -1 for k in keys]

    def complete_writes(self, keys: Iterable[bytes], ready: bool) -> list[bytes]:
        """The keys among ``keys`` that are host writes in flight (not
        promotions), in order; with ``ready`` each becomes ready and the most
        recently used (a store's completion)."""
        out = []
        entries = self.entries
        for k in keys:
            e = entries.get(k)
            if e is None or e.ref != -1 or e.source != "host":
                continue
            out.append(k)
            if ready:
                e.ref = 0
        if ready:
            self._insert_many(out)
        return out

    def owner(self, slot: int) -> bytes | None:
        """The key whose entry holds ``slot`` (None: no entry does). O(1)."""
        return self._owner.get(slot)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def free_slots(self) -> int:
        return len(self._free) if self.capacity is not None else 1 << 62

    # -- allocation --------------------------------------------------------
    def allocate(
        self, n: int, protected: Iterable[bytes] = (), partial: bool = False
    ) -> tuple[list[int], list[bytes]] | None:
        """``n`` free slots, evicting ready unprotected keys as needed.

        Returns ``(slots, evicted_keys)`` or None (and changes nothing) when
        not enough keys can be evicted; with ``partial``, as many slots as can
        be had (None only when that is none).
        """
        if self.capacity is None:
            slots = list(range(self._next_virtual, self._next_virtual + n))
            self._next_virtual += n
            return slots, []
        need = n - len(self._free)
        victims: list[bytes] = []
        if need > 0:
            prot = protected if isinstance(protected, (set, frozenset, dict)) else set(protected)
            victims = self._victims(need, prot)
            if len(victims) < need:
                if not partial or len(self._free) + len(victims) == 0:
                    return None
                n = len(self._free) + len(victims)
            self._evict_many(victims)
            entries, owner, free = self.entries, self._owner, self._free
            for key in victims:
                e = entries.pop(key)
                del owner[e.slot]
                if e.kids is not None:  # its chain cut (eviction in the policy's order)
                    self._cuts += 1
                if e.parent is not None:  # _unlink, inlined: once per evicted block
                    self._links -= 1
                    pe = entries.get(e.parent)
                    if pe is not None and pe.kids is not None:
                        _drop_kid(pe, key)
                free.append(e.slot)
        free = self._free
        cut = len(free) - n
        slots = free[cut:]
        slots.reverse()  # as n pops would give them: last first
        del free[cut:]
        return slots, victims

    def _victims(self, need: int, prot: Container[bytes]) -> list[bytes]:
        """Up to ``need`` evictable keys outside ``prot``, in the policy's
        order but each chain's tail first (see the class). Pure: neither the
        policy nor the index changes."""
        victims: list[bytes] = []
        entries, held = self.entries, self._held
        if not self._links:
            for key in self.policy.victims():
                e = entries.get(key)
                # A held slot would not come free: keep its block instead.
                if e is not None and e.evictable and key not in prot and e.slot not in held:
                    victims.append(key)
                    if len(victims) == need:
                        break
            return victims
        t = _Taking(need, victims, set(), prot)
        taken = t.taken
        # Work bound: past this many blocks walked (chains whose blocks
        # mostly cannot go), the policy's order alone decides the rest.
        budget = 8 * need + 256
        for key in self.policy.victims():
            e = entries.get(key)
            if e is None or key in taken or not e.evictable or key in prot or e.slot in held:
                continue
            if e.kids is None:
                victims.append(key)
                taken.add(key)
            else:
                budget -= self._take_chain(key, t)
            if len(victims) == need or budget <= 0:
                break
        if len(victims) < need:
            for key in self.policy.victims():
                e = entries.get(key)
                if e is None or key in taken or not e.evictable or key in prot or e.slot in held:
                    continue
                victims.append(key)
                taken.add(key)
                if len(victims) == need:
                    break
        return victims

    def _take_chain(self, root: bytes, t: _Taking) -> int:
        """Takes the blocks after ``root`` (all its resident descendants)
        that can go, deepest first, then ``root``, into ``t.victims`` until
        ``t.need``. Iterative: chains run thousands of blocks deep. Returns
        the blocks walked."""
        entries, held = self.entries, self._held
        need, victims, taken, prot = t.need, t.victims, t.taken, t.prot
        # A plain chain (one block after each): walk down, take from the end.
        root_e = start_e = entries[root]
        start = root
        hint = self._tail_hints.get(root)
        if hint is not None:
            h, he, re_, cuts = hint
            if cuts == self._cuts and re_ is root_e and entries.get(h) is he and h not in taken:
                start, start_e = h, he
        path, path_entries = [start], [start_e]
        kids = start_e.kids
        while kids is not None and type(kids) is not set:
            child = kids
            ce = entries.get(child)  # type: ignore[arg-type]  # bytes: not a set
            if ce is None or child in taken:
                break
            path.append(child)  # type: ignore[arg-type]  # bytes: not a set
            path_entries.append(ce)
            kids = ce.kids
        if kids is None:
            return self._take_tail(root, path, path_entries, t)
        walked = 0
        stack: list[tuple[bytes, Iterator[bytes]]] = [(root, iter(_kid_list(root_e.kids)))]
        while stack:
            node, children = stack[-1]
            nxt = next(children, None)
            if nxt is not None:
                if nxt not in taken and nxt in entries:
                    stack.append((nxt, iter(_kid_list(entries[nxt].kids))))
                    walked += 1
                continue
            stack.pop()
            e = entries[node]
            if e.evictable and node not in prot and e.slot not in held:
                victims.append(node)
                taken.add(node)
                if len(victims) == need:
                    break
        return walked + 1

    def _take_tail(
        self, root: bytes, path: list[bytes], path_entries: list[HostEntry], t: _Taking
    ) -> int:
        """:meth:`_take_chain` of a plain chain walked down to its tail along
        ``path`` (from ``root``, or from a hint below it): takes the blocks
        that can go from the tail toward ``root`` (along ``path``, then up
        the parent links) until ``need``, and leaves the hint for the next
        walk. Returns the blocks walked."""
        entries, held = self.entries, self._held
        need, victims, taken, prot = t.need, t.victims, t.taken, t.prot
        walked = len(path)
        i = walked - 1
        node, e = path[i], path_entries[i]
        while True:
            # HostEntry.evictable, inlined: once per block of the chain. A
            # block above a hint may have gone already in this call, as the
            # start of its own part of the chain.
            if (
                e.ref == 0
                and e.cascading == 0
                and e.fill is FILL_NONE
                and node not in prot
                and e.slot not in held
                and node not in taken
            ):
                victims.append(node)
                taken.add(node)
                if node == root:
                    self._tail_hints.pop(root, None)
                    return walked
                if len(victims) == need:
                    break
            if i > 0:
                i -= 1
                node, e = path[i], path_entries[i]
            else:
                node = e.parent  # type: ignore[assignment]  # resident up to root
                e = entries[node]
                walked += 1
        p = e.parent  # the deepest block left on root's chain: the next walk starts there
        self._hint(root, p, entries[p])  # type: ignore[index,arg-type]
        return walked

    def _hint(self, root: bytes, deepest: bytes, entry: HostEntry) -> None:
        hints = self._tail_hints
        if len(hints) >= 4096:  # those of roots gone otherwise: dropped now and then
            hints.clear()
        hints[root] = (deepest, entry, self.entries[root], self._cuts)

    def add_writing(
        self, key: bytes, slot: int, source: str = "host", parent: bytes | None = None
    ) -> None:
        """``key`` is being written into ``slot``; ``parent``: its predecessor
        in its prefix chain, kept from eviction while ``key`` is resident
        (with ``prefix_aware``; ignored otherwise)."""
        e = HostEntry(slot, -1, 0, source)
        self.entries[key] = e
        self._owner[slot] = key
        if parent is not None and self.prefix_aware:
            # Only a resident parent: a block written after its parent left
            # is stranded already. Without prefix awareness no chain is kept
            # (nor handed to lower tiers).
            pe = self.entries.get(parent)
            if pe is not None and parent != key:
                e.parent = parent
                self._links += 1
                kids = pe.kids
                if kids is None:
                    pe.kids = key
                else:  # a branch: a walk's hint may lie on the other one now
                    if type(kids) is set:
                        kids.add(key)
                    elif kids != key:
                        pe.kids = {kids, key}  # type: ignore[arg-type]  # bytes: not a set
                    self._cuts += 1

    def add_writing_many(
        self, keys: list[bytes], slots: list[int], parents: list[bytes | None] | None = None
    ) -> None:
        """:meth:`add_writing` of each key into its slot (with its parent,
        ``parents`` in the same order), for a store's offer in one call: the
        store path's per-key calls were 3% of kvtier bench manager's cycle
        (callgrind, 16-key offers)."""
        entries, owner = self.entries, self._owner
        if parents is None or not self.prefix_aware:
            for k, s in zip(keys, slots):
                entries[k] = HostEntry(s)
                owner[s] = k
            return
        links = cuts = 0
        for k, s, p in zip(keys, slots, parents):
            e = entries[k] = HostEntry(s)
            owner[s] = k
            if p is not None and p != k:
                pe = entries.get(p)  # only a resident parent, as in add_writing
                if pe is not None:
                    e.parent = p
                    links += 1
                    kids = pe.kids
                    if kids is None:
                        pe.kids = k
                    else:  # a branch (add_writing's, inlined)
                        if type(kids) is set:
                            kids.add(k)
                        elif kids != k:
                            pe.kids = {kids, k}  # type: ignore[arg-type]  # bytes: not a set
                        cuts += 1
        self._links += links
        self._cuts += cuts

    def _unlink(self, key: bytes, e: HostEntry) -> None:
        """``key`` (entry ``e``) left: its parent has one resident child fewer."""
        p = e.parent
        if p is not None:
            self._links -= 1
            pe = self.entries.get(p)
            if pe is not None and pe.kids is not None:
                _drop_kid(pe, key)

    # -- references (pins by loads, copies to lower tiers) ----------------------
    def pin(self, key: bytes) -> str:
        """Pin a ready ``key`` for a load (it is not evicted until
        :meth:`unpin`) and count it as used; returns the tier its bytes came
        from (``"host"``, or the lower tier that promoted them)."""
        e = self.entries[key]
        e.ref += 1
        self.policy.touch(key)
        return e.source

    def pin_many(self, keys: list[bytes]) -> list[str]:
        """:meth:`pin` of each key (all ready), in one call: the sources in
        the same order. Who calls: the manager's prepare_load."""
        entries = self.entries
        out = []
        for k in keys:
            e = entries[k]
            e.ref += 1
            out.append(e.source)
        self._touch_many(keys)
        return out

    def unpin_many(self, keys: Iterable[bytes]) -> None:
        """:meth:`unpin` of each key, in one call (complete_load's)."""
        entries = self.entries
        for k in keys:
            e = entries.get(k)
            if e is not None and e.ref > 0:
                e.ref -= 1
                e.source = "host"

    def touch_many(self, keys: Collection[bytes]) -> None:
        """The policy's touch of each resident key of ``keys``, in one call."""
        entries = self.entries
        self._touch_many([k for k in keys if k in entries])

    def unpin(self, key: bytes) -> None:
        """End one load's pin of ``key`` (no-op when not pinned). Its bytes
        count as the host tier's from now on."""
        e = self.entries.get(key)
        if e is not None and e.ref > 0:
            e.ref -= 1
            e.source = "host"

    def begin_cascade(self, key: bytes) -> None:
        """A lower tier will copy ``key``'s slot: hold it until :meth:`end_cascade`."""
        self.entries[key].cascading += 1

    def end_cascade(self, key: bytes) -> None:
        """One copy of ``key``'s slot to a lower tier ended (or was dropped)."""
        self.entries[key].cascading -= 1

    def mark_ready(self, key: bytes) -> None:
        e = self.entries[key]
        e.ref = 0
        self.policy.insert(key)

    def mark_ready_many(self, keys: list[bytes], entries: list[HostEntry]) -> None:
        """:meth:`mark_ready` of each key (``entries``: theirs, in the same
        order) in one call: complete_store's."""
        for e in entries:
            e.ref = 0
        self._insert_many(keys)

    def drop(self, key: bytes) -> HostEntry | None:
        """Remove ``key`` and free its slot now (caller made sure nobody uses it)."""
        e = self.detach(key)
        if e is not None:
            self.release_slot(e.slot)
        return e

    def release_slot(self, slot: int) -> None:
        if self.capacity is not None:
            self._held.release(slot)

    def hold(self, slot: int) -> None:
        """A device job that timed out may still touch ``slot``: never hand it
        out again until :meth:`unhold` (called when the job really ended)."""
        self._held.hold(slot)

    def unhold(self, slot: int) -> None:
        """The device job that held ``slot`` ended; the slot is freed now if a
        release was asked meanwhile. Called by the manager, under its lock."""
        self._held.unhold(slot)

    @property
    def held_slots(self) -> int:
        return len(self._held)

    def detach(self, key: bytes) -> HostEntry | None:
        """Remove ``key`` from the index but keep its slot allocated (still in use)."""
        e = self.entries.pop(key, None)
        if e is not None:
            self.policy.remove(key)
            self._owner.pop(e.slot, None)
            if e.kids is not None:  # its chain cut
                self._cuts += 1
            if e.parent is not None:
                self._unlink(key, e)
        return e
