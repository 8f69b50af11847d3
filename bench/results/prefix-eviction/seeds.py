"""Prefix-aware eviction against the policy alone over several seeds of a
generated workload, 16 requests in flight: whether a small difference at
seed 0 is the rule or the chaos of a cache (issue 49).

Run by hand from the repository root (one core, deterministic, about 6 s
a seed and policy at 1,000 blocks):

    .venv/bin/python bench/results/prefix-eviction/seeds.py agent lru,arc,plfu 1000 10

Prints, per policy, the change in hit rate (points, aware minus plain) for
each seed, then their mean and median.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from kvtier.replay import WORKLOADS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/, for policy_sweep
from policy_sweep import replay


def main() -> None:
    workload, policies, capacity, seeds = sys.argv[1:5]
    for pol in policies.split(","):
        deltas = []
        for seed in range(int(seeds)):
            trace = WORKLOADS[workload](6000, seed)
            plain = replay(trace, pol, int(capacity), None, 16, False)["hit_rate"]
            aware = replay(trace, pol, int(capacity), None, 16, True)["hit_rate"]
            deltas.append(round(100 * (aware - plain), 3))
        print(
            f"{workload} {pol} {capacity}: {deltas} "
            f"mean {statistics.mean(deltas):+.3f} median {statistics.median(deltas):+.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
