"""An engine's batch in a replay: several requests in flight, each storing
its blocks over several steps (chunked prefill), for policy studies.

A command-line tool's room (never imported by the library): runs in the
process that replays (``bench/policy_sweep.py --in-flight``). Who calls:
the policy sweep and the prefix-eviction tests. Blocks for the whole replay.

Why: :meth:`kvtier.replay.Replayer.run` serves one request at a time, so a
request's blocks are stored in one call, adjacent in every policy's order;
an engine interleaves requests and stores each one's blocks over several
steps, so a prefix's head and tail are far apart in recency, and an
eviction that ignores prefixes strands tails (blocks whose predecessor is
gone, which can never hit again).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.replay import MAX_PENDING_STEPS, Replayer, ReplayResult, key_of


def run_interleaved(
    r: Replayer,
    trace: Sequence[Sequence[int]],
    in_flight: int = 16,
    blocks_per_step: int = 4,
    store_retries: int = 8,
) -> ReplayResult:
    """The trace as a batching engine runs it (policy studies: no data):
    ``in_flight`` requests at a time, each offering its new blocks
    ``blocks_per_step`` a step (chunked prefill), a step's stores
    completed at the next step's start (their copies take a step), an
    offer refused whole (None) offered again next step, up to
    ``store_retries`` times. Each request is looked up and loaded when
    it is admitted. Blocks the engine; returns the result."""
    if r.transfer is not None:
        raise InvalidArgument("interleaved replay is for policy studies: no data")
    t0 = time.perf_counter()
    res, m = r.result, r.m
    todo = iter(enumerate(trace))
    active: list[list[Any]] = []  # [context, keys left to offer, refusals]
    writing: list[tuple[Any, list[bytes]]] = []
    more = True
    while more or active or writing:
        with m.lock:
            for ctx, keys in writing:
                m.complete_store(keys, ctx)
            writing = []
        while more and len(active) < in_flight:
            nxt = next(todo, None)
            if nxt is None:
                more = False
                break
            i, hash_ids = nxt
            if r.on_request is not None:
                r.on_request(i)
            keys = [key_of(h) for h in hash_ids]
            r.note_chain(keys)
            ctx = SimpleNamespace(req_id=i)
            with m.lock:
                m.on_new_request(ctx)
            hits = r.lookup_prefix(keys)
            with m.lock:
                for k in keys[:hits]:
                    res.hit_blocks[m.get_load_source(k)] += 1
                if hits:
                    m.prepare_load(keys[:hits], ctx)
                    m.complete_load(keys[:hits], ctx)
            res.requests += 1
            res.block_refs += len(keys)
            if res.requests % r.series_every == 0:
                r.sample()
            active.append([ctx, keys[hits:], 0])
        with m.lock:
            for req in active:
                ctx, left, _ = req
                chunk = left[:blocks_per_step]
                out = m.prepare_store(chunk, ctx) if chunk else None
                if chunk and out is None:
                    res.store_rejections += 1
                    req[2] += 1
                    if req[2] <= store_retries:
                        continue  # offered again next step
                elif out is not None and out.keys_to_store:
                    writing.append((ctx, list(out.keys_to_store)))
                req[1], req[2] = left[len(chunk) :], 0
            for req in [r for r in active if not r[1]]:
                m.on_request_finished(req[0])
                active.remove(req)
            m.on_schedule_end()
    for _ in range(MAX_PENDING_STEPS):
        with m.lock:
            if not m.has_pending_work():
                break
            m.on_schedule_end()
    r.sample()
    with m.lock:
        res.stranded = r.stranded(lower=True)
    res.wall_s = time.perf_counter() - t0
    return res
