"""The remote tier: a Redis / Valkey pool (standalone or Redis Cluster) shared
by engine instances across nodes, driven by kvtier's native RESP client from
C++ worker threads (pipelined, zero-copy into host slots).

Who calls: the manager, under its lock. Nothing blocks but construction
(which connects, authenticates and, for a cluster, reads the slot map) and
:meth:`RemoteTier.close`. Existence checks are asynchronous: a key never seen
answers RETRY, is checked with a pipelined EXISTS batch at the next step, and
answers HIT or MISS after that.

Every value is a 64-byte header (magic, version, namespace and key digests,
length, crc32c) followed by the block; a load that fails any check, or whose
key vanished (the server's maxmemory eviction, a TTL), is a counted miss.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from kvtier.errors import Busy, ClosedError, InvalidArgument
from kvtier.policy import AdmissionFilter
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent
from kvtier.tiers.disk import _TokenBucket, key_digest, namespace_digest

MISSING, BAD_LENGTH = -5, -6


def parse_url(url: str) -> dict[str, Any]:
    """``redis://[user[:password]@]host:port[/db]`` or
    ``redis-cluster://[user[:password]@]host:port[,host:port...]``."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "redis-cluster"):
        raise InvalidArgument(
            f"remote URL must start with redis:// or redis-cluster://, got {url!r}"
        )
    netloc = parts.netloc
    user = password = ""
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if not password:  # redis://:password@host or redis://password@host
            user, password = "", user
        user, password = unquote(user), unquote(password)
    seeds = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        if not host:
            host, port = hp, "6379"
        try:
            seeds.append((host.strip("[]"), int(port)))
        except ValueError:
            raise InvalidArgument(f"bad port in remote URL {url!r}") from None
    if not seeds or not seeds[0][0]:
        raise InvalidArgument(f"no server in remote URL {url!r}")
    db = 0
    if parts.path.strip("/"):
        try:
            db = int(parts.path.strip("/"))
        except ValueError:
            raise InvalidArgument(f"bad database number in remote URL {url!r}") from None
    return {
        "seeds": seeds,
        "cluster": parts.scheme == "redis-cluster",
        "user": user,
        "password": password,
        "db": db,
    }


