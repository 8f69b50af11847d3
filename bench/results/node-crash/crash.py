"""Time from an engine's SIGKILL until the node has released its leases
(see README.md here). Run from the repository root in .venv."""

import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "tests/node")
from test_node import _CHILD, BLOCK, NS_A, Node, _remove_pools

times = []
for _ in range(5):
    n = Node(Path(tempfile.mkdtemp()))
    try:
        cmd = [sys.executable, "-c", _CHILD, n.path, NS_A, str(BLOCK)]
        c = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert c.stdout is not None and c.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        c.send_signal(signal.SIGKILL)
        c.wait()
        while n.status()["engines"]:
            time.sleep(0.0005)
        times.append((time.monotonic() - t0) * 1000)
        occ = n.status()["classes"][str(BLOCK)]["occupancy"]
        assert (occ["blocks"], occ["pinned"], occ["writing"]) == (4, 0, 0), occ
    finally:
        n.stop()
        _remove_pools(n.name)
rounded = [round(t, 2) for t in times]
print("lease release after SIGKILL, ms:", rounded, "median", round(statistics.median(times), 2))
