"""``kvtier bench COMPONENT``'s arguments: one sub-parser per component, each
with only the flags that component reads, so ``kvtier bench soak --help``
shows the soak's and a flag of another component is argparse's error (exit
status 2), as ``vllm bench serve`` does.

A command-line tool's module: runs in the ``kvtier`` process, never imported
by the library. Who calls: :func:`kvtier.bench.commands.add_bench_parser`
(which :func:`kvtier.cli.build_parser` calls) and ``docs/gen_cli.py``
through it. Builds parsers only: imports nothing heavy, never blocks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvtier.options.surfaces import add_tls_arguments

__all__ = ["COMPONENTS", "add_bench_parser"]

Parser = argparse.ArgumentParser
Group = argparse._ActionsContainer  # a parser or one of its argument groups
#: Component -> what it measures, against what (``kvtier bench --help``).
COMPONENTS = {
    "copy": "host pool copies against memcpy; --device cpu or cuda: DeviceTransfer against "
    "a memcpy of the same descriptors, or torch's copies and the pinned-copy ceiling",
    "manager": "the manager's cost per key: lookup, store and load cycles, no data moved",
    "disk": "the disk tier's store and load throughput against fio on the same directory",
    "disk-index": "what the disk tier's index costs per record (memory, rates, restart)",
    "remote": "the remote tier's store and load throughput against redis-benchmark and redis-py",
    "vllm": "kvtier against vLLM's own offloading manager and fs tier, same run",
    "serve": "a live vLLM engine per configuration: prefill saved, TTFT "
    "(--server: vLLM's OpenAI server under concurrent load)",
    "soak": "minutes of replay (--server: serving) under injected faults, every load checked",
    "sglang": "kvtier's SGLang HiCache backend against SGLang's file backend and redis-py",
    "route": "routing requests by the tiers' events against round robin, simulated fleet",
    "node": "two live vLLM servers behind a round robin: one shared node against a host tier "
    "each and one server alone, and an engine's restart against none",
}


class _Component(argparse.ArgumentParser):
    """A component's parser: a flag it does not take is its own error (its
    usage, exit status 2), saying which components take that flag."""

    owners: dict[str, list[str]]  # flag -> the components that take it (all of bench's)

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            where = [
                f"{a} is a flag of {', '.join(self.owners[a])}"
                for a in dict.fromkeys(x.split("=", 1)[0] for x in extra)
                if a in self.owners
            ]
            self.error(
                f"unrecognized arguments: {' '.join(extra)}" + "".join(f"; {w}" for w in where)
            )
        return ns, extra


def _common(p: Parser, out: str, json_path: bool, json_when: str = "") -> None:
    """``--out`` (``--results-dir``, its old name) and ``--json``.
    ``out``: where results go unasked; ``json_path``: the component also
    writes its JSON to ``--json PATH`` (``json_when``: in that case only)."""
    p.add_argument(
        "--out",
        help=f"save results with machine facts in this directory ({out} of the repo, "
        "else a printed temporary directory)",
    )
    p.add_argument("--results-dir", dest="out", help=argparse.SUPPRESS)
    if json_path:
        p.add_argument(
            "--json",
            nargs="?",
            const="-",
            metavar="PATH",
            help=f"print only the JSON (last line); {json_when}--json PATH: the table, and "
            "the JSON written to PATH",
        )
    else:
        p.add_argument("--json", action="store_true", help="print the JSON (last line)")


def _repeats(p: Group, default: int, more: str = "") -> None:
    p.add_argument("--repeats", type=int, help=f"repeats (default {default}{more})")


def _block_bytes(p: Group, default: str) -> None:
    p.add_argument("--block-bytes", help=f"one block size (default {default})")


def _scratch(p: Parser) -> None:
    p.add_argument(
        "--dir",
        help="directory on the device to measure "
        "(default: build/bench-disk of the repo, else a temporary directory)",
    )


def _trace(p: Group) -> None:
    """``--trace`` and ``--time-scale``: a Mooncake trace replayed on its clock."""
    p.add_argument(
        "--trace",
        help="Mooncake-format JSONL trace to replay "
        "(default: ../shared/traces/mooncake_conversation_trace.jsonl if there)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the trace's inter-arrival times multiplied by this (default 1)",
    )


def _copy(p: Parser) -> None:
    _block_bytes(p, "host: 64KiB, 256KiB and 2MiB; cpu: 256KiB; not with cuda")
    _repeats(p, 5, "; --device cuda --quick: 2")
    p.add_argument(
        "--device",
        choices=["host", "cpu", "cuda"],
        default="host",
        help="host: pool<->buffer copies; cpu: DeviceTransfer with a CPU KV cache; cuda: "
        "DeviceTransfer on this GPU against torch's copies and the pinned-copy ceiling "
        "(needs torch with CUDA; --json PATH writes the JSON there too)",
    )
    o = p.add_argument_group("--device cuda")
    o.add_argument("--tokens", help="tokens per block, comma-separated (default 16,64,256,512)")
    o.add_argument(
        "--layouts", help="comma-separated of per_layer, kv_split, cross_layer, mla (default all)"
    )
    o.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (64 MiB per run, 16 and 256 tokens, 2 repeats)",
    )
    _common(p, "'' to skip; default: build/bench", True, json_when="with --device cuda, ")


def _manager(p: Parser) -> None:
    p.add_argument("--keys", type=int, default=1_000_000, help="distinct keys")
    p.add_argument("--policy", default="lru", help="the host tier's eviction policy")
    p.add_argument(
        "--node",
        action="store_true",
        help="through a kvtier node (a child process) as well: one client, then --clients at "
        "once, against the in-process manager of the same run",
    )
    p.add_argument("--clients", type=int, default=4, help="with --node: clients at once")
    p.add_argument(
        "--shared-index",
        action="store_true",
        help="with --node: the node's shared index as well (kvtier node --shared-index)",
    )
    p.add_argument(
        "--no-round-trips",
        action="store_true",
        help="with --shared-index: skip the node without it (at the default size its run at "
        "one key a call, a round trip a call, takes about half an hour)",
    )
    p.add_argument(
        "--events",
        action="store_true",
        help="with --node: the engines take KV events, and the in-process manager makes them "
        "(vLLM's enable_kv_cache_events; off by default, as in vLLM)",
    )
    _repeats(p, 3, ", the median reported")
    _common(p, "'' to skip; default: build/bench", json_path=False)


def _disk(p: Parser) -> None:
    _block_bytes(p, "256KiB and 2MiB")
    _repeats(p, 5)
    _scratch(p)
    p.add_argument("--queue-depth", type=int, default=32, help="I/O queue depth")
    p.add_argument("--total", default="1GiB", help="bytes per run")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "io_uring", "pread"],
        help="the disk tier's I/O backend (auto: io_uring where the kernel allows it)",
    )
    _common(p, "'' to skip; default: build/bench", json_path=False)


def _disk_index(p: Parser) -> None:
    p.add_argument("--records", type=int, default=1_000_000, help="records to store")
    p.add_argument("--policy", default="lru", help="the disk tier's eviction policy")
    _common(p, "'' to skip; default: build/bench", json_path=True)


def _remote(p: Parser) -> None:
    _block_bytes(p, "256KiB and 2MiB")
    _repeats(p, 5)
    p.add_argument(
        "--total", default="1GiB", help="each client stores and loads half of it per run"
    )
    p.add_argument("--url", help="redis://HOST:PORT (default: start a local server)")
    p.add_argument(
        "--tls",
        action="store_true",
        help="without --url, the local server also serves TLS; kvtier's runs alternate "
        "between its plain and TLS ports (the ratio is TLS's cost)",
    )
    add_tls_arguments(p)
    p.add_argument(
        "--connections",
        type=int,
        help="connections (worker threads; default: the remote tier's, chosen from this machine)",
    )
    p.add_argument(
        "--peer",
        action="append",
        choices=["lmcache"],
        default=[],
        help="also run this client on the same server, alternating with kvtier: lmcache "
        "(LMCache 0.5.6's native client from its PyPI wheel, cached under build/bench-peers)",
    )
    _common(p, "'' to skip; default: build/bench", json_path=False)


def _vllm(p: Parser) -> None:
    _block_bytes(p, "256KiB and 2MiB")
    _repeats(p, 5)
    _scratch(p)
    p.add_argument(
        "--trace", help="Mooncake-format JSONL trace to replay through both (default: synthetic)"
    )
    _common(p, "'' to skip; default: build/bench", json_path=False)


def _serve(p: Parser) -> None:
    _repeats(p, 3)
    p.add_argument("--python", help="a Python with vLLM's engine and kvtier (default: this one)")
    p.add_argument("--configs", help="comma-separated configurations (default: all)")
    p.add_argument(
        "--model-kind",
        default="llama",
        choices=["llama", "gemma3", "mla", "hybrid"],
        help="the generated model (default llama; mla runs in bfloat16 on vLLM's AMX backend; "
        "hybrid: Qwen3-Next-shaped, Gated DeltaNet and attention layers, bfloat16, 544-token "
        "blocks, one request at a time only)",
    )
    o = p.add_argument_group("without --server (chat sessions, one engine in-process)")
    o.add_argument("--sessions", type=int, default=6, help="chat sessions")
    o.add_argument("--system-tokens", type=int, default=2000, help="system prompt tokens")
    o.add_argument("--turns", type=int, default=3, help="turns per session")
    o = p.add_argument_group("--server (concurrent load)")
    o.add_argument(
        "--server",
        action="store_true",
        help="vLLM's OpenAI server per configuration, driven by vLLM's own `vllm bench serve` "
        "client (configurations baseline, ideal, connector-floor, host, host+disk, host+redis, "
        "host+disk+redis, second-server)",
    )
    _trace(o)
    o.add_argument("--max-requests", type=int, help="trace requests (default 60)")
    o.add_argument(
        "--trace-cut",
        default="sessions",
        choices=["sessions", "head"],
        help="every turn of every k-th conversation that returns within the trace's first 10 "
        "minutes, arriving at 1 request/s at time scale 1 (sessions, default), or the trace's "
        "first requests on its own clock (head)",
    )
    o.add_argument("--concurrencies", default="1,4", help="prefix and random load levels")
    o.add_argument(
        "--rates", default="4", help="prefix-rate's load levels, requests per second (default 4)"
    )
    o.add_argument(
        "--lower-writes",
        default="on_store",
        choices=["on_store", "on_reuse"],
        help="kvtier_lower_writes of every kvtier configuration (default on_store)",
    )
    o.add_argument("--workloads", help="comma-separated: trace, prefix, prefix-rate, random")
    p.add_argument(
        "--out",
        help="save results, plots and models in this directory (default: build/bench-serve, "
        "--server: build/bench-serve-load, of the repo, else a printed temporary directory)",
    )
    p.add_argument("--results-dir", dest="out", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the JSON (last line)")


def _soak(p: Parser) -> None:
    p.add_argument(
        "--minutes",
        type=float,
        default=2.0,
        help="minutes of replay (--server: of serving) under faults (default 2; the docs quote 30)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and fault seed")
    p.add_argument(
        "--server",
        action="store_true",
        help="a live vLLM server with kvtier (host, disk, Redis) under open-loop requests and "
        "faults, its tokens checked against a reference server without kvtier (needs "
        "--python's vLLM)",
    )
    p.add_argument(
        "--python", help="--server: a Python with vLLM's engine and kvtier (default: this one)"
    )
    _common(
        p,
        "'' to skip; default: build/bench/soak, --server: build/bench/soak-server",
        json_path=False,
    )


def _sglang(p: Parser) -> None:
    _repeats(p, 3)
    _scratch(p)
    p.add_argument("--url", help="redis://HOST:PORT (default: start a local server)")
    _common(p, "'' to skip; default: build/bench", json_path=True)


def _route(p: Parser) -> None:
    _trace(p)
    p.add_argument("--max-requests", type=int, help="replay the first M requests (default: all)")
    p.add_argument(
        "--seed", type=int, default=0, help="the engine round robin and new sessions start at"
    )
    o = p.add_argument_group("sizes, in blocks of 512 tokens")
    _block_bytes(o, "160MiB")
    o.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    for flag, default, what in (
        ("--host-blocks", 3200, "each engine's host tier (default 3,200: 500 GiB)"),
        ("--disk-blocks", 22000, "each engine's disk tier (default 22,000: 3.4 TiB)"),
        ("--pool-blocks", 6400, "the shared pool (default 6,400: 1 TiB)"),
    ):
        o.add_argument(flag, type=int, default=default, help=what)
    _common(p, "'' to skip; default: build/bench-route", json_path=True)


def _node(p: Parser) -> None:
    p.add_argument("--python", help="a Python with vLLM's engine and kvtier (default: this one)")
    p.add_argument(
        "--configs",
        help="comma-separated, of none (always run), split, node, single, split-restart, "
        "node-restart (default: all)",
    )
    p.add_argument(
        "--trace",
        help="Mooncake-format JSONL trace (default: "
        "../shared/traces/mooncake_conversation_trace.jsonl if there)",
    )
    p.add_argument(
        "--max-requests", type=int, default=40, help="requests of the sessions cut (default 40)"
    )
    p.add_argument("--max-input", type=int, default=4000, help="prompt tokens cap (default 4000)")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens cap (default 4)")
    p.add_argument(
        "--host-share",
        type=float,
        default=1.0,
        help="total host memory as a share of the cut's working set (default 1)",
    )
    _common(p, "'' to skip; default: build/bench-node", json_path=True)


_ADD: dict[str, Callable[[Parser], None]] = {
    "copy": _copy,
    "manager": _manager,
    "disk": _disk,
    "disk-index": _disk_index,
    "remote": _remote,
    "vllm": _vllm,
    "serve": _serve,
    "soak": _soak,
    "sglang": _sglang,
    "route": _route,
    "node": _node,
}


def add_bench_parser(
    sub: argparse._SubParsersAction[Parser], run: Callable[[argparse.Namespace], int]
) -> None:
    """The ``bench`` subcommand, with a sub-parser per component (its name
    in ``args.component``), each running ``run``."""
    b = sub.add_parser(
        "bench",
        help="measure a component against its baseline",
        description="Measure a component against its baseline, measured in the same run. "
        "`kvtier bench COMPONENT --help` lists that component's flags.",
    )
    components = b.add_subparsers(
        dest="component", required=True, metavar="COMPONENT", parser_class=_Component
    )
    owners: dict[str, list[str]] = {}
    for name, add in _ADD.items():
        p = components.add_parser(name, help=COMPONENTS[name], description=COMPONENTS[name])
        add(p)
        p.set_defaults(func=run)
        assert isinstance(p, _Component)
        p.owners = owners
        for a in p._actions:
            if a.help != argparse.SUPPRESS:
                for flag in a.option_strings:
                    owners.setdefault(flag, []).append(name)
