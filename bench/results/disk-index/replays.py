"""Disk hits and stranded disk blocks of ``kvtier replay`` with a disk tier
(no data moved: deterministic), each configuration without a restart and
with one halfway (``--restart-after``): ``python replays.py OUT.jsonl``
from the repository root, with the trace at ../shared; one JSON line per
run. The interpreter's kvtier is the one measured (the "before" figures
ran this script, replay.py and cli.py of this commit over the tree before
it)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

TRACE = "../shared/traces/mooncake_conversation_trace.jsonl"
# name: (arguments, requests at which the restart happens)
CONFIGS = {
    "conversation 4k": ([TRACE, "--max-requests", "4000", "--host-blocks", "500"], 2000, "64MiB"),
    "conversation": ([TRACE, "--host-blocks", "1000"], 6000, "256MiB"),
    "chat": (["--workload", "chat", "--synthetic-requests", "6000", "--host-blocks", "300"], 3000, "16MiB"),
    "rag": (["--workload", "rag", "--synthetic-requests", "6000", "--host-blocks", "300"], 3000, "16MiB"),
    "agent": (["--workload", "agent", "--synthetic-requests", "6000", "--host-blocks", "300"], 3000, "16MiB"),
}  # fmt: skip


def run(policy: str, name: str, restart: bool) -> dict[str, object]:
    args, half, size = CONFIGS[name]
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "kvtier.cli", "replay", *args, "--no-data",
               "--block-bytes", "16KiB", "--disk", f"{d}:{size}", "--disk-policy", policy,
               "--no-progress", "--json", f"{d}/r.json"]  # fmt: skip
        if restart:
            cmd += ["--restart-after", str(half)]
        subprocess.run(cmd, check=True, capture_output=True)
        with open(f"{d}/r.json") as f:
            js = json.load(f)
    return {
        "policy": policy,
        "workload": name,
        "restart_after": half if restart else None,
        "hit_blocks": js["hit_blocks"],
        "hit_rate": js["hit_rate"],
        "stranded_disk": js["stranded_blocks"]["disk"],
    }


if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        for policy in ("lru", "clock", "plfu"):
            for name in CONFIGS:
                for restart in (False, True):
                    print(json.dumps(run(policy, name, restart)), file=out, flush=True)
