"""The disk tier: a slab store on local NVMe, read and written by C++ worker
threads through io_uring (or pread/pwrite), never under the GIL.

Who calls: the manager, under its lock, once per step (``poll``) and when it
cascades or promotes. Nothing here blocks except construction (directory
checks, preallocation, index recovery) and :meth:`DiskTier.close`.

Layout of ``DIR/kvtier-<namespace>/``: ``slab-NNN.dat`` extent files of
fixed-size records (payload + 4 KiB trailer holding magic, version, namespace
and key digests, length and crc32c), ``index.journal`` (append-only, one
entry per committed or dropped record) and ``index.ckpt`` (a snapshot that
bounds the journal). A record enters the journal only after its data write
completed, and every load re-checks the trailer, so a crash can lose recent
blocks but never serve wrong bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
import struct
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import Busy, InvalidArgument, IoError
from kvtier.policy import AdmissionFilter, make_policy
from kvtier.tiers.base import LookupResult, LowerTier, TierCompletion, TierEvent

TRAILER_BYTES = 4096
_JOURNAL = struct.Struct("<4sBxxxQ16sQQI")  # magic, op, record, digest, length, seq, crc
_J_BODY = struct.Struct(_JOURNAL.format[:-1])  # all but the crc, which covers it
_J_CRC = struct.Struct("<I")
_J_MAGIC = b"KVJ1"
_PUT, _DEL = 1, 2
_EXTENT_MAX = 8 << 30
_READY, _WRITING = 1, 2


def record_bytes(block_bytes: int) -> int:
    """Bytes a block takes on disk and in a host slot the disk tier reads into."""
    return -(-block_bytes // 4096) * 4096 + TRAILER_BYTES


def namespace_digest(namespace: str | bytes, block_bytes: int) -> bytes:
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return hashlib.blake2b(
        b"kvtier-ns-v1\0" + ns + struct.pack("<Q", block_bytes), digest_size=16
    ).digest()


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


class _TokenBucket:
    """Write budget in bytes per second (burst: one second's worth)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.tokens = rate or 0.0
        self.t = time.monotonic()

    def take(self, n: int) -> bool:
        if self.rate is None:
            return True
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


def check_directory(path: Path) -> None:
    """Clear errors for a missing, foreign or read-only directory."""
    if not path.exists():
        raise IoError(2, f"disk tier directory {path} does not exist")
    if not path.is_dir():
        raise IoError(20, f"disk tier path {path} is not a directory")
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise IoError(
            1,
            f"disk tier directory {path} is owned by uid {st.st_uid}, not by us "
            f"(uid {os.geteuid()}): refusing to share it",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise IoError(13, f"disk tier directory {path} is not writable")


class DiskTier(LowerTier):
    """Disk tier over ``capacity_bytes`` of preallocated slab files in ``path``.

    ``namespace`` names what makes bytes compatible (model, dtype, layout,
    rank); two namespaces sharing ``path`` never read each other's blocks.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        *,
        namespace: str | bytes = "default",
        name: str = "disk",
        policy: str = "lru",
        admit_after: int = 1,
        write_budget_bps: float | None = None,
        backend: str = "auto",
        queue_depth: int = 32,
        max_io_bytes: int = 1 << 20,
        num_threads: int = 2,
        inflight_bytes: int = 512 << 20,
        job_bytes: int = 8 << 20,
        sync: bool = False,
        no_data: bool = False,
        timeout_s: float = 30.0,
    ) -> None:
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        if backend not in ("auto", "io_uring", "pread"):
            raise InvalidArgument(f"backend must be auto, io_uring or pread, not {backend!r}")
        self.name = name
        self.block_bytes = block_bytes
        self.record_bytes = record_bytes(block_bytes)
        self.num_records = capacity_bytes // self.record_bytes
        if self.num_records < 1:
            raise InvalidArgument(
                f"disk capacity {capacity_bytes} B holds no record of {self.record_bytes} B"
            )
        root = Path(path)
        check_directory(root)
        self.ns = namespace_digest(namespace, block_bytes)
        self.dir = root / f"kvtier-{self.ns.hex()[:16]}"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self.dir.stat().st_uid != os.geteuid():
            raise IoError(1, f"{self.dir} is owned by another user: refusing it")
        self.per_file = max(1, _EXTENT_MAX // self.record_bytes)
        nfiles = -(-self.num_records // self.per_file)
        self.paths = [str(self.dir / f"slab-{i:03d}.dat") for i in range(nfiles)]
        self.file_bytes = min(self.num_records, self.per_file) * self.record_bytes
        self.no_data = no_data
        self.opts: dict[str, Any] = dict(
            backend=backend,
            queue_depth=queue_depth,
            max_io_bytes=max_io_bytes,
            sync=sync,
            num_threads=num_threads,
            inflight_bytes=inflight_bytes,
            timeout_s=timeout_s,
        )
        self.job_records = max(1, job_bytes // self.record_bytes)
        self.policy = make_policy(policy, self.num_records)
        self.admission = AdmissionFilter(admit_after)
        self.budget = _TokenBucket(write_budget_bps)
        # index: digest -> record; per record: digest and state
        self.index: dict[bytes, int] = {}
        self.keys: dict[bytes, bytes] = {}  # digest -> key, for keys stored by this process
        self.rec_digest: list[bytes | None] = [None] * self.num_records
        self.rec_state = np.zeros(self.num_records, np.uint8)
        self.rec_loading = np.zeros(self.num_records, np.int32)
        self.free: list[int] = []
        self._tokens = itertools.count(1)
        self._jobs: dict[int, tuple[int, int, int]] = {}  # engine job -> (token, first, count)
        self._batches: dict[int, dict[str, Any]] = {}
        self._finished: list[int] = []  # tokens whose completion poll() returns next
        self._events: list[TierEvent] = []
        # Timed-out jobs still running on the device: engine job -> (records,
        # host slots) it may still write or read, freed when it really ends.
        self._held: dict[int, tuple[list[int], list[int]]] = {}
        self._released: list[int] = []
        self._seq = 0
        self._journal_buf = bytearray()
        self._journal_entries = 0
        self._nospace_until = 0.0
        self._closed = False
        self.engine: Any = None
        self.store: Any = None
        self.pool = None
        self.counters = {
            k: 0
            for k in (
                "stores",
                "loads",
                "load_failures",
                "corrupt",
                "io_errors",
                "evictions",
                "budget_skips",
                "not_admitted",
                "busy_drops",
                "nospace",
                "bytes_written",
                "bytes_read",
                "recovered",
                "timeouts",
            )
        }
        self._recover()
        self._journal_fd = os.open(
            self.dir / "index.journal", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
        )

    # -- construction helpers ------------------------------------------------
    @classmethod
    def from_spec(cls, spec: str, block_bytes: int, **kw: Any) -> DiskTier:
        """``DIR:SIZE`` as given on the command line (``/mnt/nvme/kv:100GiB``)."""
        from kvtier.bench.harness import parse_size

        path, sep, size = spec.rpartition(":")
        if not sep or not path:
            raise InvalidArgument(f"--disk wants DIR:SIZE, got {spec!r}")
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(path, parse_size(size), block_bytes, **kw)

    @staticmethod
    def slot_bytes_for(block_bytes: int) -> int:
        """Host slot size a pool needs for this tier (payload + trailer)."""
        return record_bytes(block_bytes)

    def attach(self, pool: Any) -> None:
        self.pool = pool
        if pool is None or self.no_data:
            self.no_data = True
            return
        # Slots with room for the trailer give one request per record (and
        # coalescing); slots of exactly a 4 KiB-multiple block (vLLM's primary
        # region) send the trailer from a buffer as a second request.
        trailer_in_slot = pool.slot_bytes >= self.record_bytes
        if not trailer_in_slot and (pool.slot_bytes < self.block_bytes or self.block_bytes % 4096):
            raise InvalidArgument(
                f"host slots of {pool.slot_bytes} B cannot hold a disk record of "
                f"{self.record_bytes} B (block + 4 KiB trailer), and the block is not a "
                f"multiple of 4 KiB: size the pool with DiskTier.slot_bytes_for({self.block_bytes})"
            )
        if pool.slot_bytes % 4096 or pool.address % 4096:
            raise InvalidArgument("host slots must be 4 KiB aligned for direct I/O")
        from kvtier import _native
        from kvtier.engine import Engine

        o = self.opts
        self.store = _native.DiskStore(
            self.paths,
            self.file_bytes,
            o["backend"],
            o["queue_depth"],
            o["max_io_bytes"],
            True,
            o["sync"],
            self.ns,
            [(pool.address, pool.nbytes)],
            trailer_in_slot,
        )
        if self.store.note:
            warnings.warn(f"kvtier disk tier: {self.store.note}", stacklevel=2)
        self._backend, self._direct = str(self.store.backend), bool(self.store.direct)
        # Every job ends within timeout_s: a hung device fails it (the
        # records and host slots it touches stay out of use until it ends).
        self.engine = Engine(o["num_threads"], [(o["inflight_bytes"], False, o["timeout_s"])])
        self.engine.register_pool(pool)

    @property
    def backend(self) -> str:
        return getattr(self, "_backend", "none (no data)")

    # -- index and journal ---------------------------------------------------
    def _recover(self) -> None:
        """Rebuild the index from the checkpoint and the journal (warm restart)."""
        entries: dict[int, tuple[bytes, int]] = {}
        for fname in ("index.ckpt", "index.journal"):
            p = self.dir / fname
            if not p.exists():
                continue
            data = p.read_bytes()
            good = 0
            for off in range(0, len(data) - _JOURNAL.size + 1, _JOURNAL.size):
                chunk = data[off : off + _JOURNAL.size]
                magic, op, rec, dig, length, seq, crc = _JOURNAL.unpack(chunk)
                if magic != _J_MAGIC or zlib.crc32(chunk[:-4]) != crc:
                    break  # torn tail: everything after it is ignored
                good = off + _JOURNAL.size
                self._seq = max(self._seq, seq)
                if rec >= self.num_records or length != self.block_bytes:
                    continue  # from a larger or different configuration
                if op == _PUT:
                    entries[rec] = (dig, length)
                elif op == _DEL:
                    entries.pop(rec, None)
            if fname == "index.journal" and good < len(data):
                os.truncate(p, good)
        for rec, (dig, _) in sorted(entries.items()):
            old = self.index.get(dig)
            if old is not None:  # the later record wins
                self.rec_digest[old] = None
                self.rec_state[old] = 0
            self.index[dig] = rec
            self.rec_digest[rec] = dig
            self.rec_state[rec] = _READY
            self.policy.insert(dig)
        self.free = [r for r in range(self.num_records - 1, -1, -1) if self.rec_state[r] == 0]
        self.counters["recovered"] = len(self.index)

    def _journal(self, op: int, rec: int, dig: bytes) -> None:
        self._seq += 1
        body = _J_BODY.pack(_J_MAGIC, op, rec, dig, self.block_bytes, self._seq)
        self._journal_buf += body
        self._journal_buf += _J_CRC.pack(zlib.crc32(body))
        self._journal_entries += 1

    def _flush_journal(self) -> None:
        if not self._journal_buf:
            return
        os.write(self._journal_fd, self._journal_buf)
        if self.opts["sync"]:
            os.fdatasync(self._journal_fd)
        self._journal_buf = bytearray()
        if self._journal_entries > max(100_000, 4 * self.num_records):
            self.checkpoint()

    def checkpoint(self) -> None:
        """Snapshot the index and truncate the journal (crash safe at every point)."""
        tmp = self.dir / "index.ckpt.tmp"
        out = bytearray()
        for dig, rec in self.index.items():
            if self.rec_state[rec] == _READY:
                body = _JOURNAL.pack(_J_MAGIC, _PUT, rec, dig, self.block_bytes, self._seq, 0)[:-4]
                out += body + struct.pack("<I", zlib.crc32(body))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, out)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / "index.ckpt")
        os.ftruncate(self._journal_fd, 0)
        self._journal_entries = 0

    # -- tier interface --------------------------------------------------------
    def lookup(self, key: bytes) -> LookupResult:
        rec = self.index.get(key_digest(key))
        if rec is not None and self.rec_state[rec] == _READY:
            return LookupResult.HIT
        return LookupResult.MISS

    def admit(self, key: bytes) -> bool:
        if time.monotonic() < self._nospace_until:
            self.counters["nospace"] += 1
            return False
        if not self.admission.offer(key):
            self.counters["not_admitted"] += 1
            return False
        if not self.budget.take(self.record_bytes):
            self.counters["budget_skips"] += 1
            return False
        return True

    def _allocate(self, evicted: list[bytes]) -> int | None:
        """A free record, else the policy's first victim that is neither
        being written nor read (its key appended to ``evicted``)."""
        if self.free:
            return self.free.pop()
        for dig in self.policy.victims():
            rec = self.index[dig]
            if self.rec_state[rec] == _READY and self.rec_loading[rec] == 0:
                break
        else:
            return None
        key = self.keys.get(dig)
        self._forget(dig, rec, evicted=True)
        self.counters["evictions"] += 1
        if key is not None:  # blocks recovered at restart have no known key to report
            evicted.append(key)
        return rec

    def _forget(self, dig: bytes, rec: int, evicted: bool = False) -> None:
        self.policy.remove(dig, evicted=evicted)
        del self.index[dig]
        self.keys.pop(dig, None)
        self.rec_digest[rec] = None
        self.rec_state[rec] = 0

    def _locate(self, rec: int) -> tuple[int, int]:
        return rec // self.per_file, (rec % self.per_file) * self.record_bytes

    def _submit(
        self, write: bool, token: int, recs: list[int], slots: list[int], digs: list[bytes]
    ) -> bool:
        """Engine jobs for one batch, split so both worker threads get work."""
        assert self.pool is not None
        n = len(recs)
        arr = np.empty((n, 4), np.int64)
        r = np.asarray(recs, np.int64)
        arr[:, 0] = self.pool.address + np.asarray(slots, np.int64) * self.pool.slot_bytes
        arr[:, 1] = r // self.per_file
        arr[:, 2] = (r % self.per_file) * self.record_bytes
        arr[:, 3] = self.block_bytes
        keys = np.frombuffer(b"".join(digs), np.uint8).reshape(n, 16)
        per = max(1, min(self.job_records, -(-n // self.opts["num_threads"])))
        submitted: list[int] = []
        try:
            for i in range(0, n, per):
                jid = self.engine._engine.submit_disk(
                    self.store, write, arr[i : i + per], keys[i : i + per], 0
                )
                submitted.append(jid)
                self._jobs[jid] = (token, i, min(per, n - i))
        except Busy:
            if not submitted:
                return False
            # Part of the batch is queued: the rest fails as busy, per item.
            self._batches[token]["busy_from"] = submitted and (len(submitted) * per)
        self._batches[token]["jobs"] = len(submitted)
        return True

    def _check(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        if len(keys) != len(slots):
            raise InvalidArgument(f"{len(keys)} keys but {len(slots)} slots")
        if self._closed:
            from kvtier.errors import ClosedError

            raise ClosedError(f"{self.name} tier is closed")
        if self.pool is not None and not self.no_data:
            n = self.pool.num_slots
            bad = [s for s in slots if not 0 <= s < n]
            if bad:
                raise InvalidArgument(f"host slot {bad[0]} out of range [0, {n})")

    def _new_batch(
        self, kind: str, keys: Sequence[bytes], slots: Sequence[int]
    ) -> tuple[int, dict[str, Any]]:
        """A token and the per-key bookkeeping of one store or load batch."""
        self._check(keys, slots)
        n = len(keys)
        return next(self._tokens), {
            "kind": kind,
            "keys": list(keys),
            "digs": [key_digest(k) for k in keys],
            "ok": [False] * n,
            "recs": [None] * n,
            "slots": list(slots),
            "held": [False] * n,
        }

    def _launch(
        self,
        write: bool,
        token: int,
        batch: dict[str, Any],
        io_idx: list[int],
        recs: list[int],
        io_slots: list[int],
    ) -> bool:
        """Registers the batch and queues its I/O (finished at once when there
        is none). False when the engine was busy: nothing queued, the batch
        is forgotten and the caller undoes its bookkeeping."""
        batch["io_idx"] = io_idx
        self._batches[token] = batch
        if self.no_data or not io_idx:
            batch["jobs"] = 0
            self._finish(token, [0] * len(io_idx))
            return True
        if not self._submit(write, token, recs, io_slots, [batch["digs"][i] for i in io_idx]):
            del self._batches[token]
            return False
        batch["items"] = [0] * len(io_idx)
        return True

    def submit_store(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        token, batch = self._new_batch("store", keys, slots)
        digs = batch["digs"]
        io_idx, recs, io_slots = [], [], []
        evicted: list[bytes] = []
        for i, (d, s) in enumerate(zip(digs, slots)):
            if d in self.index:
                batch["ok"][i] = True  # already stored (or being stored)
                continue
            rec = self._allocate(evicted)
            if rec is None:
                continue
            self.index[d] = rec
            self.keys[d] = keys[i]
            self.rec_digest[rec] = d
            self.rec_state[rec] = _WRITING
            batch["recs"][i] = rec
            io_idx.append(i)
            recs.append(rec)
            io_slots.append(s)
        if evicted:
            self._events.append(TierEvent(evicted, self.name, removed=True))
        if not self._launch(True, token, batch, io_idx, recs, io_slots):
            for i in io_idx:  # backpressure: undo, nothing was queued
                rec = batch["recs"][i]
                self._forget(digs[i], rec)
                self.free.append(rec)
            self.counters["busy_drops"] += len(keys)
            return None
        return token

    def submit_load(self, keys: Sequence[bytes], slots: Sequence[int]) -> int | None:
        token, batch = self._new_batch("load", keys, slots)
        digs = batch["digs"]
        io_idx, recs, io_slots = [], [], []
        for i, (d, s) in enumerate(zip(digs, slots)):
            rec = self.index.get(d)
            if rec is None or self.rec_state[rec] != _READY:
                continue
            batch["recs"][i] = rec
            self.rec_loading[rec] += 1
            io_idx.append(i)
            recs.append(rec)
            io_slots.append(s)
        if not self._launch(False, token, batch, io_idx, recs, io_slots):
            for i in io_idx:
                self.rec_loading[batch["recs"][i]] -= 1
            return None
        return token

    def poll(self) -> list[TierCompletion]:
        if self.engine is not None:
            for r in self.engine.poll():
                if r.released:  # a timed-out job really ended: its memory is free
                    recs, slots = self._held.pop(r.job_id, ([], []))
                    self.free.extend(recs)
                    self._released.extend(slots)
                    continue
                token, first, n = self._jobs.pop(r.job_id)
                b = self._batches[token]
                items = list(r.items)
                if not items and not r.ok:  # cancelled or timed out: every record failed
                    items = [110 if r.timed_out else 125] * n  # ETIMEDOUT / ECANCELED
                    self.counters["timeouts"] += n if r.timed_out else 0
                    if r.held:
                        idx = b["io_idx"][first : first + n]
                        for i in idx:
                            b["held"][i] = True
                        # A late write may still land in these records.
                        recs = [b["recs"][i] for i in idx] if b["kind"] == "store" else []
                        self._held[r.job_id] = (recs, [b["slots"][i] for i in idx])
                b["items"][first : first + len(items)] = items
                b["jobs"] -= 1
                if b["jobs"] == 0:
                    busy_from = b.get("busy_from")
                    if busy_from:
                        for k in range(busy_from, len(b["io_idx"])):
                            b["items"][k] = 16  # EBUSY: never submitted
                    self._finish(token, b["items"])
        out = [self._batches.pop(t)["completion"] for t in self._finished]
        self._finished.clear()
        self._flush_journal()
        return out

    def _finish(self, token: int, items: list[int]) -> None:
        b = self._batches[token]
        stored: list[bytes] = []
        loaded = 0
        for k, i in enumerate(b["io_idx"]):
            rec, dig, code = b["recs"][i], b["digs"][i], items[k]
            if b["kind"] == "store":
                if code == 0:
                    self.rec_state[rec] = _READY
                    self.policy.insert(dig)
                    self._journal(_PUT, rec, dig)
                    b["ok"][i] = True
                    stored.append(b["keys"][i])
                else:
                    if code == 28:  # ENOSPC: stop admitting for a while
                        self._nospace_until = time.monotonic() + 1.0
                    self.counters["io_errors"] += 1
                    self._forget(dig, rec)
                    if not b["held"][i]:  # else freed when the job ends
                        self.free.append(rec)
            else:
                self.rec_loading[rec] -= 1
                if code == 0:
                    b["ok"][i] = True
                    self.policy.touch(dig)
                    loaded += 1
                else:
                    # Torn, foreign or unreadable: a miss, counted, and dropped.
                    self.counters["load_failures"] += 1
                    self.counters["corrupt" if code < 0 else "io_errors"] += 1
                    if self.rec_digest[rec] == dig and self.rec_loading[rec] == 0:
                        self._forget(dig, rec)
                        self._journal(_DEL, rec, dig)
                        self.free.append(rec)
                        self._events.append(TierEvent([b["keys"][i]], self.name, removed=True))
        c = self.counters
        c["stores"] += len(stored)
        c["bytes_written"] += len(stored) * self.record_bytes
        c["loads"] += loaded
        c["bytes_read"] += loaded * self.record_bytes
        if stored:
            self._events.append(TierEvent(stored, self.name, removed=False))
        self._finished.append(token)
        b["completion"] = TierCompletion(
            token,
            all(b["ok"]),
            b["kind"],
            b["keys"],
            key_ok=list(b["ok"]),
            held=list(b["held"]) if any(b["held"]) else None,
        )

    def take_events(self) -> list[TierEvent]:
        ev, self._events = self._events, []
        return ev

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._finished) or bool(self._held)

    def take_released_slots(self) -> list[int]:
        out, self._released = self._released, []
        return out

    def reset(self) -> None:
        for dig, rec in list(self.index.items()):
            if self.rec_state[rec] == _READY and self.rec_loading[rec] == 0:
                self._forget(dig, rec)
                self._journal(_DEL, rec, dig)
                self.free.append(rec)
        self._flush_journal()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.engine is not None:
            self.engine.close()
            self.poll()
        self._flush_journal()
        os.close(self._journal_fd)
        # The native store holds the extent files open: let go of them now,
        # not whenever the tier object is collected (an unmount waits on it).
        self.store = None

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "direct": getattr(self, "_direct", None),
            "blocks": len(self.index),
            "capacity_blocks": self.num_records,
            "held_jobs": len(self._held),
            **self.counters,
        }


def directory_mode_ok(path: Path) -> bool:
    """True when ``path`` is private to its owner (0700)."""
    return stat.S_IMODE(path.stat().st_mode) == 0o700
