"""One connection to the node (:class:`NodeClient`), its errors, and the
one-shot calls that need no manager (:func:`pool_info`, :func:`node_status`).

Process: the engine's scheduler (through :class:`~kvtier.node.client.
NodeManager`), its workers (a one-shot :func:`pool_info` to learn which pool
to map) and tools (``kvtier node status``, ``kvtier doctor``). Who calls:
those, one thread per connection. Each call blocks for one Unix-socket round
trip, at most its timeout; posted calls do not wait. Posted calls go out
with the next call or flush, or at the latest FLUSH_AFTER_S later, sent by
the connection's flusher thread (an engine that goes idle after a store must
not keep its blocks from the node).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from kvtier._native import StoresFrame
from kvtier.errors import InvalidArgument, IoError, KvtierError
from kvtier.node import protocol as P
from kvtier.node.protocol import Op

log = logging.getLogger("kvtier.node")
# Bytes asked of one recv: below glibc's mmap threshold. recv(1 MiB)
# allocated and unmapped a megabyte per call: a trivial request's round trip
# took 127 us against 13 us for a bare echo (kvtier bench manager --node).
_RECV_BYTES = 1 << 16

# How long a call polls for its reply before sleeping in recv: the node
# answers most calls within tens of microseconds, and a sleeping CPU's
# wake-up is most of a round trip on a VM (see NodeConfig.spin_us).
SPIN_S = 200e-6
# The longest a posted call waits for the caller's next flush before the
# flusher thread sends it: calls posted, not flushed, cost the engine one
# sendall a step less, and the node one wake-up, read and loop. At 2 ms the
# flusher's wake-ups (a GIL hand-off each) cost a busy engine 0.15 us a key;
# at 10 ms nothing measurable (kvtier bench manager --node --shared-index,
# 16 keys a call, CPU a key, five runs each).
FLUSH_AFTER_S = 0.01
# Keys of one STORES frame at most (a frame of about 160 KiB): a long
# prompt's stores go in a few frames, not one the node parses at length.
STORES_KEYS = 4096


class NodeUnavailable(IoError):
    """The node did not answer (not running, restarting, or too slow)."""


class NodeError(KvtierError):
    """The node refused a request (its error kind and message)."""


class NodeClient:
    """One connection to the node. ``call`` sends a request and blocks for
    its reply; not thread-safe (one per scheduler, used under its lock)."""

    def __init__(self, path: str, timeout_s: float = 5.0, spin_s: float = SPIN_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self._sock: socket.socket | None = None
        self._reader = P.FrameReader()
        self._queued = bytearray()
        self._pack = P.packer()
        # Requests posted with post_call whose replies are owed, and the
        # frames read so far that answer them (in order).
        self._owed = 0
        self._early: list[bytes] = []
        # The flusher thread shares the queue and the socket's sending side
        # (never its reading side): both under _send_lock.
        self._send_lock = threading.Lock()
        self._queued_at = 0.0
        self._flusher: _Flusher | None = None
        # Store begins and ends posted since the last flush, written as one
        # STORES frame (under _send_lock: the flusher thread may close it).
        self._stores = StoresFrame(P.MAX_FRAME)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise NodeUnavailable(
                e.errno or 0, f"no kvtier node at {self.path}: {e.strerror or e}"
            ) from None
        self._sock = s
        self._reader = P.FrameReader()
        self._owed = 0
        self._early = []
        self._ready = select.poll()
        self._ready.register(s, select.POLLIN)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        with self._send_lock:
            self._queued = bytearray()
            self._stores.clear()
            if self._flusher is not None:
                self._flusher.stop()
                self._flusher = None
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        self._owed = 0
        self._early = []

    def post(self, op: Op, *args: Any) -> None:
        """Queue a call of :data:`~kvtier.node.protocol.NO_REPLY`: it goes
        out with the next :meth:`call` (or :meth:`flush`), in order."""
        if self._sock is None:
            raise NodeUnavailable(0, f"kvtier node at {self.path}: not connected")
        frame = self._pack([int(op), *args])
        with self._send_lock:
            self._close_stores()
            self._start_queue()
            self._queued += frame

    def post_stores(self, keys: list[bytes], slots: list[int] | None, req: Any = None) -> None:
        """Queue a store's begin (request ``req`` writes ``keys`` into
        ``slots``, its own reserved ones) or, with ``slots`` None, the
        successful end of the stores of ``keys``. Those posted until the
        next other call, flush or FLUSH_AFTER_S go as one STORES frame, in
        order: one frame a step for the node to read and dispatch, not two a
        store."""
        if self._sock is None:
            raise NodeUnavailable(0, f"kvtier node at {self.path}: not connected")
        if not keys:
            return
        with self._send_lock:
            b = self._stores
            if not b:
                self._start_queue()
            if slots is not None:
                b.begin(keys, slots, req)
            else:
                b.end(keys)
            if len(b) >= STORES_KEYS:
                self._close_stores()

    def _start_queue(self) -> None:
        """Under _send_lock, before queueing: the flusher sends what is
        queued from now on FLUSH_AFTER_S later at the latest."""
        if not self._queued and not self._stores:
            self._queued_at = time.monotonic()
            f = self._flusher
            if f is None:
                f = self._flusher = _Flusher(self)
            f.wake()

    def _close_stores(self) -> None:
        """Under _send_lock: the stores posted so far join the queue as one frame."""
        frame = self._stores.take()
        if frame is not None:
            self._queued += frame

    def post_call(self, op: Op, *args: Any) -> None:
        """Queue a request whose reply is read later, by :meth:`replies` or
        by the next :meth:`call` (which keeps it for :meth:`replies`)."""
        self.post(op, *args)
        self._owed += 1

    @property
    def stores_frame(self) -> StoresFrame:
        """The STORES frame posted stores are written to (an engine's native
        manager front writes it directly: kvtier._native.node_front)."""
        return self._stores

    @property
    def queued(self) -> bool:
        """Whether posted calls wait to go out."""
        return bool(self._queued) or bool(self._stores)

    @property
    def owed(self) -> int:
        """Replies of :meth:`post_call` not taken yet."""
        return self._owed

    def replies(self, wait: bool = False, leave: int = 0) -> list[Any]:
        """The results of posted calls that have come, oldest first; with
        ``wait``, blocks until at most ``leave`` are still owed.
        NodeUnavailable when the connection fails, NodeError when the node
        refused one."""
        try:
            if wait:
                self.flush()
                self._read_frames(self._owed - leave)
            else:
                self._read_ready()
        except (OSError, P.ProtocolError) as e:
            self.close()
            raise NodeUnavailable(0, f"kvtier node at {self.path}: {e}") from None
        n = min(len(self._early), self._owed)
        frames, self._early = self._early[:n], self._early[n:]
        self._owed -= n
        return [self._result(f) for f in frames]

    def flush(self) -> None:
        """Send what :meth:`post` queued without waiting for anything."""
        if not self.queued:
            return
        try:
            with self._send_lock:
                self._close_stores()
                if self._queued and self._sock is not None:
                    data, self._queued = bytes(self._queued), bytearray()
                    self._sock.sendall(data)
        except OSError as e:
            self.close()
            raise NodeUnavailable(0, f"kvtier node at {self.path}: {e}") from None

    def flush_stale(self) -> bool:
        """The flusher's: send what has been queued for FLUSH_AFTER_S or
        longer. Returns whether anything is still queued."""
        with self._send_lock:
            if not self.queued or self._sock is None:
                return False
            if time.monotonic() < self._queued_at + FLUSH_AFTER_S:
                return True
            self._close_stores()
            data, self._queued = bytes(self._queued), bytearray()
            # A failure is the caller's to find (its next call or poll sees
            # the connection closed): its reading side is not this thread's.
            with contextlib.suppress(OSError):
                self._sock.sendall(data)
            return False

    def call(self, op: Op, *args: Any) -> Any:
        """The result of one request; NodeUnavailable when the connection
        fails (it is closed then), NodeError when the node refuses."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        try:
            data = self._pack([int(op), *args])
            with self._send_lock:
                self._close_stores()
                if self._queued:
                    data, self._queued = bytes(self._queued) + data, bytearray()
                # The node may have refused us and closed first: its reason is
                # waiting to be read (a refused peer's error frame).
                with contextlib.suppress(OSError):
                    self._sock.sendall(data)
            self._read_frames(self._owed + 1)
        except (OSError, P.ProtocolError) as e:
            self.close()
            raise NodeUnavailable(0, f"kvtier node at {self.path}: {e}") from None
        # The posted calls' replies stay for replies(); ours is the next.
        frame = self._early.pop(self._owed)
        return self._result(frame)

    def _read_frames(self, n: int) -> None:
        """Reads until ``n`` frames are in hand (a reply takes one)."""
        early = self._early
        if len(early) < n and self.spin_s:
            early += self._reader.feed(self._poll())
        while len(early) < n:
            early += self._reader.feed(self._recv())

    def _read_ready(self) -> None:
        """Reads what has come, without waiting: once, and again only after
        a full buffer (a poll(2) that finds nothing more was a third of the
        polls of a step, kvtier bench manager --node --shared-index)."""
        assert self._sock is not None
        while self._ready.poll(0):
            data = self._recv()
            self._early += self._reader.feed(data)
            if len(data) < _RECV_BYTES:
                break

    def _result(self, frame: bytes) -> Any:
        reply = P.unpack(frame)
        if not isinstance(reply, list) or not reply:
            self.close()
            raise NodeUnavailable(0, "kvtier node sent a malformed reply")
        if reply[0] is True:
            return reply[1]
        kind, msg = (reply + ["?", "?"])[1:3]
        if kind in ("ProtocolError", "PermissionDenied"):
            self.close()
        if kind == "InvalidArgument":
            raise InvalidArgument(msg)
        raise NodeError(f"kvtier node: {kind}: {msg}")

    def peer_gone(self) -> bool:
        """Whether the node closed this connection (or sent what no request
        asked for, which only a refusal does): one poll(2) with no wait,
        about a microsecond, and reading the replies of posted calls that
        have come. Callers that answer without a round trip ask it first, so
        that a dead node's shared index is never read."""
        if self._sock is None:
            return True
        ready = self._ready.poll(0)
        if not ready:
            return False
        # A dead node's socket reports HUP at once, even while replies it sent
        # before dying wait unread: reading those alone (which stops short of
        # the end of the stream) took a dead node for a live one, and its
        # index was read for a step more.
        if ready[0][1] & (select.POLLHUP | select.POLLERR):
            return True
        try:
            self._read_ready()
        except (OSError, P.ProtocolError):
            return True
        return len(self._early) > self._owed

    def _recv(self) -> bytes:
        assert self._sock is not None
        data = self._sock.recv(_RECV_BYTES)
        if not data:
            raise ConnectionResetError("the node closed the connection")
        return data

    def _poll(self) -> bytes:
        """What arrives within ``spin_s`` without sleeping (b"": nothing yet).
        Asked of poll(2) with no wait: a recv on a socket with a timeout
        waits in poll(2) itself, MSG_DONTWAIT or not."""
        assert self._sock is not None
        ready, end = self._ready.poll, time.perf_counter() + self.spin_s
        while not ready(0):
            if time.perf_counter() > end:
                return b""
            # The CPU to whoever else can run on it (the node, when engines
            # outnumber cores): polling alone made 4 clients on 2 cores
            # 0.7x as fast.
            os.sched_yield()
        return self._recv()


