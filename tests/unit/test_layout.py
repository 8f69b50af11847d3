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
    return rel in TOOL_FILES or rel.startswith("bench/")


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


def _module_name(p: Path) -> str:
    parts = ["kvtier", *p.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(p: Path, names: set[str]) -> set[str]:
    """The package's modules ``p`` imports, at module level or inside a
    function (a lazy import still ties the two), not under TYPE_CHECKING.
    ``from pkg import sub`` names the submodule, not the package."""
    me = _module_name(p)
    pkg = me if p.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                continue
            if isinstance(ch, ast.Import):
                out.update(a.name for a in ch.names if a.name in names)
            elif isinstance(ch, ast.ImportFrom):
                base = ch.module or ""
                if ch.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - ch.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in ch.names} & names
                out.update(subs if len(subs) == len(ch.names) else subs | ({base} & names))
            visit(ch)

    visit(ast.parse(p.read_text()))
    return out - {me}


def test_no_import_circle_in_the_package() -> None:
    names = {_module_name(p) for p in MODULES}
    graph = {_module_name(p): _imports(p, names) for p in MODULES}
    # Tarjan's strongly connected components: a circle is one of two or more modules.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert circles == []


def test_the_graph_sees_lazy_imports_and_skips_type_only_ones() -> None:
    names = {_module_name(p) for p in MODULES}
    spec = _imports(PKG / "integrations" / "vllm" / "spec.py", names)
    # Imported inside get_worker (lazy) and under TYPE_CHECKING (types only).
    assert "kvtier.integrations.vllm.worker" in spec
    assert "kvtier.tiers.base" not in spec


def test_no_tool_imports_a_private_name_of_another_module() -> None:
    offenders = []
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
                offenders += [
                    f"{_rel(p)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                    and node.module != "kvtier"  # kvtier._native, the extension
                ]  # fmt: skip
    assert offenders == []


# Public paths kept for users; the package itself imports the modules they re-export.
REEXPORTS = {"kvtier.manager", "kvtier.transfer", "kvtier.streaming"}


def test_the_package_imports_canonical_paths_not_its_re_exports() -> None:
    names = {_module_name(p) for p in MODULES}
    offenders = [
        f"{_rel(p)} imports {m}"
        for p in MODULES
        if _module_name(p) not in REEXPORTS
        for m in sorted(_imports(p, names) & REEXPORTS)
    ]
    assert offenders == []


def test_no_formatter_opt_outs_in_the_package() -> None:
    """ruff formats every line (issue 50: 177 '# fmt: skip' markers were crutches)."""
    marker = "# fmt: " + "skip"
    assert [_rel(p) for p in MODULES if marker in p.read_text()] == []
