"""The manager's cycle (``kvtier bench manager``'s: a scan that misses and
its store, later a scan that hits and its load, 16 keys a call) timed call
by call: the in-process manager against an engine attached to a node with
the shared index, alternating, a fresh node a run. Prints each kind of
call's wall time over the keys (the lookups split into hits and misses, the
step ends into the quiet ones and those that send a frame), median and
range of the runs.

Why: the bench's rates say how far the node's engine is behind the
in-process manager, not where; perf and callgrind split the time by
function, not by the interface's calls. The timing wraps every call the
same way on both sides (about 0.1 µs a call).

A command-line tool; blocks for its runs (about 20 s each). Who calls: a
developer, for the node guide's cost section:

    python bench/manager_split.py [--keys 100000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_CALLS = (
    "on_new_request",
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "on_request_finished",
    "on_schedule_end",
)


class Timed:
    """``m`` with each call of the cycle timed into ``ns`` by name: lookups
    as ``lookup hit`` / ``lookup miss``; ``sent()`` (frames sent so far)
    splits the step ends into ``on_schedule_end quiet`` / ``... sending``."""

    def __init__(self, m: Any, sent: Any = None) -> None:
        self.m, self.sent = m, sent
        self.ns: dict[str, int] = defaultdict(int)
        for name in _CALLS:
            setattr(self, name, self._timed(name, getattr(m, name)))

    def _timed(self, name: str, call: Any) -> Any:
        ns, clock, sent = self.ns, time.perf_counter_ns, self.sent

        def timed(*args: Any) -> Any:
            before = sent() if sent is not None and name == "on_schedule_end" else None
            t = clock()
            out = call(*args)
            key = name
            if before is not None:
                key += " sending" if sent() != before else " quiet"
            ns[key] += clock() - t
            return out

        return timed

    def lookup(self, key: bytes, req: Any) -> Any:
        t = time.perf_counter_ns()
        r = self.m.lookup(key, req)
        self.ns["lookup " + r.name.lower()] += time.perf_counter_ns() - t
        return r


def _local(n: int) -> dict[str, int]:
    from kvtier.bench.manager import returning_cycles
    from kvtier.bench.node import RETURN_LAG, _keys, node_blocks_needed
    from kvtier.scheduler.manager import TieredOffloadingManager
    from kvtier.tiers.host_native import make_host_tier

    host = make_host_tier(None, max(n // 2, node_blocks_needed(4)), policy="lru")
    t = Timed(TieredOffloadingManager(host, events=False))
    returning_cycles(t, _keys(n, 0), 16, RETURN_LAG)
    return t.ns


def _node(n: int) -> dict[str, int]:
    from kvtier.bench import node as bn
    from kvtier.bench.manager import returning_cycles
    from kvtier.node.client import NodeManager

    keys = bn._keys(n, 0)
    order = {k: i for i, k in enumerate(keys)}

    def following(k: bytes, ctx: Any) -> list[bytes]:
        i = order[k]
        return keys[i + 1 : (i // 16 + 1) * 16]

    name = f"split{os.getpid()}"
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "node.sock")
        blocks = max(n // 2, bn.node_blocks_needed(4))
        node = bn.start_node(
            path, name, ["--host-bytes", str(blocks * bn.PAYLOAD), "--shared-index"]
        )
        try:
            with NodeManager(path, bn.NS, bn.PAYLOAD, key_order=following, events=False) as m:
                m.status()
                client = m._client
                frames = [0]
                post = client.post_call

                def counted(op: Any, *args: Any) -> None:
                    frames[0] += 1
                    post(op, *args)

                client.post_call = counted  # type: ignore[method-assign]
                t = Timed(m, lambda: frames[0])
                returning_cycles(t, keys, 16, bn.RETURN_LAG, barrier=m.status)
                return t.ns
        finally:
            node.terminate()
            node.wait()


def main() -> None:
    from kvtier.bench.harness import freeze_heap_as_engines_do

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    freeze_heap_as_engines_do()
    runs: dict[str, list[dict[str, int]]] = {"in-process": [], "node": []}
    for _ in range(args.runs):
        runs["in-process"].append(_local(args.keys))
        runs["node"].append(_node(args.keys))
    names = sorted({k for rs in runs.values() for r in rs for k in r})
    print(f"µs a key, median (min-max) of {args.runs} runs, {args.keys} keys, 16 a call")
    print(f"{'call':<28}{'in-process':>22}{'node':>22}")
    for name in [*names, "all"]:
        cells = []
        for rs in runs.values():
            us = [
                (r.get(name, 0) if name != "all" else sum(r.values())) / args.keys / 1e3 for r in rs
            ]
            cells.append(f"{statistics.median(us):.3f} ({min(us):.2f}-{max(us):.2f})")
        print(f"{name:<28}{cells[0]:>22}{cells[1]:>22}")


if __name__ == "__main__":
    main()
