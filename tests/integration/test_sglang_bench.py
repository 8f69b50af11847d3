"""kvtier bench sglang: the report's shape on a tiny run (no figure is
checked: timings vary; every page read back was verified by the run)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (make venv installs sglang==0.5.23 --no-deps)",
)


def test_bench_sglang_reports_ratios_per_op(tmp_path: Path) -> None:
    from kvtier.bench.sglang import OPS, run_sglang, table

    shape = {"page_size": 4, "layers": 2, "heads": 1, "head_dim": 64}
    r = run_sglang(str(tmp_path), repeats=1, shapes=(("tiny", shape, 16),))
    assert set(r["vs_hicache_file"]) == set(OPS) == {"set", "exists", "get"}
    ratios = (
        "vs_hicache_file",
        "disk_vs_hicache_file",
        "vs_hicache_file_device",
        "redis_vs_redis_py",
        "node_vs_host_disk",
    )
    assert all(v > 0 for k in ratios for v in r[k].values())
    (s,) = r["shapes"]
    assert (s["page_bytes"], s["pages_per_run"], s["batch_pages"]) == (2048, 16, 128)
    # The memory tier holds the run's pages: every read of them came from it.
    assert s["host_disk_get_from_memory"] == 1.0
    contenders = ("kvtier_host_disk", "kvtier_disk", "hicache_file", "hicache_file_device")
    for c in (*contenders, "kvtier_redis", "redis_py", "kvtier_node"):
        assert len(s[c]["get"]["runs_pages_per_s"]) == 1 and "gbps" not in s[c]["exists"]
    assert "kvtier_disk" in table(r) and "kvtier_node" in table(r)
    assert list(tmp_path.iterdir()) == []  # its scratch directory removed


def test_kvtier_bench_sglang_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvtier bench sglang --json FILE``: an object whose vs_hicache_file
    maps set, get and exists to kvtier's ratio (a tiny shape here)."""
    import json

    import kvtier.bench.sglang as bench
    from kvtier.cli import main

    shape = {"page_size": 4, "layers": 2, "heads": 1, "head_dim": 64}
    monkeypatch.setattr(bench, "SHAPES", (("tiny", shape, 8),))
    out = tmp_path / "sglang.json"
    args = ["bench", "sglang", "--dir", str(tmp_path), "--repeats", "1", "--out", ""]
    assert main([*args, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["component"] == "sglang" and r["repeats"] == 1
    assert sorted(r["vs_hicache_file"]) == ["exists", "get", "set"]
    assert all(isinstance(v, float) and v > 0 for v in r["vs_hicache_file"].values())
