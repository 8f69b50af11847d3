"""``kvtier bench soak --minutes 2``, as CI runs it: a replay through host,
disk and Redis tiers while every fault kind is injected, judged by the
soak's own verdict (resources flat after warm-up, no wrong byte served, no
hang, recovery after every fault). Nothing here judges speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.bench.soak import FAULT_KINDS


@pytest.mark.timeout(900)
def test_two_minute_soak_passes_with_every_fault(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "soak", "--minutes", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "soak PASSED" in r.stdout
    (path,) = out.glob("soak-*.json")
    assert len(list(out.glob("soak-*.png"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing written elsewhere
    res = json.loads(path.read_text())
    assert res["passed"] and all(c["passed"] for c in res["verdict"])
    skipped = set(res["skipped_faults"])
    if os.geteuid() == 0:  # a tmpfs to fill can be mounted
        assert skipped == set()
    else:
        assert skipped == {"disk_full"}
    for kind in FAULT_KINDS:
        assert res["fault_counts"][kind] == (0 if kind in skipped else 1), kind
    for f in res["faults"]:
        assert f["skipped"] or f["recovered_s"] is not None, f
    assert res["child_starts"] == 2 and res["crashes"] == 0 and res["hangs"] == 0
    assert sum(s["d_wrong"] for s in res["samples"]) == 0
    assert sum(s["d_hits"] for s in res["samples"]) > 0
    assert [m["minute"] for m in res["minutes"]] == [1, 2]
    # The restarted child read blocks its killed predecessor had written.
    kill = next(f for f in res["faults"] if f["kind"] == "process_kill")
    after = [s for s in res["samples"] if s["inc"] == 1]
    assert after and after[0]["tiers"]["disk"]["recovered"] > 0, kill
    assert sum(s["d_hits_by"].get("disk", 0) for s in after) > 0
