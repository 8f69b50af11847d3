"""Reading a shared Redis/Valkey pool's event stream (:mod:`kvtier.tiers.remote.stream`)
and watching the removals the server makes itself.

:class:`PoolReader` tails the stream from a position, learns which event id
names which key digest (bounded: :class:`BlockNames`), and lists what the
pool holds now (``SCAN``). :class:`Watcher` turns the server's own removals
into ``removed`` entries of the stream, so every subscriber sees them: from
keyspace notifications (``notify-keyspace-events`` with ``E`` and ``x``/``e``/
``g``) where the server sends them, and from a reconciling check
(``EXISTS`` of every block the stream says is stored) every ``reconcile_s``
seconds, which also catches what a notification cannot (a notification lost
while the watcher was down, an entry that reached the stream after the
removal of its block). One watcher appends at a time (a lease key): several
may run for availability.

Process: the ``kvtier events`` command or any tool. Who calls:
:mod:`kvtier.events_cli` and the tests. Uses redis-py (``pip install redis``, in kvtier's ``bench`` and
``test`` extras). Never imported by the library. Reads block for at most
their ``block_ms``; :meth:`Watcher.step` for about one round trip per node.
"""

from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.tiers.remote.stream import (
    UNNAMED,
    PoolEvent,
    decode_entry,
    digest_of,
    lease_key,
    value_prefix,
    xadd_commands,
)
from kvtier.tiers.remote.url import parse_url, redact_url

__all__ = ["BlockNames", "PoolReader", "Watcher", "connect", "find_streams", "primaries"]

#: Digests a reader or watcher names (event ids it learnt), by default: about
#: 200 bytes each in Python, 50 MiB.
MAX_KEYS = 262_144
_CHECK_BATCH = 1000  # EXISTS per pipeline of a reconciling check


def connect(url: str, tls: dict[str, str | None] | None = None) -> Any:
    """A redis-py client of the pool at ``url`` (a remote tier's URL; ``tls``: its
    TLS settings by option name, :func:`kvtier.options.surfaces.tls_settings`):
    ``redis.Redis`` or ``redis.cluster.RedisCluster``. Blocks while it connects."""
    try:
        import redis
        from redis.cluster import ClusterNode, RedisCluster
    except ImportError:
        raise InvalidArgument(
            "kvtier events needs redis-py: pip install redis (or kvtier[bench])"
        ) from None
    cfg = parse_url(url)
    kw: dict[str, Any] = {"password": cfg["password"] or None, "username": cfg["user"] or None}
    if cfg["tls"]:
        tls = tls or {}
        kw.update(
            ssl=True,
            ssl_ca_certs=tls.get("tls_ca_file"),
            ssl_certfile=tls.get("tls_cert_file"),
            ssl_keyfile=tls.get("tls_key_file"),
        )
    try:
        if cfg["cluster"]:
            nodes = [ClusterNode(h, p) for h, p in cfg["seeds"]]  # type: ignore[no-untyped-call]
            client: Any = RedisCluster(startup_nodes=nodes, **kw)
        else:
            host, port = cfg["seeds"][0]
            client = redis.Redis(host=host, port=port, db=cfg["db"], **kw)
        client.ping()
    except redis.RedisError as e:
        raise InvalidArgument(f"cannot reach {redact_url(url)}: {e}") from None
    client.kvtier_db = cfg["db"]
    return client


def primaries(client: Any) -> list[Any]:
    """One plain client per node that holds keys (the client itself when standalone)."""
    if not hasattr(client, "get_primaries"):
        return [client]
    return [n.redis_connection for n in client.get_primaries()]


def find_streams(client: Any) -> list[bytes]:
    """The pool's event streams (one per namespace), sorted."""
    found: set[bytes] = set()
    for node in primaries(client):
        for key in node.scan_iter(match=b"kvt-events:*", count=1000, _type="stream"):
            found.add(bytes(key))
    return sorted(found)


