"""``kvtier bench soak --server``: a live vLLM server with kvtier (host, disk
and Redis tiers) under an open-loop stream of requests for minutes, while
faults are injected on a seeded schedule; then the same prompts on a
reference server without kvtier, token for token.

The driver (:func:`run_server_soak`) starts a redis-server on a free
loopback port, puts the disk tier on a small tmpfs it mounts (when root),
starts vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``
from the engine's Python, the generated model and its local tokenizer, as
``kvtier bench serve --server`` does) with a small KV cache, and sends
requests (:mod:`kvtier.bench.soak_server_client`) at seeded Poisson
instants. Every ``sample_s`` it reads the server's processes (RSS, open
fds, threads, the /dev/shm and memfd regions they map), its ``/metrics``
and how many requests are in flight (:func:`take_sample`).
Faults (:data:`SERVER_FAULT_KINDS`, one seeded round after another):
Redis killed and restarted empty, Redis stopped (SIGSTOP) and continued,
the disk tier's file system filled and freed, records corrupted in the
slab files under the running server, the tier's directory made read-only
and writable again, clients hanging up during prefill and during decode,
and a burst of long prompts that makes vLLM preempt. After the last
request it stops the server (``--shutdown-timeout``: vLLM drains and the
shim writes ``kvtier_stats_path``), reopens the disk tier's records
(:mod:`kvtier.bench.soak_server_check`), replays every prompt on a
reference server and judges the run.

A command-line tool: runs in the ``kvtier`` process (the client's requests
in threads). Who calls: ``kvtier bench soak --server``
(:mod:`kvtier.bench.commands`) and the engine tests. Blocks for the run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.proc_tree import process_tree, tree_resources
from kvtier.bench.soak_faults import Fault, Tmpfs
from kvtier.bench.soak_server_client import OpenLoop, Request, Workload, replay, top_logprobs
from kvtier.bench.soak_server_faults import Faults

SERVER_FAULT_KINDS = (
    "redis_kill",
    "redis_stall",
    "disk_full",
    "corrupt_disk",
    "disk_readonly",
    "abort_prefill",
    "abort_decode",
    "kv_pressure",
)
"""Every fault the serving soak injects; each round runs all of them, in a seeded order."""


@dataclass(frozen=True)
class ServerSoakConfig:
    """One serving soak's sizes (small: the tiers evict all the time)."""

    minutes: float = 2.0
    seed: int = 0
    rate: float = 2.0  # requests a second, Poisson arrivals
    max_tokens: int = 16
    gpu_blocks: int = 96  # vLLM's KV cache, blocks of 32 tokens (3,072 tokens)
    max_model_len: int = 2048
    host_blocks: int = 64  # kvtier's host tier
    disk_fs_bytes: int = 24 << 20  # the tmpfs under the disk tier
    disk_bytes: int = 16 << 20
    redis_maxmemory: str = "48mb"
    # Records a pass of a corruption fault flips bytes in; 0: every written
    # one (of about 124), so that a read in the window finds its record
    # clean only when it was written since the last pass.
    corrupt_records: int = 0
    aborts: int = 2  # requests hung up on per abort fault
    # vLLM admits a prompt only when all of it fits (scheduler_reserve_full_isl):
    # prompts that fit together, then outgrow the cache as they decode.
    burst: int = 6  # prompts of the KV-pressure fault
    burst_tokens: int = 440
    burst_max_tokens: int = 256
    reference_concurrency: int = 1
    kinds: tuple[str, ...] = SERVER_FAULT_KINDS  # () for a control run without faults

    @property
    def total_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_s(self) -> float:
        return min(0.2 * self.total_s, 120.0) if self.minutes > 2 else 0.25 * self.total_s

    @property
    def sample_s(self) -> float:
        return min(10.0, max(2.0, self.total_s / 60.0))


