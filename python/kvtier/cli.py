"""``kvtier replay | bench | plan | doctor | events | node`` — the command-line front end.

A command-line tool: runs in its own process (the ``kvtier`` console script,
``python -m kvtier.cli``, ``bench/run.py``); the library never imports it.
Each subcommand blocks until it is done. Each imports what it needs lazily,
so ``kvtier --help`` and ``kvtier plan`` start without loading the native
core or torch. ``bench``'s options and runners: :mod:`kvtier.bench.commands`.

Who calls: a user's shell (``kvtier ...``) and ``make``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.options.surfaces import add_tier_arguments


def _cmd_replay(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from kvtier.options.surfaces import tier_options_from_args
    from kvtier.replay import ReplayOptions, main_replay
    from kvtier.tiers.factory import TierConfig

    host, disk, remote = tier_options_from_args(args)
    run = {f.name: getattr(args, f.name) for f in fields(ReplayOptions) if hasattr(args, f.name)}
    return main_replay(ReplayOptions(**run, host_tier=host, tiers=TierConfig(disk, remote)))


def _cmd_doctor(args: argparse.Namespace) -> int:
    from kvtier.doctor import main_doctor

    return main_doctor(args.dir, as_json=args.json, node=args.node)


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", help="Hugging Face config.json (instead of the shape flags)")
    p.add_argument("--layers", type=int, help="attention layers (instead of --model-config)")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (num_key_value_heads)")
    p.add_argument("--head-dim", type=int, help="head dimension")
    p.add_argument("--dtype", default=None, help="KV dtype (default bfloat16 or the config's)")
    p.add_argument("--mla-latent", type=int, default=0, help="MLA latent size per token")
    p.add_argument(
        "--context-tokens",
        type=int,
        default=0,
        help="sequence length for amortizing sliding-window layers",
    )
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block")
    p.add_argument("--partition", help="layers per stage, e.g. 48,16")
    p.add_argument("--stages", type=int, help="even split over this many stages (vLLM's rule)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--kv-memory", help="KV budget each device can give, e.g. 20GiB")
    g.add_argument("--total-kv-memory", help="one total KV budget split across the stages")
    p.add_argument("--host-memory", help="also size kvtier's host pool per rank from this total")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvtier import planner
    from kvtier.units import parse_size

    if args.model_config:
        model = planner.model_from_hf_config(args.model_config, args.context_tokens, args.dtype)
    else:
        if args.layers is None:
            raise InvalidArgument(
                "layers: give --layers (with --kv-heads/--head-dim) or --model-config"
            )
        model = planner.ModelKV(
            args.layers,
            args.kv_heads or 0,
            args.head_dim or 0,
            args.dtype or "bfloat16",
            args.mla_latent,
        )
    if args.partition:
        partition = planner.parse_partition(args.partition, model.layers)
    elif args.stages:
        partition = planner.even_partition(model.layers, args.stages)
    else:
        raise InvalidArgument("partition: give --partition 48,16 or --stages N")
    if args.kv_memory:
        plan = planner.plan_per_device(
            model, partition, args.block_tokens, parse_size(args.kv_memory)
        )
    else:
        plan = planner.plan_total(
            model, partition, args.block_tokens, parse_size(args.total_kv_memory)
        )
    js = plan.to_json()
    if args.host_memory:
        js["host_pool"] = planner.host_pool_per_rank(
            model, partition, args.block_tokens, parse_size(args.host_memory)
        )
    if args.json:
        print(json.dumps(js))
        return 0
    print(
        f"KV bytes/token/layer: {model.full_layer_bytes_per_token} "
        f"({'MLA' if model.mla_latent else 'K+V'}, {model.dtype}); block = {args.block_tokens} tokens"
    )
    hdr = f"  {'stage':>5} {'layers':>6} {'KV memory':>12} {'blocks':>10} {'max tokens':>12}"
    print("uniform allocation (what engines do):")
    print(hdr)
    for i, s in enumerate(plan.uniform["stages"]):
        print(
            f"  {i:>5} {s['layers']:>6} {_gib(s['kv_bytes']):>12} {s['blocks']:>10,} {s['max_tokens']:>12,}"
        )
    print(
        f"  usable: {plan.uniform['usable_blocks']:,} blocks = {plan.uniform['usable_tokens']:,} tokens; "
        f"dead memory {_gib(plan.uniform['wasted_bytes'])}"
    )
    print("proportional allocation (kvtier plan):")
    print(hdr)
    for i, s in enumerate(plan.stages):
        print(f"  {i:>5} {s.layers:>6} {_gib(s.kv_bytes):>12} {s.blocks:>10,} {s.max_tokens:>12,}")
    if plan.mode == "per-device":
        print(f"same capacity, {_gib(plan.saved_bytes)} less KV memory")
    else:
        print(f"capacity gain over an even split: {plan.capacity_gain:.3f}x")
    print("per-rank settings:")
    for s in plan.settings:
        print(
            f"  pp_rank {s['pp_rank']}: kv_cache_memory_bytes={s['kv_cache_memory_bytes']} "
            f"(num_gpu_blocks {s['num_gpu_blocks']})"
        )
    for h in js.get("host_pool", []):
        print(f"  pp_rank {h['pp_rank']}: host pool {h['num_slots']} x {h['slot_bytes']} B")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache offloading tools")
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay a request trace through the tiers")
    r.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace (default: synthetic)")
    r.add_argument("--block-bytes", default="65536", help="bytes per block (default 64KiB)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--host", help="host tier size, e.g. 2GiB (or 'inf' with --no-data)")
    g.add_argument("--host-blocks", type=int, help="host tier capacity in blocks")
    r.add_argument(
        "--cascade-on-hit",
        action="store_true",
        help="offer a block to the lower tiers again when it is reused in the host tier "
        "(with --lower-admit-after 2: written on its first reuse, not when stored)",
    )
    add_tier_arguments(r)
    r.add_argument("--no-data", action="store_true", help="policy only: no pool, no bytes")
    r.add_argument("--max-requests", type=int, help="stop after this many requests")
    r.add_argument(
        "--restart-after",
        type=int,
        metavar="N",
        help="after N requests, start again as a restarted engine would: an empty host "
        "tier, the disk tier reopened from its directory (its warm restart)",
    )
    r.add_argument(
        "--synthetic-requests",
        type=int,
        default=4000,
        help="requests of the synthetic trace, without TRACE",
    )
    r.add_argument(
        "--workload",
        default="chat",
        choices=["chat", "rag", "agent"],
        help="synthetic trace shape, without TRACE (default chat)",
    )
    r.add_argument("--seed", type=int, default=0, help="the synthetic trace's random seed")
    r.add_argument("--json", dest="json_path", help="write the summary JSON here")
    r.add_argument("--plot", help="write a PNG of hit rate over time per tier")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_cmd_replay)

    from kvtier.bench.commands import add_bench_parser

    add_bench_parser(sub)

    pl = sub.add_parser("plan", help="pipeline-parallel KV memory planner")
    _add_plan_arguments(pl)
    pl.set_defaults(func=_cmd_plan)

    d = sub.add_parser("doctor", help="check this machine: native core, io_uring, CUDA, limits")
    d.add_argument("--json", action="store_true", help="print the checks as JSON")
    d.add_argument("--dir", help="directory to test for io_uring and O_DIRECT (default: temp)")
    d.add_argument(
        "--node", help="a kvtier node's socket to look for (default: $KVTIER_NODE or the default)"
    )
    d.set_defaults(func=_cmd_doctor)

    from kvtier.events_cli import add_events_parser

    add_events_parser(sub)

    from kvtier.node.cli import add_node_parser

    add_node_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KvtierError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
