"""What ``kvtier bench serve --server`` runs: its configurations, engine
settings and workloads, the trace cut, and the command lines of the server
and the client for each.

Configurations (the names in the report), all with the same engine
settings (printed in the report):

- ``baseline``: vLLM's prefix cache only, a KV cache smaller than the
  working set (what users have);
- ``ideal``: the same with a KV cache that holds the whole working set;
- ``connector-floor``: the baseline with a KV connector that moves nothing
  (:mod:`kvtier.bench.null_connector`): the cost vLLM's connector plumbing
  puts on every connector, the floor under kvtier's cost on zero reuse;
- ``host``, ``host+disk``, ``host+redis``, ``host+disk+redis``: kvtier
  (``KVTierConnector``) over the baseline's small KV cache; ``host`` holds
  the working set, the others a third of it with the lower tiers behind;
- ``second-server``: a new server (empty host tier) on the Redis that
  ``host+redis`` filled in the same repeat: what a second engine of a fleet
  gets from the shared pool.

Workloads: ``trace`` (a Mooncake-format trace cut to ``max_requests``:
by default every turn of every k-th conversation that returns within its
first 10 minutes, their arrivals scaled to ``trace_rate``; capped to the
model's length, replayed with the client's ``timed_trace`` dataset on the
cut's timestamps times ``time_scale``), ``prefix`` (the client's
``prefix_repetition``) and ``random`` (zero reuse), the last two at each
of ``concurrencies``, and ``prefix-rate``: shared prefixes again, three
times as many prompts and prefixes, sent at each of ``rates`` (requests per
second, seeded Poisson arrivals). A closed loop of a few clients locks
into whichever rhythm its first completions set (hits batched beside a
miss's prefill or on their own), so its TTFT p50 jumps between two modes
from run to run, the ideal's included; open-loop arrivals are the same
instants in every configuration, and a rate the engine keeps up with
leaves only what each configuration's service time adds. Every workload's prompts are the same in every
configuration and repeat (fixed seeds, ``PYTHONHASHSEED`` pinned for the
trace's token expansion), so the second server asks for what the first
stored.

A command-line tool's module: runs in the ``kvtier`` process. Who calls:
:func:`kvtier.bench.serve_load.run_load`, :mod:`kvtier.bench.commands`
and the tests. Pure but for :func:`cut_trace` and :func:`default_trace`,
which block on reading (and writing) a trace file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgument

CONFIGS = (
    "baseline",
    "ideal",
    "connector-floor",
    "host",
    "host+disk",
    "host+redis",
    "host+disk+redis",
    "second-server",
)
# The baseline's engine with a KV connector that moves nothing
# (kvtier.bench.null_connector): what any connector costs.
FLOOR_CONNECTOR = {
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "kvtier.bench.null_connector",
    "kv_role": "kv_both",
}
WORKLOADS = ("trace", "prefix", "prefix-rate", "random")
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
    "loaded_host",
    "loaded_disk",
    "loaded_remote",
    "cascades",
    "cascades_dropped",
    "allocation_failures",
    "promotions",
    "load_failures",
)


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
    lower_writes: str = "on_store"  # kvtier_lower_writes of every kvtier configuration


@dataclass(frozen=True)
class Workloads:
    """The three workloads' shapes (the defaults keep this machine's engine
    busy, not drowning: a run is about 2 minutes a configuration)."""

    trace: Path | None = None
    trace_cut: str = "sessions"  # cut_trace's mode
    # The sessions cut arrives at this mean rate at time scale 1: what this
    # machine's engine serves busy but without a queue (see the README).
    trace_rate: float = 1.0
    time_scale: float = 1.0
    max_requests: int = 60
    max_input: int = 3072
    max_output: int = 32
    concurrencies: tuple[int, ...] = (1, 4)
    prefix_len: int = 1536
    prefix_suffix_len: int = 128
    prefix_count: int = 12
    prefix_prompts: int = 36
    random_input: int = 1024
    # 16 prompts made a 1.6 s run at concurrency 4: run-to-run spread was
    # 0.85-1.06 of the baseline for a connector that moves nothing; 64 make
    # each run 6-12 s and the do-no-harm ratios comparable.
    random_prompts: int = 64
    output_len: int = 32
    # prefix-rate: measured on this machine's engine, 4 requests/s keeps it
    # busy without a queue (the ideal's TTFT p50 29 ms in two runs, the
    # baseline's 128); at 8/s it ran 8 requests at once and queued.
    rates: tuple[float, ...] = (4.0,)
    rate_prefix_count: int = 36
    rate_prompts: int = 108
    names: tuple[str, ...] = WORKLOADS


def _read_trace(src: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The requests of a Mooncake-format trace (the first ``limit``, or
    all), in file order; clear errors for a line that is not one."""
    out: list[dict[str, Any]] = []
    with open(src) as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append(
                    {
                        "timestamp": float(r["timestamp"]),
                        "input_length": int(r["input_length"]),
                        "output_length": int(r["output_length"]),
                        "hash_ids": [int(h) for h in r["hash_ids"]],
                    }
                )
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidArgument(
                    f"{src}:{n}: not a Mooncake-format trace line (timestamp, input_length, "
                    f"output_length, hash_ids): {e}"
                ) from None
    if not out:
        raise InvalidArgument(f"{src}: no requests")
    return out


