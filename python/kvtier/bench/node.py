"""``kvtier bench manager --node``: a key's life in the manager (a scan
that misses, its store, and later its return: a scan that hits and its
load) through a node, against the in-process manager of the same run.

A command-line tool: runs in the ``kvtier`` process; the node is a
``kvtier node`` child process (its own interpreter, as in production), the
clients this process (one) or child processes (several at once). Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.harness import freeze_heap_as_engines_do, process_cpu_s
from kvtier.bench.manager import returning_cycles
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.host_native import make_host_tier

PAYLOAD = 64  # bytes per block: the node's pool holds data, the bench moves none
NS = "be" * 16
# Calls between a key's store and its return. vLLM loads only what a lookup
# found, in a later step than the store (a returning turn comes back
# seconds later); 64 calls of 16 keys is about 2 ms of the in-process
# manager, time for a node to have taken the store in.
RETURN_LAG = 64


def _keys(n: int, client: int) -> list[bytes]:
    return [client.to_bytes(4, "little") + i.to_bytes(28, "little") + bytes(4) for i in range(n)]


def start_node(path: str, name: str, flags: list[str]) -> subprocess.Popen[bytes]:
    """``kvtier node`` with ``flags`` in a child process, once it answers on
    ``path``: a fresh node, its region made anew (one an earlier node of
    ``name`` left would be adopted, and held from stores for its grace).
    Who calls: the node's and the SGLang backend's benchmarks,
    tests/gpu/test_cuda_node.py."""
    from kvtier.node.connection import NodeUnavailable, node_status

    for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
        f.unlink()
    cmd = [sys.executable, "-m", "kvtier.cli", "node", "--socket", path, "--name", name]
    p = subprocess.Popen(cmd + flags, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            node_status(path)
            return p
        except NodeUnavailable:
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                raise
            time.sleep(0.05)


def _client_rate(
    path: str,
    keys: list[bytes],
    batch: int,
    ready: Any = None,
    events: bool = False,
    finished: Any = None,
) -> tuple[float, int]:
    """One client's cycles a second and its returning keys missed.
    ``ready``: called once attached (HELLO answered, pool and index mapped),
    before the timed cycles: several clients start these together.
    ``events``: whether the engine takes KV events. ``finished``: called
    with the rate and misses after the timed cycles, still attached (it
    may block: the engine detaches once it returns)."""
    from kvtier.node.client import NodeManager

    order = {k: i for i, k in enumerate(keys)}

    def following(k: bytes, ctx: Any) -> list[bytes]:
        # The keys after ``k`` in its batch: what vLLM's ReqContext lists.
        i = order[k]
        return keys[i + 1 : (i // batch + 1) * batch]

    with NodeManager(
        path,
        NS,
        PAYLOAD,
        engine=f"bench-{os.getpid()}",
        key_order=following,
        timeout_s=120,
        events=events,
    ) as m:
        if ready is not None:
            m.status()  # attached: the timed cycles make no first connection
            ready()
        rate, missed = returning_cycles(m, keys, batch, RETURN_LAG, barrier=m.status)
        if finished is not None:
            finished(rate, missed)
        return rate, missed


def _echo_main(path: str) -> None:
    """A bare echo over a Unix socket: the floor of a round trip here."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    c, _ = srv.accept()
    while data := c.recv(1 << 16):
        c.sendall(data)


