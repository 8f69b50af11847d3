"""The node's data path on a real GPU (issue 59): two engine processes
attach to one ``kvtier node``, each maps the node's pool and registers it
with CUDA once, and copies straight between its own CUDA KV cache and the
node's slots (one copy, no CUDA IPC). Each loads what the other stored,
byte for byte: one engine after the other, then both at once. The node's
occupancy is exact afterwards and no lease is left. An engine SIGKILLed
with a store's copies in flight on its GPU loses its leases at once and
leaves nothing readable; started again, it loads what the other stored.

The engines are node_engine.py in child processes (a process loads one CUDA
runtime, and two are what the node is for); this process runs no CUDA.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu import cuda_case as case

case.skip_without_gpu()

from kvtier.bench.node import start_node  # noqa: E402
from kvtier.node.connection import node_status  # noqa: E402

HERE = Path(__file__).resolve().parent
SEEDS = {"a": 11, "b": 22}


class Engine:
    """node_engine.py in a child process: one command, one JSON answer."""

    def __init__(self, path: str, name: str, seed: int, device: str = "cuda") -> None:
        self.name, self.seed = name, seed
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "node_engine.py"), path, name, str(seed), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self.answer()

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"engine {self.name} exited ({self.p.poll()})"
        out: dict[str, Any] = json.loads(line)
        assert "error" not in out, f"engine {self.name}: {out['error']}\n{out.get('trace', '')}"
        return out

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[str]:
    path, name = str(tmp_path / "node.sock"), f"g{os.getpid()}-{random.randrange(1 << 30)}"
    p = start_node(path, name, ["--host-bytes", str(64 << 20)])
    yield path
    p.kill()
    p.wait()
    for f in Path("/dev/shm").glob(f"kvnode-{name}-*"):
        f.unlink()


def test_two_engines_copy_between_their_gpus_and_one_node_pool(node: str) -> None:
    a, b = Engine(node, "a", SEEDS["a"]), Engine(node, "b", SEEDS["b"])
    try:
        for e in (a, b):
            assert e.info["backend"] == "cuda", e.info
            assert e.info["slot_bytes"] >= e.info["payload"]
        # One after the other: A stores and B loads it, then the other way.
        a.send("store 1")
        assert a.answer() == {"stored": 40}
        b.send(f"load {a.seed} 1")
        assert b.answer() == {"loaded": 40}
        b.send("store 1")
        assert b.answer() == {"stored": 40}
        a.send(f"load {b.seed} 1")
        assert a.answer() == {"loaded": 40}
        # At once: both store, then each loads the other's, several rounds.
        for rnd in range(2, 6):
            a.send(f"store {rnd}")
            b.send(f"store {rnd}")
            assert (a.answer(), b.answer()) == ({"stored": 40}, {"stored": 40})
            a.send(f"load {b.seed} {rnd}")
            b.send(f"load {a.seed} {rnd}")
            assert (a.answer(), b.answer()) == ({"loaded": 40}, {"loaded": 40})
        st = node_status(node)
        (cls,) = st["classes"].values()
        assert cls["occupancy"]["blocks"] == 2 * 5 * 40
        assert cls["occupancy"]["pinned"] == 0
        for e in st["engines"]:
            assert e["leases"]["load_pins"] == e["leases"]["writes"] == 0, e
    finally:
        a.close()
        b.close()


def _engine_status(path: str, name: str) -> dict[str, Any] | None:
    return next((e for e in node_status(path)["engines"] if e["engine"] == name), None)


def test_an_engine_killed_with_copies_in_flight_leaves_nothing_readable(node: str) -> None:
    a, b = Engine(node, "a", SEEDS["a"]), Engine(node, "b", SEEDS["b"])
    try:
        a.send("store 1")
        assert a.answer() == {"stored": 40}
        b.send("hang 2")
        assert b.answer() == {"in_flight": 40}
        deadline = time.monotonic() + 10  # the node takes the store's start in its own time
        while (_engine_status(node, "b") or {}).get("leases", {}).get("writes") != 40:
            assert time.monotonic() < deadline, _engine_status(node, "b")
            time.sleep(0.01)
        b.p.kill()
        t0 = time.monotonic()
        b.p.wait()
        while _engine_status(node, "b") is not None:
            assert time.monotonic() - t0 < 1.0, "the killed engine's leases outlived 1 s"
            time.sleep(0.005)
        (cls,) = node_status(node)["classes"].values()
        occ = cls["occupancy"]
        assert (occ["blocks"], occ["pinned"], occ["writing"]) == (40, 0, 0), occ
        a.send(f"miss {SEEDS['b']} 2")  # half-written blocks never become readable
        assert a.answer() == {"missed": 40}
        b = Engine(node, "b", SEEDS["b"])  # started again: the node's blocks are there
        b.send(f"load {a.seed} 1")
        assert b.answer() == {"loaded": 40}
    finally:
        a.close()
        b.close()
