"""Disk hits and stranded disk blocks with the disk index's prefix links on
or off: ``python disk_stranded.py on|off lru|clock|plfu`` (from the
repository root, with the trace at ../shared). One replay of the first
4,000 requests of the conversation trace, 16 KiB blocks, a 500-block host
LRU over a 64 MiB disk tier; prints one RESULT line."""

from __future__ import annotations

import json
import shutil
import sys

from kvtier.options import DiskOptions
from kvtier.replay import ReplayOptions, main_replay
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.factory import TierConfig

linked, pol = sys.argv[1] == "on", sys.argv[2]
if not linked:
    DiskTier.chain_hints = None  # type: ignore[assignment,method-assign]
shutil.rmtree("/tmp/rd", ignore_errors=True)
opts = ReplayOptions(
    trace="../shared/traces/mooncake_conversation_trace.jsonl",
    block_bytes="16KiB",
    host_blocks=500,
    tiers=TierConfig(DiskOptions("/tmp/rd", 64 << 20, policy=pol)),
    max_requests=4000,
    json_path="/tmp/rd.json",
    no_progress=True,
)
main_replay(opts)
with open("/tmp/rd.json") as f:
    js = json.load(f)
print("RESULT", sys.argv[1], pol, js["hit_blocks"], js["hit_rate"], js["stranded_blocks"])
