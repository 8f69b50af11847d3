"""Hit rate against host capacity: LRU, ARC, PLFU and Belady's bound.

A command-line tool (its own process, one core, blocks for about five
minutes); run by hand from the repository root:

    nice -n 19 .venv/bin/python bench/policy_sweep.py [--out DIR]

Replays each workload through the host tier with no data (the same path as
``kvtier replay --no-data --host-blocks N --policy P``) and writes
``results.json``, ``hit_rate_vs_capacity.png`` and the tables in
``tables.md`` to ``--out`` (default ``build/bench-policy`` of the checkout;
``bench/results/policy/`` holds the run the README quotes). Deterministic:
the Mooncake trace as stored, the generated workloads with seed 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.interleaved import run_interleaved
from kvtier.manager import TieredOffloadingManager
from kvtier.policy.belady import BeladyPolicy
from kvtier.replay import WORKLOADS, Replayer, key_of, read_trace
from kvtier.tiers.host_native import make_host_tier

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "build" / "bench-policy"
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
POLICIES = ["lru", "arc", "plfu", "belady"]
CAPACITIES = [300, 1000, 3000, 10000, 30000, 100000]
GENERATED = 6000  # requests per generated workload, seed 0


def replay(
    trace: list[list[int]],
    policy: str,
    capacity: int,
    partial: str | None = None,
    in_flight: int = 0,
    prefix_aware: bool = True,
) -> dict[str, Any]:
    pol: Any = policy
    hook = None
    if policy == "belady":
        pol = BeladyPolicy(trace, key_of)
        hook = pol.advance
    opts = {} if partial is None else {"partial_stores": partial}
    m = TieredOffloadingManager(
        make_host_tier(None, capacity, policy=pol, prefix_aware=prefix_aware), **opts
    )
    t0 = time.perf_counter()
    r = Replayer(m, on_request=hook)
    res = run_interleaved(r, trace, in_flight) if in_flight else r.run(trace, progress=False)
    m.shutdown()
    return {
        "policy": policy,
        "capacity": capacity,
        "prefix_aware": prefix_aware,
        "in_flight": in_flight,
        **({"partial_stores": partial} if partial else {}),
        "hits": res.hits,
        "block_refs": res.block_refs,
        "hit_rate": res.hit_rate,
        "stores": m.stats.stores,
        "store_rejections": res.store_rejections,
        "stranded_end": res.stranded.get("host", 0),
        "stranded_mean": round(res.stranded_mean.get("host", 0.0), 1),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hit rate against host capacity per policy")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    ap.add_argument("--capacities", default=",".join(map(str, CAPACITIES)), help="host blocks")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--partial-stores",
        default="",
        help="comma list of the manager's partial_stores modes to compare (default: its own)",
    )
    ap.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="requests in flight, each storing 4 blocks a step (Replayer.run_interleaved); "
        "0: one request at a time",
    )
    ap.add_argument(
        "--prefix-eviction",
        choices=["on", "off", "both"],
        default="on",
        help="the host tier's prefix-aware eviction (both: each run twice)",
    )
    args = ap.parse_args(argv)
    dest: Path = args.out
    caps = [int(c) for c in args.capacities.split(",")]
    policies = args.policies.split(",")
    partials: list[str | None] = [p for p in args.partial_stores.split(",") if p] or [None]
    dest.mkdir(parents=True, exist_ok=True)
    workloads: dict[str, list[list[int]]] = {}
    if TRACE.is_file():
        workloads["mooncake-conversation"] = read_trace(TRACE)
    for name in ("chat", "rag", "agent"):
        workloads[f"{name} (seed 0)"] = WORKLOADS[name](GENERATED, 0)
    out: dict[str, Any] = {"capacities": caps, "policies": policies, "workloads": {}}
    for wname, trace in workloads.items():
        refs = sum(map(len, trace))
        distinct = len({h for r in trace for h in r})
        rows = []
        for cap in caps:
            for pol in policies:
                for part, aware in [
                    (p, a)
                    for p in partials
                    for a in {"on": [True], "off": [False], "both": [False, True]}[
                        args.prefix_eviction
                    ]
                ]:
                    r = replay(trace, pol, cap, part, args.in_flight, aware)
                    rows.append(r)
                    print(
                        f"{wname:24s} {pol:7s} {cap:7d} {part or '':7s} "
                        f"{'aware' if aware else 'plain':5s} "
                        f"{100 * r['hit_rate']:6.2f}% stores {r['stores']:8d} "
                        f"stranded {r['stranded_end']:6d} (mean {r['stranded_mean']:8.1f})",
                        flush=True,
                    )
        out["workloads"][wname] = {
            "requests": len(trace),
            "block_refs": refs,
            "distinct_blocks": distinct,
            "rows": rows,
        }
    (dest / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    write_tables(out, dest)
    plot(out, dest)
    return 0


def write_tables(out: dict[str, Any], dest: Path) -> None:
    lines = []
    for wname, w in out["workloads"].items():
        caps = out["capacities"]
        pols = out.get("policies", POLICIES)
        lines += [
            f"### {wname}: {w['requests']:,} requests, {w['block_refs']:,} block references, "
            f"{w['distinct_blocks']:,} distinct blocks",
            "",
            "| policy | " + " | ".join(f"{c:,}" for c in caps) + " |",
            "| --- |" + " ---: |" * len(caps),
        ]
        for pol in pols:
            rate = {r["capacity"]: r["hit_rate"] for r in w["rows"] if r["policy"] == pol}
            lines.append(f"| {pol} | " + " | ".join(f"{100 * rate[c]:.2f}" for c in caps) + " |")
        lines.append("")
    (dest / "tables.md").write_text("\n".join(lines))


def plot(out: dict[str, Any], dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), squeeze=False)
    style = {"lru": "C0o-", "arc": "C1s-", "plfu": "C3^-", "belady": "k--"}
    for ax, wname in zip(axes[0], names):
        rows = out["workloads"][wname]["rows"]
        for pol in out.get("policies", POLICIES):
            pts = sorted((r["capacity"], 100 * r["hit_rate"]) for r in rows if r["policy"] == pol)
            ax.plot([c for c, _ in pts], [h for _, h in pts], style[pol], label=pol, ms=4)
        ax.set_xscale("log")
        ax.set_xlabel("host capacity (blocks)")
        ax.set_title(wname, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("block hit rate (%)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(dest / "hit_rate_vs_capacity.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
