"""``kvtier bench COMPONENT``: its arguments and what each component runs.

A command-line tool: runs in the ``kvtier`` process (never imported by the
library). Who calls: :func:`kvtier.cli.build_parser` adds the subcommand with
:func:`add_bench_parser`; :func:`kvtier.cli.main` runs it. Blocks for the
whole benchmark. Results go to ``--out`` (default: ``build/...`` of the
checkout, else a printed temporary directory; see
:func:`kvtier.bench.harness.output_dir`), never into bench/results unasked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvtier.bench.harness import print_json_last
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.options.surfaces import tls_settings


def _scratch_dir(args: argparse.Namespace) -> str:
    """``--dir``, else ``build/bench-disk`` of the repo (or a printed temporary
    directory): a bench never writes into the current directory unasked."""
    from kvtier.bench.harness import default_output_dir

    if args.dir:
        return str(args.dir)
    d = default_output_dir("bench-disk")
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvtier.bench.harness import output_dir, save_result
    from kvtier.units import parse_size

    if args.component == "serve":
        return _cmd_bench_serve(args)
    if args.component == "soak":
        return _cmd_bench_soak(args)
    if args.component == "disk-index":
        return _cmd_bench_disk_index(args)
    if args.component == "sglang":
        return _cmd_bench_sglang(args)
    if args.component == "route":
        return _cmd_bench_route(args)
    if args.component == "node":
        return _cmd_bench_node(args)
    if args.component == "copy" and args.device == "cuda":
        return _cmd_bench_copy_cuda(args)
    args.repeats = args.repeats or (3 if args.component == "manager" else 5)
    if args.component == "copy":
        sizes = [parse_size(args.block_bytes)] if args.block_bytes else None
        if args.device == "cpu":
            from kvtier.bench.device import run_device_copy

            results = [run_device_copy(s, repeats=args.repeats) for s in (sizes or [262144])]
        else:
            from kvtier.bench.copy import DEFAULT_SIZES, run_copy

            results = [run_copy(s, repeats=args.repeats) for s in (sizes or DEFAULT_SIZES)]
    elif args.component == "disk":
        from kvtier.bench.disk import run_disk

        sizes = [parse_size(args.block_bytes)] if args.block_bytes else [262144, 2 << 20]
        results = [
            run_disk(
                _scratch_dir(args),
                s,
                args.queue_depth,
                parse_size(args.total),
                args.repeats,
                args.backend,
            )
            for s in sizes
        ]
    elif args.component == "remote":
        from kvtier.bench.remote import run_remote, run_remote_tls

        sizes = [parse_size(args.block_bytes)] if args.block_bytes else [262144, 2 << 20]
        tls = tls_settings(args)
        if args.tls and args.url:
            raise InvalidArgument(
                "--tls measures TLS on a local server; for a server of yours give a rediss:// --url"
            )
        if args.tls:
            results = [
                run_remote_tls(s, parse_size(args.total) // 2, args.repeats, args.connections)
                for s in sizes
            ]
        else:
            results = [
                run_remote(
                    args.url,
                    s,
                    parse_size(args.total) // 2,
                    args.repeats,
                    args.connections,
                    tls,
                    peers=args.peer,
                )
                for s in sizes
            ]
    elif args.component == "vllm":
        from kvtier.bench.vllm_managers import run_vllm

        chunks = (parse_size(args.block_bytes),) if args.block_bytes else (262144, 2 << 20)
        results = [run_vllm(_scratch_dir(args), chunks, args.repeats or 3, trace_path=args.trace)]
    elif args.component == "manager":
        from kvtier.bench.manager import run_manager

        if args.no_round_trips and not (args.node and args.shared_index):
            raise InvalidArgument("--no-round-trips needs --node --shared-index: no node would run")
        results = [run_manager(num_keys=args.keys, policy=args.policy, repeats=args.repeats)]
        if args.node:
            from kvtier.bench.node import run_node_manager

            ev = args.events
            if not args.no_round_trips:
                results.append(
                    run_node_manager(args.keys, args.policy, args.repeats, args.clients, events=ev)
                )
            if args.shared_index:
                results.append(
                    run_node_manager(
                        args.keys, args.policy, args.repeats, args.clients, True, events=ev
                    )
                )
    else:  # pragma: no cover - argparse restricts choices
        raise KvtierError(f"unknown component {args.component}")
    out = output_dir(args.out, "bench")
    for r in results:
        path = save_result(r, out)
        if not args.json:
            _print_human(r)
            if path:
                print(f"  saved {path}")
    if args.json:
        for r in results[:-1]:
            print(json.dumps(r))
        print_json_last(results[-1])
    return 0


def _cmd_bench_copy_cuda(args: argparse.Namespace) -> int:
    """``kvtier bench copy --device cuda``: see :mod:`kvtier.bench.device_cuda`.
    Without a CUDA GPU: InvalidArgument (one line, status 2) before any work."""
    from kvtier.bench.device_cuda import settings
    from kvtier.bench.device_cuda_report import plot, table
    from kvtier.bench.device_cuda_run import run_device_cuda
    from kvtier.bench.harness import output_dir, save_result

    if args.block_bytes:
        raise InvalidArgument("--device cuda measures vLLM's block sizes: give --tokens")
    s = settings(args.tokens, args.layouts, args.repeats, args.quick)
    result = run_device_cuda(s, progress=lambda m: print(m, file=sys.stderr, flush=True))
    path = save_result(result, output_dir(args.out, "bench"))
    text = table(result)
    if path is not None:
        try:
            plot(result, path.with_suffix(".png"))
            text += f"\n  plot  {path.with_suffix('.png')}"
        except ImportError:  # matplotlib is the bench extra's
            pass
    return _table_or_json(args, result, text, path)


def _cmd_bench_disk_index(args: argparse.Namespace) -> int:
    from kvtier.bench.disk_index import run_disk_index, table
    from kvtier.bench.harness import output_dir, save_result

    if args.records < 1:
        raise InvalidArgument(f"--records must be >= 1, got {args.records}")
    result = run_disk_index(args.records, args.policy)
    path = save_result(result, output_dir(args.out, "bench"))
    return _table_or_json(args, result, f"[disk-index] {result['note']}\n{table(result)}", path)


def _cmd_bench_sglang(args: argparse.Namespace) -> int:
    """``kvtier bench sglang``: see :mod:`kvtier.bench.sglang`."""
    from kvtier.bench.harness import output_dir, save_result
    from kvtier.bench.sglang import run_sglang, table

    result = run_sglang(_scratch_dir(args), args.url, args.repeats or 3)
    path = save_result(result, output_dir(args.out, "bench"))
    return _table_or_json(args, result, table(result), path)


def _cmd_bench_route(args: argparse.Namespace) -> int:
    """``kvtier bench route``: see :mod:`kvtier.bench.route`. Blocks for
    its three replays (seconds for the whole Mooncake trace)."""
    from kvtier.bench.harness import output_dir
    from kvtier.bench.route import plot, run_route, table
    from kvtier.bench.route_fleet import LoadModel
    from kvtier.bench.serve_load_plan import default_trace
    from kvtier.bench.traces import read_records
    from kvtier.units import parse_size

    trace = args.trace or default_trace()
    if trace is None:
        raise InvalidArgument("bench route needs --trace FILE (no default trace here)")
    if args.max_requests is not None and args.max_requests < 1:
        raise InvalidArgument(f"--max-requests must be >= 1, got {args.max_requests}")
    if not args.time_scale > 0 or args.seed < 0:
        raise InvalidArgument("--time-scale must be > 0 and --seed >= 0")
    result = run_route(
        read_records(trace, args.max_requests),
        args.engines,
        args.host_blocks,
        args.disk_blocks,
        args.pool_blocks,
        parse_size(args.block_bytes or "160MiB"),
        seed=args.seed,
        load=LoadModel(time_scale=args.time_scale),
        source=str(trace),
        progress=None if args.json == "-" else (lambda m: print(f"  {m}", flush=True)),
    )
    out = output_dir(args.out, "bench-route")
    saved = None
    text = table(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        saved = out / f"route-{time.strftime('%Y%m%dT%H%M%S')}.json"
        saved.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, saved.with_suffix(".png"))
        text += f"\n  plot  {saved.with_suffix('.png')}"
    return _table_or_json(args, result, text, saved)


def _cmd_bench_node(args: argparse.Namespace) -> int:
    """``kvtier bench node``: see :mod:`kvtier.bench.node_serve`. Blocks for
    every configuration's servers (minutes)."""
    from pathlib import Path

    from kvtier.bench.harness import default_output_dir
    from kvtier.bench.node_serve import CONFIGS, run_node_bench, table
    from kvtier.bench.serve import check_engine_python
    from kvtier.bench.serve_load_plan import default_trace

    trace = args.trace or default_trace()
    if trace is None:
        raise InvalidArgument("bench node needs --trace FILE (no default trace here)")
    if args.max_requests < 2 or args.max_input < 1 or args.max_tokens < 1:
        raise InvalidArgument("--max-requests must be >= 2, --max-input and --max-tokens >= 1")
    if not args.host_share > 0:
        raise InvalidArgument(f"--host-share must be > 0, got {args.host_share}")
    python = args.python or sys.executable
    check_engine_python(python)
    out = Path(args.out) if args.out else default_output_dir("bench-node")
    result = run_node_bench(
        out,
        python,
        Path(trace),
        configs=tuple(args.configs.split(",")) if args.configs else CONFIGS,
        max_requests=args.max_requests,
        max_input=args.max_input,
        max_tokens=args.max_tokens,
        host_share=args.host_share,
        say=(lambda _: None) if args.json == "-" else (lambda m: print(f"  {m}", flush=True)),
    )
    saved = out / f"node-{time.strftime('%Y%m%dT%H%M%S')}.json"
    saved.write_text(json.dumps(result, indent=2) + "\n")
    return _table_or_json(args, result, table(result), saved)


