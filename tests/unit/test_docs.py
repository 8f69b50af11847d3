"""The documentation site cannot rot: it builds with ``mkdocs build --strict``
(a broken link, a page missing from the nav or an anchor that is not there
fails), the generated CLI reference matches the parsers, the Python
quickstart runs as printed, and the README stays a landing page whose vLLM
line names only keys the shim knows.

Process: the test process (mkdocs and the quickstart in child processes).
Who calls: pytest (``make test``). Blocks on those children, about 10 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
QUICKSTART = DOCS / "getting-started" / "quickstart.md"
RUNNABLE = "<!-- runnable: tests/unit/test_docs.py runs this block -->"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:  # the generators import docs/gen_page.py
        sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(mod)
    return mod


def _gen_cli() -> ModuleType:
    return _load("gen_cli", DOCS / "gen_cli.py")


def _runnable_blocks(page: Path) -> list[str]:
    """The fenced code blocks that follow a ``runnable`` marker on ``page``."""
    text = page.read_text()
    pattern = re.escape(RUNNABLE) + r"\n```[a-z]*\n(.*?)\n```"
    return re.findall(pattern, text, flags=re.S)


@pytest.mark.timeout(120)
def test_the_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed in this interpreter (make venv installs it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index.html", "guides/vllm/index.html", "reference/cli/index.html"):
        assert (tmp_path / page).is_file(), page
    # mkdocstrings rendered the API pages from the docstrings, not empty stubs.
    manager = (tmp_path / "reference/api/manager/index.html").read_text()
    assert "prepare_store" in manager and "ManagerOptions" in manager


def test_the_cli_reference_is_generated_from_the_parsers() -> None:
    page = DOCS / "reference" / "cli.md"
    assert page.read_text() == _gen_cli().render(), (
        "docs/reference/cli.md is stale: run `make docs` (python docs/gen_cli.py)"
    )


def test_the_configuration_reference_is_generated_from_the_options() -> None:
    page = DOCS / "reference" / "configuration.md"
    gen = _load("gen_config", DOCS / "gen_config.py")
    assert page.read_text() == gen.render(), (
        "docs/reference/configuration.md is stale: run `make docs` (python docs/gen_config.py)"
    )
    # Every engine key is on the page.
    from kvtier.options.surfaces import engine_keys

    keys = [*engine_keys("vllm"), *engine_keys("sglang")]
    assert all(f"`{k}`" in page.read_text() for k in keys)


def test_the_cli_reference_names_every_subcommand() -> None:
    text = (DOCS / "reference" / "cli.md").read_text()
    for cmd in ("replay", "bench", "plan", "doctor", "events"):
        assert f"## kvtier {cmd}\n" in text


def test_every_command_line_argument_says_what_it_does() -> None:
    """The CLI reference's "meaning" column is each argument's help: none is empty."""
    import argparse

    from kvtier.cli import build_parser

    def walk(parser: argparse.ArgumentParser, prog: str) -> list[str]:
        bare = []
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    bare += walk(sub, f"{prog} {name}")
            elif not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
                bare.append(f"{prog} {'/'.join(a.option_strings) or a.dest}")
        return bare

    assert walk(build_parser(), "kvtier") == []


@pytest.mark.timeout(90)
def test_the_python_quickstart_runs(tmp_path: Path) -> None:
    blocks = _runnable_blocks(QUICKSTART)
    assert len(blocks) == 1, "the quickstart's runnable Python block"
    code = blocks[0]
    assert 20 <= len(code.splitlines()) <= 60
    script = tmp_path / "quickstart.py"
    script.write_text(code + "\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loaded back from disk: {'disk': 4}" in r.stdout, r.stdout
    assert "It prints `loaded back from disk: {'disk': 4}`" in QUICKSTART.read_text()


def _replay_commands(text: str) -> list[list[str]]:
    """The ``kvtier replay`` command lines of a page's shell blocks, each
    joined across ``\\`` continuations, comments cut, as argv after ``kvtier``."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if len(argv) > 1 and argv[0].endswith("kvtier") and argv[1] == "replay":
                out.append(argv[1:])
    return out


