"""``kvtier bench COMPONENT``: each component has its own parser with only
the flags it reads (its --help lists those; another component's flag is
argparse's error, exit status 2), and every invocation the repository
writes down still parses."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from kvtier.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
COMMON = {"--out", "--json"}
TLS = "--tls-ca-file --tls-ca --tls-cert-file --tls-cert --tls-key-file --tls-key --tls-server-name"
FLAGS = {
    name: set(flags.split())
    for name, flags in {
        "copy": "--block-bytes --repeats --device --tokens --layouts --quick",
        "manager": "--keys --policy --node --clients --shared-index --no-round-trips --events "
        "--repeats",
        "disk": "--block-bytes --repeats --dir --queue-depth --total --backend",
        "disk-index": "--records --policy",
        "remote": f"--block-bytes --repeats --total --url --tls --connections --peer {TLS}",
        "vllm": "--block-bytes --repeats --dir --trace",
        "serve": "--repeats --python --configs --model-kind --sessions --system-tokens --turns "
        "--server --trace --time-scale --max-requests --trace-cut --concurrencies --rates "
        "--lower-writes --workloads",
        "soak": "--minutes --seed --server --python",
        "sglang": "--repeats --dir --url",
        "route": "--trace --max-requests --time-scale --seed --block-bytes --engines "
        "--host-blocks --disk-blocks --pool-blocks",
        "node": "--python --configs --trace --max-requests --max-input --max-tokens --host-share",
    }.items()
}


def _components() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    comp = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return dict(comp.choices)


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _shown_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))


def test_every_component_has_a_parser_of_its_own_flags_only() -> None:
    parsers = _components()
    assert list(parsers) == list(FLAGS)
    for name, p in parsers.items():
        shown = {o for a in p._actions if a.help != argparse.SUPPRESS for o in a.option_strings} - {
            "-h",
            "--help",
        }
        assert shown == FLAGS[name] | COMMON, name


def test_the_soaks_help_shows_no_disk_remote_or_gpu_copy_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help(capsys, "soak")
    assert text.startswith("usage: kvtier bench soak [-h] [--minutes MINUTES]")
    foreign = {"--queue-depth", "--total", "--backend", "--dir", "--url", "--tls", "--peer"}
    foreign |= {"--connections", "--device", "--tokens", "--layouts", "--block-bytes", "--keys"}
    assert not _shown_flags(text) & foreign
    assert _shown_flags(text) == {"--help", *FLAGS["soak"], *COMMON}


@pytest.mark.parametrize("component", list(FLAGS))
def test_each_components_help_lists_its_own_flags(
    component: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help(capsys, component)
    assert text.startswith(f"usage: kvtier bench {component} [-h]")
    # Flags named in help texts (e.g. "--server: ...") are the component's own too.
    assert _shown_flags(text) == {"--help", *FLAGS[component], *COMMON}


def test_bench_help_lists_the_components(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: kvtier bench [-h] COMPONENT ...")
    for name in FLAGS:
        assert re.search(rf"^    {re.escape(name)}\b", text, re.M), name
    assert "--block-bytes" not in text and "--minutes" not in text


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["soak", "--total", "1GiB"], "--total 1GiB; --total is a flag of disk, remote"),
        (["manager", "--dir=x"], "--dir=x; --dir is a flag of disk, vllm, sglang"),
        (["copy", "--minutes", "2"], "--minutes 2; --minutes is a flag of soak"),
        (["route", "--nope"], "--nope"),
    ],
)
def test_a_flag_of_another_component_is_a_usage_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvtier bench {argv[0]} [-h]")
    assert err.endswith(f"kvtier bench {argv[0]}: error: unrecognized arguments: {said}\n")


@pytest.mark.parametrize("argv", [["--no-round-trips"], ["--node", "--no-round-trips"]])
def test_no_round_trips_without_the_shared_index_is_refused_before_any_run(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "manager", "--keys", "64", "--out", "", *argv]) == 2
    out = capsys.readouterr()
    assert out.err == (
        "kvtier: error: --no-round-trips needs --node --shared-index: no node would run\n"
    )
    assert out.out == ""  # not even the in-process manager ran


def test_a_component_that_does_not_exist_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvtier bench [-h] COMPONENT ...")
    assert "argument COMPONENT: invalid choice: 'nope'" in err


def _written_invocations() -> list[tuple[str, list[str], str]]:
    """(component, flags, where) of every ``kvtier bench`` command line the
    repository writes down: the Makefile, the READMEs, the docs (less the
    generated CLI page) and bench/run.py's configs."""
    out = []
    texts = [REPO / "Makefile", REPO / "README.md", REPO / "bench" / "README.md"]
    texts += [p for p in (REPO / "docs").rglob("*.md") if p.name != "cli.md"]
    # One command line: words up to its end, a closing backtick or a table's bar
    # (a backslash continues it on the next line).
    gap = r"(?:[ \t]+|[ \t]*\\\n\s*)"
    line = re.compile(rf"kvtier bench ([a-z][a-z-]*)((?:{gap}[^\s`|\[\]\\][^\s`|]*)*)")
    for path in texts:
        for m in line.finditer(path.read_text()):
            flags = [t.split("=", 1)[0] for t in m.group(2).split() if t.startswith("-")]
            out.append((m.group(1), flags, str(path.relative_to(REPO))))
    for path in (REPO / "bench" / "configs").glob("*.json"):
        runs = json.loads(path.read_text())["runs"]
        out += [(r[0], [t for t in r[1:] if t.startswith("-")], path.name) for r in runs]
    return out


def test_every_invocation_the_repository_writes_down_still_parses() -> None:
    parsers = _components()
    seen = _written_invocations()
    assert len(seen) > 40 and {c for c, _, _ in seen} >= {"soak", "serve", "remote", "copy"}
    for component, flags, where in seen:
        assert component in parsers, (component, where)
        known = {o for a in parsers[component]._actions for o in a.option_strings}
        assert set(flags) <= known, (component, sorted(set(flags) - known), where)