def _table_or_json(args: argparse.Namespace, result: dict[str, Any], text: str, saved: Any) -> int:
    """``--json`` (no PATH): the JSON as the last line, nothing else; else
    ``text`` and where the result was saved, and with ``--json PATH`` the
    JSON written to PATH too."""
    from pathlib import Path

    if args.json == "-":
        print_json_last(result)
        return 0
    print(text)
    if saved:
        print(f"  saved {saved}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"  wrote {args.json}")
    return 0


def _cmd_bench_serve_load(args: argparse.Namespace) -> int:
    """``kvtier bench serve --server``: see :mod:`kvtier.bench.serve_load`."""
    import subprocess
    from pathlib import Path

    from kvtier.bench.harness import default_output_dir
    from kvtier.bench.serve import check_engine_python
    from kvtier.bench.serve_load import (
        CONFIGS,
        WORKLOADS,
        EngineSettings,
        Workloads,
        default_trace,
        plot,
        report_json,
        run_load,
        table,
    )

    if args.model_kind == "hybrid":
        raise InvalidArgument(
            "--server --model-kind hybrid: the hybrid model needs 544-token blocks in bfloat16, "
            "which --server's engine settings do not take; run it without --server"
        )
    out = Path(args.out) if args.out else default_output_dir("bench-serve-load")
    configs = tuple(args.configs.split(",")) if args.configs else CONFIGS
    names = tuple(args.workloads.split(",")) if args.workloads else WORKLOADS
    trace = Path(args.trace) if args.trace else default_trace()
    if trace is None and "trace" in names:
        if args.workloads:
            raise InvalidArgument("the trace workload needs --trace FILE (no default trace here)")
        names = tuple(n for n in names if n != "trace")
    if trace is not None and not trace.exists():
        raise InvalidArgument(f"--trace {trace}: no such file")
    try:
        conc = tuple(int(c) for c in args.concurrencies.split(","))
    except ValueError:
        raise InvalidArgument(f"--concurrencies: integers, got {args.concurrencies!r}") from None
    try:
        rates = tuple(float(r) for r in args.rates.split(","))
    except ValueError:
        raise InvalidArgument(f"--rates: numbers, got {args.rates!r}") from None
    args.max_requests = 60 if args.max_requests is None else args.max_requests
    if not conc or min(conc) < 1 or args.time_scale <= 0 or args.max_requests < 1:
        raise InvalidArgument("--concurrencies, --time-scale and --max-requests must be positive")
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise InvalidArgument(f"--rates: positive, finite requests per second, got {args.rates!r}")
    python = args.python or sys.executable
    check_engine_python(python)  # after the flags: a typo is refused before vLLM is imported
    model_dir = out / f"model-{args.model_kind}"
    subprocess.run(
        [python, "-m", "kvtier.bench.vllm_engine", "make-model", str(model_dir), args.model_kind],
        check=True,
        capture_output=True,
        timeout=600,
    )
    result = run_load(
        out,
        python,
        str(model_dir),
        configs=configs,
        repeats=args.repeats or 3,
        settings=EngineSettings(lower_writes=args.lower_writes),
        workloads=Workloads(
            trace=trace,
            trace_cut=args.trace_cut,
            time_scale=args.time_scale,
            max_requests=args.max_requests,
            concurrencies=conc,
            rates=rates,
            names=names,
        ),
        progress=None if args.json else (lambda m: print(f"  {m}", flush=True)),
    )
    base = out / f"serve-load-{time.strftime('%Y%m%dT%H%M%S')}"
    report = base.with_name(base.name + "-report.json")
    report.write_text(json.dumps(report_json(result), indent=2) + "\n")
    return _save_and_show(args, result, base, plot, table, f"  report {report}\n")


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.server:
        return _cmd_bench_serve_load(args)

    from kvtier.bench.harness import default_output_dir
    from kvtier.bench.serve import CONFIGS, plot, run_serve, table
    from kvtier.bench.vllm_engine import Sessions

    out = Path(args.out) if args.out else default_output_dir("bench-serve")
    configs = tuple(args.configs.split(",")) if args.configs else CONFIGS
    result = run_serve(
        out,
        python=args.python,
        configs=configs,
        repeats=args.repeats or 3,
        workload=Sessions(
            sessions=args.sessions, system_tokens=args.system_tokens, turns=args.turns
        ),
        progress=not args.json,
        model_kind=args.model_kind,
    )
    stamp = result["machine"]["time"].replace(":", "").replace("-", "")
    return _save_and_show(args, result, out / f"serve-{stamp}", plot, table)


def _save_and_show(
    args: argparse.Namespace,
    result: dict[str, Any],
    base: Any,
    plot: Callable[[dict[str, Any], Any], None],
    table: Callable[[dict[str, Any]], str],
    more: str = "",
) -> int:
    """Write ``result`` to BASE.json and its plot to BASE.png; print the
    JSON's last line (``--json``) or the table and where they went. Blocks
    for the plot."""
    path, png = base.with_name(base.name + ".json"), base.with_name(base.name + ".png")
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png)
    if args.json:
        print_json_last(result)
    else:
        print(table(result))
        print(f"  saved {path}\n{more}  plot  {png}")
    return 0


