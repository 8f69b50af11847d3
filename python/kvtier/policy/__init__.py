"""Eviction policies and admission filters (plain Python, pluggable by dotted path).

Process: wherever a tier lives (the engine's scheduler; ``kvtier replay``).
Who calls: the tiers, under the manager's lock. Pure bookkeeping: nothing
blocks or does I/O."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.policy.admission import AdmissionFilter
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.plfu import PLFUPolicy, native_plfu

# "plfu" is the native ranking (same victims as PLFUPolicy, a fraction of the cost).
_BUILTIN: dict[str, Callable[[int], Any]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "plfu": native_plfu,
}


def make_policy(spec: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """``"lru"``, ``"arc"``, ``"plfu"`` (native: :func:`native_plfu`), ``"pkg.module.Class"`` (constructed with
    ``capacity``) or an instance. ``"belady"`` needs the future: only
    ``kvtier replay`` builds it (:func:`kvtier.replay.main_replay`)."""
    if not isinstance(spec, str):
        return spec
    cls = _BUILTIN.get(spec.lower())
    if spec.lower() == "belady":
        raise InvalidArgument("policy 'belady' knows the future: only kvtier replay can run it")
    if cls is None:
        module, _, name = spec.rpartition(".")
        if not module:
            raise InvalidArgument(
                f"unknown policy {spec!r}: use lru, arc, plfu or a dotted class path"
            )
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise InvalidArgument(f"cannot load policy {spec!r}: {e}") from None
    policy: EvictionPolicy = cls(capacity)
    for method in ("insert", "touch", "remove", "victims"):
        if not callable(getattr(policy, method, None)):
            raise InvalidArgument(f"policy {spec!r} lacks method {method}()")
    return policy


__all__ = [
    "ARCPolicy",
    "AdmissionFilter",
    "EvictionPolicy",
    "LRUPolicy",
    "PLFUPolicy",
    "make_policy",
    "native_plfu",
]
