"""What the pool's event stream costs the remote tier's stores: store
throughput with the stream on (the default) against off (``pool_events=0``).

A command-line tool (its own process; blocks for a few minutes); run by hand
from the repository root, under the shared CPU lock where others build:

    flock /tmp/kvtier-cpu.lock .venv/bin/python bench/pool_events_cost.py \
        [--sizes 16KiB,256KiB,2MiB] [--total 256MiB] [--repeats 7] [--cluster]
    [--keys vllm|plain] [--out FILE]

For each block size: one local redis-server (or a 3-master cluster), two
remote tiers on it (``off`` and ``on``, the tier's defaults otherwise, each
its own namespace), driven the way ``kvtier bench remote`` drives kvtier
(:func:`kvtier.bench.harness.drive_tier`: 4 batches in flight, polled every
millisecond) over the same number of keys, in alternating order, every
key overwritten once untimed first. A run's time ends when its stores were
answered (the entries of all but the last ~10 ms of them were appended
meanwhile: the tier appends every ``STREAM_DELAY_S``; the rest is drained
untimed before the next run, so that no run pays for another's). Prints and writes (``--out``,
JSON) each run's GB/s, the medians and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.harness import drive_tier
from kvtier.bench.redis_server import RedisCluster, RedisServer
from kvtier.pool import HostPool
from kvtier.tiers.remote import RemoteTier
from kvtier.units import parse_size


def settle(t: RemoteTier) -> None:
    while t.has_pending_work():
        t.poll()
        time.sleep(0.001)


def one_size(url: str, block: int, total: int, repeats: int, vllm: bool) -> dict[str, Any]:
    n = max(64, total // block)
    slots = min(n, max(16, (256 << 20) // block))
    batch = max(1, min(256, (16 << 20) // block))
    # vLLM's keys (a 32-byte block hash, then the group) are named by a
    # slice; any other key by a blake2b of it (vllm_event_id).
    keys = [(i + 1).to_bytes(32, "big") + bytes(4) if vllm else b"cost-%d" % i for i in range(n)]
    pool = HostPool(slots, block)
    pool.view(0, slots)[:] = 7
    tiers = {
        "off": RemoteTier(url, block, namespace="cost-off", pool_events=0),
        "on": RemoteTier(url, block, namespace="cost-on"),
    }
    gbps: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for t in tiers.values():
            t.attach(pool)
            drive_tier(t, True, keys, batch, poll_s=0.001)  # untimed: later runs overwrite
            settle(t)
        for r in range(repeats):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for name in order:
                t = tiers[name]
                secs = drive_tier(t, True, keys, batch, poll_s=0.001)
                settle(t)  # untimed: the last entries wait STREAM_DELAY_S (latency)
                gbps[name].append(round(n * block / secs / 1e9, 3))
        stats = {name: t.stats() for name, t in tiers.items()}
    finally:
        for t in tiers.values():
            t.close()
        pool.close()
    ratios = [on / off for on, off in zip(gbps["on"], gbps["off"])]
    return {
        "block_bytes": block,
        "keys_shape": "vllm" if vllm else "plain",
        "keys": n,
        "batch": batch,
        "gbps": gbps,
        "median_gbps": {k: statistics.median(v) for k, v in gbps.items()},
        "median_ratio_on_off": round(statistics.median(ratios), 3),
        "stream_entries_appended": stats["on"]["pool_events"],
        "stream_failures": stats["on"]["pool_event_failures"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16KiB,256KiB,2MiB")
    p.add_argument("--total", default="256MiB", help="bytes stored per run")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cluster", action="store_true", help="a local 3-master cluster")
    p.add_argument("--keys", choices=["vllm", "plain"], default="vllm",
                   help="vLLM's key shape (what an engine stores) or short plain keys")  # fmt: skip
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-cost-"))
    server: Any = RedisCluster(work) if args.cluster else RedisServer(work)
    results = []
    try:
        for size in args.sizes.split(","):
            r = one_size(server.url, parse_size(size), parse_size(args.total), args.repeats,
                         args.keys == "vllm")  # fmt: skip
            r["mode"] = "cluster" if args.cluster else "standalone"
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
