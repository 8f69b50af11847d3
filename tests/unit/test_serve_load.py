"""The pure parts of ``kvtier bench serve --server``: the trace cut, the
metrics parse, the medians and ratios, the commands it runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvtier.bench.serve_load import (
    EngineSettings,
    Workloads,
    client_args,
    cut_trace,
    kvtier_extra,
    parse_metrics,
    repeat_order,
    server_command,
    summarize,
)
from kvtier.bench.serve_load_report import table
from kvtier.errors import InvalidArgument


def test_cut_trace_caps_lengths_cuts_hash_ids_and_counts_reuse(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 1000, "input_length": 1500, "output_length": 400, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 5000, "output_length": 3, "hash_ids": [0, 1, 7, 8, 9]},
        {"timestamp": 4000, "input_length": 100, "output_length": 9, "hash_ids": [5]},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    info = cut_trace(src, tmp_path / "cut.jsonl", max_requests=2, max_input=1024, max_output=32,
                     mode="head")  # fmt: skip
    out = [json.loads(x) for x in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert out == [
        {"timestamp": 0.0, "input_length": 1024, "output_length": 32, "hash_ids": [0, 1]},
        {"timestamp": 500.0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
    ]
    # 4 block references, the second request's two hit an unbounded cache.
    assert info == {"mode": "head", "requests": 2, "sessions": None, "span_s": 0.5,
                    "trace_span_s": 0.5, "input_tokens": 2048, "reusable_block_share": 0.5}  # fmt: skip


def test_sessions_cut_strides_returning_conversations_and_scales_to_the_rate(
    tmp_path: Path,
) -> None:
    """Conversations (same first two blocks) that return within the window,
    every k-th for the smallest k that fits, whole, in arrival order;
    one-turn conversations and single-block requests left out; the arrivals
    stretched or squeezed to the rate with their shape kept."""
    src = tmp_path / "t.jsonl"
    lines = [
        (0, [0, 1, 2]),  # A turn 1
        (10_000, [0, 5]),  # never returns
        (20_000, [0, 7, 8]),  # B turn 1
        (30_000, [9]),  # one block: its own conversation
        (50_000, [0, 1, 2, 3]),  # A turn 2
        (90_000, [0, 7, 8, 4]),  # B turn 2
        (100_000, [0, 20, 21]),  # C turn 1
        (110_000, [0, 20, 21, 22]),  # C turn 2
    ]
    src.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(h),
                                       "output_length": 8, "hash_ids": h}) + "\n"
                           for t, h in lines))  # fmt: skip
    info = cut_trace(src, tmp_path / "cut.jsonl", max_requests=4, max_input=4096, max_output=32,
                     rate=2.0)  # fmt: skip
    out = [json.loads(x) for x in (tmp_path / "cut.jsonl").read_text().splitlines()]
    # A, B and C make 6 turns: every 2nd conversation (A, C) fits in 4.
    assert [r["hash_ids"] for r in out] == [[0, 1, 2], [0, 1, 2, 3], [0, 20, 21], [0, 20, 21, 22]]
    # 3 gaps over 110 s of trace at 2 requests/s: 1.5 s.
    assert [r["timestamp"] for r in out] == [0.0, pytest.approx(681.818), pytest.approx(1363.636),
                                             1500.0]  # fmt: skip
    # 14 block references: A's 3 and C's 2 the second time, block 0 once more.
    assert info == {"mode": "sessions", "requests": 4, "sessions": 2, "span_s": 1.5,
                    "trace_span_s": 110.0, "input_tokens": 512 * 14,
                    "reusable_block_share": pytest.approx(7 / 14)}  # fmt: skip
    # A 60 s window: B's second turn is past it, so only A returns.
    info = cut_trace(src, tmp_path / "cut.jsonl", 4, 4096, 32, window_s=60)
    out = [json.loads(x) for x in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert [r["hash_ids"] for r in out] == [[0, 1, 2], [0, 1, 2, 3]] and info["sessions"] == 1
    with pytest.raises(InvalidArgument, match="trace cut 'tail'"):
        cut_trace(src, tmp_path / "c", 4, 4096, 32, mode="tail")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument, match="trace rate must be positive"):
            cut_trace(src, tmp_path / "c", 4, 4096, 32, rate=bad)
    src.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1,
                               "hash_ids": [0, 1]}) + "\n")  # fmt: skip
    with pytest.raises(InvalidArgument, match="no conversation returns"):
        cut_trace(src, tmp_path / "c", 4, 4096, 32)


def test_cut_trace_refuses_what_is_not_a_trace(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(InvalidArgument, match=r"t.jsonl:1: not a Mooncake-format trace"):
        cut_trace(src, tmp_path / "c", 10, 100, 10)
    src.write_text("\n")
    with pytest.raises(InvalidArgument, match="no requests"):
        cut_trace(src, tmp_path / "c", 10, 100, 10)


def test_parse_metrics_sums_label_sets_and_strips_total() -> None:
    text = "\n".join([
        "# HELP vllm:kv_offload_kvtier_loaded_host Chunks",
        'vllm:kv_offload_kvtier_loaded_host_total{engine="0",model_name="m"} 12.0',
        'vllm:kv_offload_kvtier_loaded_host_total{engine="1",model_name="m"} 3.0',
        'vllm:prompt_tokens_cached_total{engine="0"} 640.0',
        'vllm:kv_offload_kvtier_loaded_host_created{engine="0"} 1795616682.42',
        'vllm:prompt_tokens_total{engine="0"} 1000.0',
        "vllm:kv_offload_kvtier_host_busy 2",
        'vllm:other_total{engine="0"} 5.0',
    ])  # fmt: skip
    assert parse_metrics(text) == {
        "kvtier_loaded_host": 15.0, "prompt_tokens_cached": 640.0, "prompt_tokens": 1000.0,
        "kvtier_host_busy": 2.0,
    }  # fmt: skip


def _run(config: str, level: float, ttft: float, tps: float, rep: int = 0) -> dict:
    row = {"config": config, "workload": "prefix", "level": level, "repeat": rep,
           "completed": 4, "failed": 0, "prompt_tokens": 100.0, "cached_tokens": 10.0,
           "kvtier": dict.fromkeys(("loaded_host", "loaded_disk", "loaded_remote", "cascades",
                                    "cascades_dropped", "allocation_failures", "promotions",
                                    "load_failures"), 1.0)}  # fmt: skip
    for k in ("throughput_rps", "ttft_mean_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
              "itl_p50_s", "itl_p99_s"):  # fmt: skip
        row[k] = 1.0
    row["ttft_p50_s"], row["ttft_mean_s"], row["output_tps"] = ttft, ttft, tps
    return row


def test_summarize_takes_medians_then_ratios_and_the_share_of_the_ideal_reduction() -> None:
    runs = [
        _run("baseline", 1, 1.0, 100, 0), _run("baseline", 1, 3.0, 80, 1),
        _run("baseline", 1, 2.0, 90, 2),
        _run("ideal", 1, 0.5, 100), _run("host", 1, 0.8, 99),
    ]  # fmt: skip
    rows = {r["config"]: r for r in summarize(runs)}
    assert rows["baseline"]["runs"] == 3 and rows["baseline"]["ttft_p50_s"] == 2.0
    assert rows["baseline"]["output_tps"] == 90
    h = rows["host"]
    # paired with the baseline of its own repeat (0): 0.8 / 1.0, not 0.8 / 2.0
    assert h["vs_baseline"]["ttft_p50_s"] == pytest.approx(0.8)
    assert h["vs_ideal"]["output_tps"] == pytest.approx(0.99)
    # baseline 2.0, ideal 0.5, host 0.8: (2.0 - 0.8) / (2.0 - 0.5) = 0.8
    assert h["ttft_reduction_captured"]["p50"] == pytest.approx(0.8)
    assert rows["ideal"]["ttft_reduction_captured"]["mean"] == pytest.approx(1.0)


def test_ratios_are_medians_of_ratios_within_each_repeat() -> None:
    # The machine drifts between repeats: each repeat's ratio cancels it.
    base = [(1.0, 100), (3.0, 80), (2.0, 90)]
    host = [(0.5, 99), (1.2, 88), (1.2, 90)]
    runs = [_run("baseline", 1, t, tps, rep) for rep, (t, tps) in enumerate(base)]
    runs += [_run("host", 1, t, tps, rep) for rep, (t, tps) in enumerate(host)]
    h = {r["config"]: r for r in summarize(runs)}["host"]
    assert h["vs_baseline"]["ttft_p50_s"] == pytest.approx(0.5)  # 0.5, 0.4, 0.6
    assert h["vs_baseline"]["output_tps"] == pytest.approx(1.0)  # 0.99, 1.1, 1.0
    assert h["ttft_p50_s"] / 2.0 == pytest.approx(0.6)  # what a ratio of medians says
    # Without repeat indices: the ratio of the medians.
    for r in runs:
        del r["repeat"]
    h = {r["config"]: r for r in summarize(runs)}["host"]
    assert h["vs_baseline"]["ttft_p50_s"] == pytest.approx(0.6)


def test_commands_carry_the_same_engine_settings_and_kvtier_only_where_named(
    tmp_path: Path,
) -> None:
    s = EngineSettings()
    base = server_command("py", "/m", 8000, "baseline", s, None)
    ideal = server_command("py", "/m", 8000, "ideal", s, None)
    extra = kvtier_extra("host+disk", s, 131072, tmp_path, None)
    assert extra is not None
    assert extra["kvtier_host_bytes"] == s.large_blocks * 131072 // 3
    assert extra["kvtier_disk_path"] == str(tmp_path / "disk-host+disk")
    host = server_command("py", "/m", 8000, "host+disk", s, extra)
    assert base[base.index("--num-gpu-blocks-override") + 1] == str(s.small_blocks)
    assert ideal[ideal.index("--num-gpu-blocks-override") + 1] == str(s.large_blocks)
    assert host[: len(base)] == base  # the same engine settings, then the connector
    cfg = json.loads(host[host.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "KVTierConnector"
    assert kvtier_extra("baseline", s, 1, tmp_path, None) is None
    # The floor: the baseline's engine with a connector that moves nothing.
    assert kvtier_extra("connector-floor", s, 1, tmp_path, None) is None
    floor = server_command("py", "/m", 8000, "connector-floor", s, None)
    assert floor[: len(base)] == base
    floor_cfg = json.loads(floor[floor.index("--kv-transfer-config") + 1])
    assert floor_cfg["kv_connector_module_path"] == "kvtier.bench.null_connector"
    with pytest.raises(InvalidArgument, match="needs a Redis server"):
        kvtier_extra("host+redis", s, 1, tmp_path, None)
    args = client_args(
        "trace", 2.0, "http://h:1", "/m", Workloads(), tmp_path / "t", tmp_path / "r.json"
    )
    assert args[args.index("--timed-trace-sec-multiplier") + 1] == "0.002"
    with pytest.raises(InvalidArgument, match="unknown workload"):
        client_args("nope", 1, "u", "/m", Workloads(), None, tmp_path / "r.json")


def test_prefix_rate_sends_open_loop_arrivals_seeded_alike_for_every_configuration(
    tmp_path: Path,
) -> None:
    from kvtier.bench.serve_load_plan import levels

    w = Workloads(rates=(8.0, 2.0))
    assert levels("prefix-rate", w) == [2.0, 8.0]  # lightest first
    a = client_args("prefix-rate", 2.0, "http://h:1", "/m", w, None, tmp_path / "a.json")
    b = client_args("prefix-rate", 2.0, "http://h:2", "/m", w, None, tmp_path / "b.json")
    # Open loop: a rate and Poisson arrivals, no cap on requests in flight.
    assert a[a.index("--request-rate") + 1] == "2"
    assert a[a.index("--burstiness") + 1] == "1"
    assert "--max-concurrency" not in a
    assert a[a.index("--num-prompts") + 1] == str(w.rate_prompts)
    assert a[a.index("--prefix-repetition-num-prefixes") + 1] == str(w.rate_prefix_count)
    # The same arrival instants whatever the server: the seed depends on
    # the workload and level only, and differs from the closed loop's.
    assert a[a.index("--seed") + 1] == b[b.index("--seed") + 1]
    c = client_args("prefix", 2, "http://h:1", "/m", w, None, tmp_path / "c.json")
    assert c[c.index("--seed") + 1] != a[a.index("--seed") + 1]


@pytest.mark.parametrize("rates", ["0", "-1", "nan", "inf", "four", ""])
def test_bench_serve_refuses_rates_that_are_not_positive_numbers(
    rates: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    # Refused before the engine's Python is looked at (this one does not exist).
    argv = ["bench", "serve", "--server", "--python", "/nonexistent/python", "--rates", rates]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: --rates: ")
    assert repr(rates) in err


def test_each_configuration_runs_once_in_every_position_over_as_many_repeats() -> None:
    configs = ["baseline", "ideal", "host", "host+redis", "second-server"]
    orders = [repeat_order(configs, rep) for rep in range(5)]
    assert orders[0] == ["baseline", "ideal", "host", "host+redis", "second-server"]
    assert orders[1] == ["ideal", "host", "host+redis", "second-server", "baseline"]
    assert orders[2] == ["host", "host+redis", "second-server", "baseline", "ideal"]
    assert orders[3] == ["host+redis", "second-server", "baseline", "ideal", "host"]
    assert orders[4] == orders[0]  # four rotating configurations: period 4
    # Without second-server (which follows host+redis), every configuration
    # takes every place once in four repeats.
    rotating = [[c for c in o if c != "second-server"] for o in orders[:4]]
    for c in ("baseline", "ideal", "host", "host+redis"):
        assert sorted(o.index(c) for o in rotating) == [0, 1, 2, 3]


def test_the_interval_of_a_median_is_the_order_statistics_with_exact_coverage() -> None:
    from kvtier.bench.serve_load_report import median_interval

    six = [1.1, 0.9, 0.8, 1.0, 1.2, 0.7]
    # n = 6: only the range covers 95% (1 - 2 / 64).
    assert median_interval(six) == {"lo": 0.7, "hi": 1.2, "confidence": 0.9688}
    # n = 10: the 2nd and 9th values, 1 - 2 * 11 / 1024.
    ten = [float(v) for v in range(10, 0, -1)]
    assert median_interval(ten) == {"lo": 2.0, "hi": 9.0, "confidence": 0.9785}
    # n = 3 cannot reach 95%: the range, and its 75% said.
    assert median_interval([3.0, float("nan"), 1.0, 2.0]) == {
        "lo": 1.0,
        "hi": 3.0,
        "confidence": 0.75,
    }
    assert math.isnan(median_interval([])["lo"])


def test_summarize_and_the_table_give_each_ratio_its_interval() -> None:
    base = [(1.0, 100), (3.0, 80), (2.0, 90)]
    host = [(0.5, 99), (1.2, 88), (1.2, 90)]
    runs = [_run("baseline", 1, t, tps, rep) for rep, (t, tps) in enumerate(base)]
    runs += [_run("host", 1, t, tps, rep) for rep, (t, tps) in enumerate(host)]
    rows = summarize(runs)
    h = {r["config"]: r for r in rows}["host"]
    iv = h["vs_baseline_interval"]["output_tps"]
    assert (iv["lo"], iv["hi"], iv["confidence"]) == (pytest.approx(0.99), pytest.approx(1.1), 0.75)
    assert h["vs_ideal_interval"] is None  # no ideal in this run
    text = table({"settings": {}, "rows": rows})
    assert "  host            prefix           1  out tok/s 1.00 [0.99, 1.10, 75%]" in text
