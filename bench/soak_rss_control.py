"""Whose is the serving soak's RSS growth? (issue 52: vLLM's worker process
grew from 679 MiB to 1,470 MiB over the 30-minute serving soak.)

A command-line tool (its own process; blocks for ``--minutes`` plus a server
start); run by hand from the repository root with kvtier's venv:

    .venv/bin/python bench/soak_rss_control.py kvtier --minutes 6 --cpu-defaults
    .venv/bin/python bench/soak_rss_control.py baseline --minutes 6 --cpu-defaults
    .venv/bin/python bench/soak_rss_control.py baseline --minutes 5

It starts the serving soak's server (``kvtier bench soak --server``'s model,
sizes and settings, its ``CPU_MEMORY_ENV`` included unless
``--cpu-defaults``) with kvtier on host + disk + Redis (``kvtier``), on the
host tier alone (``host``), or without kvtier (``baseline``: vLLM's prefix
cache only), drives it with the soak's open-loop client and workload (the
same seed: the same requests at the same rate) and no fault, and samples the
engine core's and the worker's RSS every 15 s, split into anonymous,
file-backed and shared memory (``/proc/PID/status``). ``--env K=V`` adds to
the server's environment (an allocator setting, ``LD_PRELOAD``). Writes the
samples as JSON (``--out``, default ``build/soak-rss-control``) and prints
each sample as it is taken, oldest first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.proc_tree import process_tree
from kvtier.bench.redis_server import RedisServer
from kvtier.bench.serve_load_plan import kv_bytes_per_block
from kvtier.bench.soak_server import CPU_MEMORY_ENV, ServerSoakConfig, server_env, start_soak_server
from kvtier.bench.soak_server_client import OpenLoop, Workload

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _memory(pid: int) -> dict[str, Any]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    f = dict(line.split(":", 1) for line in lines if ":" in line)
    return {"name": f["Name"].strip(), **{k: int(f[k].split()[0]) >> 10 for k in FIELDS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["kvtier", "host", "baseline"])
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--python", default=str(REPO / ".venv-engine" / "bin" / "python"))
    ap.add_argument("--env", action="append", default=[], help="K=V for the server (repeatable)")
    ap.add_argument(
        "--cpu-defaults",
        action="store_true",
        help="without the soak's CPU_MEMORY_ENV (oneDNN's and glibc's defaults, as before 28 Nov)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "build" / "soak-rss-control")
    args = ap.parse_args(argv)
    cfg = ServerSoakConfig(minutes=args.minutes, kinds=())
    work = Path(tempfile.mkdtemp(prefix="kvtier-rss-control-"))
    model = work / "model"
    subprocess.run(
        [args.python, "-m", "kvtier.bench.vllm_engine", "make-model", str(model)],
        check=True,
        capture_output=True,
    )
    block = kv_bytes_per_block(str(model), 32)
    redis = None
    extra: dict[str, Any] | None = None
    if args.mode != "baseline":
        extra = {"block_size": 32, "kvtier_host_bytes": cfg.host_blocks * block}
    if args.mode == "kvtier":
        (work / "disk").mkdir()
        redis = RedisServer(work, maxmemory=cfg.redis_maxmemory)
        extra = {
            **(extra or {}),
            "kvtier_disk_path": str(work / "disk"),
            "kvtier_disk_bytes": cfg.disk_bytes,
            "kvtier_remote_url": redis.url,
        }
    env = server_env()
    if args.cpu_defaults:
        for k in CPU_MEMORY_ENV:
            if k not in os.environ:
                env.pop(k)
    env.update(kv.split("=", 1) for kv in args.env)
    server = start_soak_server(args.python, str(model), cfg, extra, work / "server.log", env)
    samples: list[dict[str, Any]] = []
    try:
        port = int(server.base_url.rsplit(":", 1)[1])
        client = OpenLoop("127.0.0.1", port, str(model))
        workload = Workload(seed=cfg.seed, max_tokens=cfg.max_tokens)
        arrivals = random.Random(cfg.seed + 2)
        t0 = time.time()
        next_arrival = next_sample = t0
        while (now := time.time()) - t0 < cfg.total_s:
            while next_arrival <= now:
                client.start(workload.next(client.busy()))
                next_arrival += arrivals.expovariate(cfg.rate)
            if now >= next_sample:
                row: dict[str, Any] = {"at_s": round(now - t0)}
                for p in process_tree(server.proc.pid):
                    try:
                        m = _memory(p)
                    except (OSError, KeyError):
                        continue  # ended meanwhile
                    if m["name"].startswith("VLLM::"):
                        row[m["name"]] = m
                samples.append(row)
                print(json.dumps(row), flush=True)
                next_sample += 15.0
            time.sleep(0.02)
        client.join(120)
    finally:
        server.stop()
        if redis is not None:
            redis.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.mode}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps({"mode": args.mode, "env": args.env, "samples": samples}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