class RemoteTier(LowerTier):
    """Remote tier over a Redis/Valkey URL; blocks of ``block_bytes``."""

    def __init__(
        self,
        url: str,
        block_bytes: int,
        *,
        namespace: str | bytes = "default",
        name: str = "remote",
        ttl_s: float | None = None,
        timeout_s: float = 2.0,
        pipeline: int = 64,
        window_bytes: int = 512 << 10,
        num_threads: int = 2,
        inflight_bytes: int = 512 << 20,
        job_items: int = 64,
        admit_after: int = 1,
        write_budget_bps: float | None = None,
        degraded_ok: bool = False,
        negative_ttl_s: float = 1.0,
        known_capacity: int = 1 << 20,
    ) -> None:
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        if timeout_s <= 0 or pipeline <= 0 or job_items <= 0 or window_bytes <= 0:
            raise InvalidArgument("timeout_s, pipeline, window_bytes and job_items must be > 0")
        from kvtier import _native
        from kvtier.engine import Engine

        cfg = parse_url(url)
        self.url = url
        self.name = name
        self.block_bytes = block_bytes
        self.ns = namespace_digest(namespace, block_bytes)
        self._prefix = b"kvt:" + self.ns.hex()[:16].encode() + b":"
        self.store = _native.RemoteStore(
            cfg["seeds"],
            cfg["cluster"],
            cfg["user"],
            cfg["password"],
            cfg["db"],
            int(timeout_s * 1000),
            int(timeout_s * 1000),
            pipeline,
            int((ttl_s or 0) * 1000),
            degraded_ok,
            self.ns,
            window_bytes,
        )
        self.engine = Engine(num_threads, [(inflight_bytes, False)])
        self.job_items = job_items
        self.admission = AdmissionFilter(admit_after)
        self.budget = _TokenBucket(write_budget_bps)
        self.negative_ttl_s = negative_ttl_s
        self.known_capacity = known_capacity
        # digest -> (exists, when); bounded LRU
        self.known: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._exists_queue: dict[bytes, bytes] = {}  # digest -> server key
        self._exists_inflight: set[bytes] = set()
        self._tokens = itertools.count(1)
        self._jobs: dict[int, tuple[int, int]] = {}  # engine job -> (token, first index)
        self._batches: dict[int, dict[str, Any]] = {}
        self._finished: list[int] = []  # tokens whose completion poll() returns next
        self._events: list[TierEvent] = []
        self._closed = False
        self.pool = None
        self.counters = {
            k: 0
            for k in (
                "stores",
                "loads",
                "load_failures",
                "vanished",
                "corrupt",
                "io_errors",
                "server_errors",
                "exists_checks",
                "budget_skips",
                "not_admitted",
                "busy_drops",
                "bytes_written",
                "bytes_read",
            )
        }

    # -- helpers -------------------------------------------------------------
    def server_key(self, key: bytes) -> bytes:
        """The key this tier uses on the server for an engine key."""
        return self._prefix + key_digest(key).hex().encode()

    def _remember(self, dig: bytes, exists: bool) -> None:
        self._remember_all([dig], exists)

    def _remember_all(self, digs: list[bytes], exists: bool) -> None:
        now, known = time.monotonic(), self.known
        for dig in digs:
            known[dig] = (exists, now)
            known.move_to_end(dig)
        while len(known) > self.known_capacity:
            known.popitem(last=False)

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
        hit = self.known.get(dig)
        if hit is not None:
            exists, when = hit
            if exists:
                return LookupResult.HIT
            if time.monotonic() - when < self.negative_ttl_s:
                return LookupResult.MISS
        if dig not in self._exists_inflight:
            self._exists_queue[dig] = self.server_key(key)
        return LookupResult.RETRY

    def admit(self, key: bytes) -> bool:
        if not self.admission.offer(key):
            self.counters["not_admitted"] += 1
            return False
        if not self.budget.take(self.block_bytes):
            self.counters["budget_skips"] += 1
            return False
        return True

    def _submit(self, kind: str, keys: list[bytes], slots: Sequence[int], token: int) -> bool:
        n = len(keys)
        digs = self._batches[token]["digs"] = [key_digest(k) for k in keys]
        skeys = [self._prefix + d.hex().encode() for d in digs]
        if self.pool is not None and kind != "exists":
            addr = self.pool.address + np.asarray(slots, np.int64) * self.pool.slot_bytes
        else:
            addr = np.zeros(n, np.int64)
        dig_arr = np.frombuffer(b"".join(digs), np.uint8).reshape(n, 16)
        submitted = 0
        try:
            for i in range(0, n, self.job_items):
                jid = self.engine._engine.submit_remote(
                    self.store,
                    kind,
                    skeys[i : i + self.job_items],
                    addr[i : i + self.job_items],
                    self.block_bytes,
                    dig_arr[i : i + self.job_items],
                    0,
                )
                self._jobs[jid] = (token, i)
                submitted += 1
        except Busy:
            if submitted == 0:
                return False
            self._batches[token]["busy_from"] = submitted * self.job_items
        self._batches[token]["jobs"] = submitted
        return True

    def _check(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        if self._closed:
            raise ClosedError(f"{self.name} tier is closed")
        if len(keys) != len(slots):
            raise InvalidArgument(f"{len(keys)} keys but {len(slots)} slots")
        if self.pool is not None:
            if self.pool.slot_bytes < self.block_bytes:
                raise InvalidArgument("host slots are smaller than the tier's blocks")
            bad = [s for s in slots if not 0 <= s < self.pool.num_slots]
            if bad:
                raise InvalidArgument(f"host slot {bad[0]} out of range [0, {self.pool.num_slots})")

    def _start(self, kind: str, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        self._check(keys, slots)
        token = next(self._tokens)
        self._batches[token] = {"kind": kind, "keys": list(keys), "items": [0] * len(keys)}
        if self.pool is None:  # no-data mode: the index only
            self._batches[token]["jobs"] = 0
            self._finish(token)
            return token
        if not self._submit(kind, list(keys), slots, token):
            del self._batches[token]
            if kind == "store":
                self.counters["busy_drops"] += len(keys)
            return None
        return token

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        return self._start("store", keys, slots)

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        return self._start("load", keys, slots)

    def poll(self) -> list[TierCompletion]:
        if self._exists_queue and not self._closed:
            digs = list(self._exists_queue)
            skeys = [self._exists_queue[d] for d in digs]
            self._exists_queue.clear()
            token = next(self._tokens)
            self._batches[token] = {
                "kind": "exists",
                "keys": skeys,
                "digs": digs,
                "items": [0] * len(digs),
                "issued": time.monotonic(),
            }
            try:
                n = len(digs)
                arr = np.frombuffer(b"".join(digs), np.uint8).reshape(n, 16)
                for i in range(0, n, 1024):
                    jid = self.engine._engine.submit_remote(
                        self.store,
                        "exists",
                        skeys[i : i + 1024],
                        np.zeros(len(skeys[i : i + 1024]), np.int64),
                        self.block_bytes,
                        arr[i : i + 1024],
                        0,
                    )
                    self._jobs[jid] = (token, i)
                self._batches[token]["jobs"] = -(-n // 1024)
                self._exists_inflight.update(digs)
                self.counters["exists_checks"] += n
            except Busy:
                del self._batches[token]
                for d, k in zip(digs, skeys):
                    self._exists_queue[d] = k
        for r in self.engine.poll():
            token, first = self._jobs.pop(r.job_id)
            b = self._batches[token]
            items = list(r.items)
            if not items and not r.ok:  # cancelled before it ran
                items = [125] * min(len(b["items"]) - first, self.job_items)
            b["items"][first : first + len(items)] = items
            b["jobs"] -= 1
            if b["jobs"] == 0:
                busy_from = b.get("busy_from")
                if busy_from:
                    b["items"][busy_from:] = [16] * (len(b["items"]) - busy_from)
                self._finish(token)
        out = []
        for token in self._finished:
            c = self._batches.pop(token)["completion"]
            if c is not None:
                out.append(c)
        self._finished.clear()
        return out

    def _finish(self, token: int) -> None:
        b = self._batches[token]
        kind, items = b["kind"], b["items"]
        if kind == "exists":
            known, issued = self.known, b["issued"]
            for d, code in zip(b["digs"], items):
                self._exists_inflight.discard(d)
                seen = known.get(d)
                if seen is not None and seen[1] > issued:
                    # A store or load that ended after this check was sent
                    # knows better (the check may have run before its SET).
                    continue
                # A failed check (server down) counts as absent for a while.
                self._remember(d, code == 0)
            b["completion"] = None
            self._finished.append(token)
            return
        keys = b["keys"]
        ok = [code == 0 for code in items]
        digs = b.get("digs") or [key_digest(k) for k in keys]
        if all(ok):  # the common case, kept cheap: it runs for every block moved
            self._remember_all(digs, True)
            n = len(keys)
            self.counters["stores" if kind == "store" else "loads"] += n
            self.counters["bytes_written" if kind == "store" else "bytes_read"] += (
                n * self.block_bytes
            )
            if kind == "store":
                self._events.append(TierEvent(list(keys), self.name, removed=False))
            b["completion"] = TierCompletion(token, True, kind, keys, key_ok=ok)
            self._finished.append(token)
            return
        done: list[bytes] = []
        for key, dig, code in zip(keys, digs, items):
            if code == 0:
                self._remember(dig, True)
                done.append(key)
                self.counters["stores" if kind == "store" else "loads"] += 1
                self.counters["bytes_written" if kind == "store" else "bytes_read"] += (
                    self.block_bytes
                )
                continue
            if kind == "load":
                self.counters["load_failures"] += 1
                if code in (MISSING,):
                    self.counters["vanished"] += 1
                elif code < 0 and code != -7:
                    self.counters["corrupt"] += 1
                if code < 0:
                    self._remember(dig, False)  # gone or not ours: a miss from now on
                    self._events.append(TierEvent([key], self.name, removed=True))
                else:
                    self.known.pop(dig, None)
            if code > 0:
                self.counters["io_errors"] += 1
            elif code == -7:
                self.counters["server_errors"] += 1
        if kind == "store" and done:
            self._events.append(TierEvent(done, self.name, removed=False))
        b["completion"] = TierCompletion(token, all(ok), kind, keys, key_ok=ok)
        self._finished.append(token)

    def take_events(self) -> list[TierEvent]:
        ev, self._events = self._events, []
        return ev

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._exists_queue) or bool(self._finished)

    def reset(self) -> None:
        self.known.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        self.poll()

    def stats(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "nodes": self.nodes,
            "known": len(self.known),
            "redirects": int(self.store.redirects),
            **self.counters,
        }
