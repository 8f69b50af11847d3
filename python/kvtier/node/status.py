"""What ``kvtier node status`` prints: the attached engines, namespaces,
each slot class's occupancy, leases and tier counters.

Process: the node. Who calls: :meth:`kvtier.node.server.NodeServer.status`
(its STATUS request and its metrics), on the node's serving thread.
Non-blocking.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.node.server import NodeServer


def report(srv: NodeServer) -> dict[str, Any]:
    """What ``kvtier node status`` prints: engines, namespaces,
    occupancy, leases, tier counters. Non-blocking."""
    engines = []
    namespaces: dict[str, int] = {}
    for conn in srv.conns.values():
        s = conn.session
        if s is None:
            continue
        namespaces[s.namespace] = namespaces.get(s.namespace, 0) + 1
        engines.append(
            {
                "engine": s.engine,
                "pid": conn.pid,
                "uid": conn.uid,
                "namespace": s.namespace,
                "class": s.cls.payload_bytes,
                "calls": s.calls,
                "leases": s.leases(),
                "events_dropped": s.events_dropped,
            }
        )
    classes = {}
    for b, c in srv.classes.items():
        classes[str(b)] = {
            "pool": c.pool.name,
            "slot_bytes": c.pool.slot_bytes,
            "occupancy": c.occupancy(),
            "quarantined": c.quarantine.slots,  # held since an engine died (its copies)
            "stats": {
                "stores": c.manager.stats.stores,
                "loads": c.manager.stats.loads,
                "lookups": dict(c.manager.stats.lookups),
                "promotions": c.manager.stats.promotions,
                "cascades": c.manager.stats.cascades,
            },
            "tiers": {t.name: t.stats() for t in c.manager.lower},
        }
    return {
        "node": srv.config.name,
        "socket": srv.config.socket_path,
        "uptime_s": round(time.time() - srv.started, 1),
        "host_bytes": srv.config.host.bytes,
        "engines": engines,
        "namespaces": namespaces,
        "region": srv.region.status() if srv.region is not None else None,
        "classes": classes,
        "counters": dict(srv.counters),
        "writers": len(srv.writers),  # engines' worker processes known (POOL)
    }
