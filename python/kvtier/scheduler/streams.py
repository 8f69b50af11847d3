"""Blocks the engine's worker reads from, or writes to, a lower tier itself
(streaming), with the records pinned or reserved for it meanwhile.

Process: the engine's scheduler, under the manager's lock. Who calls: the
manager facade (lookups, loads, stores and failed loads). Nothing here
blocks. Only with the ``streaming`` / ``streaming_stores`` options, for
engines whose worker streams (the vLLM shim).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.scheduler.core import Core
from kvtier.scheduler.specs import StreamSpec


class Streams:
    """Lower-tier hits reported HIT without a host slot this step, the
    records pinned for loads in flight and those reserved for worker writes."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.hits: dict[bytes, int] = {}  # key -> tier, this step
        self.pins: dict[
            tuple[Any, bytes], list[tuple[int, int]]
        ] = {}  # (req, key) -> [(tier, record)]
        self.writes: dict[bytes, tuple[int, int]] = {}  # key -> (tier, record)

    def hit(self, key: bytes, tier: int) -> None:
        """``key`` was reported HIT for the worker to read from ``tier``."""
        self.hits[key] = tier

    def tier_of(self, key: bytes) -> int | None:
        """The tier a streamed HIT of this step is read from (None: not one)."""
        return self.hits.get(key)

    def step_end(self) -> None:
        self.hits.clear()

    def in_flight(self) -> int:
        """Records pinned for loads or reserved for writes."""
        return sum(len(p) for p in self.pins.values()) + len(self.writes)

    def pin(self, keys: list[bytes], streamed: dict[int, list[int]], req: Any) -> StreamSpec:
        """Pin the records of ``keys[i]`` for ``i`` in ``streamed[tier]`` for
        request ``req``'s load, until :meth:`unpin`."""
        core = self.core
        index: list[int] = []
        tiers: list[str] = []
        locs, digs, readers = [], [], {}
        for t, pos in streamed.items():
            tier = core.lower[t]
            loc, dig = tier.pin_for_read([keys[i] for i in pos])
            for i, rec in zip(pos, loc[:, 0].tolist()):
                self.pins.setdefault((req, keys[i]), []).append((t, rec))
            spec = tier.reader_spec()
            assert spec is not None
            readers[tier.name] = spec
            index += pos
            tiers += [tier.name] * len(pos)
            locs.append(loc)
            digs.append(dig)
        core.stats.streamed += len(index)
        return StreamSpec(
            np.asarray(index, np.int64), tiers, np.concatenate(locs), b"".join(digs), readers
        )

    def unpin(self, key: bytes, req: Any) -> bool:
        """End request ``req``'s streamed load of ``key``; False when that
        load was not streamed (the key's host slot is the one to unpin)."""
        pins = self.pins.get((req, key))
        if not pins:
            return False
        t, rec = pins.pop()
        if not pins:
            del self.pins[(req, key)]
        self.core.lower[t].unpin_read([rec])
        return True

    def reserve_writes(
        self, keys: list[bytes], first: int
    ) -> tuple[list[bytes], StreamSpec | None]:
        """Records of the first lower tier another process can write, for
        ``keys`` (positions from ``first`` in the store): what got one."""
        core = self.core
        for t, tier in enumerate(core.lower):
            spec = tier.reader_spec()
            if spec is None:
                continue
            got = tier.reserve_for_write(keys)
            out = [keys[i] for i, _, _ in got]
            for k, (_, loc, _) in zip(out, got):
                self.writes[k] = (t, int(loc[0]))
            core.stats.streamed_stores += len(out)
            if not out:
                return [], None
            return out, StreamSpec(
                np.arange(first, first + len(out), dtype=np.int64),
                [tier.name] * len(out),
                np.stack([loc for _, loc, _ in got]),
                b"".join(d for _, _, d in got),
                {tier.name: spec},
            )
        return [], None

    def commit(self, key: bytes, success: bool) -> bool:
        """The worker's write of ``key`` ended; False when it was not one."""
        w = self.writes.pop(key, None)
        if w is None:
            return False
        self.core.lower[w[0]].commit_write(key, w[1], success)
        return True

    def load_failed(self, st: StreamSpec) -> None:
        """The worker's streamed reads of ``st`` failed: each tier forgets
        those records."""
        rows: dict[str, list[int]] = {}
        for n, name in enumerate(st.tiers):
            rows.setdefault(name, []).append(n)
        for tier in self.core.lower:
            mine = rows.get(tier.name)
            if mine:
                digs = b"".join(st.digests[16 * n : 16 * n + 16] for n in mine)
                tier.read_failed(st.locations[mine], digs)
