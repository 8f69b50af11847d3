"""The node's Prometheus metrics (``kvtier node --metrics-port``).

Process: the node. Who calls: :class:`~kvtier.node.server.NodeServer` at
start (:class:`NodeMetrics`); Prometheus scrapes on prometheus_client's own
HTTP thread, which reads a snapshot the event loop refreshes (never the
tiers themselves: they belong to the loop's thread). Nothing here blocks but start-up (the
HTTP server's bind).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgument

if TYPE_CHECKING:
    from kvtier.node.server import NodeServer


class NodeMetrics:
    """Serves the node's counters and per-class occupancy on ``port``."""

    def __init__(self, server: NodeServer, port: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise InvalidArgument(
                "--metrics-port needs prometheus_client (pip install prometheus_client)"
            ) from None
        self._server = server
        self._snapshot: dict[str, Any] = {}
        self._mu = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.refresh()
        self._http, self._thread = start_http_server(port, registry=self.registry)

    def refresh(self) -> None:
        """Take a snapshot (the event loop's thread, after each request batch)."""
        st = self._server.status()
        with self._mu:
            self._snapshot = st

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._mu:
            st = self._snapshot
        engines = GaugeMetricFamily("kvtier_node_engines", "engines attached")
        engines.add_metric([], len(st.get("engines", [])))
        yield engines
        for name, value in st.get("counters", {}).items():
            c = CounterMetricFamily(f"kvtier_node_{name}", f"node counter {name}")
            c.add_metric([], value)
            yield c
        occ = GaugeMetricFamily(
            "kvtier_node_blocks", "host blocks by state", labels=["block_bytes", "state"]
        )
        chunks = GaugeMetricFamily(
            "kvtier_node_chunks", "chunks of the region a block size holds", labels=["block_bytes"]
        )
        for b, cls in st.get("classes", {}).items():
            for state, v in cls["occupancy"].items():
                if state == "chunks":
                    chunks.add_metric([b], v)
                elif state != "chunk_bytes":
                    occ.add_metric([b, state], v)
        yield occ
        yield chunks

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
