"""``kvtier replay``: drive the manager with a request trace, as an engine does.

Per request: look keys up in prefix order until the first MISS (stepping the
manager while promotions are pending), load the hits, "compute" the rest and
offer them for storing. With data (the default) real bytes move between a
numpy array standing in for the GPU KV cache and the host pool, and every loaded
block is verified byte-for-byte against bytes derived from its hash.

A command-line tool (never imported by the library): runs in the ``kvtier``
process, the manager and its tiers in that same process, as a scheduler
would. Who calls: ``kvtier replay`` (:mod:`kvtier.cli`), ``kvtier bench
soak``, the policy tests and ``bench/policy_sweep.py``. Blocks for the whole
replay. Traces: :mod:`kvtier.bench.traces`.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

# The traces moved to kvtier.bench.traces; re-exported for replay's callers.
from kvtier.bench.traces import WORKLOADS as WORKLOADS
from kvtier.bench.traces import agent_trace as agent_trace
from kvtier.bench.traces import rag_trace as rag_trace
from kvtier.bench.traces import read_trace as read_trace
from kvtier.bench.traces import synthetic_requests as synthetic_requests
from kvtier.bench.traces import synthetic_trace as synthetic_trace
from kvtier.errors import InvalidArgument, IoError
from kvtier.options.tiers import HostOptions
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.base import LookupResult
from kvtier.tiers.factory import TierConfig, build_lower_tiers, host_slot_bytes
from kvtier.tiers.host_native import make_host_tier
from kvtier.units import parse_size

MAX_PENDING_STEPS = 1000


def key_of(hash_id: int) -> bytes:
    """A 12-byte key shaped like vLLM's (block hash + 4-byte group index)."""
    return struct.pack(">qI", hash_id, 0)


