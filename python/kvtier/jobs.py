"""One completion primitive: jobs made of parts, and memory a timed-out part
still holds until it is released.

Process: any (the scheduler's tiers, the worker's transfers and stream
loader, the vLLM shim's worker). Who calls: every layer that splits its own
jobs into jobs of a lower layer (engine jobs, per-group transfers, per-stage
tier batches) and must report them whole. Nothing here blocks, and nothing
is thread-safe: each user calls it from one thread, or under its own lock.

A *parent* job is made of *parts*, each covering items ``[first, first +
count)`` of the parent. A parent ends when its last part's result is in
(:meth:`Joined.done` says which parent ended; :meth:`Joined.take` hands its
parts back in item order). Submission may stop part way (a queue full):
:meth:`Joined.seal` with ``missing_from`` marks the items never submitted,
and a parent sealed with no part ends at once. A part that timed out while
the device may still touch its memory is *held*: :meth:`Joined.release`
names it when its late end is reported, so its memory is reused only then.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)  # a parent job's id
S = TypeVar("S", bound=Hashable)  # a part's id
R = TypeVar("R")  # a part's result


@dataclass
class Part(Generic[S, R]):
    """One part of a parent job: its items and, once it ended, its result."""

    sub: S
    first: int = 0
    count: int = 1
    result: R | None = None
    ended: bool = False


@dataclass
class _Parent(Generic[S, R]):
    parts: list[Part[S, R]] = field(default_factory=list)
    left: int = 0
    sealed: bool = False
    missing_from: int | None = None


@dataclass(frozen=True)
class Ended(Generic[P, S, R]):
    """A parent job whose every part ended: its parts in item order and the
    first item never submitted (None: all were)."""

    parent: P
    parts: list[Part[S, R]]
    missing_from: int | None

    @property
    def results(self) -> list[R]:
        return [p.result for p in self.parts if p.result is not None]


class Joined(Generic[P, S, R]):
    """Parent jobs, their parts in flight, and the parts held after a timeout.

    Parents come back from :meth:`take_ended` in the order they ended."""

    def __init__(self) -> None:
        self._parents: dict[P, _Parent[S, R]] = {}
        self._owner: dict[S, tuple[P, Part[S, R]]] = {}
        self._held: dict[S, tuple[P, Part[S, R]]] = {}
        self._ended: list[Ended[P, S, R]] = []

    def add(self, parent: P, sub: S, first: int = 0, count: int = 1) -> None:
        """Part ``sub`` (an id unique among the parts in flight) of
        ``parent`` was submitted; ``parent`` is opened by its first part."""
        p = self._parents.setdefault(parent, _Parent())
        if p.sealed:
            raise RuntimeError(f"job {parent!r} is sealed: no part may be added")
        if sub in self._owner:
            raise RuntimeError(f"part {sub!r} is already in flight")
        part: Part[S, R] = Part(sub, first, count)
        p.parts.append(part)
        p.left += 1
        self._owner[sub] = (parent, part)

    def seal(self, parent: P, missing_from: int | None = None) -> None:
        """Every part of ``parent`` was added (``missing_from``: items from
        there on were never submitted); a parent without parts ends now."""
        p = self._parents.setdefault(parent, _Parent())
        p.sealed, p.missing_from = True, missing_from
        if p.left == 0:
            self._end(parent, p)

    def done(self, sub: S, result: R, held: bool = False) -> P | None:
        """Part ``sub`` ended with ``result`` (``held``: it timed out and may
        still touch its memory, see :meth:`release`). The parent's id when
        this ended it, else None; None too for a part not in flight."""
        got = self._owner.pop(sub, None)
        if got is None:
            return None
        parent, part = got
        part.result, part.ended = result, True
        if held:
            self._held[sub] = got
        p = self._parents[parent]
        p.left -= 1
        if p.left == 0 and p.sealed:
            self._end(parent, p)
            return parent
        return None

    def release(self, sub: S) -> tuple[P, Part[S, R]] | None:
        """The held part ``sub`` really ended: its memory may be reused.
        Its parent and part, or None when it was not held."""
        return self._held.pop(sub, None)

    def take_ended(self) -> list[Ended[P, S, R]]:
        """Parents that ended since the last call, in the order they ended."""
        out, self._ended = self._ended, []
        return out

    def part(self, sub: S) -> tuple[P, Part[S, R]] | None:
        """Part ``sub`` in flight and its parent (None: not in flight)."""
        return self._owner.get(sub)

    def held_parts(self) -> list[tuple[P, Part[S, R]]]:
        """Parts held after a timeout, with their parents."""
        return list(self._held.values())

    def parent_of(self, sub: S) -> P | None:
        got = self._owner.get(sub)
        return None if got is None else got[0]

    def subs(self, parent: P) -> list[S]:
        """The parts of ``parent`` still in flight."""
        p = self._parents.get(parent)
        return [] if p is None else [x.sub for x in p.parts if not x.ended]

    def in_flight(self) -> list[S]:
        """Every part still in flight."""
        return list(self._owner)

    def __contains__(self, parent: object) -> bool:
        return parent in self._parents

    def __len__(self) -> int:
        """Parents open (not ended and taken)."""
        return len(self._parents)

    @property
    def held(self) -> int:
        """Parts held after a timeout, not yet released."""
        return len(self._held)

    def busy(self) -> bool:
        """A part in flight, a parent ended but not taken, or a part held."""
        return bool(self._owner or self._ended or self._held)

    def _end(self, parent: P, p: _Parent[S, R]) -> None:
        del self._parents[parent]
        p.parts.sort(key=lambda x: x.first)
        self._ended.append(Ended(parent, p.parts, p.missing_from))
