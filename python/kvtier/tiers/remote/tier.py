"""The remote tier: a Redis / Valkey pool (standalone or Redis Cluster) shared
by engine instances across nodes, driven by kvtier's native RESP client from
C++ worker threads (pipelined, zero-copy into host slots).

Who calls: the manager, under its lock. Nothing blocks but construction
(which connects, authenticates and, for a cluster, reads the slot map) and
:meth:`RemoteTier.close` and :meth:`RemoteTier.wait`. A lookup the pool's
index (below) cannot answer is asynchronous: RETRY, then a pipelined EXISTS
at the next step, then HIT or MISS; or the manager probes it
(:meth:`RemoteTier.submit_probe`): a GET straight into a host slot.

``rediss://`` (and ``rediss-cluster://``) connect with TLS: the server's
certificate is verified against ``tls_ca_file`` (default: OpenSSL's system
store) and must name the host (or ``tls_server_name``); ``tls_cert_file`` and
``tls_key_file`` give a client certificate to servers that ask for one. A
certificate that does not verify is a :class:`~kvtier.errors.TlsError` naming
the URL and OpenSSL's reason. A user and password in the URL authenticate every
connection (``AUTH user password``, an ACL user), cluster redirects included.

With ``pool_events`` (on by default) every store the server acknowledged is
also appended to the pool's event stream (:mod:`kvtier.tiers.remote.stream`),
one ``XADD`` per batch of stores, so that one subscriber (``kvtier events``)
learns what the whole pool holds, whichever engine wrote it; the tier reads
it too (:mod:`kvtier.tiers.remote.index`) to answer lookups without asking.

A clear of the namespace (SGLang's) increments its epoch: a tier forgets
what it learnt of the pool before it, and stream entries carry their epoch.

Every value is a 64-byte header (magic, version, namespace and key digests,
length, crc32c) followed by the block; a load that fails any check, or whose
key vanished (the server's maxmemory eviction, a TTL), is a counted miss.

Process: the engine's scheduler (the worker side: :mod:`kvtier.tiers.remote.worker`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier._lazy import lazy_getattr
from kvtier.codes import ItemStatus
from kvtier.errors import InvalidArgument, IoError, TlsError
from kvtier.options.tiers import RemoteOptions
from kvtier.policy.admission import WriteGate
from kvtier.pool import HostPool
from kvtier.tiers.base import LookupResult, TierCompletion, TierEvent
from kvtier.tiers.events import vllm_event_id
from kvtier.tiers.jobs import Batch, JobTier, count_moved
from kvtier.tiers.records import key_digest, namespace_digest
from kvtier.tiers.remote.announce import STREAM_DELAY_S, Unannounced
from kvtier.tiers.remote.index import PoolIndex, read_epoch
from kvtier.tiers.remote.known import KnownKeys
from kvtier.tiers.remote.stream import stream_key
from kvtier.tiers.remote.url import (
    TLS_FIELDS,
    RemoteConnection,
    check_tls_options,
    default_connections,
    parse_url,
    redact_url,
)

if TYPE_CHECKING:
    from kvtier.tiers.remote.worker import RemoteReaderSpec

__all__ = ["STREAM_DELAY_S", "RemoteTier"]

_RESETS = (errno.ECONNRESET, errno.EPIPE)
_EXISTS_PER_JOB = 1024  # an EXISTS pipeline moves no payload: large jobs are cheap
# The tier's own counters (stats()), beside every job tier's.
_COUNTERS = (
    ("load_failures", "vanished", "corrupt", "io_errors", "server_errors", "exists_checks")
    + ("budget_skips", "not_admitted", "probes", "probe_misses")
    + ("pool_events", "pool_event_failures", "pool_events_dropped")
)


class RemoteTier(JobTier):
    """Remote tier over a Redis/Valkey URL; blocks of ``block_bytes``. Its
    settings are a :class:`~kvtier.options.tiers.RemoteOptions` (``options``,
    or that class's fields given as keywords, which override it).

    ``num_threads`` connections (default :func:`default_connections`), each
    served by one worker thread of the tier's engine, at niceness
    ``worker_nice`` (default :func:`kvtier.engine.io_nice`: ``KVTIER_IO_NICE``
    or 10; 0 to compete with the engine's threads on equal terms).
    ``event_log_keys``: see :class:`~kvtier.tiers.events.EventLog`.

    ``pool_events``: the pool's event stream keeps about this many entries
    (:data:`~kvtier.tiers.remote.stream.STREAM_MAXLEN`; 0: append nothing).
    ``engine_id`` names this engine in it (default ``host:pid``);
    ``event_id`` names a block by its key there (12 bytes, or None:
    :func:`~kvtier.tiers.events.vllm_event_id`). ``pool_index`` (default:
    with ``pool_events``): lookups answered by :class:`~kvtier.tiers.remote.index.PoolIndex`."""

    can_probe = True

    @classmethod
    def from_options(
        cls,
        options: RemoteOptions,
        block_bytes: int,
        *,
        namespace: str | bytes,
        name: str = "remote",
    ) -> RemoteTier:
        """The tier ``options`` describe (their ``url`` must be set). Blocks while it connects."""
        if options.url is None:
            raise InvalidArgument("RemoteOptions.url is None: no remote tier configured")
        return cls(options.url, block_bytes, namespace=namespace, name=name, options=options)

    def __init__(
        self,
        url: str,
        block_bytes: int,
        *,
        namespace: str | bytes = "default",
        name: str = "remote",
        event_id: Callable[[bytes], bytes | None] = vllm_event_id,
        options: RemoteOptions | None = None,
        **settings: Any,
    ) -> None:
        # ``settings``: fields of RemoteOptions, a keyword convenience over ``options``.
        o = replace(options or RemoteOptions(), url=url, **settings)
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        self.options = o
        from kvtier import _native
        from kvtier.engine import Engine, io_nice

        nice = io_nice(o.worker_nice)  # checked before connecting
        cfg = parse_url(url)
        tls = {f: getattr(o, f) for f in TLS_FIELDS}
        check_tls_options(url, cfg, tls)
        self._tier_init(name, *_COUNTERS, event_log_keys=o.event_log_keys)
        self.url = redact_url(url)
        self.block_bytes = block_bytes
        self.ns = namespace_digest(namespace, block_bytes)
        self._prefix = b"kvt:" + self.ns.hex()[:16].encode() + b":"
        self.pool_events = o.pool_events
        self.stream = stream_key(self._prefix) if o.pool_events else None
        self.engine_id = o.engine_id or f"{socket.gethostname()}:{os.getpid()}"
        self.event_id = event_id
        self._unannounced = Unannounced(event_id)
        # What opens a client to the same pool, here and in an engine worker
        # that streams blocks itself (RemoteIO).
        ms = int(o.timeout_s * 1000)
        self.connection = RemoteConnection(
            tuple(cfg["seeds"]),
            cfg["cluster"],
            cfg["user"],
            cfg["password"],
            cfg["db"],
            ms,
            ms,
            o.pipeline,
            int((o.ttl_s or 0) * 1000),
            o.degraded_ok,
            self.ns,
            o.window_bytes,
            cfg["tls"],
            tuple(v or "" for v in tls.values()),
        )
        self.timeout_s = o.timeout_s
        try:
            self.store = self.connection.open_store()
        except IoError as e:
            # TLS 1.3 ends the handshake before the server checks the client
            # certificate: a refusal may arrive as a reset of the first command
            # rather than as the server's alert (which one comes first is a race).
            if not cfg["tls"] or isinstance(e, TlsError) or e.errno not in _RESETS:
                raise
            raise TlsError(
                e.errno,
                (
                    f"TLS with {self.url} failed: the server closed the connection right after "
                    f"the handshake (it wants a client certificate, or refused this one): {e.strerror}"
                ),
            ) from None
        self.num_threads = o.num_threads or default_connections()
        # Background I/O yields the CPU to the engine's threads and to a
        # server on the same machine (see Engine).
        self.engine = Engine(self.num_threads, [(o.inflight_bytes, False)], nice)
        self._value_bytes = block_bytes + int(_native.REMOTE_HEADER_BYTES)
        self.job_items = o.job_items
        self.gate = WriteGate(o.admit_after, o.write_budget_bps)
        # Off unless the engine survives a failed read (the vLLM shim's
        # connector recomputes; vLLM's own worker asserts success): a value
        # can vanish between the existence check and a worker's read, or a
        # write meet a server gone. Promotion checks bytes before HIT.
        self.worker_io = o.worker_io
        self.known = KnownKeys(o.known_ttl_s, o.negative_ttl_s, o.known_capacity)
        self._exists_queue: dict[bytes, bytes] = {}  # digest -> server key
        self._exists_inflight: set[bytes] = set()
        self.jobs.engine = self.engine
        # The namespace's epoch as this tier knows it (kept by its index); 0
        # when unread (server away): readers may skip its entries (misses only).
        self.epoch = 0
        with contextlib.suppress(OSError, ValueError):
            self.epoch = read_epoch(self.store, self.stream) if self.stream else 0
        on = bool(o.pool_events) if o.pool_index is None else o.pool_index
        self.index = (
            PoolIndex(self.store, self.stream, epoch=self.epoch) if on and self.stream else None
        )

    # -- helpers -------------------------------------------------------------
    def server_key(self, key: bytes) -> bytes:
        """The key this tier uses on the server for an engine key."""
        return self._prefix + key_digest(key).hex().encode()

    def attach(self, pool: Any) -> None:
        self.pool = pool
        if pool is not None:
            self.engine.register_pool(pool)

    @property
    def nodes(self) -> list[str]:
        return list(self.store.nodes)

    # -- tier interface --------------------------------------------------------
    def lookup(self, key: bytes) -> LookupResult:
        dig = key_digest(key)
        learnt = self.known.answer(dig)
        if learnt is not None:
            return learnt
        if self.index is not None and (said := self.index.answer(dig)) is not None:
            return said
        if dig not in self._exists_inflight:
            self._exists_queue[dig] = self.server_key(key)
        return LookupResult.RETRY

    def admit(self, key: bytes) -> bool:
        return self.gate.admit(key, self.block_bytes, self.counters)

    def _submit(
        self,
        batch: Batch,
        skeys: list[bytes],
        digs: list[bytes],
        addr: np.ndarray,
        per_job: int,
        fences: np.ndarray | None = None,
    ) -> bool:
        """Jobs of at most ``per_job`` keys for ``batch`` (see TierJobs.submit)."""
        n = len(digs)
        dig_arr = np.frombuffer(b"".join(digs), np.uint8).reshape(n, 16)
        engine = self.engine
        kind = "load" if batch.kind == "probe" else batch.kind  # a probe is a GET

        def submit_one(first: int, count: int) -> int:
            end = first + count
            return engine.submit_remote(
                self.store,
                kind,
                skeys[first:end],
                addr[first:end],
                self.block_bytes,
                dig_arr[first:end],
                fences=None if fences is None else fences[first:end],
            )

        return self.jobs.submit(batch, per_job, submit_one, self._value_bytes)

    def _start(
        self,
        kind: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        armed: np.ndarray | None = None,
    ) -> int | None:
        self._check(keys, slots)
        digs = [key_digest(k) for k in keys]
        n = 0 if self.pool is None else len(keys)
        batch = self.jobs.batch(kind, n, keys=list(keys), digs=digs, epoch=self.epoch)
        if self.pool is None:  # no-data mode: the index only
            self.jobs.end_now(batch)
            return batch.token
        skeys = [self._prefix + d.hex().encode() for d in digs]
        addr = self.pool.address + np.asarray(slots, np.int64) * self.pool.slot_bytes
        # A batch is spread over every connection: one job per worker thread
        # (at most job_items keys each) rather than whole jobs of job_items.
        per_job = min(self.job_items, -(-len(keys) // self.num_threads))
        fences = None if armed is None else self.pool.fences(np.asarray(slots, np.int64), armed)
        if not self._submit(batch, skeys, digs, addr, per_job, fences):
            if kind == "store":
                self.counters["busy_drops"] += len(keys)
            return None
        if kind == "probe":
            self.counters["probes"] += len(keys)
            for d in digs:  # answered by the probe: no EXISTS for them
                self._exists_queue.pop(d, None)
        return batch.token

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        return self._start("store", keys, slots)

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        return self._start("load", keys, slots)

    @property
    def can_fence(self) -> bool:  # type: ignore[override]
        return isinstance(getattr(self, "pool", None), HostPool)

    def submit_fenced_load(
        self, keys: Sequence[bytes], slots: Sequence[int], armed: np.ndarray
    ) -> int | None:
        """See :meth:`LowerTier.submit_fenced_load`: the native store settles
        each job's fences when that job ends (a batch is one job per
        connection, so the first values are ready while later ones are read)."""
        if not self.can_fence:
            return None
        return self._start("load", keys, slots, np.asarray(armed, np.int64))

    def submit_probe(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        """GETs of ``keys`` straight into host ``slots``, checked like a load
        (header, digests, crc32c): a key the server does not hold is a nil
        reply, as cheap as an EXISTS, and ends as a plain miss (counted in
        ``probe_misses``, remembered absent for ``negative_ttl_s``), not as
        a vanished value. A token, or None when busy (nothing queued)."""
        return self._start("probe", keys, slots)

    # -- I/O by another process (an engine worker streaming blocks) -------------
    def reader_spec(self) -> RemoteReaderSpec | None:
        """What a :class:`~kvtier.tiers.remote.worker.RemoteIO` in another
        process needs (None without data, or unless built with ``worker_io``)."""
        if not self.worker_io or getattr(self, "pool", None) is None:
            return None
        from kvtier.tiers.remote.worker import RemoteReaderSpec

        return RemoteReaderSpec(self.connection, self.block_bytes, self._prefix, self.timeout_s)

    def pin_for_read(self, keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
        """Digests of ``keys`` (the server holds no pins: a value evicted
        meanwhile fails its read, which the engine recomputes)."""
        return np.zeros((len(keys), 3), np.int64), b"".join(key_digest(k) for k in keys)

    def unpin_read(self, records: Sequence[int]) -> None:
        return None

    def read_failed(self, locations: np.ndarray, digests: bytes) -> None:
        """Absent for ``negative_ttl_s``; then an existence check asks again
        (the value may have been written anew meanwhile)."""
        digs = [digests[i : i + 16] for i in range(0, len(digests), 16)]
        self.counters["load_failures"] += len(digs)
        self.known.remember(digs, False)

    def reserve_for_write(self, keys: Sequence[bytes]) -> list[tuple[int, np.ndarray, bytes]]:
        """Every admitted key: the worker writes it under its digest. Record
        (location[0], which the worker ignores): the namespace's epoch now."""
        loc = np.array([self.epoch, 0, 0], np.int64)
        return [(i, loc, key_digest(k)) for i, k in enumerate(keys) if self.admit(k)]

    def commit_write(self, key: bytes, record: int, ok: bool) -> None:
        if ok:
            count_moved(self.counters, "store", 1, self.block_bytes)
            self._events.append(TierEvent([key], self.name, removed=False))
            if record == self.epoch:  # else a clear since may have deleted it
                dig = key_digest(key)
                self.known.remember([dig], True)
                self._note_stored([key], [dig])
        else:
            self.counters["io_errors"] += 1

    def submit_checks(self) -> int | None:
        if not self._exists_queue or self._closed:
            return None
        return self._check_exists()

    def _check_exists(self) -> int | None:
        """One pipelined EXISTS batch for the keys lookups asked about since
        the last step; under backpressure they wait for the next one."""
        digs = list(self._exists_queue)
        skeys = [self._exists_queue[d] for d in digs]
        self._exists_queue.clear()
        batch = self.jobs.batch(
            "exists", len(digs), digs=digs, skeys=skeys, issued=time.monotonic(), epoch=self.epoch
        )
        if not self._submit(batch, skeys, digs, np.zeros(len(digs), np.int64), _EXISTS_PER_JOB):
            self._exists_queue.update(zip(digs, skeys))
            return None
        self._exists_inflight.update(digs)
        self.counters["exists_checks"] += len(digs)
        return batch.token

    def poll(self) -> list[TierCompletion]:
        self.known.expire()
        if self.index is not None and self.index.epoch != self.epoch:
            self._forget(self.index.epoch)  # another engine cleared the namespace
        # Called on every engine step; most steps have nothing in flight.
        if not (self._exists_queue or self._unannounced or self.jobs.busy()):
            return []
        self.submit_checks()
        ended, _ = self.jobs.poll()  # no deadlines here: no job is ever held
        out: list[TierCompletion] = []
        for b in ended:
            if b.kind == "exists":
                self._finish_exists(b)
            elif b.kind == "events":
                self._finish_events(b)
            else:
                out.append(self._finish(b))
        if self._unannounced.ready():
            self._append_stored()
        return out

    # -- the pool's event stream ---------------------------------------------
    def _note_stored(self, keys: Sequence[bytes], digs: Sequence[bytes]) -> None:
        """Blocks the server acknowledged: appended to the pool's stream by
        the first poll :data:`STREAM_DELAY_S` later (one XADD per
        :data:`ENTRY_BLOCKS` of them)."""
        if self.index is not None:
            self.index.learn(digs, True)
        if self.stream is not None:
            self.counters["pool_events_dropped"] += self._unannounced.add(keys, digs)

    def _append_stored(self) -> None:
        """One job of XADDs (on the worker threads, after the SETs were
        answered) for what :meth:`_note_stored` collected; under
        backpressure they wait for the next poll."""
        if self._closed or self.stream is None:
            return
        un = self._unannounced  # stores of this epoch only (_forget)
        cmds = un.commands(self.stream, self.pool_events, self.engine_id, self.name, self.epoch)
        n = len(cmds)
        batch = self.jobs.batch("events", n, blocks=len(un))
        stream = self.stream

        def submit_one(first: int, count: int) -> int:
            return self.engine.submit_remote(
                self.store,
                "command",
                [stream] * count,
                np.zeros(count, np.int64),
                0,
                np.zeros((count, 16), np.uint8),
                commands=cmds[first : first + count],
            )

        if self.jobs.submit(batch, n, submit_one):
            un.clear()

    def _finish_events(self, b: Batch) -> None:
        failed = sum(1 for code in b.items if code != 0)
        self.counters["pool_events"] += b.n - failed
        self.counters["pool_event_failures"] += failed

    def _finish_exists(self, b: Batch) -> None:
        known, issued = self.known, b.data["issued"]
        answered: tuple[list[bytes], list[bytes]] = ([], [])  # absent, present
        fresh = b.data["epoch"] == self.epoch
        for d, skey, code in zip(b.data["digs"], b.data["skeys"], b.items):
            self._exists_inflight.discard(d)
            if code == ItemStatus.BUSY or (code == 0 and not fresh):
                # Never sent, or found before a clear: ask again at the next step.
                self._exists_queue[d] = skey
                continue
            if known.learnt_after(d, issued):
                # A store or load that ended after this check was sent
                # knows better (the check may have run before its SET).
                continue
            # A failed check (server down) counts as absent for a while.
            answered[code == 0].append(d)
        known.remember(answered[0], False)
        known.remember(answered[1], True)

    def _finish(self, b: Batch) -> TierCompletion:
        kind, keys, digs = b.kind, b.data["keys"], b.data["digs"]
        items = b.items if b.n else [0] * len(keys)  # no-data mode: every key as asked
        ok = [code == 0 for code in items]
        # Else begun before a clear, which may have deleted what it wrote or found.
        fresh = b.data["epoch"] == self.epoch
        if all(ok):  # the common case, kept cheap: it runs for every block moved
            if fresh:
                self.known.remember(digs, True)
            count_moved(self.counters, kind, len(keys), self.block_bytes)
            if kind == "store":
                self._events.append(TierEvent(list(keys), self.name, removed=False))
                if fresh:
                    self._note_stored(keys, digs)
            return TierCompletion(b.token, True, kind, keys, key_ok=ok)
        done: list[bytes] = []
        done_digs: list[bytes] = []
        missing = [kind == "probe" and code == ItemStatus.MISSING for code in items]
        for key, dig, code, absent in zip(keys, digs, items, missing):
            if code == 0:
                if fresh:
                    self.known.remember([dig], True)
                done.append(key)
                done_digs.append(dig)
                continue
            if absent:  # a probe of a key never stored (or gone): a plain miss
                self.counters["probe_misses"] += 1
                self.known.remember([dig], False)
                continue
            if kind != "store":
                # A GET never sent (BUSY part way) is asked again. A value gone or
                # not ours is a miss from now on; one the server did not answer,
                # for a while, as after a failed EXISTS check (no request waits on
                # a dead server; forgotten, a load's key was named HIT again by the
                # pool's index: a soak failed 16,400 promotions while Redis was down).
                if code == ItemStatus.BUSY:
                    self.known.pop(dig, None)
                else:
                    self.known.remember([dig], False)
                if kind != "probe" or code < 0:
                    self.counters["load_failures"] += 1
                    if code == ItemStatus.MISSING:  # evicted by the server, expired
                        self.counters["vanished"] += 1
                    elif code < 0 and code != ItemStatus.SERVER_ERROR:
                        self.counters["corrupt"] += 1
                    if code < 0:
                        if self.index is not None:
                            self.index.learn((dig,), False)
                        self._events.append(TierEvent([key], self.name, removed=True))
            if code > 0:
                self.counters["io_errors"] += 1
            elif code == ItemStatus.SERVER_ERROR:
                self.counters["server_errors"] += 1
        count_moved(self.counters, kind, len(done), self.block_bytes)
        if kind == "store" and done:
            self._events.append(TierEvent(done, self.name, removed=False))
            if fresh:
                self._note_stored(done, done_digs)
        # What a connection failed with (positive codes are errnos), once each.
        error = "; ".join(
            f"{errno.errorcode.get(c, str(c))}: {os.strerror(c)}"
            for c in sorted({int(c) for c in items if c > 0})
        )
        return TierCompletion(
            b.token,
            all(ok),
            kind,
            keys,
            error=error,
            key_ok=ok,
            missing=missing if any(missing) else None,
        )

    def has_pending_work(self) -> bool:
        return self.jobs.busy() or bool(self._exists_queue) or bool(self._unannounced)

    def close(self) -> None:
        """As :meth:`JobTier.close`, after the stores in flight ended and their
        entries reached the pool's stream (for at most twice ``timeout_s``)."""
        if not self._closed and self.stream is not None:
            deadline = time.monotonic() + 2 * self.timeout_s
            while (self.jobs.busy() or self._unannounced) and time.monotonic() < deadline:
                self.poll()
                time.sleep(0.001)
        if self.index is not None:
            self.index.close()
        super().close()

    def reset(self) -> None:
        self.known.clear()
        if self.index is not None:
            self.index.restart()

    def cleared(self, epoch: int) -> None:
        """The SGLang backend's clear deleted this namespace's values and stream
        and made its epoch ``epoch``: forget (others' tiers learn of it from their
        index, :data:`~kvtier.tiers.remote.index.STALE_S` at most). Non-blocking."""
        self._forget(epoch)
        if self.index is not None:
            self.index.restart(epoch)

    def _forget(self, epoch: int) -> None:
        """Forget what was learnt of the pool: the namespace is at ``epoch`` now."""
        self.epoch = epoch
        self.known.clear()
        self._unannounced.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "nodes": self.nodes,
            "known": len(self.known),
            "redirects": int(self.store.redirects),
            "events_dropped": self._events.dropped,
            "stream": None if self.stream is None else self.stream.decode(),
            "epoch": self.epoch,
            "index": None if self.index is None else self.index.stats(),
            **self.counters,
        }


# RemoteIO moved to remote_worker (which imports this module): the old names resolve.
__getattr__ = lazy_getattr(
    __name__, dict.fromkeys(("RemoteIO", "RemoteReaderSpec"), "kvtier.tiers.remote.worker")
)
