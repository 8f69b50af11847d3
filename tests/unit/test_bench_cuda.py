"""``kvtier bench copy --device cuda`` where there is no GPU: its arguments,
its refusal (one line, exit status 2, before any work), and the pure parts
of kvtier.bench.device_cuda: vLLM's layout arithmetic, how much a run
moves, the report's table and plot. The measurements themselves need a GPU
(``make gpu-check`` runs them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from kvtier.bench.device_cuda import (
    GIB,
    LAYOUTS,
    blocks_per_run,
    repeats_within,
    settings,
    shape_of,
)
from kvtier.bench.device_cuda_report import plot, table
from kvtier.cli import build_parser, main
from kvtier.errors import InvalidArgument

MIB = 1 << 20


def test_the_layouts_are_vllms_for_a_32_layer_model() -> None:
    page = 2 * 16 * 8 * 128 * 2  # K and V, 16 tokens, 8 heads of 128, bfloat16
    got = {name: shape_of(name, 16) for name in LAYOUTS}
    assert (got["per_layer"].tensors, got["per_layer"].page_bytes) == (32, page)
    assert (got["kv_split"].tensors, got["kv_split"].page_bytes) == (64, page // 2)
    assert (got["cross_layer"].tensors, got["cross_layer"].page_bytes) == (1, 32 * page)
    assert (got["mla"].tensors, got["mla"].page_bytes) == (32, 16 * 576 * 2)
    for name in ("per_layer", "kv_split", "cross_layer"):  # one block: 2 MiB however split
        assert got[name].block_bytes == 2 * MIB
    assert got["kv_split"].inner == (16, 8, 128)  # each half of vLLM's (2, blocks, ...)
    assert shape_of("per_layer", 512).block_bytes == 64 * MIB
    assert shape_of("mla", 512).block_bytes == 32 * 512 * 576 * 2
    with pytest.raises(InvalidArgument, match="unknown layout"):
        shape_of("paged", 16)


def test_a_run_moves_about_a_gib_each_way_within_the_pool_budget() -> None:
    assert blocks_per_run(2 * MIB, GIB, 2 * GIB) == 512
    assert blocks_per_run(16 * 576 * 2 * 32, GIB, 2 * GIB) == 1820  # MLA, 16 tokens
    assert blocks_per_run(2 * MIB, GIB, 256 * MIB) == 64  # a small /dev/shm: fewer
    assert blocks_per_run(64 * MIB, 32 * MIB, 2 * GIB) == 1  # a block over the run: one


def test_later_cases_get_fewer_repeats_when_the_budget_runs_short() -> None:
    assert repeats_within(100.0, 0.0, 5, 5) == 5  # nothing measured yet: all of them
    assert repeats_within(100.0, 1.0, 4, 5) == 5  # 4 cases x 6 rounds fit in 100 s
    assert repeats_within(20.0, 1.0, 4, 5) == 4  # 5 rounds each (warm-up included)
    assert repeats_within(9.0, 1.0, 4, 5) == 1
    assert repeats_within(5.0, 1.0, 4, 5) == 0  # not even warm-up and one round: skip
    assert repeats_within(-3.0, 1.0, 1, 5) == 0


def test_settings_from_the_command_line() -> None:
    s = settings()
    assert (s.tokens, s.layouts, s.repeats, s.bytes_per_run) == (
        (16, 64, 256, 512),
        LAYOUTS,
        5,
        GIB,
    )
    q = settings(quick=True)
    assert q.bytes_per_run == 64 * MIB and q.tokens == (16, 256) and q.pool_sizes == (256 * MIB,)
    mine = settings(tokens=" 16, 128", layouts="mla,per_layer", repeats=3, quick=True)
    assert (mine.tokens, mine.layouts, mine.repeats) == ((16, 128), ("mla", "per_layer"), 3)
    assert mine.bytes_per_run == 64 * MIB
    for bad in (
        {"tokens": "16,x"},
        {"tokens": "0"},
        {"tokens": ","},
        {"layouts": "paged"},
        {"repeats": 0},
    ):
        with pytest.raises(InvalidArgument):
            settings(**bad)  # type: ignore[arg-type]


def test_the_parser_takes_the_cuda_options() -> None:
    args = build_parser().parse_args(
        ["bench", "copy", "--device", "cuda", "--tokens", "16,64", "--layouts", "mla", "--quick"]
    )
    assert (args.device, args.tokens, args.layouts, args.quick) == ("cuda", "16,64", "mla", True)


@pytest.mark.parametrize("why", ["torch missing", "no GPU"])
def test_without_a_gpu_it_refuses_in_one_line(
    why: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if why == "torch missing":
        monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    else:
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "copy", "--device", "cuda", "--json", "--out", ""]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no JSON, no table: nothing ran
    (line,) = err.strip().splitlines()
    assert line.startswith("kvtier: error: bench copy --device cuda needs")
    assert ("not installed" if why == "torch missing" else "sees none") in line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tokens", "16,abc"], "--tokens"),
        (["--layouts", "paged"], "--layouts"),
        (["--block-bytes", "2MiB"], "--tokens"),
    ],
)
def test_bad_arguments_are_refused_before_the_gpu_is_looked_for(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["bench", "copy", "--device", "cuda", "--out", "", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line and "torch" not in line


def _row(**kw: Any) -> dict[str, Any]:
    return {"component": "copy", "device": "cuda", "gpu": "H100", **kw}


def _measured() -> dict[str, Any]:
    """A result as a run on an H100 makes it: each kind of row once."""
    copy = {
        "measure": "copy",
        "layout": "mla",
        "tokens_per_block": 16,
        "page_bytes": 18432,
        "direction": "h2d",
        "ceiling_gbps": 50.0,
    }
    return {
        "gpu": {
            "gpu": "NVIDIA H100",
            "driver": "580.1",
            "cuda": "13.0",
            "torch": "2.11",
            "pcie_gen_current": 5,
            "pcie_width_current": 16,
        },
        "kvtier_runtime": {"runtime": "libcudart.so.13", "runtime_version": 13000},
        "rows": [
            _row(measure="ceiling", direction="h2d", gbps=50.0),
            _row(
                **copy,
                contender="kvtier_batched",
                gbps=45.0,
                ratio_to_ceiling=0.9,
                ratio_to_torch_gather=1.5,
            ),
            _row(
                **copy,
                contender="torch_gather",
                gbps=30.0,
                ratio_to_ceiling=0.6,
                ratio_to_torch_gather=1.0,
            ),
            _row(
                measure="pool_setup",
                bytes=GIB,
                pool_create_s_per_gib=0.2,
                register_s_per_gib=0.1,
                torch_pinned_s_per_gib=0.3,
                ratio_to_torch_pinned=1.0,
            ),
            _row(measure="pool_setup", bytes=4 * GIB, skipped="/dev/shm has 64 MiB free"),
            _row(measure="copy", layout="mla", tokens_per_block=512, skipped="past the budget"),
            _row(
                measure="do_no_harm",
                contender="kvtier_batched",
                copy_gbps_meanwhile=40.0,
                step_ms_busy=0.41,
                step_ms_alone=0.4,
                slowdown=1.025,
            ),
        ],
        "seconds": 180.0,
    }


def test_the_table_shows_every_measurement() -> None:
    text = table(_measured())
    assert "NVIDIA H100" in text and "PCIe gen5 x16" in text and "libcudart.so.13" in text
    assert "ceiling  h2d: 50.0 GB/s" in text
    (line,) = [ln for ln in text.splitlines() if ln.lstrip().startswith("mla") and "KiB" in ln]
    assert "45.0 (0.90)" in line and "30.0 (0.60)" in line and line.endswith("1.50")
    assert "pool of 1024 MiB" in text and "skipped (/dev/shm has 64 MiB free)" in text
    assert "slowdown 1.025" in text
    assert "skipped: past the budget" in text


def test_the_plot_draws_each_contender_by_page_size_and_the_ceiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from kvtier.bench import plots

    drawn = []
    real_save = plots.save_figure
    monkeypatch.setattr(
        plots, "save_figure", lambda fig, path: (drawn.append(fig), real_save(fig, path))
    )
    plot(_measured(), tmp_path / "copy.png")
    assert (tmp_path / "copy.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = drawn
    loads = fig.axes[0]
    lines = {
        ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in loads.get_lines()
    }
    assert lines["kvtier, batched"] == ([18432], [45.0])
    assert lines["torch: gather + one copy"] == ([18432], [30.0])
    assert lines["contiguous pinned copy"][1] == [50.0, 50.0]
    assert loads.get_title() == "loads (host to GPU)"
    assert not fig.axes[1].get_lines()  # no store was measured (a skipped row is not drawn)
