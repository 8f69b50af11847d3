"""The manager's counters.

Process: the engine's scheduler. Who calls: written by the manager's rooms
under its lock; read by the vLLM shim's metrics, replay and benchmarks (plain ints, no
lock needed for a racy read). Nothing here blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ManagerStats:
    """What the manager did, counted in blocks (keys) unless said otherwise."""

    lookups: dict[str, int] = field(
        default_factory=lambda: {"hit": 0, "hit_pending": 0, "retry": 0, "miss": 0}
    )
    promotions: int = 0
    promotion_failures: int = 0
    # Lookups that waited for their request's reads (scan_wait_s) and the
    # seconds they waited in all (the part of a returning prefix's time to
    # first token spent reading lower tiers), reads that ended within the
    # wait, probes of keys no tier held, and waits cut short by the deadline.
    scan_waits: int = 0
    scan_wait_s: float = 0.0
    scan_reads: int = 0
    fenced_reads: int = 0  # read ahead and HIT at once, loads waiting on their fences
    fenced_failures: int = 0  # of those, reads that failed
    probe_misses: int = 0
    scan_timeouts: int = 0
    cascades: int = 0
    cascades_dropped: int = 0
    cascade_failures: int = 0
    held_slots: int = 0  # host slots kept from reuse after a device timeout
    stores: int = 0
    store_failures: int = 0
    loads: int = 0
    streamed: int = 0  # loaded blocks the engine's worker read from a lower tier
    streamed_stores: int = 0  # stored blocks it wrote to a lower tier itself
    load_failures: int = 0  # chunks (keys) of loads the engine's worker reported failed
    not_admitted: int = 0
    allocation_failures: int = 0
    # Blocks handed to the engine by prepare_load, by the tier they came from.
    loaded_from: dict[str, int] = field(default_factory=dict)
