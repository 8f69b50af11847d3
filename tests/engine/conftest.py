"""The engine tests' shared reference run: one engine with no prefix cache
and no offloading, made once per session for every module that compares
outputs with it (each run of the CPU engine takes about a minute here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_vllm_engine as engines


@pytest.fixture(scope="session")
def reference(
    engine_python: str, model: str, tmp_path_factory: pytest.TempPathFactory
) -> engines.Engine:
    return engines.run_reference(engine_python, model, tmp_path_factory.mktemp("none"))
