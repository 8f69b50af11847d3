"""``kvtier bench route``: what routing requests by the tiers' events buys.

Replays a Mooncake-format trace over a simulated fleet
(:mod:`kvtier.bench.route_fleet`: N engines, each with its own host and disk
tier, one shared pool) three times, once per routing:

- ``round_robin``: request i goes to engine (seed + i) mod N;
- ``session``: sticky by session, a new session to the next engine in turn.
  Mooncake's trace names no session or conversation: every prompt starts
  with the same block (id 0, a system prompt), and a conversation's turns
  share the block after it. A request's session is therefore its first
  block past the prefix that every request of the trace shares
  (:func:`sessions`);
- ``events``: :class:`EventsRouter`, which knows only what the engines'
  ``take_events()`` streams (host, disk) and the pool's stream told it, and
  sends each request to the engine whose tiers (its host and disk, and the
  pool) hold the longest prefix of its blocks, one block of prefix being
  worth one request in flight (:meth:`EventsRouter.choose`); among equals,
  to the one whose own tiers hold most of it (then its host), then to the
  one chosen least recently.

Per routing: blocks hit per tier (a contiguous prefix, as the engine loads),
prefill tokens saved (blocks hit x 512), blocks and bytes written per tier.
Deterministic for a trace, sizes and seed.

A command-line tool's module (never imported by the library): runs in the
``kvtier`` process. Who calls: :mod:`kvtier.bench.commands` (``kvtier bench
route``) and the tests. :func:`run_route` blocks for the three replays;
:func:`plot` writes a PNG (needs matplotlib); the rest is pure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.plots import pyplot, save_figure
from kvtier.bench.route_fleet import BLOCK_TOKENS, TIERS, Fleet, LoadModel
from kvtier.errors import InvalidArgument
from kvtier.replay import key_of
from kvtier.tiers.base import TierEvent

ROUTINGS = ("round_robin", "session", "events")
TARGET = 1.5  # issue 35: events must save >= 1.5x the prefill tokens of round robin


def sessions(traces: Sequence[Sequence[int]]) -> list[int]:
    """Each request's session: its first block past the prefix every request
    shares (its last block when it has none past it; -1 when empty)."""
    if not traces:
        return []
    common = list(traces[0])
    for ids in traces[1:]:
        n = 0
        for a, b in zip(common, ids):
            if a != b:
                break
            n += 1
        del common[n:]
    c = len(common)
    return [ids[min(c, len(ids) - 1)] if ids else -1 for ids in traces]


class Router:
    """Chooses an engine per request; :meth:`observe` hears every event."""

    def __init__(self, engines: int, seed: int = 0) -> None:
        self.n = engines
        self.seed = seed

    def choose(self, keys: Sequence[bytes], session: int, loads: Sequence[int]) -> int:
        raise NotImplementedError

    def observe(
        self, engine_events: Sequence[Sequence[TierEvent]], pool: Sequence[TierEvent]
    ) -> None:
        """The events since the last call: per engine (host, disk), and the pool's."""


class RoundRobin(Router):
    def __init__(self, engines: int, seed: int = 0) -> None:
        super().__init__(engines, seed)
        self.i = 0

    def choose(self, keys: Sequence[bytes], session: int, loads: Sequence[int]) -> int:
        e = (self.seed + self.i) % self.n
        self.i += 1
        return e


class SessionRouter(Router):
    """Sticky: a session stays on the engine its first request went to;
    new sessions go round robin."""

    def __init__(self, engines: int, seed: int = 0) -> None:
        super().__init__(engines, seed)
        self.of: dict[int, int] = {}

    def choose(self, keys: Sequence[bytes], session: int, loads: Sequence[int]) -> int:
        e = self.of.get(session)
        if e is None:
            e = self.of[session] = (self.seed + len(self.of)) % self.n
        return e


