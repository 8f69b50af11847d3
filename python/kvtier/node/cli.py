"""``kvtier node [serve] | status``: run the node, or ask a running one.

A command-line tool: runs in its own process (the ``kvtier`` console
script); the library never imports it. Who calls: a user's shell, systemd,
a DaemonSet's container. ``serve`` blocks until SIGTERM or
SIGINT; ``status`` blocks for one round trip.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
from typing import Any

from kvtier.options.surfaces import add_tier_arguments


def add_node_parser(sub: Any) -> None:
    """Add ``kvtier node`` to the top-level subparsers ``sub``."""
    from kvtier.node.server import DEFAULT_SOCKET

    n = sub.add_parser(
        "node",
        help="one kvtier per machine: serve every engine on it (or ask a running node)",
        description="Run the node cache that every engine on this machine shares "
        "(action serve, the default), or print a running node's status.",
    )
    n.add_argument(
        "action",
        nargs="?",
        choices=["serve", "status"],
        default="serve",
        help="serve: run the node (the default); status: print a running node's status "
        "(--socket names it, --json for JSON)",
    )
    n.add_argument("--host-bytes", help="host memory for every engine's blocks, e.g. 64GiB")
    n.add_argument(
        "--socket", default=DEFAULT_SOCKET, help=f"Unix socket (default {DEFAULT_SOCKET})"
    )
    n.add_argument("--socket-group", help="group owning the socket and pools (0660)")
    n.add_argument(
        "--allow-uid", type=int, action="append", default=[], help="a uid that may attach (repeat)"
    )
    n.add_argument(
        "--allow-gid", type=int, action="append", default=[], help="a gid that may attach (repeat)"
    )
    n.add_argument(
        "--max-classes",
        type=int,
        default=1,
        help="block sizes served at once (sharing --host-bytes by use); default 1",
    )
    n.add_argument(
        "--chunk-bytes",
        default="64MiB",
        help="the unit in which block sizes share --host-bytes (default 64MiB; less for a "
        "region of under 16 chunks); a block may not be larger",
    )
    n.add_argument("--name", default="node", help="names this node's pools (default node)")
    n.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    n.add_argument(
        "--spin-us",
        type=int,
        default=200,
        help="after a request, poll this long for the next before sleeping (default 200; "
        "0: sleep at once): a woken CPU is most of a round trip's time",
    )
    n.add_argument(
        "--adopt-grace-s",
        type=float,
        default=5.0,
        help="a node that adopts the region an earlier node left stores nothing in it "
        "for this long (default 5): copies begun before may still land",
    )
    n.add_argument(
        "--shared-index",
        action="store_true",
        help="engines look up, load and store host blocks in shared memory, without a "
        "round trip (off by default; docs/concepts/node-shared-index.md)",
    )
    n.add_argument("--json", action="store_true", help="status: print JSON")
    add_tier_arguments(n)
    n.set_defaults(func=_cmd_node)


def _cmd_node(args: argparse.Namespace) -> int:
    if args.action == "status":
        return _status(args)
    import dataclasses

    from kvtier.errors import InvalidArgument
    from kvtier.node.server import NodeConfig, NodeServer
    from kvtier.options.surfaces import tier_options_from_args
    from kvtier.units import parse_size

    if not args.host_bytes:
        raise InvalidArgument("kvtier node needs --host-bytes (e.g. 64GiB)")
    if args.spin_us < 0:
        raise InvalidArgument(f"--spin-us must be >= 0, got {args.spin_us}")
    if not args.adopt_grace_s >= 0:  # (NaN too)
        raise InvalidArgument(f"--adopt-grace-s must be >= 0, got {args.adopt_grace_s}")
    host, disk, remote = tier_options_from_args(args)
    host = dataclasses.replace(host, bytes=parse_size(args.host_bytes))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = NodeServer(
        NodeConfig(
            host=host,
            disk=disk,
            remote=remote,
            socket_path=args.socket,
            socket_group=args.socket_group,
            allow_uids=args.allow_uid,
            allow_gids=args.allow_gid,
            max_classes=args.max_classes,
            chunk_bytes=parse_size(args.chunk_bytes),
            name=args.name,
            metrics_port=args.metrics_port,
            spin_us=args.spin_us,
            adopt_grace_s=args.adopt_grace_s,
            shared_index=args.shared_index,
        )
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    logging.getLogger("kvtier.node").info("kvtier node: serving %s", args.socket)
    # Out of the collector's reach from now on, as vLLM's engine core does
    # once started: the node's full collections walk the index it grows,
    # not the modules it imported (see kvtier.bench.harness).
    gc.collect()
    gc.freeze()
    server.serve_forever()
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvtier.node.connection import node_status

    st = node_status(args.socket)
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def _pairs(d: dict[str, Any]) -> str:
    """``{"a": 1, "b": {"c": 2}}`` -> ``"a=1 b.c=2"``: counters on one line."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += [f"{k}.{kk}={vv}" for kk, vv in v.items()]
        else:
            out.append(f"{k}={v}")
    return " ".join(out) or "none"


def format_status(st: dict[str, Any]) -> str:
    """``kvtier node status``'s text: the node, its region, each engine, each
    block size's occupancy, counters and lower tiers, then the node's
    counters. ``st``: what the node's STATUS answers (``--json`` prints it
    as it is). Who calls: :func:`_status`. Pure."""
    from kvtier.units import format_size

    lines = [
        f"node {st['node']} at {st['socket']}, up {st['uptime_s']} s, "
        f"host {format_size(st['host_bytes'])}"
    ]
    r = st.get("region")
    if r:
        lines.append(
            f"region {r['pool']}: {r['chunks']} chunks of {format_size(r['chunk_bytes'])}, "
            f"{r['free_chunks']} free, {r['reassigned']} moved between block sizes"
        )
    lines.append(f"engines attached: {len(st['engines'])}")
    ns = st.get("namespaces") or {}
    if ns:
        lines.append(
            "namespaces: "
            + ", ".join(f"{k[:12]} ({n} engine{'s' * (n != 1)})" for k, n in sorted(ns.items()))
        )
    lines += [
        f"  {e['engine']}: pid {e['pid']}, uid {e['uid']}, namespace {e['namespace'][:12]}, "
        f"blocks of {format_size(e['class'])}, {e['calls']} calls, leases {_pairs(e['leases'])}"
        for e in st["engines"]
    ]
    for b, c in st["classes"].items():
        o = c["occupancy"]
        cap = o["capacity"]
        share = f" ({100 * o['blocks'] / cap:.1f}%)" if cap else ""
        lines.append(
            f"blocks of {format_size(int(b))}: {o['blocks']} of at most {cap}{share} "
            f"in {o.get('chunks', '?')} chunks; pinned {o['pinned']}, writing {o['writing']}, "
            f"held {o['held']} ({c.get('quarantined', 0)} of engines that died)"
        )
        lines.append(f"  {_pairs(c['stats'])}")
        lines += [f"  {name}: {_pairs(t)}" for name, t in c.get("tiers", {}).items()]
    lines.append(
        f"counters: {_pairs(st['counters'])}; "
        f"engines' worker processes known: {st.get('writers', 0)}"
    )
    return "\n".join(lines)
