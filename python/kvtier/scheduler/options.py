"""The manager's options: one typed dataclass instead of feature flags.

Process: the engine's scheduler (any process that builds a manager). Who
calls: whoever builds a :class:`~kvtier.scheduler.manager.TieredOffloadingManager`
(the vLLM shim, replay, benchmarks, tests). Nothing here blocks. The manager
reads its options at each call, so a test may change one between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidArgument

KeyOrder = Callable[[bytes, Any], Sequence[bytes]]
"""``key_order(key, req_context)``: the keys the request will look up after
``key``, in the order the engine will look them up (empty when unknown)."""

EAGER_PROMOTE = 16
"""Promotions a lookup queues for one tier before it starts them itself,
rather than waiting for the step to end: a long prefix's first reads then
overlap the rest of its scan (the engine scans a prefix key by key)."""

SCAN_BACKOFF_S = 1.0
"""After a lookup's wait ran into its deadline (a server that stopped
answering, a device stuck), lookups do not wait again for this long: a hung
tier costs the scheduler one deadline, not one per step."""


PARTIAL_STORES = ("prefix", "free", "none")
"""The choices of :attr:`ManagerOptions.partial_stores`, the default first."""


@dataclass
class ManagerOptions:
    """How the manager moves blocks between tiers.

    ``streaming``: a hit in a lower tier that another process can read
    (``reader_spec``) and that finds no room in the host tier is reported HIT
    and handed to the engine's worker to read itself (a
    :class:`~kvtier.scheduler.specs.StreamSpec` in the load) instead of MISS,
    so a prefix longer than the host tier still loads whole.
    ``streaming_stores``: likewise, offered blocks that find no host slot are
    written by the worker straight to such a tier (only where one worker
    holds a whole block: no tensor parallelism). ``promote=False`` (with
    ``streaming``): such hits are always streamed, never promoted into the
    host tier first.

    ``scan_wait_s`` > 0: the first lookup of a request that misses the host
    tier reads that key and the request's following keys (``key_order``)
    from the lower tiers at once and waits for them, so a returning prefix is
    HIT in the step it is first looked up (see
    :mod:`kvtier.scheduler.readahead`); at most ``scan_wait_s`` of waiting and
    ``scan_bytes`` read per scheduler step. ``probe``: keys a tier does not
    know yet are probed (one GET answers "exists?" and brings the bytes)
    rather than checked first. ``fenced``: reads of keys a tier holds are
    not waited for; their slots are fenced and the keys HIT at once (see
    :mod:`kvtier.scheduler.fences`); only for engines whose worker reports
    failed loads.

    ``cascade_on_hit``: a host block the engine loads (a reuse) is offered to
    the lower tiers' cascade again. With lower tiers that admit a block on
    its second offer (``admit_after=2``), a block is then written to disk or
    Redis on its first reuse instead of when it is stored: blocks nobody
    comes back for (a workload without reuse) are never written.

    ``partial_stores``: what ``prepare_store`` does when not every new block
    of an offer finds a host slot (blocks pinned, being written or offered
    leave too few to evict). ``"prefix"``: store the longest head of the
    offer that fits, evicting ready blocks for it (a prefix is looked up
    from its start, so its head is worth most); ``"free"``: store the head
    that fits in free slots, evicting nothing; ``"none"``: store nothing
    (None), as vLLM's own manager does (the engine offers the blocks again).
    :data:`PARTIAL_STORES` names them; ``bench/policy_sweep.py
    --partial-stores`` compares them.

    ``events=False``: the host tier's stored and removed events are not
    recorded (``take_events`` still drains the lower tiers'), for an engine
    that publishes no KV events: vLLM drains and drops them then, as its own
    manager does not make them (``enable_events``).
    """

    streaming: bool = False
    streaming_stores: bool = False
    promote: bool = True
    scan_wait_s: float = 0.0
    scan_bytes: int = 64 << 20
    key_order: KeyOrder | None = None
    probe: bool = False
    fenced: bool = False
    cascade_on_hit: bool = False
    partial_stores: str = "prefix"
    events: bool = True

    def __post_init__(self) -> None:
        if self.partial_stores not in PARTIAL_STORES:
            raise InvalidArgument(
                f"partial_stores must be one of {', '.join(PARTIAL_STORES)}, "
                f"got {self.partial_stores!r}"
            )
        if not self.scan_wait_s >= 0 or self.scan_bytes < 0:
            raise InvalidArgument(
                f"scan_wait_s and scan_bytes must be >= 0, got {self.scan_wait_s}, "
                f"{self.scan_bytes}"
            )
        self.scan_wait_s = float(self.scan_wait_s)
        self.scan_bytes = int(self.scan_bytes)
