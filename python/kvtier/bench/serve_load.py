"""``kvtier bench serve --server``: kvtier under concurrent load, through
vLLM's own OpenAI server and vLLM's own benchmark client.

A command-line tool: runs in the ``kvtier`` process. Who calls:
:mod:`kvtier.bench.commands` (and the engine tests' smoke run). Blocks for the whole
run: per repeat and configuration one ``vllm serve`` process (vLLM's API
server, ``python -m vllm.entrypoints.openai.api_server``: the CPU build's
console script cannot start, see ``../shared/reference/serving.md``) on a
locally generated model and tokenizer, then vLLM's ``vllm bench serve``
client (``vllm.benchmarks.serve``, run as a child process of the same
Python) for every workload and load level, one after another.

Configurations (the names in the report), all with the same engine
settings (printed in the report):

- ``baseline``: vLLM's prefix cache only, a KV cache smaller than the
  working set (what users have);
- ``ideal``: the same with a KV cache that holds the whole working set;
- ``host``, ``host+disk``, ``host+redis``, ``host+disk+redis``: kvtier
  (``KVTierConnector``) over the baseline's small KV cache; ``host`` holds
  the working set, the others a third of it with the lower tiers behind;
- ``second-server``: a new server (empty host tier) on the Redis that
  ``host+redis`` filled in the same repeat: what a second engine of a fleet
  gets from the shared pool.

Workloads: ``trace`` (a Mooncake-format trace cut to ``max_requests`` and
capped to the model's length, replayed with the client's ``timed_trace``
dataset on its own timestamps times ``time_scale``), ``prefix`` (the
client's ``prefix_repetition``) and ``random`` (zero reuse), the last two at
each of ``concurrencies``. Every workload's prompts are the same in every
configuration and repeat (fixed seeds, ``PYTHONHASHSEED`` pinned for the
trace's token expansion), so the second server asks for what the first
stored.

Results: per configuration, workload and level the client's throughput and
latency percentiles, kvtier's counters from the server's Prometheus
``/metrics`` (``vllm:kv_offload_kvtier_*``, differences over the workload),
medians over repeats, and ratios to ``baseline`` and ``ideal`` of the same
workload and level.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgument

CONFIGS = (
    "baseline", "ideal", "host", "host+disk", "host+redis", "host+disk+redis", "second-server",
)  # fmt: skip
WORKLOADS = ("trace", "prefix", "random")
TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces
# Client metrics carried into the report: (report key, client key, scale).
METRICS = (
    ("throughput_rps", "request_throughput", 1.0),
    ("output_tps", "output_throughput", 1.0),
    ("ttft_mean_s", "mean_ttft_ms", 1e-3),
    ("ttft_p50_s", "median_ttft_ms", 1e-3),
    ("ttft_p99_s", "p99_ttft_ms", 1e-3),
    ("tpot_p50_s", "median_tpot_ms", 1e-3),
    ("tpot_p99_s", "p99_tpot_ms", 1e-3),
    ("itl_p50_s", "median_itl_ms", 1e-3),
    ("itl_p99_s", "p99_itl_ms", 1e-3),
)
# kvtier's counters read from /metrics (vllm:kv_offload_kvtier_<name>).
KVTIER_COUNTERS = (
    "loaded_host", "loaded_disk", "loaded_remote", "cascades", "cascades_dropped",
    "allocation_failures", "promotions", "load_failures",
)  # fmt: skip


@dataclass(frozen=True)
class EngineSettings:
    """What every configuration's server runs with (the report prints it)."""

    block_size: int = 32
    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048  # chunked prefill's step budget
    small_blocks: int = 384  # the baseline's KV cache (engine blocks)
    large_blocks: int = 4096  # the ideal's: the whole working set
    # VLLM_CPU_OMP_THREADS_BIND, the same for every configuration. vLLM's
    # "auto" reserves one core more when a KV connector is configured, which
    # on a 2-core machine leaves none reserved: the model then computes on
    # both cores with a connector and on one without (a miss computed in
    # 130-180 ms against 240-290 in bench serve), and under load its OpenMP
    # threads fight the engine core and the API server for the cores.
    omp_threads_bind: str = "0"
    kv_cache_space_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (at least large_blocks' bytes)


@dataclass(frozen=True)
class Workloads:
    """The three workloads' shapes (the defaults keep this machine's engine
    busy, not drowning: a run is about 2 minutes a configuration)."""

    trace: Path | None = None
    time_scale: float = 1.0
    max_requests: int = 40
    max_input: int = 3072
    max_output: int = 32
    concurrencies: tuple[int, ...] = (1, 4)
    prefix_len: int = 1536
    prefix_suffix_len: int = 128
    prefix_count: int = 12
    prefix_prompts: int = 36
    random_input: int = 1024
    random_prompts: int = 16
    output_len: int = 32
    names: tuple[str, ...] = WORKLOADS


@dataclass
class Run:
    """One server: its configuration, its log and its per-workload results."""

    config: str
    repeat: int
    results: list[dict[str, Any]] = field(default_factory=list)
    startup_s: float = 0.0
    error: str | None = None


def cut_trace(
    src: Path, dst: Path, max_requests: int, max_input: int, max_output: int
) -> dict[str, Any]:
    """Write the first ``max_requests`` requests of a Mooncake-format trace to
    ``dst`` with prompts capped to ``max_input`` tokens (their hash ids cut to
    match) and outputs to ``max_output``, timestamps rebased to the first.
    Returns what the cut holds: requests, span, tokens and the share of
    512-token blocks an unbounded cache would serve. Clear errors for a
    file that is not such a trace."""
    out: list[dict[str, Any]] = []
    with open(src) as f:
        for n, line in enumerate(f, 1):
            if len(out) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ts, inp, outp, ids = (
                    float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                    [int(h) for h in r["hash_ids"]],
                )  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidArgument(
                    f"{src}:{n}: not a Mooncake-format trace line (timestamp, input_length, "
                    f"output_length, hash_ids): {e}"
                ) from None
            inp = min(inp, max_input)
            ids = ids[: max(1, math.ceil(inp / TRACE_BLOCK))]
            out.append({"timestamp": ts, "input_length": inp,
                        "output_length": max(1, min(outp, max_output)), "hash_ids": ids})  # fmt: skip
    if not out:
        raise InvalidArgument(f"{src}: no requests")
    t0 = out[0]["timestamp"]
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in out:
        r["timestamp"] -= t0
        ids = r["hash_ids"]
        prefix_ok = True
        for i in range(len(ids)):
            key = tuple(ids[: i + 1])
            total += 1
            prefix_ok = prefix_ok and key in seen
            hit += prefix_ok
            seen.add(key)
    dst.write_text("".join(json.dumps(r) + "\n" for r in out))
    return {
        "requests": len(out), "span_s": out[-1]["timestamp"] / 1000,
        "input_tokens": sum(r["input_length"] for r in out),
        "reusable_block_share": hit / total if total else 0.0,
    }  # fmt: skip


def _kv_bytes_per_block(model_dir: str, block_size: int) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers, kv_heads = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    return layers * 2 * kv_heads * int(head) * 4 * block_size


def kvtier_extra(
    config: str, settings: EngineSettings, block_bytes: int, workdir: Path, redis_url: str | None
) -> dict[str, Any] | None:
    """kvtier's ``kv_connector_extra_config`` of a configuration (None: no
    connector). ``host`` holds the ideal's KV cache worth of blocks, the
    tiered ones a third of it."""
    if config in ("baseline", "ideal"):
        return None
    whole = settings.large_blocks * block_bytes
    kv: dict[str, Any] = {"block_size": settings.block_size}
    kv["kvtier_host_bytes"] = whole if config == "host" else whole // 3
    if "disk" in config:
        kv["kvtier_disk_path"] = str(workdir / f"disk-{config}")
        kv["kvtier_disk_bytes"] = 2 * whole
    if "redis" in config or config == "second-server":
        if redis_url is None:
            raise InvalidArgument(f"{config} needs a Redis server")
        kv["kvtier_remote_url"] = redis_url
    return kv


def server_command(
    python: str, model_dir: str, port: int, config: str, settings: EngineSettings,
    extra: dict[str, Any] | None,
) -> list[str]:  # fmt: skip
    """The ``vllm serve`` command line of a configuration (the CPU build's
    console script cannot start; its module does)."""
    blocks = settings.large_blocks if config == "ideal" else settings.small_blocks
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--block-size", str(settings.block_size), "--enforce-eager", "--seed", "0",
        "--max-model-len", str(settings.max_model_len),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--enable-chunked-prefill", "--enable-prefix-caching",
        "--num-gpu-blocks-override", str(blocks),
    ]  # fmt: skip
    if extra is not None:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra,
        })]  # fmt: skip
    return cmd


