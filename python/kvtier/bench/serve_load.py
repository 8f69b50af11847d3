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

This module starts and stops the server, runs the client, reads the
server's metrics and drives the run (:func:`run_load`). The configurations,
workloads and command lines are in :mod:`kvtier.bench.serve_load_plan`, the
medians, table and plot in :mod:`kvtier.bench.serve_load_report`; every
name this module had before that split is still importable from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.bench.serve_load_plan import (
    CONFIGS,
    KVTIER_COUNTERS,
    METRICS,
    TRACE_BLOCK,
    WORKLOADS,
    EngineSettings,
    Workloads,
    client_args,
    cut_trace,
    default_trace,
    kv_bytes_per_block,
    kvtier_extra,
    levels,
    server_command,
)
from kvtier.bench.serve_load_report import plot, report_json, summarize, table
from kvtier.errors import InvalidArgument

__all__ = [
    "CONFIGS",
    "KVTIER_COUNTERS",
    "METRICS",
    "TRACE_BLOCK",
    "WORKLOADS",
    "EngineSettings",
    "Run",
    "Server",
    "Workloads",
    "client_args",
    "cut_trace",
    "default_trace",
    "kvtier_extra",
    "levels",
    "parse_metrics",
    "plot",
    "report_json",
    "run_client",
    "run_load",
    "scrape",
    "server_command",
    "summarize",
    "table",
]


@dataclass
class Run:
    """One server: its configuration, its log and its per-workload results."""

    config: str
    repeat: int
    results: list[dict[str, Any]] = field(default_factory=list)
    startup_s: float = 0.0
    error: str | None = None


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

    def __init__(
        self, cmd: list[str], env: dict[str, str], log: Path, port: int, timeout_s: float = 300.0
    ) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        t0 = time.perf_counter()
        self._f = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
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


def free_port() -> int:
    from kvtier.bench.redis_server import free_port

    return free_port()


def run_client(
    python: str, args: list[str], env: dict[str, str], result: Path, timeout_s: float = 1800.0
) -> dict[str, Any]:
    """Run vLLM's benchmark client to the end; its saved result."""
    p = subprocess.run(
        [python, "-c", _CLIENT, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if p.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}): {p.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def _row(
    config: str, workload: str, level: float, client: dict[str, Any], counters: dict[str, float]
) -> dict[str, Any]:
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
    """Every repeat runs every configuration (in :func:`repeat_order`) on
    every workload and level.

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
        trace_info = cut_trace(
            w.trace,
            trace_file,
            w.max_requests,
            w.max_input,
            w.max_output,
            mode=w.trace_cut,
            rate=w.trace_rate,
        )
        # The client asks for as many as the cut holds (a short trace holds fewer).
        w = replace(w, max_requests=trace_info["requests"])
    block_bytes = kv_bytes_per_block(model_dir, settings.block_size)
    env = {k: v for k, v in os.environ.items()}
    env.update(
        {
            "PYTHONHASHSEED": "0",  # the trace's token expansion hashes strings
            "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": settings.omp_threads_bind,
        }
    )
    runs: list[dict[str, Any]] = []
    redis = None
    try:
        needs_redis = any("redis" in c or c == "second-server" for c in configs)
        for rep in range(repeats):
            for config in repeat_order(configs, rep):
                if config in ("host+redis", "host+disk+redis"):
                    # A fresh Redis for each server that fills one; second-server
                    # reads the one host+redis filled just before it.
                    if redis is not None:
                        redis.stop()
                    redis = _start_redis(work, settings.omp_threads_bind) if needs_redis else None
                url = None if redis is None else f"redis://127.0.0.1:{redis.port}"
                extra = kvtier_extra(config, settings, block_bytes, work / f"r{rep}", url)
                port = free_port()
                cmd = server_command(python, model_dir, port, config, settings, extra)
                log = out / f"server-{config.replace('+', '_')}-r{rep}.log"
                say(f"repeat {rep + 1}/{repeats}: {config}: starting vllm serve")
                server = Server(cmd, env, log, port)
                try:
                    for workload in w.names:
                        for level in levels(workload, w):
                            before = scrape(server.base_url)
                            res = work / f"client-{config}-{workload}-{level}-r{rep}.json"
                            args = client_args(
                                workload, level, server.base_url, model_dir, w, trace_file, res
                            )
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


def repeat_order(configs: Sequence[str], rep: int) -> list[str]:
    """The order repeat ``rep`` runs ``configs`` in: rotated by one place a
    repeat, so that over as many repeats as configurations each one runs
    once in every position (a fixed order gave the baseline, always first, a
    bias of its own: 5% under the connector floor at concurrency 4 in one
    run); ``second-server`` right after ``host+redis``, on the Redis it
    filled. Pure."""
    order = [c for c in configs if c != "second-server"]
    k = rep % len(order) if order else 0
    order = order[k:] + order[:k]
    if "second-server" in configs:
        order.insert(order.index("host+redis") + 1, "second-server")
    return order


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
