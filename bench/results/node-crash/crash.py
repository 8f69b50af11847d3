import sys, time, signal, subprocess, statistics, tempfile, os

sys.path.insert(0, "tests/node")
from pathlib import Path
from test_node import Node, _CHILD, NS_A, BLOCK, _remove_pools

ts = []
for i in range(5):
    d = Path(tempfile.mkdtemp())
    n = Node(d)
    try:
        c = subprocess.Popen(
            [sys.executable, "-c", _CHILD, n.path, NS_A, str(BLOCK)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert c.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        c.send_signal(signal.SIGKILL)
        c.wait()
        while n.status()["engines"]:
            time.sleep(0.0005)
        ts.append((time.monotonic() - t0) * 1000)
        occ = n.status()["classes"][str(BLOCK)]["occupancy"]
        assert (occ["blocks"], occ["pinned"], occ["writing"]) == (4, 0, 0), occ
    finally:
        n.stop()
        _remove_pools(n.name)
print(
    "lease release after SIGKILL, ms:",
    [round(t, 2) for t in ts],
    "median",
    round(statistics.median(ts), 2),
)