def client_args(
    workload: str, level: int | float, base_url: str, model_dir: str, w: Workloads,
    trace_file: Path | None, result: Path,
) -> list[str]:  # fmt: skip
    """``vllm bench serve`` flags of one workload at one level (concurrency;
    for the trace, the time scale)."""
    args = [
        "--backend", "vllm", "--base-url", base_url, "--model", model_dir,
        # Each workload and level its own prompts: the client's datasets draw
        # their token offsets from the same generator, so equal seeds would
        # make a random prompt repeat a prefix_repetition one, and a level hit
        # what an earlier level left cached.
        "--tokenizer", model_dir, "--seed", str(_SEEDS.get(workload, 0) + int(level * 1000)),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm",
    ]  # fmt: skip
    if workload == "trace":
        assert trace_file is not None
        args += [
            "--dataset-name", "timed_trace", "--dataset-path", str(trace_file),
            "--num-prompts", str(w.max_requests), "--timed-trace-chunk-hash-size", str(TRACE_BLOCK),
            "--timed-trace-sec-multiplier", str(0.001 * float(level)),
            "--timed-trace-label-timestamp", "timestamp",
            "--timed-trace-label-input-length", "input_length",
            "--timed-trace-label-output-length", "output_length",
            "--timed-trace-label-hash-ids", "hash_ids",
        ]  # fmt: skip
    elif workload == "prefix":
        args += [
            "--dataset-name", "prefix_repetition", "--num-prompts", str(w.prefix_prompts),
            "--prefix-repetition-prefix-len", str(w.prefix_len),
            "--prefix-repetition-suffix-len", str(w.prefix_suffix_len),
            "--prefix-repetition-num-prefixes", str(w.prefix_count),
            "--prefix-repetition-output-len", str(w.output_len),
            "--max-concurrency", str(int(level)), "--ignore-eos",
        ]  # fmt: skip
    elif workload == "random":
        args += [
            "--dataset-name", "random", "--num-prompts", str(w.random_prompts),
            "--random-input-len", str(w.random_input), "--random-output-len", str(w.output_len),
            "--random-range-ratio", "0", "--max-concurrency", str(int(level)),
        ]  # fmt: skip
    else:
        raise InvalidArgument(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
    return args + ["--save-result", "--result-dir", str(result.parent),
                   "--result-filename", result.name]  # fmt: skip


_SEEDS = {"trace": 0, "prefix": 5_000_000, "random": 7_000_000}


def levels(workload: str, w: Workloads) -> list[float]:
    """The load levels of a workload, lightest first."""
    return [w.time_scale] if workload == "trace" else [float(c) for c in w.concurrencies]


# The client: vLLM's own, from Python (the CPU build's console script cannot start).
_CLIENT = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = argparse.ArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def scrape(base_url: str) -> dict[str, float]:
    """Prometheus ``/metrics`` of a server: kvtier's counters and vLLM's
    cached prompt tokens, summed over label sets."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of the metrics this report uses over its labels:
    ``kvtier_<name>`` for ``vllm:kv_offload_kvtier_<name>`` (counters carry a
    ``_total`` suffix in the text format), ``prompt_tokens_cached`` and
    ``prompt_tokens``. Pure."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or " " not in line:
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.split("{", 1)[0]
        if name.endswith("_created"):  # prometheus_client's creation timestamps
            continue
        name = name.removesuffix("_total")
        if name.startswith("vllm:kv_offload_kvtier_"):
            key = "kvtier_" + name[len("vllm:kv_offload_kvtier_") :]
        elif name in ("vllm:prompt_tokens_cached", "vllm:prompt_tokens"):
            key = name.split(":", 1)[1]
        else:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


class Server:
    """A ``vllm serve`` child in its own session, stopped with its children.

    Blocks in ``__init__`` until the server answers ``/health`` (or fails:
    the log's tail is in the error)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, port: int,
                 timeout_s: float = 300.0) -> None:  # fmt: skip
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        t0 = time.perf_counter()
        self._f = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): {self.tail()}")
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"vllm serve not up after {timeout_s:.0f} s: {self.tail()}")
                try:
                    with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def tail(self, n: int = 3000) -> str:
        self._f.flush()
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """SIGINT (vLLM shuts its engine down and kvtier's tiers close), then
        SIGKILL of the session after 60 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._f.close()


def _free_port() -> int:
    from kvtier.bench.redis_server import free_port

    return free_port()


def run_client(python: str, args: list[str], env: dict[str, str], result: Path,
               timeout_s: float = 1800.0) -> dict[str, Any]:  # fmt: skip
    """Run vLLM's benchmark client to the end; its saved result."""
    p = subprocess.run([python, "-c", _CLIENT, *args], env=env, capture_output=True, text=True,
                       timeout=timeout_s)  # fmt: skip
    if p.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}): {p.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def _row(config: str, workload: str, level: float, client: dict[str, Any],
         counters: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"config": config, "workload": workload, "level": level}
    for key, src, scale in METRICS:
        v = client.get(src)
        row[key] = float(v) * scale if isinstance(v, (int, float)) else float("nan")
    row["completed"] = int(client.get("completed", 0))
    row["failed"] = int(client.get("failed", 0) or 0)
    row["prompt_tokens"] = counters.get("prompt_tokens", 0.0)
    row["cached_tokens"] = counters.get("prompt_tokens_cached", 0.0)
    row["kvtier"] = {k: counters.get(f"kvtier_{k}", 0.0) for k in KVTIER_COUNTERS}
    return row


def run_load(
    out: Path,
    python: str,
    model_dir: str,
    configs: Iterable[str] = CONFIGS,
    repeats: int = 3,
    settings: EngineSettings | None = None,
    workloads: Workloads | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every repeat runs every configuration (in order; ``second-server``
    right after ``host+redis``, on its Redis) on every workload and level.

    Blocks for the whole run. Returns ``{"settings", "workloads", "trace",
    "runs": [per server and workload level: the client's figures and
    kvtier's counters], "rows": the medians with their ratios}``."""
    settings = settings or EngineSettings()
    w = workloads or Workloads()
    configs = list(configs)
    for c in configs:
        if c not in CONFIGS:
            raise InvalidArgument(f"unknown configuration {c!r}: one of {', '.join(CONFIGS)}")
    if "second-server" in configs and "host+redis" not in configs:
        raise InvalidArgument("second-server runs on host+redis's Redis: name host+redis too")
    for name in w.names:
        if name not in WORKLOADS:
            raise InvalidArgument(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    if repeats < 1:
        raise InvalidArgument("repeats must be >= 1")
    say = progress or (lambda _: None)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-load-"))
    trace_info = None
    trace_file = None
    if "trace" in w.names:
        if w.trace is None:
            raise InvalidArgument("the trace workload needs --trace FILE")
        trace_file = out / "trace-cut.jsonl"
        trace_info = cut_trace(w.trace, trace_file, w.max_requests, w.max_input, w.max_output)
    block_bytes = _kv_bytes_per_block(model_dir, settings.block_size)
    env = {k: v for k, v in os.environ.items()}
    env.update({
        "PYTHONHASHSEED": "0",  # the trace's token expansion hashes strings
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": settings.omp_threads_bind,
    })  # fmt: skip
    runs: list[dict[str, Any]] = []
    redis = None
    try:
        needs_redis = any("redis" in c or c == "second-server" for c in configs)
        # second-server right after host+redis, on the Redis it filled.
        order = [c for c in configs if c != "second-server"]
        if "second-server" in configs:
            order.insert(order.index("host+redis") + 1, "second-server")
        for rep in range(repeats):
            for config in order:
                if config in ("host+redis", "host+disk+redis"):
                    # A fresh Redis for each server that fills one; second-server
                    # reads the one host+redis filled just before it.
                    if redis is not None:
                        redis.stop()
                    redis = _start_redis(work, settings.omp_threads_bind) if needs_redis else None
                url = None if redis is None else f"redis://127.0.0.1:{redis.port}"
                extra = kvtier_extra(config, settings, block_bytes, work / f"r{rep}", url)
                port = _free_port()
                cmd = server_command(python, model_dir, port, config, settings, extra)
                log = out / f"server-{config.replace('+', '_')}-r{rep}.log"
                say(f"repeat {rep + 1}/{repeats}: {config}: starting vllm serve")
                server = Server(cmd, env, log, port)
                try:
                    for workload in w.names:
                        for level in levels(workload, w):
                            before = scrape(server.base_url)
                            res = work / f"client-{config}-{workload}-{level}-r{rep}.json"
                            args = client_args(workload, level, server.base_url, model_dir, w,
                                               trace_file, res)  # fmt: skip
                            say(f"repeat {rep + 1}/{repeats}: {config}: {workload} at {level:g}")
                            client = run_client(python, args, env, res)
                            time.sleep(1.0)  # the last step's metrics reach the front end
                            after = scrape(server.base_url)
                            diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                            row = _row(config, workload, level, client, diff)
                            row["repeat"] = rep
                            row["startup_s"] = server.startup_s
                            runs.append(row)
                finally:
                    server.stop()
                    if extra is not None and "kvtier_disk_path" in extra:
                        shutil.rmtree(extra["kvtier_disk_path"], ignore_errors=True)
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "settings": asdict(settings),
        "workloads": {**asdict(w), "trace": None if w.trace is None else str(w.trace)},
        "trace": trace_info,
        "model": model_dir,
        "block_bytes": block_bytes,
        "repeats": repeats,
        "runs": runs,
        "rows": summarize(runs),
    }


def _start_redis(work: Path, compute_bind: str) -> Any:
    """A local Redis, its threads kept off the engine's compute cores (as a
    deployment keeps the pool's servers off the engine's)."""
    from kvtier.bench.redis_server import RedisServer

    server = RedisServer(work)
    compute = _parse_cpus(compute_bind)
    spare = set(range(os.cpu_count() or 1)) - compute
    if server.proc is not None and compute and spare:
        for tid in os.listdir(f"/proc/{server.proc.pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), spare)
    return server


def _parse_cpus(spec: str) -> set[int]:
    """CPU ids of a VLLM_CPU_OMP_THREADS_BIND value ("0", "0-3,6"); empty
    for "auto" or anything else it cannot read."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return set()
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _median(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else float("nan")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats per (config, workload, level), with ``vs_baseline``
    and ``vs_ideal`` (each metric over that reference's median, same workload
    and level) and ``ttft_reduction_captured`` (the share of the ideal's TTFT
    reduction over the baseline that the configuration reaches, for p50 and
    mean). Pure; rows in first-seen order."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["config"], r["workload"], r["level"]), []).append(r)
    med: dict[tuple[str, str, float], dict[str, Any]] = {}
    for key, rs in groups.items():
        m: dict[str, Any] = {"config": key[0], "workload": key[1], "level": key[2], "runs": len(rs)}
        for name, _, _ in METRICS:
            m[name] = _median([r[name] for r in rs])
        for name in ("completed", "failed", "prompt_tokens", "cached_tokens"):
            m[name] = _median([float(r[name]) for r in rs])
        m["kvtier"] = {k: _median([r["kvtier"][k] for r in rs]) for k in KVTIER_COUNTERS}
        med[key] = m
    for (_, workload, level), m in med.items():
        for ref in ("baseline", "ideal"):
            base = med.get((ref, workload, level))
            m[f"vs_{ref}"] = (
                None if base is None else {
                    name: (m[name] / base[name] if base[name] else float("nan"))
                    for name, _, _ in METRICS
                }
            )  # fmt: skip
        b, i = med.get(("baseline", workload, level)), med.get(("ideal", workload, level))
        if b is not None and i is not None:
            # How much the ideal cuts at all: where it is a few percent, the
            # share captured is noise over a small difference (report it, but
            # the table shows n/a below 10%).
            m["ideal_ttft_reduction"] = {
                stat: (1 - i[k] / b[k] if b[k] else float("nan"))
                for stat, k in (("p50", "ttft_p50_s"), ("mean", "ttft_mean_s"))
            }
            m["ttft_reduction_captured"] = {
                stat: ((b[k] - m[k]) / (b[k] - i[k]) if b[k] != i[k] else float("nan"))
                for stat, k in (("p50", "ttft_p50_s"), ("mean", "ttft_mean_s"))
            }
    return list(med.values())


def table(result: dict[str, Any]) -> str:
    """The report as text: engine settings, then one line per configuration,
    workload and level (medians; ratios to the baseline and the ideal)."""
    s = result["settings"]
    lines = [
        "engine settings (every configuration): " + ", ".join(f"{k}={v}" for k, v in s.items()),
    ]
    if result.get("trace"):
        t = result["trace"]
        lines.append(
            f"trace cut: {t['requests']} requests over {t['span_s']:.0f} s, "
            f"{t['input_tokens']} prompt tokens, {100 * t['reusable_block_share']:.1f}% of "
            "blocks reusable by an unbounded cache"
        )
    lines.append(
        f"{'config':<16}{'workload':<9}{'level':>6}{'req/s':>7}{'out tok/s':>10}"
        f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'tput/base':>10}"
        f"{'TTFT/base':>10}{'TTFT/ideal':>11}{'captured':>9}{'cached':>8}  kvtier loads h/d/r, dropped"
    )
    for r in result["rows"]:
        vb, vi = r.get("vs_baseline") or {}, r.get("vs_ideal") or {}
        cap = r.get("ttft_reduction_captured", {}).get("p50")
        if r.get("ideal_ttft_reduction", {}).get("p50", 0.0) < 0.10:
            cap = None  # the ideal barely beats the baseline here: no share to speak of
        k = r["kvtier"]
        lines.append(
            f"{r['config']:<16}{r['workload']:<9}{r['level']:>6g}{r['throughput_rps']:>7.2f}"
            f"{r['output_tps']:>10.1f}{1e3 * r['ttft_p50_s']:>8.0f}ms{1e3 * r['ttft_p99_s']:>6.0f}ms"
            f"{1e3 * r['tpot_p50_s']:>8.1f}ms{1e3 * r['tpot_p99_s']:>6.1f}ms"
            f"{vb.get('output_tps', float('nan')):>10.2f}{vb.get('ttft_p50_s', float('nan')):>10.2f}"
            f"{vi.get('ttft_p50_s', float('nan')):>11.2f}"
            f"{'n/a' if cap is None or r['config'] in ('baseline', 'ideal') else f'{100 * cap:.0f}%':>9}"
            f"{100 * r['cached_tokens'] / max(1.0, r['prompt_tokens']):>7.0f}%"
            f"  {k['loaded_host']:.0f}/{k['loaded_disk']:.0f}/{k['loaded_remote']:.0f}, "
            f"{k['cascades_dropped']:.0f}"
        )
    return "\n".join(lines)


def report_json(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One object per configuration and level (the issue's keys: ``config``,
    ``level``, ``throughput_rps``, ``output_tps``, ``ttft_p50_s``,
    ``ttft_p99_s``, ``tpot_p50_s``, ``vs_baseline``, ``vs_ideal``), plus the
    workload and the rest of the medians. Pure."""
    return [dict(r) for r in result["rows"]]


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT p50 and output throughput against load, one line per
    configuration, one column per workload (a workload with one level is
    drawn as points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(2, max(1, len(names)), figsize=(5 * max(1, len(names)), 7),
                             squeeze=False)  # fmt: skip
    for col, wl in enumerate(names):
        for config in CONFIGS:
            pts = sorted(
                (r["level"], r) for r in rows if r["workload"] == wl and r["config"] == config
            )
            if not pts:
                continue
            xs = [x for x, _ in pts]
            axes[0][col].plot(xs, [1e3 * r["ttft_p50_s"] for _, r in pts], marker="o", label=config)
            axes[1][col].plot(xs, [r["output_tps"] for _, r in pts], marker="o", label=config)
        xlabel = "time scale" if wl == "trace" else "concurrency"
        axes[0][col].set_title(wl)
        axes[0][col].set_ylabel("TTFT p50 (ms)")
        axes[1][col].set_ylabel("output tokens/s")
        axes[1][col].set_xlabel(xlabel)
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"kvtier under load: vLLM server + vllm bench serve, medians of "
                 f"{result['repeats']} runs")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_trace() -> Path | None:
    """The conversation trace beside a clone of this repository, if there."""
    for up in (*Path(__file__).resolve().parents, *Path.cwd().resolve().parents, Path.cwd()):
        p = up / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
        if p.exists():
            return p
    return None
