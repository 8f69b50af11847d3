"""The repository's layout rules (DESIGN.md section 3), checked on the
source: a reader knows from a module which process runs it, who calls it and
whether it blocks; no library file grows past about 600 lines; only
``engine.py`` drives the native engine; the library never imports the tools."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "python" / "kvtier"
MODULES = sorted(PKG.rglob("*.py"))
TOOLS = ("kvtier.cli", "kvtier.replay", "kvtier.doctor", "kvtier.bench")
# Tool modules (command-line tools and benchmarks), which may import the tools.
TOOL_FILES = {"cli.py", "replay.py", "doctor.py"}


def _rel(p: Path) -> str:
    return str(p.relative_to(PKG))


def _is_tool(p: Path) -> bool:
    rel = _rel(p)
    return (
        rel in TOOL_FILES
        or rel.startswith("bench/")
        or rel in ("integrations/vllm_bench.py", "integrations/vllm_engine.py")
    )


def test_the_package_was_found() -> None:
    assert len(MODULES) > 50 and (PKG / "scheduler" / "manager.py") in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_every_module_says_its_process_caller_and_blocking(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.lower().split())
    assert re.search(r"\bprocess\b|command-line tool", text), "names no process"
    assert re.search(r"who calls|called by|who runs|callers", text), "names no caller"
    assert "block" in text, "does not say whether it blocks"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_library_file_over_600_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 600


def test_only_engine_py_drives_the_native_engine() -> None:
    offenders = [_rel(p) for p in MODULES if p.name != "engine.py" and "._engine." in p.read_text()]
    assert offenders == []


def test_the_library_never_imports_the_tools() -> None:
    offenders = []
    for p in MODULES:
        if _is_tool(p):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            tools = [n for n in names if n in TOOLS or n.startswith(tuple(t + "." for t in TOOLS))]
            offenders += [f"{_rel(p)} imports {n}" for n in tools]
    assert offenders == []