class _Flusher:
    """A connection's daemon thread that sends posted calls the caller left
    queued for FLUSH_AFTER_S. It sleeps on an event while nothing is queued
    (woken by the post that queues after an empty queue), and takes the GIL
    at most once per FLUSH_AFTER_S while something is."""

    def __init__(self, client: NodeClient) -> None:
        self._client = client
        self._event = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvtier-node-flush", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        if not self._event.is_set():
            self._event.set()

    def stop(self) -> None:
        self._stopped = True
        self._event.set()

    def _run(self) -> None:
        client = self._client
        while not self._stopped:
            self._event.wait()
            self._event.clear()
            while not self._stopped:
                time.sleep(FLUSH_AFTER_S)
                if self._stopped or not client.flush_stale():
                    break


def pool_info(
    path: str, payload_bytes: int, timeout_s: float = 30.0, engine: str | None = None
) -> dict[str, Any]:
    """Which pool the node keeps for blocks of ``payload_bytes`` (its name,
    slots, slot size): what an engine's worker maps. ``engine``: the engine
    this process writes slots for (its HELLO name): the node holds a dead
    engine's unfinished slots until this process has exited too. Blocks for
    one round trip."""
    c = NodeClient(path, timeout_s)
    try:
        args = (payload_bytes,) if engine is None else (payload_bytes, engine)
        return dict(c.call(Op.POOL, *args))
    finally:
        c.close()


def node_status(path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The node's status (``kvtier node status``). Blocks for one round trip."""
    c = NodeClient(path, timeout_s)
    try:
        return dict(c.call(Op.STATUS))
    finally:
        c.close()
