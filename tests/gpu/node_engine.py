"""One engine attached to a kvtier node, in its own process, for
test_cuda_node.py: its KV cache on its own GPU memory (random bytes from its
seed), the node's pool mapped and registered with CUDA once, and copies
straight between the two (one copy, no CUDA IPC).

Run as ``python node_engine.py SOCKET ENGINE SEED DEVICE``; it answers one
JSON line on stdout for each command line on stdin, in order:

- ``store ROUND``: stores its blocks under keys of (its seed, ROUND);
  answers ``{"stored": n}``;
- ``load SEED ROUND``: looks up and loads the blocks engine SEED stored in
  ROUND into poisoned blocks of its own cache and compares them byte for
  byte with that engine's bytes (made again from SEED); answers
  ``{"loaded": n}`` or ``{"error": "..."}``;
- ``hang ROUND``: begins a store of round ROUND behind about 1.5 s of GPU
  work on the compute stream, so its copies are still in flight, and
  never completes it; answers ``{"in_flight": n}`` (the test kills it);
- ``miss SEED ROUND``: looks up engine SEED's keys of ROUND; answers
  ``{"missed": n}`` when none is found;
- ``quit``.

DEVICE "cpu" runs the same steps on CPU tensors (the cpu backend): a check
of this script on a machine without a GPU, not of CUDA. Every command
blocks until its copies are final.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from gpu import cuda_case as case

NS = "c3" * 16  # one model: both engines share its keys
LAYOUT = "kv_split"  # vLLM's (2, num_blocks, ...) per layer
NB = 96  # KV blocks in each engine's cache: stores from the first half, loads into the second
MOVED = 40  # blocks each engine stores a round


def key(seed: int, rnd: int, i: int) -> bytes:
    return seed.to_bytes(8, "big") + rnd.to_bytes(8, "big") + i.to_bytes(16, "big") + bytes(4)


def sources(seed: int, rnd: int) -> np.ndarray:
    """The blocks engine ``seed`` stores in round ``rnd``, in key order (of
    the first half: loads never change them, so they are its seed's bytes)."""
    return np.random.default_rng([seed, rnd]).permutation(NB // 2)[:MOVED]


def main() -> None:
    path, engine, seed, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    import torch
    from kvtier.node.client import NodeManager
    from kvtier.tiers.base import LookupResult
    from kvtier.worker.transfer import DeviceTransfer

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    lay = case.make_layout(LAYOUT, NB, seed=seed, device=device)
    payload = sum(lay.page_bytes)
    m = NodeManager(path, NS, payload, engine=engine)
    pool = m.attach_pool()
    sync()
    t = DeviceTransfer(lay.tensors, pool, page_bytes=lay.page_arg)
    jobs = iter(range(1, 1 << 30))
    out = {"backend": t.backend, "slot_bytes": pool.slot_bytes, "payload": payload}
    print(json.dumps(out), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            try:
                if cmd[0] == "quit":
                    break
                if cmd[0] == "store":
                    rnd = int(cmd[1])
                    keys = [key(seed, rnd, i) for i in range(MOVED)]
                    got = m.prepare_store(keys)
                    assert got is not None and got.keys_to_store == keys, "not admitted"
                    j = next(jobs)
                    sync()
                    assert t.submit_store(j, sources(seed, rnd), got.store_spec.slots)
                    case.assert_ok(t, [j])
                    m.complete_store(keys)
                    m.on_schedule_end()
                    out = {"stored": len(keys)}
                elif cmd[0] == "load":
                    other, rnd = int(cmd[1]), int(cmd[2])
                    keys = [key(other, rnd, i) for i in range(MOVED)]
                    found = [m.lookup(k) for k in keys]
                    assert found == [LookupResult.HIT] * MOVED, f"lookups {found}"
                    spec = m.prepare_load(keys)
                    dst = (
                        NB // 2
                        + np.random.default_rng([seed, other, rnd]).permutation(NB // 2)[:MOVED]
                    )
                    case.poison_blocks(lay.tensors, dst)
                    before = [case.snapshot(x) for x in lay.tensors]
                    j = next(jobs)
                    sync()
                    assert t.submit_load(j, spec.slots, dst)
                    case.assert_ok(t, [j])
                    m.complete_load(keys)
                    m.on_schedule_end()
                    theirs = case.make_layout(LAYOUT, NB, seed=other, device=device)
                    src = sources(other, rnd)
                    for i, x in enumerate(lay.tensors):
                        want = before[i].copy()
                        want[dst] = case.snapshot(theirs.tensors[i])[src]
                        case.assert_bytes_equal(case.snapshot(x), want, f"{engine}: tensor {i}")
                    out = {"loaded": len(keys)}
                elif cmd[0] == "hang":
                    rnd = int(cmd[1])
                    keys = [key(seed, rnd, i) for i in range(MOVED)]
                    got = m.prepare_store(keys)
                    assert got is not None and got.keys_to_store == keys, "not admitted"
                    if device == "cuda":  # the store waits for the compute stream's work
                        torch.cuda._sleep(10 * case.SLEEP_CYCLES)
                    assert t.submit_store(next(jobs), sources(seed, rnd), got.store_spec.slots)
                    out = {"in_flight": len(keys)}
                elif cmd[0] == "miss":
                    other, rnd = int(cmd[1]), int(cmd[2])
                    keys = [key(other, rnd, i) for i in range(MOVED)]
                    found = [m.lookup(k) for k in keys]
                    m.on_schedule_end()
                    assert found == [LookupResult.MISS] * MOVED, f"lookups {found}"
                    out = {"missed": len(keys)}
                else:
                    out = {"error": f"unknown command {cmd!r}"}
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(json.dumps(out), flush=True)
    finally:
        t.shutdown()
        m.shutdown()


if __name__ == "__main__":
    main()
