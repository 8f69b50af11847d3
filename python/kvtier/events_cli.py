"""``kvtier events URL``: what a shared Redis/Valkey pool holds and what
changes in it, as JSON lines, for operators and routers.

Tails the pool's event stream (:mod:`kvtier.tiers.remote.stream`): every block
an engine stored there (once the server acknowledged it) and every block
that left it. ``--format vllm`` prints vLLM's KV event shape (an
``EventBatch`` of ``BlockStored``/``BlockRemoved`` with ``block_hashes``,
``medium`` and ``group_idx``) rather than kvtier's. ``--snapshot`` first
lists what the pool holds now; ``--from-start`` or ``--from POSITION``
replays what the stream still holds. ``--watch`` also turns the server's own
removals (eviction, expiry, deletion) into removed entries of the stream
(:class:`kvtier.pool_watch.Watcher`).

A command-line tool: runs in its own process; blocks until interrupted, or
until ``--count`` entries were printed or nothing came for ``--idle-exit``
seconds. Who calls: a user's shell through :mod:`kvtier.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from kvtier.errors import InvalidArgument
from kvtier.options.surfaces import add_tls_arguments, tls_settings
from kvtier.tiers.remote.stream import STREAM_MAXLEN, PoolEvent

__all__ = ["add_events_parser", "vllm_batch"]

# Where vLLM's offloading events put kvtier's remote tier (the vLLM shim's
# medium and locality for it).
_MEDIUM, _LOCALITY = "CPU", "REMOTE"


def add_events_parser(sub: Any) -> None:
    """The ``events`` subcommand on ``sub`` (argparse subparsers)."""
    e = sub.add_parser("events", help="tail a shared Redis/Valkey pool's event stream")
    e.add_argument("url", help="the remote tier's URL (redis://, redis-cluster://, rediss://...)")
    e.add_argument(
        "--stream", help="the stream key, kvt-events:<ns> (default: the pool's only one)"
    )
    g = e.add_mutually_exclusive_group()
    g.add_argument("--from-start", action="store_true", help="replay what the stream holds")
    g.add_argument("--from", dest="position", help="the entries after this stream position")
    e.add_argument(
        "--snapshot",
        action="store_true",
        help="first list what the pool holds now (SCAN), then tail from there",
    )
    e.add_argument(
        "--format",
        choices=["json", "vllm"],
        default="json",
        help="json: one kvtier event a line; vllm: vLLM's KV event batches",
    )
    e.add_argument(
        "--watch",
        action="store_true",
        help="also append the server's own removals (eviction, expiry) to the stream",
    )
    e.add_argument(
        "--enable-notifications",
        action="store_true",
        help="with --watch: turn on keyspace notifications where they are off",
    )
    e.add_argument(
        "--reconcile-s",
        type=float,
        default=10.0,
        help="with --watch: check every block named stored this often (seconds)",
    )
    e.add_argument(
        "--maxlen",
        type=int,
        default=STREAM_MAXLEN,
        help="with --watch: the stream's bound in entries (as the tiers')",
    )
    e.add_argument(
        "--max-keys",
        type=int,
        default=262_144,
        help="blocks whose event ids are remembered to name removals",
    )
    e.add_argument("--count", type=int, help="exit after printing this many entries")
    e.add_argument("--idle-exit", type=float, help="exit when nothing came for this long (s)")
    add_tls_arguments(e)
    e.set_defaults(func=main_events)


def _hash_and_group(event_id: bytes) -> tuple[int, int]:
    return int.from_bytes(event_id[:8], "big"), int.from_bytes(event_id[8:], "big")


def json_line(ev: PoolEvent) -> dict[str, Any]:
    """kvtier's own shape of an entry: key digests and event ids in hex."""
    out: dict[str, Any] = {
        "position": ev.position,
        "op": ev.op,
        "engine": ev.engine,
        "tier": ev.tier,
        "ts_ms": ev.ts_ms,
    }
    if ev.reason:
        out["reason"] = ev.reason
    out["keys"] = [d.hex() for d in ev.digests]
    out["ids"] = [None if i is None else i.hex() for i in ev.ids]
    return out


