from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kvtier
import pytest
from kvtier.replay import read_trace, synthetic_trace

SHARED_TRACE = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "traces"
    / "mooncake_conversation_trace.jsonl"
)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True
    )


def test_synthetic_trace_shares_prefixes() -> None:
    t = synthetic_trace(500, seed=1)
    assert len(t) == 500
    firsts = {r[0] for r in t}
    assert len(firsts) < 30  # a few system prompts start every request
    assert t == synthetic_trace(500, seed=1)


def test_read_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(kvtier.InvalidArgument, match="not found"):
        read_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"oops": 1}\n')
    with pytest.raises(kvtier.InvalidArgument, match=r"bad\.jsonl:2"):
        read_trace(bad)


def test_replay_with_data_verifies_and_writes_outputs(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    reqs = synthetic_trace(300, seed=3)
    trace.write_text(
        "".join(json.dumps({"timestamp": i, "hash_ids": r}) + "\n" for i, r in enumerate(reqs))
    )
    out = run_cli(
        "replay",
        str(trace),
        "--block-bytes",
        "16KiB",
        "--host-blocks",
        "200",
        "--policy",
        "arc",
        "--json",
        str(tmp_path / "r.json"),
        "--plot",
        str(tmp_path / "r.png"),
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    js = json.loads((tmp_path / "r.json").read_text())
    assert js["requests"] == 300
    assert js["block_refs"] == sum(len(r) for r in reqs)
    assert js["verify_failures"] == 0
    assert js["hit_blocks"]["host"] > 0
    assert js["bytes_loaded"] == js["hit_blocks"]["host"] * 16384
    assert set(js["load_latency_ms"]) == {"p50", "p99"}
    assert (tmp_path / "r.png").stat().st_size > 10_000
    for key in ("hit_rate", "bytes_stored", "wall_s"):
        assert key in js


def test_no_data_hit_counts_are_exact(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    # 3 requests: [1,2,3], [1,2,4], [1,5]: unbounded cache hits 2 + 1 = 3 of 8 refs.
    trace.write_text('{"hash_ids": [1,2,3]}\n{"hash_ids": [1,2,4]}\n{"hash_ids": [1,5]}\n')
    out = run_cli(
        "replay",
        str(trace),
        "--no-data",
        "--host",
        "inf",
        "--no-progress",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr
    js = json.loads((tmp_path / "r.json").read_text())
    assert (js["block_refs"], js["hit_blocks"]["host"]) == (8, 3)


def test_bad_options_are_clear_errors() -> None:
    out = run_cli("replay", "--host", "inf", "--no-progress", "--max-requests", "5")
    assert out.returncode == 2 and "--no-data" in out.stderr
    out = run_cli("replay", "--block-bytes", "12XB", "--no-progress")
    assert out.returncode == 2 and "cannot parse size" in out.stderr
    out = run_cli("replay", "--no-data", "--no-progress", "--restart-after", "0")
    assert out.returncode == 2 and "--restart-after must be >= 1, got 0" in out.stderr
    out = run_cli(
        "replay", "--no-data", "--no-progress", "--policy", "belady", "--restart-after", "9"
    )
    assert out.returncode == 2 and "--restart-after with the belady policy" in out.stderr


def test_a_restart_reopens_the_disk_and_its_blocks_load_intact(tmp_path: Path) -> None:
    # With data: after the restart the host tier is empty, so the blocks
    # written before it come back from the disk, each verified byte for byte.
    js_path = tmp_path / "r.json"
    out = run_cli(
        "replay", "--workload", "chat", "--synthetic-requests", "300", "--block-bytes", "16KiB",
        "--host-blocks", "50", "--disk", f"{tmp_path}/d:8MiB", "--restart-after", "150",
        "--no-progress", "--json", str(js_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    js = json.loads(js_path.read_text())
    assert js["restart_after"] == 150 and js["requests"] == 300
    assert js["tiers"]["disk"]["recovered"] > 0 and js["hit_blocks"]["disk"] > 0
    assert js["verify_failures"] == 0


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared trace not present")
def test_mooncake_trace_ceiling() -> None:
    out = run_cli("replay", str(SHARED_TRACE), "--no-data", "--host", "inf", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "36.64%" in out.stdout
