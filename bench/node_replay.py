"""The node's own time a key, without sockets or the VM's scheduling: one
engine's cycle (``kvtier bench manager --node --shared-index``'s, 16 keys a
call) is run against a live node while every byte the engine sends is
recorded; the recording is then replayed into a node in this process, its
frames handed straight to the request dispatch, and timed. Medians of
several replays; per op (STORE_BEGIN, COMPLETE_STORE, STEP_END) beside.

Why: on this kind of VM the live bench's rates swing by a tenth or more
from run to run, so a change worth a few percent of the node's work does
not show there; callgrind counts instructions but not a native call's
memory stalls. A replay of the same frames times only the node's request
handling (nine replays agree within about 3%). The replays run without the
engine's pins in the shared index, so an eviction may choose another
block than the live run did; a frame the replayed node refuses is counted
and printed (none so far).

A command-line tool; blocks for its runs (about a minute). Who calls: a
developer, for the node guide's cost section:

    python bench/node_replay.py [--keys 50000] [--replays 9]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def record(n: int) -> list[bytes]:
    """What one engine sends a live node over ``n`` keys (16 a call)."""
    from kvtier.bench import node as bn
    from kvtier.bench.harness import freeze_heap_as_engines_do

    freeze_heap_as_engines_do()
    sent: list[bytes] = []
    plain = socket.socket.sendall

    def sendall(self: socket.socket, data: Any, *args: Any) -> None:
        if self.family == socket.AF_UNIX:
            sent.append(bytes(data))
        plain(self, data, *args)

    name = f"replay{os.getpid()}"
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "node.sock")
        flags = ["--host-bytes", str(n // 2 * bn.PAYLOAD), "--shared-index", "--spin-us", "0"]
        node = bn.start_node(path, name, flags)
        socket.socket.sendall = sendall  # type: ignore[method-assign]
        try:
            bn._client_rate(path, bn._keys(n, 0), 16)
        finally:
            socket.socket.sendall = plain  # type: ignore[method-assign]
            node.terminate()
            node.wait()
            for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
                f.unlink()
    return sent


def replay(n: int, sent: list[bytes], i: int) -> tuple[float, dict[str, float], int]:
    """Microseconds a key the node takes over ``sent``, the same by op, and
    how many requests it refused."""
    from kvtier.bench.node import PAYLOAD
    from kvtier.node import protocol as P
    from kvtier.node.server import NodeConfig, NodeServer, _Conn
    from kvtier.options.tiers import HostOptions

    name = f"replay{os.getpid()}r{i}"
    with tempfile.TemporaryDirectory() as d:
        cfg = NodeConfig(
            host=HostOptions(bytes=n // 2 * PAYLOAD),
            socket_path=str(Path(d) / "node.sock"),
            name=name,
            shared_index=True,
            spin_us=0,
        )
        srv = NodeServer(cfg)
        ours, theirs = socket.socketpair()
        conn = _Conn(ours, os.getpid(), os.getuid(), os.getgid())
        reader = P.FrameReader()
        frames = [body for chunk in sent for body in reader.feed(chunk)]
        by_op: dict[int, float] = {}
        refused = 0
        clock = time.perf_counter
        try:
            t0 = clock()
            for body in frames:
                t = clock()
                msg = P.unpack(body)
                reply = srv._dispatch(conn, msg)
                if reply is not None:
                    refused += reply[0] is not True
                    srv._pack(reply)
                by_op[msg[0]] = by_op.get(msg[0], 0.0) + clock() - t
            total = clock() - t0
        finally:
            srv._close_all()
            ours.close()
            theirs.close()
            for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
                f.unlink()
    ops = {P.Op(op).name: s / n * 1e6 for op, s in by_op.items() if s / n * 1e6 >= 0.01}
    return total / n * 1e6, ops, refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--replays", type=int, default=9)
    args = ap.parse_args()
    sent = record(args.keys)
    runs = [replay(args.keys, sent, i) for i in range(args.replays + 1)][1:]  # the first warms
    us = [r[0] for r in runs]
    print(
        f"node, replayed: {statistics.median(us):.3f} us a key (median of {len(us)}; "
        f"{min(us):.3f}-{max(us):.3f}); refused requests: {sum(r[2] for r in runs)}"
    )
    for op in runs[0][1]:
        print(f"  {op}: {statistics.median(r[1].get(op, 0.0) for r in runs):.3f} us a key")


if __name__ == "__main__":
    main()
