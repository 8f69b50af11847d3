"""What an engine attached to a node counts of its own, and what the vLLM
shim's gauges read of the node's host tier.

Process: the engine's scheduler. Who calls: :class:`~kvtier.node.client.
NodeManager` (which owns both; updated under its lock), the vLLM shim's
metrics and tests (read). Nothing here blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HostView:
    """The node's host tier as the shim's gauges read it: its size, and its
    use as of the last step end answered."""

    capacity: int
    used: int = 0

    def __len__(self) -> int:
        return self.used


@dataclass
class NodeClientStats:
    """The client's own counters (the node keeps the tiers')."""

    node_down_lookups: int = 0
    node_dropped_stores: int = 0
    node_failures: int = 0
    reattaches: int = 0
    round_trips: int = 0
    pool_changed: bool = False