class EventsRouter(Router):
    """Longest cached prefix, from the events alone: per engine the blocks
    each of its tiers holds (stored adds, removed takes away), and the
    pool's blocks; it never looks at a tier."""

    def __init__(self, engines: int, seed: int = 0, load_weight: float = 1.0) -> None:
        super().__init__(engines, seed)
        self.load_weight = load_weight
        self.held: list[dict[str, set[bytes]]] = [{} for _ in range(engines)]
        self.pool: set[bytes] = set()
        # When each engine was last chosen (lower: longer ago); engine seed mod n first.
        self.last = [-engines + (e - seed) % engines for e in range(engines)]
        self.tick = 0

    def score(self, engine: int, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Blocks of ``keys``, from the first, that ``engine``'s tiers or the
        pool hold; of those, how many its own tiers (host or disk) hold, and
        how many its host holds, each from the first too."""
        held = self.held[engine]
        host, disk = held.get("host", set()), held.get("disk", set())
        total = local = in_host = 0
        for k in keys:
            h = k in host
            if h and in_host == total:
                in_host += 1
            if h or k in disk:
                if local == total:
                    local += 1
            elif k not in self.pool:
                break
            total += 1
        return total, local, in_host

    def choose(self, keys: Sequence[bytes], session: int, loads: Sequence[int]) -> int:
        """The least work: blocks to compute (those past the longest prefix
        held) plus ``load_weight`` blocks per request in flight, so that a
        prefix every engine shares (a system prompt) does not draw every
        request to the engine that happened to cache it first. Among equals,
        the most of the prefix in the engine's own tiers, then in its host;
        then the engine chosen least recently."""

        def rank(i: int) -> tuple[float, ...]:
            total, local, in_host = self.score(i, keys)
            return len(keys) - total + self.load_weight * loads[i], -local, -in_host, self.last[i]

        e = min(range(self.n), key=rank)
        self.last[e] = self.tick
        self.tick += 1
        return e

    @staticmethod
    def _apply(held: set[bytes], ev: TierEvent) -> None:
        if ev.removed:
            held.difference_update(ev.keys)
        else:
            held.update(ev.keys)

    def observe(
        self, engine_events: Sequence[Sequence[TierEvent]], pool: Sequence[TierEvent]
    ) -> None:
        for e, evs in enumerate(engine_events):
            for ev in evs:
                self._apply(self.held[e].setdefault(ev.tier, set()), ev)
        for ev in pool:
            self._apply(self.pool, ev)


ROUTERS: dict[str, Callable[[int, int], Router]] = {
    "round_robin": RoundRobin,
    "session": SessionRouter,
    "events": EventsRouter,
}


def bound_blocks(traces: Sequence[Sequence[int]]) -> int:
    """Blocks an infinite cache shared by every engine would hit (a
    contiguous prefix of each request): what no routing can beat."""
    seen: set[int] = set()
    hits = 0
    for ids in traces:
        for h in ids:
            if h not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits


def replay_routing(
    name: str,
    records: Sequence[dict[str, Any]],
    fleet: Fleet,
    seed: int = 0,
    session_of: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One routing over ``fleet`` (fresh); its counts, and for the events
    router whether its view equals what the tiers hold at the end."""
    t0 = time.perf_counter()
    n = len(fleet.engines)
    router = ROUTERS[name](n, seed)
    traces = [r["hash_ids"] for r in records]
    session_of = sessions(traces) if session_of is None else session_of
    hit = dict.fromkeys(TIERS, 0)
    refs = saved = 0
    chosen: list[int] = []
    scale = fleet.load_model.time_scale
    for req, session in zip(records, session_of):
        now = float(req.get("timestamp", 0)) / 1000.0 * scale
        keys = [key_of(h) for h in req["hash_ids"]]
        e = router.choose(keys, session, fleet.loads(now))
        chosen.append(e)
        got = fleet.serve(e, req, now)
        for t, k in got.items():
            hit[t] += k
        saved += BLOCK_TOKENS * sum(got.values())
        refs += len(keys)
        router.observe(*fleet.take_events())
    out: dict[str, Any] = {
        "saved_tokens": saved,
        "hit_rate": round(sum(hit.values()) / refs, 6) if refs else 0.0,
        "tier_hit_rate": {t: round(k / refs, 6) if refs else 0.0 for t, k in hit.items()},
        "hit_blocks": hit,
        "block_refs": refs,
        "written_blocks": fleet.written(),
        "requests_per_engine": [e.requests for e in fleet.engines],
        "choices": chosen,
    }
    if isinstance(router, EventsRouter):
        per, pool = fleet.holdings()
        out["router_view_exact"] = pool == router.pool and all(
            router.held[i].get(t, set()) == held for i, d in enumerate(per) for t, held in d.items()
        )
    fleet.finish()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def run_route(
    records: Sequence[dict[str, Any]],
    engines: int,
    host_blocks: int,
    disk_blocks: int,
    pool_blocks: int,
    block_bytes: int,
    seed: int = 0,
    load: LoadModel | None = None,
    source: str = "",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The three routings over the same trace and fleet sizes: the result
    object (``routings`` maps each to its ``saved_tokens`` and ``hit_rate``)."""
    if engines < 1 or host_blocks < 1 or min(disk_blocks, pool_blocks) < 0:
        raise InvalidArgument("--engines and --host-blocks must be >= 1, other sizes >= 0")
    if not records:
        raise InvalidArgument("the trace has no requests")
    load = load or LoadModel()
    traces = [r["hash_ids"] for r in records]
    session_of = sessions(traces)
    routings: dict[str, dict[str, Any]] = {}
    for name in ROUTINGS:
        fleet = Fleet(engines, host_blocks, disk_blocks, pool_blocks, load)
        r = replay_routing(name, records, fleet, seed, session_of)
        r["bytes_written"] = {t: k * block_bytes for t, k in r["written_blocks"].items()}
        del r["choices"]  # the tests read them; 8 bytes a request is no report
        routings[name] = r
        if progress:
            progress(f"{name}: {r['saved_tokens']:,} tokens saved ({r['wall_s']} s)")
    rr = routings["round_robin"]["saved_tokens"]
    ratios = {n: round(r["saved_tokens"] / rr, 3) if rr else None for n, r in routings.items()}
    bound = bound_blocks(traces) * BLOCK_TOKENS
    return {
        "component": "route",
        "trace": source,
        "requests": len(records),
        "engines": engines,
        "host_blocks": host_blocks,
        "disk_blocks": disk_blocks,
        "pool_blocks": pool_blocks,
        "block_bytes": block_bytes,
        "block_tokens": BLOCK_TOKENS,
        "seed": seed,
        "load_model": vars(load),
        "sessions": len(set(session_of)),
        "bound_saved_tokens": bound,
        "routings": routings,
        "vs_round_robin": ratios,
        "target": TARGET,
        "target_met": ratios["events"] is not None and ratios["events"] >= TARGET,
    }


def table(result: dict[str, Any]) -> str:
    """The three routings side by side. Pure."""
    gb = 1e9
    lines = [
        f"kvtier bench route: {result['trace']}, {result['requests']:,} requests, "
        f"{result['sessions']:,} sessions; {result['engines']} engines x (host "
        f"{result['host_blocks']:,} + disk {result['disk_blocks']:,} blocks), pool "
        f"{result['pool_blocks']:,} blocks; {result['block_bytes'] / 2**20:g} MiB blocks",
        f"{'routing':<12}{'saved tokens':>14}{'vs rr':>7}{'hit':>8}{'host':>8}{'disk':>8}"
        f"{'pool':>8}{'written GB h/d/p':>22}  requests per engine",
    ]
    for name, r in result["routings"].items():
        th, w = r["tier_hit_rate"], r["bytes_written"]
        ratio = result["vs_round_robin"][name]
        written = "/".join(f"{w[t] / gb:,.0f}" for t in TIERS)
        lines.append(
            f"{name:<12}{r['saved_tokens']:>14,}{ratio if ratio is not None else 'n/a':>7}"
            f"{100 * r['hit_rate']:>7.2f}%{100 * th['host']:>7.2f}%{100 * th['disk']:>7.2f}%"
            f"{100 * th['pool']:>7.2f}%"
            f"{written:>22}"
            f"  {r['requests_per_engine']}"
        )
    ev = result["routings"]["events"]
    lines.append(
        f"bound (one infinite cache): {result['bound_saved_tokens']:,} tokens; events router's "
        f"view exact at the end: {ev.get('router_view_exact')}; events / round robin "
        f"{result['vs_round_robin']['events']} (target {result['target']})"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Prefill tokens saved per routing (with the infinite-cache bound) and
    hit rate per tier, stacked, per routing."""
    plt = pyplot()

    names = list(result["routings"])
    rs = [result["routings"][n] for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    a.bar(names, [r["saved_tokens"] / 1e6 for r in rs], color=["#999999", "#6baed6", "#2171b5"])
    a.axhline(
        result["bound_saved_tokens"] / 1e6, color="black", ls="--", lw=1, label="one infinite cache"
    )
    for i, n in enumerate(names):
        ratio = result["vs_round_robin"][n]
        if ratio is not None:
            a.text(
                i,
                rs[i]["saved_tokens"] / 1e6,
                f"{ratio:.2f}x\nof round robin",
                ha="center",
                va="top",
                color="white",
            )
    a.set_ylabel("prefill tokens saved (millions)")
    a.legend(loc="lower right")
    bottom = [0.0] * len(rs)
    for tier, color in zip(TIERS, ("#31a354", "#fd8d3c", "#756bb1")):
        vals = [100 * r["tier_hit_rate"][tier] for r in rs]
        b.bar(names, vals, bottom=bottom, label=tier, color=color)
        bottom = [x + v for x, v in zip(bottom, vals)]
    b.set_ylabel("blocks hit (% of block references)")
    b.legend(title="tier")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"kvtier bench route: {Path(result['trace']).name}, {result['requests']:,} requests\n"
        f"{result['engines']} engines (host {result['host_blocks']:,}, disk "
        f"{result['disk_blocks']:,} blocks each), pool {result['pool_blocks']:,} blocks",
        fontsize=11,
    )
    save_figure(fig, path)
