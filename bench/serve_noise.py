"""How finely can this machine tell two serving configurations apart?
(issue 32, the do-no-harm target: >= 0.97x of the baseline's throughput).

A command-line tool (its own process, blocks for about ten minutes); run by
hand from the repository root with the engine's Python, after ``kvtier bench
serve --server`` made its model (``build/bench-serve-load/model-llama``):

    .venv-engine/bin/python bench/serve_noise.py [--runs 5] [--out DIR]

Two measurements, nothing of kvtier's in either:

1. the machine itself: a single-threaded 512x512 float32 matmul counted in
   back-to-back 3-second windows (the spread of a CPU's speed over time);
2. one ``baseline`` server (``kvtier bench serve --server``'s settings,
   vLLM's prefix cache only), driven ``--runs`` times back to back by vLLM's
   own client with exactly the same arguments: zero reuse (``random``) at
   concurrency 1 and 4 (the do-no-harm rows) and open loop at 12 requests/s
   (past this engine's capacity: the throughput is the capacity).

Any two of those runs differ only by time, so the ratio of consecutive
identical runs is what a configuration that costs nothing shows against
the baseline. The JSON (``--out``, default ``build/bench-serve-noise``) has
every run; the printed table each mode's range and those ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.serve_load import Server, free_port, run_client
from kvtier.bench.serve_load_plan import EngineSettings, Workloads, client_args, server_command

MODES = (("closed c=1", 1, None, None), ("closed c=4", 4, None, None), ("open 12/s", 4, 12.0, 128))


def machine_windows(n: int, seconds: float = 3.0) -> list[int]:
    """Matmuls of one thread per window (blocks n * seconds)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    counts = []
    for _ in range(n):
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            a @ b
            k += 1
        counts.append(k)
    return counts


def spread(values: list[float]) -> dict[str, Any]:
    """Median, range relative to the median, and the ratios of consecutive values."""
    med = statistics.median(values)
    pairs = [b / a for a, b in itertools.pairwise(values)]
    return {"values": values, "median": med, "min_rel": min(values) / med, "max_rel": max(values) / med,
            "consecutive_ratios": pairs}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default="build/bench-serve-noise")
    p.add_argument("--model", default="build/bench-serve-load/model-llama")
    a = p.parse_args()
    if a.runs < 2:
        p.error("--runs: at least 2")
    model = Path(a.model).resolve()
    if not (model / "config.json").exists():
        p.error(f"--model {model}: no model there (run kvtier bench serve --server once)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "machine_matmuls_per_3s": spread([float(c) for c in machine_windows(10)])
    }
    s, w = EngineSettings(), Workloads()
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE=str(s.kv_cache_space_gib),
               VLLM_CPU_OMP_THREADS_BIND=s.omp_threads_bind)  # fmt: skip
    port = free_port()
    server = Server(server_command(sys.executable, str(model), port, "baseline", s, None), env,
                    out / "server-baseline.log", port)  # fmt: skip
    try:
        for name, conc, rate, prompts in MODES:
            tps = []
            for k in range(a.runs):
                res = out / f"client-{name.replace(' ', '_').replace('/', '')}-{k}.json"
                args = client_args("random", conc, server.base_url, str(model), w, None, res)
                if rate is not None:
                    i = args.index("--max-concurrency")
                    args[i : i + 2] = ["--request-rate", f"{rate:g}", "--burstiness", "1"]
                if prompts is not None:
                    args[args.index("--num-prompts") + 1] = str(prompts)
                tps.append(float(run_client(sys.executable, args, env, res)["output_throughput"]))
                print(f"  {name} run {k + 1}/{a.runs}: {tps[-1]:.1f} output tok/s", flush=True)
            result[name] = spread(tps)
    finally:
        server.stop()
    path = out / f"serve-noise-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for name, r in result.items():
        ratios = r["consecutive_ratios"]
        print(f"{name:24s} median {r['median']:8.1f}  range {r['min_rel']:.2f}-{r['max_rel']:.2f} of it;"
              f"  consecutive identical runs' ratios {min(ratios):.2f}-{max(ratios):.2f}")  # fmt: skip
    print(f"  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
