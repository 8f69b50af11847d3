"""An engine's view of the node's shared index (csrc/core/node/shared_index.h):
its scans find and pin HITs there without a round trip, its loads of them
keep the pins until complete_load, the step's end drops the rest.

Process: the engine's scheduler. Who calls: :class:`~kvtier.node.client.
NodeManager`, under its lock, when the node offered an index at HELLO.
Nothing here blocks (atomics on a shared mapping; opening maps a small
file). The node never sees these pins: they are this engine's bits in the
index, cleared by the node when the engine's connection closes.

The bookkeeping (this step's scan pins and hits, the loads' pins, the
writes, the reserved slots) is the native ``EngineView``
(csrc/core/node/engine_view.h), which digests each key as it looks it up:
as Python dicts and a digest memo it was half of the engine's cost per key
(``kvtier bench manager --node --shared-index``, 16 keys a call).
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.errors import KvtierError
from kvtier.pool import HostPool

log = logging.getLogger("kvtier.node")


class SharedView:
    """The index mapped by one engine: ``prefix`` (its namespace's 8 bytes,
    as the node keys its blocks), ``lower``: whether the node has lower
    tiers to ask after a MISS here."""

    def __init__(self, pool: HostPool, native: Any, prefix: bytes, lower: bool) -> None:
        self.pool = pool
        self.native = native
        self.prefix = prefix
        self.lower = lower
        self.evicted: list[bytes] = []  # evicted to fill the reservation, not reported yet
        # The native calls, bound once: the manager calls them per request.
        self.scan = native.scan
        self.scan_into = native.scan_into
        self.take_loads = native.take_loads
        self.take_all_loads = native.take_all_loads
        self.pin_present = native.pin_present
        self.complete = native.complete
        self.end_step = native.end_step
        self.reserve = native.reserve
        self.add_writing = native.add_writing

    @classmethod
    def open(cls, ix: Any, prefix: bytes) -> SharedView | None:
        """The view HELLO's ``ix`` names (None when it names none or it
        cannot be mapped: the engine asks the node, as without one)."""
        if not isinstance(ix, dict):
            return None
        from kvtier._native import EngineView

        try:
            pool = HostPool.attach(str(ix["name"]))
            native = EngineView.attach(pool.native, int(ix["engine"]), prefix)
        except (KvtierError, KeyError, ValueError) as e:
            log.warning("kvtier: the node's shared index is not usable (%s): asking the node", e)
            return None
        return cls(pool, native, prefix, bool(ix.get("lower", True)))

    def close(self) -> None:
        """Unmap (the node is gone or the engine stops: its pins die with the
        connection, not here)."""
        self.native.clear()
        self.evicted.clear()
        self.pool.close()

    @property
    def reserved(self) -> int:
        """Free slots the node keeps for this engine's stores."""
        return int(self.native.reserved)

    @property
    def hits(self) -> int:
        """Keys this step's scans found here."""
        return int(self.native.hits)

    def finish(self, keys: list[bytes], success: bool) -> None:
        """This engine's stores of ``keys`` ended: when they succeeded, their
        blocks are ready here now (their bytes are complete; the node's
        COMPLETE_STORE follows), so any engine may load them at once."""
        self.native.finish(keys, success)
