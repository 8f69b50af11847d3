"""`kvtier bench disk | remote` end to end on tiny sizes: the JSON the issues
name, baselines measured in the same run, the summary page built from it.
Figures are not asserted (tests never judge speed); their presence and
consistency are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from statistics import median
from typing import Any

import pytest
from kvtier.bench.report import ratios, write_summary
from kvtier.cli import main
from kvtier.tiers.disk import namespace_digest


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", *args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


def _consistent(d: dict[str, Any], base: str) -> None:
    b = d["baseline"]
    assert b["name"] == base
    for k in ("store", "load"):
        assert d[f"{k}_gbps"] > 0 and b[f"{k}_gbps"] > 0
        pairs = zip(d["runs"][k], b["runs"][k], strict=True)
        assert d["ratio"][k] == pytest.approx(median(o / x for o, x in pairs), abs=1e-3)


@pytest.mark.skipif(shutil.which("fio") is None, reason="make test installs fio")
def test_bench_disk_json_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.bench.disk as disk

    real = disk.run_disk
    monkeypatch.setattr(disk, "run_disk", lambda *a, **k: real(*a, **{**k, "probe_rounds": 1}))
    res = tmp_path / "results"
    d = _bench(
        capsys, "disk", "--dir", str(tmp_path), "--block-bytes", "256KiB",
        "--total", "16MiB", "--repeats", "3", "--out", str(res),
    )  # fmt: skip
    assert d["component"] == "disk" and d["block_bytes"] == 256 << 10
    assert d["backend"] in ("io_uring", "pread")
    _consistent(d, "fio")
    assert set(d["vs_python_threadpool"]) == {"store", "load"}
    g = d["gil"]
    assert g["python_loop_speed_while_busy"] > 0 and g["tier_gbps_meanwhile"] > 0
    assert g["driver_in_second_thread"]["floor_thread_waking_alone"] > 0
    assert len(g["loop_beside_fio"]["runs"]) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvtier-bench")] == []
    md, _ = write_summary(res)
    assert "| disk 256 KiB store | fio |" in md.read_text()
    assert "| disk 256 KiB Python loop beside fio | loop alone |" in md.read_text()


def test_bench_remote_json(
    redis_standalone: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    d = _bench(
        capsys, "remote", "--url", redis_standalone.url, "--block-bytes", "64KiB",
        "--total", "8MiB", "--repeats", "2", "--out", str(tmp_path),
    )  # fmt: skip
    assert d["component"] == "remote" and d["block_bytes"] == 64 << 10
    assert d["checksums"].startswith("crc32c")
    if shutil.which("redis-benchmark"):
        _consistent(d, "redis-benchmark")
        assert set(d["baseline_same_keyspace"]["ratio"]) == {"store", "load"}
        cpu = d["server_cpu_s_per_gb"]
        assert {"kvtier store", "kvtier load", "redis-benchmark store"} <= set(cpu)
        assert all(v >= 0 for v in cpu.values())
    assert set(d["vs_redis_py"]) == {"store", "load"}
    rows = {(w, b) for w, _, b in ratios([d])}
    assert ("remote 64 KiB store", "redis-py + hiredis") in rows
    # the bench leaves the server as it found it: none of its keys behind
    left = redis_standalone.cli("--scan", "--pattern", "*").split()
    assert [k for k in left if k.startswith(("key:", "kvtier-bench-py:"))] == []
    assert [
        k for k in left if k.startswith("kvt:" + namespace_digest("bench", 65536).hex()[:16])
    ] == []


def _fake_kvtier_file(monkeypatch: pytest.MonkeyPatch, root: Path, repo: bool) -> None:
    """Make kvtier look installed from ``root``: a source checkout or not."""
    import kvtier

    pkg = root / "python" / "kvtier" if repo else root / "site-packages" / "kvtier"
    pkg.mkdir(parents=True)
    if repo:
        (root / "pyproject.toml").write_text("")
    monkeypatch.setattr(kvtier, "__file__", str(pkg / "__init__.py"))


@pytest.mark.parametrize("repo", [True, False], ids=["from-checkout", "installed"])
def test_bench_writes_only_where_asked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    repo: bool,
) -> None:
    import tempfile

    cwd, root, tmp = tmp_path / "cwd", tmp_path / "root", tmp_path / "tmp"
    for d in (cwd, root, tmp):
        d.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    _fake_kvtier_file(monkeypatch, root, repo)
    assert main(["bench", "manager", "--keys", "2000", "--json"]) == 0
    out = capsys.readouterr()
    assert list(cwd.iterdir()) == []  # nothing where the user stood
    if repo:
        (saved,) = (root / "build" / "bench").iterdir()
        assert list(tmp.iterdir()) == []
    else:
        (where,) = tmp.iterdir()
        assert out.err == f"kvtier bench: writing to {where}\n"
        (saved,) = where.iterdir()
    assert saved.name.startswith("manager-all-") and saved.suffix == ".json"
    assert json.loads(saved.read_text())["component"] == "manager"
    # --out DIR: there and nowhere else; --out '': nowhere at all.
    assert main(["bench", "manager", "--keys", "2000", "--json", "--out", str(tmp_path / "o")]) == 0
    assert len(list((tmp_path / "o").iterdir())) == 1
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["bench", "manager", "--keys", "2000", "--json", "--out", ""]) == 0
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_bench_disk_scratch_defaults_outside_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.bench.commands import _scratch_dir
    from kvtier.cli import build_parser

    root = tmp_path / "root"
    _fake_kvtier_file(monkeypatch, root, repo=True)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench", "disk"])
    assert _scratch_dir(args) == str(root / "build" / "bench-disk")
    assert (root / "build" / "bench-disk").is_dir()
    args = build_parser().parse_args(["bench", "disk", "--dir", "elsewhere"])
    assert _scratch_dir(args) == "elsewhere"
