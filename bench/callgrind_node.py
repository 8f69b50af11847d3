"""Instructions per key of ``kvtier bench manager --node --shared-index``'s
cycle (a key's life as vLLM makes it: a scan that misses and its store, 64
calls later a scan that hits and its load), counted by callgrind on each
side: the in-process manager, an engine's client against a node, and the
node serving it. Each figure is a run over 2N keys minus a run over N, over
N, as ``callgrind_manager.py`` does. Steadier than this machine's
timings, which swing by half between runs: the in-process count to 0.01%,
the node's to about 1%, the engine's to about 4% (how many step ends it
sends depends on when the node's replies come); neither side polls (``--spin-us 0``,
the client's ``spin_s=0``), so no waiting is counted. Kernel time (socket
calls, wake-ups) is not in it: ``kvtier bench manager --node`` reports CPU
time a key beside.

A command-line tool (needs valgrind); blocks for its runs (a few minutes).
Who calls: a developer, for the node guide's cost section:

    python bench/callgrind_node.py [--keys 10000]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from callgrind_manager import STEADY_ENV, collected, count

# The bench's own code, so that its loop and keys cost each side the same;
# the keys frozen out of the collector's reach (an engine's long-lived state,
# not the manager's work: else full collections walking them make the 2N run
# cost more than twice the N run, by thousands of instructions a key).
_IN_PROCESS = """
import sys
from kvtier.bench import node as bn
from kvtier.bench.manager import returning_cycles
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.host_native import make_host_tier
from kvtier.bench.harness import freeze_heap_as_engines_do
n = int(sys.argv[1])
keys = bn._keys(n, 0)
freeze_heap_as_engines_do()
m = TieredOffloadingManager(make_host_tier(None, n // 2, policy="lru"))
returning_cycles(m, keys, 16, bn.RETURN_LAG)
"""
_CLIENT = """
import sys
from kvtier.bench import node as bn
from kvtier.bench.manager import returning_cycles
from kvtier.node.client import NodeManager
path, n, who = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from kvtier.bench.harness import freeze_heap_as_engines_do
keys = bn._keys(n, who)
order = {k: i for i, k in enumerate(keys)}
freeze_heap_as_engines_do()
def following(k, ctx):
    i = order[k]
    return keys[i + 1 : (i // 16 + 1) * 16]
with NodeManager(path, bn.NS, bn.PAYLOAD, engine="callgrind", key_order=following,
                 timeout_s=600, spin_s=0) as m:
    returning_cycles(m, keys, 16, bn.RETURN_LAG, barrier=m.status)
"""


def _node_run(n: int, client: bool) -> tuple[int, int]:
    """(the node's instructions, the client's) for a node serving one
    client's N keys: the node under callgrind, and the client too when
    ``client`` (else a plain client process drives it)."""
    from kvtier.bench.node import PAYLOAD
    from kvtier.node.connection import NodeUnavailable, node_status

    name = f"callgrind{os.getpid()}n{n}c{int(client)}"
    with tempfile.TemporaryDirectory() as d:
        path, log = str(Path(d) / "node.sock"), Path(d) / "node.log"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/node.out"]
        cmd += [sys.executable, "-m", "kvtier.cli", "node", "--socket", path, "--name", name]
        cmd += ["--host-bytes", str(n * PAYLOAD), "--shared-index", "--spin-us", "0"]
        try:
            with log.open("w") as err:
                node = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=STEADY_ENV)
                deadline = time.monotonic() + 300
                while True:
                    try:
                        node_status(path, timeout_s=60)
                        break
                    except NodeUnavailable:
                        if time.monotonic() > deadline or node.poll() is not None:
                            node.kill()
                            raise
                        time.sleep(0.2)
                if client:
                    ours = count(_CLIENT, path, str(n), "1")
                else:
                    cmd = [sys.executable, "-c", _CLIENT, path, str(n), "1"]
                    subprocess.run(cmd, check=True, env=STEADY_ENV)
                    ours = 0
                node.send_signal(signal.SIGTERM)  # a clean exit: callgrind writes its counts
                node.wait(600)
            return collected(log.read_text()), ours
        finally:
            for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
                f.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=10_000, help="N: runs over N and 2N keys")
    n = ap.parse_args().keys
    local = (count(_IN_PROCESS, str(2 * n)) - count(_IN_PROCESS, str(n))) / n
    node1, _ = _node_run(n, client=False)
    node2, _ = _node_run(2 * n, client=False)
    _, client1 = _node_run(n, client=True)
    _, client2 = _node_run(2 * n, client=True)
    client, node = (client2 - client1) / n, (node2 - node1) / n
    print("| 16 keys a call | instructions per key | against in-process |")
    print("| --- | ---: | ---: |")
    print(f"| in-process manager | {local:,.0f} | 1.00x |")
    print(f"| engine's client (node mode, shared index) | {client:,.0f} | {client / local:.2f}x |")
    print(f"| node, serving it | {node:,.0f} | {node / local:.2f}x |")


if __name__ == "__main__":
    main()
