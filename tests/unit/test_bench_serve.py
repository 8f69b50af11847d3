"""bench serve's configurations: each one's kvtier settings are settings the
vLLM shim accepts; the streamed one turns promotion and probes off, the
waited one the fenced reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.bench.serve import CONFIGS, _config_spec


def test_every_configuration_is_a_valid_kvtier_config(tmp_path: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.base")
    from kvtier.integrations.vllm import parse_extra_config

    sizes = {"large": 64 << 20, "small": 8 << 20, "tiny": 1 << 20}
    url = "redis://127.0.0.1:6379"
    specs = {c: _config_spec(c, "model", sizes, tmp_path, url) for c in CONFIGS}
    for name, spec in specs.items():
        if spec["mode"] == "kvtier":
            assert parse_extra_config(spec["kvtier"]).given == set(spec["kvtier"]), name
    stream, ahead = specs["host+redis-stream"]["kvtier"], specs["host+redis"]["kvtier"]
    assert stream == {**ahead, "kvtier_promote": False, "kvtier_remote_probe": False}
    assert specs["host+redis-wait"]["kvtier"] == {**ahead, "kvtier_fenced_reads": False}


def test_each_model_kinds_kv_bytes_per_token_and_groups() -> None:
    from kvtier.bench.serve import _kv_layout
    from kvtier.bench.vllm_engine import MODEL_KINDS, model_config

    got = {k: _kv_layout(k, model_config(k)) for k in MODEL_KINDS}
    # float32, every layer as full attention: layers x (K, V) x kv heads x head dim x 4.
    assert got["llama"] == (4 * 2 * 2 * 64 * 4, 1)
    assert got["gemma3"] == (6 * 2 * 2 * 64 * 4, 3)  # two full, four sliding: groups of two
    assert got["mla"] == (4 * (512 + 64) * 4, 1)  # one latent + rope a token and layer
    assert got["hybrid"] == (4 * 2 * 2 * 64 * 4, 2)  # attention and Gated DeltaNet groups


def test_the_hybrid_model_is_refused_under_server_with_the_reason() -> None:
    import argparse

    from kvtier.bench.commands import _cmd_bench_serve_load
    from kvtier.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="needs 544-token blocks in bfloat16"):
        _cmd_bench_serve_load(argparse.Namespace(model_kind="hybrid"))


def test_outputs_are_compared_with_recomputing_and_with_vllms_prefix_cache() -> None:
    from kvtier.bench.serve import _identical, summarize

    def result(outputs: list[list[int]]) -> dict[str, object]:
        reqs = [
            {"id": f"r{i}", "turn": 1 + i, "ttft_s": 0.01, "prompt_tokens": 10,
             "cached_tokens": 5 * i, "output": out}
            for i, out in enumerate(outputs)
        ]  # fmt: skip
        return {"mode": "kvtier", "requests": reqs, "workload_s": 1.0, "startup_s": 1.0}

    none, prefix = result([[1, 2], [3, 4]]), result([[1, 2], [3, 5]])
    same_as_prefix = summarize(result([[1, 2], [3, 5]]), none, prefix)
    different = summarize(result([[1, 2], [3, 6]]), none, prefix)
    assert (same_as_prefix["identical_outputs"], same_as_prefix["identical_to_prefix"]) == (
        False,
        True,
    )
    assert (different["identical_outputs"], different["identical_to_prefix"]) == (False, False)
    assert "identical_to_prefix" not in summarize(result([[1, 2], [3, 4]]), none)
    assert [_identical(m) for m in (
        {"identical_outputs": True}, {"identical_outputs": False, "identical_to_prefix": True},
        {"identical_outputs": False, "identical_to_prefix": False}, {"identical_outputs": False},
    )] == ["yes", "as prefix cache", "NO", "NO"]  # fmt: skip
