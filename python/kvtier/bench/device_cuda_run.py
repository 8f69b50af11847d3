"""``kvtier bench copy --device cuda``, the whole run: the cases of
:mod:`kvtier.bench.device_cuda`, the cost of registration and of sharing the
GPU (:mod:`kvtier.bench.device_cuda_costs`) and the machine's facts
(:mod:`kvtier.bench.device_cuda_report`), within the time asked for.

A command-line tool's module: runs in the ``kvtier`` process. Who calls:
``kvtier bench copy --device cuda`` and ``make gpu-check``. Blocks (minutes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier.bench import device_cuda_costs as costs
from kvtier.bench.device_cuda import (
    DIRECTIONS,
    Case,
    Settings,
    Staging,
    blocks_per_run,
    ceilings,
    measure_case,
    median,
    repeats_within,
    require_cuda,
    shape_of,
    shm_free,
)
from kvtier.bench.device_cuda_report import gpu_facts
from kvtier.errors import InvalidArgument


def run_device_cuda(s: Settings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark; the result ``kvtier bench copy --device cuda``
    prints. ``progress`` gets a line per step. Blocks (minutes)."""
    torch = require_cuda()  # before anything heavy: no GPU is one clear line
    from kvtier.pool import HostPool

    t_start = time.perf_counter()

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"  [{time.perf_counter() - t_start:6.1f} s] {msg}")

    device = torch.cuda.current_device()
    shm = shm_free()
    host_budget = min(2 * s.bytes_per_run, int(shm * 0.8))
    shapes = [shape_of(layout, tokens, s.model) for tokens in s.tokens for layout in s.layouts]
    for sh in shapes:  # refused now rather than a pool failing minutes in
        if 2 * sh.block_bytes > host_budget:
            raise InvalidArgument(
                f"/dev/shm has {shm >> 20} MiB free: too little for two {sh.block_bytes >> 20} MiB "
                f"slots ({sh.layout}, {sh.tokens} tokens); enlarge it (docker --shm-size) or "
                "give smaller --tokens"
            )
    say("host pool creation and registration")
    # First: before this run's own pinned buffers sit in torch's cache.
    pool_rows = costs.pool_setup(torch, s, shm)
    # Staging holds the largest run of one direction (at least one block).
    st = Staging(torch, max([s.bytes_per_run] + [sh.block_bytes for sh in shapes]))
    ceil = ceilings(torch, st, s.repeats)
    say("ceilings: " + ", ".join(f"{d} {median(v):.1f} GB/s" for d, v in ceil.items()))
    pool: Any = None
    prev: Case | None = None
    stats: dict[str, Any] = {}
    copy_rows: list[dict[str, Any]] = []
    # Kept for what follows the copies: the harm windows, ceilings again, facts.
    reserve = s.harm_rounds * 3 * s.harm_seconds * 1.5 + 10
    spent: list[tuple[float, int]] = []  # (seconds, rounds) of each case measured
    try:
        for k, sh in enumerate(shapes):
            layout, tokens = sh.layout, sh.tokens
            left = s.budget_s - reserve - (time.perf_counter() - t_start)
            per_round = sum(t for t, _ in spent) / max(1, sum(r for _, r in spent))
            repeats = repeats_within(left, per_round, len(shapes) - k, s.repeats)
            if repeats == 0:
                say(f"{layout}, {tokens} tokens: skipped, past the time budget")
                copy_rows.append(
                    {
                        "measure": "copy",
                        "layout": layout,
                        "tokens_per_block": tokens,
                        "skipped": f"past the {s.budget_s:.0f} s time budget",
                    }
                )
                continue
            t0 = time.perf_counter()
            n = blocks_per_run(sh.block_bytes, s.bytes_per_run, host_budget)
            want = (2 * n, sh.block_bytes)
            if pool is not None and (pool.num_slots, pool.slot_bytes) != want:
                if prev is not None:
                    prev.close()
                    prev = None
                pool.close()
                pool = None
            if pool is None:
                pool = HostPool(*want)
            # The next case's transfers exist before the last's go: a pool
            # both use stays page-locked (registrations are shared).
            case = Case(torch, sh, n, pool, st, s)
            if prev is not None:
                prev.close()
            prev = case
            say(
                f"{layout}, {tokens} tokens: {sh.tensors} x {sh.page_bytes} B pages, "
                f"{n} blocks per run"
            )
            copy_rows += measure_case(torch, case, repeats)
            spent.append((time.perf_counter() - t0, repeats + 1))
            stats = stats or case.stats()
    finally:
        if prev is not None:
            prev.close()
        if pool is not None:
            pool.close()
    # The ceiling again at the end: the better of the two, so a slow start
    # does not flatter the contenders.
    again = ceilings(torch, st, s.repeats)
    best = {d: max(median(ceil[d]), median(again[d])) for d in DIRECTIONS}
    for r in (r for r in copy_rows if "gbps" in r):
        r["ceiling_gbps"] = round(best[r["direction"]], 3)
        r["ratio_to_ceiling"] = round(r["gbps"] / best[r["direction"]], 3)
    say("do no harm: matmuls alone, beside kvtier, beside torch's gather")
    harm = costs.do_no_harm(torch, s, st, host_budget)
    ceil_rows = [
        {
            "measure": "ceiling",
            "direction": d,
            "contender": "one contiguous pinned copy",
            "gbps": round(best[d], 3),
            "runs": [round(x, 3) for x in ceil[d] + again[d]],
            "bytes_per_run": st.n * (2 if d == "both" else 1),
        }
        for d in DIRECTIONS
    ]
    facts = gpu_facts(torch, device)  # after the copies: an idle link reads low
    rows = [
        {"component": "copy", "device": "cuda", "gpu": facts["gpu"], **r}
        for r in ceil_rows + copy_rows + pool_rows + harm
    ]
    return {
        "component": "copy",
        "device": "cuda",
        "gpu": facts,
        "kvtier_runtime": {k: stats.get(k) for k in ("runtime", "runtime_version", "device")},
        "kvtier_stats": stats,
        "settings": {
            "tokens": list(s.tokens),
            "layouts": list(s.layouts),
            "repeats": s.repeats,
            "bytes_per_run": s.bytes_per_run,
            "job_bytes": s.job_bytes,
            "loop_copies": s.loop_copies,
            "model": vars(s.model),
        },
        "baselines": {
            "ceiling": "one contiguous non_blocking copy of pinned memory (both: two streams)",
            "torch_gather": "index_select per tensor into a GPU buffer + one copy to pinned "
            "memory (loads: one copy up + index_copy_)",
            "torch_per_block": "host[slot].copy_(kv[block], non_blocking=True) per block and "
            "tensor, pinned host",
        },
        "rows": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
