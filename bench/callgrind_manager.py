"""Instructions per key of ``kvtier bench manager``'s cycle (lookup,
prepare_store, complete_store, prepare_load, complete_load), counted by
callgrind: a run over 2N keys minus a run over N keys, divided by N, so
that the interpreter's start-up and imports cancel out. Deterministic where
timings are not: issue 60's measure of the scheduler side.

A command-line tool (needs valgrind); blocks for its runs (about a minute
each under callgrind). Who calls: a developer, for the benchmark pages:

    python bench/callgrind_manager.py [--keys 20000] [--batch 1 16] [--tier native python]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

# One run: N keys into a host tier of N / 2 blocks (the second half evicts),
# ``batch`` keys a call, as kvtier.bench.manager.run_manager does.
_CHILD = """
import sys
from kvtier.bench.manager import cycles
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_native import NativeHostTier
n, batch, tier = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
keys = [i.to_bytes(32, "little") + b"\\0\\0\\0\\0" for i in range(n)]
make = NativeHostTier if tier == "native" else HostTier
cycles(TieredOffloadingManager(make(None, n // 2)), keys, batch)
"""


# Runs that count the same twice: no hash randomization (dicts and sets
# resize and iterate alike), and no OpenBLAS thread pool, whose threads spin
# for a time-dependent while after numpy starts them (millions of
# instructions a run, measured).
STEADY_ENV = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}


def collected(stderr: str) -> int:
    """The instruction count in callgrind's report (its stderr)."""
    m = re.search(r"Collected : (\d+)", stderr)
    if m is None:
        raise SystemExit(f"no instruction count in callgrind's output:\n{stderr[-2000:]}")
    return int(m.group(1))


def count(code: str, *args: str) -> int:
    """Instructions callgrind counted for ``python -c code args...``."""
    with tempfile.NamedTemporaryFile(suffix=".out") as out:
        p = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}"]
            + [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            check=True,
            env=STEADY_ENV,
        )
    return collected(p.stderr)


def instructions(n: int, batch: int, tier: str) -> int:
    """Instructions callgrind counted for one child run."""
    return count(_CHILD, str(n), str(batch), tier)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000, help="N: runs over N and 2N keys")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tier", nargs="+", default=["native", "python"])
    a = ap.parse_args()
    print("| host tier | keys a call | instructions per key |")
    print("| --- | ---: | ---: |")
    for tier in a.tier:
        for batch in a.batch:
            per_key = (
                instructions(2 * a.keys, batch, tier) - instructions(a.keys, batch, tier)
            ) / a.keys
            print(f"| {tier} | {batch} | {per_key:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