def server_fault_schedule(
    total_s: float, warmup_s: float, seed: int, kinds: tuple[str, ...] = SERVER_FAULT_KINDS
) -> list[tuple[float, str]]:
    """(seconds from the start, kind) of every fault: whole rounds of
    ``kinds`` (one round per 5 minutes after warm-up, at least one), each
    round in an order drawn from ``seed``, evenly spaced between the end of
    warm-up and a tail left to watch the last one. Pure."""
    tail = max(15.0, 0.05 * total_s)
    span = total_s - warmup_s - tail
    if span <= 0:
        raise ValueError(f"a soak of {total_s:.0f} s leaves no time for faults")
    if not kinds:
        return []
    rounds = max(1, int(span // 300))
    rng = random.Random(seed)
    order: list[str] = []
    for _ in range(rounds):
        r = list(kinds)
        rng.shuffle(r)
        order += r
    gap = span / len(order)
    return [(warmup_s + (i + 0.5) * gap, k) for i, k in enumerate(order)]


# -- the server's processes ----------------------------------------------------
def scrape_all(base_url: str) -> dict[str, float]:
    """kvtier's counters and gauges and vLLM's request and preemption
    counters from ``/metrics``, summed over labels (``request_success`` per
    finish reason). Empty when the server does not answer."""
    import urllib.request

    from kvtier.bench.serve_load import parse_metrics

    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = parse_metrics(text)
    for line in text.splitlines():
        if line.startswith(
            (
                "vllm:num_preemptions_total",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:request_success_total",
            )
        ):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{", 1)[0].removeprefix("vllm:").removesuffix("_total")
            if name == "request_success" and 'finished_reason="' in sample:
                name += "_" + sample.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def take_sample(pid: int, base_url: str, in_flight: Callable[[], int], t0: float) -> dict[str, Any]:
    """One sample of the server: its processes' resources
    (:func:`tree_resources`), its ``/metrics``, and ``in_flight``, the
    requests in flight while the resources were read: the larger of the
    counts just before and just after, as a request that starts or ends
    meanwhile may hold a counted fd. The judge compares fds and threads only
    between samples at equal load. Who calls: the soak's loop. Blocks while
    it reads /proc and ``/metrics`` (10 s at most)."""
    now = time.time()
    before = in_flight()
    res = tree_resources(pid)
    load = max(before, in_flight())
    return {
        "t": now,
        "at_s": round(now - t0, 2),
        **res,
        "metrics": scrape_all(base_url),
        "in_flight": load,
    }


#: The CPU build's settings that bound its own memory (both servers, the
#: caller's environment first). oneDNN compiles a GEMM primitive per shape
#: and caches up to 1,024 of them; batches of 1-1,024 tokens keep making new
#: ones, so vLLM's worker grew by 438 MiB in 345 s without kvtier as with it
#: (bench/results/soak-server/rss-control/, 464 -> 902 MiB, still rising).
#: Capped at 16 primitives and with blocks of 128 KiB and more mapped on
#: their own (glibc, so a freed primitive's memory goes back rather than
#: fragmenting the heap), the same load holds the worker flat within a
#: minute (496-503 MiB from 30 s to 195 s).
CPU_MEMORY_ENV = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16",
    "MALLOC_MMAP_THRESHOLD_": "131072",
}


def server_env() -> dict[str, str]:
    """The environment of the soak's servers (kvtier's and the reference):
    deterministic hashing, vLLM's CPU KV cache and threads, and
    :data:`CPU_MEMORY_ENV` unless the caller's environment sets them. Who
    calls: the soak, ``bench/soak_rss_control.py``."""
    return {
        **CPU_MEMORY_ENV,
        **os.environ,
        "PYTHONHASHSEED": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
    }


def start_soak_server(
    python: str,
    model: str,
    cfg: ServerSoakConfig,
    extra: dict[str, Any] | None,
    log: Path,
    env: dict[str, str],
) -> Any:
    """vLLM's OpenAI server with the soak's sizes, with kvtier (``extra``: its
    ``kv_connector_extra_config``) or without (None: the reference). Who
    calls: the soak, ``bench/soak_rss_control.py``. Blocks until it answers."""
    from kvtier.bench.redis_server import free_port
    from kvtier.bench.serve_load import EngineSettings, Server, server_command

    s = EngineSettings(
        small_blocks=cfg.gpu_blocks,
        max_model_len=cfg.max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
    )
    port = free_port()
    cmd = server_command(python, model, port, "host" if extra else "baseline", s, extra)
    # vLLM's default (0) kills the engine core at once: the shim never shuts down.
    cmd += ["--shutdown-timeout", "30"]
    return Server(cmd, env, log, port)


def _stop_engine_first(api_pid: int, timeout_s: float = 60.0) -> None:
    """Let vLLM's engine core shut down (the scheduler's connector, and with
    it kvtier's manager, last) before the API server goes. vLLM 0.32's API
    server sends SIGTERM to the engine core as it stops, and the engine core
    dies there while it still waits for its worker: the shim's shutdown,
    and ``kvtier_stats_path``, never come. So the API server is stopped
    (SIGSTOP) while the engine core gets SIGINT and drains."""
    cores = [
        p
        for p in process_tree(api_pid)
        if Path(f"/proc/{p}/comm").exists()
        and Path(f"/proc/{p}/comm").read_text().startswith("VLLM::EngineCor")
    ]
    if not cores:
        return
    os.kill(api_pid, signal.SIGSTOP)
    try:
        os.kill(cores[0], signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        while Path(f"/proc/{cores[0]}").exists() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{cores[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.1)
    finally:
        os.kill(api_pid, signal.SIGCONT)


def _batched_check(
    port: int,
    model: str,
    wanted: list[Request],
    reference: dict[int, list[int]],
    rng: random.Random,
    rounds: int = 3,
) -> dict[str, Any]:
    """For every request whose tokens differ from the reference's serial
    answer: its prompt sent to the reference again, ``rounds`` times, in a
    batch of 8 with other prompts of the run, as the soak's server batched
    it. Whether batching alone changes the reference's tokens (greedy
    decoding on CPU is exact per batch, not across batch shapes). And how
    close the first differing token was: the reference's log probabilities
    of its own token and of the soak's there, given the tokens before (a
    gap of a few thousandths is a near tie that rounding can flip; wrong KV
    moves the distribution far more)."""
    bad = [
        r
        for r in wanted
        if r.tokens != reference[r.id][: len(r.tokens)]
        or (r.status == "answered" and r.tokens != reference[r.id])
    ]
    out: dict[str, Any] = {}
    for r in bad:
        seen = []
        for _ in range(rounds):
            batch = [r, *rng.sample(wanted, min(7, len(wanted)))]
            got = replay("127.0.0.1", port, model, batch, len(batch))[r.id]
            seen.append(got)
        ref = reference[r.id]
        d = next((i for i, (a, b) in enumerate(zip(r.tokens, ref, strict=False)) if a != b), None)
        tie: dict[str, Any] = {}
        if d is not None:
            top = top_logprobs("127.0.0.1", port, model, r.prompt + ref[:d], k=20)
            floor = min(top.values())
            tie = {
                "first_diff": d,
                "reference_token_logprob": round(top.get(ref[d], float("nan")), 6),
                # Not among the 20 likeliest: at most the 20th's.
                "soak_token_logprob": round(top.get(r.tokens[d], floor), 6),
                "soak_token_in_top20": r.tokens[d] in top,
            }
            tie["gap"] = round(tie["reference_token_logprob"] - tie["soak_token_logprob"], 6)
        out[str(r.id)] = {
            "batched_differs_from_serial": any(g != ref for g in seen),
            "batched_gave_soak_tokens": any(g[: len(r.tokens)] == r.tokens for g in seen),
            **tie,
        }
    return out


def run_server_soak(
    cfg: ServerSoakConfig, out_dir: Path | None, python: str, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the serving soak (see the module docstring) and return its record;
    with ``out_dir``, the JSON, the plot and the servers' logs go there.
    Blocks for ``cfg.minutes`` plus a server start (the two servers start
    together) and the replay."""
    from kvtier.bench.harness import machine_facts
    from kvtier.bench.redis_server import RedisServer
    from kvtier.bench.serve_load_plan import kv_bytes_per_block
    from kvtier.bench.soak_server_check import check_disk, judge, plot
    from kvtier.tiers.records import record_bytes

    t_begin = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t_begin))
    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-server-"))
    logs = out_dir or work
    logs.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    subprocess.run(
        [python, "-m", "kvtier.bench.vllm_engine", "make-model", str(model)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    block = kv_bytes_per_block(str(model), 32)
    fs = Tmpfs(cfg.disk_fs_bytes)
    disk_root = (fs.path or work) / "disk"
    disk_root.mkdir()
    redis = RedisServer(work, maxmemory=cfg.redis_maxmemory)
    stats_path = work / "kvtier-stats.json"
    extra = {
        "block_size": 32,
        "kvtier_host_bytes": cfg.host_blocks * block,
        "kvtier_disk_path": str(disk_root),
        "kvtier_disk_bytes": cfg.disk_bytes,
        "kvtier_remote_url": redis.url,
        "kvtier_stats_path": str(stats_path),
    }
    env = server_env()
    workload = Workload(seed=cfg.seed, max_tokens=cfg.max_tokens)
    arrivals = random.Random(cfg.seed + 2)
    samples: list[dict[str, Any]] = []
    faults: list[Fault] = []
    crashes: list[str] = []
    server = None
    ref_start: concurrent.futures.Future[Any] | None = None
    fx: Faults | None = None
    try:
        log(
            f"kvtier bench soak --server: {cfg.minutes:g} min at {cfg.rate:g} requests/s; "
            f"disk tier on "
            + (
                f"a {cfg.disk_fs_bytes >> 20} MiB tmpfs"
                if fs.path
                else f"{disk_root} ({fs.reason})"
            )
            + f"; {redis.url}"
        )
        # The reference starts beside kvtier's server and idles until the
        # replay: a vLLM start is mostly one busy core, so on two cores the
        # two overlap (measured: 36 s alone, 55 s together).
        starter = concurrent.futures.ThreadPoolExecutor(1)
        ref_start = starter.submit(
            start_soak_server, python, str(model), cfg, None, logs / f"reference-{stamp}.log", env
        )
        starter.shutdown(wait=False)
        server = start_soak_server(
            python, str(model), cfg, extra, logs / f"server-{stamp}.log", env
        )
        log(f"  server up in {server.startup_s:.0f} s")
        port = int(server.base_url.rsplit(":", 1)[1])
        client = OpenLoop("127.0.0.1", port, str(model))
        fx = Faults(cfg, redis, fs, disk_root, client, workload, record_bytes(block))
        schedule = server_fault_schedule(cfg.total_s, cfg.warmup_s, cfg.seed, cfg.kinds)
        gap = (schedule[1][0] - schedule[0][0]) if len(schedule) > 1 else 30.0
        t0 = time.time()
        next_arrival, next_sample = t0, t0
        while (now := time.time()) - t0 < cfg.total_s:
            if server.proc.poll() is not None:
                crashes.append(f"server exited with {server.proc.returncode} at {now - t0:.0f} s")
                break
            while next_arrival <= now:
                client.start(workload.next(client.busy()))
                next_arrival += arrivals.expovariate(cfg.rate)
            fx.due()
            if schedule and now - t0 >= schedule[0][0]:
                faults.append(fx.inject(schedule.pop(0)[1], gap))
                log(
                    f"  {now - t0:6.1f} s  {faults[-1].kind}: "
                    f"{faults[-1].detail or faults[-1].skipped}"
                )
            if now >= next_sample:
                s = take_sample(server.proc.pid, server.base_url, client.in_flight, t0)
                if not s["metrics"]:
                    crashes.append(f"/metrics did not answer at {now - t0:.0f} s")
                samples.append(s)
                next_sample += cfg.sample_s
            time.sleep(
                max(0.0, min(next_arrival, next_sample) - time.time()) if not fx.pending else 0.05
            )
        fx.due(force=True)
        client.join(180.0)
        time.sleep(1.0)
        samples.append(
            {
                **take_sample(server.proc.pid, server.base_url, client.in_flight, t0),
                "event": "final",
            }
        )
        if server.proc.poll() is not None and not crashes:
            crashes.append(f"server exited with {server.proc.returncode}")
        stop_t = time.perf_counter()
        _stop_engine_first(server.proc.pid)
        server.stop()
        stop_s = time.perf_counter() - stop_t
        server_rc = server.proc.returncode
        redis_keys = redis.cli("DBSIZE").strip()
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
        disk = check_disk(disk_root, block, fx.corrupted)
        reqs = client.requests
        log(
            f"  {len(reqs)} requests; server stopped in {stop_s:.1f} s (exit {server_rc}); "
            f"replaying on the reference server"
        )
        ref_t = time.perf_counter()
        ref = ref_start.result()
        try:
            rport = int(ref.base_url.rsplit(":", 1)[1])
            wanted = [r for r in reqs if r.status == "answered" or r.tokens]
            # The reference's memory before and after the same prompts: vLLM's
            # own growth without kvtier (its worker grows under this load;
            # bench/results/soak-server/rss-control/).
            ref_memory = {"start": tree_resources(ref.proc.pid)}
            reference = replay("127.0.0.1", rport, str(model), wanted, cfg.reference_concurrency)
            ref_memory["end"] = tree_resources(ref.proc.pid)
            batched = _batched_check(rport, str(model), wanted, reference, arrivals)
        finally:
            ref.stop()
        reference_s = time.perf_counter() - ref_t
    finally:
        if fx is not None:
            fx.due(force=True)
        if server is not None:
            server.stop()
        if ref_start is not None:  # (stopped already after a replay: stop is idempotent)
            with contextlib.suppress(Exception):
                ref_start.result().stop()
        redis.stop()
        fs.close()
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "component": "soak-server",
        "config": {**dataclasses.asdict(cfg), "warmup_s": cfg.warmup_s, "sample_s": cfg.sample_s},
        "server_env": {k: env[k] for k in CPU_MEMORY_ENV},
        "machine": machine_facts(),
        "t0": t0,
        "disk_on_tmpfs": fs.reason == "",
        "block_bytes": block,
        "server_stop_s": round(stop_s, 1),
        "server_exit": server_rc,
        "reference_s": round(reference_s, 1),
        "reference_memory": ref_memory,
        "redis_keys_at_end": int(redis_keys or 0),
        "crashes": crashes,
        "kvtier_stats": stats,
        "disk_reopen": disk,
        "faults": [{**f.to_json(), "at_s": round(f.start - t0, 1)} for f in faults],
        "abort_ids": fx.abort_ids,
        "requests": [r.to_json() for r in reqs],
        "samples": samples,
    }
    judge(result, {r.id: r for r in reqs}, reference)
    result["tokens"]["mismatches_batched_on_reference"] = batched
    if out_dir is not None:
        result["json_path"] = str(out_dir / f"soak-server-{stamp}.json")
        result["plot_path"] = str(out_dir / f"soak-server-{stamp}.png")
        Path(result["json_path"]).write_text(json.dumps(result, indent=1) + "\n")
        plot(result, Path(result["plot_path"]))
    return result


def main_soak_server(args: Any) -> int:
    """``kvtier bench soak --server``: run, print the report (or the JSON's
    summary with ``--json``), exit 0 when the soak passed. Blocks for the run."""
    import sys

    from kvtier.bench.harness import output_dir, print_json_last
    from kvtier.bench.serve import check_engine_python
    from kvtier.bench.soak_server_check import report

    python = args.python or sys.executable
    check_engine_python(python)
    result = run_server_soak(
        ServerSoakConfig(minutes=args.minutes, seed=args.seed),
        output_dir(args.out, "bench/soak-server"),
        python,
        log=(lambda _: None) if args.json else (lambda m: print(m, flush=True)),
    )
    if args.json:
        print_json_last({k: v for k, v in result.items() if k not in ("requests", "samples")})
    else:
        print(report(result))
        if "json_path" in result:
            print(f"  saved {result['json_path']}\n  plot  {result['plot_path']}")
    return 0 if result["passed"] else 1


__all__ = [
    "SERVER_FAULT_KINDS",
    "Faults",
    "Request",
    "ServerSoakConfig",
    "main_soak_server",
    "run_server_soak",
    "scrape_all",
    "server_fault_schedule",
    "take_sample",
]
