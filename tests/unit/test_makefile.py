"""The Makefile's set-up, read from ``make -n -B`` (every command it would
run from a fresh clone, none run): ``make demo`` installs kvtier alone, in
a venv of its own, and ``make test`` keeps the full venv, explaining once
the pip conflict lines that vLLM and SGLang installed without their
dependencies print."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _fresh_clone_commands(target: str) -> str:
    r = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_demo_installs_kvtier_alone_in_a_venv_of_its_own() -> None:
    out = _fresh_clone_commands("demo")
    # None of these is used by the replay; torch and vLLM took 5 minutes to install.
    for heavy in ("torch", "vllm", "sglang", "mkdocs", "pytest", "transformers"):
        assert heavy not in out.lower(), heavy
    assert not re.search(r"(^|\s)\.venv/", out), "the demo leaves make test's venv alone"
    pips = [line for line in out.splitlines() if " -m pip install" in line]
    assert all(line.startswith(".venv-demo/bin/python -m pip install -q ") for line in pips)
    assert pips[-1].endswith("--no-build-isolation -Cbuild-dir=build/demo-{wheel_tag} -e .")
    assert ".venv-demo/bin/kvtier replay --host-blocks 512" in out


def test_make_test_keeps_the_full_venv_and_explains_the_conflicts_once() -> None:
    out = _fresh_clone_commands("test")
    assert ".venv/bin/python -m pip install -q --no-deps vllm==0.33.0" in out
    assert '.venv/bin/python -m pip install -q --no-deps "sglang==0.5.23"' in out
    assert '.venv/bin/python -m pip install -q "torch==2.13.0"' in out
    assert out.count("are installed without their dependencies on purpose") == 1
    note = out.index("without their dependencies on purpose")
    assert note < out.index("--no-deps vllm==0.33.0")
