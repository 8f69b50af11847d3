"""kvtier's tiers in vLLM's own KV events (issue 35 item 2), in a running
engine: vLLM's CPU build publishes its KV events over ZMQ
(``kv_events_config``) while kvtier offloads to a host tier and a disk tier,
both small enough to evict; a subscriber here decodes every batch (msgpack,
vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank]``, each event a
map tagged by ``type``) and checks what a router would conclude from them.

One engine start (a minute on 2 cores); runs only with
``KVTIER_ENGINE_PYTHON`` (see test_vllm_engine.py)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgspec.msgpack")
import test_vllm_engine as engines  # noqa: E402

# The engine tests' fixtures: the engine venv's Python, the model it made.
engine_python, model = engines.engine_python, engines.model

pytestmark = pytest.mark.timeout(900)

HOST_SLOTS = 12  # fewer than a prefix (20-24 blocks): the host tier evicts
DISK_RECORDS = 40  # fewer than the 56 blocks of the working set: so does the disk tier
RECORD = engines.SLOT + 4096  # a host slot holds a disk record (block and trailer)

# (medium, locality, ownership) of each of kvtier's tiers in vLLM's events.
HOST = ("CPU", None, None)
DISK = ("STORAGE", "LOCAL", "disk")


class Subscriber:
    """A ZMQ SUB socket bound on 127.0.0.1 (vLLM's publisher connects to
    it), receiving ``(topic, seq, payload)`` frames on a thread until
    :meth:`stop`."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frames: list[tuple[int, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            _topic, seq, payload = self.sock.recv_multipart()
            self.frames.append((int.from_bytes(seq, "big"), msgpack.decode(payload)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def tier_of(ev: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (ev.get("medium"), ev.get("locality"), ev.get("ownership"))


def test_kvtier_tiers_in_vllms_kv_events(engine_python: str, model: str, tmp_path: Path) -> None:
    sub = Subscriber()
    try:
        kv = {"kvtier_host_bytes": HOST_SLOTS * RECORD, "kvtier_disk_path": str(tmp_path / "disk"),
              "kvtier_disk_bytes": DISK_RECORDS * RECORD}  # fmt: skip
        spec = {
            **engines._kvtier_spec(model, **kv),
            "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": sub.endpoint},
        }  # fmt: skip
        e = engines.run_engine(
            engine_python, tmp_path, spec, env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}
        )
    finally:
        sub.stop()
    (tmp_path / "events.json").write_text(json.dumps(sub.frames))  # for a failure's reader
    # Returning prefixes were loaded (not all of them: the disk tier is
    # smaller than the working set).
    assert sum(r["cached_tokens"] for r in e.requests) > 0
    engines._assert_clean(e)

    # Every batch arrived, in order (the publisher numbers them from 0).
    seqs = [s for s, _ in sub.frames]
    assert seqs == list(range(len(seqs))) and seqs, seqs[:10]
    events = [ev for _, batch in sub.frames for ev in batch[1]]
    kinds = Counter((ev["type"], tier_of(ev)) for ev in events)
    gpu = ("GPU", None, None)
    assert set(kinds) <= {
        ("BlockStored", gpu), ("BlockRemoved", gpu), ("AllBlocksCleared", (None, None, None)),
        ("BlockStored", HOST), ("BlockRemoved", HOST),
        ("BlockStored", DISK), ("BlockRemoved", DISK),
    }, kinds  # fmt: skip

    # Replay what a router would: per tier, what it holds. A block is never
    # announced twice in a tier without a removal between, nor removed before
    # it was stored; kvtier's blocks carry the very hashes (vLLM's int block
    # hashes) of vLLM's own GPU-tier stores of the same prefix, announced
    # there first.
    on_gpu: set[int] = set()
    held: dict[tuple[Any, Any, Any], set[int]] = {HOST: set(), DISK: set()}
    stored: dict[tuple[Any, Any, Any], set[int]] = {HOST: set(), DISK: set()}
    removed: Counter[tuple[Any, Any, Any]] = Counter()
    for ev in events:
        where = tier_of(ev)
        if where == gpu:
            if ev["type"] == "BlockStored":
                on_gpu.update(ev["block_hashes"])
            continue
        if ev["type"] == "AllBlocksCleared":
            continue
        assert ev.get("group_idx", 0) == 0, ev
        for h in ev["block_hashes"]:
            assert isinstance(h, int) and 0 <= h < 1 << 64, ev
            if ev["type"] == "BlockStored":
                assert h in on_gpu, f"{where} stored a block vLLM never computed: {h}"
                assert h not in held[where], f"{where} stored {h} twice"
                held[where].add(h)
                stored[where].add(h)
            else:
                assert h in held[where], f"{where} removed {h}, which it never stored"
                held[where].discard(h)
                removed[where] += 1

    # Every block vLLM computed (the prompts' whole blocks) reached kvtier.
    blocks = {len(r["prompt"]) // engines.BLOCK for r in spec["requests"]}
    assert len(on_gpu) >= max(blocks)
    assert stored[HOST] | stored[DISK] == on_gpu
    # Both tiers evicted, and said so; what the events say each holds is
    # what it holds: the host tier's count at shutdown, a full disk tier.
    assert removed[HOST] > 0 and removed[DISK] > 0, removed
    assert e.stats is not None
    assert len(held[HOST]) == e.stats["occupancy"]["blocks"]
    assert len(stored[DISK]) > DISK_RECORDS
    assert len(held[DISK]) == DISK_RECORDS