def _cmd_bench_soak(args: argparse.Namespace) -> int:
    from kvtier.bench.harness import output_dir
    from kvtier.bench.soak import SoakConfig, report, run_soak

    if not 1 <= args.minutes <= 24 * 60:  # (NaN fails too) a minute holds one round of faults
        raise InvalidArgument(f"--minutes must be in [1, 1440], got {args.minutes}")
    if args.server:
        return _cmd_bench_soak_server(args)
    result = run_soak(
        SoakConfig(minutes=args.minutes, seed=args.seed),
        output_dir(args.out, "bench/soak"),
        progress=not args.json,
        log=(lambda _: None) if args.json else print,
    )
    if args.json:
        print_json_last(result)
    else:
        print(report(result))
        if "json_path" in result:
            print(f"  saved {result['json_path']}\n  plot  {result['plot_path']}")
    return 0 if result["passed"] else 1


def _cmd_bench_soak_server(args: argparse.Namespace) -> int:
    from kvtier.bench.soak_server import main_soak_server

    return main_soak_server(args)


def _print_human(r: dict[str, Any]) -> None:
    keys = [k for k, v in r.items() if not isinstance(v, (dict, list))]
    print(f"[{r['component']}]")
    for k in keys:
        if k != "component":
            print(f"  {k:>22}: {r[k]}")


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``bench`` subcommand: a sub-parser per component, with only its
    flags (:mod:`kvtier.bench.parsers`), each run by :func:`_cmd_bench`."""
    from kvtier.bench.parsers import add_bench_parser as add

    add(sub, _cmd_bench)
