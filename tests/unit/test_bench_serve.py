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
            assert set(parse_extra_config(spec["kvtier"])) == set(spec["kvtier"]), name
    stream, ahead = specs["host+redis-stream"]["kvtier"], specs["host+redis"]["kvtier"]
    assert stream == {**ahead, "kvtier_promote": False, "kvtier_remote_probe": False}
    assert specs["host+redis-wait"]["kvtier"] == {**ahead, "kvtier_fenced_reads": False}
