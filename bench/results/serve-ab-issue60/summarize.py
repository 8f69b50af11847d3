"""Medians of issue 60's interleaved before/after serving sweeps.

Process: a developer's shell, once, after ``run.sh``. Who calls: nobody else.
Reads the JSONs of one sweep (``python summarize.py sweep2`` the second's,
with no argument the first's, beside this file) and prints one row per (time scale, configuration,
version), in that sorted order, then after/before per round; blocks only on
reading them.
"""

import collections
import json
import math
import random
import re
import statistics as st
import sys
from pathlib import Path

where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
Row = dict
rows: dict[tuple[str, str, str], dict[int, Row]] = collections.defaultdict(dict)
# The first sweep's files lie beside this one (the second's in sweep2/):
# only a directory named on the command line is searched below.
found = where.rglob if len(sys.argv) > 1 else where.glob
for f in sorted(found("*serve-load-*[0-9].json")):
    m = re.search(r"(after|before)-ts([0-9.]+)-r(\d+)", str(f))
    if m is None:
        continue
    ver, ts, rep = m.group(1), m.group(2), int(m.group(3))
    for r in json.loads(f.read_text())["runs"]:
        rows[(ts, r["config"], ver)][rep] = r
print("ts     config     ver    n  TTFT p50 ms [runs]                 mean   p99  out tok/s")
for k in sorted(rows):
    rs = [rows[k][i] for i in sorted(rows[k])]
    p50 = [r["ttft_p50_s"] * 1e3 for r in rs]
    mean = st.median(r["ttft_mean_s"] * 1e3 for r in rs)
    p99 = st.median(r["ttft_p99_s"] * 1e3 for r in rs)
    tps = st.median(r["output_tps"] for r in rs)
    runs = str([round(x) for x in p50])
    print(
        f"{k[0]:6} {k[1]:10} {k[2]:6} {len(rs)}  {st.median(p50):6.0f} {runs:30} "
        f"{mean:5.0f} {p99:5.0f} {tps:6.1f}"
    )
print("\nafter / before, paired by round (p50 | mean | p99), and the medians:")
for ts, config in sorted({(k[0], k[1]) for k in rows if k[2] == "before"}):
    a, b = rows[(ts, config, "after")], rows[(ts, config, "before")]
    reps = sorted(set(a) & set(b))
    ratios = {
        m: [a[i][f"ttft_{m}_s"] / b[i][f"ttft_{m}_s"] for i in reps] for m in ("p50", "mean", "p99")
    }
    loads = [(int(a[i]["kvtier"]["loaded_host"]), int(b[i]["kvtier"]["loaded_host"])) for i in reps]
    tps = st.median(a[i]["output_tps"] / b[i]["output_tps"] for i in reps)
    print(f"ts {ts:5} {config:10} rounds {len(reps)}")
    for m, rs in ratios.items():
        print(f"   {m:5} {' '.join(f'{x:.2f}' for x in rs)}  median {st.median(rs):.2f}x")
    print(f"   out tok/s median {tps:.2f}x; host loads (after, before) {loads}")

# Pooled: every paired after/before ratio at a rate (host and host+disk), as
# a geometric mean with a bootstrap 90% interval over the rounds (resampled
# with their configurations together), and how many pairs lean each way.
print("\npooled after / before per rate (geometric mean, 90% bootstrap interval, pairs > 1):")
rng = random.Random(60)
for ts in sorted({k[0] for k in rows}):
    configs = [c for (t, c, v) in rows if t == ts and v == "before"]
    for m in ("p50", "mean", "p99"):
        by_round: dict[int, list[float]] = collections.defaultdict(list)
        for c in configs:
            a, b = rows[(ts, c, "after")], rows[(ts, c, "before")]
            for i in set(a) & set(b):
                by_round[i].append(math.log(a[i][f"ttft_{m}_s"] / b[i][f"ttft_{m}_s"]))
        rounds = sorted(by_round)
        logs = [x for i in rounds for x in by_round[i]]
        boot = []
        for _ in range(2000):
            pick = [x for _ in rounds for x in by_round[rng.choice(rounds)]]
            boot.append(math.exp(st.fmean(pick)))
        boot.sort()
        lo, hi = boot[len(boot) // 20], boot[-len(boot) // 20 - 1]
        above = sum(1 for x in logs if x > 0)
        print(
            f"ts {ts:5} {m:5} {math.exp(st.fmean(logs)):.3f}x  [{lo:.3f}, {hi:.3f}]  "
            f"{above} of {len(logs)} pairs above 1"
        )
