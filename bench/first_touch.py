"""A fresh process's first load out of a pool that other processes filled:
the copy with the mapping left to fault page by page, against the same
copy after :meth:`kvtier.pool.HostPool.populate` (what a CPU worker's
transfers do in the background when they attach, as CUDA's registration
does for a GPU worker). The default sizes are ``kvtier bench node``'s: a
428 MB pool of 128 KiB slots, a 4,000-token load of 125 slots.

Why: a restarted engine's workers map the node's pool afresh; its first
loads paid the faults that the run without the restart had paid long
before. Each sample is a new process (fork), alternating; medians.

A command-line tool; blocks for its runs (a few seconds). Who calls: a
developer, for the node guide's restart section:

    python bench/first_touch.py [--runs 6] [--slots 3266] [--load 125]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from kvtier.pool import HostPool

SLOT_BYTES = 128 << 10


def sample(pool: HostPool, populate: bool, load: int, seed: int) -> tuple[float, float, float]:
    """In a forked process: ms to populate (0 when not), to copy ``load``
    random slots out, and to copy them again."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            mine = HostPool.attach(pool.name)
            t = time.perf_counter()
            if populate:
                mine.populate()
            pop = time.perf_counter() - t
            dst = np.zeros((load, pool.slot_bytes), np.uint8)  # its own pages faulted here
            slots = np.random.default_rng(seed).choice(pool.num_slots, load, replace=False)
            src = mine.view(0, pool.num_slots)
            took = []
            for _ in range(2):
                t = time.perf_counter()
                for i, s in enumerate(slots):
                    dst[i] = src[s]
                took.append(time.perf_counter() - t)
            os.write(wr, f"{pop * 1e3} {took[0] * 1e3} {took[1] * 1e3}".encode())
        finally:
            os._exit(0)
    os.close(wr)
    out = os.read(rd, 200).decode()
    os.close(rd)
    os.waitpid(pid, 0)
    pop, first, again = map(float, out.split())
    return pop, first, again


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="processes of each kind")
    ap.add_argument("--slots", type=int, default=3266)
    ap.add_argument("--load", type=int, default=125, help="slots of one load")
    args = ap.parse_args()
    with HostPool(args.slots, SLOT_BYTES) as pool:
        pool.view(0, args.slots)[:] = 7  # filled by its creator, as a node's is
        runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for r in range(2 * args.runs):
            runs[bool(r % 2)].append(sample(pool, bool(r % 2), args.load, r))
    mib = args.load * SLOT_BYTES / (1 << 20)
    print(
        f"pool {args.slots * SLOT_BYTES / 1e6:.0f} MB, a load of {args.load} slots ({mib:.1f} MiB):"
    )
    for populate, rs in runs.items():
        first = [r[1] for r in rs]
        print(
            f"  {'populated' if populate else 'faulting '}: first load {statistics.median(first):.2f} ms "
            f"({min(first):.2f}-{max(first):.2f}), again {statistics.median(r[2] for r in rs):.2f} ms"
            + (f"; populate {statistics.median(r[0] for r in rs):.0f} ms" if populate else "")
        )


if __name__ == "__main__":
    main()