def round_trip_floor_us(n: int = 20_000) -> float:
    """Microseconds per round trip of a 64-byte message to an echo in
    another process: the baseline of the node's per-call cost."""
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "echo.sock")
        p = mp.get_context("spawn").Process(target=_echo_main, args=(path,))
        p.start()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 30
        while True:
            try:
                s.connect(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        msg = bytes(64)
        t0 = time.perf_counter()
        for _ in range(n):
            s.sendall(msg)
            s.recv(1 << 16)
        us = (time.perf_counter() - t0) / n * 1e6
        s.close()
        p.join(10)
    return us


def _client_main(
    path: str, keys: list[bytes], batch: int, start: Any, q: Any, events: bool, done: Any
) -> None:
    freeze_heap_as_engines_do()  # as this bench's own process did
    began = [0.0]

    def ready() -> None:
        q.put(None)
        start.wait()
        began[0] = process_cpu_s()

    def finished(rate: float, missed: int) -> None:
        q.put((rate, missed, process_cpu_s() - began[0]))  # the timed cycles' CPU
        # Held, attached, until every client has finished: a client that
        # detached (the node releasing its session) and exited (its
        # interpreter's teardown) beside the clients still cycling took
        # their CPU. Four clients, 100,000 keys, alternating, ten pairs:
        # 603,000 keys a second against 633,000 held (7 December 2026).
        done.wait()

    _client_rate(path, keys, batch, ready, events, finished)


def run_node_manager(
    num_keys: int = 200_000,
    policy: str = "lru",
    repeats: int = 3,
    clients: int = 4,
    shared_index: bool = False,
    events: bool = False,
) -> dict[str, Any]:
    """Cycles per second: in-process, one node client, ``clients`` node
    clients at once (aggregate); medians of ``repeats``, alternating.
    ``shared_index``: the node offers its shared index. ``events``: the
    engines take KV events and the in-process manager makes them (vLLM's
    default is neither: with several engines of one namespace each engine
    is told every engine's stores, so their cost grows as engines squared)."""
    capacity = max(1, num_keys // 2)
    # The node holds every client's keys between their store and return,
    # and each engine's reservation, or returning keys miss and the runs
    # compare unlike work (8,192 keys: 4,080 of them missed at 16 a call).
    node_blocks = max(capacity, node_blocks_needed(clients))
    flags = ["--shared-index"] if shared_index else []
    out: dict[str, Any] = {
        "component": "manager-node-shared" if shared_index else "manager-node",
        "policy": policy,
        "keys": num_keys,
        "host_blocks": capacity,
        "node_host_blocks": node_blocks,
        "clients": clients,
        "events": events,
    }
    name = f"bench{os.getpid()}"
    freeze_heap_as_engines_do()  # the node does the same once started
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "node.sock")
        try:
            for batch in (1, 16):
                local, one, many = [], [], []
                cpu: dict[str, list[float]] = {
                    k: [] for k in ("in_process", "client", "node", "clients_many", "node_many")
                }
                missed = 0
                for _ in range(repeats):
                    keys = _keys(num_keys, 0)
                    host = make_host_tier(None, capacity, policy=policy)
                    m = TieredOffloadingManager(host, events=events)
                    c0 = process_cpu_s()
                    rate, miss = returning_cycles(m, keys, batch, RETURN_LAG)
                    cpu["in_process"].append(process_cpu_s() - c0)
                    local.append(rate)
                    node = start_node(
                        path, name, ["--host-bytes", str(node_blocks * PAYLOAD), *flags]
                    )
                    try:
                        c0, n0 = process_cpu_s(), process_cpu_s(node.pid)
                        rate, m1 = _client_rate(path, keys, batch, None, events)
                        cpu["client"].append(process_cpu_s() - c0)
                        cpu["node"].append(process_cpu_s(node.pid) - n0)
                        one.append(rate)
                        rate, m4, used, node_used = _aggregate(
                            path, num_keys, batch, clients, events, node.pid
                        )
                        cpu["clients_many"].append(used)
                        cpu["node_many"].append(node_used)
                        many.append(rate)
                        missed += miss + m1 + m4
                    finally:
                        node.terminate()
                        node.wait()
                out[f"in_process_batch{batch}"] = round(statistics.median(local))
                out[f"node_1_client_batch{batch}"] = round(statistics.median(one))
                out[f"node_{clients}_clients_batch{batch}"] = round(statistics.median(many))
                out[f"returning_misses_batch{batch}"] = missed
                out.update(cpu_figures(cpu, num_keys, clients, batch))
                out[f"ratio_1_client_batch{batch}"] = round(
                    statistics.median(one) / statistics.median(local), 3
                )
                out[f"ratio_{clients}_clients_batch{batch}"] = round(
                    statistics.median(many) / statistics.median(local), 3
                )
        finally:
            for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
                f.unlink()
    out["round_trip_floor_us"] = round(
        statistics.median(round_trip_floor_us() for _ in range(repeats)), 1
    )
    out["note"] = (
        "cycles per second of a key's life: a scan that misses, prepare_store + "
        f"complete_store, {RETURN_LAG} calls later a scan that hits, prepare_load + "
        "complete_load; returning_misses: returning keys a scan missed (0: every load ran); "
        "ratios against the in-process manager of the same run; "
        f"{clients} clients: their aggregate, each cycling {num_keys // clients} keys of its own; "
        "round_trip_floor_us: a bare echo over a Unix socket between two processes; "
        "node_host_blocks: the node's blocks (host_blocks, the in-process manager's, or more "
        "where fewer would not hold every engine's keys in flight); "
        "events: whether the engines took KV events and the in-process manager made them; "
        "cpu_us_per_key: CPU time (user + system) a key of the in-process manager, of "
        "the one-client run's client and node processes (both poll briefly while they "
        f"wait: included), and of the {clients} clients' run's clients (their timed cycles, "
        "together) and node (from their start to the last one's end); "
        "node_capacity_ratio: the keys a second one core of the node would serve at its CPU "
        f"a key in the {clients} clients' run, against the in-process manager; cpu_ratio: "
        f"the {clients} clients' and the node's CPU a key together against the in-process "
        "manager's (on C cores the aggregate cannot pass C / cpu_ratio of it)"
    )
    return out


def node_blocks_needed(clients: int, batch: int = 16) -> int:
    """The node's blocks for ``clients`` engines at once, plus the one-engine
    run's, to return every key: twice each engine's keys in flight
    (RETURN_LAG + 2 calls of ``batch``: LRU keeps the keys returned and
    used since as recent as those in flight) and each engine's reservation."""
    from kvtier.node.state import RESERVE_MAX

    return clients * 2 * (RETURN_LAG + 2) * batch + (clients + 1) * RESERVE_MAX


def cpu_figures(
    cpu: dict[str, list[float]], num_keys: int, clients: int, batch: int
) -> dict[str, float]:
    """Each side's CPU a key (medians of ``cpu``'s seconds over ``num_keys``:
    ``in_process``, ``client``, ``node``, ``clients_many``, ``node_many``),
    and from the several clients' run: what one core of the node would serve
    at its CPU a key against the in-process manager
    (``node_capacity_ratio``), and the clients' and node's CPU a key together
    against the in-process manager's (``cpu_ratio``; on C cores the
    aggregate cannot pass C / cpu_ratio of it). A ratio whose divisor read
    no CPU (a short run under the clock's tick) is left out."""
    us = {who: statistics.median(s) / num_keys * 1e6 for who, s in cpu.items()}
    out: dict[str, float] = {}
    for who, v in us.items():
        out[f"cpu_us_per_key_{who.replace('many', f'{clients}_clients')}_batch{batch}"] = round(
            v, 2
        )
    local, node = us["in_process"], us["node_many"]
    if node > 0 and local > 0:
        # One core's keys a second (1e6 / node) over the in-process rate (1e6 / local).
        out[f"node_capacity_ratio_{clients}_clients_batch{batch}"] = round(local / node, 3)
    if local > 0:
        both = us["clients_many"] + node
        out[f"cpu_ratio_{clients}_clients_batch{batch}"] = round(both / local, 2)
    return out


def _gather(q: Any, procs: list[Any], n: int, timeout_s: float = 600.0) -> list[Any]:
    """``n`` items from the clients' queue ``q``. Raises RuntimeError as soon
    as a client of ``procs`` has died (its traceback is on stderr), not
    after ``timeout_s``: one that failed an assertion left the bench
    waiting ten minutes for its figure."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        try:
            got.append(q.get(timeout=0.2))
            continue
        except queue.Empty:
            pass
        # A client that exited well put its items before (its queue's feeder
        # is flushed at exit): only a failed one is missing them.
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            p = dead[0]
            raise RuntimeError(f"bench client {p.pid} failed (exit code {p.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench clients sent {len(got)} of {n} figures in {timeout_s:.0f} s")
    return got


def _aggregate(
    path: str,
    num_keys: int,
    batch: int,
    clients: int,
    events: bool = False,
    node_pid: int | None = None,
) -> tuple[float, int, float, float]:
    """``clients`` node clients at once, child processes started together
    once attached: their aggregate cycles a second, their returning keys
    missed, their CPU seconds over their timed cycles, and the node's (the
    process ``node_pid``; 0.0 without) from their start to the last one's
    end."""
    ctx = mp.get_context("spawn")
    start, done, q = ctx.Event(), ctx.Event(), ctx.Queue()
    per = num_keys // clients
    procs = [
        ctx.Process(
            target=_client_main, args=(path, _keys(per, c + 1), batch, start, q, events, done)
        )
        for c in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        # Every child imported, attached and its keys built before the start:
        # a second's sleep was not enough on two cores, so the clients' imports
        # and first connections were timed with their cycles.
        if any(r is not None for r in _gather(q, procs, len(procs))):
            raise RuntimeError("a bench client finished before the start")
        n0 = process_cpu_s(node_pid) if node_pid is not None else 0.0
        t0 = time.perf_counter()
        start.set()
        rates = _gather(q, procs, len(procs))
    except BaseException:
        for p in procs:
            p.kill()
        for p in procs:  # reaped here, not left to the bench's exit
            p.join(10)
        raise
    wall = time.perf_counter() - t0
    node_used = process_cpu_s(node_pid) - n0 if node_pid is not None else 0.0
    done.set()  # the clients detach and exit now, untimed
    for p in procs:
        p.join()
    # Each client's keys over the wall time of all: the node's throughput.
    return per * clients / wall, sum(r[1] for r in rates), sum(r[2] for r in rates), node_used
