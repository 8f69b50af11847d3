"""``kvtier node``: one process per machine that owns the host pool, index,
policy and lower tiers for every engine on it, serving them over a Unix socket.

Process: the node. Who calls: the ``kvtier node`` command (:func:`serve`),
tests (:class:`NodeServer` in a thread). :meth:`NodeServer.serve_forever`
blocks; every request is served on its one event-loop thread, in arrival
order per connection, so the tier code runs exactly as in an engine (one
caller at a time, no lock). Lower-tier I/O runs on the native engine's
threads, never this one.

Who may attach: the socket is created 0660 (group ``socket_group``) and
each connection's peer credentials (SO_PEERCRED) are checked against the
allowed uids/gids; a refused client gets an error reply and a log line.
A connection that sends anything but valid requests (garbage, an oversized
frame, a claim on slots it does not lease) is closed and its leases
released; the node and the other engines go on.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.node import protocol as P
from kvtier.node.chunks import CHUNK_BYTES, Region, chunk_bytes_for, open_region
from kvtier.node.classes import SlotClass, build_class
from kvtier.node.protocol import Op, ProtocolError
from kvtier.node.quarantine import GRACE_S, Writers
from kvtier.node.state import Session
from kvtier.options.tiers import DiskOptions, HostOptions, RemoteOptions

log = logging.getLogger("kvtier.node")
# Bytes asked of one recv: below glibc's mmap threshold. recv(1 MiB)
# allocated and unmapped a megabyte per call: a trivial request's round trip
# took 127 us against 13 us for a bare echo (kvtier bench manager --node).
_RECV_BYTES = 1 << 16

DEFAULT_SOCKET = "/run/kvtier/node.sock"
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# Replies a client may leave unread before it is dropped: a client that
# sends and never reads would otherwise grow the node's memory without bound.
MAX_UNREAD = 64 << 20


@dataclass
class NodeConfig:
    """What ``kvtier node`` is started with. ``host`` sizes the host tier of
    every slot class together: ``max_classes`` block sizes at most, sharing
    one region of ``host.bytes`` that they divide by use, a chunk of
    ``chunk_bytes`` at a time (:mod:`kvtier.node.chunks`); a disk tier is
    split between them evenly."""

    host: HostOptions
    disk: DiskOptions | None = None
    remote: RemoteOptions | None = None
    socket_path: str = DEFAULT_SOCKET
    socket_group: str | None = None
    allow_uids: list[int] = field(default_factory=list)
    allow_gids: list[int] = field(default_factory=list)
    max_classes: int = 1
    # The region's unit of division between block sizes (smaller for a
    # small --host-bytes: see kvtier.node.chunks.chunk_bytes_for).
    chunk_bytes: int = CHUNK_BYTES
    name: str = "node"
    metrics_port: int | None = None
    # After serving a request, poll for the next one this long before
    # sleeping in epoll: an engine's calls come in bursts (a step's lookups,
    # stores, loads), and waking a sleeping CPU is most of a round trip on a
    # VM (a bare echo here: 77-92 us asleep on both sides, 7-9 us with both
    # polling up to 200 us). 0: sleep at once.
    spin_us: int = 200
    # A node that adopts an earlier node's region hands none of it out for this
    # long: a copy prepared against the dead node may still land or read.
    adopt_grace_s: float = GRACE_S
    # Engines look up, pin and store host blocks without a round trip (in
    # progress, off: docs/concepts/node-shared-index.md).
    shared_index: bool = False


@dataclass
class _Conn:
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    reader: P.FrameReader = field(default_factory=P.FrameReader)
    out: bytearray = field(default_factory=bytearray)
    session: Session | None = None
    closing: bool = False
    want_write: bool = False


class NodeServer:
    """The node: its socket, its slot classes and the engines' sessions."""

    def __init__(self, config: NodeConfig) -> None:
        if config.host.bytes is None:
            raise InvalidArgument("kvtier node needs --host-bytes (e.g. 64GiB)")
        if config.max_classes < 1:
            raise InvalidArgument(f"max_classes must be >= 1, got {config.max_classes}")
        self.config = config
        self.classes: dict[int, SlotClass] = {}
        self.region: Region | None = None  # created when the first engine attaches
        self.conns: dict[int, _Conn] = {}
        self.counters = {
            "attached": 0,
            "refused": 0,
            "protocol_errors": 0,
            "disconnects": 0,
            "leases_released": 0,
            "requests": 0,
            "refused_calls": 0,
            "internal_errors": 0,
        }
        self.started, self._since = time.time(), time.monotonic()
        self.writers = Writers()  # engines' workers, named at POOL (node/quarantine.py)
        self._pack = P.packer()  # the replies' (this thread's only)
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._listen = self._bind(config)
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._allowed_uids = {os.getuid(), 0, *config.allow_uids}
        self._allowed_gids = set(config.allow_gids)
        if config.socket_group is not None:
            self._allowed_gids.add(_gid(config.socket_group))
        self.metrics = None
        if config.metrics_port is not None:
            from kvtier.node.metrics import NodeMetrics

            self.metrics = NodeMetrics(self, config.metrics_port)

    # -- socket ------------------------------------------------------------
    @staticmethod
    def _bind(config: NodeConfig) -> socket.socket:
        path = config.socket_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise InvalidArgument(f"a node is already serving {path}")
        except (FileNotFoundError, ConnectionRefusedError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket left by a node that died
        finally:
            probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # born 0660: no window in which others may connect
        try:
            s.bind(path)
        finally:
            os.umask(old)
        if config.socket_group is not None:
            os.chown(path, -1, _gid(config.socket_group))
        os.chmod(path, 0o660)
        s.listen(128)
        s.setblocking(False)
        return s

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (any thread; non-blocking)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def serve_forever(self, poll_s: float = 0.005) -> None:
        """Serve until :meth:`stop`. Blocks. Between requests it drives the
        lower tiers' completions (promotions, cascades) every ``poll_s``
        while any class has work in flight."""
        metrics_due = drive_due = spin_until = 0.0
        spin_s = self.config.spin_us / 1e6
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                spinning = now < spin_until
                # Asked where it decides (the wait, a due drive), spinning once a
                # poll_s: each spin it was a tenth of the node's CPU (bench manager).
                busy = (not spinning or now >= drive_due) and any(
                    c.manager.has_pending_work() for c in self.classes.values()
                )
                if spinning and not busy and now >= drive_due:
                    drive_due = now + poll_s
                if spinning:
                    os.sched_yield()  # polling, not keeping a runnable engine off the CPU
                events = self._sel.select(0.0 if spinning else poll_s if busy else 0.5)
                if events and spin_s:
                    spin_until = time.monotonic() + spin_s
                for key, mask in events:
                    if key.fileobj is self._listen:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE and not conn.closing:
                            self._flush(conn)
                # After requests, after a wait, and every poll_s while polling.
                if busy and (events or not spinning or time.monotonic() >= drive_due):
                    drive_due = time.monotonic() + poll_s
                    for c in self.classes.values():
                        c.manager.on_schedule_end()
                        c.distribute_events()
                if time.monotonic() >= metrics_due:
                    metrics_due = time.monotonic() + 1.0
                    # Engines that never end a step (SGLang) leave the
                    # classes' events (their lower tiers' too) to the node:
                    # handed on once a second, kept only by who takes them.
                    for c in self.classes.values():
                        c.distribute_events()
                        c.quarantine.expire()  # a dead engine's slots, past their grace
                    self.writers.prune()
                    if self.metrics is not None:
                        self.metrics.refresh()
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for conn in list(self.conns.values()):
            self._drop(conn, "node stopping")
        self._sel.close()
        self._listen.close()
        self._wake_r.close()
        self._wake_w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.socket_path)
        for c in self.classes.values():
            c.manager.shutdown()
            c.pool.close()
            if c.index_pool is not None:
                c.index_pool.close()
        if self.region is not None:
            # The region's name stays: engines' workers keep it mapped, and a
            # node started again serves them from it (open_region).
            self.region.pool.disown()
            self.region.pool.close()
        if self.metrics is not None:
            self.metrics.close()
        self.writers.close()

    def _accept(self) -> None:
        try:
            s, _ = self._listen.accept()
        except BlockingIOError:
            return
        pid, uid, gid = _PEERCRED.unpack(
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid not in self._allowed_uids and gid not in self._allowed_gids:
            self.counters["refused"] += 1
            log.warning("kvtier node: refused pid %d (uid %d, gid %d): not allowed", pid, uid, gid)
            with contextlib.suppress(OSError):
                s.sendall(
                    P.pack(
                        [
                            False,
                            "PermissionDenied",
                            f"uid {uid} / gid {gid} may not attach to this node "
                            "(its --allow-uid / --allow-gid / --socket-group)",
                        ]
                    )
                )
            s.close()
            return
        s.setblocking(False)
        conn = _Conn(s, pid, uid, gid)
        self.conns[s.fileno()] = conn
        self._sel.register(s, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.counters["disconnects"] += 1
            self._drop(conn, "disconnected")
            return
        try:
            frames = conn.reader.feed(data)
            for body in frames:
                reply = self._dispatch(conn, P.unpack(body))
                if reply is not None:
                    conn.out += self._pack(reply)
            if len(conn.out) > MAX_UNREAD:
                raise ProtocolError(f"{len(conn.out)} bytes of replies left unread")
        except ProtocolError as e:
            self.counters["protocol_errors"] += 1
            log.warning("kvtier node: closing pid %d: %s", conn.pid, e)
            with contextlib.suppress(OSError):
                conn.sock.send(P.pack([False, "ProtocolError", str(e)]))
            self._drop(conn, "protocol error")
            return
        except Exception:
            # A fault of the node's own on one engine's request: that engine's
            # connection goes (it reattaches), not the node every engine shares.
            self.counters["internal_errors"] += 1
            log.exception("kvtier node: closing pid %d after an internal error", conn.pid)
            self._drop(conn, "internal error")
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.out:
            try:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
            except BlockingIOError:
                pass
            except OSError:
                self._drop(conn, "send failed")
                return
        if bool(conn.out) != conn.want_write:  # an epoll_ctl only when interest changes
            conn.want_write = bool(conn.out)
            want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            self._sel.modify(conn.sock, want, conn)

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn.closing:
            return
        conn.closing = True
        self.conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn.session is not None:
            # Its workers alive now may still write: their exits end the hold.
            writers = self.writers.alive(conn.session.engine, conn.pid)
            misbehaved, stopping = why == "protocol error", why == "node stopping"
            released = conn.session.release_all(writers, misbehaved, hold=not stopping)
            n = sum(released.values())
            self.counters["leases_released"] += n
            e = conn.session.engine
            log.info("kvtier node: engine %s (pid %d) %s; released %s", e, conn.pid, why, released)

    # -- requests ----------------------------------------------------------
    def _dispatch(self, conn: _Conn, msg: Any) -> list[Any] | None:
        """The reply to one request; None for the calls the client does
        not wait for (:data:`~kvtier.node.protocol.NO_REPLY`): one the tier
        code refuses is counted and logged there, as the client has gone on."""
        if not isinstance(msg, list) or not msg or type(msg[0]) is not int:
            raise ProtocolError("a request is [op, args...]")
        code = msg[0]
        reply = self._serve(conn, code, msg[1:])
        if code not in _NO_REPLY:
            return reply
        if reply[0] is not True:
            self.counters["refused_calls"] += 1
            log.warning("kvtier node: %s of pid %d refused: %s", Op(code).name, conn.pid, reply[2])
        return None

    def _serve(self, conn: _Conn, code: int, args: list[Any]) -> list[Any]:
        self.counters["requests"] += 1
        try:
            handler = _HANDLERS.get(code)
            if handler is None:
                raise ProtocolError(f"unknown op {code}")
            nargs, call, needs_session = handler
            if nargs is not None and len(args) != nargs:
                raise ProtocolError(f"expected {nargs} arguments, got {len(args)}")
            if not needs_session:
                return [True, call(self, conn, args)]
            s = conn.session
            if s is None:
                raise ProtocolError(f"{Op(code).name} before HELLO")
            s.calls += 1
            return [True, call(s, args)]
        except ProtocolError:
            raise
        except KvtierError as e:
            # The tier code refused the call (a key that is not a HIT, ...):
            # the engine sees the same error it would see in-process.
            return [False, type(e).__name__, str(e)]

    def _class_for(self, payload_bytes: int) -> SlotClass:
        c = self.classes.get(payload_bytes)
        if c is not None:
            return c
        if len(self.classes) >= self.config.max_classes:
            raise InvalidArgument(
                f"this node serves {self.config.max_classes} block size(s) "
                f"({sorted(self.classes)} B) and an engine asked for {payload_bytes} B: "
                "start it with a larger --max-classes"
            )
        from kvtier.tiers.factory import TierConfig, build_lower_tiers, host_slot_bytes

        cfg = TierConfig(self.config.disk, self.config.remote)
        slot_bytes = -(-host_slot_bytes(payload_bytes, cfg) // 64) * 64
        region = self._region()
        if slot_bytes > region.chunk_bytes:
            raise InvalidArgument(
                f"a block of {slot_bytes} B is larger than this node's chunks of "
                f"{region.chunk_bytes} B: start it with a larger --chunk-bytes (and --host-bytes)"
            )
        if cfg.disk is not None:
            sub = os.path.join(str(cfg.disk.path), f"class-{payload_bytes}")
            import dataclasses

            disk = dataclasses.replace(
                cfg.disk, path=sub, capacity_bytes=_share(cfg.disk, self.config.max_classes)
            )
            cfg = TierConfig(disk, cfg.remote)
        lower = build_lower_tiers(cfg, payload_bytes, f"kvtier-node-{payload_bytes}")
        c = build_class(payload_bytes, slot_bytes, region, self.config.host, lower)
        if self.config.shared_index:
            # Named per node process: engines attached to an earlier node map
            # its index until they reattach to this one.
            c.open_shared_index(
                f"kvnode-{_safe(self.config.name)}-ix-{payload_bytes}-{os.getpid()}"
            )
            if c.index_pool is not None:
                self._share_pool(c.index_pool.name)
        self.classes[payload_bytes] = c
        log.info(
            "kvtier node: class %d B: slots of %d B in %s", payload_bytes, slot_bytes, c.pool.name
        )
        return c

    def _region(self) -> Region:
        if self.region is None:
            assert self.config.host.bytes is not None
            total = int(self.config.host.bytes)
            chunk = chunk_bytes_for(total, self.config.chunk_bytes)
            name = f"kvnode-{_safe(self.config.name)}-region"
            self.region = open_region(name, total // chunk * chunk, chunk, self.config.max_classes)
            self._share_pool(self.region.pool.name)
            # The grace counts from this node's start: copies begun before it.
            until = self._since + self.config.adopt_grace_s
            if self.region.adopted and until > time.monotonic():
                self.region.closed_until = until
                left = until - time.monotonic()
                msg = "kvtier node: adopted region %s of an earlier node: no stores for %.1f s"
                log.warning(msg + " (copies begun before it may still land)", name, left)
            log.info(
                "kvtier node: region %s, %d chunks of %d B",
                name,
                self.region.pool.num_slots,
                chunk,
            )
        return self.region

    def _share_pool(self, name: str) -> None:
        """The pool file as the socket: readable and writable by the group
        allowed to attach (engines of other users map it)."""
        path = f"/dev/shm/{name}"
        with contextlib.suppress(OSError):
            if self.config.socket_group is not None:
                os.chown(path, -1, _gid(self.config.socket_group))
            os.chmod(path, 0o660)

    def _pool(self, conn: _Conn, args: list[Any]) -> dict[str, Any]:
        """POOL [payload_bytes, engine]: the pool an engine's worker maps; a
        worker that names its engine is one of its writers from now on."""
        if len(args) not in (1, 2):
            raise ProtocolError(f"expected 1 or 2 arguments, got {len(args)}")
        info = self._pool_info(_int(args[0], "payload_bytes"))
        if len(args) == 2:
            if not isinstance(args[1], str) or len(args[1]) > 256:
                raise ProtocolError("engine must be a str")
            self.writers.add(args[1], conn.pid)
        return info

    def _pool_info(self, payload_bytes: int) -> dict[str, Any]:
        c = self._class_for(payload_bytes)
        return {
            "pool": c.pool.name,
            "num_slots": c.pool.num_slots,
            "slot_bytes": c.pool.slot_bytes,
            "pool_id": _pool_id(c.pool.name),
            "node": self.config.name,
        }

    def _hello(self, conn: _Conn, *args: Any) -> dict[str, Any]:
        namespace, payload_bytes, engine, events = P.hello_args(list(args))
        if conn.session is not None:
            raise ProtocolError("HELLO twice")
        info = self._pool_info(_int(payload_bytes, "payload_bytes"))
        c = self.classes[payload_bytes]
        conn.session = sess = Session(c, namespace, engine, conn.pid, conn.uid, events)
        if c.index_pool is not None and sess.engine_index is not None:
            # Lookups and loads of HITs without a round trip (the engine's
            # MISS is final unless the class has lower tiers to ask).
            info["index"] = {
                "name": c.index_pool.name,
                "engine": sess.engine_index,
                "lower": bool(c.manager.lower),
            }
        self.counters["attached"] += 1
        log.info(
            "kvtier node: engine %s (pid %d, uid %d) attached, namespace %s, class %d B",
            engine,
            conn.pid,
            conn.uid,
            namespace[:12],
            payload_bytes,
        )
        return info

    def status(self) -> dict[str, Any]:
        """What ``kvtier node status`` prints (:func:`kvtier.node.status.report`)."""
        from kvtier.node.status import report

        return report(self)


def _nargs(args: list[Any], n: int) -> None:
    if len(args) != n:
        raise ProtocolError(f"expected {n} arguments, got {len(args)}")


def _int(v: Any, what: str) -> int:
    if type(v) is not int or not 0 < v <= (1 << 40):
        raise ProtocolError(f"{what} must be a positive int")
    return v


def _gid(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "node"


def _share(disk: DiskOptions, n: int) -> Any:
    return disk.capacity_bytes // n if isinstance(disk.capacity_bytes, int) else disk.capacity_bytes


def _pool_id(name: str) -> int:
    """The pool file's identity (its inode): an engine that mapped it checks,
    on reattaching to a restarted node, that it is still the same memory."""
    try:
        return os.stat(f"/dev/shm/{name}").st_ino
    except OSError:
        return 0


def _success(v: Any) -> bool:
    if type(v) is not bool:
        raise ProtocolError("success must be a bool")
    return v


# Each request's handler by its op's number: (its arguments' count, None:
# any; the call; whether it needs an attached session). One place lists
# every op's arity and handler, checked complete below.
_HANDLERS: dict[int, tuple[int | None, Any, bool]] = {
    Op.HELLO: (None, lambda srv, conn, a: srv._hello(conn, *a), False),
    Op.STATUS: (0, lambda srv, conn, a: srv.status(), False),
    Op.POOL: (None, lambda srv, conn, a: srv._pool(conn, a), False),
    Op.LOOKUP: (2, lambda s, a: s.lookup(P.keys_arg(a[0]), P.req_arg(a[1])), True),
    Op.CONTAINS: (1, lambda s, a: s.contains(P.keys_arg(a[0])), True),
    Op.LOAD_PRESENT: (2, lambda s, a: s.load_present(P.keys_arg(a[0]), P.req_arg(a[1])), True),
    Op.PREPARE_LOAD: (2, lambda s, a: s.prepare_load(P.keys_arg(a[0]), P.req_arg(a[1])), True),
    Op.LOAD_PINNED: (2, lambda s, a: s.load_pinned(P.keys_arg(a[0]), P.req_arg(a[1])), True),
    Op.STORE_BEGIN: (
        3,
        lambda s, a: s.stores(
            P.keys_arg(a[0]), P.int_list_arg(a[1]), [P.req_arg(a[2])], [len(a[0])] if a[0] else []
        ),
        True,
    ),
    Op.STORES: (
        4,
        lambda s, a: s.stores(
            P.keys_arg(a[0]), P.int_list_arg(a[1]), P.reqs_arg(a[2]), P.int_list_arg(a[3])
        ),
        True,
    ),
    Op.COMPLETE_LOAD: (2, lambda s, a: s.complete_load(P.keys_arg(a[0]), P.req_arg(a[1])), True),
    Op.LOAD_FAILED: (1, lambda s, a: s.load_failed(P.int_list_arg(a[0])), True),
    Op.TOUCH: (1, lambda s, a: s.touch(P.keys_arg(a[0])), True),
    Op.PREPARE_STORE: (2, lambda s, a: s.prepare_store(P.keys_arg(a[0]), P.req_arg(a[1])), True),
    Op.COMPLETE_STORE: (
        3,
        lambda s, a: s.complete_store(P.keys_arg(a[0]), P.req_arg(a[1]), _success(a[2])),
        True,
    ),
    Op.REQUEST_FINISHED: (1, lambda s, a: s.request_finished(P.req_arg(a[0])), True),
    Op.STEP_END: (2, lambda s, a: s.step_end(P.reqs_arg(a[0]), P.int_list_arg(a[1])), True),
    Op.RESET: (0, lambda s, a: s.reset(), True),
}
_HANDLERS = {int(k): v for k, v in _HANDLERS.items()}
assert set(_HANDLERS) == {int(o) for o in Op}, "every op has a handler"
_NO_REPLY = frozenset(int(o) for o in P.NO_REPLY)