# -- results --------------------------------------------------------------
@dataclass
class ReplayResult:
    requests: int = 0
    block_refs: int = 0
    hit_blocks: dict[str, int] = field(default_factory=dict)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    verify_failures: int = 0
    store_rejections: int = 0
    load_latency_ms: list[float] = field(default_factory=list)
    # Per tier, at the end: blocks held whose predecessor in their prefix
    # chain is gone from that tier (lookups walk a prefix from its start, so
    # such a block can never hit there again); and the mean over the samples.
    stranded: dict[str, int] = field(default_factory=dict)
    stranded_mean: dict[str, float] = field(default_factory=dict)
    transfer_seconds: float = 0.0
    wall_s: float = 0.0
    series: list[dict[str, float]] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return sum(self.hit_blocks.values())

    @property
    def hit_rate(self) -> float:
        return self.hits / self.block_refs if self.block_refs else 0.0

    def to_json(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        lat = np.asarray(self.load_latency_ms) if self.load_latency_ms else np.zeros(1)
        moved = self.bytes_stored + self.bytes_loaded
        return {
            "requests": self.requests,
            "block_refs": self.block_refs,
            "hit_blocks": dict(self.hit_blocks),
            "hit_rate": round(self.hit_rate, 6),
            "bytes_stored": self.bytes_stored,
            "bytes_loaded": self.bytes_loaded,
            "transfer_gbps": round(moved / self.transfer_seconds / 1e9, 3)
            if self.transfer_seconds
            else 0.0,
            "load_latency_ms": {
                "p50": round(float(np.percentile(lat, 50)), 4),
                "p99": round(float(np.percentile(lat, 99)), 4),
            },
            "verify_failures": self.verify_failures,
            "store_rejections": self.store_rejections,
            "stranded_blocks": dict(self.stranded),
            "stranded_blocks_mean": {k: round(v, 1) for k, v in self.stranded_mean.items()},
            "wall_s": round(self.wall_s, 3),
            **(extra or {}),
        }


# -- the fake GPU KV cache -----------------------------------------------
class FakeKV:
    """A numpy array standing in for the GPU KV cache (no torch needed): two
    "layers" sharing one array, each block's bytes derived from its hash so
    loads can be verified."""

    def __init__(self, num_blocks: int, block_bytes: int, seed: int = 0) -> None:
        if block_bytes % 16:
            raise InvalidArgument("--block-bytes must be a multiple of 16")
        self.block_bytes = block_bytes
        self.tensor = np.zeros((num_blocks, 2, block_bytes // 2), dtype=np.uint8)
        self.layers = [self.tensor[:, 0, :], self.tensor[:, 1, :]]
        self.words = self.tensor.reshape(num_blocks, block_bytes).view(np.uint64)
        self.base = np.random.default_rng(seed).integers(
            0, 2**63, block_bytes // 8, dtype=np.uint64
        )

    @staticmethod
    def _mix(hash_ids: Sequence[int]) -> np.ndarray:
        x = np.asarray(hash_ids, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out

    # fill and verify go block by block, in place: a temporary the size of a
    # whole request (up to 124 blocks) makes glibc raise its mmap threshold
    # and keep such sizes on the heap, and RSS crept up for the whole of a
    # 2-minute soak (kvtier bench soak; flat with these per-block loops).
    def fill(self, block_ids: np.ndarray, hash_ids: Sequence[int]) -> None:
        for b, m in zip(np.asarray(block_ids).tolist(), self._mix(hash_ids), strict=True):
            np.bitwise_xor(self.base, m, out=self.words[b])

    def clear(self, block_ids: np.ndarray) -> None:
        self.words[block_ids] = 0

    def verify(self, block_ids: np.ndarray, hash_ids: Sequence[int]) -> int:
        """Number of blocks whose bytes differ from what their hash says."""
        want = np.empty_like(self.base)
        bad = 0
        for b, m in zip(np.asarray(block_ids).tolist(), self._mix(hash_ids), strict=True):
            np.bitwise_xor(self.base, m, out=want)
            bad += not np.array_equal(self.words[b], want)
        return bad


# -- the driver -------------------------------------------------------------
def _write_out(path: str, write: Callable[[Path], object]) -> None:
    """``write(path)`` after making its directory; an OSError (a path the
    user cannot write) becomes IoError naming the path."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write(p)
    except OSError as e:
        raise IoError(e.errno or errno.EIO, f"cannot write {p}: {e.strerror or e}") from None


class Replayer:
    """Drives a manager (and, with data, a DeviceTransfer) through a trace."""

    def __init__(
        self,
        manager: TieredOffloadingManager,
        transfer: Any = None,
        kv: FakeKV | None = None,
        block_bytes: int = 0,
        series_every: int = 200,
        on_request: Callable[[int], None] | None = None,
        chains: bool = True,
    ) -> None:
        """``on_request(i)`` runs before request ``i`` (0-based): how an
        offline policy (:class:`~kvtier.policy.belady.BeladyPolicy`) keeps time.
        ``chains``: remember each key's predecessor, for the stranded-block
        counts (a map of every key the trace names: off for long runs that
        watch their memory, such as the soak)."""
        self.m = manager
        self.on_request = on_request
        self.transfer = transfer
        self.kv = kv
        self.block_bytes = block_bytes
        self.series_every = series_every
        self.result = ReplayResult(hit_blocks={t: 0 for t in self.tier_names})
        self._job = 0
        # Each key's predecessor in its request's prefix (a trace's hashes are
        # chained: a hash names its whole prefix, so this is one key each).
        self._chains = chains
        self._pred: dict[bytes, bytes] = {}
        self._stranded_sum: dict[str, int] = {}
        self._stranded_samples = 0

    @property
    def tier_names(self) -> list[str]:
        return [self.m.host.name] + [t.name for t in self.m.lower]

    def note_chain(self, keys: Sequence[bytes]) -> None:
        """A request's keys, in prefix order: each one's predecessor (for
        :meth:`stranded`)."""
        if self._chains:
            self._pred.update(zip(keys[1:], keys))

    def lookup_prefix(self, keys: list[bytes]) -> int:
        """Look ``keys`` up in order until the first MISS, stepping the
        manager while some are pending; the number of leading HITs."""
        for _ in range(MAX_PENDING_STEPS):
            hits, pending = 0, False
            with self.m.lock:
                for k in keys:
                    r = self.m.lookup(k)
                    if r is LookupResult.MISS:
                        break
                    if r is LookupResult.HIT and not pending:
                        hits += 1
                    else:
                        pending = True
                if not pending:
                    return hits
                self.m.on_schedule_end()  # a step passes; promotions progress
        return hits

    def _next_job(self) -> int:
        self._job += 1
        return self._job

    def run_request(self, hash_ids: Sequence[int]) -> None:
        res = self.result
        if self.on_request is not None:
            self.on_request(res.requests)
        keys = [key_of(h) for h in hash_ids]
        self.note_chain(keys)
        hits = self.lookup_prefix(keys)
        gpu = np.arange(len(keys), dtype=np.int64)
        with self.m.lock:
            self.m.on_new_request()
            for k in keys[:hits]:
                res.hit_blocks[self.m.get_load_source(k)] += 1
            if hits:
                spec = self.m.prepare_load(keys[:hits])
                if self.transfer is not None and self.kv is not None:
                    self.kv.clear(gpu[:hits])
                    t0 = time.perf_counter()
                    jid = self._next_job()
                    self._submit(lambda: self.transfer.submit_load(jid, spec.slots, gpu[:hits]))
                    self.transfer.wait([jid])
                    dt = time.perf_counter() - t0
                    self._drain()
                    res.load_latency_ms.append(dt * 1e3)
                    res.transfer_seconds += dt
                    res.verify_failures += self.kv.verify(gpu[:hits], hash_ids[:hits])
                    res.bytes_loaded += hits * self.block_bytes
                self.m.complete_load(keys[:hits])
            miss_keys = keys[hits:]
            if miss_keys:
                if self.kv is not None:
                    self.kv.fill(gpu[hits:], hash_ids[hits:])
                out = self.m.prepare_store(miss_keys)
                if out is None:
                    res.store_rejections += 1
                elif out.keys_to_store:
                    stored = out.keys_to_store
                    if self.transfer is not None:
                        index = {k: i for i, k in enumerate(keys)}
                        blocks = gpu[[index[k] for k in stored]]
                        t0 = time.perf_counter()
                        jid = self._next_job()
                        self._submit(
                            lambda: self.transfer.submit_store(jid, blocks, out.store_spec.slots)
                        )
                        self.transfer.wait([jid])
                        res.transfer_seconds += time.perf_counter() - t0
                        ok = self._drain()
                        res.bytes_stored += len(stored) * self.block_bytes
                    else:
                        ok = True
                    self.m.complete_store(stored, success=ok)
            self.m.on_request_finished()
            self.m.on_schedule_end()
        res.requests += 1
        res.block_refs += len(keys)
        if res.requests % self.series_every == 0:
            self.sample()

    def _settle(self) -> None:
        """Step the manager until its cascades and promotions finished."""
        for _ in range(MAX_PENDING_STEPS):
            with self.m.lock:
                if not self.m.has_pending_work():
                    break
                self.m.on_schedule_end()

    def _submit(self, fn: Any) -> None:
        for _ in range(10000):
            if fn():
                return
            time.sleep(0.0005)
        raise RuntimeError("transfer queue stayed full")

    def _drain(self) -> bool:
        return all(r.success for r in self.transfer.get_finished())

    def stranded(self, lower: bool = False) -> dict[str, int]:
        """Per tier, the blocks it holds whose chain predecessor it does not
        hold: the host tier from its index; with ``lower``, each lower tier
        by its lookups of every key of the trace so far (a tier that cannot
        answer at once, RETRY, counts as not holding the key)."""
        if not self._chains:
            return {}
        pred = self._pred
        held = self.m.host.entries
        out = {self.m.host.name: sum(1 for k in held if k in pred and pred[k] not in held)}
        for t in self.m.lower if lower else ():
            keys = {k for pair in pred.items() for k in pair}
            have = {k for k in keys if t.lookup(k) is LookupResult.HIT}
            out[t.name] = sum(1 for k in have if k in pred and pred[k] not in have)
        return out

    def sample(self) -> None:
        """Append a point to the result's series (hit rates, stranded blocks)."""
        res = self.result
        point = {"requests": float(res.requests), "hit_rate": res.hit_rate}
        for t, n in res.hit_blocks.items():
            point[t] = n / res.block_refs if res.block_refs else 0.0
        res.stranded = self.stranded()
        self._stranded_samples += 1
        for t, n in res.stranded.items():  # the host tier's, every sample
            self._stranded_sum[t] = self._stranded_sum.get(t, 0) + n
            point[f"stranded {t}"] = float(n)
        res.stranded_mean = {t: v / self._stranded_samples for t, v in self._stranded_sum.items()}
        res.series.append(point)

    def run(
        self,
        trace: Sequence[Sequence[int]],
        progress: bool = True,
        restart_after: int | None = None,
        restart: Callable[[], TieredOffloadingManager] | None = None,
    ) -> ReplayResult:
        """Replay ``trace``; after ``restart_after`` requests, the manager is
        shut down (what it had in flight finished) and ``restart()`` gives
        the one that serves the rest, as after an engine's restart."""
        t0 = time.perf_counter()
        it: Any = trace
        if progress:
            from tqdm import tqdm

            it = tqdm(trace, unit="req", desc="replay", mininterval=0.5)
        for ids in it:
            if restart is not None and self.result.requests == restart_after:
                self._settle()
                self.m.shutdown()
                self.m = restart()
            self.run_request(ids)
            if progress and self.result.requests % 200 == 0:
                it.set_postfix(hit=f"{self.result.hit_rate:.1%}", refresh=False)
        self._settle()  # the tiers' final state complete
        self.sample()
        with self.m.lock:
            self.result.stranded = self.stranded(lower=True)
        self.result.wall_s = time.perf_counter() - t0
        return self.result


# -- CLI ----------------------------------------------------------------------
def _format_table(res: ReplayResult, js: dict[str, Any]) -> str:
    rows = [
        ("requests", f"{res.requests:,}"),
        ("block references", f"{res.block_refs:,}"),
    ]
    for t, n in res.hit_blocks.items():
        rows.append((f"hits from {t}", f"{n:,} ({n / max(res.block_refs, 1):.2%})"))
    for t, st in js.get("tiers", {}).items():
        # What admission to a lower tier is judged by: blocks written to it
        # per hit it gave.
        hits = res.hit_blocks.get(t, 0)
        per = f"{st['stores'] / hits:.2f} per hit" if hits else "no hit"
        rows.append((f"writes to {t}", f"{st['stores']:,} blocks ({per})"))
    rows += [
        ("hit rate", f"{res.hit_rate:.2%}"),
        ("bytes stored", f"{res.bytes_stored / 1e9:.3f} GB"),
        ("bytes loaded", f"{res.bytes_loaded / 1e9:.3f} GB"),
        ("transfer GB/s", f"{js['transfer_gbps']}"),
        (
            "load latency p50/p99",
            f"{js['load_latency_ms']['p50']} / {js['load_latency_ms']['p99']} ms",
        ),
        ("verify failures", f"{res.verify_failures}"),
        (
            "stranded blocks",
            ", ".join(f"{t} {n:,}" for t, n in res.stranded.items()) or "none",
        ),
        ("wall time", f"{res.wall_s:.1f} s"),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)


def plot_series(res: ReplayResult, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [p["requests"] for p in res.series]
    ax.plot(xs, [100 * p["hit_rate"] for p in res.series], label="total", color="black", lw=2)
    for t in res.hit_blocks:
        ax.plot(xs, [100 * p.get(t, 0.0) for p in res.series], label=t)
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("cumulative block hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class ReplayOptions:
    """What ``kvtier replay`` was asked for: the run's flags (sizes as text)
    and the tiers' options (:mod:`kvtier.options`, from the tiers' flags)."""

    trace: str | None = None
    block_bytes: str = "65536"
    host: str | None = None
    host_blocks: int | None = None
    host_tier: HostOptions = field(default_factory=HostOptions)
    tiers: TierConfig = field(default_factory=TierConfig)
    cascade_on_hit: bool = False
    no_data: bool = False
    max_requests: int | None = None
    restart_after: int | None = None
    synthetic_requests: int = 4000
    workload: str = "chat"
    seed: int = 0
    json_path: str | None = None
    plot: str | None = None
    no_progress: bool = False


def main_replay(args: ReplayOptions) -> int:
    """Run ``kvtier replay``: build the tiers, replay the trace, print the
    table (and write the JSON and plot asked for). Blocks until the trace is
    done; returns the exit status (1 when a loaded block failed verification)."""
    block_bytes = parse_size(args.block_bytes)
    if args.max_requests is not None and args.max_requests < 1:
        raise InvalidArgument(f"--max-requests must be >= 1, got {args.max_requests}")
    if args.restart_after is not None and args.restart_after < 1:
        raise InvalidArgument(f"--restart-after must be >= 1, got {args.restart_after}")
    if args.seed < 0:
        raise InvalidArgument(f"--seed must be >= 0, got {args.seed}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgument("--plot needs matplotlib: pip install 'kvtier[bench]'")
    if args.workload not in WORKLOADS:
        raise InvalidArgument(f"--workload must be one of {', '.join(WORKLOADS)}")
    if args.trace:
        trace = read_trace(args.trace, args.max_requests)
        source = args.trace
    else:
        n = args.max_requests or args.synthetic_requests
        trace = WORKLOADS[args.workload](n, args.seed)
        kind = "" if args.workload == "chat" else f"{args.workload}, "
        source = f"synthetic({kind}{n} requests, seed {args.seed})"
    if not trace:
        raise InvalidArgument("the trace has no requests")

    capacity: int | None
    if args.host_blocks is not None:
        capacity = args.host_blocks
    elif args.host and args.host.lower() in ("inf", "unbounded"):
        if not args.no_data:
            raise InvalidArgument(
                "--host inf needs --no-data (an unbounded pool cannot be allocated)"
            )
        capacity = None
    elif args.host:
        capacity = parse_size(args.host) // block_bytes
    else:
        capacity = None if args.no_data else (1 << 30) // block_bytes
    if capacity is not None and capacity <= 0:
        raise InvalidArgument("host capacity must hold at least one block")

    tier_cfg = args.tiers
    if args.no_data and tier_cfg.disk is not None:
        tier_cfg = replace(tier_cfg, disk=replace(tier_cfg.disk, no_data=True))
    pool = transfer = kv = None
    if not args.no_data:
        from kvtier.pool import HostPool
        from kvtier.worker.transfer import DeviceTransfer

        assert capacity is not None
        # Lower tiers may need room beside each block (the disk record trailer).
        pool = HostPool(capacity, host_slot_bytes(block_bytes, tier_cfg))
        kv = FakeKV(max(len(t) for t in trace), block_bytes, seed=args.seed)
        transfer = DeviceTransfer(kv.layers, pool)
    policy: Any = args.host_tier.policy
    on_request = None
    if policy.lower() == "belady":
        from kvtier.policy.belady import BeladyPolicy

        if args.restart_after is not None:
            raise InvalidArgument("--restart-after with the belady policy: it knows no restart")
        policy = BeladyPolicy(trace, key_of)
        on_request = policy.advance

    def start() -> TieredOffloadingManager:
        """The tiers and manager: a fresh host tier over the pool, the lower
        tiers opened from their configuration (a disk tier recovers its
        directory's index)."""
        lower = build_lower_tiers(tier_cfg, block_bytes, namespace=f"replay-{block_bytes}")
        host = make_host_tier(
            pool,
            capacity,
            policy=policy,
            admit_after=args.host_tier.admit_after,
            max_tracked=args.host_tier.max_tracked,
            prefix_aware=args.host_tier.prefix_eviction,
        )
        return TieredOffloadingManager(host, lower, cascade_on_hit=args.cascade_on_hit)

    manager = start()
    lower = manager.lower
    cap_txt = "unbounded" if capacity is None else f"{capacity:,} blocks"
    print(
        f"kvtier replay: {source}; host {cap_txt}, policy {args.host_tier.policy}, "
        f"{'no data' if args.no_data else f'{block_bytes:,} B blocks, data verified'}"
        + "".join(f"; {t.name} tier" for t in lower)
    )
    rep = None
    try:
        rep = Replayer(manager, transfer, kv, block_bytes, on_request=on_request)
        res = rep.run(trace, not args.no_progress, args.restart_after, start)
    finally:
        if rep is not None:  # after a restart, the second one
            manager, lower = rep.m, rep.m.lower
        manager.shutdown()
        if transfer is not None:
            transfer.shutdown()
        if pool is not None:
            pool.close()
    js = res.to_json(
        {
            "trace": source,
            "policy": args.host_tier.policy,
            "disk_policy": tier_cfg.disk.policy if tier_cfg.disk else None,
            "host_blocks": capacity,
            "block_bytes": block_bytes,
            "data": not args.no_data,
            "restart_after": args.restart_after,
            "tiers": {t.name: t.stats() for t in lower},
            "manager": vars(manager.stats),
        }
    )
    print(_format_table(res, js))
    if args.json_path:
        _write_out(args.json_path, lambda p: p.write_text(json.dumps(js, indent=2) + "\n"))
        print(f"  wrote {args.json_path}")
    if args.plot:
        title = f"kvtier replay: {Path(source).name}, {cap_txt}, {args.host_tier.policy}"
        _write_out(args.plot, lambda p: plot_series(res, str(p), title))
        print(f"  wrote {args.plot}")
    if res.verify_failures:
        print(f"kvtier: {res.verify_failures} block(s) failed verification")
        return 1
    return 0 if math.isfinite(res.hit_rate) else 1
