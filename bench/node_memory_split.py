"""The node's memory between two block sizes: a fixed even split (what the
node did before) against the division by use (kvtier.node.chunks), on the
node's own tier code (host tiers and managers of one region), no engines.

Two models on one node, each a stream of multi-turn conversations: a turn
looks its conversation's prefix up (the hit blocks are the prefill saved),
then stores the blocks it added. The streams differ in block size, in
conversations and in turns per second, so their working sets differ. Printed:
per model the blocks and bytes hit, per configuration the hit bytes of both
together (the prefill saved), and the ratio by use / fixed.

Usage: ``python bench/node_memory_split.py [--region-mib 64] [--turns 40000]
[--seeds 3] [--json FILE]``. A script (the kvtier process); blocks for the
whole run (a few seconds per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from kvtier.node.chunks import ChunkedHostTier, chunk_bytes_for, open_region
from kvtier.options.tiers import HostOptions
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.base import LookupResult
from kvtier.tiers.host import HostTier


@dataclass(frozen=True)
class Model:
    name: str
    block_bytes: int
    conversations: int  # live at once: the working set's breadth
    blocks_per_turn: int  # blocks a turn adds to its conversation
    max_turns: int  # a conversation ends (a new one starts) after this many
    share: float  # of all turns


#: Workloads: two models' streams each. "balanced": an even split is about
#: the best fixed one; "skewed": the large-block model's working set is
#: small (about 4 of 16 chunks is the best fixed split); "idle": the
#: large-block model gets 2% of the turns.
SCENARIOS = {
    "balanced": (
        Model("large-blocks", 256 << 10, 8, 2, 10, 0.25),
        Model("small-blocks", 32 << 10, 64, 4, 12, 0.75),
    ),
    "skewed": (
        Model("large-blocks", 256 << 10, 4, 2, 10, 0.25),
        Model("small-blocks", 32 << 10, 96, 4, 12, 0.75),
    ),
    "idle": (
        Model("large-blocks", 256 << 10, 8, 2, 10, 0.02),
        Model("small-blocks", 32 << 10, 96, 4, 12, 0.98),
    ),
}


def _turns(models: tuple[Model, ...], n: int, seed: int) -> list[tuple[int, list[bytes], int]]:
    """``n`` turns of both models interleaved at their shares: (model index,
    the conversation's prefix keys, blocks added this turn)."""
    rng = random.Random(seed)
    convs: list[list[list[bytes]]] = [[[] for _ in range(m.conversations)] for m in models]
    turns_of: list[list[int]] = [[0] * m.conversations for m in models]
    next_id = 0
    out = []
    for _ in range(n):
        i = 0 if rng.random() < models[0].share else 1
        m = models[i]
        c = rng.randrange(m.conversations)
        if turns_of[i][c] >= m.max_turns:  # a new conversation in its place
            convs[i][c], turns_of[i][c] = [], 0
        for _ in range(m.blocks_per_turn):
            convs[i][c].append(next_id.to_bytes(8, "little") + bytes([i]) * 4)
            next_id += 1
        turns_of[i][c] += 1
        out.append((i, list(convs[i][c]), m.blocks_per_turn))
    return out


def _run(managers: list[Any], turns: list[tuple[int, list[bytes], int]]) -> list[int]:
    """Blocks hit per model: each turn's prefix up to its first miss (as an
    engine's scan), then every block of the turn offered, as an engine
    offers a request's blocks once computed (those held are kept as they are;
    the others, recomputed or new, stored)."""
    hits = [0] * len(managers)
    for i, keys, added in turns:
        m = managers[i]
        for k in keys[:-added]:
            if m.lookup(k) is not LookupResult.HIT:
                break
            hits[i] += 1
        out = m.prepare_store(keys)
        if out is not None:
            m.complete_store(out.keys_to_store)
        m.on_schedule_end()
    return hits


def _compare(
    models: tuple[Model, ...],
    turns: list[tuple[int, list[bytes], int]],
    region_bytes: int,
    seed: int,
) -> dict[str, Any]:
    """Hit blocks and bytes of a fixed even split and of the division by use."""
    run: dict[str, Any] = {"seed": seed}
    # Fixed: each block size an equal half, as separate host tiers.
    fixed = [
        TieredOffloadingManager(HostTier(None, region_bytes // 2 // m.block_bytes), events=False)
        for m in models
    ]
    # By use: one region, chunks moving between the block sizes.
    region = open_region(
        f"kvbench-split-{os.getpid()}-{seed}", region_bytes, chunk_bytes_for(region_bytes)
    )
    try:
        tiers = [ChunkedHostTier(region.view(m.block_bytes), HostOptions(), region) for m in models]
        by_use = [TieredOffloadingManager(t, events=False) for t in tiers]
        for label, managers in (("fixed", fixed), ("by_use", by_use)):
            hits = _run(managers, turns)
            run[label] = {
                "hit_blocks": hits,
                "hit_bytes": sum(h * m.block_bytes for h, m in zip(hits, models)),
            }
        run["by_use"]["chunks"] = [len(t.chunks) for t in tiers]
        run["by_use"]["reassigned"] = region.reassigned
    finally:
        region.pool.close()
    run["ratio"] = round(run["by_use"]["hit_bytes"] / max(1, run["fixed"]["hit_bytes"]), 3)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--region-mib", type=int, default=64)
    ap.add_argument("--turns", type=int, default=40_000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    region_bytes = args.region_mib << 20
    results: dict[str, Any] = {
        "region_bytes": region_bytes,
        "chunk_bytes": chunk_bytes_for(region_bytes),
        "turns": args.turns,
        "scenarios": {},
    }
    for scenario, models in SCENARIOS.items():
        runs = []
        for seed in range(args.seeds):
            run = _compare(models, _turns(models, args.turns, seed), region_bytes, seed)
            runs.append(run)
            print(scenario, json.dumps(run), flush=True)
        med = statistics.median(r["ratio"] for r in runs)
        results["scenarios"][scenario] = {
            "models": [m.__dict__ for m in models],
            "runs": runs,
            "ratio_median": med,
        }
        print(f"{scenario}: hit bytes, by use / fixed even split: median {med} "
              f"over {args.seeds} seeds")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
