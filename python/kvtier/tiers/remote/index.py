"""What a Redis/Valkey pool holds, as its own event stream tells, kept in the
scheduler's memory so that a lookup is answered without a round trip.

Why: a lookup the remote tier cannot answer from what it learnt recently asks
the server (one pipelined EXISTS), and the engine's scheduler holds the
request back until the answer: 0.13 ms on an idle machine, 0.97 ms p50 in a
loaded engine, on every new prompt that misses the host tier (session 17's
timing of every connector call in `vllm serve`). Every engine sharing the pool
appends what it stored to the namespace's stream
(:mod:`kvtier.tiers.remote.stream`), and a watcher appends what the server
evicted or expired; reading that stream from its first entry rebuilds the set
of blocks the pool holds.

The index is *authoritative for misses* only while it is complete: the
stream was never trimmed (``entries-added`` equals its length: nothing the
pool still holds fell out of it), the index never overflowed ``capacity``,
and its reader read the stream within :data:`STALE_S`. Otherwise it answers
only what it knows present and the tier asks the server for the rest, as
before. A present answer can be stale (a value evicted with no watcher
running): the load then fails and counts as a miss, as a value evicted
between an EXISTS and its GET always did.

A clear of the namespace (SGLang's ``/clear_hicache_storage_backend``)
deletes its values and its stream, then increments its epoch
(:func:`~kvtier.tiers.remote.stream.epoch_key`). The reader checks the
epoch every :data:`_CHECK_S` and starts again when it changed; stored
entries of an older epoch are skipped (a writer's XADD can land after the
clear and name values it deleted); and the index answers nothing, present
or absent, unless the epoch was checked within :data:`STALE_S`. So every
engine forgets what a clear deleted within :data:`STALE_S` of it. What the index cannot see: a
block another engine stored in the last few milliseconds (its entry is
appended :data:`~kvtier.tiers.remote.tier.STREAM_DELAY_S` after the SET, then
read), and blocks written by engines whose stream is off
(``kvtier_pool_events`` false): turn the index off (``kvtier_pool_index``)
on a pool shared with such writers.

Process: the engine's scheduler. Who calls: :class:`~kvtier.tiers.remote.tier.RemoteTier`
(``in``, :meth:`PoolIndex.learn` under the manager's lock, never blocking);
the reader is this module's own daemon thread, which blocks on the server
(``XREAD BLOCK``) on its own connection with the GIL released.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from kvtier.tiers.base import LookupResult
from kvtier.tiers.remote.stream import decode_entry, epoch_key

__all__ = ["CAPACITY", "STALE_S", "PoolIndex", "read_epoch"]

#: Digests an index holds at most by default: 91 bytes each in a Python set
#: (measured with tracemalloc), 190 MB at most; a stream of STREAM_MAXLEN
#: entries names about a million blocks before it is trimmed (and then no
#: longer answers misses anyway).
CAPACITY = 1 << 21

#: The index answers misses only if its reader read the stream this
#: recently, and anything only if it checked the namespace's epoch this recently.
STALE_S = 2.0
_BLOCK_MS = 100  # one XREAD's wait for new entries: the reader's idle wake-ups
_COUNT = 512  # entries one XREAD returns at most
# How often the reader checks that the stream was not reset nor the
# namespace cleared: well within STALE_S, so that a reader a little late
# (its thread waiting for the GIL) still vouches for its answers.
_CHECK_S = 1.0
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2]))


def read_epoch(store: Any, stream: bytes) -> int:
    """How many times ``stream``'s namespace was cleared (its epoch key; 0
    while absent), read through ``store`` (a native ``RemoteStore``).
    Blocks for one round trip; raises what the store raises, and
    ValueError for a value that is not a number."""
    key = epoch_key(stream)
    value = store.call(key, [b"GET", key])
    return int(value) if value else 0


class PoolIndex:
    """Digests of the blocks the pool holds, from its stream ``stream`` read
    through ``store`` (a native ``RemoteStore``); at most ``capacity``.

    ``epoch``: the namespace's epoch as the caller read it (the reader reads
    it again as it starts). Starts its reader at construction; :meth:`close`
    stops it (waits at most one XREAD's block time)."""

    def __init__(self, store: Any, stream: bytes, capacity: int = CAPACITY, epoch: int = 0) -> None:
        self._store = store
        self._stream = stream
        self.capacity = capacity
        self._present: set[bytes] = set()
        self.complete = False  # set by the reader once it read the whole history
        self.overflowed = False
        self.read_at = 0.0  # monotonic time of the reader's last successful read
        self.epoch = epoch  # the namespace's epoch this index's contents belong to
        self.checked_at = 0.0  # monotonic time the reader last found the epoch unchanged
        self.entries = 0  # stream entries applied
        self.stale_entries = 0  # stored entries of an older epoch, skipped
        self.errors = 0  # reads that failed (server away): the index is stale meanwhile
        self.resets = 0  # the stream was deleted or recreated, or the namespace cleared
        self._seen_added = 0
        self._caught_up = False  # the reader reached the stream's end since _start
        self._restart = False  # restart() asked the reader to begin again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-pool-index", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._present

    def authoritative(self) -> bool:
        """Whether a digest absent from the index is absent from the pool."""
        now = time.monotonic()
        return (
            self.complete
            and self._caught_up
            and not self._restart
            and now - self.read_at < STALE_S
            and now - self.checked_at < STALE_S
        )

    def answer(self, digest: bytes) -> LookupResult | None:
        """HIT, MISS (only while :meth:`authoritative`), or None: ask the
        server. Present answers too need the epoch checked within
        :data:`STALE_S`: a clear this index has not seen yet may have
        deleted the value (its load would fail, but SGLang's existence
        query would count the page)."""
        now = time.monotonic()
        if now - self.checked_at >= STALE_S or self._restart:
            return None
        if digest in self._present:
            return _HIT
        if self.complete and self._caught_up and now - self.read_at < STALE_S:
            return _MISS
        return None

    def restart(self, epoch: int | None = None) -> None:
        """Forget, and read the stream again from its first entry (the
        tier's reset: what the pool holds may have changed under it);
        ``epoch``: the namespace's, when the caller knows it (its clear)."""
        self._restart = True
        self._caught_up = False
        self._present.clear()
        if epoch is not None:
            self.epoch = epoch

    def learn(self, digests: Iterable[bytes], present: bool) -> None:
        """What this engine saw itself: stores the server acknowledged (their
        stream entries follow), loads that found a value gone."""
        if present:
            if not self.overflowed:
                self._present.update(digests)
                self._check_size()
        else:
            self._present.difference_update(digests)

    def _check_size(self) -> None:
        if len(self._present) > self.capacity:
            # Past its budget the index stops growing and stops answering
            # misses: what it forgets may still be in the pool.
            self.overflowed = True
            self.complete = False

    # -- the reader thread -----------------------------------------------------
    def _call(self, *args: bytes) -> Any:
        return self._store.call(self._stream, list(args))

    def _added(self) -> tuple[int | None, bool]:
        """Entries the stream ever had (``entries-added``: Redis/Valkey >= 7;
        0 when there is no stream, None when the server does not say), and
        whether it still holds them all (not trimmed by MAXLEN: what fell out
        may still be in the pool)."""
        if not self._call(b"EXISTS", self._stream):
            return 0, True
        info = self._call(b"XINFO", b"STREAM", self._stream)
        fields = dict(zip(info[::2], info[1::2]))
        added = fields.get(b"entries-added")
        if not isinstance(added, int):
            return None, False
        return added, added == fields.get(b"length")

    def _start(self) -> None:
        """Reads the history again from the stream's first entry; decides
        whether it is whole (no stream yet: an empty pool, as far as the
        stream can tell)."""
        self._restart = False
        self._present.clear()
        self.entries = 0
        self._caught_up = False
        self.epoch = read_epoch(self._store, self._stream)
        self.checked_at = time.monotonic()
        added, whole = self._added()
        self._seen_added = added or 0
        self.complete = added is not None and whole and not self.overflowed

    def _reset_seen(self) -> bool:
        """Whether the namespace was cleared (its epoch changed), or the
        stream deleted or recreated (a FLUSHALL, a new server), since the
        reader began: its history starts again then. The entry count alone
        misses a stream deleted and written again within :data:`_CHECK_S`."""
        if read_epoch(self._store, self._stream) != self.epoch:
            return True
        added, _ = self._added()
        if added is None:
            return False
        if added < self._seen_added or (added == 0 and self.entries > 0):
            return True
        self._seen_added = added
        return False

    def _apply(self, entries: list[Any]) -> bytes:
        pos = b""
        present, epoch = self._present, self.epoch
        for raw_id, flat in entries:
            pos = raw_id
            ev = decode_entry(raw_id, _fields(flat))
            self.entries += 1
            if ev is None:
                continue
            if ev.removed:
                present.difference_update(ev.digests)
            elif ev.epoch < epoch:  # sent before a clear, which may have deleted them
                self.stale_entries += 1
            elif not self.overflowed:
                present.update(ev.digests)
        self._check_size()
        return pos

    def _run(self) -> None:
        pos: bytes | None = None
        checked = 0.0
        while not self._stop.is_set():
            try:
                if pos is None or self._restart:
                    self._start()
                    pos = b"0-0"
                reply = self._call(
                    b"XREAD",
                    b"COUNT",
                    str(_COUNT).encode(),
                    b"BLOCK",
                    str(_BLOCK_MS).encode(),
                    b"STREAMS",
                    self._stream,
                    pos,
                )
                now = time.monotonic()
                if reply:
                    entries = reply[0][1]
                    pos = self._apply(entries) or pos
                    self._caught_up = self._caught_up or len(entries) < _COUNT
                else:
                    self._caught_up = True
                if now - checked >= _CHECK_S:
                    checked = now
                    if self._reset_seen():
                        self.resets += 1
                        self.complete = False
                        self.restart()  # nothing answered until the history is read again
                        continue
                    self.checked_at = now
                self.read_at = now
            except Exception:  # the reader must outlive any reply
                # The server is away (IoError), or the shared stream holds
                # something malformed: the index goes stale (lookups ask the
                # server again, as they did) until a read works.
                self.errors += 1
                self._stop.wait(0.2)

    def close(self) -> None:
        """Stops the reader (waits for at most one XREAD's block time)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _BLOCK_MS / 1000 + 2.0)

    def stats(self) -> dict[str, Any]:
        return {
            "size": len(self._present),
            "complete": self.complete,
            "authoritative": self.authoritative(),
            "entries": self.entries,
            "epoch": self.epoch,
            "stale_entries": self.stale_entries,
            "errors": self.errors,
            "resets": self.resets,
        }