def _conversation(r: dict[str, Any], i: int) -> tuple[int, ...]:
    """The conversation of request ``i``: its first two blocks (a one-block
    request is its own)."""
    return tuple(r["hash_ids"][:2]) if len(r["hash_ids"]) > 1 else (-1, i)


def _returning_sessions(
    reqs: list[dict[str, Any]], max_requests: int, window_s: float
) -> list[dict[str, Any]]:
    """Every turn of every k-th conversation that returns within the trace's
    first ``window_s`` seconds, in arrival order, k the smallest stride that
    gives at most ``max_requests`` turns. A conversation: the requests whose
    first two blocks are the same (the trace's shared system block, then the
    conversation's first own block). Striding spreads the first turns over
    the window (the first conversations alone start in a burst of misses
    that queues every configuration alike) and keeps other conversations'
    prompts between a conversation's turns (on the conversation trace 11 of
    them at the median, more than the baseline's KV cache holds)."""
    end = min(r["timestamp"] for r in reqs) + 1000 * window_s
    convs: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(reqs):
        if r["timestamp"] < end:
            convs.setdefault(_conversation(r, i), []).append(i)
    returning = sorted(
        (t for t in convs.values() if len(t) > 1), key=lambda t: reqs[t[0]]["timestamp"]
    )
    picked: list[int] = []
    for k in range(1, len(returning) + 1):
        picked = [i for turns in returning[::k] for i in turns]
        if len(picked) <= max_requests:
            break
    picked.sort(key=lambda i: (reqs[i]["timestamp"], i))
    return [reqs[i] for i in picked[:max_requests]]


def cut_trace(
    src: Path,
    dst: Path,
    max_requests: int,
    max_input: int,
    max_output: int,
    mode: str = "sessions",
    rate: float = 1.0,
    window_s: float = 600.0,
) -> dict[str, Any]:
    """Write a cut of a Mooncake-format trace to ``dst``: prompts capped to
    ``max_input`` tokens (their hash ids cut to match), outputs to
    ``max_output``, timestamps rebased to the first.

    ``mode`` ``"sessions"``: every turn of conversations that return within
    the first ``window_s`` seconds (:func:`_returning_sessions`), at most
    ``max_requests``, their timestamps scaled so that the cut arrives at
    ``rate`` requests a second on average (its gaps keep their shape; the
    trace's own minutes between turns would make one run last an hour).
    ``"head"``: the first ``max_requests`` requests on the trace's own
    clock, which on the conversation trace are mostly first turns whose
    next turns come after the cut. Returns what the cut holds: requests, conversations (sessions),
    span at time scale 1, the trace's own span, tokens and the share of
    512-token blocks an unbounded cache would serve. Blocks on reading the
    whole trace."""
    if mode not in ("sessions", "head"):
        raise InvalidArgument(f"trace cut {mode!r}: one of sessions, head")
    if not rate > 0 or rate == float("inf"):
        raise InvalidArgument(f"trace rate must be positive and finite, got {rate}")
    if mode == "sessions":
        cut = _returning_sessions(_read_trace(src), max_requests, window_s)
    else:
        cut = _read_trace(src, max_requests)
    if not cut:
        raise InvalidArgument(
            f"{src}: no conversation returns (a second request on its first blocks)"
        )
    t0 = cut[0]["timestamp"]
    trace_span_ms = cut[-1]["timestamp"] - t0
    scale = 1.0
    if mode == "sessions" and len(cut) > 1 and trace_span_ms > 0:
        scale = (len(cut) - 1) / rate * 1000 / trace_span_ms
    out = []
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in cut:
        inp = min(r["input_length"], max_input)
        ids = r["hash_ids"][: max(1, math.ceil(inp / TRACE_BLOCK))]
        out.append(
            {
                "timestamp": round((r["timestamp"] - t0) * scale, 3),
                "input_length": inp,
                "output_length": max(1, min(r["output_length"], max_output)),
                "hash_ids": ids,
            }
        )
        prefix_ok = True
        for i in range(len(ids)):
            key = tuple(ids[: i + 1])
            total += 1
            prefix_ok = prefix_ok and key in seen
            hit += prefix_ok
            seen.add(key)
    dst.write_text("".join(json.dumps(r) + "\n" for r in out))
    return {
        "mode": mode,
        "requests": len(out),
        "sessions": len({_conversation(r, i) for i, r in enumerate(cut)})
        if mode == "sessions"
        else None,
        "span_s": out[-1]["timestamp"] / 1000,
        "trace_span_s": trace_span_ms / 1000,
        "input_tokens": sum(r["input_length"] for r in out),
        "reusable_block_share": hit / total if total else 0.0,
    }


