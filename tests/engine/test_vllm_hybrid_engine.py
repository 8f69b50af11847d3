"""kvtier serving a hybrid model in vLLM's CPU build: a tiny random
Qwen3-Next (Gated DeltaNet linear attention on layers 0 and 2, full
attention on 1 and 3, a small MoE; bfloat16, which vLLM's CPU GDN kernel
requires), made here with transformers. vLLM sets the attention block to
544 tokens so that an attention page holds a GDN state, and keeps one state
per block ("align" mode, prefix caching on).

A Mamba2 hybrid (NemotronH, Bamba, Granite-4.0-H, Falcon-H1) does not run
here with prefix caching on: vLLM 0.32's CPU chunk scan returns final states
only and its align-mode prefill checkpoint indexes chunk states (IndexError
in mamba_mixer2); Mamba1 (Jamba) has no CPU selective scan at all.

kvtier's hits and outputs must equal vLLM's own prefix cache and
recomputing. With prefix caching off kvtier refuses to start:
tests/integration/test_vllm_hybrid.py checks that against vLLM's own
configuration (both versions), and the MLA refusal in test_vllm_engine.py
that a live engine's start-up runs the check. Runs in the engine's Python
like test_vllm_engine.py (skipped without ``KVTIER_ENGINE_PYTHON``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine.test_vllm_engine import (  # noqa: F401  (engine_python: a fixture)
    _assert_clean,
    _generated_model,
    _outputs,
    engine_python,
    run_engine,
    run_none_and_prefix,
)
from kvtier.bench.serve import HYBRID_BLOCK_TOKENS
from kvtier.bench.vllm_engine import Sessions

pytestmark = pytest.mark.timeout(900)

BLOCK = HYBRID_BLOCK_TOKENS  # vLLM's block: an attention page holds a GDN state
REQUESTS = Sessions(
    sessions=3, system_prompts=1, system_tokens=1200, turns=2, user_tokens=64
).requests()
BASE = {"requests": REQUESTS, "block_size": BLOCK, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def hybrid_model(engine_python: str) -> str:  # noqa: F811
    # kvtier.bench.vllm_engine's "hybrid" kind (HYBRID_MODEL).
    return _generated_model(engine_python, "hybrid")


def test_hybrid_model_loads_prefixes_token_identical_to_recomputing(
    engine_python: str,  # noqa: F811
    hybrid_model: str,
    tmp_path: Path,
) -> None:
    """Hits equal vLLM's own prefix cache, outputs equal recomputing, and
    every chunk loaded came from kvtier's host tier: the attention group's
    chunks of the prefix and the linear-attention group's last one."""
    base = {**BASE, "model": hybrid_model}
    none, prefix = run_none_and_prefix(engine_python, tmp_path / "refs", base)
    hits = {r["id"]: r["cached_tokens"] for r in prefix.requests}
    assert sum(hits.values()) > 0, hits
    assert len({tuple(o) for o in _outputs(none).values()}) > 1
    e = run_engine(
        engine_python, tmp_path / "kvtier",
        {**base, "mode": "kvtier", "kvtier": {"kvtier_host_bytes": "64MiB"}, "pause_s": 0.3},
    )  # fmt: skip
    assert {r["id"]: r["cached_tokens"] for r in e.requests} == hits
    assert _outputs(e) == _outputs(none) == _outputs(prefix)
    # One chunk per block of the attention group, one state per hit.
    chunks = sum(h // BLOCK + (1 if h else 0) for h in hits.values())
    assert e.counters["kvtier"]["loaded_host"] == chunks
    _assert_clean(e)
