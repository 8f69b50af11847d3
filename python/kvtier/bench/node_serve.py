"""``kvtier bench node``: what a node cache shared by two vLLM servers buys,
and what it keeps across an engine's restart.

A command-line tool: runs in the ``kvtier`` process. Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run: per configuration
one or two ``vllm serve`` processes (vLLM's API server from the engine's
Python; see ``../shared/reference/serving.md``) on a generated tiny Llama,
and for the node configurations a ``kvtier node`` child of this Python.

The workload is a slice of the conversation trace (:func:`cut_trace`'s
sessions cut: every turn of every k-th returning conversation), replayed
one request at a time in arrival order, so a request's time to first token
is its prefill (or load) alone. A trace block (512 tokens, one hash id)
becomes 512 token ids drawn from a generator seeded with the hash id, so
equal ids make equal prefixes on every server. After every request the
serving server's own prefix cache is reset (vLLM's dev endpoint), so a
returning prefix can only come from kvtier. Before every request, in every
configuration, the replay waits :data:`SETTLE_S`: an idle vLLM worker keeps
polling its step queue for a second after its last step (vLLM's
``SpinCondition``, a full core), and on a 2-core machine the other server's
spinning worker stretched a 20 ms load to 100-420 ms (one request right
after the other server's, against 20-25 ms a second later; the spinner was
the only busy thread in /proc over those 0.4 s, 3 December 2026). A machine
with a core per server has no such contention. Every server, when it has
started (also after a restart), answers one throwaway request first
(:func:`_warm`): a process's first request is not what a returning turn
measures.

Configurations (the same total host memory, ``host_bytes``):

- ``none``: two servers, no offloading (the baseline);
- ``split``: two servers, each its own in-process host tier of half;
- ``node``: two servers on one ``kvtier node`` holding all of it;
- ``single``: one server with an in-process host tier of all of it,
  every request sent to it (the upper bound of sharing);
- ``split-restart`` / ``node-restart``: as ``split`` / ``node``, with
  server 1 SIGKILLed (its whole process group) after half the requests and
  started again before the next: its returning turns after the restart are
  compared with the same turns of ``split`` / ``node``.

Two servers sit behind :class:`RoundRobin`: request i goes to server
``i % 2``, so a returning turn lands on the other server about half the
time (the report says how often it did).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.bench.serve import percentile
from kvtier.errors import InvalidArgument

CONFIGS = ("none", "split", "node", "single", "split-restart", "node-restart")
TOKENS_PER_HASH = 512  # the trace's block: one hash id
SETTLE_S = 1.2  # past vLLM's 1 s of worker polling after a step (see above)
FIRST_TOKEN = 16  # token ids below this are the tokenizer's specials


class RoundRobin:
    """Which of ``servers`` serves the next request: 0, 1, ..., n-1, 0, ...
    Pure; the bench's only router (one request at a time, so alternation
    is the whole policy)."""

    def __init__(self, servers: int) -> None:
        if servers < 1:
            raise InvalidArgument(f"a router needs at least one server, got {servers}")
        self.servers = servers
        self._next = 0

    def pick(self) -> int:
        i = self._next
        self._next = (i + 1) % self.servers
        return i


def block_tokens(hash_id: int, vocab: int, n: int = TOKENS_PER_HASH) -> list[int]:
    """The token ids of trace block ``hash_id``: the same on every call and
    in every process (an int-seeded generator, not ``hash()``). Pure."""
    rng = random.Random(hash_id)
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def plan_requests(rows: list[dict[str, Any]], vocab: int, max_tokens: int) -> list[dict[str, Any]]:
    """The replayed requests of a trace cut's rows (in order): id, its
    conversation (its first two hash ids), turn (1 for a conversation's
    first request), prompt token ids (the blocks' tokens cut to
    ``input_length``) and ``max_tokens`` (at most the row's output). Pure."""
    turns: dict[tuple[int, ...], int] = {}
    out = []
    for i, r in enumerate(rows):
        conv = tuple(r["hash_ids"][:2]) if len(r["hash_ids"]) > 1 else (-1, i)
        turns[conv] = turns.get(conv, 0) + 1
        prompt = [t for h in r["hash_ids"] for t in block_tokens(h, vocab)][: r["input_length"]]
        out.append(
            {
                "id": i,
                "conv": list(conv),
                "turn": turns[conv],
                "prompt": prompt,
                "max_tokens": max(1, min(max_tokens, int(r["output_length"]))),
            }
        )
    return out


def distinct_blocks(requests: list[dict[str, Any]], block: int) -> int:
    """Full engine blocks of ``block`` tokens over every prompt, each prefix
    counted once: the working set a cache of every block would hold. Pure."""
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        p = r["prompt"]
        for k in range(1, len(p) // block + 1):
            seen.add(tuple(p[: k * block]))
    return len(seen)


def engine_extra(
    config: str, host_bytes: int, node_socket: str, block: int
) -> dict[str, Any] | None:
    """kvtier's ``kv_connector_extra_config`` for each server of ``config``
    (None: no connector). Pure."""
    if config == "none":
        return None
    if config in ("node", "node-restart"):
        return {"kvtier_node": node_socket, "block_size": block}
    share = host_bytes if config == "single" else host_bytes // 2
    return {"kvtier_host_bytes": share, "block_size": block}


def servers_of(config: str) -> int:
    """How many servers ``config`` runs. Pure."""
    return 1 if config == "single" else 2


def summarize(reqs: list[dict[str, Any]], ref: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One configuration's figures: hit tokens (vLLM's cached prompt tokens;
    with the prefix cache reset after every request, all from kvtier) over
    every request and over returning turns, returning turns' TTFT p50/p90,
    the share of returning turns served by another server than their
    previous turn, outputs identical to ``ref`` (no offloading). Pure."""
    later = [r for r in reqs if r["turn"] > 1]
    ttft = [1e3 * r["ttft_s"] for r in later]
    out: dict[str, Any] = {
        "requests": len(reqs),
        "returning_turns": len(later),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "hit_tokens": sum(r["cached_tokens"] for r in reqs),
        "returning_hit_tokens": sum(r["cached_tokens"] for r in later),
        "returning_prompt_tokens": sum(r["prompt_tokens"] for r in later),
        "ttft_returning_p50_ms": round(percentile(ttft, 0.5), 2),
        "ttft_returning_p90_ms": round(percentile(ttft, 0.9), 2),
        "ttft_first_p50_ms": round(
            percentile([1e3 * r["ttft_s"] for r in reqs if r["turn"] == 1], 0.5), 2
        ),
        "moved_share": round(sum(r["moved"] for r in later) / len(later), 3) if later else 0.0,
    }
    if ref is not None:
        want = {r["id"]: r["output"] for r in ref}
        out["identical_outputs"] = all(want.get(r["id"]) == r["output"] for r in reqs)
    return out


def restart_figures(restarted: list[dict[str, Any]], plain: list[dict[str, Any]]) -> dict[str, Any]:
    """The restarted server's returning turns after its restart against the
    same requests of the run without a restart: hit tokens and TTFT p50,
    each with its ratio. Pure."""
    ids = {r["id"] for r in restarted if r["after_restart"] and r["turn"] > 1}
    a = [r for r in restarted if r["id"] in ids]
    b = [r for r in plain if r["id"] in ids]
    hits_a, hits_b = sum(r["cached_tokens"] for r in a), sum(r["cached_tokens"] for r in b)
    p50_a = percentile([1e3 * r["ttft_s"] for r in a], 0.5)
    p50_b = percentile([1e3 * r["ttft_s"] for r in b], 0.5)
    return {
        "turns": len(ids),
        "hit_tokens": hits_a,
        "hit_tokens_without_restart": hits_b,
        "hit_ratio": round(hits_a / hits_b, 3) if hits_b else float("nan"),
        "ttft_p50_ms": round(p50_a, 2),
        "ttft_p50_without_restart_ms": round(p50_b, 2),
        "ttft_p50_ratio": round(p50_a / p50_b, 3) if p50_b else float("nan"),
    }


def verdict(s: dict[str, dict[str, Any]], restarts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets from the summaries of one run: node's hit tokens
    against single's (within 5%), node's TTFT cut over none against
    split's (at least 1.5x; the cut is none's returning p50 minus the
    configuration's), node-restart's hit ratio (>= 0.95) and TTFT ratio
    (<= 1.10). A figure whose configurations did not run is absent. Pure."""
    v: dict[str, Any] = {}
    if "node" in s and "single" in s and s["single"]["hit_tokens"]:
        r = s["node"]["hit_tokens"] / s["single"]["hit_tokens"]
        v["node_hits_vs_single"] = {"ratio": round(r, 3), "met": r >= 0.95}
    if {"none", "node", "split"} <= s.keys():
        base = s["none"]["ttft_returning_p50_ms"]
        cut_node = base - s["node"]["ttft_returning_p50_ms"]
        cut_split = base - s["split"]["ttft_returning_p50_ms"]
        r = cut_node / cut_split if cut_split > 0 else float("inf")
        v["node_cut_vs_split_cut"] = {
            "ratio": round(r, 3),
            "met": r >= 1.5,
            "speedup_node": round(base / s["node"]["ttft_returning_p50_ms"], 3),
            "speedup_split": round(base / s["split"]["ttft_returning_p50_ms"], 3),
        }
    if "node-restart" in restarts:
        n = restarts["node-restart"]
        v["node_restart"] = {
            "hit_ratio": n["hit_ratio"],
            "ttft_p50_ratio": n["ttft_p50_ratio"],
            "met": n["hit_ratio"] >= 0.95 and n["ttft_p50_ratio"] <= 1.10,
        }
    return v


# ---------------------------------------------------------------- the run


def _complete(base: str, model: str, req: dict[str, Any]) -> tuple[float, int, int, str]:
    """One streamed completion: (TTFT s, cached prompt tokens, prompt tokens,
    output text). Blocks until the last token."""
    body = {
        "model": model,
        "prompt": req["prompt"],
        "max_tokens": req["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    q = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft = None
    text, usage = [], {}
    with urllib.request.urlopen(q, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk["choices"][0].get("text", ""))
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return (
        ttft if ttft is not None else float("nan"),
        int(details.get("cached_tokens") or 0),
        int(usage.get("prompt_tokens", len(req["prompt"]))),
        "".join(text),
    )


def _warm(base: str, model: str, block_tokens: int) -> None:
    """One throwaway request to a server just started, shorter than a block
    (nothing to offload or load), then its prefix cache reset. A started
    server's first request pays its process's one-time costs: a restarted
    server's first returning turn, a full 4,000-token load, took 82.7 ms
    against 29.1 ms for the same turn in the run without the restart, and
    its four other turns 0.77x-1.04x (6 December 2026). Every server of
    every configuration is warmed alike, so the turns compare servers at
    work, not a process's start."""
    _complete(base, model, {"prompt": [FIRST_TOKEN] * (block_tokens // 4), "max_tokens": 1})
    _reset_prefix_cache(base)


def _reset_prefix_cache(base: str) -> None:
    """vLLM's own prefix cache emptied (it refuses while an offload still
    holds blocks: retried for up to 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        q = urllib.request.Request(f"{base}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(q, timeout=30) as r:
            if json.loads(r.read() or b"{}").get("success", True):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}: vLLM's prefix cache would not reset")
        time.sleep(0.05)


def _shm_of(pgid: int) -> set[str]:
    """/dev/shm files mapped by the processes of group ``pgid``."""
    found: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(int(pid)) != pgid:
                continue
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    found.add(path.removesuffix(" (deleted)"))
    return found


class _Node:
    """``kvtier node`` in a child process of this Python."""

    def __init__(self, work: Path, host_bytes: int) -> None:
        from kvtier.node.connection import NodeUnavailable, node_status

        self.socket, self.name = str(work / "node.sock"), f"bench{os.getpid()}"
        cmd = [sys.executable, "-m", "kvtier.cli", "node", "--socket", self.socket]
        cmd += ["--name", self.name, "--host-bytes", str(host_bytes)]
        log = open(work / "node.log", "w")  # noqa: SIM115 (the child owns it)
        self.p = subprocess.Popen(cmd, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            try:
                node_status(self.socket)
                return
            except NodeUnavailable:
                if self.p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvtier node did not start") from None
                time.sleep(0.05)

    def stop(self) -> dict[str, Any]:
        from kvtier.node.connection import node_status

        status: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            status = node_status(self.socket)
        self.p.terminate()
        self.p.wait(30)
        for f in Path("/dev/shm").glob(f"kvnode-{self.name}-*"):
            f.unlink()
        return status


def run_node_bench(
    out: Path,
    python: str,
    trace: Path,
    configs: tuple[str, ...] = CONFIGS,
    max_requests: int = 40,
    max_input: int = 4000,
    max_tokens: int = 4,
    host_share: float = 1.0,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run ``configs`` (``none`` always, first) on one trace cut; the
    JSON-able result: per configuration its summary and requests, the
    restart figures, the targets' verdict. Blocks for the whole run."""
    from kvtier.bench.harness import machine_facts
    from kvtier.bench.serve_load import Server, free_port
    from kvtier.bench.serve_load_plan import (
        EngineSettings,
        cut_trace,
        kv_bytes_per_block,
        server_command,
    )
    from kvtier.bench.vllm_engine import model_config

    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise InvalidArgument(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    for c in configs:
        if c.endswith("-restart") and c.removesuffix("-restart") not in configs:
            raise InvalidArgument(f"{c} is compared with {c.removesuffix('-restart')}: name it too")
    configs = ("none", *(c for c in configs if c != "none"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model-llama"
    subprocess.run(
        [python, "-m", "kvtier.bench.vllm_engine", "make-model", str(model_dir), "llama"],
        check=True,
        capture_output=True,
    )
    vocab = int(model_config("llama")["vocab_size"])
    settings = EngineSettings()
    cut = out / "trace-cut.jsonl"
    info = cut_trace(trace, cut, max_requests, max_input, 10**6)
    rows = [json.loads(line) for line in cut.read_text().splitlines()]
    requests = plan_requests(rows, vocab, max_tokens)
    block_bytes = kv_bytes_per_block(str(model_dir), settings.block_size)
    working = distinct_blocks(requests, settings.block_size)
    host_bytes = int(working * block_bytes * host_share)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-node-"))
    raw: dict[str, list[dict[str, Any]]] = {}
    nodes: dict[str, dict[str, Any]] = {}
    try:
        for config in configs:
            say(f"{config}: starting {servers_of(config)} server(s)")
            tools = (Server, free_port, server_command, say)
            raw[config], nodes[config] = _run_config(
                config, requests, python, str(model_dir), settings, host_bytes, work, out, *tools
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summaries = {c: summarize(r, raw["none"]) for c, r in raw.items()}
    restarts = {
        c: restart_figures(raw[c], raw[c.removesuffix("-restart")])
        for c in raw
        if c.endswith("-restart")
    }
    return {
        "component": "node",
        "configs": list(configs),
        "workload": {
            "trace": str(trace),
            "cut": info,
            "max_tokens": max_tokens,
            "replay": "one request at a time, in arrival order; prefix cache reset after each; "
            f"{SETTLE_S} s idle before each (vLLM workers poll 1 s after a step)",
            "working_set_blocks": working,
            "block_tokens": settings.block_size,
            "block_bytes": block_bytes,
            "host_bytes_total": host_bytes,
            "host_share_of_working_set": host_share,
        },
        "model": dict(model_config("llama"), kind="llama", dtype="float32"),
        "summaries": summaries,
        "restarts": restarts,
        "verdict": verdict(summaries, restarts),
        "node_status_at_end": nodes,
        "requests": {
            c: [{k: v for k, v in r.items() if k not in ("prompt", "output")} for r in rs]
            for c, rs in raw.items()
        },
        "machine": machine_facts(),
    }


def _run_config(
    config: str,
    requests: list[dict[str, Any]],
    python: str,
    model_dir: str,
    settings: Any,
    host_bytes: int,
    work: Path,
    out: Path,
    server_cls: Any,
    free_port: Callable[[], int],
    server_command: Callable[..., list[str]],
    say: Callable[[str], None],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One configuration's servers (and node), the replay, the restart."""
    node = _Node(work, host_bytes) if config.startswith("node") else None
    extra = engine_extra(config, host_bytes, node.socket if node else "", settings.block_size)
    n = servers_of(config)

    def start(i: int) -> Any:
        env = dict(os.environ)
        env.update(
            {
                "PYTHONHASHSEED": "0",  # every engine's block hashes agree
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(i % 2),  # one core each
            }
        )
        cmd = server_command(python, model_dir, port := free_port(), "host", settings, extra)
        cmd.append("--enable-prompt-tokens-details")
        log = out / f"server-{config}-{i}.log"
        server = server_cls(cmd, env, log, port)
        _warm(server.base_url, model_dir, settings.block_size)
        return server

    servers: list[Any] = []
    try:
        with ThreadPoolExecutor(n) as pool:
            servers = list(pool.map(start, range(n)))
        router = RoundRobin(n)
        last_server: dict[tuple[int, ...], int] = {}
        restart_at = len(requests) // 2 if config.endswith("-restart") else -1
        done: list[dict[str, Any]] = []
        for k, req in enumerate(requests):
            time.sleep(SETTLE_S)
            if k == restart_at:
                say(f"{config}: SIGKILL of server 1, started again")
                pgid = servers[1].proc.pid
                shm = _shm_of(pgid)
                os.killpg(pgid, signal.SIGKILL)
                servers[1].proc.wait()
                servers[1].stop()
                for f in shm:  # the killed engine's own pools: no one unlinks them
                    if not Path(f).name.startswith("kvnode-"):
                        with contextlib.suppress(OSError):
                            os.unlink(f)
                servers[1] = start(1)
            i = router.pick()
            ttft, cached, prompt_tokens, text = _complete(servers[i].base_url, model_dir, req)
            _reset_prefix_cache(servers[i].base_url)
            conv = tuple(req["conv"])
            done.append(
                {
                    **req,
                    "server": i,
                    "moved": conv in last_server and last_server[conv] != i,
                    "after_restart": 0 <= restart_at <= k and i == 1,
                    "ttft_s": ttft,
                    "cached_tokens": cached,
                    "prompt_tokens": prompt_tokens,
                    "output": text,
                }
            )
            last_server[conv] = i
        return done, (node.stop() if node else {})
    finally:
        for s in servers:
            s.stop()
        if node is not None:
            with contextlib.suppress(Exception):
                node.stop()


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per configuration, then the restart comparisons."""
    rows = [
        "| configuration | servers | hit tokens (all) | hit tokens (returning) / prompt "
        "| returning TTFT p50 / p90 (ms) | vs none p50 | returning turns moved | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    s = result["summaries"]
    base = s["none"]["ttft_returning_p50_ms"]
    for name, m in s.items():
        rows.append(
            f"| {name} | {servers_of(name)} | {m['hit_tokens']} "
            f"| {m['returning_hit_tokens']} / {m['returning_prompt_tokens']} "
            f"| {m['ttft_returning_p50_ms']:.1f} / {m['ttft_returning_p90_ms']:.1f} "
            f"| {m['ttft_returning_p50_ms'] / base:.2f} | {m['moved_share']:.2f} "
            f"| {'yes' if m.get('identical_outputs', True) else 'NO'} |"
        )
    if result["restarts"]:
        rows += [
            "",
            "| restart | turns after it | hit tokens vs without | TTFT p50 (ms) vs without |",
            "|---|---|---|---|",
        ]
        for name, r in result["restarts"].items():
            rows.append(
                f"| {name} | {r['turns']} | {r['hit_tokens']} / {r['hit_tokens_without_restart']}"
                f" = {r['hit_ratio']:.2f} | {r['ttft_p50_ms']:.1f} / "
                f"{r['ttft_p50_without_restart_ms']:.1f} = {r['ttft_p50_ratio']:.2f} |"
            )
    return "\n".join(rows)