def kv_bytes_per_block(model_dir: str, block_size: int) -> int:
    """Bytes of one engine block of the model's KV cache (float32 K and V, every layer)."""
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
    if config in ("baseline", "ideal", "connector-floor"):
        return None
    whole = settings.large_blocks * block_bytes
    kv: dict[str, Any] = {"block_size": settings.block_size}
    kv["kvtier_host_bytes"] = whole if config == "host" else whole // 3
    if "disk" in config:
        kv["kvtier_disk_path"] = str(workdir / f"disk-{config}")
        kv["kvtier_disk_bytes"] = 2 * whole
    if settings.lower_writes != "on_store":
        kv["kvtier_lower_writes"] = settings.lower_writes
    if "redis" in config or config == "second-server":
        if redis_url is None:
            raise InvalidArgument(f"{config} needs a Redis server")
        kv["kvtier_remote_url"] = redis_url
    return kv


def server_command(
    python: str,
    model_dir: str,
    port: int,
    config: str,
    settings: EngineSettings,
    extra: dict[str, Any] | None,
) -> list[str]:
    """The ``vllm serve`` command line of a configuration (the CPU build's
    console script cannot start; its module does)."""
    blocks = settings.large_blocks if config == "ideal" else settings.small_blocks
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(settings.block_size),
        "--enforce-eager",
        "--seed",
        "0",
        "--max-model-len",
        str(settings.max_model_len),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--enable-chunked-prefill",
        "--enable-prefix-caching",
        "--num-gpu-blocks-override",
        str(blocks),
    ]
    if config == "connector-floor":
        cmd += ["--kv-transfer-config", json.dumps(FLOOR_CONNECTOR)]
    elif extra is not None:
        cmd += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "KVTierConnector",
                    "kv_connector_module_path": "kvtier.integrations.vllm_connector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                }
            ),
        ]
    return cmd


def client_args(
    workload: str,
    level: int | float,
    base_url: str,
    model_dir: str,
    w: Workloads,
    trace_file: Path | None,
    result: Path,
) -> list[str]:
    """``vllm bench serve`` flags of one workload at one level (concurrency;
    for the trace, the time scale)."""
    args = [
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        model_dir,
        # Each workload and level its own prompts: the client's datasets draw
        # their token offsets from the same generator, so equal seeds would
        # make a random prompt repeat a prefix_repetition one, and a level hit
        # what an earlier level left cached.
        "--tokenizer",
        model_dir,
        "--seed",
        str(_SEEDS.get(workload, 0) + int(level * 1000)),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]
    if workload == "trace":
        assert trace_file is not None
        args += [
            "--dataset-name",
            "timed_trace",
            "--dataset-path",
            str(trace_file),
            "--num-prompts",
            str(w.max_requests),
            "--timed-trace-chunk-hash-size",
            str(TRACE_BLOCK),
            "--timed-trace-sec-multiplier",
            str(0.001 * float(level)),
            "--timed-trace-label-timestamp",
            "timestamp",
            "--timed-trace-label-input-length",
            "input_length",
            "--timed-trace-label-output-length",
            "output_length",
            "--timed-trace-label-hash-ids",
            "hash_ids",
        ]
    elif workload in ("prefix", "prefix-rate"):
        closed = workload == "prefix"
        args += [
            "--dataset-name",
            "prefix_repetition",
            "--num-prompts",
            str(w.prefix_prompts if closed else w.rate_prompts),
            "--prefix-repetition-prefix-len",
            str(w.prefix_len),
            "--prefix-repetition-suffix-len",
            str(w.prefix_suffix_len),
            "--prefix-repetition-num-prefixes",
            str(w.prefix_count if closed else w.rate_prefix_count),
            "--prefix-repetition-output-len",
            str(w.output_len),
            "--ignore-eos",
        ]
        # Open loop: the client seeds its arrival draws with --seed, so
        # the same instants in every configuration.
        args += (
            ["--max-concurrency", str(int(level))]
            if closed
            else ["--request-rate", f"{float(level):g}", "--burstiness", "1"]
        )
    elif workload == "random":
        args += [
            "--dataset-name",
            "random",
            "--num-prompts",
            str(w.random_prompts),
            "--random-input-len",
            str(w.random_input),
            "--random-output-len",
            str(w.output_len),
            "--random-range-ratio",
            "0",
            "--max-concurrency",
            str(int(level)),
        ]
    else:
        raise InvalidArgument(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
    return args + [
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


_SEEDS = {"trace": 0, "prefix": 5_000_000, "prefix-rate": 6_000_000, "random": 7_000_000}


def levels(workload: str, w: Workloads) -> list[float]:
    """The load levels of a workload, lightest first: the trace's time
    scale, prefix-rate's request rates, the others' concurrencies."""
    if workload == "trace":
        return [w.time_scale]
    if workload == "prefix-rate":
        return sorted(float(r) for r in w.rates)
    return [float(c) for c in w.concurrencies]


def default_trace() -> Path | None:
    """The conversation trace beside a clone of this repository, if there."""
    for up in (*Path(__file__).resolve().parents, *Path.cwd().resolve().parents, Path.cwd()):
        p = up / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
        if p.exists():
            return p
    return None
