"""The interface between the manager and a lower tier (disk, remote, memory).

Who calls: :class:`kvtier.scheduler.manager.TieredOffloadingManager`, under its lock,
from the scheduler thread. No method blocks but :meth:`LowerTier.wait` (and
``close``): stores and loads are submitted and their completions drained by
:meth:`LowerTier.poll` once per step, or after a bounded :meth:`LowerTier.wait`.

Process: the engine's scheduler (the interface), with readers opened in the
engine's worker (:class:`ReaderSpec`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from kvtier.errors import InvalidArgument

if TYPE_CHECKING:
    from kvtier.engine import Engine
    from kvtier.pool import HostPool


class LookupResult(enum.Enum):
    """vLLM 0.33 semantics: MISS, HIT (readable), HIT_PENDING (present, not
    readable yet), RETRY (not known yet: an asynchronous lookup is in flight)."""

    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


@dataclass
class TierCompletion:
    """One finished store or load batch of a lower tier."""

    token: int
    ok: bool
    kind: str  # "store" or "load"
    keys: list[bytes]
    error: str = ""
    # Per-key outcome when a batch partly failed (None: every key as ``ok``).
    key_ok: list[bool] | None = None
    # Per key: failed by timeout while the device may still touch its host
    # slot; the slot must not be reused until take_released_slots() names it.
    held: list[bool] | None = None
    # Per key of a probe (``kind == "probe"``): the medium does not hold it
    # (a plain miss, not a failure). None: no key was absent.
    missing: list[bool] | None = None


_NO_EXTRA: Mapping[str, Any] = MappingProxyType({})


@dataclass
class TierEvent:
    """Blocks of tier ``tier`` became readable (``removed`` false) or stopped
    being readable (``removed`` true).

    ``keys`` names them by key. ``ids`` names removed blocks whose key the
    tier no longer has (the disk tier's index keeps digests): by their event
    id, 12 bytes each, ``tier.event_id(key)`` of the key it was stored as
    (see :func:`kvtier.tiers.events.vllm_event_id`: for a vLLM key, the last 8
    bytes of its block hash then its 4-byte group index, so an event id has
    the shape of a vLLM OffloadKey whose block hash is vLLM's int block
    hash). A block is named once, by key or by id.

    ``metadata_only`` (with ``removed``): blocks that were never announced
    stored went away (their write or promotion failed, or a fenced read of
    them did), after a lookup may have reported them HIT_PENDING or HIT. No
    block that was public is removed: a consumer forgets only what it
    learned of them from lookups (vLLM 0.33's ``OffloadingEvent.metadata_only``;
    its events tracker drops the payload it kept for the key). The manager's
    ``take_events`` leaves out a key that a new store or promotion owns
    again by then."""

    keys: list[bytes]
    tier: str
    removed: bool
    # Shared empty defaults rather than a new dict and list per event: the
    # manager makes one event per store and per eviction (measured, kvtier
    # bench manager: two more objects per event cost 10% of its cycles, most
    # of it in the garbage collector's passes over them).
    extra: Mapping[str, Any] = field(default_factory=lambda: _NO_EXTRA)
    ids: Sequence[bytes] = ()
    metadata_only: bool = False


class TierIO(Protocol):
    """A lower tier's medium opened by an engine worker (a process other than
    the scheduler that owns the tier), moving blocks between it and slots
    of the worker's own pool: :class:`kvtier.tiers.disk.DiskIO`,
    :class:`kvtier.tiers.remote.worker.RemoteIO`.

    Who calls: the worker's stream loader, one thread. :meth:`submit` never
    blocks; its results come from ``engine.poll()``, one code per item;
    :meth:`close` blocks until the jobs in flight ended.
    """

    block_bytes: int
    engine: Engine

    def submit(
        self, slots: Sequence[int], locations: np.ndarray, digests: bytes, write: bool = False
    ) -> int:
        """One engine job reading the blocks at ``locations`` (as
        :meth:`LowerTier.pin_for_read` gave them; 16-byte ``digests``) into
        ``slots``, or with ``write`` writing them from there; its job id."""
        ...

    def close(self) -> None: ...


class ReaderSpec:
    """What an engine worker needs to open a lower tier's medium itself.

    Made in the scheduler by :meth:`LowerTier.reader_spec`, carried to the
    worker inside the engine's per-step metadata (so every subclass is a
    frozen, picklable dataclass of plain values), opened there once per
    tier by :meth:`open`. A subclass names its medium's I/O class in
    :attr:`io`. Nothing here blocks but :meth:`open`.
    """

    io: ClassVar[Callable[[Any, HostPool], TierIO]]

    def open(self, pool: HostPool) -> TierIO:
        """The medium, moving blocks through slots of ``pool`` (the worker's
        staging ring, registered with the reader's own engine)."""
        return type(self).io(self, pool)


def check_slots(
    keys: Sequence[bytes], slots: Sequence[int], pool: HostPool | None, block_bytes: int = 0
) -> None:
    """Raises InvalidArgument for keys and slots of different lengths, or
    (with a pool) a slot outside it or smaller than ``block_bytes``. Every
    tier calls it first in ``submit_store``/``submit_load``: nothing moves."""
    if len(keys) != len(slots):
        raise InvalidArgument(f"{len(keys)} keys but {len(slots)} slots")
    if pool is None:
        return
    if pool.slot_bytes < block_bytes:
        raise InvalidArgument("host slots are smaller than the tier's blocks")
    n = pool.num_slots
    # min/max in C: a per-slot Python check was a tenth of a batch's submit
    # cost (cProfile of kvtier bench remote, 64 slots a batch).
    if len(slots) and not (min(slots) >= 0 and max(slots) < n):
        bad = next(s for s in slots if not 0 <= s < n)
        raise InvalidArgument(f"host slot {bad} out of range [0, {n})")


class LowerTier(ABC):
    """A tier below the host: bytes move only between its medium and host slots."""

    name: str = "lower"
    can_probe: bool = False  # overrides submit_probe (keys that say RETRY)
    can_fence: bool = False  # overrides submit_fenced_load

    def attach(self, pool: HostPool | None) -> None:
        """Called once by the manager with the host pool (None: no-data mode)."""
        self.pool = pool

    @abstractmethod
    def lookup(self, key: bytes) -> LookupResult:
        """HIT when readable now, RETRY while an asynchronous check is in flight, else MISS."""

    @abstractmethod
    def admit(self, key: bytes) -> bool:
        """Called once per cascade offer: the tier's admission filter and write budget."""

    @abstractmethod
    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        """Copy host ``slots`` to the medium as ``keys``; a token, or None when
        backpressured (the cascade is dropped; nothing was queued)."""

    @abstractmethod
    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        """Copy ``keys`` from the medium into host ``slots``; a token, or None when busy."""

    @abstractmethod
    def poll(self) -> list[TierCompletion]:
        """Finished batches since the last poll, in completion order."""

    def submit_fenced_load(
        self, keys: Sequence[bytes], slots: Sequence[int], armed: np.ndarray
    ) -> int | None:
        """As :meth:`submit_load`, and settle each slot's fence (armed as
        ``armed``, :meth:`HostPool.arm_fences`) as soon as its value is in
        and checked, so that a load into the engine may copy it before the
        batch ends. None when the tier cannot (``can_fence`` false) or is
        busy; the caller then settles the fences itself. Non-blocking."""
        return None

    def submit_probe(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        """For keys whose :meth:`lookup` said RETRY: read them into host
        ``slots`` if the medium holds them, one round trip answering both
        "is it there?" and "here are its bytes" (a key absent is a plain
        miss: ``TierCompletion.missing``). A token (the completion's kind is
        ``"probe"``), or None when the tier cannot probe or is busy (nothing
        was queued). Non-blocking."""
        return None

    def submit_checks(self) -> int | None:
        """Start now the asynchronous existence checks that lookups queued
        (rather than at the next :meth:`poll`): a token to :meth:`wait` on,
        or None when there is none to start. Non-blocking."""
        return None

    def wait(self, tokens: Sequence[int], timeout_s: float) -> bool:
        """Block (the GIL released) until the batches ``tokens`` ended, at most
        ``timeout_s``: True if they all did. Their completions still come from
        :meth:`poll`. A tier whose batches end only at poll returns at once."""
        return True

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events of this tier since the last call."""
        return []

    def has_pending_work(self) -> bool:
        return False

    def take_released_slots(self) -> list[int]:
        """Host slots of timed-out jobs (``TierCompletion.held``) that really
        ended since the last call: safe to reuse now. Non-blocking."""
        return []

    def reset(self) -> None:
        """Forget everything (the manager's reset_cache does not call this)."""

    # -- reads by another process: tiers whose blocks an engine worker can
    # read itself (streaming a hit larger than the host tier) override these.
    def reader_spec(self) -> ReaderSpec | None:
        """What a reader in another process needs to open this tier (None:
        it cannot be read elsewhere, hits go through host slots)."""
        return None

    def pin_for_read(self, keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
        """Locations and 16-byte digests of ``keys`` (all HIT), kept valid
        until :meth:`unpin_read`. Only when :meth:`reader_spec` is not None."""
        raise NotImplementedError(f"tier {self.name} cannot be read by another process")

    def unpin_read(self, records: Sequence[int]) -> None:
        """The reads pinned by :meth:`pin_for_read` (column 0 of its locations) ended."""
        raise NotImplementedError(f"tier {self.name} cannot be read by another process")

    def read_failed(self, locations: np.ndarray, digests: bytes) -> None:
        """Another process failed to read these records (as :meth:`pin_for_read`
        gave them; unpinned since): a miss from now on, so that no lookup
        answers HIT for the same bytes again."""
        raise NotImplementedError(f"tier {self.name} cannot be read by another process")

    def reserve_for_write(self, keys: Sequence[bytes]) -> list[tuple[int, np.ndarray, bytes]]:
        """Locations another process writes ``keys`` to: ``(position, location,
        digest)`` per key reserved, unreadable until :meth:`commit_write`."""
        raise NotImplementedError(f"tier {self.name} cannot be written by another process")

    def commit_write(self, key: bytes, record: int, ok: bool) -> None:
        """The write reserved for ``key`` at ``record`` ended (``ok``: it is readable)."""
        raise NotImplementedError(f"tier {self.name} cannot be written by another process")

    def close(self) -> None:
        """Release files, connections and threads. Idempotent."""

    def stats(self) -> dict[str, Any]:
        return {}