def test_the_quickstart_commands_are_valid_and_the_demo_runs(tmp_path: Path) -> None:
    """Every ``kvtier replay`` line of the quickstart parses, flags and
    values alike; the demo's line is the Makefile's, and runs (shortened)."""
    from kvtier.cli import build_parser
    from kvtier.options.surfaces import tier_options_from_args

    commands = _replay_commands(QUICKSTART.read_text())
    assert len(commands) == 4
    for argv in commands:
        tier_options_from_args(build_parser().parse_args(argv))
    demo = commands[0]
    make = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert " ".join(demo) in " ".join(make.replace("\\\n", " ").split())
    short = [a.replace("build/", f"{tmp_path}/") for a in demo]
    short[short.index("--max-requests") + 1] = "300"
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *short, "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "demo-replay.json").read_text())["verify_failures"] == 0


def _vllm_line(text: str) -> dict[str, object]:
    m = re.search(r"vllm serve MODEL --kv-transfer-config '(\{.*?\})'\n", text)
    assert m is not None, "a one-line `vllm serve ... --kv-transfer-config` enable"
    cfg: dict[str, object] = json.loads(m.group(1))
    return cfg


def test_the_readme_is_a_landing_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150
    first_screen = "\n".join(lines[:40]) + "\n"
    assert "--kv-transfer-config" in first_screen
    _vllm_line(first_screen)
    for cmd in ("make demo", "make test"):
        assert cmd in README.read_text()


def test_the_one_line_vllm_enable_is_the_same_everywhere_and_valid() -> None:
    # The module by its file: the package kvtier.integrations.vllm imports
    # vLLM's base modules (seconds), which the key table does not need.
    config = ROOT / "python" / "kvtier" / "integrations" / "vllm" / "config.py"
    keys = _load("kvtier_vllm_config", config).CONFIG_KEYS
    pages = [README, DOCS / "index.md", DOCS / "guides" / "vllm.md"]
    configs = [_vllm_line(p.read_text()) for p in pages]
    assert all(c == configs[0] for c in configs)
    cfg = configs[0]
    assert cfg["kv_connector"] == "KVTierConnector"
    assert cfg["kv_connector_module_path"] == "kvtier.integrations.vllm_connector"
    extra = cfg["kv_connector_extra_config"]
    assert isinstance(extra, dict) and "kvtier_host_bytes" in extra
    assert set(extra) <= set(keys)


def _config_snippets() -> list[tuple[str, str, dict[str, Any]]]:
    """Every engine configuration the docs show whole (an elided one, with
    ``...``, is an excerpt): (page, flag, its JSON)."""
    flags = ("--kv-transfer-config", "--hicache-storage-backend-extra-config")
    out = []
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        for flag in flags:
            found = re.finditer(re.escape(flag) + r"\s*\\?\s*'(\{.*?\})'", text, re.S)
            rel = str(page.relative_to(ROOT))
            out += [(rel, flag, json.loads(m[1])) for m in found if "..." not in m[1]]
    return out


def test_every_configuration_snippet_is_valid_against_the_options() -> None:
    """The vLLM and SGLang configurations the pages show parse, and their
    kvtier keys (and secondary tiers' arguments) pass kvtier's own checks."""
    from kvtier.integrations.sglang.config import parse_extra_config
    from kvtier.options import DiskOptions, RemoteOptions
    from kvtier.options.surfaces import parse_engine_config, secondary_options

    snippets = _config_snippets()
    assert len(snippets) >= 5
    kinds = {"KVTierDiskTier": DiskOptions, "KVTierRedisTier": RemoteOptions}
    for page, flag, cfg in snippets:
        if flag == "--hicache-storage-backend-extra-config":
            # The backend's own check: a tier of the rank's own, or a node.
            settings = parse_extra_config(cfg)
            assert settings.disk or settings.remote or settings.node, page
            continue
        extra = cfg["kv_connector_extra_config"]
        for tier in extra.get("secondary_tiers", []):
            if tier["type"] in kinds:
                args = {
                    k: v for k, v in tier.items() if k not in ("type", "module_path", "namespace")
                }
                secondary_options(kinds[tier["type"]], args, page)
        parse_engine_config(extra, "vllm", page)


def test_readme_links_point_at_pages_that_exist() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target
