"""``kvtier bench manager``: manager overhead, in lookup + prepare_store +
complete_store + prepare_load + complete_load cycles per second over many keys
(no data moves; this is the policy layer's cost per block).

A command-line tool: runs in the ``kvtier`` process, the
manager on its calling thread. Who calls: :mod:`kvtier.bench.commands`.
Blocks for the whole run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvtier.bench.harness import freeze_heap_as_engines_do
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.base import LookupResult
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_native import make_host_tier


def cycles(m: Any, keys: list[bytes], batch: int, scan: bool = False) -> float:
    """Cycles per second over ``keys``, ``batch`` keys a call. ``scan``: the
    lookups stop at the first MISS, as vLLM's scan does (``bench manager
    --node``: a node answers a scan in one round trip up to there)."""
    miss = LookupResult.MISS
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ks = keys[i : i + batch]
        for k in ks:
            if m.lookup(k) is miss and scan:
                break
        out = m.prepare_store(ks)
        assert out is not None
        m.complete_store(out.keys_to_store)
        m.prepare_load(ks)
        m.complete_load(ks)
    return len(keys) / (time.perf_counter() - t0)


class _Req:
    """A request's context as vLLM hands it to the manager (its id)."""

    __slots__ = ("req_id",)

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


def returning_cycles(
    m: Any, keys: list[bytes], batch: int, lag: int, barrier: Any = None
) -> tuple[float, int]:
    """Cycles per second of a key's life in vLLM, ``batch`` keys a call: a
    request whose scan MISSes and that stores the keys, and ``lag`` calls
    later the keys' return, a request whose scan HITs and that loads them
    (vLLM loads only what a lookup found, in a later step than the store).
    Each request is announced, passed as vLLM's context and finished, as
    vLLM does; each call is one scheduler step, ended by ``on_schedule_end``
    (the worst case: one request a step). Returns the rate and how many
    returning keys missed (0 unless the manager lost some: fell more than
    ``lag`` calls behind, or evicted them). ``barrier``: called once at the
    end, timed (a node client's round trip: what the node had queued is
    then done)."""
    miss, hit = LookupResult.MISS, LookupResult.HIT
    back = lag * batch
    missed = 0
    t0 = time.perf_counter()
    for i in range(0, len(keys) + back, batch):
        ks = keys[i : i + batch]
        if ks:
            req = _Req(f"s{i}")
            m.on_new_request(req)
            for k in ks:
                if m.lookup(k, req) is miss:
                    break
            out = m.prepare_store(ks, req)
            assert out is not None
            m.complete_store(out.keys_to_store, req)
            m.on_request_finished(req)
        if i >= back:
            req = _Req(f"r{i}")
            m.on_new_request(req)
            found = []
            for k in keys[i - back : i - back + batch]:
                if m.lookup(k, req) is not hit:
                    break
                found.append(k)
            missed += min(batch, len(keys) - (i - back)) - len(found)
            if found:
                m.prepare_load(found, req)
                m.complete_load(found, req)
            m.on_request_finished(req)
        m.on_schedule_end()
    if barrier is not None:
        barrier()
    return len(keys) / (time.perf_counter() - t0), missed


def index_cycles(index: Any, keys: list[bytes], batch: int) -> float:
    """The host tier's own share of :func:`cycles` (no manager around it),
    in keys per second: allocate for a batch (its keys protected), write it
    as one chain, make it ready, pin it and unpin it, ``batch`` keys a call.
    ``index``: a :class:`HostTier` or a native ``HostIndex`` (the same calls
    but the writes' readiness, which HostTier takes with the entries)."""
    native = not isinstance(index, HostTier)
    prev: bytes | None = None
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ks = keys[i : i + batch]
        got = index.allocate(len(ks), set(ks), False)
        assert got is not None
        parents = [prev, *ks[:-1]]
        index.add_writing_many(ks, got[0], parents)
        if native:
            index.mark_ready_many(ks)
        else:
            entries = index.entries
            index.mark_ready_many(ks, [entries[k] for k in ks])
        index.pin_many(ks)
        index.unpin_many(ks)
        prev = ks[-1]
    return len(keys) / (time.perf_counter() - t0)


def run_index(keys: list[bytes], capacity: int, repeats: int) -> dict[str, Any]:
    """:func:`index_cycles` of the Python host tier (LRU) and of the native
    index, interleaved run by run, at 1 and 16 keys a call: medians and the
    native's ratio."""
    from kvtier._native import HostIndex

    out: dict[str, Any] = {}
    for batch in (1, 16):
        py, nat = [], []
        for _ in range(repeats):
            py.append(index_cycles(HostTier(None, capacity, policy="lru"), keys, batch))
            nat.append(index_cycles(HostIndex(capacity), keys, batch))
        out[f"host_tier_keys_per_s_batch{batch}"] = round(statistics.median(py))
        out[f"native_index_keys_per_s_batch{batch}"] = round(statistics.median(nat))
        out[f"native_index_ratio_batch{batch}"] = round(
            statistics.median(n / p for n, p in zip(nat, py)), 2
        )
    return out


def run_manager(num_keys: int = 1_000_000, policy: str = "lru", repeats: int = 3) -> dict[str, Any]:
    keys = [i.to_bytes(32, "little") + b"\0\0\0\0" for i in range(num_keys)]
    capacity = max(1, num_keys // 2)  # half fits: the second half evicts
    freeze_heap_as_engines_do()
    out: dict[str, Any] = {
        "component": "manager",
        "policy": policy,
        "keys": num_keys,
        "host_blocks": capacity,
    }
    for batch in (1, 16):
        rates = []
        for _ in range(repeats):
            m = TieredOffloadingManager(make_host_tier(None, capacity, policy=policy))
            rates.append(cycles(m, keys, batch))
        out[f"cycles_per_s_batch{batch}"] = round(statistics.median(rates))
    if policy == "lru":  # the native index keeps LRU order only
        out.update(run_index(keys, capacity, repeats))
    out["ops_per_s"] = out["cycles_per_s_batch1"]
    out["us_per_cycle"] = round(1e6 / out["ops_per_s"], 3)
    out["note"] = (
        "a cycle is lookup + prepare_store + complete_store + prepare_load + "
        "complete_load of one key; batch16 passes 16 keys per call"
    )
    return out
