"""Stores a remote tier's server acknowledged that the pool's event stream
(:mod:`kvtier.tiers.remote.stream`) has not been told of yet: collected for
:data:`STREAM_DELAY_S` so that one XADD job carries the entries of several
batches, then turned into those XADDs.

Process: the engine's scheduler. Who calls:
:class:`~kvtier.tiers.remote.tier.RemoteTier`, under the manager's lock (it
submits the XADDs as a job of its own). Pure: no I/O, never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.remote.stream import UNNAMED, xadd_commands

__all__ = ["PENDING_MAX", "STREAM_DELAY_S", "Unannounced"]

#: How long an acknowledged store may wait for its XADD, so that one job
#: carries the entries of several batches: a job per batch woke a worker
#: thread per batch and cost 5% of the store throughput at 16 KiB blocks
#: (bench/pool_events_cost.py). What a subscriber hears is late by this much.
STREAM_DELAY_S = 0.01
#: Stores acknowledged but not yet appended to the pool's stream, at most (a
#: server that refuses the XADDs must not make the tier hold every key).
PENDING_MAX = 65_536


class Unannounced:
    """Digests and event ids (``event_id`` of the key, 12 bytes, or None:
    :data:`~kvtier.tiers.remote.stream.UNNAMED`) of acknowledged stores, in
    the order they were acknowledged, all of the namespace epoch the tier
    knows now (it clears them when that changes)."""

    def __init__(self, event_id: Callable[[bytes], bytes | None]) -> None:
        self.event_id = event_id
        self.digests: list[bytes] = []
        self.ids: list[bytes] = []
        self.due = 0.0  # monotonic time by which the oldest of them must go

    def __len__(self) -> int:
        return len(self.digests)

    def add(self, keys: Sequence[bytes], digs: Sequence[bytes]) -> int:
        """Stores of ``keys`` (``digs`` their digests) acknowledged; how many
        of the oldest were dropped to keep :data:`PENDING_MAX`."""
        name, pending, ids = self.event_id, self.digests, self.ids
        if not pending:
            self.due = time.monotonic() + STREAM_DELAY_S
        pending += digs
        if name is vllm_event_id:  # never None: the common case, kept cheap
            ids += map(name, keys)
        else:
            ids += [name(k) or UNNAMED for k in keys]
        cut = max(0, len(pending) - PENDING_MAX)
        if cut:
            del pending[:cut], ids[:cut]
        return cut

    def ready(self) -> bool:
        """Whether they should go now: the oldest waited long enough, or
        half of :data:`PENDING_MAX` wait."""
        return bool(self.digests) and (
            time.monotonic() >= self.due or len(self.digests) >= PENDING_MAX // 2
        )

    def commands(
        self, stream: bytes, maxlen: int, engine: str, tier: str, epoch: int
    ) -> list[list[bytes]]:
        """The XADDs announcing them (see :func:`~kvtier.tiers.remote.stream.xadd_commands`)."""
        return xadd_commands(
            stream, maxlen, "stored", engine, tier, self.digests, self.ids, epoch=epoch
        )

    def clear(self) -> None:
        """They went out, or must not (a clear of the namespace may have
        deleted their values)."""
        self.digests.clear()
        self.ids.clear()