def vllm_batch(ev: PoolEvent) -> dict[str, Any] | None:
    """An entry as vLLM's ``EventBatch`` (one event per group of its named
    blocks), or None when it names none."""
    by_group: dict[int, list[int]] = {}
    for i in ev.ids:
        if i is not None:
            h, grp = _hash_and_group(i)
            by_group.setdefault(grp, []).append(h)
    if not by_group:
        return None
    events = []
    for grp, hashes in by_group.items():
        common = {
            "block_hashes": hashes,
            "medium": _MEDIUM,
            "group_idx": grp,
            "locality": _LOCALITY,
            "ownership": ev.tier or "remote",
        }
        if ev.removed:
            events.append({"type": "BlockRemoved", **common})
        else:
            events.append(
                {
                    "type": "BlockStored",
                    **common,
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    "lora_id": None,
                    "lora_name": None,
                }
            )
    return {
        "ts": ev.ts_ms / 1000,
        "events": events,
        "data_parallel_rank": None,
        "position": ev.position,
        "engine": ev.engine,
    }


class _Printer:
    def __init__(self, fmt: str, out: TextIO, count: int | None) -> None:
        self.fmt, self.out, self.left = fmt, out, count

    def event(self, ev: PoolEvent) -> None:
        if not ev.op:
            return
        obj = json_line(ev) if self.fmt == "json" else vllm_batch(ev)
        if obj is not None:
            self.line(obj)
        if self.left is not None:
            self.left -= 1

    def line(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    @property
    def done(self) -> bool:
        return self.left is not None and self.left <= 0


def _snapshot(reader: Any, printer: _Printer, position: str) -> None:
    n = 0
    for chunk in reader.snapshot():
        n += len(chunk)
        ids = [i for _, i in chunk]
        ev = PoolEvent(
            position,
            "stored",
            "",
            "remote",
            int(time.time() * 1000),
            [d for d, _ in chunk],
            ids,
            "snapshot",
        )
        if printer.fmt == "json":
            printer.line({**json_line(ev), "op": "snapshot"})
        elif (b := vllm_batch(ev)) is not None:
            printer.line(b)
    printer.line({"op": "snapshot_end", "position": position, "blocks": n})


def main_events(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from kvtier.pool_watch import PoolReader, Watcher, connect, find_streams

    client = connect(args.url, tls_settings(args))
    stream = args.stream.encode() if args.stream else None
    if stream is None:
        found = find_streams(client)
        if len(found) != 1:
            names = ", ".join(s.decode() for s in found) or "none"
            raise InvalidArgument(
                f"the pool holds {len(found)} event streams ({names}): name one with --stream"
            )
        stream = found[0]
    reader = PoolReader(client, stream, args.max_keys)
    printer = _Printer(args.format, out, args.count)
    if args.from_start:
        position = reader.first_position()
    elif args.position:
        position = args.position
    else:
        position = reader.last_position()
    if args.snapshot:
        # Names for the snapshot's blocks from what the stream holds; unless
        # told where, the tail goes on from the position taken before the
        # scan, so nothing that changes during it is missed.
        last = reader.replay()
        if not (args.from_start or args.position):
            position = last
        _snapshot(reader, printer, position)
    watcher = None
    if args.watch:
        watcher = Watcher(
            client,
            stream,
            maxlen=args.maxlen,
            reconcile_s=args.reconcile_s,
            enable=args.enable_notifications,
            max_keys=args.max_keys,
        )
        if not watcher.notifying:
            print(
                f"kvtier events: keyspace notifications are off: removals found by a check "
                f"every {args.reconcile_s:g} s",
                file=sys.stderr,
            )
    idle_since = time.monotonic()
    try:
        while not printer.done:
            if watcher is not None:
                watcher.step()
            batch = reader.read(position, block_ms=200 if watcher else 1000)
            for ev in batch:
                position = ev.position
                printer.event(ev)
                if printer.done:
                    break
            now = time.monotonic()
            if batch:
                idle_since = now
            elif args.idle_exit is not None and now - idle_since >= args.idle_exit:
                break
    finally:
        if watcher is not None:
            watcher.close()
        client.close()
    return 0