class BlockNames:
    """Key digest -> event id, for the blocks a subscriber believes stored,
    newest last; at most ``max_keys`` (the oldest forgotten, counted in
    :attr:`forgotten`: a removal of one of those is reported unnamed)."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        if max_keys <= 0:
            raise InvalidArgument(f"max_keys must be > 0, got {max_keys}")
        self.max_keys = max_keys
        self.forgotten = 0
        self._ids: OrderedDict[bytes, bytes | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._ids

    def learn(self, event: PoolEvent) -> PoolEvent:
        """Take ``event`` into account; returns it with the ids this knows
        filled in (a removal named by its digest alone)."""
        ids = self._ids
        if event.removed:
            named = [i if i is not None else ids.get(d) for d, i in zip(event.digests, event.ids)]
            for d in event.digests:
                ids.pop(d, None)
            return PoolEvent(
                event.position,
                event.op,
                event.engine,
                event.tier,
                event.ts_ms,
                event.digests,
                named,
                event.reason,
            )
        for d, i in zip(event.digests, event.ids):
            ids[d] = i if i is not None else ids.get(d)
            ids.move_to_end(d)
        over = len(ids) - self.max_keys
        for _ in range(max(0, over)):
            ids.popitem(last=False)
            self.forgotten += 1
        return event

    def name(self, digest: bytes) -> bytes | None:
        return self._ids.get(digest)

    def digests(self) -> list[bytes]:
        return list(self._ids)


class PoolReader:
    """Reads ``stream`` of the pool ``client`` (see :func:`connect`)."""

    def __init__(self, client: Any, stream: bytes, max_keys: int = MAX_KEYS) -> None:
        self.client = client
        self.stream = stream
        self.prefix = value_prefix(stream)
        self.names = BlockNames(max_keys)

    def last_position(self) -> str:
        """The id of the newest entry (``0-0`` for an empty stream): reading
        from it returns what comes next."""
        last = self.client.xrevrange(self.stream, count=1)
        return last[0][0].decode() if last else "0-0"

    def first_position(self) -> str:
        """What reading from the oldest entry the stream still holds starts at."""
        return "0-0"

    def read(self, position: str, block_ms: int | None = None, count: int = 256) -> list[PoolEvent]:
        """Entries after ``position``, oldest first (waiting up to ``block_ms``
        for one; None: not at all), with the ids this reader knows filled in."""
        got = self.client.xread({self.stream: position}, count=count, block=block_ms)
        out = []
        for _, entries in got or ():
            for pos, fields in entries:
                ev = decode_entry(pos, fields)
                if ev is None:  # not ours: skipped, but the position moves on
                    ev = PoolEvent(_text(pos), "", "", "", 0, [], [])
                out.append(self.names.learn(ev) if ev.op else ev)
        return out

    def replay(self) -> str:
        """Learn from every entry the stream holds; the last one's position."""
        pos = self.first_position()
        while batch := self.read(pos, count=1000):
            pos = batch[-1].position
        return pos

    def snapshot(self, chunk: int = 1000) -> Iterator[list[tuple[bytes, bytes | None]]]:
        """What the pool holds now, ``(digest, event id or None)`` in chunks,
        by a ``SCAN`` of every node (a key written or removed during the scan
        may or may not be listed: read the stream from a position taken
        before the scan to catch up)."""
        batch: list[tuple[bytes, bytes | None]] = []
        for node in primaries(self.client):
            for key in node.scan_iter(match=self.prefix + b"*", count=1000):
                d = digest_of(bytes(key), self.prefix)
                if d is None:
                    continue
                batch.append((d, self.names.name(d)))
                if len(batch) >= chunk:
                    yield batch
                    batch = []
        if batch:
            yield batch


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class Watcher:
    """Appends the server's own removals of ``stream``'s blocks to it.

    ``enable``: turn keyspace notifications on (``CONFIG SET``) where they
    are off and the server allows it. Without them, removals are found by
    the reconciling check alone, within ``reconcile_s`` (and the time the
    check takes: one pipelined ``EXISTS`` per 1,000 blocks named).
    """

    def __init__(
        self,
        client: Any,
        stream: bytes,
        *,
        maxlen: int,
        engine_id: str | None = None,
        reconcile_s: float = 10.0,
        enable: bool = False,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.reader = PoolReader(client, stream, max_keys)
        self.client = client
        self.stream = stream
        self.maxlen = maxlen
        self.engine_id = engine_id or (
            f"watcher:{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        )
        self.reconcile_s = reconcile_s
        self.lease = lease_key(stream)
        self.lease_ms = int(max(3.0, 3 * reconcile_s) * 1000)
        self.position = self.reader.replay()
        self.notifying = self._subscribe(enable)
        self._next_check = time.monotonic() + reconcile_s
        self.counters = dict.fromkeys(
            ("removed", "unnamed", "checked", "not_leader", "stream_lost"), 0
        )

    def _subscribe(self, enable: bool) -> bool:
        """Subscribe to every node's expired/evicted/del key events; whether
        every node sends them."""
        import redis

        db = getattr(self.client, "kvtier_db", 0)
        self.subs = []
        all_on = True
        for node in primaries(self.client):
            try:
                flags = node.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
                on = "E" in flags and ("A" in flags or ("x" in flags and "e" in flags))
                if not on and enable:
                    node.config_set("notify-keyspace-events", "".join({*flags, "E", "x", "e", "g"}))
                    on = True
            except redis.ResponseError:  # CONFIG renamed or refused: cannot tell
                on = False
            all_on = all_on and on
            sub = node.pubsub(ignore_subscribe_messages=True)
            sub.subscribe(*(f"__keyevent@{db}__:{e}" for e in ("expired", "evicted", "del")))
            self.subs.append(sub)
        return all_on

    def _is_leader(self) -> bool:
        c, me = self.client, self.engine_id.encode()
        if c.set(self.lease, me, nx=True, px=self.lease_ms):
            return True
        if c.get(self.lease) == me:
            c.pexpire(self.lease, self.lease_ms)
            return True
        return False

    def step(self, now: float | None = None) -> int:
        """Learn new entries, turn notifications received and (when due) a
        reconciling check into removed entries; the blocks reported."""
        now = time.monotonic() if now is None else now
        while batch := self.reader.read(self.position, count=1000):  # all of it: bounded
            self.position = batch[-1].position
        gone: dict[str, list[bytes]] = {}
        prefix = self.reader.prefix
        for sub in self.subs:
            while (msg := sub.get_message(timeout=0.0)) is not None:
                if msg.get("type") != "message":
                    continue
                if bytes(msg["data"]) == self.stream:  # its history is gone (not its future)
                    self.counters["stream_lost"] += 1
                d = digest_of(bytes(msg["data"]), prefix)
                if d is not None:
                    reason = _text(msg["channel"]).rsplit(":", 1)[1]
                    gone.setdefault({"del": "deleted"}.get(reason, reason), []).append(d)
        reported = 0
        if gone:
            reported += self._report(gone, check=True)
        if now >= self._next_check:
            self._next_check = now + self.reconcile_s
            missing = self._absent(self.reader.names.digests())
            if missing:
                reported += self._report({"missing": missing}, check=False)
        return reported

    def _absent(self, digests: Sequence[bytes]) -> list[bytes]:
        """Those of ``digests`` whose values the pool does not hold."""
        out: list[bytes] = []
        prefix = self.reader.prefix
        for first in range(0, len(digests), _CHECK_BATCH):
            part = digests[first : first + _CHECK_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for d in part:
                pipe.exists(prefix + d.hex().encode())
            out += [d for d, n in zip(part, pipe.execute()) if not n]
            self.counters["checked"] += len(part)
        return out

    def _report(self, gone: dict[str, list[bytes]], check: bool) -> int:
        """Append ``gone`` (reason -> digests) as removed entries, those
        absent still when ``check`` (a block stored again since is not)."""
        if not self._is_leader():
            self.counters["not_leader"] += 1
            return 0
        n = 0
        names = self.reader.names
        for reason, digs in gone.items():
            digs = list(dict.fromkeys(digs))
            if check:
                digs = self._absent(digs)
            if not digs:
                continue
            ids = [names.name(d) or UNNAMED for d in digs]
            self.counters["unnamed"] += ids.count(UNNAMED)
            for cmd in xadd_commands(
                self.stream, self.maxlen, "removed", self.engine_id, "remote", digs, ids, reason
            ):
                self.client.execute_command(cmd[0].decode(), *cmd[1:])
            n += len(digs)
        self.counters["removed"] += n
        return n

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        if self.client.get(self.lease) == self.engine_id.encode():
            self.client.delete(self.lease)
