"""Medians of issue 60's interleaved before/after serving sweep.

Process: a developer's shell, once, after ``run.sh``. Who calls: nobody else.
Reads the JSONs beside it and prints one row per (time scale, configuration,
version), in that sorted order; blocks only on reading them.
"""

import collections
import json
import statistics as st
from pathlib import Path

rows: dict[tuple[str, str, str], list[dict]] = collections.defaultdict(list)
for f in sorted(Path(__file__).parent.glob("*-ts*-r*-serve-load-*[0-9].json")):
    ver, ts, _rep = f.name.split("-")[:3]
    for r in json.loads(f.read_text())["runs"]:
        rows[(ts, r["config"], ver)].append(r)
print("ts     config     ver    n  TTFT p50 ms [runs]         mean   p99  out tok/s  host loads")
for k in sorted(rows):
    rs = rows[k]
    p50 = [r["ttft_p50_s"] * 1e3 for r in rs]
    mean = st.median(r["ttft_mean_s"] * 1e3 for r in rs)
    p99 = st.median(r["ttft_p99_s"] * 1e3 for r in rs)
    tps = st.median(r["output_tps"] for r in rs)
    loads = [int(r["kvtier"]["loaded_host"]) for r in rs]
    runs = str([round(x) for x in p50])
    print(
        f"{k[0]:6} {k[1]:10} {k[2]:6} {len(rs)}  {st.median(p50):6.0f} {runs:22} "
        f"{mean:5.0f} {p99:5.0f} {tps:6.1f}  {loads}"
    )
