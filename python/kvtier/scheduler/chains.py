"""Prefix chains of offered keys: each key's parent, for the host tier's
prefix-aware eviction (a chain's tail goes first) and the lower tiers'
cascades.

Process: the engine's scheduler, or the node (the manager runs in both).
Who calls: :class:`~kvtier.scheduler.manager.TieredOffloadingManager`'s
prepare_store and adopt_store, once an offer. Pure; never blocks.
"""

from __future__ import annotations

from kvtier import _native


def offer_parents(
    offer: list[bytes], last: dict[bytes, bytes] | None, miss: dict[bytes, bytes]
) -> list[bytes | None] | None:
    """Each offered key's predecessor in its chain, in the offer's order
    (None where none is known; None instead of a list for a one-key offer
    of no request whose key has no hint): the key offered before it (of
    its group: vLLM offers group by group), else the request's last
    offered key of that group (``last``, the request's, by group; None: an
    offer with no request, chained within itself only, as such callers may
    never say it ended), else the key its scan looked up before it
    (``miss``, popped). Remembers the offer's last
    key per group in ``last`` for the request's next offer.

    A list, not a dict: the host tier takes it as is (a dict was 2% of a
    cycle: callgrind, kvtier bench manager, 16-key offers). The rule itself
    is native (``csrc/bindings/chains.h``), the one the node's store path
    uses too; keys must be bytes (InvalidArgument otherwise)."""
    if last is None and len(offer) == 1:  # the common call of a plain caller
        p = miss.pop(offer[0], None) if miss else None
        return [p] if p is not None else None
    return _native.offer_parents(offer, last, miss)
