"""An engine's link to the node: its one connection
(:class:`~kvtier.node.connection.NodeClient`), the node's shared index when
it offers one (:class:`~kvtier.node.shared_view.SharedView`), and how the
engine notices the node gone and reattaches. :class:`NodeLink` is the base of
:class:`~kvtier.node.client.NodeManager`, which holds the manager interface.

Process: the engine's scheduler. Who calls: :class:`~kvtier.node.client.
NodeManager`, under its lock. Attaching and the calls that need the node
(``_call``) block for one Unix-socket round trip, at most ``timeout_s``;
posted calls (``_send``) do not wait.

A node that is gone (killed, restarting) is the same degradation as a
failed Redis: the client tries to reattach at most once a second, at a step
end, and goes on as before once the node answers with the same pool.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError
from kvtier.node import protocol as P
from kvtier.node.client_stats import HostView, NodeClientStats
from kvtier.node.connection import NodeClient, NodeError, NodeUnavailable
from kvtier.node.protocol import Op
from kvtier.node.shared_view import SharedView
from kvtier.tiers.base import TierEvent

if TYPE_CHECKING:
    from kvtier.pool import HostPool

log = logging.getLogger("kvtier.node")

REATTACH_PERIOD_S = 1.0
# Posted calls that wait for the next message out: a sendall each cost 12 us, a
# third of the in-process manager's cycle (bench manager --node, 16 keys a call).
_INFORM = frozenset({Op.LOAD_PINNED, Op.TOUCH, Op.REQUEST_FINISHED})


class NodeLink:
    """One engine's connection to the node at ``path`` and the node's
    shared index; attaches at once (NodeUnavailable when no node answers).
    ``namespace`` (32 hex digits) and ``payload_bytes`` choose what the
    engine shares; ``events``: whether it takes KV events."""

    def __init__(
        self,
        path: str,
        namespace: str,
        payload_bytes: int,
        engine: str,
        timeout_s: float,
        spin_s: float,
        events: bool,
    ) -> None:
        self.path = path
        self.events = events
        self.namespace = namespace
        self.payload_bytes = payload_bytes
        self.engine = engine
        self._client = NodeClient(path, timeout_s, spin_s)
        self.client_stats = NodeClientStats()
        self._events: list[TierEvent] = []
        self._finished: list[Any] = []  # request ids, told with the step end
        self._loaded: list[int] = []  # slots loaded through the shared index, likewise
        self._pending = False
        self._asked = False  # this step asked the node to look (it may start work)
        self._alive = False  # polled since the last step end sent (_index)
        # The native view of a shared index polled since the last step end sent
        # (_index), else None: the usual scan, store and load take it alone.
        self._fast: Any = None
        self._next_attach = 0.0
        self._refused = ""  # the node's last refusal at a reattach (logged once)
        # The node's shared index, when it offers one (no round trips).
        self._view: SharedView | None = None
        self.pool: dict[str, Any] = self._attach()
        self.host = HostView(int(self.pool["num_slots"]))

    def attach_pool(self) -> HostPool:
        """This process's mapping of the node's pool, as slots of this
        engine's block size (the node's block sizes share one region).
        Blocks while it maps."""
        from kvtier.pool import HostPool

        return HostPool.attach(str(self.pool["pool"]), slot_bytes=int(self.pool["slot_bytes"]))

    # -- connection ----------------------------------------------------------
    def _attach(self) -> dict[str, Any]:
        hello = (P.VERSION, self.namespace, self.payload_bytes, self.engine, self.events)
        info = dict(self._client.call(Op.HELLO, *hello))
        self._open_index(info.pop("index", None))
        return info

    def _open_index(self, ix: Any) -> None:
        self._drop_index()
        self._alive = False  # its first use polls (_index)
        self._view = SharedView.open(ix, bytes.fromhex(self.namespace)[:8])

    def _drop_index(self) -> None:
        """Forget the shared index (the node is gone: a node started again reuses its slots)."""
        self._fast = None
        if self._view is not None:
            self._view.close()
            self._view = None

    def _down(self, e: Exception) -> None:
        self._drop_index()
        self._finished.clear()  # a node started again never saw them
        self._loaded.clear()
        if self._client.connected:
            self._client.close()
        self.client_stats.node_failures += 1
        log.warning("kvtier: node at %s unavailable (%s): serving without it", self.path, e)
        self._next_attach = time.monotonic() + REATTACH_PERIOD_S

    @property
    def attached(self) -> bool:
        return self._client.connected and not self.client_stats.pool_changed

    def _reattach(self) -> None:
        if self.client_stats.pool_changed or time.monotonic() < self._next_attach:
            return
        self._next_attach = time.monotonic() + REATTACH_PERIOD_S
        try:
            info = self._attach()
        except NodeError as e:  # it answers but refuses us (another protocol version)
            self._client.close()
            if str(e) != self._refused:  # once, not at every try
                self._refused = str(e)
                log.error("kvtier: the node at %s refused this engine: %s", self.path, e)
            return
        except KvtierError:
            self._client.close()
            return
        if (info["pool"], info["pool_id"]) != (self.pool["pool"], self.pool["pool_id"]):
            # The workers map the old pool: copying into the new one needs
            # them to map it again, which only an engine restart does.
            self.client_stats.pool_changed = True
            self._client.close()
            self._drop_index()  # the new pool's: the workers map the old one
            msg = "kvtier: the node at %s came back with another pool (%s, not %s): %s"
            why = "this engine serves without it until restarted"
            log.error(msg, self.path, info["pool"], self.pool["pool"], why)
            return
        self.client_stats.reattaches += 1
        log.warning("kvtier: reattached to the node at %s", self.path)

    def _index(self) -> SharedView | None:
        """The shared index, when there is one and the node is alive: its
        connection is polled at the first use after a step end sent (a dead
        node's index is never read past the step that noticed). Not once a call:
        only a node started again reuses the old one's slots, far later than
        STEPS_PER_END steps; a poll a step was 3% of the engine's time a key."""
        view = self._view
        if view is None or self._alive:
            return view
        if self._client.peer_gone():
            self._down(NodeUnavailable(0, f"kvtier node at {self.path}: the connection closed"))
            return None
        self._alive = True
        self._fast = view.native
        return view

    def _call(self, op: Op, *args: Any) -> Any:
        self.client_stats.round_trips += 1
        if op is Op.LOOKUP or op is Op.LOAD_PRESENT:
            self._asked = True
        out = self._client.call(op, *args)
        if self._client.owed:  # the replies of posted step ends came before ours
            for r in self._client.replies():
                self._step_reply(r)
        return out

    def _send(self, op: Op, *args: Any) -> None:
        """A call whose effect dies with the node anyway (its leases): when
        the node is gone there is nothing to give back. No reply is awaited.
        Calls that only inform the node go with the next message sent (or
        FLUSH_AFTER_S later: the connection's flusher); so do the rest with
        a shared index, which shows a finished store to every engine at
        once. Without one the rest are sent now. STORES: a store's begin
        or end (:meth:`NodeClient.post_stores`)."""
        if not self.attached:
            return
        try:
            if op is Op.STORES:
                return self._client.post_stores(*args)
            self._client.post(op, *args)
            if op not in _INFORM and self._view is None:
                self._client.flush()
        except NodeUnavailable as e:
            self._down(e)

    def _step_reply(self, reply: Any) -> None:
        events, self._pending, self.host.used, *more = reply
        for tier, removed, keys, ids, meta in events:
            self._events.append(TierEvent(keys, tier, removed, ids=ids, metadata_only=meta))
        if more and self._view is not None:  # slots added to the reservation, keys it evicted
            self._view.reserve(more[0])
            self._view.evicted.extend(more[1])

    def _settle(self, wait: bool) -> None:
        """Takes the replies of posted step ends that have come (all of
        them, blocking, with ``wait``)."""
        if self._client.owed:
            try:
                for r in self._client.replies(wait):
                    self._step_reply(r)
            except NodeUnavailable as e:
                self._down(e)
