"""The benchmark summary: newest result per kind, every ratio in the table."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench.report import latest, ratios, write_summary


def _disk(t: str, store: float) -> dict:
    return {
        "component": "disk",
        "block_bytes": 262144,
        "ratio": {"store": store, "load": 0.5},
        "vs_python_threadpool": {"store": 2.0, "load": 1.5},
        "gil": {
            "python_loop_speed_while_busy": 0.95,
            "driver_in_second_thread": {"python_loop_speed_while_busy": 0.9},
        },
        "machine": {"time": t},
    }


def test_newest_result_per_kind_and_its_ratios(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_disk("2026-01-02T00:00:00Z", 1.25)))
    (tmp_path / "b.json").write_text(json.dumps(_disk("2026-01-01T00:00:00Z", 9.0)))
    (tmp_path / "c.json").write_text(
        json.dumps({"component": "vllm", "manager": {"ratio": 1.1}, "disk": []})
    )
    (tmp_path / "junk.json").write_text("{not json")
    got = latest(tmp_path)
    assert [d["component"] for d in got] == ["disk", "vllm"]
    assert got[0]["ratio"]["store"] == 1.25  # the newer run wins
    rows = ratios(got)
    assert ("disk 256 KiB store", 1.25, "fio") in rows
    assert ("disk 256 KiB load", 1.5, "Python thread pool") in rows
    assert ("disk 256 KiB Python loop while busy", 0.95, "loop alone") in rows
    assert ("disk 256 KiB Python loop, driver in a 2nd thread", 0.9, "loop alone") in rows
    assert ("vLLM manager cycles", 1.1, "CPUOffloadingManager") in rows
    md, png = write_summary(tmp_path)
    text = md.read_text()
    assert "| disk 256 KiB store | fio | 1.25 |" in text and "9.00" not in text
    assert png is not None and png.stat().st_size > 1000
