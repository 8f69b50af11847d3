"""The remote tier: a Redis / Valkey pool (standalone or Redis Cluster) shared
by engine instances across nodes, one room like ``tiers/disk/``.

``tier`` the tier itself (:class:`RemoteTier`: lookups, jobs, the pool's
event stream), ``url`` the URL and TLS settings and what opens a native
client (:class:`RemoteConnection`), ``index`` what the pool holds as its
event stream says (:class:`~kvtier.tiers.remote.index.PoolIndex`),
``stream`` that stream's format, ``announce`` the stores waiting for their
entry in it, ``worker`` the engine worker's reads and writes of the pool.

Process: the engine's scheduler (``worker``: the engine's worker). Who
calls: the factory, the manager, the tools. Importing the package blocks on
nothing and loads no native code: the names below are imported on first use
(``kvtier.options`` reads ``stream``'s defaults in every vLLM process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_getattr

if TYPE_CHECKING:
    from kvtier.tiers.remote.tier import RemoteTier
    from kvtier.tiers.remote.url import (
        RemoteConnection,
        default_connections,
        parse_url,
        redact_url,
    )

_LAZY = {
    "RemoteTier": "kvtier.tiers.remote.tier",
    "STREAM_DELAY_S": "kvtier.tiers.remote.tier",
    "RemoteConnection": "kvtier.tiers.remote.url",
    "default_connections": "kvtier.tiers.remote.url",
    "parse_url": "kvtier.tiers.remote.url",
    "redact_url": "kvtier.tiers.remote.url",
}

__getattr__ = lazy_getattr("kvtier.tiers.remote", _LAZY)

__all__ = ["RemoteConnection", "RemoteTier", "default_connections", "parse_url", "redact_url"]
