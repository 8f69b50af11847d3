"""``kvtier bench disk-index``: what the disk tier's index costs per record.

Resident bytes per record, store, lookup and admission rates through the
tier's public calls, checkpoint time, and warm-restart time and rate, with
``DiskTier(..., no_data=True)`` so no device is needed (only the index, the
journal and the checkpoint are written, to a temporary directory). The
blocks are stored as prefix chains of :data:`CHAIN` blocks (each batch with
its blocks' predecessors, as the manager hands them to the tier), and every
restart checks how many of a sample of chains it kept whole.

Each phase runs in a fresh Python process so the resident-memory delta is the
tier's alone: the fill (store N records, look them up, admit, close), a
restart that replays the journal (then checkpoints), and a restart from the
checkpoint. Who calls: ``kvtier bench disk-index`` (:mod:`kvtier.bench.commands`),
a command-line tool: the phases are child processes of the ``kvtier`` process. Blocks for the
whole measurement (about 10 s per million records with the Python index).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_BYTES = 4096
BATCH = 64  # keys per submit_store, as a cascade of a few requests' blocks
CHAIN = 256  # blocks per prefix chain (4 batches: a 128k-token prompt at 512-token blocks)
SAMPLE_CHAINS = 200  # chains walked after each phase


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _key(i: int) -> bytes:
    # vLLM's shape: a 32-byte block hash and a 4-byte group index.
    return i.to_bytes(32, "little") + b"\0\0\0\0"


def _chains_kept(t: Any, records: int) -> tuple[int, int]:
    """(chains whole, chains walked) of a sample of the stored chains: a
    chain is whole when its head's links lead through all of its blocks."""
    from kvtier.tiers.disk import key_digest

    ix = t.index
    if not hasattr(ix, "child"):  # an index without readable links
        return 0, 0
    heads = range(0, records - CHAIN + 1, CHAIN)
    walked = whole = 0
    for h in heads[:: max(1, len(heads) // SAMPLE_CHAINS)]:
        rec, n = ix.find(key_digest(_key(h))), 1
        while rec >= 0 and n < CHAIN:
            rec = ix.child(rec)
            n += rec >= 0
        walked += 1
        whole += n == CHAIN
    return whole, walked


def _phase(phase: str, path: str, records: int, policy: str) -> dict[str, Any]:
    """One phase in this (fresh) process; the figures as a dict."""
    import gc

    from kvtier.tiers.disk import DiskTier, record_bytes

    capacity = records * record_bytes(BLOCK_BYTES)
    gc.collect()
    base = _rss_bytes()
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    t = DiskTier(path, capacity, BLOCK_BYTES, no_data=True, policy=policy)
    out["open_s"] = time.perf_counter() - t0
    if phase == "fill":
        slots = list(range(BATCH))
        t0 = time.perf_counter()
        for first in range(0, records, BATCH):
            keys = [_key(i) for i in range(first, min(records, first + BATCH))]
            # Each block's predecessor in its chain, as the manager hands them.
            t.chain_hints(
                {k: _key(first + i - 1) for i, k in enumerate(keys) if (first + i) % CHAIN}
            )
            assert t.submit_store(keys, slots[: len(keys)]) is not None
            t.poll()
            t.take_events()
        out["store_per_s"] = records / (time.perf_counter() - t0)
        gc.collect()
        out["rss_bytes"] = _rss_bytes() - base
        probe = [_key(i) for i in range(0, records, max(1, records // 200_000))]
        misses = [_key(records + i) for i in range(len(probe))]
        t0 = time.perf_counter()
        hits = sum(t.lookup(k).name == "HIT" for k in probe)
        out["lookup_hit_per_s"] = len(probe) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        miss = sum(t.lookup(k).name == "MISS" for k in misses)
        out["lookup_miss_per_s"] = len(misses) / (time.perf_counter() - t0)
        assert hits == len(probe) and miss == len(misses), (hits, miss)
        t0 = time.perf_counter()
        admitted = sum(t.admit(k) for k in misses)
        out["admit_per_s"] = len(misses) / (time.perf_counter() - t0)
        assert admitted == len(misses)
        out["blocks"] = t.stats()["blocks"]
    else:
        out["recovered"] = t.stats()["recovered"]
        gc.collect()
        out["rss_bytes"] = _rss_bytes() - base
    out["chains_whole"], out["chains_walked"] = _chains_kept(t, records)
    if phase == "restart-journal":
        t0 = time.perf_counter()
        t.checkpoint()
        out["checkpoint_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    t.close()
    out["close_s"] = time.perf_counter() - t0
    return out


def _run_phase(phase: str, path: str, records: int, policy: str) -> dict[str, Any]:
    code = (
        "import json, sys\n"
        "from kvtier.bench.disk_index import _phase\n"
        "print(json.dumps(_phase(*sys.argv[1:3], int(sys.argv[3]), sys.argv[4])))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, phase, path, str(records), policy],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(f"disk-index phase {phase} failed:\n{r.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def run_disk_index(records: int = 1_000_000, policy: str = "lru") -> dict[str, Any]:
    """Measure the three phases over ``records`` records; a flat result dict."""
    with tempfile.TemporaryDirectory(prefix="kvtier-disk-index-") as d:
        fill = _run_phase("fill", d, records, policy)
        journal_bytes = sum(p.stat().st_size for p in Path(d).glob("*/index.journal"))
        rj = _run_phase("restart-journal", d, records, policy)
        ckpt_bytes = sum(p.stat().st_size for p in Path(d).glob("*/index.ckpt"))
        rc = _run_phase("restart-checkpoint", d, records, policy)
    if not rj["recovered"] == rc["recovered"] == records:
        raise RuntimeError(f"restart recovered {rj['recovered']} / {rc['recovered']} of {records}")
    return {
        "component": "disk-index",
        "records": records,
        "block_bytes": BLOCK_BYTES,
        "policy": policy,
        "resident_bytes_per_record": round(fill["rss_bytes"] / records, 1),
        "store_per_s": round(fill["store_per_s"]),
        "lookup_hit_per_s": round(fill["lookup_hit_per_s"]),
        "lookup_miss_per_s": round(fill["lookup_miss_per_s"]),
        "admit_per_s": round(fill["admit_per_s"]),
        "checkpoint_s": round(rj["checkpoint_s"], 3),
        "checkpoint_bytes": ckpt_bytes,
        "journal_bytes": journal_bytes,
        "restart_journal_s": round(rj["open_s"], 3),
        "restart_journal_per_s": round(records / rj["open_s"]),
        "restart_checkpoint_s": round(rc["open_s"], 3),
        "restart_checkpoint_per_s": round(records / rc["open_s"]),
        "restart_resident_bytes_per_record": round(rc["rss_bytes"] / records, 1),
        "close_after_fill_s": round(fill["close_s"], 3),
        # Of a sample of chains: whole after the fill, after each restart.
        "chains_walked": fill["chains_walked"],
        "chains_whole": [fill["chains_whole"], rj["chains_whole"], rc["chains_whole"]],
        "note": (
            "DiskTier(no_data=True), 4 KiB blocks, capacity = records; each phase in a "
            f"fresh process; rates through submit_store+poll (batches of 64, chains of {CHAIN} "
            "blocks), lookup, admit"
        ),
    }


def table(r: dict[str, Any]) -> str:
    """The result as a two-column text table."""
    rows = [
        ("records", f"{r['records']:,}"),
        ("policy", r["policy"]),
        ("resident bytes / record", f"{r['resident_bytes_per_record']:.1f}"),
        ("  after a warm restart", f"{r['restart_resident_bytes_per_record']:.1f}"),
        ("stores / s", f"{r['store_per_s']:,}"),
        ("lookups (hit) / s", f"{r['lookup_hit_per_s']:,}"),
        ("lookups (miss) / s", f"{r['lookup_miss_per_s']:,}"),
        ("admissions / s", f"{r['admit_per_s']:,}"),
        ("checkpoint", f"{r['checkpoint_s']:.3f} s ({r['checkpoint_bytes']:,} B)"),
        (
            "restart from journal",
            f"{r['restart_journal_s']:.3f} s ({r['restart_journal_per_s']:,} records/s)",
        ),
        (
            "restart from checkpoint",
            f"{r['restart_checkpoint_s']:.3f} s ({r['restart_checkpoint_per_s']:,} records/s)",
        ),
        (
            "chains whole (of a sample)",
            "after the fill {}, journal restart {}, checkpoint restart {} of {}".format(
                *r["chains_whole"], r["chains_walked"]
            ),
        ),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)
